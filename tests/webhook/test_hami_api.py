"""The rest of HAMi's pod API (issue 16): nvidia.com/priority becomes the limiter's CUDA_TASK_PRIORITY and leaves the
resources; HAMi's policy names are read as ours or refused at admission with what to write instead;
gpumem-percentage: 0 is "not set"; MIG resources are routed with their own resource (static MIG),
nvidia.com/vgpu-mode: mig is dynamic MIG sized by gpumem, and mps is refused, never silently turned into a shared
vGPU. In-process through
`mutate.review` (the function the HTTPS server calls)."""

from __future__ import annotations

from typing import Any

import pytest

from kube_vgpu import protocol
from kube_vgpu.extender.engine.policies import REGISTRY
from kube_vgpu.webhook.config import LimiterMode, WebhookConfig
from kube_vgpu.webhook.mutate import Result
from tests.webhook.builders import GPU, MEM, PCT, apply_response, container, gpu_container, pod, run_review

PRIORITY = "nvidia.com/priority"  # written out, not imported from the code under test


def _admitted(sent: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The pod the API server stores, and the warnings."""
    outcome, response = run_review(sent)
    assert response["allowed"] is True, response.get("status")
    assert outcome.result is Result.MUTATED
    return apply_response(sent, response), list(response.get("warnings", []))


def _denied(sent: dict[str, Any]) -> tuple[int, str]:
    outcome, response = run_review(sent)
    assert outcome.result is Result.DENIED and response["allowed"] is False
    assert "patch" not in response
    return response["status"]["code"], response["status"]["message"]


def _env(stored: dict[str, Any], index: int = 0) -> dict[str, str]:
    return {entry["name"]: entry.get("value", "") for entry in stored["spec"]["containers"][index].get("env", [])}


# -- nvidia.com/priority


@pytest.mark.parametrize("value", ["0", "1", 0, 1])
def test_priority_becomes_the_limiters_env_and_leaves_the_resources(value: str | int) -> None:
    sent = pod(container("trainer", limits={GPU: "1", MEM: "4096", PRIORITY: value},
                         requests={GPU: "1", MEM: "4096", PRIORITY: value}))
    stored, warnings = _admitted(sent)
    resources = stored["spec"]["containers"][0]["resources"]
    assert resources == {"limits": {GPU: "1", MEM: "4096"}, "requests": {GPU: "1", MEM: "4096"}}
    assert _env(stored)["CUDA_TASK_PRIORITY"] == str(value)
    assert warnings == []
    # a reinvocation on the stored pod changes nothing (the priority lives on in the env alone)
    outcome, response = run_review(stored)
    assert outcome.result is Result.ALLOWED and "patch" not in response


def test_priority_in_limits_only_is_read_and_removed() -> None:
    sent = pod(container("trainer", limits={GPU: "1", PRIORITY: "1"}))
    stored, _warnings = _admitted(sent)
    resources = stored["spec"]["containers"][0]["resources"]
    assert PRIORITY not in resources["limits"] and PRIORITY not in resources["requests"]
    assert _env(stored)["CUDA_TASK_PRIORITY"] == "1"


def test_priority_of_one_container_is_not_given_to_another() -> None:
    sent = pod(container("high", limits={GPU: "1", PRIORITY: "0"}), container("plain", limits={GPU: "1"}))
    stored, _warnings = _admitted(sent)
    assert _env(stored, 0)["CUDA_TASK_PRIORITY"] == "0"
    assert "CUDA_TASK_PRIORITY" not in _env(stored, 1)


def test_priority_of_an_init_container_and_a_sidecar() -> None:
    sidecar = container("proxy", limits={GPU: "1", PRIORITY: "1"}, restartPolicy="Always")
    sent = pod(container("app", limits={GPU: "1"}),
               init_containers=[container("warmup", limits={GPU: "1", PRIORITY: "0"}), sidecar])
    stored, _warnings = _admitted(sent)
    init_env = [{e["name"]: e.get("value") for e in c.get("env", [])} for c in stored["spec"]["initContainers"]]
    assert [env.get("CUDA_TASK_PRIORITY") for env in init_env] == ["0", "1"]
    assert all(PRIORITY not in c["resources"]["limits"] for c in stored["spec"]["initContainers"])


def test_the_resource_wins_over_the_pods_own_env_with_a_warning() -> None:
    sent = pod(container("trainer", limits={GPU: "1", PRIORITY: "1"},
                         env=[{"name": "CUDA_TASK_PRIORITY", "value": "0"}]))
    stored, warnings = _admitted(sent)
    assert _env(stored)["CUDA_TASK_PRIORITY"] == "1"
    assert any("CUDA_TASK_PRIORITY" in warning for warning in warnings)


@pytest.mark.parametrize(
    ("limits", "message"),
    [
        ({GPU: "1", PRIORITY: "2"},
         "container trainer: nvidia.com/priority must be 0 (high priority) or 1 (low priority), got 2"),
        ({GPU: "1", PRIORITY: "0.5"}, "container trainer: nvidia.com/priority must be a non-negative whole number, "
                                      "got '0.5'"),
        ({PRIORITY: "1"}, "container trainer: nvidia.com/priority is the priority of a container's vGPUs, and this "
                          "container asks for none: add nvidia.com/gpu (or nvidia.com/gpumem / nvidia.com/gpucores) "
                          "or remove it"),
        ({GPU: "0", PRIORITY: "0"}, "container trainer: nvidia.com/gpu is 0 but nvidia.com/priority is set"),
    ],
)
def test_bad_priorities_are_refused(limits: dict[str, str], message: str) -> None:
    assert _denied(pod(container("trainer", limits=limits))) == (400, message)


# -- gpumem-percentage: 0 is "not set", as in HAMi


def test_gpumem_percentage_zero_is_unset() -> None:
    stored, _warnings = _admitted(pod(gpu_container(gpu="1", gpumem_percentage="0")))
    request = protocol.parse_pod_gpu_request(stored)
    (gpu,) = request.containers
    assert gpu.memory_percent is None and gpu.memory_mib is None  # the whole GPU's memory
    assert not any(name.startswith("CUDA_DEVICE_MEMORY_LIMIT") for name in _env(stored))


def test_gpumem_percentage_zero_beside_gpumem_is_not_both() -> None:
    stored, _warnings = _admitted(pod(gpu_container(gpu="1", gpumem="2048", gpumem_percentage="0")))
    (gpu,) = protocol.parse_pod_gpu_request(stored).containers
    assert gpu.memory_mib == 2048 and gpu.memory_percent is None
    assert _env(stored)["CUDA_DEVICE_MEMORY_LIMIT_0"] == "2048m"
    assert stored["spec"]["containers"][0]["resources"]["limits"][PCT] == "0"  # kept as sent


# -- policies


def test_the_webhooks_policy_list_is_the_extenders_registry() -> None:
    assert tuple(sorted(REGISTRY)) == protocol.POLICY_NAMES


@pytest.mark.parametrize("key", ["hami.io/gpu-scheduler-policy", "hami.io/node-scheduler-policy"])
@pytest.mark.parametrize(("written", "read"), [("binpack", "binpack"), ("spread", "spread"),
                                               ("topology-aware", "topology"), (" bfgd ", "bfgd"),
                                               ("mutex", "mutex")])
def test_policy_names_we_know_are_admitted_and_read_as_ours(key: str, written: str, read: str) -> None:
    stored, _warnings = _admitted(pod(gpu_container(gpu="1"), annotations={key: written}))
    request = protocol.parse_pod_gpu_request(stored)
    assert (request.gpu_policy if key.startswith("hami.io/gpu") else request.node_policy) == read


KNOWN = (
    "bestfit, bfgd, binpack, clustering, dotprod, fgd, hsafgd, lafgd, mutex, packing, random, safgd, spread, topology"
)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("numa", "annotation hami.io/gpu-scheduler-policy: HAMi's policy 'numa' is not implemented by kube-vgpu: for "
                 'GPUs of one NUMA node, set the annotation nvidia.com/numa-bind: "true", or name one policy '
                 f"({KNOWN})"),
        ("binpack,numa", "annotation hami.io/gpu-scheduler-policy: 'binpack,numa' is a chain of policies, which "
                         f"kube-vgpu does not read; name one policy ({KNOWN}); for GPUs of one NUMA node, set the "
                         'annotation nvidia.com/numa-bind: "true"'),
        ("mutex,topology-aware", "annotation hami.io/gpu-scheduler-policy: 'mutex,topology-aware' is a chain of "
                                 f"policies, which kube-vgpu does not read; name one policy ({KNOWN})"),
        ("fastest", f"annotation hami.io/gpu-scheduler-policy: unknown policy 'fastest'; known policies: {KNOWN}"),
    ],
)
def test_policies_the_extender_would_not_know_are_refused_at_admission(value: str, message: str) -> None:
    sent = pod(gpu_container(gpu="1"), annotations={"hami.io/gpu-scheduler-policy": value})
    assert _denied(sent) == (400, message)


def test_an_unknown_node_policy_is_refused_at_admission() -> None:
    sent = pod(gpu_container(gpu="1"), annotations={"hami.io/node-scheduler-policy": "x" * 200})
    code, message = _denied(sent)
    assert code == 400 and message.startswith("annotation hami.io/node-scheduler-policy: unknown policy 'xxxx")
    assert len(message) < 200 + len(KNOWN)  # a long value is cut short


# -- MIG: static MIG devices routed with their own resource; malformed asks and HAMi's dynamic MIG refused


@pytest.mark.parametrize("resource", ["nvidia.com/mig-3g.20gb", "nvidia.com/mig-1g.10gb"])
def test_a_mig_request_is_routed_with_its_mig_resource_and_no_limits(resource: str) -> None:
    sent = pod(container("trainer", limits={resource: "1"}), init_containers=[
        container("warmup", limits={"nvidia.com/mig-1g.5gb": "1"})])
    stored, warnings = _admitted(sent)
    assert warnings == []
    assert stored["spec"]["schedulerName"] == "kube-vgpu-scheduler"
    main, warmup = stored["spec"]["containers"][0], stored["spec"]["initContainers"][0]
    # the MIG resource alone (the device plugin advertises it), never a shared nvidia.com/gpu
    assert main["resources"] == {"limits": {resource: "1"}, "requests": {resource: "1"}}
    assert warmup["resources"]["limits"] == {"nvidia.com/mig-1g.5gb": "1"}
    env = _env(stored)
    assert env["CUDA_DEVICE_SM_LIMIT"] == "0" and not any(n.startswith("CUDA_DEVICE_MEMORY_LIMIT") for n in env)
    outcome, response = run_review(stored)  # a reinvocation changes nothing
    assert outcome.result is Result.ALLOWED and "patch" not in response


@pytest.mark.parametrize(("limits", "message"), [
    ({GPU: "1", "nvidia.com/mig-1g.5gb": "1"}, "container trainer: asks for nvidia.com/mig-1g.5gb and nvidia.com/gpu: "
                                              "a container gets either MIG devices or vGPU shares, not both"),
    ({"nvidia.com/mig-1g.5gb": "1", "nvidia.com/mig-2g.10gb": "1"},
     "container trainer: asks for several MIG profiles (nvidia.com/mig-1g.5gb, nvidia.com/mig-2g.10gb); kube-vgpu "
     "places one MIG profile per container: split it into containers"),
    ({"nvidia.com/mig-big": "1"}, "container trainer: 'nvidia.com/mig-big' is not a MIG resource like "
                                  "nvidia.com/mig-3g.20gb"),
    ({"nvidia.com/mig-1g.5gb": "0.5"}, "container trainer: nvidia.com/mig-1g.5gb must be a non-negative whole "
                                       "number, got '0.5'"),
    ({"nvidia.com/mig-1g.5gb+me": "1"}, "container trainer: nvidia.com/mig-1g.5gb+me: media-extension MIG devices "
                                        "are offered under their plain profile, ask for nvidia.com/mig-1g.5gb"),
    ({"nvidia.com/mig-1g.12gb": "1"},
     "container trainer: nvidia.com/mig-1g.12gb: kube-vgpu places the MIG profiles of A100 40GB/80GB, H100 80GB and "
     "H200 141GB (1g.5gb, 1g.10gb, 1g.18gb, 1g.20gb, 1g.35gb, 2g.10gb, 2g.20gb, 2g.35gb, 3g.20gb, 3g.40gb, 3g.71gb, "
     "4g.20gb, 4g.40gb, 4g.71gb, 7g.40gb, 7g.80gb, 7g.141gb), not 1g.12gb"),
])  # fmt: skip
def test_malformed_mig_requests_are_refused_with_what_is_wrong(limits: dict[str, str], message: str) -> None:
    assert _denied(pod(container("trainer", limits=limits))) == (400, message)


def test_mig_count_zero_asks_for_nothing() -> None:
    outcome, response = run_review(pod(container("trainer", limits={"nvidia.com/mig-1g.5gb": "0"})))
    assert response["allowed"] is True and outcome.result is Result.ALLOWED


@pytest.mark.parametrize(
    ("mode", "message"),
    [
        ("mps", "annotation nvidia.com/vgpu-mode: 'mps' is not supported; kube-vgpu shares GPUs with the in-container "
                "limiter (hami-core) or partitions them with MIG (mig): remove the annotation or set it to one of "
                "those"),
    ],
)
def test_vgpu_modes_other_than_hami_core_and_mig_are_refused(mode: str, message: str) -> None:
    sent = pod(gpu_container(gpu="1", gpumem="4096"), annotations={"nvidia.com/vgpu-mode": mode})
    assert _denied(sent) == (400, message)


def test_vgpu_mode_mig_is_dynamic_mig_by_memory() -> None:
    """HAMi's dynamic MIG: the container's gpumem chooses the profile on the node (issue 16 item 2)."""
    _admitted(pod(gpu_container(gpu="1", gpumem="9000"), annotations={"nvidia.com/vgpu-mode": "mig"}))
    sent = pod(gpu_container(gpu="1"), annotations={"nvidia.com/vgpu-mode": "mig"})
    assert _denied(sent) == (400, "container trainer: annotation nvidia.com/vgpu-mode: mig chooses the MIG profile "
                                  "by memory: set nvidia.com/gpumem (MiB) per GPU (nvidia.com/gpumem-percentage is not "
                                  "read in this mode), or ask for a profile with nvidia.com/mig-<profile>")


def test_vgpu_mode_hami_core_is_what_we_do() -> None:
    _admitted(pod(gpu_container(gpu="1"), annotations={"nvidia.com/vgpu-mode": "hami-core"}))


@pytest.mark.parametrize("mode", list(LimiterMode))
def test_the_limiter_is_not_loaded_into_a_mig_container(mode: LimiterMode) -> None:
    sent = pod(container("mig", limits={"nvidia.com/mig-3g.20gb": "1"}), container("share", limits={GPU: "1"}))
    _outcome, response = run_review(sent, WebhookConfig(limiter_mode=mode))
    assert response["allowed"] is True, response.get("status")
    stored = apply_response(sent, response)
    mig_container, share = stored["spec"]["containers"]
    assert "LD_PRELOAD" not in _env(stored, 0)
    assert [m["name"] for m in mig_container["volumeMounts"]] == ["kube-vgpu-cache"]
    # the shared vGPU beside it gets the limiter as before
    share_mounts = {m["name"] for m in share["volumeMounts"]}
    if mode is LimiterMode.LD_SO_PRELOAD:
        assert "kube-vgpu-ld-so-preload" in share_mounts
    if mode in (LimiterMode.LD_PRELOAD, LimiterMode.DEVICE_PLUGIN):
        assert _env(stored, 1)["LD_PRELOAD"].startswith("/usr/local/vgpu/libvgpu.so")
