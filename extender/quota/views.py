"""The /quota view (and `kube-vgpu quota status`, and the metrics): per ClusterQueue and flavor, nominal,
borrowed, lent, used and available; pending pods; the gangs in each queue; cohorts; local queues; the
configuration's errors and warnings."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from kube_vgpu import protocol
from kube_vgpu.extender.gangs import gang_summary
from kube_vgpu.extender.quota.fairsharing import dominant_resource_share
from kube_vgpu.extender.quota.mig import resource_unit
from kube_vgpu.extender.quota.objects import RESOURCE_CPU, RESOURCE_MEMORY, RESOURCE_PODS, RESOURCE_UNITS
from kube_vgpu.extender.quota.usage import GPU_RESOURCES, pod_info, request_counts, request_usage_fixed
from kube_vgpu.protocol import InvalidGpuRequest

if TYPE_CHECKING:
    from kube_vgpu.extender.gangs import Gang, GangTracker, Member
    from kube_vgpu.extender.quota.gate import QuotaGate
    from kube_vgpu.extender.quota.objects import ClusterQueue


def _member_labels(gate: QuotaGate, member: Member) -> Mapping[str, str]:
    """A member's labels: from its pod object, or from the state's record for a member known only as bound."""
    labels = (member.pod.get("metadata") or {}).get("labels")
    if labels is None:
        record = gate.state.pods.get(member.uid)
        labels = record.labels if record is not None else {}
    return labels


def _gang_quota(gate: QuotaGate, cluster_queue: ClusterQueue, members: list[Member]) -> dict[str, Any]:
    """What the gang's members in this queue ask of it, in the resources it covers: a counted member (bound, or
    reserved by the gang's plan) what the gate charged it; a pending one its request. A GPU ask that depends on
    the node (gpumem-percentage, whole GPUs) is left out of the sums, its resources listed in dependsOnNode."""
    covered = cluster_queue.covered_resources
    totals: dict[str, int] = {}
    depends_on_node: set[str] = set()
    now_s = gate.state.clock()
    for member in members:
        charge = gate.charges.get(member.uid)
        if charge is not None:
            asked = dict(charge.resources)
        else:
            try:
                request = protocol.parse_pod_gpu_request(member.pod)
            except InvalidGpuRequest:
                request = None  # filter says why, to the pod's owner
            fixed = request_usage_fixed(request) if request is not None else None
            if fixed is None:
                # MiB and cores depend on the node's GPUs (a MIG device's MiB on its node's devices); the vGPU and
                # MIG device counts do not
                depends_on_node.update(r for r in GPU_RESOURCES[1:] if r in covered)
                fixed = request_counts(request) if request is not None else {}
            info = pod_info(member.pod, now_s)
            asked = {**fixed, RESOURCE_CPU: info.cpu_milli, RESOURCE_MEMORY: info.memory_bytes, RESOURCE_PODS: 1}
        for resource, amount in asked.items():
            if resource in covered and amount > 0:
                totals[resource] = totals.get(resource, 0) + amount
    return {
        "resources": [{"resource": r, "unit": resource_unit(r, RESOURCE_UNITS), "amount": totals[r]}
                      for r in sorted(totals)],
        "dependsOnNode": sorted(depends_on_node),
    }


def _gang_entry(gang: Gang) -> dict[str, Any]:
    return {**gang_summary(gang), "planned": sum(1 for uid in gang.plan if uid in gang.members)}


def gangs_by_queue(gate: QuotaGate, tracker: GangTracker) -> tuple[dict[str, list[dict[str, Any]]],
                                                                   list[dict[str, Any]]]:
    """(ClusterQueue name -> its gangs, the gangs in no queue); caller holds the state lock. A member's queue is
    the gate's own answer (cluster_queue_of), so /quota groups gangs as quota counts them. Counts are the whole
    gang's; `membersInQueue` and `quota` are of the members in that queue (Kueue wants a group in one queue: a
    gang split over queues shows under each)."""
    by_queue: dict[str, list[dict[str, Any]]] = {}
    unqueued: list[dict[str, Any]] = []
    for key in sorted(tracker.gangs):
        gang = tracker.gangs[key]
        members_by_queue: dict[str, tuple[ClusterQueue, list[Member]]] = {}
        outside = 0
        for member in sorted(gang.members.values(), key=lambda m: (m.created, m.name)):
            cluster_queue = gate.cluster_queue_of(member.uid, key.namespace, _member_labels(gate, member))
            if cluster_queue is None:
                outside += 1
                continue
            members_by_queue.setdefault(cluster_queue.name, (cluster_queue, []))[1].append(member)
        for name, (cluster_queue, members) in members_by_queue.items():
            by_queue.setdefault(name, []).append({**_gang_entry(gang), "membersInQueue": len(members),
                                                  "quota": _gang_quota(gate, cluster_queue, members)})
        if outside:
            unqueued.append(_gang_entry(gang))
    return by_queue, unqueued


def weight_text(weight_milli: int) -> str:
    """A weight in thousandths as the quantity one would write ("1", "0.5", "2.25")."""
    whole, milli = divmod(weight_milli, 1000)
    return str(whole) if not milli else f"{whole}.{milli:03d}".rstrip("0")


def _fair_sharing(gate: QuotaGate, kind: str, name: str, weights: Mapping[tuple[str, str], int]) -> dict[str, Any]:
    """Kueue's status.fairSharing (weightedShare) and the weight it was divided by."""
    weight = weights.get((kind, name), 1000)
    share = dominant_resource_share(gate.tree, (kind, name), weight)
    return {"weight": weight_text(weight), "weightedShare": share.value, "dominantResource": share.resource}


def kueue_controller_warnings(gate: QuotaGate) -> list[str]:
    """Quota mode enforce with Kueue's controller running after all (installed after the extender started, or
    forced): only Kueue's controller writes a ClusterQueue's status conditions, so a queue that has them says so."""
    names = sorted(key[1] for key, obj in gate.cluster_documents.get("ClusterQueue", {}).items()
                   if any(c.get("type") == "Active" for c in ((obj.get("status") or {}).get("conditions") or [])
                          if isinstance(c, Mapping)))
    if not names:
        return []
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return [f"ClusterQueue {shown} carries status written by Kueue's controller: Kueue admits too, beside this "
            "gate (quota mode enforce); two admission layers. Restart the extender with --quota-mode=auto or kueue "
            "(docs/quota.md#quota-modes-who-admits---quota-mode)"]


def quota_view(gate: QuotaGate, gangs: GangTracker | None = None) -> dict[str, Any]:
    """JSON-ready view of the gate's queues (and of the tracker's gangs), taken under the state lock (a
    consistent moment: the gangs are the scheduler's, kept under the same lock)."""
    with gate.state.lock:
        gate.resolve_unresolved()
        config = gate.config
        queue_gangs, unqueued_gangs = gangs_by_queue(gate, gangs) if gangs is not None else ({}, [])
        queues: list[dict[str, Any]] = []
        weights = gate.weights if gate.fair_sharing else {}  # read from the config at its last reload
        for cluster_queue in sorted(config.cluster_queues.values(), key=lambda q: q.name):
            pending = sorted((p for p in gate.pending.values() if p.cluster_queue == cluster_queue.name),
                             key=lambda p: p.order)
            charges = [c for c in gate.charges.values() if c.cluster_queue == cluster_queue.name]
            flavors = []
            for group in cluster_queue.resource_groups:
                for flavor_quotas in group.flavors:
                    resources = []
                    for resource, _ in flavor_quotas.resources:
                        status = gate.tree.status(cluster_queue.name, (flavor_quotas.name, resource))
                        resources.append({
                            "resource": resource,
                            "unit": resource_unit(resource, RESOURCE_UNITS),
                            "nominal": status.nominal,
                            "borrowingLimit": status.borrowing_limit,
                            "lendingLimit": status.lending_limit,
                            "used": status.used,
                            "borrowed": status.borrowed,
                            "lent": status.lent,
                            "available": status.available,
                            "limit": status.potential,
                        })
                    flavors.append({"flavor": flavor_quotas.name, "resources": resources})
            queues.append({
                "name": cluster_queue.name,
                "cohort": cluster_queue.cohort,
                "queueingStrategy": cluster_queue.queueing_strategy,
                "stopPolicy": cluster_queue.stop_policy,
                "inactiveReason": gate.inactive_reason(cluster_queue),
                "admittedPods": sum(1 for c in charges if c.counted),
                "uncountedPods": [{"pod": f"{c.namespace}/{c.name}", "problem": c.problem}
                                  for c in charges if not c.counted],
                "pendingPods": len(pending),
                "waitingForQuota": sum(1 for p in pending if p.waiting_for_quota),
                "flavors": flavors,
                "pending": [{"pod": f"{p.namespace}/{p.name}", "priority": p.priority,
                             "waitingForQuota": p.waiting_for_quota, "reason": p.reason}
                            for p in pending[:100]],
                "gangs": queue_gangs.get(cluster_queue.name, []),
            })
            if gate.fair_sharing:  # only then: without --fair-sharing no share decides anything
                queues[-1]["fairSharing"] = _fair_sharing(gate, "ClusterQueue", cluster_queue.name, weights)
        cohorts: list[dict[str, Any]] = []
        cohort_names = sorted({k[1] for k in gate.tree.parent if k[0] == "Cohort"})
        all_frs = sorted({fr for quotas in gate.tree.quotas.values() for fr in quotas})
        for name in cohort_names:
            totals = []
            for fr in all_frs:
                subtree, usage = gate.tree.cohort_totals(name, fr)
                if subtree or usage:
                    totals.append({"flavor": fr[0], "resource": fr[1], "subtreeQuota": subtree, "usage": usage})
            parent = gate.tree.parent.get(("Cohort", name))
            cohorts.append({"name": name, "parent": parent[1] if parent else None,
                            "inCycle": name in gate.tree.cyclic, "resources": totals})
            if gate.fair_sharing:
                cohorts[-1]["fairSharing"] = _fair_sharing(gate, "Cohort", name, weights)
        return {
            "mode": "enforce",
            "synced": gate.synced,
            "sources": list(gate.sources),
            "unqueuedPods": gate.unqueued,
            "fairSharing": gate.fair_sharing,
            "unqueuedGangs": unqueued_gangs,
            "errors": list(config.errors),
            "warnings": [*config.warnings, *kueue_controller_warnings(gate)],
            "clusterQueues": queues,
            "cohorts": cohorts,
            "localQueues": [{"namespace": q.namespace, "name": q.name, "clusterQueue": q.cluster_queue,
                             "stopPolicy": q.stop_policy}
                            for q in sorted(config.local_queues.values(), key=lambda q: (q.namespace, q.name))],
        }
