"""bfgd as the extender's default: real nodes (links, GPUs in percent), unknown host CPU, the node score's
topology and fill terms (openb-style nodes and the reference_ties option: tests/engine/test_reference_policies.py)."""

from __future__ import annotations

from typing import Any

import pytest

from kube_vgpu import protocol
from kube_vgpu.dev.fixtures import synth_inventory
from kube_vgpu.extender.engine.fit import place
from kube_vgpu.extender.engine.model import NodeState, Placement, PlacementRequest
from kube_vgpu.extender.engine.policies import make_policy
from kube_vgpu.extender.engine.policies.base import Policy
from tests.helpers import pod


def node(
    name: str = "n", gpus: int = 4, topology: str = "nvswitch", cpu_milli: int = 64000, memory_mib: int = 81920
) -> NodeState:
    return NodeState(name, synth_inventory(name, gpus, "A100", memory_mib, topology), cpu_milli_total=cpu_milli)


def request(cpu_milli: int = 8000, **kwargs: Any) -> PlacementRequest:
    return PlacementRequest(protocol.parse_pod_gpu_request(pod(**kwargs)), cpu_milli=cpu_milli)


def learned(*requests: PlacementRequest) -> Policy:
    policy = make_policy("bfgd")
    for _ in range(8):
        for item in requests:
            policy.observe(item)
    return policy


def placed(policy: Policy, state: NodeState, item: PlacementRequest) -> Placement:
    result = place(state, item, policy, policy)
    assert isinstance(result, Placement), result
    return result


def use(state: NodeState, policy: Policy, item: PlacementRequest) -> None:
    result = placed(policy, state, item)
    state.apply_usage(result.usage)
    state.cpu_milli_used += item.cpu_milli


WHOLE = request(cpu_milli=16000, gpus=1, cores=100)
SHARE = request(cpu_milli=4000, memory_mib=20480, cores=25)
CPU_ONLY = request(cpu_milli=16000, gpus=None)


def test_unknown_host_cpu_is_fgd_not_everything_stranded() -> None:
    """A node without allocatable CPU (not reported yet) scores like a node with CPU to spare: the CPU terms drop
    out instead of calling every idle GPU stranded (or every task unable to fit)."""
    from kube_vgpu.extender.engine.policies._milli import frag_cpu_free_milli, free_milli_list

    policy = learned(WHOLE, SHARE)
    unknown = node("unknown", cpu_milli=0)
    ample = node("ample", cpu_milli=1_000_000)
    poor = node("poor", cpu_milli=12000)
    for state in (unknown, ample, poor):
        use(state, policy, SHARE)  # cpu_milli_used grows on every node; `unknown` still has no total
    assert placed(policy, unknown, SHARE).score == placed(policy, ample, SHARE).score
    assert placed(policy, unknown, WHOLE).score == placed(policy, ample, WHOLE).score
    stranded = {
        s.name: policy.stranded(s, *frag_cpu_free_milli(s), free_milli_list(s))  # type: ignore[attr-defined]
        for s in (unknown, ample, poor)
    }
    assert stranded["unknown"] == stranded["ample"] == 0 < stranded["poor"]


def test_cpu_only_pods_go_where_they_strand_no_gpu() -> None:
    policy = learned(WHOLE, SHARE)
    busy = node("busy", cpu_milli=40000)
    for _ in range(4):
        use(busy, policy, WHOLE)  # all GPUs used, 24 CPUs left
    idle = node("idle", cpu_milli=40000)  # 4 idle GPUs that need its CPU
    assert placed(policy, busy, CPU_ONLY).score > placed(policy, idle, CPU_ONLY).score


def test_sharing_pods_fill_a_split_gpu_even_when_the_workload_cannot_tell() -> None:
    """With only this shape learned, packing and spreading fragment alike; the tie goes to the GPU in use (and the
    fuller node), as kube-vgpu's binpack/topology defaults did, not to an idle GPU."""
    small = request(cpu_milli=500, memory_mib=3072, cores=20)
    policy = learned(small)
    state = node(gpus=8)
    use(state, policy, small)
    again = placed(policy, state, small)
    assert [u.position for u in again.usage] == [0]
    empty = node("empty", gpus=8)
    assert placed(policy, state, small).score > placed(policy, empty, small).score


@pytest.mark.parametrize(
    ("topology", "gpus", "cores"),
    [("nvswitch", 4, 100), ("nvswitch", 8, 100), ("nvlink-pairs", 2, 100), ("nvswitch", 2, 30)],
)
def test_multi_gpu_node_score_prefers_nvlink_to_pcie(topology: str, gpus: int, cores: int) -> None:
    multi = request(cpu_milli=8000, gpus=gpus, cores=cores, memory_mib=10240)
    policy = learned(multi)
    nvlink = placed(policy, node("a", gpus=8, topology=topology), multi).score
    pcie = placed(policy, node("b", gpus=8, topology="pcie"), multi).score
    assert nvlink > pcie


def test_learned_cpu_per_gpu_depends_on_the_gpu_size() -> None:
    """8 CPUs per 8 GiB pod: a tenth of an 80 GiB GPU, half of a 16 GiB one."""
    policy = learned(request(cpu_milli=8000, memory_mib=8192))
    assert policy.cpu_per_gpu_on(81920) == pytest.approx(80.0)  # type: ignore[attr-defined]
    assert policy.cpu_per_gpu_on(16384) == pytest.approx(16.0)  # type: ignore[attr-defined]


def test_epoch_changes_only_when_the_learned_model_does() -> None:
    """Refreshes at 8, 16, 32 ... pods of one shape leave the model as it was: cached results stay valid."""
    policy = make_policy("bfgd")
    policy.observe(SHARE)
    first = policy.epoch()
    for _ in range(40):
        policy.observe(SHARE)
    assert policy.epoch() == first
    for _ in range(40):
        policy.observe(WHOLE)
    assert policy.epoch() > first
