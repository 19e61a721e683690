"""admit_create's edge that mutation testing found untested (docs/mutation-testing.md): a GPU container without a
name is matched to its request under the same "?" the parser gives it, so the privileged rule still applies."""

from __future__ import annotations

from kube_vgpu.webhook.config import WebhookConfig
from kube_vgpu.webhook.mutate import admit_create
from tests.webhook.builders import gpu_container, pod


def test_a_nameless_privileged_gpu_container_is_still_refused() -> None:
    nameless = gpu_container(gpu="1", securityContext={"privileged": True})
    del nameless["name"]
    decision = admit_create(pod(nameless), "someone", WebhookConfig())
    assert (decision.allowed, decision.code) == (False, 403)
    assert decision.message.startswith("container ?: privileged containers cannot use vGPUs")
