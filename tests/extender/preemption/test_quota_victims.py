"""Victims on quota (Kueue's reclaim and within-queue preemption), table-driven: two ClusterQueues of 4 A100 vGPUs
each in one cohort; team-a borrows, team-b wants its nominal quota back."""

from __future__ import annotations

import pytest
import yaml

from kube_vgpu.extender.preemption.quota_victims import QuotaCandidate, find_quota_victims
from kube_vgpu.extender.quota.accounting import QuotaTree
from kube_vgpu.extender.quota.objects import build_config
from tests.quota.helpers import FLAVORS, gpu_queue

GPU = ("a100", "nvidia.com/gpu")


def tree_with(usage: dict[str, int]) -> QuotaTree:
    text = FLAVORS + gpu_queue("team-a", {"a100": 4}, cohort="ai") + gpu_queue("team-b", {"a100": 4}, cohort="ai")
    config = build_config(("q.yaml", doc) for doc in yaml.safe_load_all(text) if doc)
    tree = QuotaTree(config.cluster_queues.values(), config.cohorts.values())
    for queue, used in usage.items():
        tree.add(queue, {GPU: used})
    return tree


def pod(uid: str, queue: str, gpus: int, priority: int = 0, created_s: float = 0.0, allowed: bool = True,
        gang: str | None = None) -> QuotaCandidate:
    return QuotaCandidate(uid, queue, {GPU: gpus}, priority, created_s, allowed, gang)


# team-a runs 8 pods of 1 vGPU (4 nominal + 4 borrowed from team-b); team-b asks for its own
A_PODS = [pod(f"a{i}", "team-a", 1, priority=i % 3, created_s=float(i)) for i in range(8)]


@pytest.mark.parametrize(("case", "usage", "need", "candidates", "expected"), [
    ("fits-already", {"team-a": 4}, 2, A_PODS[:4], []),
    # 2 back: the lowest priority first, newest first among equals (a6, a3 at priority 0; a0 is older)
    ("reclaim-two", {"team-a": 8}, 2, A_PODS, ["a6", "a3"]),
    # all 4 borrowed come back, never a pod within team-a's nominal 4
    ("reclaim-all-borrowed", {"team-a": 8}, 4, A_PODS, ["a6", "a3", "a0", "a7"]),
    # asking more than team-b's own 4 would mean taking team-a's nominal: not by reclaim
    ("never-beyond-borrowed", {"team-a": 8}, 5, A_PODS, None),
    ("refused-candidates-stay", {"team-a": 8}, 2, [pod(c.uid, c.cluster_queue, 1, c.priority, c.created_s,
                                                       allowed=c.uid not in ("a6", "a3")) for c in A_PODS],
     ["a0", "a7"]),
    # a 2-vGPU pod covers the need alone and is cheaper than two 1-vGPU pods of higher priority
    ("one-big-victim", {"team-a": 8}, 2, [pod("big", "team-a", 2, 0, 1.0), pod("x", "team-a", 1, 5, 2.0),
                                           pod("y", "team-a", 1, 5, 3.0), pod("z", "team-a", 2, 5, 4.0)], ["big"]),
    # a gang goes whole: both members, though one would be enough
    ("gang-whole", {"team-a": 8}, 1, [pod("g0", "team-a", 1, 0, 1.0, gang="g"), pod("g1", "team-a", 1, 0, 2.0,
                                                                                   gang="g")], ["g0", "g1"]),
])
def test_quota_victims(case: str, usage: dict[str, int], need: int, candidates: list[QuotaCandidate],
                       expected: list[str] | None) -> None:
    tree = tree_with(usage)
    before = {q: dict(u) for q, u in tree.usage.items()}
    found = find_quota_victims(tree, "team-b", {GPU: need}, candidates)
    assert tree.usage == before  # the caller's tree is never changed
    assert (None if found is None else [v.uid for v in found]) == expected


def test_within_its_own_queue_the_lowest_priority_newest_go_first() -> None:
    tree = tree_with({"team-a": 4, "team-b": 4})  # the cohort is full: nothing to borrow
    own = [pod(f"b{i}", "team-b", 1, priority=i, created_s=float(i)) for i in range(4)]
    found = find_quota_victims(tree, "team-b", {GPU: 2}, own)
    assert found is not None and [v.uid for v in found] == ["b0", "b1"]
