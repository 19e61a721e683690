"""Kueue's dominant resource share against hand-computed cases (each expected number worked out beside it)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from kube_vgpu.extender.quota.accounting import COHORT, CQ, FlavorResource, QuotaTree
from kube_vgpu.extender.quota.fairsharing import (
    INFINITE_SHARE,
    Share,
    dominant_resource_share,
    lendable,
    queue_share,
    weights_of,
)
from kube_vgpu.extender.quota.objects import (
    ClusterQueue,
    Cohort,
    FlavorQuotas,
    QuotaConfig,
    ResourceGroup,
    ResourceQuota,
)

GPU = "nvidia.com/gpu"
MEM = "nvidia.com/gpumem"
A100 = ("a100", GPU)
V100 = ("v100", GPU)
A100_MEM = ("a100", MEM)


def cq(name: str, gpus: int, *, lending: int | None = None, cohort: str | None = "c", mem: int | None = None,
       v100: int | None = None) -> ClusterQueue:
    covered = (GPU, MEM) if mem is not None else (GPU,)
    resources = ((GPU, ResourceQuota(gpus, None, lending)),) + (((MEM, ResourceQuota(mem)),) if mem is not None
                                                                 else ())
    flavors = (FlavorQuotas("a100", resources),)
    if v100 is not None:
        flavors += (FlavorQuotas("v100", ((GPU, ResourceQuota(v100)),)),)
    return ClusterQueue(name, (ResourceGroup(covered, flavors),), cohort=cohort)


@dataclass
class Case:
    name: str
    queues: list[ClusterQueue]
    used: dict[str, dict[FlavorResource, int]]
    expect: int
    weight_milli: int = 1000
    request: dict[FlavorResource, int] = field(default_factory=dict)
    sign: int = 1
    resource: str = GPU
    cohorts: list[Cohort] = field(default_factory=list)


# a(4) and b(6) in cohort c: the cohort can lend 10 GPUs
PAIR = [cq("a", 4), cq("b", 6)]

CASES = [
    Case("within nominal: 0", PAIR, {"a": {A100: 4}}, 0, resource=""),
    Case("borrows 2 of 10: 2 * 1000 // 10 = 200", PAIR, {"a": {A100: 6}}, 200),
    Case("weight 2 halves it: 200 * 1000 // 2000 = 100", PAIR, {"a": {A100: 6}}, 100, weight_milli=2000),
    Case("weight 0.5 doubles it: 3 of 10 = 300, * 1000 // 500 = 600", PAIR, {"a": {A100: 7}}, 600,
         weight_milli=500),
    Case("weight 0 and borrowing: infinite", PAIR, {"a": {A100: 5}}, INFINITE_SHARE, weight_milli=0),
    Case("weight 0 within nominal: 0", PAIR, {"a": {A100: 4}}, 0, weight_milli=0, resource=""),
    Case("with a request of 3 on 4 used: borrows 3, 300", PAIR, {"a": {A100: 4}}, 300, request={A100: 3}),
    Case("without a victim of 2 on 8 used: borrows 2, 200", PAIR, {"a": {A100: 8}}, 200, request={A100: 2},
         sign=-1),
    Case("rounds down: 1 of 3 lendable (a 1, b 2) = 333", [cq("a", 1), cq("b", 2)], {"a": {A100: 2}}, 333),
    # b lends only 2 of its 6: the cohort can lend a's 4 + b's 2 = 6; a borrows 3 of 6 = 500
    Case("lending limit shrinks the lendable: 3 of 6 = 500", [cq("a", 4), cq("b", 6, lending=2)],
         {"a": {A100: 7}}, 500),
    # gpu: borrows 1 of 10 = 100; gpumem: 30000 of 100000 = 300: the dominant resource is gpumem
    Case("dominant resource: the larger ratio", [cq("a", 4, mem=40000), cq("b", 6, mem=60000)],
         {"a": {A100: 5, A100_MEM: 70000}}, 300, resource=MEM),
    # lendable GPUs summed over flavors: a100 4 + 6, v100 2 + 2 = 14; borrowed 1 + 1 = 2: 2000 // 14 = 142
    Case("flavors summed per resource: 2 of 14 = 142", [cq("a", 4, v100=2), cq("b", 6, v100=2)],
         {"a": {A100: 5, V100: 3}}, 142),
    Case("no cohort: 0 even over nominal", [cq("a", 4, cohort=None)], {"a": {A100: 9}}, 0, resource=""),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_queue_share(case: Case) -> None:
    tree = QuotaTree(case.queues, case.cohorts)
    for name, amounts in case.used.items():
        tree.add(name, amounts)
    share = dominant_resource_share(tree, (CQ, "a"), case.weight_milli, case.request, case.sign)
    assert share == Share(case.expect, case.resource)


def test_hierarchical_cohort_share() -> None:
    # org (no own quota) > ml > a(3), b(1); z(4) directly in org. subtree(ml) = 4, subtree(org) = 8.
    queues = [cq("a", 3, cohort="ml"), cq("b", 1, cohort="ml"), cq("z", 4, cohort="org")]
    cohorts = [Cohort("ml", "org"), Cohort("org")]
    tree = QuotaTree(queues, cohorts)
    tree.add("a", {A100: 5})
    tree.add("b", {A100: 1})
    # ml uses 6 of its 4: borrows 2 of org's 8 lendable = 250; weight 2 -> 125
    assert dominant_resource_share(tree, (COHORT, "ml")) == Share(250, GPU)
    assert dominant_resource_share(tree, (COHORT, "ml"), 2000) == Share(125, GPU)
    # a borrows 2 (5 - 3) of what ml could ever lend it: ml has no guarantee, org lends 8: 2000 // 8 = 250
    assert lendable(tree, (COHORT, "ml")) == {GPU: 8}
    assert dominant_resource_share(tree, (CQ, "a")) == Share(250, GPU)
    assert dominant_resource_share(tree, (COHORT, "org")) == Share(0)  # a root borrows from nobody
    with pytest.raises(ValueError):
        dominant_resource_share(tree, (COHORT, "ml"), request={A100: 1})


def test_weights_of_config_and_defaults() -> None:
    config = QuotaConfig(cluster_queues={"a": cq("a", 4), "b": ClusterQueue("b", fair_weight_milli=0)},
                         cohorts={"c": Cohort("c", fair_weight_milli=2500)})
    weights = weights_of(config)
    assert weights == {(CQ, "a"): 1000, (CQ, "b"): 0, (COHORT, "c"): 2500}
    tree = QuotaTree(PAIR)
    tree.add("a", {A100: 6})
    assert queue_share(tree, {(CQ, "a"): 4000}, "a") == Share(50, GPU)  # 200 * 1000 // 4000
    assert queue_share(tree, {}, "a") == Share(200, GPU)  # unknown: weight 1
    assert Share(INFINITE_SHARE).describe() == "infinite (weight 0)" and Share(7).describe() == "7"
