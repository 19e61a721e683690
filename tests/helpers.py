"""Builders shared by the tests: real objects in the exact shapes the API server and kube-scheduler use."""

from __future__ import annotations

import itertools
from typing import Any

from kube_vgpu import protocol
from kube_vgpu.dev.synth import node_object, synth_inventory

_counter = itertools.count()


def gpu_node(
    name: str,
    gpus: int = 4,
    model: str = "NVIDIA-A100-SXM4-80GB",
    memory_mib: int = 81920,
    topology: str = "nvswitch",
    **node_kwargs: Any,
) -> dict[str, Any]:
    return node_object(name, synth_inventory(name, gpus, model, memory_mib, topology), **node_kwargs)


def pod(
    name: str | None = None,
    *,
    gpus: int | None = 1,
    memory_mib: int | None = None,
    memory_percent: int | None = None,
    cores: int | None = None,
    namespace: str = "default",
    annotations: dict[str, str] | None = None,
    labels: dict[str, str] | None = None,
    init_gpus: int | None = None,
    init_memory_mib: int | None = None,
) -> dict[str, Any]:
    """A Pod object as kube-scheduler sends it to an extender (full object, status Pending)."""
    name = name or f"pod-{next(_counter)}"
    limits: dict[str, str] = {"cpu": "1", "memory": "1Gi"}
    if gpus is not None:
        limits[protocol.RESOURCE_GPU] = str(gpus)
    if memory_mib is not None:
        limits[protocol.RESOURCE_GPU_MEMORY] = str(memory_mib)
    if memory_percent is not None:
        limits[protocol.RESOURCE_GPU_MEMORY_PERCENTAGE] = str(memory_percent)
    if cores is not None:
        limits[protocol.RESOURCE_GPU_CORES] = str(cores)
    spec: dict[str, Any] = {
        "schedulerName": protocol.DEFAULT_SCHEDULER_NAME,
        "containers": [
            {
                "name": "main",
                "image": "nvcr.io/nvidia/pytorch:24.01-py3",
                "resources": {"limits": limits, "requests": dict(limits)},
                "terminationMessagePath": "/dev/termination-log",
                "imagePullPolicy": "IfNotPresent",
            }
        ],
        "restartPolicy": "Always",
        "terminationGracePeriodSeconds": 30,
        "dnsPolicy": "ClusterFirst",
        "serviceAccountName": "default",
        "securityContext": {},
        "priority": 0,
        "enableServiceLinks": True,
        "preemptionPolicy": "PreemptLowerPriority",
        "tolerations": [
            {
                "key": "node.kubernetes.io/not-ready",
                "operator": "Exists",
                "effect": "NoExecute",
                "tolerationSeconds": 300,
            }
        ],
    }
    if init_gpus is not None:
        init_limits = {protocol.RESOURCE_GPU: str(init_gpus)}
        if init_memory_mib is not None:
            init_limits[protocol.RESOURCE_GPU_MEMORY] = str(init_memory_mib)
        spec["initContainers"] = [{"name": "warmup", "image": "busybox", "resources": {"limits": init_limits}}]
    return {
        "kind": "Pod",
        "apiVersion": "v1",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "uid": f"0b1e{next(_counter):04d}-{abs(hash(name)) % 10**8:08d}-4c1a-9d2e-5f3b7a8c9d0e",
            "resourceVersion": "1234",
            "creationTimestamp": "2026-11-21T10:00:00Z",
            "labels": labels or {},
            "annotations": annotations or {},
        },
        "spec": spec,
        "status": {"phase": "Pending", "qosClass": "Guaranteed"},
    }
