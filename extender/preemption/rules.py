"""May this running pod be preempted for that pending one? Kueue's per-ClusterQueue rules (spec.preemption) and,
for pods outside any queue, kube-scheduler's PriorityClass rule. Pure: the caller passes a snapshot of the quota.

Kueue's rules (pkg/scheduler/preemption), for a preemptor in ClusterQueue P and a candidate in ClusterQueue C:
  * C == P: withinClusterQueue. LowerPriority: strictly lower priority. LowerOrNewerEqualPriority: lower, or equal
    and created after the preemptor. Never: none.
  * C != P, same cohort tree: only while C borrows (uses above its nominal quota) a resource the preemptor needs.
    If P is within its nominal quota once the preemptor is admitted, reclaimWithinCohort decides (Any: any
    priority; LowerPriority: strictly lower). Otherwise P would borrow: only borrowWithinCohort LowerPriority allows
    it, for strictly lower priority at or below maxPriorityThreshold.
  * C in another cohort (or no cohort): never by quota rules.
  * With --fair-sharing (QueueSnapshot.fair_sharing), for C != P in one cohort tree the within-nominal and
    borrowWithinCohort tests give way to Kueue's fair-sharing strategies (preemption/fairsharing.py): here only
    the candidates are named (C borrows what P needs; reclaimWithinCohort Any, or LowerPriority and lower).
Pods outside any queue (preemptor or candidate): plain priority, strictly lower, and a preemptor with
preemptionPolicy Never preempts nothing (kube-scheduler's DefaultPreemption). Kueue ignores preemptionPolicy for
its own quota preemption, and so do the queue rules here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from kube_vgpu.extender.quota.accounting import CQ, FlavorResource, NodeKey, QuotaTree
from kube_vgpu.extender.quota.objects import (
    ANY,
    LOWER_OR_NEWER_EQUAL_PRIORITY,
    LOWER_PRIORITY,
    NEVER,
    Preemption,
)

if TYPE_CHECKING:
    from kube_vgpu.extender.engine.model import NodeState
    from kube_vgpu.protocol import PodGpuRequest


@dataclass(frozen=True, slots=True)
class PodFacts:
    """What the rules read of a pod. created_s: creation time (Kueue's "newer" compares it)."""

    uid: str
    priority: int
    created_s: float
    cluster_queue: str | None = None  # None: outside any queue
    #: spec.preemptionPolicy is Never (only the preemptor's matters)
    never_preempts: bool = False


@dataclass(frozen=True, slots=True)
class QueueSnapshot:
    """The quota facts the rules need, at decision time (build it with snapshot_queues)."""

    #: ClusterQueue -> its queue's spec.preemption
    preemption: Mapping[str, Preemption] = field(default_factory=dict)
    #: ClusterQueue -> root of its cohort tree (None: no cohort); queues under one root share quota
    cohort_root: Mapping[str, str | None] = field(default_factory=dict)
    #: ClusterQueue -> (flavor, resource) -> amount used above nominal (only positive amounts)
    borrowed: Mapping[str, Mapping[FlavorResource, int]] = field(default_factory=dict)
    #: the preemptor's queue stays within its nominal quota once the preemptor is admitted
    preemptor_within_nominal: bool = True
    #: what the preemptor needs, per (flavor, resource): reclaim only from queues borrowing one of these
    needs: Mapping[FlavorResource, int] = field(default_factory=dict)
    #: --fair-sharing: between queues of a cohort, Kueue's fair-sharing strategies (preemption/fairsharing.py)
    #: decide instead of the within-nominal / borrowWithinCohort test; may_preempt only names the candidates
    fair_sharing: bool = False
    #: (kind, name) -> fairSharing.weight in thousandths (read with fair_sharing)
    weights: Mapping[NodeKey, int] = field(default_factory=dict)
    #: Kueue's fairSharing.preemptionStrategies, in order (empty: its default pair)
    strategies: tuple[str, ...] = ()


class QueueRules(Protocol):
    """What the rules need of a quota gate's queues (Gate.queue_rules)."""

    def queue_of(self, uid: str, namespace: str, labels: Mapping[str, str]) -> str | None:
        """The ClusterQueue a pod is in; None outside any queue."""
        ...

    def snapshot(self, preemptor_queue: str | None, needs: Mapping[FlavorResource, int] | None = None) -> QueueSnapshot:
        """The queues' preemption policies, cohorts and borrowing, as of now (`needs`: the preemptor's, when it
        waits for quota: what reclaim may take back)."""
        ...

    def needs_on(self, pod: Mapping[str, Any], request: PodGpuRequest,
                 node: NodeState) -> tuple[str, dict[FlavorResource, int]] | None:
        """The pod's ClusterQueue and what it would be counted for on this node; None when no queue manages it."""
        ...

    def tree(self) -> QuotaTree:
        """The quota tree as of now (callers clone it before changing anything)."""
        ...

    def charges(self) -> list[QueueCharge]:
        """Every counted pod: (uid, ClusterQueue, amounts, priority, created_s)."""
        ...

    def hold(self, uid: str, cluster_queue: str, amounts: Mapping[FlavorResource, int]) -> None:
        """Count a nominated preemptor's needs in its queue until released: the quota its victims free is its."""
        ...

    def release(self, uid: str) -> None: ...


@dataclass(frozen=True, slots=True)
class QueueCharge:
    uid: str
    cluster_queue: str
    amounts: Mapping[FlavorResource, int]
    priority: int
    created_s: float


@dataclass(frozen=True, slots=True)
class Verdict:
    allowed: bool
    rule: str  # for events: which rule allowed or refused it, and why


def snapshot_queues(
    tree: QuotaTree,
    preemption: Mapping[str, Preemption],
    preemptor_queue: str | None,
    needs: Mapping[FlavorResource, int],
    *,
    fair_sharing: bool = False,
    weights: Mapping[NodeKey, int] | None = None,
    strategies: tuple[str, ...] = (),
) -> QueueSnapshot:
    """The snapshot from the quota tree (usage as of now, the preemptor not yet counted)."""
    borrowed: dict[str, dict[FlavorResource, int]] = {}
    for name, usage in tree.usage.items():
        over = {fr: used - tree.quota((CQ, name), fr).nominal for fr, used in usage.items()}
        over = {fr: amount for fr, amount in over.items() if amount > 0}
        if over:
            borrowed[name] = over
    within = True
    if preemptor_queue is not None:
        key = (CQ, preemptor_queue)
        usage = tree.usage.get(preemptor_queue, {})
        within = all(usage.get(fr, 0) + need <= tree.quota(key, fr).nominal for fr, need in needs.items() if need > 0)
    queues = [key[1] for key in tree.parent if key[0] == CQ]
    return QueueSnapshot(
        preemption=dict(preemption),
        cohort_root={name: tree.root_of(name) for name in queues},
        borrowed=borrowed,
        preemptor_within_nominal=within,
        needs=dict(needs),
        fair_sharing=fair_sharing,
        weights=dict(weights or {}),
        strategies=strategies,
    )


def _plain(preemptor: PodFacts, candidate: PodFacts) -> Verdict:
    if preemptor.never_preempts:
        return Verdict(False, "priority: the preemptor's preemptionPolicy is Never")
    if candidate.priority < preemptor.priority:
        return Verdict(True, f"priority: {candidate.priority} is lower than {preemptor.priority}")
    return Verdict(False, f"priority: {candidate.priority} is not lower than {preemptor.priority}")


def _within_queue(policy: str, preemptor: PodFacts, candidate: PodFacts) -> Verdict:
    queue = preemptor.cluster_queue
    lower = candidate.priority < preemptor.priority
    if policy == LOWER_PRIORITY and lower:
        return Verdict(True, f"withinClusterQueue: {queue}, priority {candidate.priority} < {preemptor.priority}")
    if policy == LOWER_OR_NEWER_EQUAL_PRIORITY:
        if lower:
            return Verdict(True, f"withinClusterQueue: {queue}, priority {candidate.priority} < {preemptor.priority}")
        if candidate.priority == preemptor.priority and candidate.created_s > preemptor.created_s:
            return Verdict(True, f"withinClusterQueue: {queue}, equal priority and newer than the preemptor")
    return Verdict(False, f"withinClusterQueue {policy}: {queue} does not allow preempting this pod")


def _describe(borrowed: Mapping[FlavorResource, int]) -> str:
    return ", ".join(f"{amount} {resource} ({flavor})" for (flavor, resource), amount in sorted(borrowed.items()))


def _in_cohort(policy: Preemption, preemptor: PodFacts, candidate: PodFacts, queues: QueueSnapshot) -> Verdict:
    theirs = candidate.cluster_queue
    # only what the victim's queue borrows in resources the preemptor needs can come back to the preemptor
    borrowed = {fr: n for fr, n in queues.borrowed.get(theirs or "", {}).items() if queues.needs.get(fr, 0) > 0}
    if not borrowed:
        return Verdict(False, f"cohort: {theirs} does not borrow what the preemptor needs")
    lower = candidate.priority < preemptor.priority
    if queues.fair_sharing:
        return _fair_candidate(policy, preemptor, candidate, borrowed)
    if queues.preemptor_within_nominal:
        reclaim = policy.reclaim_within_cohort
        if reclaim == ANY or (reclaim == LOWER_PRIORITY and lower):
            return Verdict(True, f"reclaimWithinCohort: {theirs} borrows {_describe(borrowed)} above its nominal "
                                 f"quota")
        return Verdict(False, f"reclaimWithinCohort {reclaim}: {preemptor.cluster_queue} may not take back from "
                              f"this pod")
    if policy.borrow_within_cohort != LOWER_PRIORITY or not lower:
        return Verdict(False, f"borrowWithinCohort {policy.borrow_within_cohort}: {preemptor.cluster_queue} would "
                              f"borrow and may not preempt this pod")
    threshold = policy.max_priority_threshold
    if threshold is not None and candidate.priority > threshold:
        return Verdict(False, f"borrowWithinCohort: priority {candidate.priority} is above maxPriorityThreshold "
                              f"{threshold}")
    return Verdict(True, f"borrowWithinCohort: {theirs} borrows {_describe(borrowed)} above its nominal quota, "
                         f"priority {candidate.priority} < {preemptor.priority}")


def _fair_candidate(policy: Preemption, preemptor: PodFacts, candidate: PodFacts,
                    borrowed: Mapping[FlavorResource, int]) -> Verdict:
    """With fair sharing, Kueue's candidates in the cohort: pods of queues borrowing what the preemptor needs, of
    lower priority unless reclaimWithinCohort is Any. Whether each goes is the shares' decision
    (fairsharing.fair_quota_victims, where borrowWithinCohort's priority bound also applies), not this one's."""
    theirs = candidate.cluster_queue
    lower = candidate.priority < preemptor.priority
    if policy.reclaim_within_cohort == ANY or lower:
        return Verdict(True, f"fairSharing: {theirs} borrows {_describe(borrowed)} above its nominal quota; "
                             f"shares decide")
    return Verdict(False, f"reclaimWithinCohort {policy.reclaim_within_cohort}: priority {candidate.priority} is "
                          f"not lower than {preemptor.priority}")


def reclaimable(preemptor: PodFacts, queues: QueueSnapshot) -> dict[str, dict[FlavorResource, int]]:
    """For the victim search's bound (victims.find_victims): each queue of the preemptor's cohort whose pods the
    cohort rules allow, with what it borrows in resources the preemptor needs. Only that much may be taken from it:
    its pods within its nominal quota stay, as in Kueue."""
    ours = preemptor.cluster_queue
    if ours is None or queues.cohort_root.get(ours) is None:
        return {}
    root = queues.cohort_root[ours]
    return {
        name: {fr: n for fr, n in borrowed.items() if queues.needs.get(fr, 0) > 0}
        for name, borrowed in queues.borrowed.items()
        if name != ours and queues.cohort_root.get(name) == root
    }


def may_preempt(preemptor: PodFacts, candidate: PodFacts, queues: QueueSnapshot) -> Verdict:
    """Whether `candidate` may be a victim of `preemptor`, and the rule that says so (or refuses)."""
    if candidate.uid == preemptor.uid:
        return Verdict(False, "the preemptor itself")
    ours, theirs = preemptor.cluster_queue, candidate.cluster_queue
    if ours is None or theirs is None:
        return _plain(preemptor, candidate)
    policy = queues.preemption.get(ours, Preemption())
    if ours == theirs:
        return _within_queue(policy.within_cluster_queue, preemptor, candidate)
    root = queues.cohort_root.get(ours)
    if root is None or queues.cohort_root.get(theirs) != root:
        return Verdict(False, f"cohort: {theirs} is not in {ours}'s cohort")
    if policy.reclaim_within_cohort == NEVER:
        return Verdict(False, f"reclaimWithinCohort Never: {ours} never preempts in its cohort")
    return _in_cohort(policy, preemptor, candidate, queues)
