"""hsafgd (policies/hostsupply.py): its per-node tables computed by hand, its agreement with safgd where every
filler fits the node, and a placement where it parts from safgd (a hole whose node has no memory left for it)."""

from __future__ import annotations

import pytest

from kube_vgpu.dev.simulator.engine import build_node, build_request
from kube_vgpu.dev.simulator.trace import NodeSpec, Task
from kube_vgpu.extender.engine.fit import place
from kube_vgpu.extender.engine.model import NodeState, Placement
from kube_vgpu.extender.engine.policies import REGISTRY, make_policy
from kube_vgpu.extender.engine.policies.hostsupply import HostSupplyFGD, _ClassTables
from kube_vgpu.extender.engine.policies.supply import SupplyLookaheadFGD, supply_residue, supply_table


def task(milli: int, memory_mib: int = 1024, cpu_milli: int = 2000) -> Task:
    return Task(f"s{milli}", cpu_milli, memory_mib, 1, milli)


#: 470s, 320s, 650s and whole GPUs, each asking 8 GiB of host memory and 2 CPUs
WORKLOAD = [task(470, 8192)] * 4 + [task(320, 8192)] * 2 + [task(650, 8192)] * 2 + [task(1000, 8192)] * 4


def learned(name: str) -> SupplyLookaheadFGD:
    policy = make_policy(name)
    assert isinstance(policy, SupplyLookaheadFGD)
    for pod in WORKLOAD:
        policy.observe(build_request(pod))
    return policy


def one_gpu_node(memory_mib: int) -> NodeState:
    return build_node(NodeSpec("n", 32000, memory_mib, 1, "T4"))


def test_registered_under_its_name() -> None:
    assert REGISTRY["hsafgd"] is HostSupplyFGD
    policy = make_policy("hsafgd")
    assert isinstance(policy, HostSupplyFGD) and isinstance(policy, SupplyLookaheadFGD)


def tables(tasks: dict[int, list[tuple[int, int, float]]]) -> _ClassTables:
    probabilities = {ask: sum(p for _, _, p in rows) for ask, rows in tasks.items()}
    return _ClassTables(probabilities, supply_residue(probabilities)[1], tasks)


@pytest.mark.parametrize(
    ("cpu_free", "memory_free", "hole", "expected"),
    [
        (None, None, 530, 60.0),  # host unknown: safgd's E (a 470 leaves 60)
        (None, None, 1000, 0.0),  # a whole GPU
        (64000, 64000, 530, 60.0),  # every task fits
        (64000, 20000, 530, 0.5 * 60 + 0.5 * 530),  # half the 470s ask 30000 MiB: the hole waits half the time
        (64000, 5000, 530, 530.0),  # no 470 fits: the hole stays
        (64000, 5000, 1000, 0.0),  # the whole-GPU tasks ask 1000 MiB: they still fit
        (3000, 64000, 530, 530.0),  # the 470s ask 4 CPUs
        (3000, 64000, 1000, 0.0),  # the whole-GPU tasks 2
        (1000, 64000, 1000, 1000.0),  # nothing fits
    ],
)
def test_table_by_hand(cpu_free: int | None, memory_free: int | None, hole: int, expected: float) -> None:
    by_ask = {470: [(4000, 10000, 0.25), (4000, 30000, 0.25)], 1000: [(2000, 1000, 0.5)]}
    assert tables(by_ask).table(cpu_free, memory_free)[hole] == pytest.approx(expected)


def test_tables_are_shared_between_levels_that_scale_alike() -> None:
    classes = tables({470: [(4000, 10000, 0.5)], 1000: [(2000, 1000, 0.5)]})
    plenty = classes.table(None, None)
    assert classes.table(64000, 64000) is plenty  # one table for every level where every task fits
    assert classes.table(5000, 20000) is plenty
    assert classes.table(5000, 5000) is not plenty
    assert len(classes.tables) == 2


def test_every_filler_fitting_is_safgd() -> None:
    policy = learned("hsafgd")
    node = one_gpu_node(262144)
    tables = policy.class_tables(node.gpu_model, node.gpu_memory_mib)
    assert tables.table(32000, 262144) == supply_table(policy.frag_model.shapes, "T4", 0)
    assert tables.table(None, None) == supply_table(policy.frag_model.shapes, "T4", 0)


@pytest.mark.parametrize("memory_mib", [0, 262144])
def test_the_node_as_safgd_sees_it_when_the_host_feeds_everything(memory_mib: int) -> None:
    # plenty of CPU and memory, or memory not reported (the live extender): the score is safgd's
    request = build_request(task(320, 8192))
    scores = []
    for name in ("hsafgd", "safgd"):
        policy = learned(name)
        result = place(one_gpu_node(memory_mib), request, policy, policy)
        assert isinstance(result, Placement), result
        scores.append(result.score)
    assert scores[0] == scores[1]


def test_a_hole_whose_node_cannot_feed_its_fillers_is_priced_as_permanent() -> None:
    # a 320 on a fresh GPU leaves 680, which a 650 brings to 30, if the node still has memory for a 650: with
    # 12 GiB it has 4 GiB after the 320 and the hole stays. safgd cannot tell the two nodes apart
    request = build_request(task(320, 8192))
    for name, tighter_is_worse in (("hsafgd", True), ("safgd", False)):
        policy = learned(name)
        roomy = place(one_gpu_node(262144), request, policy, policy, check_host=True)
        tight = place(one_gpu_node(12288), request, policy, policy, check_host=True)
        assert isinstance(roomy, Placement) and isinstance(tight, Placement)
        assert (roomy.score > tight.score) is tighter_is_worse, name
        if not tighter_is_worse:
            assert roomy.score == tight.score


def test_tables_follow_the_learned_model() -> None:
    policy = learned("hsafgd")
    assert isinstance(policy, HostSupplyFGD)
    node = one_gpu_node(262144)
    classes = policy.class_tables(node.gpu_model, node.gpu_memory_mib)
    assert classes is policy.class_tables(node.gpu_model, node.gpu_memory_mib)  # memoised per GPU class
    epoch = policy.epoch()
    for pod in [task(230, 65536)] * 64:  # a new shape, asking more memory: the model and the tables change
        policy.observe(build_request(pod))
    assert policy.epoch() != epoch
    assert policy.class_tables(node.gpu_model, node.gpu_memory_mib) is not classes
    assert 230 in policy.class_tables(node.gpu_model, node.gpu_memory_mib).tasks


def test_the_classes_of_a_batch_are_built_together_as_each_alone() -> None:
    """After a model change, a batch placement hands hsafgd every GPU class it is about to meet (prepare_classes):
    their availabilities come from one pass (supply_residues) and each class's tables are those class_tables
    builds for it alone; a class already built is kept as it is."""
    # on the A100s the 810s' 190 holes wait for a rare 160 (it comes out short); the V100s' 160s are no one's
    workload = [*WORKLOAD, *[Task("v", 2000, 8192, 1, 160, ("V100",))] * 3,
                *[Task("a", 2000, 4096, 1, 810, ("A100",))] * 14, *[Task("r", 2000, 4096, 1, 160, ("A100",))] * 3]
    together, alone = make_policy("hsafgd"), make_policy("hsafgd")
    assert isinstance(together, HostSupplyFGD) and isinstance(alone, HostSupplyFGD)
    for pod in workload:
        together.observe(build_request(pod))
        alone.observe(build_request(pod))
    kept = together.class_tables("T4", 16384)
    classes = [("T4", 16384), ("V100", 32768), ("A100", 81920), ("V100", 32768)]
    together.prepare_classes(classes)
    assert together.class_tables("T4", 16384) is kept
    for model, memory_mib in classes:
        built, expected = together.class_tables(model, memory_mib), alone.class_tables(model, memory_mib)
        assert (built.probabilities, built.available, built.tasks) == (
            expected.probabilities, expected.available, expected.tasks)
        assert built.table(4000, 65536) == expected.table(4000, 65536)
    assert together.class_tables("A100", 81920).available[160] < 1.0
