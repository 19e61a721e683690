"""Which pods may be victims: Kueue's ClusterQueue spec.preemption and plain PriorityClass preemption, as tables;
and spec.preemption read from Kueue's YAML with its validation."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from kube_vgpu.extender.preemption import PodFacts, QueueSnapshot, may_preempt, snapshot_queues
from kube_vgpu.extender.quota.accounting import QuotaTree
from kube_vgpu.extender.quota.objects import Preemption, QuotaConfigError, build_config, parse_object

GPU = ("a100", "nvidia.com/gpu")
MEM = ("a100", "nvidia.com/gpumem")

P = Preemption  # short, for the tables


def snapshot(policy: Preemption, *, within_nominal: bool = True,
             borrowed: dict[str, dict[tuple[str, str], int]] | None = None) -> QueueSnapshot:
    """Queues a and b in cohort "ai", c alone; the preemptor is in a and needs GPUs."""
    return QueueSnapshot(
        preemption={"a": policy},
        cohort_root={"a": "ai", "b": "ai", "c": None},
        borrowed={"b": {GPU: 4}} if borrowed is None else borrowed,
        preemptor_within_nominal=within_nominal,
        needs={GPU: 1},
    )


def me(priority: int = 5, queue: str | None = "a", *, never: bool = False) -> PodFacts:
    return PodFacts("me", priority, created_s=100.0, cluster_queue=queue, never_preempts=never)


def them(priority: int, queue: str | None, created_s: float = 50.0) -> PodFacts:
    return PodFacts("them", priority, created_s, queue)


CASES: list[tuple[str, Preemption, dict[str, Any], PodFacts, PodFacts, bool, str]] = [
    # (id, preemptor queue's policy, snapshot options, preemptor, candidate, allowed, rule fragment)
    # Kueue's defaults: nothing
    ("defaults-same-queue", P(), {}, me(), them(1, "a"), False, "withinClusterQueue Never"),
    ("defaults-cohort", P(), {}, me(), them(1, "b"), False, "reclaimWithinCohort Never"),
    # withinClusterQueue
    ("within-lower", P("LowerPriority"), {}, me(), them(4, "a"), True, "withinClusterQueue: a, priority 4 < 5"),
    ("within-lower-equal", P("LowerPriority"), {}, me(), them(5, "a", 200.0), False, "withinClusterQueue"),
    ("within-newer-equal", P("LowerOrNewerEqualPriority"), {}, me(), them(5, "a", 200.0), True,
     "equal priority and newer"),
    ("within-older-equal", P("LowerOrNewerEqualPriority"), {}, me(), them(5, "a", 50.0), False,
     "withinClusterQueue LowerOrNewerEqualPriority"),
    ("within-newer-lower", P("LowerOrNewerEqualPriority"), {}, me(), them(1, "a", 50.0), True, "priority 1 < 5"),
    ("within-higher", P("LowerOrNewerEqualPriority"), {}, me(), them(6, "a", 200.0), False, "withinClusterQueue"),
    # reclaimWithinCohort (preemptor within nominal)
    ("reclaim-any-higher", P(reclaim_within_cohort="Any"), {}, me(), them(9, "b"), True,
     "reclaimWithinCohort: b borrows 4 nvidia.com/gpu (a100) above its nominal quota"),
    ("reclaim-lower", P(reclaim_within_cohort="LowerPriority"), {}, me(), them(4, "b"), True,
     "reclaimWithinCohort: b borrows"),
    ("reclaim-lower-equal", P(reclaim_within_cohort="LowerPriority"), {}, me(), them(5, "b"), False,
     "reclaimWithinCohort LowerPriority"),
    ("reclaim-not-borrowing", P(reclaim_within_cohort="Any"), {"borrowed": {}}, me(), them(1, "b"), False,
     "b does not borrow"),
    ("reclaim-borrows-other-resource", P(reclaim_within_cohort="Any"), {"borrowed": {"b": {MEM: 1024}}}, me(),
     them(1, "b"), False, "does not borrow what the preemptor needs"),
    ("other-cohort", P(reclaim_within_cohort="Any"), {}, me(), them(1, "c"), False, "c is not in a's cohort"),
    # the preemptor would borrow: only borrowWithinCohort
    ("borrowing-reclaim-only", P(reclaim_within_cohort="Any"), {"within_nominal": False}, me(), them(1, "b"),
     False, "borrowWithinCohort Never"),
    ("borrow-lower", P(reclaim_within_cohort="Any", borrow_within_cohort="LowerPriority"),
     {"within_nominal": False}, me(), them(4, "b"), True, "borrowWithinCohort: b borrows"),
    ("borrow-equal", P(reclaim_within_cohort="Any", borrow_within_cohort="LowerPriority"),
     {"within_nominal": False}, me(), them(5, "b"), False, "borrowWithinCohort LowerPriority"),
    ("borrow-at-threshold", P(reclaim_within_cohort="Any", borrow_within_cohort="LowerPriority",
                              max_priority_threshold=3), {"within_nominal": False}, me(), them(3, "b"), True,
     "borrowWithinCohort"),
    ("borrow-above-threshold", P(reclaim_within_cohort="Any", borrow_within_cohort="LowerPriority",
                                 max_priority_threshold=3), {"within_nominal": False}, me(), them(4, "b"), False,
     "above maxPriorityThreshold 3"),
    # pods outside any queue: plain priority
    ("plain-lower", P(), {}, me(queue=None), them(4, None), True, "priority: 4 is lower than 5"),
    ("plain-equal", P(), {}, me(queue=None), them(5, None), False, "not lower"),
    ("plain-never", P(), {}, me(queue=None, never=True), them(1, None), False, "preemptionPolicy is Never"),
    ("queued-preemptor-unqueued-victim", P(), {}, me(), them(1, None), True, "priority: 1 is lower"),
    ("unqueued-preemptor-queued-victim", P(), {}, me(queue=None), them(6, "a"), False, "not lower"),
]


@pytest.mark.parametrize(("policy", "options", "preemptor", "candidate", "allowed", "rule"),
                         [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_rules_table(policy: Preemption, options: dict[str, Any], preemptor: PodFacts, candidate: PodFacts,
                     allowed: bool, rule: str) -> None:
    verdict = may_preempt(preemptor, candidate, snapshot(policy, **options))
    assert verdict.allowed is allowed, verdict
    assert rule in verdict.rule, verdict.rule


def test_never_itself() -> None:
    assert not may_preempt(me(), me(), snapshot(P("LowerOrNewerEqualPriority"))).allowed


QUOTA = """
apiVersion: kueue.x-k8s.io/v1beta1
kind: ClusterQueue
metadata: {name: team-a}
spec:
  cohort: ai
  preemption: {reclaimWithinCohort: Any, withinClusterQueue: LowerPriority}
  resourceGroups:
  - coveredResources: [nvidia.com/gpu]
    flavors:
    - name: a100
      resources: [{name: nvidia.com/gpu, nominalQuota: 4}]
---
apiVersion: kueue.x-k8s.io/v1beta1
kind: ClusterQueue
metadata: {name: team-b}
spec:
  cohort: ai
  resourceGroups:
  - coveredResources: [nvidia.com/gpu]
    flavors:
    - name: a100
      resources: [{name: nvidia.com/gpu, nominalQuota: 4}]
"""


@pytest.mark.parametrize(("a_uses", "need", "within"), [(0, 4, True), (2, 2, True), (2, 3, False)])
def test_snapshot_from_the_quota_tree(a_uses: int, need: int, within: bool) -> None:
    """team-b borrows all of team-a's lendable GPUs; team-a reclaims them while it stays within its nominal 4."""
    config = build_config(("q.yaml", d) for d in yaml.safe_load_all(QUOTA))
    assert config.errors == []
    tree = QuotaTree(config.cluster_queues.values(), config.cohorts.values())
    tree.add("team-b", {GPU: 8 - a_uses})
    tree.add("team-a", {GPU: a_uses})
    queues = snapshot_queues(tree, {n: q.preemption for n, q in config.cluster_queues.items()}, "team-a",
                             {GPU: need})
    assert queues.cohort_root == {"team-a": "ai", "team-b": "ai"}
    assert queues.borrowed == {"team-b": {GPU: 4 - a_uses}}
    assert queues.preemptor_within_nominal is within
    verdict = may_preempt(PodFacts("p", 0, 1.0, "team-a"), PodFacts("v", 100, 0.0, "team-b"), queues)
    assert verdict.allowed is within, verdict
    if within:
        assert verdict.rule == f"reclaimWithinCohort: team-b borrows {4 - a_uses} nvidia.com/gpu (a100) above its " \
                               f"nominal quota"


def queue_with(preemption: str) -> dict[str, Any]:
    return dict(yaml.safe_load(f"""
apiVersion: kueue.x-k8s.io/v1beta2
kind: ClusterQueue
metadata: {{name: q}}
spec:
  preemption: {preemption}
"""))


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("null", P()),
        ("{}", P()),
        ("{withinClusterQueue: LowerOrNewerEqualPriority}", P("LowerOrNewerEqualPriority")),
        ("{reclaimWithinCohort: LowerPriority, borrowWithinCohort: {policy: LowerPriority}}",
         P(reclaim_within_cohort="LowerPriority", borrow_within_cohort="LowerPriority")),
        ("{reclaimWithinCohort: Any, borrowWithinCohort: {policy: LowerPriority, maxPriorityThreshold: -5}}",
         P(reclaim_within_cohort="Any", borrow_within_cohort="LowerPriority", max_priority_threshold=-5)),
    ],
)
def test_preemption_parsed(text: str, expected: Preemption) -> None:
    assert parse_object(queue_with(text)).preemption == expected


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{withinClusterQueue: Always}", r"\.withinClusterQueue: 'Always' is not one of Never"),
        ("{reclaimWithinCohort: LowerOrNewerEqualPriority}",
         r"\.reclaimWithinCohort: 'LowerOrNewerEqualPriority' is not one of Never, LowerPriority, Any"),
        ("{reclaimWithinCohort: Any, borrowWithinCohort: {policy: Any}}", r"\.borrowWithinCohort\.policy: 'Any'"),
        ("{reclaimWithinCohort: Any, borrowWithinCohort: {policy: LowerPriority, maxPriorityThreshold: high}}",
         r"\.borrowWithinCohort\.maxPriorityThreshold: must be a 32-bit integer, got 'high'"),
        ("{reclaimWithinCohort: Any, borrowWithinCohort: {maxPriorityThreshold: 4294967296}}",
         r"\.borrowWithinCohort\.maxPriorityThreshold: must be a 32-bit integer"),
        ("{borrowWithinCohort: {policy: LowerPriority}}",
         r": reclaimWithinCohort=Never and borrowWithinCohort\.policy=LowerPriority"),
        ("[Never]", r": must be an object"),
    ],
)
def test_bad_preemption_refused_with_its_field(text: str, message: str) -> None:
    with pytest.raises(QuotaConfigError, match=r"ClusterQueue q: spec\.preemption" + message):
        parse_object(queue_with(text))


@pytest.mark.parametrize("text", ["null", "{withinClusterQueue: LowerPriority}", "{reclaimWithinCohort: Any}"])
def test_a_preemption_policy_loads_without_a_warning(text: str) -> None:
    """spec.preemption is carried out (preemptor.py): a queue that asks for it is not warned any more."""
    config = build_config([("quota.yaml", queue_with(text))])
    assert config.errors == [] and config.warnings == []
