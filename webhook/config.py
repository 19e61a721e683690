"""Settings of the admission webhook: what it injects and what it refuses. Plain data, no I/O."""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum

from kube_vgpu.protocol import (
    DEFAULT_LIMITER_LD_SO_PRELOAD_PATH,
    DEFAULT_LIMITER_LIBRARY_PATH,
    DEFAULT_SCHEDULER_NAME,
    LABEL_LIMITER,
)

#: The service accounts of the components that write kube-vgpu's internal pod annotations, as named in manifests/:
#: the extender (assignment and bind time, at bind) and the device plugin (allocation, in Allocate).
DEFAULT_EXTENDER_USERNAME = "system:serviceaccount:kube-vgpu:kube-vgpu-extender"
DEFAULT_DEVICE_PLUGIN_USERNAME = "system:serviceaccount:kube-vgpu:kube-vgpu-device-plugin"
DEFAULT_TRUSTED_USERNAMES = frozenset({DEFAULT_EXTENDER_USERNAME, DEFAULT_DEVICE_PLUGIN_USERNAME})
#: Default cap on vGPUs per pod: 16 covers every single node on the market (8 GPUs x 2 sharing containers) while
#: stopping typos like `nvidia.com/gpu: 100` that would stay Pending forever.
DEFAULT_MAX_GPUS_PER_POD = 16
#: Directory (an emptyDir the webhook adds) holding each GPU container's limiter cache file.
DEFAULT_CACHE_DIR = "/run/kube-vgpu"


class LimiterMode(StrEnum):
    """How the in-container limiter library gets loaded into every process of a GPU container."""

    #: LD_PRELOAD env + the library mounted read-only. Works everywhere, but a process that clears LD_PRELOAD
    #: (or a static binary) escapes the limits.
    LD_PRELOAD = "ld-preload"
    #: The node's ld.so.preload file mounted at /etc/ld.so.preload (+ the library): every dynamically linked
    #: process loads the limiter whatever its environment. Needs that file on every GPU node.
    LD_SO_PRELOAD = "ld-so-preload"
    #: LD_PRELOAD env, and the device plugin mounts the library (its Allocate answer, --limiter-library; plus
    #: /etc/ld.so.preload with --ld-so-preload): no hostPath in the pod spec, so GPU namespaces can enforce Pod
    #: Security `baseline`. The device plugin refuses a shared GPU on a node without the library.
    DEVICE_PLUGIN = "device-plugin"
    #: The cluster provides the limiter another way (e.g. a runtime hook); only the env vars are set.
    NONE = "none"


@dataclass(frozen=True, slots=True)
class WebhookConfig:
    scheduler_name: str = DEFAULT_SCHEDULER_NAME
    max_gpus_per_pod: int = DEFAULT_MAX_GPUS_PER_POD
    limiter_mode: LimiterMode = LimiterMode.LD_PRELOAD
    #: Path of the limiter library on the node; mounted at the same path in the container.
    limiter_library_path: str = DEFAULT_LIMITER_LIBRARY_PATH
    #: Path on the node of the file listing the library (LD_SO_PRELOAD mode only).
    limiter_ld_so_preload_path: str = DEFAULT_LIMITER_LD_SO_PRELOAD_PATH
    #: Node label present where the device plugin found the installed limiter intact: pods that load the limiter
    #: from the node require it (node affinity), so none lands where the library is missing ("" = no affinity).
    limiter_node_label: str = LABEL_LIMITER
    cache_dir: str = DEFAULT_CACHE_DIR
    #: Users (AdmissionReview userInfo.username) allowed to write kube-vgpu's internal pod annotations.
    trusted_usernames: frozenset[str] = DEFAULT_TRUSTED_USERNAMES

    def __post_init__(self) -> None:
        if self.max_gpus_per_pod < 1:
            raise ValueError(f"max_gpus_per_pod must be at least 1, got {self.max_gpus_per_pod}")
        for name in ("limiter_library_path", "limiter_ld_so_preload_path", "cache_dir"):
            if not getattr(self, name).startswith("/"):
                raise ValueError(f"{name} must be an absolute path, got {getattr(self, name)!r}")
        if not self.scheduler_name:
            raise ValueError("scheduler_name must not be empty")


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    """What one client can hold of the server (webhook/connections.py enforces them; why, there)."""

    #: open connections, TLS handshakes included; 200 x 0.27 MiB stays far inside the 256Mi memory limit, and two
    #: replicas serve 400 API server connections (it keeps a few per replica)
    max_connections: int = 200
    #: accept (TLS handshake included) to a complete request head; the API server sends one in milliseconds
    header_timeout_s: float = 10.0
    #: end of a response to the next complete request head (the API server keeps connections for reuse)
    idle_timeout_s: float = 30.0
    #: a request head to its whole body (a slow body holds a request slot and up to 8 MiB)
    body_timeout_s: float = 10.0
    #: requests reading their body or being reviewed at once; more wait (within body_timeout_s) for a slot
    max_concurrent_requests: int = 8

    def __post_init__(self) -> None:
        for name in ("max_connections", "max_concurrent_requests"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("header_timeout_s", "idle_timeout_s", "body_timeout_s"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a positive number of seconds, got {value}")
