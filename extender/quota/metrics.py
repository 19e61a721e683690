"""The /quota numbers as Prometheus gauges, computed at scrape time (no cost per bind). Every metric name is
written out here (not derived from the view's JSON keys), so renaming a JSON field cannot rename a metric."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from kube_vgpu.extender.quota.views import quota_view

if TYPE_CHECKING:
    from kube_vgpu.extender.quota.gate import QuotaGate

_UNIT_NOTE = ", in the resource's unit (vGPUs, MiB, percent of a GPU, MIG devices, millicores, bytes, pods)"
#: /quota field -> (metric name, help)
QUEUE_RESOURCE_GAUGES: dict[str, tuple[str, str]] = {
    "nominal": ("kube_vgpu_quota_nominal", "ClusterQueue nominal quota"),
    "borrowingLimit": ("kube_vgpu_quota_borrowing_limit", "ClusterQueue borrowing limit (absent: none)"),
    "lendingLimit": ("kube_vgpu_quota_lending_limit", "ClusterQueue lending limit (absent: none)"),
    "used": ("kube_vgpu_quota_used", "ClusterQueue usage counted on the devices actually assigned"),
    "borrowed": ("kube_vgpu_quota_borrowed", "ClusterQueue usage above nominal"),
    "lent": ("kube_vgpu_quota_lent", "ClusterQueue unused lendable quota the rest of the cohort is using"),
    "available": ("kube_vgpu_quota_available", "ClusterQueue what can still be admitted now"),
    "limit": ("kube_vgpu_quota_limit",
              "ClusterQueue the most the queue could hold (nominal plus what the cohort could lend)"),
}
QUEUE_LABELS = ["cluster_queue", "flavor", "resource"]


class QuotaCollector(Collector):
    def __init__(self, gate: QuotaGate) -> None:
        self.gate = gate

    def collect(self) -> Iterator[GaugeMetricFamily]:
        families = {field: GaugeMetricFamily(name, text + _UNIT_NOTE, labels=QUEUE_LABELS)
                    for field, (name, text) in QUEUE_RESOURCE_GAUGES.items()}
        pending = GaugeMetricFamily("kube_vgpu_quota_pending_pods", "pods seen by filter and not admitted yet",
                                    labels=["cluster_queue"])
        waiting = GaugeMetricFamily("kube_vgpu_quota_waiting_pods", "pending pods waiting for quota",
                                    labels=["cluster_queue"])
        admitted = GaugeMetricFamily("kube_vgpu_quota_admitted_pods", "pods counted against the queue",
                                     labels=["cluster_queue"])
        errors = GaugeMetricFamily("kube_vgpu_quota_invalid_objects", "Kueue objects left out as invalid")
        # Kueue's kueue_cluster_queue_weighted_share; only with --fair-sharing (the view has no share without it)
        shares = GaugeMetricFamily("kube_vgpu_quota_weighted_share", "ClusterQueue fair-sharing weighted share "
                                   "(thousandths of what its cohort can lend, divided by its weight)",
                                   labels=["cluster_queue"])
        view: dict[str, Any] = quota_view(self.gate)
        for queue in view["clusterQueues"]:
            for flavor in queue["flavors"]:
                for resource in flavor["resources"]:
                    values = [queue["name"], flavor["flavor"], resource["resource"]]
                    for field, family in families.items():
                        if resource[field] is not None:
                            family.add_metric(values, resource[field])
            pending.add_metric([queue["name"]], queue["pendingPods"])
            waiting.add_metric([queue["name"]], queue["waitingForQuota"])
            admitted.add_metric([queue["name"]], queue["admittedPods"])
            if "fairSharing" in queue:
                shares.add_metric([queue["name"]], queue["fairSharing"]["weightedShare"])
        errors.add_metric([], len(view["errors"]))
        yield from families.values()
        yield pending
        yield waiting
        yield admitted
        yield errors
        yield shares  # declared always (no samples without --fair-sharing), as every other family here
