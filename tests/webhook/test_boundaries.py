"""Every bound the webhook enforces, tested on both sides on purpose (issue 20, item 13): the last value allowed and
the first refused, so a change that moves a bound by one fails here, not by accident elsewhere.

In-process through `mutate.review` (the function the server calls), except the body-size bound, which is the
server's and is tested over real HTTPS."""

from __future__ import annotations

from typing import Any

import httpx
import orjson
import pytest

from kube_vgpu import kubeapi, protocol
from kube_vgpu.webhook.config import WebhookConfig
from kube_vgpu.webhook.mutate import Result
from kube_vgpu.webhook.registration import mutating_webhook_configuration
from kube_vgpu.webhook.server import MAX_BODY_BYTES
from tests.webhook.builders import (
    CORES,
    GPU,
    MEM,
    PCT,
    admission_review,
    apply_response,
    container,
    gpu_container,
    pod,
    run_review,
)


def allowed(obj: dict[str, Any], config: WebhookConfig | None = None) -> Result:
    outcome, response = run_review(obj, config)
    assert response["allowed"] is True, response.get("status")
    return outcome.result


def denial(obj: dict[str, Any], config: WebhookConfig | None = None) -> tuple[int, str]:
    outcome, response = run_review(obj, config)
    assert outcome.result is Result.DENIED and response["allowed"] is False
    return response["status"]["code"], response["status"]["message"]


# (resource, last value allowed on the low side, first refused below it, last allowed on the high side, first refused
#  above it, the two messages). None: no bound on that side.
BOUNDS = [
    (GPU, "0", "-1", None, None,
     "container trainer: nvidia.com/gpu must not be negative, got '-1'", None),
    (MEM, "1", "0", str(protocol.MAX_GPU_MEMORY_MIB), str(protocol.MAX_GPU_MEMORY_MIB + 1),
     "container trainer: nvidia.com/gpumem must be greater than 0 MiB, got 0",
     "container trainer: nvidia.com/gpumem must be at most 1048576 MiB (more than any GPU has; it counts MiB, not "
     "bytes), got 1048577"),
    # 0 is "not set", as in HAMi (the whole GPU's memory)
    (PCT, "0", "-1", "100", "101",
     "container trainer: nvidia.com/gpumem-percentage must not be negative, got '-1'",
     "container trainer: nvidia.com/gpumem-percentage must be between 1 and 100, got 101"),
    (protocol.RESOURCE_TASK_PRIORITY, "0", "-1", "1", "2",
     "container trainer: nvidia.com/priority must not be negative, got '-1'",
     "container trainer: nvidia.com/priority must be 0 (high priority) or 1 (low priority), got 2"),
    (CORES, "0", "-1", "100", "101",
     "container trainer: nvidia.com/gpucores must not be negative, got '-1'",
     "container trainer: nvidia.com/gpucores must be between 0 and 100, got 101"),
]  # fmt: skip


def _gpu_pod(resource: str, value: str) -> dict[str, Any]:
    limits = {"cpu": "1", GPU: "1", resource: value}
    return pod(container("trainer", limits=limits, requests=dict(limits)))


@pytest.mark.parametrize(("resource", "low_ok", "low_bad", "high_ok", "high_bad", "low_message", "high_message"),
                         BOUNDS, ids=[row[0] for row in BOUNDS])  # fmt: skip
def test_each_per_container_bound_on_both_sides(
    resource: str, low_ok: str, low_bad: str, high_ok: str | None, high_bad: str | None, low_message: str,
    high_message: str | None,
) -> None:  # fmt: skip
    # gpu: 0 is "no GPU" (allowed untouched); every other resource at its edge gives a GPU pod to mutate
    assert allowed(_gpu_pod(resource, low_ok)) is (Result.ALLOWED if resource == GPU else Result.MUTATED)
    assert denial(_gpu_pod(resource, low_bad)) == (400, low_message)
    if high_ok is not None and high_bad is not None:
        assert allowed(_gpu_pod(resource, high_ok)) is Result.MUTATED
        assert denial(_gpu_pod(resource, high_bad)) == (400, high_message)


def test_gpumem_at_its_largest_is_passed_on_to_the_limiter_exactly() -> None:
    sent = _gpu_pod(MEM, str(protocol.MAX_GPU_MEMORY_MIB))
    outcome, response = run_review(sent)
    assert outcome.result is Result.MUTATED
    env = apply_response(sent, response)["spec"]["containers"][0]["env"]
    assert {"name": "CUDA_DEVICE_MEMORY_LIMIT_0", "value": f"{protocol.MAX_GPU_MEMORY_MIB}m"} in env


def test_quantity_text_length_on_both_sides() -> None:
    longest = "0" * (kubeapi.MAX_QUANTITY_TEXT - 1) + "1"  # still the number 1
    assert allowed(_gpu_pod(CORES, longest)) is Result.MUTATED
    too_long = "0" + longest
    assert denial(_gpu_pod(CORES, too_long)) == (
        400, f"container trainer: nvidia.com/gpucores must be a non-negative whole number, got {too_long!r}"
    )


# -- vGPUs per pod (config.max_gpus_per_pod): app containers add up, init containers count at their peak, native
#    sidecars beside what they run with


def _cap_message(total: int, cap: int, sidecars: bool = False) -> str:
    sidecar_note = " (native sidecars count with the containers they run beside)" if sidecars else ""
    return f"pod asks for {total} vGPUs (nvidia.com/gpu), more than the maximum of {cap} per pod allowed in this " + (
        "cluster" + sidecar_note
    )


@pytest.mark.parametrize("cap", [1, 16])
def test_vgpus_per_pod_in_one_container_on_both_sides(cap: int) -> None:
    config = WebhookConfig(max_gpus_per_pod=cap)
    assert allowed(pod(gpu_container(gpu=str(cap))), config) is Result.MUTATED
    assert denial(pod(gpu_container(gpu=str(cap + 1))), config) == (403, _cap_message(cap + 1, cap))


def test_vgpus_per_pod_summed_over_app_containers_on_both_sides() -> None:
    assert allowed(pod(gpu_container("a", gpu="8"), gpu_container("b", gpu="8"))) is Result.MUTATED
    assert denial(pod(gpu_container("a", gpu="8"), gpu_container("b", gpu="9"))) == (403, _cap_message(17, 16))


def test_vgpus_per_pod_at_the_peak_of_init_containers_on_both_sides() -> None:
    # an init container runs alone: 16 then 16 is a peak of 16, not 32
    at_cap = pod(gpu_container("app", gpu="16"), init_containers=[gpu_container("init", gpu="16")])
    assert allowed(at_cap) is Result.MUTATED
    over = pod(gpu_container("app", gpu="1"), init_containers=[gpu_container("init", gpu="17")])
    assert denial(over) == (403, _cap_message(17, 16))


def test_vgpus_per_pod_with_a_native_sidecar_on_both_sides() -> None:
    def with_sidecar(app_gpus: int) -> dict[str, Any]:
        sidecar = gpu_container("proxy", gpu="8", restartPolicy="Always")
        return pod(gpu_container("app", gpu=str(app_gpus)), init_containers=[sidecar])

    assert allowed(with_sidecar(8)) is Result.MUTATED
    assert denial(with_sidecar(9)) == (403, _cap_message(17, 16, sidecars=True))


def test_the_cap_setting_itself_on_both_sides() -> None:
    assert WebhookConfig(max_gpus_per_pod=1).max_gpus_per_pod == 1
    with pytest.raises(ValueError, match="max_gpus_per_pod must be at least 1, got 0"):
        WebhookConfig(max_gpus_per_pod=0)


# -- registration: the API server's own limit on timeoutSeconds


@pytest.mark.parametrize(("seconds", "ok"), [(0, False), (1, True), (30, True), (31, False)])
def test_registration_timeout_on_both_sides(seconds: int, ok: bool) -> None:
    if ok:
        config = mutating_webhook_configuration(b"", url="https://127.0.0.1/mutate", timeout_seconds=seconds)
        assert {hook["timeoutSeconds"] for hook in config["webhooks"]} == {seconds}
    else:
        with pytest.raises(ValueError, match=f"between 1 and 30 .*got {seconds}"):
            mutating_webhook_configuration(b"", url="https://127.0.0.1/mutate", timeout_seconds=seconds)


# -- the server's body size


def test_body_size_on_both_sides_over_https(client: httpx.Client) -> None:
    document = orjson.dumps(admission_review(pod(gpu_container(gpu="1"))))
    at_limit = document + b" " * (MAX_BODY_BYTES - len(document))  # trailing whitespace: still the same JSON
    reply = client.post("/mutate", content=at_limit, headers={"Content-Type": "application/json"})
    assert reply.status_code == 200 and reply.json()["response"]["allowed"] is True
    reply = client.post("/mutate", content=at_limit + b" ", headers={"Content-Type": "application/json"})
    assert reply.status_code == 413
    assert reply.json()["message"] == f"request body larger than {MAX_BODY_BYTES} bytes"
