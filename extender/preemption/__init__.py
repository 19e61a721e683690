"""The pure decision of preemption (issue 14): which pods may be victims (rules) and which to evict on a node
(victims). No I/O: carrying it out (Eviction API, nomination, events) is the caller's."""

from __future__ import annotations

from kube_vgpu.extender.preemption.rules import (
    PodFacts,
    QueueSnapshot,
    Verdict,
    may_preempt,
    reclaimable,
    snapshot_queues,
)
from kube_vgpu.extender.preemption.victims import (
    Candidate,
    GangMember,
    NoVictims,
    Victims,
    find_victims,
    pick_node,
)

__all__ = [
    "Candidate",
    "GangMember",
    "NoVictims",
    "PodFacts",
    "QueueSnapshot",
    "Verdict",
    "Victims",
    "find_victims",
    "may_preempt",
    "pick_node",
    "reclaimable",
    "snapshot_queues",
]
