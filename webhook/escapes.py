"""Ways out of the in-container limiter that a GPU pod's spec can ask for, found at admission. Pure, no I/O.

The limiter (HAMi-core, loaded into each process) enforces what its environment says. So a GPU pod must not be able
to set that environment itself (env entries are replaced in mutate.py; `envFrom` keys are unknown at admission, so
a GPU container's `envFrom` that could produce one is refused here), nor reach around the limiter: another process
namespace (`hostPID`, `SYS_PTRACE`), the host's IPC, mounts (`SYS_ADMIN`) or every device (`privileged`). Non-GPU
containers of a GPU pod are held to the same rules (they share the pod's network and, with `shareProcessNamespace`,
its processes). docs/security.md says what the limiter can and cannot protect beyond this.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Mapping
from typing import Any

from kube_vgpu.protocol import (
    ENV_LD_PRELOAD,
    ENV_LIMITER_OVERRIDES,
    ENV_MEMORY_LIMIT_PREFIX,
    ENV_NVIDIA_VISIBLE_DEVICES,
    ENV_SHARED_CACHE,
    ENV_SM_LIMIT,
)

#: Variables a GPU container's own `env` may not set (the webhook's and the device plugin's values must win): the
#: limiter's limits and off switches, its cache path, and the visible devices.
LIMITER_ENV_NAMES = frozenset(
    {
        *ENV_LIMITER_OVERRIDES,
        ENV_MEMORY_LIMIT_PREFIX.rstrip("_"),  # HAMi-core's un-indexed limit, for every device
        ENV_SHARED_CACHE,
        ENV_NVIDIA_VISIBLE_DEVICES,
    }
)
#: ... and whole families of them: every CUDA_DEVICE_MEMORY_LIMIT_<i> and CUDA_DEVICE_SM_LIMIT*.
LIMITER_ENV_PREFIXES = (ENV_MEMORY_LIMIT_PREFIX, ENV_SM_LIMIT)
#: An `envFrom` source's keys are unknown at admission, so it is held to more: LD_PRELOAD too, and every NVIDIA_*
#: variable (the NVIDIA container toolkit reads NVIDIA_VISIBLE_DEVICES, NVIDIA_MIG_CONFIG_DEVICES, ... to pick
#: devices).
_ENV_FROM_NAMES = LIMITER_ENV_NAMES | {ENV_LD_PRELOAD}
_ENV_FROM_PREFIXES = (*LIMITER_ENV_PREFIXES, "NVIDIA_")
#: Capabilities that reach around the limiter: SYS_ADMIN mounts over the library or /etc/ld.so.preload,
#: SYS_PTRACE rewrites a limited process's memory; ALL includes both.
ESCAPE_CAPABILITIES = frozenset({"SYS_ADMIN", "SYS_PTRACE", "ALL"})


def is_limiter_env_name(name: str) -> bool:
    """A name a GPU container's own `env` may not set (mutate.py drops the entry, with a warning)."""
    return name in LIMITER_ENV_NAMES or name.startswith(LIMITER_ENV_PREFIXES)


def env_from_prefix_is_safe(prefix: str) -> bool:
    """True when no key of the ConfigMap/Secret, whatever it is, can become a limiter variable under `prefix`: the
    prefix must not begin any limiter name (a key could complete it) nor lie inside a limiter family."""
    if any(name.startswith(prefix) for name in _ENV_FROM_NAMES):
        return False
    return not any(family.startswith(prefix) or prefix.startswith(family) for family in _ENV_FROM_PREFIXES)


def _containers(spec: Mapping[str, Any]) -> Iterator[tuple[str, Mapping[str, Any]]]:
    for key in ("initContainers", "containers", "ephemeralContainers"):
        for container in spec.get(key) or ():
            yield key, container


def _capabilities(container: Mapping[str, Any]) -> list[str]:
    capabilities = ((container.get("securityContext") or {}).get("capabilities") or {}).get("add") or ()
    found = []
    for capability in capabilities:
        name = str(capability).upper()
        name = name.removeprefix("CAP_")
        if name in ESCAPE_CAPABILITIES:
            found.append(str(capability))
    return found


def find_escape(spec: Mapping[str, Any], gpu_containers: Collection[tuple[str, str]]) -> str | None:
    """The first way out of the limiter this GPU pod's spec asks for, as a refusal message; None if there is none.
    `gpu_containers`: (spec key, name) of the containers with a vGPU request. Their `envFrom` could override the
    limiter (and the device plugin's env); a non-GPU container's cannot, as mutate.py pins its
    NVIDIA_VISIBLE_DEVICES to void in `env`, which wins over `envFrom`."""
    for field_name, why in (
        ("hostPID", "it could see and signal the processes of other pods on the node, including their GPU work"),
        ("hostIPC", "it would share the node's IPC namespace with other pods and the node"),
    ):
        if spec.get(field_name) is True:
            return f"GPU pods cannot set spec.{field_name}: {why}; remove it"
    for key, container in _containers(spec):
        name = str(container.get("name", "?"))
        where = f"container {name}"
        if ((container.get("securityContext") or {}).get("privileged")) is True:
            what = "use vGPUs" if (key, name) in gpu_containers else "run beside vGPUs in one pod"
            return (
                f"{where}: privileged containers cannot {what} (a privileged container sees every GPU on the node, "
                "so its limits cannot be enforced); remove securityContext.privileged"
            )
        escaping = _capabilities(container)
        if escaping:
            return (
                f"{where}: capabilities {', '.join(escaping)} are not allowed in a GPU pod (they can switch the GPU "
                "limiter off: SYS_ADMIN by mounting over it, SYS_PTRACE by rewriting a limited process); remove "
                "them from securityContext.capabilities.add"
            )
        if (key, name) not in gpu_containers:
            continue
        for index, source in enumerate(container.get("envFrom") or ()):
            prefix = source.get("prefix") or ""
            if not isinstance(prefix, str) or not env_from_prefix_is_safe(prefix):
                shown = f"prefix {prefix!r}" if prefix else "no prefix"
                return (
                    f"{where}: envFrom[{index}] has {shown}, so the ConfigMap or Secret could set GPU limiter "
                    "variables (CUDA_DISABLE_CONTROL, CUDA_DEVICE_MEMORY_LIMIT_*, NVIDIA_VISIBLE_DEVICES, "
                    "LD_PRELOAD, ...) that kube-vgpu cannot see at admission; give it a prefix such as 'APP_' that "
                    "no such variable starts with, or list the variables under env"
                )
    return None
