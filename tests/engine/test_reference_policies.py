"""Basic behaviour of the trace-reference policies and ours, table-driven: which of two nodes (or GPUs) wins."""

from __future__ import annotations

import pytest

from kube_vgpu.dev.simulator.engine import build_node, build_request
from kube_vgpu.dev.simulator.trace import NodeSpec, Task
from kube_vgpu.extender.engine.fit import place
from kube_vgpu.extender.engine.fragmentation import TaskShape
from kube_vgpu.extender.engine.model import NodeState, Placement
from kube_vgpu.extender.engine.policies import make_policy

SHARE = Task("share", 2000, 1024, 1, 500)
WHOLE = Task("whole", 2000, 1024, 1, 1000)
CPU = Task("cpu", 4000, 1024, 0, 0)
SHAPES = ((TaskShape(2000, 500, 1), 0.5), (TaskShape(2000, 1000, 1), 0.5))


def node(name: str, gpus: int = 4, cpu_milli: int = 32000, used: tuple[Task, ...] = ()) -> NodeState:
    state = build_node(NodeSpec(name, cpu_milli, 262144, gpus, "T4"))
    for task in used:
        result = place(state, build_request(task), make_policy("bestfit"), make_policy("bestfit"), check_host=True)
        assert isinstance(result, Placement)
        state.cpu_milli_used += task.cpu_milli
        state.memory_mib_used += task.memory_mib
        state.apply_usage(result.usage)
    return state


def policy(name: str):
    if name == "fgd":
        return make_policy(name, shapes=SHAPES)
    pol = make_policy(name)
    if name == "bfgd":  # it learns the workload from the pods it sees
        for _ in range(4):
            pol.observe(build_request(SHARE))
            pol.observe(build_request(WHOLE))
    return pol


def score(name: str, state: NodeState, task: Task) -> float:
    pol = policy(name)
    result = place(state, build_request(task), pol, pol, check_host=True)
    assert isinstance(result, Placement), result
    return result.score


@pytest.mark.parametrize(
    ("name", "task", "better", "worse"),
    [
        # best fit: the node left with less free GPU and CPU
        ("bestfit", WHOLE, lambda: node("a", used=(WHOLE, WHOLE)), lambda: node("b")),
        ("bestfit", CPU, lambda: node("a", gpus=1), lambda: node("b", gpus=4)),
        # dot product: the fuller node (smaller dot product of free and asked)
        ("dotprod", WHOLE, lambda: node("a", used=(WHOLE,)), lambda: node("b")),
        # packing: a GPU already shared beats idle GPUs; a used node beats an idle node
        ("packing", SHARE, lambda: node("a", used=(SHARE,)), lambda: node("b", used=(WHOLE,))),
        ("packing", WHOLE, lambda: node("a", used=(WHOLE,)), lambda: node("b")),
        # clustering: nodes holding only this kind of pod first, then empty nodes, then other kinds
        ("clustering", SHARE, lambda: node("a", used=(SHARE,)), lambda: node("b")),
        ("clustering", WHOLE, lambda: node("a"), lambda: node("b", used=(SHARE,))),
        # fgd: filling a half-used GPU fragments less than cutting into an idle one
        ("fgd", SHARE, lambda: node("a", used=(SHARE,)), lambda: node("b")),
        ("bfgd", SHARE, lambda: node("a", used=(SHARE,)), lambda: node("b")),
    ],
)
def test_preferred_node(name, task, better, worse):
    assert score(name, better(), task) > score(name, worse(), task)


@pytest.mark.parametrize("name", ["random", "clustering", "packing"])
def test_cpu_only_pods_score_the_same_everywhere(name):
    assert score(name, node("a", used=(WHOLE,)), CPU) == score(name, node("b"), CPU)


def test_random_scores_every_node_alike():
    assert score("random", node("a", used=(SHARE, WHOLE)), SHARE) == score("random", node("b"), SHARE)


@pytest.mark.parametrize("name", ["random", "dotprod", "clustering", "packing", "bestfit", "fgd", "bfgd"])
def test_sharing_pod_goes_to_the_partly_used_gpu(name):
    state = node("a", used=(WHOLE, SHARE))  # GPU0 whole, GPU1 half used, GPU2..3 idle
    pol = policy(name)
    result = place(state, build_request(SHARE), pol, pol, check_host=True)
    assert isinstance(result, Placement)
    assert [usage.position for usage in result.usage] == [1]


@pytest.mark.parametrize("name", ["random", "dotprod", "clustering", "packing", "bestfit", "fgd", "bfgd"])
def test_whole_gpus_take_the_lowest_idle_ones(name):
    state = node("a", used=(SHARE,))
    pol = policy(name)
    result = place(state, build_request(Task("two", 2000, 1024, 2, 1000)), pol, pol, check_host=True)
    assert isinstance(result, Placement)
    assert [usage.position for usage in result.usage] == [1, 2]


def test_pod_kinds_follow_usage():
    state = node("a", used=(SHARE, WHOLE, Task("two", 2000, 1024, 2, 1000)))
    assert state.pod_kinds == {"share": 1, "1-gpu": 1, "2-gpu": 1}


def test_bfgd_learns_the_workload_from_what_it_sees():
    pol = make_policy("bfgd")
    assert pol.epoch() == 0
    pol.observe(build_request(SHARE))
    assert pol.epoch() == 1
    assert [shape for shape, _ in pol.frag_model.shapes] == [TaskShape(2000, 500, 1)]


def test_bfgd_keeps_cpu_for_idle_gpus():
    """A CPU-only pod goes where it strands no GPU: FGD sees no difference, bfgd does."""
    full = node("a", cpu_milli=16000, used=(WHOLE, WHOLE, WHOLE, WHOLE))  # GPUs all used, 8 CPUs free
    idle = node("b", cpu_milli=10000)  # 4 idle GPUs need ~8 CPUs at 2 CPUs per GPU
    bfgd = make_policy("bfgd")
    for _ in range(8):
        bfgd.observe(build_request(WHOLE))
    assert bfgd.cpu_per_gpu == pytest.approx(2.0)

    def node_score(pol, state):
        result = place(state, build_request(CPU), pol, pol, check_host=True)
        assert isinstance(result, Placement)
        return result.score

    assert node_score(bfgd, full) > node_score(bfgd, idle)
    fgd = make_policy("fgd", shapes=((TaskShape(2000, 1000, 1), 1.0),))
    assert node_score(fgd, full) == node_score(fgd, idle)



def test_bfgd_knows_no_simulator_only_its_reference_ties_option():
    """bfgd on an openb-style node (no links) uses its live tie-breaks: among equally good GPUs one already split,
    and a fill term under one point; reference_ties=True the FGD reference's: lowest index, no extra term."""
    from kube_vgpu.extender.engine.policies.base import Scratch, node_fill_after
    from kube_vgpu.extender.engine.policies.bfgd import FILL_TIE_BREAK, BalancedFGD

    state = build_node(NodeSpec("a", 32000, 262144, 2, "T4"))
    bestfit = make_policy("bestfit")
    whole = place(state, build_request(WHOLE), bestfit, bestfit, check_host=True)
    assert isinstance(whole, Placement)
    state.apply_usage(whole.usage)  # GPU 0
    share = place(state, build_request(SHARE), bestfit, bestfit, check_host=True)
    assert isinstance(share, Placement)
    state.apply_usage(share.usage)  # GPU 1
    state.apply_usage(whole.usage, sign=-1)  # GPU 0 idle again, GPU 1 split
    assert not state.has_links
    live, reference = BalancedFGD(), BalancedFGD(reference_ties=True)
    tied = list(state.gpus)
    assert live.break_tie(state, tied, Scratch(2)).index == 1
    assert reference.break_tie(state, tied, Scratch(2)).index == 0
    for pol in (live, reference):
        for _ in range(4):
            pol.observe(build_request(SHARE))
            pol.observe(build_request(WHOLE))
    cpu_only = place(state, build_request(CPU), live, live, check_host=True)
    assert isinstance(cpu_only, Placement)
    fill = node_fill_after(state, cpu_only)
    assert fill > 0
    assert score_with(live, state, CPU) - score_with(reference, state, CPU) == pytest.approx(FILL_TIE_BREAK * fill)


def score_with(pol, state: NodeState, task: Task) -> float:
    result = place(state, build_request(task), pol, pol, check_host=True)
    assert isinstance(result, Placement), result
    return result.score
