"""Hypothesis property (issue 14): whatever the queues' spec.preemption and usage, a pod is never allowed as a victim
of equal or higher priority than the rules allow: strictly lower priority, except an equal-priority newer pod of
the same queue under LowerOrNewerEqualPriority and a borrowing queue's pod under reclaimWithinCohort Any; never
across cohorts; never with Kueue's defaults; never by a preemptor with preemptionPolicy Never outside the queues."""

from __future__ import annotations

from hypothesis import event, given, settings
from hypothesis import strategies as st

from kube_vgpu.extender.preemption import PodFacts, QueueSnapshot, may_preempt
from kube_vgpu.extender.quota.objects import (
    BORROW_WITHIN_COHORT_POLICIES,
    RECLAIM_WITHIN_COHORT_POLICIES,
    WITHIN_CLUSTER_QUEUE_POLICIES,
    Preemption,
)

GPU = ("a100", "nvidia.com/gpu")
MEM = ("a100", "nvidia.com/gpumem")
QUEUES = ["a", "b", "b", "b", "c", None]  # the preemptor is mostly in a; b shares its cohort
ROOTS = {"a": "ai", "b": "ai", "c": "web"}


@st.composite
def preemptions(draw: st.DrawFn) -> Preemption:
    reclaim = draw(st.sampled_from(RECLAIM_WITHIN_COHORT_POLICIES))
    borrow = "Never" if reclaim == "Never" else draw(st.sampled_from(BORROW_WITHIN_COHORT_POLICIES))
    return Preemption(draw(st.sampled_from(WITHIN_CLUSTER_QUEUE_POLICIES)), reclaim, borrow,
                      draw(st.one_of(st.none(), st.integers(-2, 6))))


PREEMPTORS = st.builds(lambda p, t, q, never: PodFacts("me", p, float(t), q, never),
                       st.integers(-2, 6), st.integers(0, 3), st.sampled_from(["a", "a", "a", None]), st.booleans())
CANDIDATES = st.builds(lambda uid, p, t, q: PodFacts(uid, p, float(t), q),
                       st.sampled_from(["them", "them", "them", "me"]), st.integers(-2, 6), st.integers(0, 3),
                       st.sampled_from(QUEUES))
SNAPSHOTS = st.builds(
    lambda a, others, borrowed, within, needs: QueueSnapshot({"a": a, **others}, ROOTS, borrowed, within, needs),
    preemptions(),
    st.dictionaries(st.sampled_from(["b", "c"]), preemptions()),
    st.dictionaries(st.sampled_from(["a", "b", "b", "c"]), st.dictionaries(st.sampled_from([GPU, MEM]),
                                                                           st.integers(1, 4))),
    st.booleans(),
    st.dictionaries(st.sampled_from([GPU, MEM]), st.integers(1, 4), min_size=1),
)


@settings(max_examples=600, deadline=None, derandomize=True, database=None)
@given(PREEMPTORS, CANDIDATES, SNAPSHOTS)
def test_never_a_victim_the_rules_do_not_allow(preemptor: PodFacts, candidate: PodFacts, queues: QueueSnapshot) -> None:
    verdict = may_preempt(preemptor, candidate, queues)
    assert verdict.rule
    event(f"allowed by {verdict.rule.split(':')[0]}" if verdict.allowed else "refused")
    if not verdict.allowed:
        return
    assert candidate.uid != preemptor.uid
    ours, theirs = preemptor.cluster_queue, candidate.cluster_queue
    lower = candidate.priority < preemptor.priority
    if ours is None or theirs is None:
        assert lower and not preemptor.never_preempts
        return
    policy = queues.preemption.get(ours, Preemption())
    assert policy != Preemption()  # Kueue's defaults preempt nothing
    if ours == theirs:
        newer_equal = candidate.priority == preemptor.priority and candidate.created_s > preemptor.created_s
        assert (lower and policy.within_cluster_queue != "Never") or (
            newer_equal and policy.within_cluster_queue == "LowerOrNewerEqualPriority")
        return
    assert ROOTS[ours] == ROOTS[theirs]
    assert any(queues.needs.get(fr, 0) > 0 for fr in queues.borrowed.get(theirs, {}))  # only from a borrower
    if queues.preemptor_within_nominal:
        assert policy.reclaim_within_cohort == "Any" or (policy.reclaim_within_cohort == "LowerPriority" and lower)
    else:
        assert policy.borrow_within_cohort == "LowerPriority" and lower
        threshold = policy.max_priority_threshold
        assert threshold is None or candidate.priority <= threshold
