"""The dashboard's view model: the extender's GET /state and GET /quota (and, when given, per-pod use read from
Prometheus) turned into the figures the page shows. Pure: documents in, one JSON-ready dict out.

/state is parsed by `kube-vgpu top`'s parser (extender/top.py), so both read the same document the same way and a
malformed one is refused with the same message (StateFormatError).
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kube_vgpu.extender.top import Gpu, Node, StateFormatError, parse_state

#: without any assignment to learn from, the "typical request" a stranded-capacity figure is measured against:
#: a quarter of an 80 GiB GPU's memory and of its compute (honestly labelled as this default on the page)
DEFAULT_TYPICAL_MEMORY_MIB = 20480
DEFAULT_TYPICAL_CORES = 25


@dataclass(frozen=True, slots=True)
class PodUsage:
    """What a pod's containers use, measured (device plugin metrics, through Prometheus)."""

    memory_used_mib: float
    utilization_percent: float


def _gpu_view(gpu: Gpu, raw: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "migMode": raw.get("migMode") is True,
        "index": gpu.index, "uuid": gpu.uuid, "model": gpu.model, "healthy": gpu.healthy,
        "memoryMiB": gpu.memory_mib, "usedMemoryMiB": gpu.used_memory_mib,
        "cores": gpu.cores, "usedCores": gpu.used_cores,
        "maxShares": gpu.max_shares, "usedShares": gpu.used_shares,
        "pods": list(gpu.pods),
    }


def _mig_view(raw_node: Mapping[str, Any]) -> list[dict[str, Any]]:
    """A node's static MIG devices (only nodes that have some list them); fields kept as /state spells them."""
    devices = raw_node.get("migDevices")
    if not isinstance(devices, list):
        return []
    view = []
    for device in devices:
        if not isinstance(device, dict):
            raise StateFormatError(f"state.nodes[{raw_node.get('name')}].migDevices holds {device!r}, not objects")
        view.append({key: device.get(key) for key in ("uuid", "gpuIndex", "profile", "memoryMiB", "healthy", "held")})
    return view


def typical_request(raw_assignments: list[Any]) -> tuple[int, int, bool]:
    """(memory MiB, cores, learned) of one vGPU as the running pods ask: the median over every device assigned;
    the default (learned False) when nothing is assigned."""
    memory: list[int] = []
    cores: list[int] = []
    for raw in raw_assignments:
        for container in raw.get("containers") or []:
            for device in container.get("devices") or []:
                memory.append(int(device["memoryMiB"]))
                cores.append(int(device["cores"]))
    if not memory:
        return DEFAULT_TYPICAL_MEMORY_MIB, DEFAULT_TYPICAL_CORES, False
    return int(statistics.median_low(memory)), int(statistics.median_low(cores)), True


def stranded(nodes: list[Node], raw_nodes: list[Any], memory_mib: int, cores: int) -> dict[str, Any]:
    """Free memory on healthy GPUs that cannot take one more vGPU of the typical size (too little memory or compute
    left, or no share left): capacity that is free but that such a request cannot use. GPUs in MIG mode are left
    out (their MIG devices are handed out whole, not shared)."""
    gpus = 0
    free_memory = 0
    for node, raw_node in zip(nodes, raw_nodes, strict=True):
        for gpu, raw_gpu in zip(node.gpus, raw_node["gpus"], strict=True):
            free = gpu.memory_mib - gpu.used_memory_mib
            if not gpu.healthy or free <= 0 or raw_gpu.get("migMode") is True:
                continue
            fits = free >= memory_mib and gpu.cores - gpu.used_cores >= cores and gpu.used_shares < gpu.max_shares
            if not fits:
                gpus += 1
                free_memory += free
    return {"gpus": gpus, "freeMemoryMiB": free_memory}


def _pending(quota: Mapping[str, Any] | None, raw_state: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Pending pods by reason: the quota gate's pending pods (GET /quota), gangs still waiting and preemptors
    waiting for their victims (GET /state)."""
    reasons: Counter[str] = Counter()
    if quota is not None:
        for queue in quota.get("clusterQueues") or []:
            for pod in queue.get("pending") or []:
                # grouped by queue: the gate's full reasons name amounts and differ per pod (the queues page shows them)
                if pod.get("waitingForQuota"):
                    reasons[f"waiting for quota in ClusterQueue {queue.get('name')}"] += 1
                else:
                    reasons[f"refused by ClusterQueue {queue.get('name')}: {pod.get('reason') or 'pending'}"] += 1
    for gang in raw_state.get("gangs") or []:
        if isinstance(gang, dict) and gang.get("waiting"):
            reasons[f"gang {gang.get('name')}: {gang['waiting']}"] += 1
    for nomination in raw_state.get("nominations") or []:
        if isinstance(nomination, dict):
            reasons["waiting for preemption victims to leave"] += 1
    ordered = sorted(reasons.items(), key=lambda item: (-item[1], item[0]))  # the most common reason first
    return [{"reason": reason, "count": count} for reason, count in ordered]


def _queues(quota: Mapping[str, Any]) -> list[dict[str, Any]]:
    queues = []
    for queue in quota.get("clusterQueues") or []:
        resources = [
            {"flavor": flavor.get("flavor"), "resource": r.get("resource"), "unit": r.get("unit") or "",
             "nominal": r.get("nominal"), "borrowed": r.get("borrowed"), "lent": r.get("lent"), "used": r.get("used"),
             "available": r.get("available")}
            for flavor in queue.get("flavors") or [] for r in flavor.get("resources") or []
        ]
        queues.append({
            "name": queue.get("name"), "cohort": queue.get("cohort"), "inactiveReason": queue.get("inactiveReason"),
            "admittedPods": queue.get("admittedPods"), "pendingPods": queue.get("pendingPods"),
            "waitingForQuota": queue.get("waitingForQuota"), "resources": resources,
            "pending": [{"pod": p.get("pod"), "reason": p.get("reason")} for p in queue.get("pending") or []],
            "gangs": [{"name": g.get("name"), "size": g.get("size"), "bound": g.get("bound"),
                       "waiting": g.get("waiting")} for g in queue.get("gangs") or []],
        })
    return queues


def build_view(state_doc: Any, quota_doc: Any | None, quota_error: str | None,
               usage: Mapping[str, PodUsage] | None, usage_error: str | None) -> dict[str, Any]:
    """The page's data from the extender's documents. Raises StateFormatError when /state is not an extender's."""
    nodes, pods = parse_state(state_doc)
    raw_nodes = state_doc["nodes"]
    raw_assignments = state_doc["assignments"]
    quota = quota_doc if isinstance(quota_doc, dict) else None
    if quota_doc is not None and quota is None:
        quota_error = "GET /quota did not answer a JSON object"
    gpus = [gpu for node in nodes for gpu in node.gpus]
    memory_mib, cores, learned = typical_request(raw_assignments)
    overview = {
        "nodes": len(nodes),
        "gpus": len(gpus),
        "unhealthyGpus": sum(not g.healthy for g in gpus),
        "memoryMiB": sum(g.memory_mib for g in gpus),
        "usedMemoryMiB": sum(g.used_memory_mib for g in gpus),
        "cores": sum(g.cores for g in gpus),
        "usedCores": sum(g.used_cores for g in gpus),
        "maxShares": sum(g.max_shares for g in gpus),
        "usedShares": sum(g.used_shares for g in gpus),
        "pods": len(pods),
        "stranded": {**stranded(nodes, raw_nodes, memory_mib, cores), "typicalMemoryMiB": memory_mib,
                     "typicalCores": cores, "typicalLearned": learned},
        "pending": _pending(quota, state_doc),
        "inventoryErrors": sum(1 for n in nodes if n.inventory_error),
    }
    node_views = [
        {"name": node.name, "heartbeatAgeSeconds": node.heartbeat_age_s, "inventoryError": node.inventory_error,
         "pods": node.pods, "gpus": [_gpu_view(g, r) for g, r in zip(node.gpus, raw["gpus"], strict=True)],
         "mig": _mig_view(raw)}
        for node, raw in zip(nodes, raw_nodes, strict=True)
    ]
    pod_views = []
    for pod, raw in sorted(zip(pods, raw_assignments, strict=True), key=lambda p: (p[0].namespace, p[0].name)):
        uid = raw.get("uid") if isinstance(raw.get("uid"), str) else ""
        used = usage.get(uid) if usage is not None else None
        pod_views.append({
            "namespace": pod.namespace, "name": pod.name, "uid": uid, "node": pod.node, "gpus": pod.gpus,
            "vgpus": pod.vgpus, "memoryMiB": pod.memory_mib, "cores": pod.cores, "state": pod.state,
            "usedMemoryMiB": None if used is None else round(used.memory_used_mib),
            "utilizationPercent": None if used is None else round(used.utilization_percent, 1),
        })
    return {
        "synced": bool(state_doc.get("synced", True)),
        "overview": overview,
        "nodes": node_views,
        "pods": pod_views,
        "usage": {"source": "prometheus" if usage is not None else None, "error": usage_error},
        "quota": {"available": quota is not None, "error": quota_error,
                  "mode": quota.get("mode") if quota else None,
                  "queues": _queues(quota) if quota else [],
                  "warnings": [*(quota.get("errors") or []), *(quota.get("warnings") or [])] if quota else []},
    }
