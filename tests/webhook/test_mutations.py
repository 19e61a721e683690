"""Good cases: the RFC 6902 patch, applied with the `jsonpatch` library to the pod exactly as sent, gives exactly the
expected pod; a second review of the result (reinvocationPolicy: IfNeeded) changes nothing."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from kube_vgpu.webhook.config import LimiterMode, WebhookConfig
from kube_vgpu.webhook.mutate import Result
from tests.webhook.builders import (
    CORES,
    GPU,
    LIB,
    MEM,
    PCT,
    apply_response,
    container,
    gpu_container,
    patch_ops,
    pod,
    run_review,
)

# Written out here, not imported from the code under test.
SCHEDULER = "kube-vgpu-scheduler"
CACHE_MOUNT = {"name": "kube-vgpu-cache", "mountPath": "/run/kube-vgpu"}
LIB_MOUNT = {"name": "kube-vgpu-limiter", "mountPath": LIB, "readOnly": True}
PRELOAD_MOUNT = {"name": "kube-vgpu-ld-so-preload", "mountPath": "/etc/ld.so.preload", "readOnly": True}
CACHE_VOLUME = {"name": "kube-vgpu-cache", "emptyDir": {}}
LIB_VOLUME = {"name": "kube-vgpu-limiter", "hostPath": {"path": LIB, "type": "File"}}
PRELOAD_VOLUME = {
    "name": "kube-vgpu-ld-so-preload",
    "hostPath": {"path": "/usr/local/vgpu/ld.so.preload", "type": "File"},
}
LD_PRELOAD = {"name": "LD_PRELOAD", "value": LIB}
ADMITTED = "kube-vgpu.io/admitted"
NO_DEVICES = {"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"}
LIMITER_LABEL = "kube-vgpu.io/limiter"
#: only on nodes where the device plugin found the installed limiter intact (every limiter mode but none)
LIMITER_AFFINITY = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
    "nodeSelectorTerms": [{"matchExpressions": [{"key": LIMITER_LABEL, "operator": "Exists"}]}]}}}


def env(name: str, value: str) -> dict[str, str]:
    return {"name": name, "value": value}


def sm(percent: int) -> dict[str, str]:
    return env("CUDA_DEVICE_SM_LIMIT", str(percent))


def mem(index: int, mib: int) -> dict[str, str]:
    return env(f"CUDA_DEVICE_MEMORY_LIMIT_{index}", f"{mib}m")


def cache(name: str) -> dict[str, str]:
    return env("CUDA_DEVICE_MEMORY_SHARED_CACHE", f"/run/kube-vgpu/{name}.cache")


def _memory_1024_ld_preload(expected: dict[str, Any]) -> None:
    spec = expected["spec"]
    spec["schedulerName"] = SCHEDULER
    c = spec["containers"][0]
    c["env"] = [sm(0), mem(0, 1024), cache("trainer"), LD_PRELOAD]
    c["volumeMounts"] = [CACHE_MOUNT, LIB_MOUNT]
    spec["volumes"] = [CACHE_VOLUME, LIB_VOLUME]


def _device_plugin_mode(expected: dict[str, Any]) -> None:
    """LD_PRELOAD in the env, the library mounted by the device plugin: no hostPath anywhere in the pod."""
    spec = expected["spec"]
    spec["schedulerName"] = SCHEDULER
    c = spec["containers"][0]
    c["env"] = [sm(0), mem(0, 1024), cache("trainer"), LD_PRELOAD]
    c["volumeMounts"] = [CACHE_MOUNT]
    spec["volumes"] = [CACHE_VOLUME]


def _cpu_container_gets_no_devices(expected: dict[str, Any]) -> None:
    _memory_1024_ld_preload(expected)
    expected["spec"]["containers"][1]["env"] = [{"name": "A", "value": "1"}, NO_DEVICES]


@dataclass(frozen=True)
class Case:
    id: str
    pod: dict[str, Any]
    edit: Callable[[dict[str, Any]], None]  # turns a copy of `pod` into the expected pod
    warnings: list[str] = field(default_factory=list)
    config: WebhookConfig = field(default_factory=WebhookConfig)


def _two_gpus_memory_and_cores(expected: dict[str, Any]) -> None:
    spec = expected["spec"]
    spec["schedulerName"] = SCHEDULER
    spec["containers"][0]["env"] = [
        env("EPOCHS", "3"),
        sm(30),
        mem(0, 20000),
        mem(1, 20000),
        cache("trainer"),
        LD_PRELOAD,
    ]
    spec["containers"][0]["volumeMounts"] = [CACHE_MOUNT, LIB_MOUNT]
    spec["volumes"] = [CACHE_VOLUME, LIB_VOLUME]


def _memory_only(expected: dict[str, Any]) -> None:
    spec = expected["spec"]
    spec["schedulerName"] = SCHEDULER
    c = spec["containers"][0]
    c["resources"]["limits"] = {"cpu": "2", "memory": "8Gi", MEM: "4096", GPU: "1"}
    c["resources"]["requests"] = {GPU: "1", MEM: "4096"}  # created: it was absent
    c["env"] = [sm(0), mem(0, 4096), cache("trainer"), LD_PRELOAD]
    c["volumeMounts"] = [CACHE_MOUNT, LIB_MOUNT]
    spec["volumes"] = [CACHE_VOLUME, LIB_VOLUME]


def _cores_only_no_resources_requests(expected: dict[str, Any]) -> None:
    spec = expected["spec"]
    spec["schedulerName"] = SCHEDULER
    c = spec["containers"][0]
    c["resources"]["limits"][GPU] = "1"
    c["resources"]["requests"] = {"cpu": "1", CORES: "25", GPU: "1"}
    c["env"] = [sm(25), cache("trainer"), LD_PRELOAD]
    c["volumeMounts"] = [CACHE_MOUNT, LIB_MOUNT]
    spec["volumes"] = [CACHE_VOLUME, LIB_VOLUME]


def _requests_follow_limits(expected: dict[str, Any]) -> None:
    spec = expected["spec"]
    spec["schedulerName"] = SCHEDULER
    c = spec["containers"][0]
    c["resources"]["requests"] = {GPU: "2", MEM: "8000", "cpu": "1"}
    c["resources"]["limits"] = {GPU: "2", MEM: "8000"}
    c["env"] = [sm(0), mem(0, 8000), mem(1, 8000), cache("trainer"), LD_PRELOAD]
    c["volumeMounts"] = [CACHE_MOUNT, LIB_MOUNT]
    spec["volumes"] = [CACHE_VOLUME, LIB_VOLUME]


def _requests_only(expected: dict[str, Any]) -> None:
    spec = expected["spec"]
    spec["schedulerName"] = SCHEDULER
    c = spec["containers"][0]
    c["resources"]["limits"] = {GPU: "1", MEM: "2048"}
    c["env"] = [sm(0), mem(0, 2048), cache("trainer"), LD_PRELOAD]
    c["volumeMounts"] = [CACHE_MOUNT, LIB_MOUNT]
    spec["volumes"] = [CACHE_VOLUME, LIB_VOLUME]


def _percentage(expected: dict[str, Any]) -> None:
    spec = expected["spec"]
    spec["schedulerName"] = SCHEDULER
    c = spec["containers"][0]
    c["env"] = [sm(50), cache("trainer"), LD_PRELOAD]  # no memory env: the device plugin knows the GPU size
    c["volumeMounts"] = [CACHE_MOUNT, LIB_MOUNT]
    spec["volumes"] = [CACHE_VOLUME, LIB_VOLUME]


def _user_env_overridden(expected: dict[str, Any]) -> None:
    spec = expected["spec"]
    spec["schedulerName"] = SCHEDULER
    c = spec["containers"][0]
    c["env"] = [
        env("A", "1"),
        sm(20),  # was 100, in place
        mem(0, 1000),  # was 99999m, in place
        env("B", "2"),
        env("LD_PRELOAD", f"{LIB}:/opt/tracing.so"),  # ours first, theirs kept
        cache("trainer"),
    ]
    c["volumeMounts"] = [CACHE_MOUNT, LIB_MOUNT]
    spec["volumes"] = [CACHE_VOLUME, LIB_VOLUME]


def _foreign_scheduler(expected: dict[str, Any]) -> None:
    spec = expected["spec"]
    c = spec["containers"][0]
    c["env"] = [sm(0), mem(0, 1024), cache("trainer"), LD_PRELOAD]
    c["volumeMounts"] = [CACHE_MOUNT, LIB_MOUNT]
    spec["volumes"] = [CACHE_VOLUME, LIB_VOLUME]


def _init_container_only(expected: dict[str, Any]) -> None:
    spec = expected["spec"]
    spec["schedulerName"] = SCHEDULER
    w = spec["initContainers"][0]
    w["env"] = [sm(10), mem(0, 512), cache("warmup"), LD_PRELOAD]
    w["volumeMounts"] = [CACHE_MOUNT, LIB_MOUNT]
    spec["volumes"] = [CACHE_VOLUME, LIB_VOLUME]
    # the app container and the CPU sidecar asked for no GPU: they get none, whatever their image's env says
    for c in spec["containers"]:
        c["env"] = [NO_DEVICES]


def _existing_volumes_and_mounts(expected: dict[str, Any]) -> None:
    spec = expected["spec"]
    spec["schedulerName"] = SCHEDULER
    c = spec["containers"][0]
    c["env"] = [sm(0), mem(0, 1024), cache("trainer"), LD_PRELOAD]
    c["volumeMounts"] = [{"name": "data", "mountPath": "/data"}, CACHE_MOUNT, LIB_MOUNT]
    spec["volumes"] = [{"name": "data", "emptyDir": {}}, CACHE_VOLUME, LIB_VOLUME]


def _ld_so_preload_mode(expected: dict[str, Any]) -> None:
    spec = expected["spec"]
    spec["schedulerName"] = SCHEDULER
    c = spec["containers"][0]
    c["env"] = [sm(0), mem(0, 1024), cache("trainer")]  # no LD_PRELOAD: /etc/ld.so.preload does it
    c["volumeMounts"] = [CACHE_MOUNT, LIB_MOUNT, PRELOAD_MOUNT]
    spec["volumes"] = [CACHE_VOLUME, LIB_VOLUME, PRELOAD_VOLUME]


def _limiter_disabled(expected: dict[str, Any]) -> None:
    spec = expected["spec"]
    spec["schedulerName"] = "team-scheduler"  # configured name
    c = spec["containers"][0]
    c["env"] = [sm(0), mem(0, 1024), env("CUDA_DEVICE_MEMORY_SHARED_CACHE", "/var/cache/vgpu/trainer.cache")]
    c["volumeMounts"] = [{"name": "kube-vgpu-cache", "mountPath": "/var/cache/vgpu"}]
    spec["volumes"] = [CACHE_VOLUME]


def _tampering_replaced(expected: dict[str, Any]) -> None:
    spec = expected["spec"]
    spec["schedulerName"] = SCHEDULER
    c = spec["containers"][0]
    c["env"] = [sm(0), mem(0, 1024), cache("trainer")]
    # the pod's own mount at /etc/ld.so.preload (an empty file would switch the limiter off) is gone
    c["volumeMounts"] = [{"name": "data", "mountPath": "/data"}, CACHE_MOUNT, LIB_MOUNT, PRELOAD_MOUNT]
    spec["volumes"] = [
        {"name": "data", "emptyDir": {}},
        LIB_VOLUME,  # replaced in place: the pod's "kube-vgpu-limiter" pointed at a fake library
        {"name": "empty", "configMap": {"name": "empty"}},
        CACHE_VOLUME,
        PRELOAD_VOLUME,
    ]


def _no_scheduler_name(expected: dict[str, Any]) -> None:
    spec = expected["spec"]
    spec["schedulerName"] = SCHEDULER  # added: the pod as sent had none
    c = spec["containers"][0]
    c["env"] = [sm(0), mem(0, 1024), cache("trainer"), LD_PRELOAD]
    c["volumeMounts"] = [CACHE_MOUNT, LIB_MOUNT]
    spec["volumes"] = [CACHE_VOLUME, LIB_VOLUME]


def _pod_without_scheduler_name() -> dict[str, Any]:
    sent = pod(gpu_container(gpu="1", gpumem="1024"))
    del sent["spec"]["schedulerName"]
    return sent


CASES = [
    Case(
        "two-gpus-memory-and-cores",
        pod(gpu_container(gpu="2", gpumem="20000", gpucores="30", env=[env("EPOCHS", "3")])),
        _two_gpus_memory_and_cores,
    ),
    Case(
        "memory-only-adds-gpu-1",
        pod(container("trainer", limits={"cpu": "2", "memory": "8Gi", MEM: "4096"})),
        _memory_only,
    ),
    Case(
        "cores-only-adds-gpu-1",
        pod(container("trainer", limits={CORES: "25"}, requests={"cpu": "1", CORES: "25"})),
        _cores_only_no_resources_requests,
    ),
    Case(
        "requests-made-equal-to-limits",
        pod(container("trainer", limits={GPU: "2", MEM: "8000"}, requests={GPU: "1", MEM: "1000", "cpu": "1"})),
        _requests_follow_limits,
    ),
    Case(
        "requests-only-creates-limits",
        pod(container("trainer", requests={GPU: "1", MEM: "2048"})),
        _requests_only,
    ),
    Case(
        "percentage-memory-leaves-memory-to-device-plugin",
        pod(gpu_container(gpu="1", gpumem_percentage="50", gpucores="50")),
        _percentage,
    ),
    Case(
        "user-limit-env-overridden",
        pod(
            gpu_container(
                gpu="1",
                gpumem="1000",
                gpucores="20",
                env=[
                    env("A", "1"),
                    env("CUDA_DEVICE_SM_LIMIT", "100"),
                    env("CUDA_DEVICE_MEMORY_LIMIT_0", "99999m"),
                    env("CUDA_DEVICE_MEMORY_LIMIT_1", "99999m"),  # a second GPU it does not have
                    env("CUDA_DEVICE_MEMORY_LIMIT", "99999m"),
                    env("NVIDIA_VISIBLE_DEVICES", "all"),
                    env("CUDA_DISABLE_CONTROL", "true"),
                    {
                        "name": "GPU_CORE_UTILIZATION_POLICY",
                        "valueFrom": {"configMapKeyRef": {"name": "x", "key": "y"}},
                    },
                    env("B", "2"),
                    env("CUDA_DEVICE_SM_LIMIT", "90"),  # duplicate: the later one would win in the container
                    env("LD_PRELOAD", "/opt/tracing.so"),
                ],
            )
        ),
        _user_env_overridden,
        warnings=[
            "container trainer: env CUDA_DEVICE_SM_LIMIT, CUDA_DEVICE_MEMORY_LIMIT_0, CUDA_DEVICE_MEMORY_LIMIT_1, "
            "CUDA_DEVICE_MEMORY_LIMIT, NVIDIA_VISIBLE_DEVICES, CUDA_DISABLE_CONTROL, GPU_CORE_UTILIZATION_POLICY, "
            "LD_PRELOAD set by the pod was overridden; kube-vgpu sets GPU limits from the container's resources"
        ],
    ),
    Case(
        "foreign-scheduler-left-alone",
        pod(gpu_container(gpu="1", gpumem="1024"), schedulerName="volcano"),
        _foreign_scheduler,
        warnings=[
            "pod names scheduler 'volcano', so kube-vgpu left spec.schedulerName alone: its GPUs are not placed by "
            "kube-vgpu-scheduler"
        ],
    ),
    Case(
        "init-container-only",
        pod(
            container("app", limits={"cpu": "1"}),
            container("sidecar", limits={GPU: "0"}),
            init_containers=[gpu_container("warmup", gpu="1", gpumem="512", gpucores="10")],
        ),
        _init_container_only,
    ),
    Case(
        "existing-volumes-and-mounts-appended",
        pod(
            gpu_container(gpu="1", gpumem="1024", volumeMounts=[{"name": "data", "mountPath": "/data"}]),
            volumes=[{"name": "data", "emptyDir": {}}],
        ),
        _existing_volumes_and_mounts,
    ),
    Case(
        "ld-so-preload-mode",
        pod(gpu_container(gpu="1", gpumem="1024")),
        _ld_so_preload_mode,
        config=WebhookConfig(limiter_mode=LimiterMode.LD_SO_PRELOAD),
    ),
    Case(
        "limiter-disabled-and-other-names",
        pod(gpu_container(gpu="1", gpumem="1024")),
        _limiter_disabled,
        config=WebhookConfig(
            limiter_mode=LimiterMode.NONE, scheduler_name="team-scheduler", cache_dir="/var/cache/vgpu"
        ),
    ),
    Case(
        "tampering-with-limiter-volumes-replaced",
        pod(
            gpu_container(
                gpu="1",
                gpumem="1024",
                volumeMounts=[
                    {"name": "data", "mountPath": "/data"},
                    {"name": "empty", "mountPath": "/etc/ld.so.preload", "subPath": "empty"},
                ],
            ),
            volumes=[
                {"name": "data", "emptyDir": {}},
                {"name": "kube-vgpu-limiter", "hostPath": {"path": "/tmp/fake.so", "type": "File"}},
                {"name": "empty", "configMap": {"name": "empty"}},
            ],
        ),
        _tampering_replaced,
        warnings=[
            "container trainer: volume mounts at /etc/ld.so.preload were replaced by kube-vgpu's own",
            "volume kube-vgpu-limiter was replaced: the name is reserved for kube-vgpu",
        ],
        config=WebhookConfig(limiter_mode=LimiterMode.LD_SO_PRELOAD),
    ),
    Case("no-scheduler-name-in-pod", _pod_without_scheduler_name(), _no_scheduler_name),
    Case(
        "device-plugin-mode-no-host-path",
        pod(gpu_container(gpu="1", gpumem="1024")),
        _device_plugin_mode,
        config=WebhookConfig(limiter_mode=LimiterMode.DEVICE_PLUGIN),
    ),
    Case(
        "cpu-container-asking-for-all-gpus-gets-none",
        pod(
            gpu_container(gpu="1", gpumem="1024"),
            container("exporter", env=[env("NVIDIA_VISIBLE_DEVICES", "all"), env("A", "1")]),
        ),
        _cpu_container_gets_no_devices,
        warnings=[
            "container exporter: env NVIDIA_VISIBLE_DEVICES set by the pod was replaced by 'void': a container that "
            "asks for no vGPU gets no GPU"
        ],
    ),
    Case(
        "env-from-with-a-safe-prefix-is-kept",
        pod(gpu_container(gpu="1", gpumem="1024", envFrom=[{"prefix": "APP_", "configMapRef": {"name": "settings"}}])),
        _memory_1024_ld_preload,
    ),
    Case(
        "mark-already-present-from-an-earlier-pass",
        pod(gpu_container(gpu="1", gpumem="1024"), annotations={ADMITTED: "v1", "team": "a"}),
        _memory_1024_ld_preload,
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_patch_gives_exactly_the_expected_pod(case: Case) -> None:
    outcome, response = run_review(case.pod, case.config)
    assert (outcome.http_status, outcome.result, response["allowed"]) == (200, Result.MUTATED, True)
    expected = copy.deepcopy(case.pod)
    case.edit(expected)
    if case.config.limiter_mode is not LimiterMode.NONE:
        expected["spec"]["affinity"] = LIMITER_AFFINITY
    # every GPU pod the webhook admits carries its mark (the extender and device plugin refuse pods without it)
    expected.setdefault("metadata", {}).setdefault("annotations", {})[ADMITTED] = "v1"
    assert apply_response(case.pod, response) == expected
    assert response.get("warnings", []) == case.warnings


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_reinvocation_on_the_mutated_pod_changes_nothing(case: Case) -> None:
    """reinvocationPolicy: IfNeeded sends our own output back; it must come back unchanged and without new
    warnings (the foreign-scheduler warning is about the pod, so it stays)."""
    _, response = run_review(case.pod, case.config)
    mutated = apply_response(case.pod, response)
    outcome, again = run_review(mutated, case.config)
    assert outcome.result is Result.ALLOWED
    assert patch_ops(again) == []
    assert again.get("warnings", []) == [w for w in case.warnings if "scheduler" in w]


def test_reinvocation_after_another_webhook_restores_only_what_is_missing() -> None:
    _, response = run_review(pod(gpu_container(gpu="1", gpumem="1024")))
    mutated = apply_response(pod(gpu_container(gpu="1", gpumem="1024")), response)
    # another webhook injects a sidecar-ish env var and drops our LD_PRELOAD
    mutated["spec"]["containers"][0]["env"] = [
        e for e in mutated["spec"]["containers"][0]["env"] if e["name"] != "LD_PRELOAD"
    ]
    mutated["spec"]["containers"][0]["env"].append(env("OTEL", "on"))
    _, again = run_review(mutated)
    assert patch_ops(again) == [
        {
            "op": "replace",
            "path": "/spec/containers/0/env",
            "value": [sm(0), mem(0, 1024), cache("trainer"), env("OTEL", "on"), LD_PRELOAD],
        }
    ]


def test_resource_names_are_escaped_in_json_pointers() -> None:
    """nvidia.com/gpu must appear as nvidia.com~1gpu, or the patch would address /limits/nvidia.com/gpu."""
    _, response = run_review(pod(container("trainer", limits={MEM: "4096"}, requests={MEM: "4096"})))
    paths = [op["path"] for op in patch_ops(response)]
    assert "/spec/containers/0/resources/limits/nvidia.com~1gpu" in paths
    assert "/spec/containers/0/resources/requests/nvidia.com~1gpu" in paths


def test_pct_and_cores_values_are_kept_as_sent() -> None:
    sent = pod(container("t", limits={GPU: "1", PCT: "25", CORES: "40"}))
    _, response = run_review(sent)
    result = apply_response(sent, response)
    assert result["spec"]["containers"][0]["resources"]["requests"] == {GPU: "1", PCT: "25", CORES: "40"}


@pytest.mark.parametrize(
    "sent",
    [
        pod(container("web", limits={"cpu": "1", "memory": "1Gi"})),
        pod(container("web")),
        pod(container("web", limits={GPU: "0"}), annotations={"nvidia.com/use-gputype": "A100"}),
        pod(container("web", env=[env("CUDA_DEVICE_SM_LIMIT", "100")]), nodeName="n1"),  # not ours to judge
        pod(container("web", securityContext={"privileged": True}), schedulerName="other"),
    ],
    ids=["cpu-only", "no-resources", "zero-gpus", "cpu-with-node-name", "privileged-cpu"],
)
def test_pods_without_gpu_requests_pass_untouched(sent: dict[str, Any]) -> None:
    outcome, response = run_review(sent)
    assert (outcome.result, response["allowed"]) == (Result.ALLOWED, True)
    assert "patch" not in response and "patchType" not in response and "warnings" not in response


def test_trusted_component_creating_a_pod_with_internal_annotations_is_still_mutated() -> None:
    sent = pod(gpu_container(gpu="1"), annotations={"kube-vgpu.io/gpu-assignment": "{}"})
    outcome, _ = run_review(sent, username="system:serviceaccount:kube-vgpu:kube-vgpu-extender")
    assert outcome.result is Result.MUTATED
