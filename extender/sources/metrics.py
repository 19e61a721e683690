"""Metrics of how the extender keeps up with the API server: objects it could not apply, nodes whose GPU inventory
it ignores, and each watch's silence and restarts. Computed at scrape time from the state and the sources."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kube_vgpu.extender.sources.watch import WatchHealth
from kube_vgpu.extender.state import ClusterState


class SourceCollector(Collector):
    def __init__(self, state: ClusterState, watches: Mapping[str, WatchHealth] | None = None) -> None:
        self.state = state
        self.watches = dict(watches or {})

    def collect(self) -> Iterator[Metric]:
        invalid = GaugeMetricFamily(
            "kube_vgpu_node_inventory_invalid",
            "1 for each node whose GPU inventory the extender ignores (reason: /state inventoryError)",
            labels=["node"],
        )
        ingest = CounterMetricFamily(
            "kube_vgpu_extender_ingest_errors",
            "API objects whose update could not be applied and was skipped",
            labels=["kind"],
        )
        with self.state.lock:
            for node in sorted(self.state.inventory_errors):
                invalid.add_metric([node], 1)
            for kind in ("nodes", "pods", *sorted(set(self.state.ingest_errors) - {"nodes", "pods"})):
                ingest.add_metric([kind], self.state.ingest_errors.get(kind, 0))
        yield invalid
        yield ingest
        if not self.watches:
            return
        silent = GaugeMetricFamily(
            "kube_vgpu_extender_watch_silent_seconds",
            "seconds since the watch last delivered anything (events, bookmarks) or was opened",
            labels=["resource"],
        )
        restarts = CounterMetricFamily(
            "kube_vgpu_extender_watch_restarts",
            "watches opened again, by reason (stalled: silent past the progress timeout; expired; error)",
            labels=["resource", "reason"],
        )
        for resource, health in sorted(self.watches.items()):
            seconds = health.silent_for_s()
            if seconds is not None:
                silent.add_metric([resource], seconds)
            counts = dict(health.restarts)
            for reason in ("stalled", "expired", "error"):
                restarts.add_metric([resource, reason], counts.get(reason, 0))
        yield silent
        yield restarts
