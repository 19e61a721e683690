"""Pods and AdmissionReviews in the exact shapes the kube-apiserver sends to a mutating webhook."""

from __future__ import annotations

import base64
import copy
import itertools
from typing import Any

import jsonpatch
import orjson

from kube_vgpu.webhook.config import WebhookConfig
from kube_vgpu.webhook.mutate import AdmissionOutcome, review

_uids = itertools.count(1)

GPU = "nvidia.com/gpu"
MEM = "nvidia.com/gpumem"
PCT = "nvidia.com/gpumem-percentage"
CORES = "nvidia.com/gpucores"
LIB = "/usr/local/vgpu/libvgpu.so"


def container(
    name: str = "trainer",
    *,
    limits: dict[str, Any] | None = None,
    requests: dict[str, Any] | None = None,
    env: list[dict[str, Any]] | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """A container as the API server holds it after defaulting (image pull policy, termination message...)."""
    body: dict[str, Any] = {
        "name": name,
        "image": "nvcr.io/nvidia/cuda:12.4.1-base-ubuntu22.04",
        "imagePullPolicy": "IfNotPresent",
        "terminationMessagePath": "/dev/termination-log",
        "terminationMessagePolicy": "File",
    }
    resources: dict[str, Any] = {}
    if limits is not None:
        resources["limits"] = limits
    if requests is not None:
        resources["requests"] = requests
    body["resources"] = resources
    if env is not None:
        body["env"] = env
    body.update(extra)
    return body


def gpu_container(name: str = "trainer", **resources: Any) -> dict[str, Any]:
    """limits and requests both set to the given GPU resources (the API server defaults requests from limits)."""
    values = {_RESOURCE_KEYS[key]: value for key, value in resources.items() if key in _RESOURCE_KEYS}
    extra = {key: value for key, value in resources.items() if key not in _RESOURCE_KEYS}
    limits = {"cpu": "2", "memory": "8Gi", **values}
    return container(name, limits=limits, requests=dict(limits), **extra)


_RESOURCE_KEYS = {"gpu": GPU, "gpumem": MEM, "gpumem_percentage": PCT, "gpucores": CORES}


def pod(
    *containers: dict[str, Any],
    init_containers: list[dict[str, Any]] | None = None,
    annotations: dict[str, str] | None = None,
    name: str = "job-0",
    namespace: str = "team-a",
    **spec_extra: Any,
) -> dict[str, Any]:
    metadata: dict[str, Any] = {"name": name, "namespace": namespace, "labels": {"app": "train"}}
    if annotations is not None:
        metadata["annotations"] = annotations
    spec: dict[str, Any] = {
        "containers": list(containers) or [container("app")],
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": 30,
        "dnsPolicy": "ClusterFirst",
        "serviceAccountName": "default",
        "securityContext": {},
        "schedulerName": "default-scheduler",
        "enableServiceLinks": True,
        "preemptionPolicy": "PreemptLowerPriority",
        "priority": 0,
    }
    if init_containers is not None:
        spec["initContainers"] = init_containers
    spec.update(spec_extra)
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": spec, "status": {}}


def admission_review(
    obj: dict[str, Any],
    *,
    operation: str = "CREATE",
    old: dict[str, Any] | None = None,
    username: str = "alice@example.com",
    api_version: str = "admission.k8s.io/v1",
    uid: str | None = None,
) -> dict[str, Any]:
    namespace = (obj.get("metadata") or {}).get("namespace", "team-a")
    request: dict[str, Any] = {
        "uid": uid or f"0b6f8c2e-0000-4000-8000-{next(_uids):012d}",
        "kind": {"group": "", "version": "v1", "kind": "Pod"},
        "resource": {"group": "", "version": "v1", "resource": "pods"},
        "requestKind": {"group": "", "version": "v1", "kind": "Pod"},
        "requestResource": {"group": "", "version": "v1", "resource": "pods"},
        "name": (obj.get("metadata") or {}).get("name", ""),
        "namespace": namespace,
        "operation": operation,
        "userInfo": {"username": username, "groups": ["system:authenticated"]},
        "object": obj,
        "oldObject": old,
        "dryRun": False,
        "options": {
            "apiVersion": "meta.k8s.io/v1",
            "kind": "CreateOptions" if operation == "CREATE" else "UpdateOptions",
        },
    }
    return {"apiVersion": api_version, "kind": "AdmissionReview", "request": request}


def decode(outcome: AdmissionOutcome) -> dict[str, Any]:
    doc = orjson.loads(outcome.body)
    assert isinstance(doc, dict)
    return doc


def run_review(
    obj: dict[str, Any], config: WebhookConfig | None = None, **kwargs: Any
) -> tuple[AdmissionOutcome, dict[str, Any]]:
    """(outcome, the AdmissionReview response object)."""
    sent = copy.deepcopy(obj)
    outcome = review(orjson.dumps(admission_review(sent, **kwargs)), config or WebhookConfig())
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
