"""lafgd (policies/lookahead.py): its per-GPU tables computed by hand, and which of two hand-built nodes it
prefers where bfgd prefers the other."""

from __future__ import annotations

import pytest

from kube_vgpu import protocol
from kube_vgpu.dev.fixtures import synth_inventory
from kube_vgpu.dev.simulator.engine import build_node, build_request
from kube_vgpu.dev.simulator.trace import NodeSpec, Task
from kube_vgpu.extender.engine.fit import place
from kube_vgpu.extender.engine.fragmentation import TaskShape
from kube_vgpu.extender.engine.model import NodeState, Placement, PlacementRequest
from kube_vgpu.extender.engine.policies import REGISTRY, make_policy
from kube_vgpu.extender.engine.policies.bfgd import BalancedFGD
from kube_vgpu.extender.engine.policies.lookahead import LookaheadFGD, lookahead_table, residue_table
from tests.helpers import pod


def share(milli: int) -> Task:
    return Task(f"s{milli}", 2000, 1024, 1, milli)


#: the workload both policies learn: 470s, 320s, whole GPUs, 230s and 650s (4:2:2:2:2)
WORKLOAD = [share(470)] * 4 + [share(320)] * 2 + [share(1000)] * 2 + [share(230)] * 2 + [share(650)] * 2


def learned(name: str) -> BalancedFGD:
    policy = make_policy(name)
    assert isinstance(policy, BalancedFGD)
    for task in WORKLOAD:
        policy.observe(build_request(task))
    return policy


def one_gpu_node(used: tuple[int, ...]) -> NodeState:
    state = build_node(NodeSpec("n", 32000, 262144, 1, "T4"))
    packer = make_policy("bestfit")
    for milli in used:
        result = place(state, build_request(share(milli)), packer, packer, check_host=True)
        assert isinstance(result, Placement)
        state.cpu_milli_used += 2000
        state.memory_mib_used += 1024
        state.apply_usage(result.usage)
    return state


def score(name: str, used: tuple[int, ...], milli: int) -> float:
    policy = learned(name)
    result = place(one_gpu_node(used), build_request(share(milli)), policy, policy, check_host=True)
    assert isinstance(result, Placement), result
    return result.score


def test_registered_under_its_name() -> None:
    assert REGISTRY["lafgd"] is LookaheadFGD
    assert isinstance(make_policy("lafgd"), LookaheadFGD)


def test_residue_table_by_hand() -> None:
    # asks 470, 320 and whole GPUs: R(h) = h - the largest sum of asks <= h
    shapes = ((TaskShape(1000, 470, 1), 0.5), (TaskShape(1000, 320, 1), 0.3), (TaskShape(1000, 1000, 2), 0.2))
    table = residue_table(shapes, "T4", 0)
    assert table[0] == 0.0
    assert table[350] == 30.0  # a 320
    assert table[530] == 60.0  # a 470
    assert table[790] == 0.0  # a 470 and a 320
    assert table[1000] == 0.0
    assert table[190] == 190.0  # nothing fits
    assert table[319] == 319.0
    # a model the shapes do not allow, or CPU-only shapes: nothing fits anywhere
    assert residue_table(((TaskShape(1000, 470, 1, ("A10",)), 1.0),), "T4", 0)[600] == 600.0
    assert residue_table(((TaskShape(1000, 0, 0), 1.0),), "T4", 0)[600] == 600.0


def test_conditioned_table_by_hand() -> None:
    # a 470 or a whole GPU. V'(h) = mean of V'(h - s) over the asks that fit (h when none); T = V' - (1 - fits) h
    shapes = ((TaskShape(1000, 470, 1), 0.5), (TaskShape(1000, 1000, 1), 0.5))
    table = lookahead_table(shapes, "T4", 0, conditioned=True)
    assert table[60] == pytest.approx(60 - 60)  # nothing fits: V' = h, FGD's term is h too
    assert table[530] == pytest.approx(60 - 0.5 * 530)  # only the 470 fits and leaves 60
    assert table[1000] == pytest.approx(0.5 * 60 + 0.5 * 0)  # both fit: V'(530) = 60, V'(0) = 0


def test_deep_table_by_hand() -> None:
    # workload: a 470 share or a whole GPU, half and half. V(h) = sum_m p_m (h if m does not fit, else V(h - s_m))
    shapes = ((TaskShape(1000, 470, 1), 0.5), (TaskShape(1000, 1000, 1), 0.5))
    table = lookahead_table(shapes, "T4", 0)
    assert table[0] == 0.0
    assert table[60] == 0.0  # nothing fits: FGD's own term covers it, nothing deeper
    assert table[530] == pytest.approx(0.5 * 60)  # the 470 fits and leaves 60, which nothing fills
    # V(530) = 0.5 * 530 + 0.5 * 60 = 295; D(1000) = 0.5 * V(530) + 0.5 * V(0)
    assert table[1000] == pytest.approx(0.5 * 295)
    # a model the shapes do not allow, or CPU-only shapes, look ahead to nothing
    assert not any(lookahead_table(((TaskShape(1000, 470, 1, ("A10",)), 1.0),), "T4", 0))
    assert not any(lookahead_table(((TaskShape(1000, 0, 0), 1.0),), "T4", 0))


@pytest.mark.parametrize(
    ("task", "lafgd_prefers", "bfgd_prefers", "why"),
    [
        # a 320 beside a 320 leaves 360 (a 320 fits, 40 left); beside a 470 it leaves 210, which none of the
        # learned asks fills: bfgd sees both GPUs as usable by the next task, lafgd sees what they leave
        (320, (320,), (470,), "keep the 530 hole for a 470"),
        # a 230 beside a 650 leaves 120 for good; beside a 230 it leaves 540 (a 470 fits, then 70 left)
        (230, (230,), (650,), "leave the 650 for a 320"),
        (230, (230,), (320, 320), "leave a hole the common 470 fits"),
    ],
)
def test_preferred_gpu_where_bfgd_disagrees(
    task: int, lafgd_prefers: tuple[int, ...], bfgd_prefers: tuple[int, ...], why: str
) -> None:
    assert score("lafgd", lafgd_prefers, task) > score("lafgd", bfgd_prefers, task), why
    assert score("bfgd", bfgd_prefers, task) > score("bfgd", lafgd_prefers, task)


def test_without_lookahead_it_scores_as_bfgd() -> None:
    plain = LookaheadFGD(lookahead_weight=0.0)
    bfgd = make_policy("bfgd")
    for task in WORKLOAD:
        plain.observe(build_request(task))
        bfgd.observe(build_request(task))
    for used in [(), (470,), (320,), (230,), (320, 320)]:
        for milli in (230, 320, 470, 1000):
            a = place(one_gpu_node(used), build_request(share(milli)), plain, plain, check_host=True)
            b = place(one_gpu_node(used), build_request(share(milli)), bfgd, bfgd, check_host=True)
            assert type(a) is type(b)
            if isinstance(a, Placement) and isinstance(b, Placement):
                assert a.score == b.score


def test_unknown_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown look-ahead mode 'nope'"):
        LookaheadFGD(mode="nope")


def test_epoch_changes_only_with_the_learned_model() -> None:
    policy = make_policy("lafgd")
    policy.observe(build_request(share(470)))
    epoch = policy.epoch()
    for _ in range(6):  # refreshes at 8 pods: same single shape, same ratio, same table
        policy.observe(build_request(share(470)))
    policy.observe(build_request(share(470)))
    assert policy.epoch() == epoch


def test_live_nodes_real_units_and_topology() -> None:
    """On a real node (GPUs in percent, memory asks, NVSwitch links) lafgd places like bfgd's live machinery: a
    4-GPU pod gets connected GPUs, a memory-only share lands, and the look-ahead term reads real-unit shares."""

    def request(cpu_milli: int, **kwargs: object) -> PlacementRequest:
        return PlacementRequest(protocol.parse_pod_gpu_request(pod(**kwargs)), cpu_milli=cpu_milli)

    policy = make_policy("lafgd")
    share_pod = request(4000, memory_mib=20480, cores=25)
    memory_only = request(2000, memory_mib=8192)
    quad = request(16000, gpus=4, cores=100)
    for _ in range(8):
        for item in (share_pod, memory_only, quad):
            policy.observe(item)
    state = NodeState("live", synth_inventory("live", 8, "A100", 81920, "nvswitch"), cpu_milli_total=128000)
    for item in (share_pod, memory_only, quad):
        result = place(state, item, policy, policy)
        assert isinstance(result, Placement), result
        state.apply_usage(result.usage)
        state.cpu_milli_used += item.cpu_milli
    assert isinstance(policy, LookaheadFGD)
    assert any(policy.table(state))  # learned from real-unit asks
