"""Test helpers around the webhook's review (the pods and AdmissionReviews themselves: kube_vgpu.dev.fixtures)."""

from __future__ import annotations

import base64
import copy
from typing import Any

import jsonpatch
import orjson

from kube_vgpu.dev.fixtures.admission import (
    CORES,
    GPU,
    LIB,
    MEM,
    PCT,
    admission_review,
    container,
    gpu_container,
    pod,
)
from kube_vgpu.webhook.config import WebhookConfig
from kube_vgpu.webhook.mutate import AdmissionOutcome, review
from kube_vgpu.webhook.owners import OwnerResolver

__all__ = ["CORES", "GPU", "LIB", "MEM", "PCT", "admission_review", "apply_response", "container", "decode",
           "gpu_container", "patch_ops", "pod", "run_review"]


def decode(outcome: AdmissionOutcome) -> dict[str, Any]:
    doc = orjson.loads(outcome.body)
    assert isinstance(doc, dict)
    return doc


def run_review(
    obj: dict[str, Any], config: WebhookConfig | None = None, owners: OwnerResolver | None = None, **kwargs: Any
) -> tuple[AdmissionOutcome, dict[str, Any]]:
    """(outcome, the AdmissionReview response object)."""
    sent = copy.deepcopy(obj)
    outcome = review(orjson.dumps(admission_review(sent, **kwargs)), config or WebhookConfig(), owners)
    assert sent == obj, "the webhook must not modify the pod it was given"
    doc = decode(outcome)
    return outcome, doc.get("response", doc)


def patch_ops(response: dict[str, Any]) -> list[dict[str, Any]]:
    if "patch" not in response:
        return []
    assert response["patchType"] == "JSONPatch"
    ops = orjson.loads(base64.b64decode(response["patch"]))
    assert isinstance(ops, list)
    return ops


def apply_response(obj: dict[str, Any], response: dict[str, Any]) -> dict[str, Any]:
    """The pod the API server would store: the RFC 6902 patch applied to the pod as sent."""
    result: dict[str, Any] = jsonpatch.apply_patch(copy.deepcopy(obj), patch_ops(response))
    return result
