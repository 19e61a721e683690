"""Pods, assignments and waits for the device plugin tests: objects in the exact shapes the API server uses."""

from __future__ import annotations

import datetime as dt
import itertools
import time
from collections.abc import Callable
from typing import Any, TypeVar

from kube_vgpu import protocol
from kube_vgpu.dev.fixtures import gpu_limits

NODE = "gpu-node-a"
_uids = itertools.count(1)
T = TypeVar("T")

#: generous bound for anything that happens on another thread; tests never assert how fast
WAIT_SECONDS = 20.0


def wait_until(condition: Callable[[], T], what: str, timeout_seconds: float = WAIT_SECONDS) -> T:
    """Poll `condition` until it returns something truthy; fail naming `what` after the bound."""
    deadline = time.monotonic() + timeout_seconds
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_seconds:.0f}s waiting for {what}")
        time.sleep(0.02)


def bind_time(seconds: float) -> str:
    return protocol.format_bind_time(dt.datetime(2026, 1, 31, 12, 0, 0, tzinfo=dt.UTC) + dt.timedelta(seconds=seconds))


def container(name: str, gpus: int | None, memory_mib: int | None = None, percent: int | None = None) -> dict[str, Any]:
    limits = {"cpu": "1", **gpu_limits(gpus=gpus, memory_mib=memory_mib, memory_percent=percent)}
    return {"name": name, "image": "busybox", "resources": {"limits": limits, "requests": dict(limits)}}


def gpu_pod(
    name: str,
    *,
    node: str = NODE,
    containers: list[dict[str, Any]] | None = None,
    init_containers: list[dict[str, Any]] | None = None,
    assignment: dict[str, list[tuple[str, int, int]]] | None = None,
    init_assignment: dict[str, list[tuple[str, int, int]]] | None = None,
    bound_at: float | None = None,
    created_at: float = 0.0,
    phase: str = "Pending",
    namespace: str = "default",
    scheduler: str = protocol.DEFAULT_SCHEDULER_NAME,
) -> dict[str, Any]:
    """A pod bound to `node`. `assignment`: container name -> [(uuid, MiB, cores)] as the extender writes it."""
    annotations: dict[str, str] = {}
    if assignment is not None or init_assignment is not None:
        entries = [
            protocol.ContainerAssignment(name, tuple(protocol.DeviceShare(*d) for d in devices), init=True)
            for name, devices in (init_assignment or {}).items()
        ] + [
            protocol.ContainerAssignment(name, tuple(protocol.DeviceShare(*d) for d in devices))
            for name, devices in (assignment or {}).items()
        ]
        annotations[protocol.POD_ASSIGNMENT_ANNOTATION] = protocol.encode_assignment(
            protocol.PodAssignment(node=node, containers=tuple(entries))
        )
    if bound_at is not None:
        annotations[protocol.POD_BIND_TIME_ANNOTATION] = bind_time(bound_at)
    created = dt.datetime(2026, 1, 31, 11, 0, 0, tzinfo=dt.UTC) + dt.timedelta(seconds=created_at)
    spec: dict[str, Any] = {
        "schedulerName": scheduler,
        "nodeName": node,
        "containers": containers or [container("main", 1)],
    }
    if init_containers:
        spec["initContainers"] = init_containers
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "uid": f"uid-{next(_uids):04d}-{name}",
            "creationTimestamp": created.strftime("%Y-%m-%dT%H:%M:%SZ"),
            "annotations": annotations,
        },
        "spec": spec,
        "status": {"phase": phase},
    }


def allocation_of(pod: dict[str, Any]) -> dict[str, tuple[str, ...]]:
    text = (pod["metadata"].get("annotations") or {}).get(protocol.POD_ALLOCATION_ANNOTATION)
    return protocol.decode_allocation(text) if text else {}
