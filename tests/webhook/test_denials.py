"""The bad-input matrix: every row is refused with its exact message, HTTP 200 + allowed=false + status.code 400/403
(never a 5xx), in-process through `mutate.review` (the same function the HTTPS server calls; test_server.py runs
this same table over real HTTPS)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from kube_vgpu.webhook.config import WebhookConfig
from kube_vgpu.webhook.mutate import Result
from tests.webhook.builders import CORES, GPU, MEM, PCT, container, gpu_container, pod, run_review


@dataclass(frozen=True)
class Row:
    id: str
    pod: dict[str, Any]
    code: int
    message: str
    config: WebhookConfig = field(default_factory=WebhookConfig)
    operation: str = "CREATE"
    old: dict[str, Any] | None = None


ENVFROM_TAIL = (
    'so the ConfigMap or Secret could set GPU limiter variables (CUDA_DISABLE_CONTROL, CUDA_DEVICE_MEMORY'
    '_LIMIT_*, NVIDIA_VISIBLE_DEVICES, LD_PRELOAD, ...) that kube-vgpu cannot see at admission; give it a'
    " prefix such as 'APP_' that no such variable starts with, or list the variables under env"
)


def _with_annotations(annotations: dict[str, str], *containers: dict[str, Any]) -> dict[str, Any]:
    return pod(*containers, annotations=annotations)


def _gang_member(annotations: dict[str, str]) -> dict[str, Any]:
    member = pod(gpu_container(gpu="1"), annotations=annotations)
    member["metadata"]["labels"]["kueue.x-k8s.io/pod-group-name"] = "train-7"
    return member


ROWS = [
    # -- quantities: whole, non-negative numbers only
    Row(
        "gpu-fraction",
        pod(gpu_container(gpu="0.5")),
        400,
        "container trainer: nvidia.com/gpu must be a non-negative whole number, got '0.5'",
    ),
    Row(
        "gpucores-millis",
        pod(gpu_container(gpu="1", gpucores="500m")),
        400,
        "container trainer: nvidia.com/gpucores must be a non-negative whole number, got '500m'",
    ),
    Row(
        "gpumem-negative",
        pod(gpu_container(gpu="1", gpumem="-1024")),
        400,
        "container trainer: nvidia.com/gpumem must not be negative, got '-1024'",
    ),
    # -- gpumem counts MiB: a byte unit or a size no GPU has is a mistake, refused instead of Pending forever
    Row(
        "gpumem-binary-unit",
        pod(gpu_container(gpu="1", gpumem="8Gi")),
        400,
        "container trainer: nvidia.com/gpumem counts MiB, so it takes no Ki/Mi/Gi/Ti/Pi/Ei unit, got '8Gi'; for 8Gi "
        "write 8192",
    ),
    Row(
        "gpumem-larger-than-any-gpu",
        pod(gpu_container(gpu="1", gpumem="8G")),
        400,
        "container trainer: nvidia.com/gpumem must be at most 1048576 MiB (more than any GPU has; it counts MiB, not "
        "bytes), got 8000000000",
    ),
    Row(
        "quantity-5000-digits",
        pod(gpu_container(gpu="1", gpucores="1" * 5000)),
        400,
        "container trainer: nvidia.com/gpucores must be a non-negative whole number, "
        f"got {'1' * 80!r}... (5000 characters)",
    ),
    Row(
        "gpu-negative",
        pod(gpu_container(gpu="-1")),
        400,
        "container trainer: nvidia.com/gpu must not be negative, got '-1'",
    ),
    Row(
        "gpumem-garbage",
        pod(gpu_container(gpu="1", gpumem="lots")),
        400,
        "container trainer: nvidia.com/gpumem must be a non-negative whole number, got 'lots'",
    ),
    # -- ranges
    Row(
        "gpucores-150",
        pod(gpu_container(gpu="1", gpucores="150")),
        400,
        "container trainer: nvidia.com/gpucores must be between 0 and 100, got 150",
    ),
    Row(
        "gpumem-zero",
        pod(gpu_container(gpu="1", gpumem="0")),
        400,
        "container trainer: nvidia.com/gpumem must be greater than 0 MiB, got 0",
    ),
    Row(
        "gpumem-percentage-101",
        pod(gpu_container(gpu="1", gpumem_percentage="101")),
        400,
        "container trainer: nvidia.com/gpumem-percentage must be between 1 and 100, got 101",
    ),
    Row(
        "gpumem-and-percentage",
        pod(gpu_container(gpu="1", gpumem="4096", gpumem_percentage="50")),
        400,
        "container trainer: set either nvidia.com/gpumem or nvidia.com/gpumem-percentage, not both",
    ),
    Row(
        "zero-gpus-with-memory",
        pod(gpu_container(gpu="0", gpumem="4096")),
        400,
        "container trainer: nvidia.com/gpu is 0 but GPU memory or cores are requested",
    ),
    Row(
        "bad-value-in-requests-only",
        pod(container("trainer", limits={GPU: "1"}, requests={GPU: "1", CORES: "150"})),
        400,
        "container trainer: nvidia.com/gpucores must be between 0 and 100, got 150",
    ),
    Row(
        "bad-init-container",
        pod(container("app"), init_containers=[gpu_container("warmup", gpu="1", gpumem_percentage="200")]),
        400,
        "container warmup: nvidia.com/gpumem-percentage must be between 1 and 100, got 200",
    ),
    # -- count per pod
    Row(
        "gpu-count-above-default-max",
        pod(gpu_container(gpu="17")),
        403,
        "pod asks for 17 vGPUs (nvidia.com/gpu), more than the maximum of 16 per pod allowed in this cluster",
    ),
    Row(
        "gpu-count-above-configured-max-across-containers",
        pod(gpu_container("a", gpu="3"), gpu_container("b", gpu="2")),
        403,
        "pod asks for 5 vGPUs (nvidia.com/gpu), more than the maximum of 4 per pod allowed in this cluster",
        config=WebhookConfig(max_gpus_per_pod=4),
    ),
    Row(
        "gpu-count-above-configured-max-with-a-sidecar",
        pod(gpu_container("a", gpu="3"), init_containers=[gpu_container("side", gpu="2", restartPolicy="Always")]),
        403,
        "pod asks for 5 vGPUs (nvidia.com/gpu), more than the maximum of 4 per pod allowed in this cluster "
        "(native sidecars count with the containers they run beside)",
        config=WebhookConfig(max_gpus_per_pod=4),
    ),
    Row(
        "gpu-count-above-configured-max-sidecar-beside-a-later-init-container",
        pod(
            gpu_container("a", gpu="1"),
            init_containers=[gpu_container("side", gpu="1", restartPolicy="Always"), gpu_container("warm", gpu="4")],
        ),
        403,
        "pod asks for 5 vGPUs (nvidia.com/gpu), more than the maximum of 4 per pod allowed in this cluster "
        "(native sidecars count with the containers they run beside)",
        config=WebhookConfig(max_gpus_per_pod=4),
    ),
    # -- placement and isolation
    Row(
        "node-name-preset",
        pod(gpu_container(gpu="1", gpumem="4096"), nodeName="gpu-node-3"),
        403,
        "pod sets spec.nodeName='gpu-node-3', which skips GPU placement and limits; "
        "use a nodeSelector or node affinity instead",
    ),
    Row(
        "privileged-gpu-container",
        pod(gpu_container(gpu="1", gpumem="4096", securityContext={"privileged": True})),
        403,
        "container trainer: privileged containers cannot use vGPUs (a privileged container sees every GPU on the "
        "node, so its limits cannot be enforced); remove securityContext.privileged",
    ),
    Row(
        "privileged-gpu-init-container",
        pod(container("app"), init_containers=[gpu_container("warmup", gpu="1", securityContext={"privileged": True})]),
        403,
        "container warmup: privileged containers cannot use vGPUs (a privileged container sees every GPU on the "
        "node, so its limits cannot be enforced); remove securityContext.privileged",
    ),
    # -- ways around the limiter (issue 20 item 7)
    Row(
        "privileged-cpu-container-beside-vgpus",
        pod(gpu_container(gpu="1"), container("debug", securityContext={"privileged": True})),
        403,
        "container debug: privileged containers cannot run beside vGPUs in one pod (a privileged container sees every "
        "GPU on the node, so its limits cannot be enforced); remove securityContext.privileged",
    ),
    Row(
        "host-pid",
        pod(gpu_container(gpu="1"), hostPID=True),
        403,
        "GPU pods cannot set spec.hostPID: it could see and signal the processes of other pods on the node, including "
        "their GPU work; remove it",
    ),
    Row(
        "host-ipc",
        pod(gpu_container(gpu="1"), hostIPC=True),
        403,
        "GPU pods cannot set spec.hostIPC: it would share the node's IPC namespace with other pods and the node; "
        "remove it",
    ),
    *[
        Row(
            f"capability-{capability.lower()}-in-{where}",
            pod(gpu_container(gpu="1", securityContext={"capabilities": {"add": ["NET_ADMIN", capability]}}))
            if where == "gpu-container"
            else pod(gpu_container(gpu="1"),
                     container("tool", securityContext={"capabilities": {"add": [capability]}})),
            403,
            f"container {'trainer' if where == 'gpu-container' else 'tool'}: capabilities {capability} are not allowed "
            "in a GPU pod (they can switch the GPU limiter off: SYS_ADMIN by mounting over it, SYS_PTRACE by rewriting "
            "a limited process); remove them from securityContext.capabilities.add",
        )
        for capability in ("SYS_ADMIN", "SYS_PTRACE", "ALL", "CAP_SYS_ADMIN", "sys_ptrace")
        for where in ("gpu-container", "cpu-container")
    ],
    *[
        Row(
            f"env-from-{label}",
            pod(gpu_container(gpu="1", envFrom=[{"configMapRef": {"name": "settings"}, **extra}])),
            403,
            f"container trainer: envFrom[0] has {shown}, {ENVFROM_TAIL}",
        )
        for label, extra, shown in (
            ("no-prefix", {}, "no prefix"),
            ("empty-prefix", {"prefix": ""}, "no prefix"),
            ("cuda-prefix", {"prefix": "CUDA_"}, "prefix 'CUDA_'"),
            ("c-prefix", {"prefix": "C"}, "prefix 'C'"),
            ("nvidia-prefix", {"prefix": "NVIDIA_"}, "prefix 'NVIDIA_'"),
            ("in-memory-limit-family", {"prefix": "CUDA_DEVICE_MEMORY_LIMIT_0"}, "prefix 'CUDA_DEVICE_MEMORY_LIMIT_0'"),
            ("ld-prefix", {"prefix": "LD_"}, "prefix 'LD_'"),
            ("gpu-core-prefix", {"prefix": "GPU_CORE_"}, "prefix 'GPU_CORE_'"),
        )
    ],
    Row(
        "env-from-second-source-of-init-gpu-container",
        pod(container("app"), init_containers=[gpu_container(
            "warmup", gpu="1", envFrom=[{"prefix": "APP_", "secretRef": {"name": "a"}}, {"secretRef": {"name": "b"}}]
        )]),
        403,
        f"container warmup: envFrom[1] has no prefix, {ENVFROM_TAIL}",
    ),
    # -- internal annotations
    Row(
        "internal-annotation-on-gpu-pod",
        _with_annotations({"kube-vgpu.io/gpu-assignment": "{}"}, gpu_container(gpu="1")),
        403,
        "annotation kube-vgpu.io/gpu-assignment is written only by kube-vgpu; remove it from the pod",
    ),
    Row(
        "admission-mark-with-another-value",
        _with_annotations({"kube-vgpu.io/admitted": "v2"}, gpu_container(gpu="1")),
        403,
        "annotation kube-vgpu.io/admitted is written only by kube-vgpu; remove it from the pod",
    ),
    Row(
        "internal-annotations-on-cpu-pod",
        _with_annotations({"kube-vgpu.io/gpu-allocation": "{}", "kube-vgpu.io/gpu-assignment": "{}"}),
        403,
        "annotations kube-vgpu.io/gpu-allocation, kube-vgpu.io/gpu-assignment are written only by kube-vgpu; "
        "remove them from the pod",
    ),
    Row(
        "update-adds-internal-annotation",
        _with_annotations({"kube-vgpu.io/gpu-assignment": '{"v":1}'}, gpu_container(gpu="1")),
        403,
        "annotation kube-vgpu.io/gpu-assignment is written only by kube-vgpu and cannot be added, changed or removed",
        operation="UPDATE",
        old=pod(gpu_container(gpu="1")),
    ),
    Row(
        "update-changes-internal-annotation",
        _with_annotations({"kube-vgpu.io/gpu-assignment": '{"v":2}'}, gpu_container(gpu="1")),
        403,
        "annotation kube-vgpu.io/gpu-assignment is written only by kube-vgpu and cannot be added, changed or removed",
        operation="UPDATE",
        old=_with_annotations({"kube-vgpu.io/gpu-assignment": '{"v":1}'}, gpu_container(gpu="1")),
    ),
    Row(
        "update-removes-internal-annotation",
        _with_annotations({"team": "a"}, gpu_container(gpu="1")),
        403,
        "annotation kube-vgpu.io/gpu-bind-time is written only by kube-vgpu and cannot be added, changed or removed",
        operation="UPDATE",
        old=_with_annotations({"team": "a", "kube-vgpu.io/gpu-bind-time": "2026-01-01T00:00:00Z"}, gpu_container()),
    ),
    # -- gang declarations: refused at admission, not left Pending with the same message
    Row(
        "gang-without-count",
        _gang_member({}),
        400,
        "invalid gang: pod has the label kueue.x-k8s.io/pod-group-name=train-7 but no annotation "
        "kueue.x-k8s.io/pod-group-total-count (the number of pods in the group)",
    ),
    Row(
        "gang-count-not-a-number",
        _gang_member({"kueue.x-k8s.io/pod-group-total-count": "four"}),
        400,
        "invalid gang: annotation kueue.x-k8s.io/pod-group-total-count must be a whole number from 1 to 4096, "
        "got 'four'",
    ),
    Row(
        "gang-timeout-too-short",
        _gang_member({"kueue.x-k8s.io/pod-group-total-count": "4", "gang.kube-vgpu.io/timeout-seconds": "1"}),
        400,
        "invalid gang: annotation gang.kube-vgpu.io/timeout-seconds must be a number of seconds from 10 to 86400, "
        "got '1'",
    ),
]


@pytest.mark.parametrize("row", ROWS, ids=[row.id for row in ROWS])
def test_bad_input_is_denied_with_its_message(row: Row) -> None:
    outcome, response = run_review(row.pod, row.config, operation=row.operation, old=row.old)
    assert outcome.http_status == 200
    assert outcome.result is Result.DENIED
    assert response["allowed"] is False
    assert response["status"] == {
        "status": "Failure",
        "code": row.code,
        "reason": "Forbidden" if row.code == 403 else "BadRequest",
        "message": row.message,
    }
    assert "patch" not in response


def test_every_rule_of_the_issue_has_a_row() -> None:
    messages = " | ".join(row.message for row in ROWS)
    for fragment in (
        "whole number",  # non-integer
        "must not be negative",
        f"{CORES} must be between 0 and 100",
        f"{MEM} must be greater than 0",
        f"{MEM} counts MiB, so it takes no Ki/Mi/Gi/Ti/Pi/Ei unit",
        f"{MEM} must be at most 1048576 MiB",
        f"{PCT} must be between 1 and 100",
        "not both",
        "more than the maximum",
        "spec.nodeName",
        "privileged",
        "written only by kube-vgpu",
    ):
        assert fragment in messages, fragment


def test_components_may_write_internal_annotations() -> None:
    """The extender (bind) and device plugin (Allocate) write them; their service accounts are trusted."""
    old = pod(gpu_container(gpu="1"))
    new = _with_annotations({"kube-vgpu.io/gpu-assignment": '{"v":1}'}, gpu_container(gpu="1"))
    for username in (
        "system:serviceaccount:kube-vgpu:kube-vgpu-extender",
        "system:serviceaccount:kube-vgpu:kube-vgpu-device-plugin",
    ):
        outcome, response = run_review(new, operation="UPDATE", old=old, username=username)
        assert (outcome.result, response["allowed"]) == (Result.ALLOWED, True)
    config = WebhookConfig(trusted_usernames=frozenset({"system:admin"}))
    outcome, _ = run_review(new, config, operation="UPDATE", old=old, username="system:admin")
    assert outcome.result is Result.ALLOWED
    outcome, _ = run_review(new, config, operation="UPDATE", old=old, username="system:serviceaccount:x:y")
    assert outcome.result is Result.DENIED


def test_update_that_keeps_internal_annotations_is_allowed() -> None:
    """kubectl label / apply on a bound pod resends the annotations unchanged: fine."""
    annotations = {"kube-vgpu.io/gpu-assignment": '{"v":1}'}
    old = _with_annotations(annotations, gpu_container(gpu="1"))
    new = _with_annotations({**annotations, "note": "hello"}, gpu_container(gpu="1"))
    outcome, response = run_review(new, operation="UPDATE", old=old)
    assert (outcome.result, response["allowed"], "patch" in response) == (Result.ALLOWED, True, False)


def test_update_never_mutates_even_a_gpu_pod() -> None:
    gpu_pod = pod(gpu_container(gpu="1", gpumem="1024"))
    outcome, response = run_review(gpu_pod, operation="UPDATE", old=gpu_pod)
    assert outcome.result is Result.ALLOWED
    assert "patch" not in response


def test_the_vgpu_cap_counts_the_pods_peak() -> None:
    """Init containers run one at a time (their largest counts, not their sum); a native sidecar runs beside the app
    containers and every later init container, so it counts with them."""
    config = WebhookConfig(max_gpus_per_pod=4)
    ordinary = pod(
        gpu_container("a", gpu="3"), init_containers=[gpu_container("w1", gpu="4"), gpu_container("w2", gpu="4")]
    )
    assert run_review(ordinary, config)[0].result is Result.MUTATED
    sidecar_after = pod(
        gpu_container("a", gpu="3"),
        init_containers=[gpu_container("warm", gpu="4"), gpu_container("side", gpu="1", restartPolicy="Always")],
    )
    assert run_review(sidecar_after, config)[0].result is Result.MUTATED  # warm-up ends before the sidecar starts
    sidecar_over = pod(
        gpu_container("a", gpu="4"), init_containers=[gpu_container("side", gpu="1", restartPolicy="Always")]
    )
    assert run_review(sidecar_over, config)[0].result is Result.DENIED
