"""The topology policy, and bfgd (the extender's default), pick the best-connected GPU set on NVSwitch,
NVLink-pair and PCIe nodes."""

from __future__ import annotations

from itertools import combinations
from typing import Any

import pytest

from kube_vgpu import protocol
from kube_vgpu.dev.fixtures import synth_inventory
from kube_vgpu.extender.engine.fit import place
from kube_vgpu.extender.engine.model import NodeState, Placement, PlacementRequest
from kube_vgpu.extender.engine.policies import DEFAULT_GPU_POLICY, DEFAULT_NODE_POLICY, make_policy
from kube_vgpu.extender.engine.policies.topology import best_connected_set, set_quality
from tests.helpers import pod

#: every policy that must keep multi-GPU pods on well-connected GPUs: topology and the extender's defaults
POLICIES = sorted({"topology", "bfgd", DEFAULT_GPU_POLICY})


def occupy(node: NodeState, *positions: int) -> None:
    for position in positions:
        gpu = node.gpus[position]
        gpu.used_memory_mib, gpu.used_cores, gpu.used_vgpus, gpu.exclusive_holders = gpu.memory_mib, 100, 1, 1
    node.touch()


def chosen(node: NodeState, policy: str, **kwargs: Any) -> list[int]:
    gpu_policy = make_policy(policy)
    node_policy = make_policy(DEFAULT_NODE_POLICY if policy == DEFAULT_GPU_POLICY else policy)
    result = place(node, PlacementRequest(protocol.parse_pod_gpu_request(pod(**kwargs))), gpu_policy, node_policy)
    assert isinstance(result, Placement), result
    return sorted(d[0] for d in result.containers[0].devices)


def brute_force_best(node: NodeState, free: list[int], count: int) -> tuple[int, int]:
    return max(set_quality(node.link_matrix, list(c)) for c in combinations(free, count))


@pytest.mark.parametrize("policy", POLICIES)
def test_nvswitch_any_set_is_all_nvlink(policy: str) -> None:
    node = NodeState("n", synth_inventory("n", 8, "H100", 81920, "nvswitch"))
    occupy(node, 0, 5)
    picked = chosen(node, policy, gpus=4, cores=100)
    assert not {0, 5} & set(picked)
    assert set_quality(node.link_matrix, picked)[0] >= 100  # every pair over NVLink


@pytest.mark.parametrize("policy", POLICIES)
def test_nvlink_pairs_two_gpus_get_a_pair(policy: str) -> None:
    node = NodeState("n", synth_inventory("n", 8, "A100", 40960, "nvlink-pairs"))
    occupy(node, 0, 3)  # pairs (0,1) and (2,3) are broken; (4,5) and (6,7) are intact
    assert chosen(node, policy, gpus=2, cores=100) in ([4, 5], [6, 7])


@pytest.mark.parametrize("policy", POLICIES)
def test_nvlink_pairs_four_gpus_get_two_pairs_on_one_numa_node(policy: str) -> None:
    node = NodeState("n", synth_inventory("n", 8, "A100", 40960, "nvlink-pairs"))
    occupy(node, 1)
    picked = chosen(node, policy, gpus=4, cores=100)
    assert picked == [4, 5, 6, 7]


@pytest.mark.parametrize("policy", POLICIES)
def test_single_gpu_does_not_break_an_intact_pair(policy: str) -> None:
    node = NodeState("n", synth_inventory("n", 4, "A100", 40960, "nvlink-pairs"))
    occupy(node, 0)  # GPU 1 lost its partner; (2,3) intact
    assert chosen(node, policy, gpus=1, cores=100) == [1]


@pytest.mark.parametrize("policy", POLICIES)
def test_pcie_prefers_same_switch(policy: str) -> None:
    node = NodeState("n", synth_inventory("n", 8, "T4", 15360, "pcie"))
    occupy(node, 0)
    picked = chosen(node, policy, gpus=2, cores=100)
    assert picked[0] // 2 == picked[1] // 2  # a pair under one switch
    assert 1 not in picked  # and not the lonely GPU beside the busy one


@pytest.mark.parametrize("topology", ["nvswitch", "nvlink-pairs", "pcie"])
@pytest.mark.parametrize("count", [2, 3, 4])
def test_greedy_matches_brute_force(topology: str, count: int) -> None:
    node = NodeState("n", synth_inventory("n", 8, "X", 1000, topology))
    for busy in ([], [0], [1, 6], [0, 2, 5]):
        free = [p for p in range(8) if p not in busy]
        picked = best_connected_set(node.link_matrix, free, count)
        assert set_quality(node.link_matrix, picked)[0] == brute_force_best(node, free, count)[0]


@pytest.mark.parametrize("policy", POLICIES)
def test_fractional_multi_gpu_pods_get_a_pair_too(policy: str) -> None:
    node = NodeState("n", synth_inventory("n", 8, "A100", 40960, "nvlink-pairs"))
    occupy(node, 0, 3)
    assert chosen(node, policy, gpus=2, memory_mib=8192, cores=10) in ([4, 5], [6, 7])
