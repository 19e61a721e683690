"""The topology policy, and bfgd (the extender's default), pick the best-connected GPU set on NVSwitch,
NVLink-pair and PCIe nodes."""

from __future__ import annotations

from itertools import combinations
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kube_vgpu import protocol
from kube_vgpu.dev.fixtures import synth_inventory
from kube_vgpu.extender.engine.fit import place
from kube_vgpu.extender.engine.model import NodeState, Placement, PlacementRequest
from kube_vgpu.extender.engine.policies import DEFAULT_GPU_POLICY, DEFAULT_NODE_POLICY, make_policy
from kube_vgpu.extender.engine.policies.topology import (
    best_connected_positions,
    best_connected_set,
    set_quality,
)
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


def greedy_search(matrix: list[list[int]], candidates: list[int], count: int) -> list[int]:
    """best_connected_set's search from every seed, without its shortcuts (the reference)."""
    if count >= len(candidates):
        return list(candidates)
    best: list[int] = []
    best_quality = (-1, -1)
    for seed in candidates:
        picked = [seed]
        remaining = [c for c in candidates if c != seed]
        while len(picked) < count:
            pick = max(remaining, key=lambda c: (min(matrix[c][s] for s in picked), sum(matrix[c][s] for s in picked),
                                                 -c))
            picked.append(pick)
            remaining.remove(pick)
        quality = set_quality(matrix, picked)
        if quality > best_quality:
            best, best_quality = picked, quality
    return best


@st.composite
def link_matrices(draw: st.DrawFn) -> list[list[int]]:
    """8x8 link scores: uniform (NVSwitch, or none), a few values, or uniform but for one pair (or one direction)."""
    kind = draw(st.sampled_from(["uniform", "random", "one-pair", "one-way"]))
    base = draw(st.sampled_from([0, 10, 100, 118]))
    matrix = [[0 if a == b else base for b in range(8)] for a in range(8)]
    if kind == "random":
        for a in range(8):
            for b in range(a + 1, 8):
                matrix[a][b] = matrix[b][a] = draw(st.sampled_from([0, 10, 40, 100]))
    elif kind != "uniform":
        a, b = draw(st.lists(st.integers(0, 7), min_size=2, max_size=2, unique=True))
        matrix[a][b] = base + 1
        if kind == "one-pair":
            matrix[b][a] = base + 1
    return matrix


@settings(max_examples=300, deadline=None)
@given(matrix=link_matrices(), candidates=st.lists(st.integers(0, 7), min_size=1, max_size=8, unique=True),
       count=st.integers(1, 8))
def test_best_connected_set_is_the_greedy_search(matrix: list[list[int]], candidates: list[int], count: int) -> None:
    """The shortcut for candidates all linked alike (every set as good) gives the search's own answer, in its
    order, for candidates in any order; and the memoised positions equal the search on sorted candidates."""
    assert best_connected_set(matrix, candidates, count) == greedy_search(matrix, candidates, count)
    positions = tuple(sorted(candidates))
    link_id = -1 - abs(hash(tuple(map(tuple, matrix))))  # ids of its own (real ones are >= 0)
    assert best_connected_positions(link_id, matrix, positions, count) == greedy_search(matrix, list(positions),
                                                                                           count)
