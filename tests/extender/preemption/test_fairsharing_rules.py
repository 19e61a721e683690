"""Preemption on quota with fair sharing (Kueue's LessThanOrEqualToFinalShare, then LessThanInitialShare),
table-driven: a(4), b(4) and c(4) A100 vGPUs in cohort ai (12 the cohort can lend). Shares worked out beside."""

from __future__ import annotations

import pytest

from kube_vgpu.extender.preemption.fairsharing import (
    LESS_THAN_INITIAL_SHARE,
    LESS_THAN_OR_EQUAL_TO_FINAL_SHARE,
    borrow_below,
    fair_quota_victims,
    strategy_allows,
)
from kube_vgpu.extender.preemption.quota_victims import QuotaCandidate
from kube_vgpu.extender.preemption.rules import PodFacts, may_preempt, snapshot_queues
from kube_vgpu.extender.quota.accounting import CQ, QuotaTree
from kube_vgpu.extender.quota.objects import (
    ANY,
    LOWER_PRIORITY,
    ClusterQueue,
    FlavorQuotas,
    Preemption,
    ResourceGroup,
    ResourceQuota,
)

GPU = ("a100", "nvidia.com/gpu")


def tree_with(usage: dict[str, int]) -> QuotaTree:
    group = (ResourceGroup(("nvidia.com/gpu",), (FlavorQuotas("a100", (("nvidia.com/gpu", ResourceQuota(4)),)),)),)
    tree = QuotaTree([ClusterQueue(name, group, cohort="ai") for name in ("a", "b", "c")])
    for queue, used in usage.items():
        tree.add(queue, {GPU: used})
    return tree


def pods(queue: str, count: int, gpus: int = 1, priority: int = 0) -> list[QuotaCandidate]:
    return [QuotaCandidate(f"{queue}{i}", queue, {GPU: gpus}, priority, float(i), True) for i in range(count)]


@pytest.mark.parametrize(("preemptor", "candidate_before", "candidate_after", "lte_final", "lt_initial"), [
    (100, 300, 100, True, True),  # 100 <= 100; 100 < 300
    (100, 300, 50, False, True),  # 100 > 50; 100 < 300
    (300, 300, 300, True, False),  # 300 <= 300; 300 not < 300
    (400, 300, 200, False, False),
])
def test_strategies(preemptor: int, candidate_before: int, candidate_after: int, lte_final: bool,
                    lt_initial: bool) -> None:
    assert strategy_allows(LESS_THAN_OR_EQUAL_TO_FINAL_SHARE, preemptor, candidate_before,
                           candidate_after) is lte_final
    assert strategy_allows(LESS_THAN_INITIAL_SHARE, preemptor, candidate_before, candidate_after) is lt_initial
    with pytest.raises(ValueError):
        strategy_allows("Sometimes", 0, 0, 0)


@pytest.mark.parametrize(("case", "usage", "queue", "need", "candidates", "weights", "below", "expected", "rule"), [
    # c at 0 wants its own 4 back: c's share after admission 0; a (8: borrows 4) without one pod: 3 of 12 = 250
    ("reclaim-nominal", {"a": 8, "b": 4}, "c", 4, pods("a", 8), {}, None, ["a4", "a5", "a6", "a7"],
     "fairSharing: a share 250 without this pod >= c share 0 after admission (LessThanOrEqualToFinalShare)"),
    # b would borrow 2 (166); a without one pod borrows 3 (250), without two 2 (166): 166 <= 166, still allowed
    ("both-borrow-final-share", {"a": 8, "b": 4}, "b", 2, pods("a", 8), {}, None, ["a7", "a6"],
     "fairSharing: a share 166 without this pod >= b share 166 after admission (LessThanOrEqualToFinalShare)"),
    # b (weight 2) would borrow 2: 166 / 2 = 83; a's 2-vGPU pod gone leaves a at 0 < 83: refused by the first
    # strategy; a's share now (2 of 12: 166) > 83: the second takes it
    ("initial-share", {"a": 6, "b": 4, "c": 2}, "b", 2, pods("a", 1, gpus=2) + pods("c", 1, gpus=2),
     {(CQ, "b"): 2000}, None, ["a0"],
     "fairSharing: a share 166 > b share 83 after admission (LessThanInitialShare)"),
    # b would borrow 3 (250) against a's 2 (166): neither strategy lets b take from a
    ("higher-share-preempts-nothing", {"a": 6, "b": 4, "c": 2}, "b", 3, pods("a", 6), {}, None, None, ""),
    # ... unless a's pods are below borrowWithinCohort's priority bound
    ("below-borrow-bound", {"a": 6, "b": 4, "c": 2}, "b", 2, pods("a", 6), {}, 5, ["a5", "a4"],
     "borrowWithinCohort: priority below 5, a borrows above its nominal quota"),
    # a has weight 0 and borrows 1: its share is infinite; b would borrow 4 (333): the second strategy takes a's
    ("zero-weight-loses", {"a": 5, "b": 4}, "b", 4, pods("a", 5), {(CQ, "a"): 0}, None, ["a4"],
     "fairSharing: a share infinite (weight 0) > b share 333 after admission (LessThanInitialShare)"),
    # nobody borrows: only the preemptor's own queue's pods (allowed by withinClusterQueue) can go
    ("own-queue", {"a": 4, "b": 4, "c": 4}, "c", 1, pods("c", 4) + pods("a", 4), {}, None, ["c3"],
     "withinClusterQueue: c"),
    ("fits-already", {"a": 4}, "b", 2, pods("a", 4), {}, None, [], ""),
])
def test_fair_quota_victims(case: str, usage: dict[str, int], queue: str, need: int,
                            candidates: list[QuotaCandidate], weights: dict[tuple[str, str], int], below: int | None,
                            expected: list[str] | None, rule: str) -> None:
    tree = tree_with(usage)
    before = {q: dict(u) for q, u in tree.usage.items()}
    rules = {c.uid: f"withinClusterQueue: {c.cluster_queue}" for c in candidates}
    found = fair_quota_victims(tree, weights, queue, {GPU: need}, candidates, rules, borrow_below_priority=below)
    assert tree.usage == before  # the caller's tree is never changed
    if expected is None:
        assert found is None
        return
    assert found is not None
    assert sorted(v.uid for v in found.victims) == sorted(expected)
    if expected:
        assert found.rules[expected[-1]] == rule
        assert set(found.rules) == set(expected)


def test_gang_victim_goes_whole() -> None:
    tree = tree_with({"a": 8, "b": 4})
    gang = [QuotaCandidate(f"g{i}", "a", {GPU: 1}, 0, float(i), True, "team-a/g") for i in range(2)]
    found = fair_quota_victims(tree, {}, "c", {GPU: 1}, gang, {})
    assert found is not None and sorted(v.uid for v in found.victims) == ["g0", "g1"]


@pytest.mark.parametrize(("priority", "lower", "threshold", "expected"), [
    (10, False, None, None), (10, True, None, 10), (10, True, 3, 4), (10, True, 20, 10),
])
def test_borrow_below(priority: int, lower: bool, threshold: int | None, expected: int | None) -> None:
    assert borrow_below(priority, lower, threshold) == expected


def test_may_preempt_names_fair_candidates() -> None:
    tree = tree_with({"a": 6, "b": 4})
    policies = {"b": Preemption(reclaim_within_cohort=LOWER_PRIORITY), "c": Preemption(reclaim_within_cohort=ANY)}
    preemptor_b = PodFacts("p", 5, 0.0, "b")
    snapshot = snapshot_queues(tree, policies, "b", {GPU: 2}, fair_sharing=True)
    assert snapshot.fair_sharing and snapshot.weights == {}
    verdict = may_preempt(preemptor_b, PodFacts("x", 1, 0.0, "a"), snapshot)
    assert verdict.allowed and verdict.rule == ("fairSharing: a borrows 2 nvidia.com/gpu (a100) above its nominal "
                                                "quota; shares decide")
    refused = may_preempt(preemptor_b, PodFacts("y", 5, 0.0, "a"), snapshot)
    assert not refused.allowed and refused.rule == "reclaimWithinCohort LowerPriority: priority 5 is not lower than 5"
    # Any: equal priority is a candidate too; a queue that does not borrow never is
    snapshot_c = snapshot_queues(tree, policies, "c", {GPU: 2}, fair_sharing=True)
    assert may_preempt(PodFacts("q", 5, 0.0, "c"), PodFacts("y", 5, 0.0, "a"), snapshot_c).allowed
    assert not may_preempt(PodFacts("q", 5, 0.0, "c"), PodFacts("z", 0, 0.0, "b"), snapshot_c).allowed
    # off: the classic rule (b within nominal after admission? 4 + 2 > 4: no; borrowWithinCohort Never)
    classic = snapshot_queues(tree, policies, "b", {GPU: 2})
    assert not may_preempt(preemptor_b, PodFacts("x", 1, 0.0, "a"), classic).allowed


def test_strategies_configurable_as_kueue_allows() -> None:
    from kube_vgpu.extender.cli import parse_args
    from kube_vgpu.extender.preemption.fairsharing import DEFAULT_STRATEGIES, parse_strategies

    assert parse_strategies("LessThanOrEqualToFinalShare, LessThanInitialShare") == DEFAULT_STRATEGIES
    assert parse_strategies("LessThanInitialShare") == (LESS_THAN_INITIAL_SHARE,)
    for bad in ("LessThanInitialShare,LessThanOrEqualToFinalShare", "", "Always"):
        with pytest.raises(ValueError, match="not one of Kueue's lists"):
            parse_strategies(bad)
    assert parse_args([]).fair_sharing_preemption_strategies == DEFAULT_STRATEGIES
    assert parse_args(["--fair-sharing-preemption-strategies", "LessThanOrEqualToFinalShare"]
                      ).fair_sharing_preemption_strategies == (LESS_THAN_OR_EQUAL_TO_FINAL_SHARE,)
    with pytest.raises(SystemExit):
        parse_args(["--fair-sharing-preemption-strategies", "Always"])
    # the initial-share case above with the first strategy only: b (83 after) may not take a's pod (a: 0 after)
    tree = tree_with({"a": 6, "b": 4, "c": 2})
    only_final = fair_quota_victims(tree, {(CQ, "b"): 2000}, "b", {GPU: 2}, pods("a", 1, gpus=2), {},
                                    strategies=(LESS_THAN_OR_EQUAL_TO_FINAL_SHARE,))
    assert only_final is None
    only_initial = fair_quota_victims(tree, {(CQ, "b"): 2000}, "b", {GPU: 2}, pods("a", 1, gpus=2), {},
                                      strategies=(LESS_THAN_INITIAL_SHARE,))
    assert only_initial is not None and [v.uid for v in only_initial.victims] == ["a0"]
    assert only_initial.rules["a0"] == "fairSharing: a share 166 > b share 83 after admission (LessThanInitialShare)"
