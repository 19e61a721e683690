"""The /quota view (and `kube-vgpu quota status`, and the metrics): per ClusterQueue and flavor, nominal,
borrowed, lent, used and available; pending pods; cohorts; local queues; the configuration's errors and warnings."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kube_vgpu.extender.quota.objects import RESOURCE_UNITS

if TYPE_CHECKING:
    from kube_vgpu.extender.quota.gate import QuotaGate


def quota_view(gate: QuotaGate) -> dict[str, Any]:
    """JSON-ready view of the gate's queues, taken under the state lock (a consistent moment)."""
    with gate.state.lock:
        gate.resolve_unresolved()
        config = gate.config
        queues = []
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
                            "unit": RESOURCE_UNITS.get(resource, ""),
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
            })
        cohorts = []
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
        return {
            "synced": gate.synced,
            "sources": list(gate.sources),
            "unqueuedPods": gate.unqueued,
            "errors": list(config.errors),
            "warnings": list(config.warnings),
            "clusterQueues": queues,
            "cohorts": cohorts,
            "localQueues": [{"namespace": q.namespace, "name": q.name, "clusterQueue": q.cluster_queue,
                             "stopPolicy": q.stop_policy}
                            for q in sorted(config.local_queues.values(), key=lambda q: (q.namespace, q.name))],
        }
