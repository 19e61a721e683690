"""kubeapi.check_pod: a field of a type the API server never sends is refused with its path; every real pod passes."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from kube_vgpu.kubeapi import InvalidObject, check_pod
from tests import helpers
from tests.webhook import builders


def full_pod() -> dict[str, Any]:
    """A pod as the API server returns it, with every field kube-vgpu reads set."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": "trainer-0", "namespace": "team-a", "uid": "0b1e0001-0000-4000-8000-000000000001",
            "generateName": "trainer-", "resourceVersion": "42", "creationTimestamp": "2026-01-01T00:00:00Z",
            "labels": {"kueue.x-k8s.io/queue-name": "q"}, "annotations": {"nvidia.com/use-gputype": "A100"},
            "ownerReferences": [{"apiVersion": "batch/v1", "kind": "Job", "name": "trainer", "uid": "u-1",
                                 "controller": True, "blockOwnerDeletion": True}],
        },
        "spec": {
            "nodeName": "", "schedulerName": "kube-vgpu-scheduler", "priorityClassName": "high", "priority": 1000,
            "restartPolicy": "Never", "runtimeClassName": "nvidia", "nodeSelector": {"pool": "gpu"},
            "overhead": {"cpu": "250m", "memory": "120Mi"}, "resources": {"requests": {"cpu": "4"}},
            "affinity": {"nodeAffinity": {}}, "securityContext": {"runAsNonRoot": True},
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
            "volumes": [{"name": "data", "emptyDir": {}}],
            "initContainers": [{"name": "proxy", "image": "envoy", "restartPolicy": "Always",
                                "resources": {"requests": {"cpu": 0.5, "memory": 268435456}}}],
            "containers": [{
                "name": "main", "image": "cuda",
                "resources": {"limits": {"nvidia.com/gpu": "1", "nvidia.com/gpumem": 4096}, "requests": {}},
                "env": [{"name": "A", "value": "1"}, {"name": "B", "valueFrom": {"fieldRef": {"fieldPath": "x"}}}],
                "envFrom": [{"configMapRef": {"name": "cfg"}}],
                "volumeMounts": [{"name": "data", "mountPath": "/data"}],
                "securityContext": {"privileged": False},
            }],
        },
        "status": {"phase": "Pending"},
    }


def test_real_pods_pass() -> None:
    for pod in (full_pod(), {}, {"metadata": None, "spec": None, "status": None}, helpers.pod(),
                builders.pod(builders.gpu_container(gpu="1"))):
        assert check_pod(pod) is pod


def _set(pod: dict[str, Any], path: tuple[str | int, ...], value: Any) -> dict[str, Any]:
    changed = copy.deepcopy(pod)
    target: Any = changed
    for part in path[:-1]:
        target = target[part]
    target[path[-1]] = value
    return changed


CONTAINER = ("spec", "containers", 0)
WRONG = [
    ((), [], "pod must be an object, got a list"),
    (("metadata",), "x", "pod.metadata must be an object, got a string"),
    (("metadata", "uid"), [1], "pod.metadata.uid must be a string, got a list"),
    (("metadata", "namespace"), 7, "pod.metadata.namespace must be a string, got a number"),
    (("metadata", "labels", "kueue.x-k8s.io/queue-name"), None,
     "pod.metadata.labels['kueue.x-k8s.io/queue-name'] must be a string, got null"),
    (("metadata", "annotations"), [], "pod.metadata.annotations must be an object, got a list"),
    (("metadata", "ownerReferences", 0), "Job", "pod.metadata.ownerReferences[0] must be an object, got a string"),
    (("metadata", "ownerReferences", 0, "uid"), 1,
     "pod.metadata.ownerReferences[0].uid must be a string, got a number"),
    (("spec",), [], "pod.spec must be an object, got a list"),
    (("spec", "priority"), True, "pod.spec.priority must be an integer, got a boolean"),
    (("spec", "nodeName"), ["n"], "pod.spec.nodeName must be a string, got a list"),
    (("spec", "nodeSelector", "pool"), 1, "pod.spec.nodeSelector['pool'] must be a string, got a number"),
    (("spec", "overhead", "cpu"), {}, "pod.spec.overhead['cpu'] must be a quantity (a string or a number), got an "
     "object"),
    (("spec", "resources", "requests"), "4", "pod.spec.resources.requests must be an object, got a string"),
    (("spec", "tolerations"), {}, "pod.spec.tolerations must be a list, got an object"),
    (("spec", "volumes", 0, "name"), 1, "pod.spec.volumes[0].name must be a string, got a number"),
    (("spec", "initContainers", 0, "restartPolicy"), True,
     "pod.spec.initContainers[0].restartPolicy must be a string, got a boolean"),
    ((*CONTAINER, "name"), None, None),  # null is an absent field
    ((*CONTAINER, "name"), 1.5, "pod.spec.containers[0].name must be a string, got a number"),
    ((*CONTAINER, "resources", "limits", "nvidia.com/gpu"), [1],
     "pod.spec.containers[0].resources.limits['nvidia.com/gpu'] must be a quantity (a string or a number), got a "
     "list"),
    ((*CONTAINER, "env", 1), "B=2", "pod.spec.containers[0].env[1] must be an object, got a string"),
    ((*CONTAINER, "env", 0, "value"), 1, "pod.spec.containers[0].env[0].value must be a string, got a number"),
    ((*CONTAINER, "env", 1, "valueFrom"), "x", "pod.spec.containers[0].env[1].valueFrom must be an object, got a "
     "string"),
    ((*CONTAINER, "envFrom"), {}, "pod.spec.containers[0].envFrom must be a list, got an object"),
    ((*CONTAINER, "volumeMounts", 0, "mountPath"), {}, "pod.spec.containers[0].volumeMounts[0].mountPath must be a "
     "string, got an object"),
    ((*CONTAINER, "securityContext", "privileged"), "true",
     "pod.spec.containers[0].securityContext.privileged must be a boolean, got a string"),
    (("status",), "Pending", "pod.status must be an object, got a string"),
    (("status", "phase"), 1, "pod.status.phase must be a string, got a number"),
]


@pytest.mark.parametrize(("path", "value", "message"), WRONG, ids=[".".join(map(str, p)) or "pod" for p, _, _ in WRONG])
def test_a_wrong_typed_field_is_named(path: tuple[str | int, ...], value: Any, message: str | None) -> None:
    pod = _set(full_pod(), path, value) if path else value
    if message is None:
        assert check_pod(pod) is pod
        return
    with pytest.raises(InvalidObject) as refused:
        check_pod(pod)
    assert str(refused.value) == message
