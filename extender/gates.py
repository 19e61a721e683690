"""The interfaces the extender's core calls its pluggable parts through, each hook declared (kube-scheduler's
plugin model: the scheduler never looks a method up by name; a part that has nothing to say implements the hook as
a no-op).

- `Gate`: an admission gate consulted by filter and bind (the quota gate implements it).
- `ClusterSource`: where the state's objects come from (live watches, or a snapshot file).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from prometheus_client.registry import Collector

    from kube_vgpu.extender.engine.model import NodeState
    from kube_vgpu.extender.gangs import GangTracker
    from kube_vgpu.extender.preemption.rules import QueueRules
    from kube_vgpu.extender.sources.watch import WatchHealth
    from kube_vgpu.protocol import PodGpuRequest


class Gate(Protocol):
    def check(self, pod: Mapping[str, Any], request: PodGpuRequest, node: NodeState) -> str | None:
        """None if the pod may use this node, else a reason (filter; no side effects)."""
        ...

    def reserve(self, pod: Mapping[str, Any], request: PodGpuRequest, node: NodeState, uid: str) -> str | None:
        """Atomically re-check and take the pod's share (bind; called under the state lock); None or a reason."""
        ...

    def observe_filter(self, pod: Mapping[str, Any], request: PodGpuRequest, passed: list[str]) -> None:
        """The whole outcome of one filter call (a gate that orders waiting pods, StrictFIFO, learns from it)."""
        ...

    def collector(self) -> Collector | None:
        """The gate's own Prometheus gauges, registered with the extender's; None for none."""
        ...

    def snapshot(self, gangs: GangTracker | None = None) -> dict[str, Any] | None:
        """The gate's JSON view for /quota (with the gangs in its queues, from the tracker); None when it has
        none."""
        ...

    def queue_rules(self) -> QueueRules | None:
        """The gate's queues as preemption's rules read them (Kueue's spec.preemption); None for a gate without
        queues (then plain PriorityClass preemption applies)."""
        ...

    def start(self) -> None:
        """Start the gate's own watches, if any (with the HTTP app)."""
        ...

    def stop(self) -> None: ...


class ClusterSource(Protocol):
    @property
    def health(self) -> Mapping[str, WatchHealth]:
        """Watch name -> how that watch is doing (/readyz, /metrics); empty for a source without watches."""
        ...

    def start(self) -> None:
        """Start feeding the state (a snapshot is complete at construction: nothing to start)."""
        ...

    def stop(self) -> None: ...
