"""Kueue's quota arithmetic against hand-computed cases (every expected number is worked out in the comment)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from kube_vgpu.extender.quota.accounting import CQ, QuotaTree
from kube_vgpu.extender.quota.objects import ClusterQueue, Cohort, FlavorQuotas, ResourceGroup, ResourceQuota

GPU = "nvidia.com/gpu"
FR = ("a100", GPU)


def quota_groups(nominal: int, borrowing: int | None = None, lending: int | None = None) -> tuple[ResourceGroup, ...]:
    return (ResourceGroup((GPU,), (FlavorQuotas("a100", ((GPU, ResourceQuota(nominal, borrowing, lending)),)),)),)


def cq(name: str, nominal: int, borrowing: int | None = None, lending: int | None = None,
       cohort: str | None = None) -> ClusterQueue:
    return ClusterQueue(name, quota_groups(nominal, borrowing, lending), cohort=cohort)


def cohort(name: str, nominal: int | None = None, borrowing: int | None = None, lending: int | None = None,
           parent: str | None = None) -> Cohort:
    groups = quota_groups(nominal, borrowing, lending) if nominal is not None else ()
    return Cohort(name, parent, groups)


@dataclass
class Case:
    name: str
    queues: list[ClusterQueue]
    used: dict[str, int]
    expect_available: dict[str, int]
    expect_potential: dict[str, int] = field(default_factory=dict)
    cohorts: list[Cohort] = field(default_factory=list)


# a(4, borrowingLimit 2) and b(6) share cohort "c": the cohort holds 4 + 6 = 10 (no lendingLimit: all lent)
BORROWING = [cq("a", 4, borrowing=2, cohort="c"), cq("b", 6, cohort="c")]
# a(4) and b(6, lendingLimit 2) share cohort "c": b keeps 6 - 2 = 4 for itself; the cohort holds 4 + 2 = 6
LENDING = [cq("a", 4, cohort="c"), cq("b", 6, lending=2, cohort="c")]
# org (own pool 2) > ml (nominal 0, may borrow 1 from org) > a(3), b(1); z(4, lends 1) directly in org.
# subtree(ml) = 0 + 3 + 1 = 4; guaranteed(z) = 4 - 1 = 3; subtree(org) = 2 + 4 + (4 - 3) = 7
HIERARCHY_QUEUES = [cq("a", 3, cohort="ml"), cq("b", 1, cohort="ml"), cq("z", 4, lending=1, cohort="org")]
HIERARCHY_COHORTS = [cohort("org", 2), cohort("ml", 0, borrowing=1, parent="org")]

CASES = [
    Case("nominal only: 3 of 4 used", [cq("a", 4)], {"a": 3}, {"a": 1}, {"a": 4}),
    Case("nominal only: over-admitted after a quota cut", [cq("a", 4)], {"a": 5}, {"a": -1}),
    # a may hold 4 + 2; the cohort has 10 free: the borrowing limit binds
    Case("cohort: borrowing limit binds", BORROWING, {"a": 4}, {"a": 2, "b": 6}, {"a": 6, "b": 10}),
    # cohort free = 10 - (4 + 5) = 1 < a's remaining borrowing 2
    Case("cohort: the cohort's free quota binds", BORROWING, {"a": 4, "b": 5}, {"a": 1, "b": 1}),
    # a borrowed its full 2: a has 0; b (no borrowing limit) gets the cohort's 10 - 6 = 4
    Case("cohort: borrower at its limit", BORROWING, {"a": 6}, {"a": 0, "b": 4}),
    # nothing used: a can borrow b's lendable 2 on top of its 4 (6 = the cohort's all); b has its guaranteed 4
    # plus the cohort's 6 (a lends all of its 4, having no lendingLimit)
    Case("lendingLimit: lender idle", LENDING, {}, {"a": 6, "b": 10}, {"a": 6, "b": 10}),
    # a borrowed b's 2 lendable: b still has its guaranteed 4 (local) + 0 from the cohort
    Case("lendingLimit protects the lender", LENDING, {"a": 6}, {"a": 0, "b": 4}),
    # b uses 5 = its 4 guaranteed + 1 stored in the cohort; cohort usage 4 + 1 = 5 of 6: 1 left for either
    Case("lendingLimit: lender past its guarantee", LENDING, {"a": 4, "b": 5}, {"a": 1, "b": 1}),
    # idle: ml may take min(org free 7, its 4 + borrowing 1) = 5; z: its 3 guaranteed + org's 7
    Case("hierarchy: idle", HIERARCHY_QUEUES, {}, {"a": 5, "b": 5, "z": 10}, {"a": 5, "b": 5, "z": 10},
         HIERARCHY_COHORTS),
    # a uses 4: ml stores 4 in org (org free 7 - 4 = 3), ml's limit 4 - 4 + 1 = 1 binds
    Case("hierarchy: child cohort's borrowing limit", HIERARCHY_QUEUES, {"a": 4}, {"a": 1, "b": 1, "z": 6},
         {}, HIERARCHY_COHORTS),
    # a uses 5 (b's 1 and ml's 1 borrowed): ml is at its limit; z keeps 3 + org's 7 - 5 = 5
    Case("hierarchy: child cohort exhausted", HIERARCHY_QUEUES, {"a": 5}, {"a": 0, "b": 0, "z": 5}, {},
         HIERARCHY_COHORTS),
    # z uses 4: 1 past its guarantee is stored in org (free 6); ml still capped at 4 + 1 = 5
    Case("hierarchy: lender in the parent", HIERARCHY_QUEUES, {"z": 4}, {"a": 5, "z": 6}, {},
         HIERARCHY_COHORTS),
    # the cohort named by the queues has no object: it exists with no quota of its own
    Case("implicit cohort", [cq("a", 2, cohort="nowhere"), cq("b", 3, cohort="nowhere")], {"b": 1},
         {"a": 4, "b": 4}),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_available_matches_hand_computation(case: Case) -> None:
    tree = QuotaTree(case.queues, case.cohorts)
    for name, amount in case.used.items():
        tree.add(name, {FR: amount})
    for name, expected in case.expect_available.items():
        assert tree.available((CQ, name), FR) == expected, name
    for name, expected in case.expect_potential.items():
        assert tree.potential_available((CQ, name), FR) == expected, name


def test_usage_added_and_removed_returns_to_the_same_numbers() -> None:
    tree = QuotaTree(LENDING)
    before = {q.name: tree.available((CQ, q.name), FR) for q in LENDING}
    for amount in (1, 3, 2):
        tree.add("a", {FR: amount})
    tree.add("b", {FR: 5})
    for amount in (1, 3, 2):
        tree.add("a", {FR: amount}, -1)
    tree.add("b", {FR: 5}, -1)
    assert {q.name: tree.available((CQ, q.name), FR) for q in LENDING} == before


def test_shortfalls_name_need_used_and_limit() -> None:
    tree = QuotaTree(BORROWING)
    tree.add("a", {FR: 5})
    [short] = tree.shortfalls("a", {FR: 2})
    assert (short.flavor, short.resource, short.need, short.used, short.available, short.potential) == (
        "a100", GPU, 2, 5, 1, 6)
    assert not short.never_fits
    assert tree.shortfalls("a", {FR: 1}) == []
    assert tree.shortfalls("a", {FR: 7})[0].never_fits  # more than a could ever hold (6)


def test_status_borrowed_and_lent() -> None:
    tree = QuotaTree(BORROWING)
    tree.add("a", {FR: 6})  # a borrows 2 of b's idle quota
    a, b = tree.status("a", FR), tree.status("b", FR)
    assert (a.nominal, a.borrowing_limit, a.used, a.borrowed, a.lent, a.available) == (4, 2, 6, 2, 0, 0)
    assert (b.nominal, b.used, b.borrowed, b.lent, b.available) == (6, 0, 0, 2, 4)


def test_status_lent_is_capped_by_the_lending_limit() -> None:
    tree = QuotaTree(LENDING)
    tree.add("a", {FR: 6})
    assert tree.status("b", FR).lent == 2
    assert tree.status("a", FR).borrowed == 2


def test_cycle_of_cohorts_is_detected() -> None:
    tree = QuotaTree([cq("a", 2, cohort="x")], [cohort("x", parent="y"), cohort("y", parent="x")])
    assert tree.in_cycle("a") in {"x", "y"}
    assert tree.cyclic == {"x", "y"}
    assert tree.available((CQ, "a"), FR) == 2  # sums still terminate


def test_clone_is_independent() -> None:
    tree = QuotaTree(BORROWING)
    tree.add("a", {FR: 4})
    copy = tree.clone()
    copy.add("a", {FR: 4}, -1)
    assert copy.available((CQ, "a"), FR) == 6
    assert tree.available((CQ, "a"), FR) == 2
