"""topology: multi-GPU requests get the best-connected free set of GPUs; single-GPU requests fill GPUs
already in use first and otherwise take the idle GPU whose loss least breaks up well-connected idle sets.

The set search is greedy from every seed GPU (O(n^2 k) for n candidates) instead of enumerating all
C(n, k) combinations; with the link scores of model.link_score it finds the optimum on NVSwitch,
NVLink-pair and PCIe-tree nodes (tests/engine/test_topology.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from operator import attrgetter
from typing import TYPE_CHECKING

from kube_vgpu.extender.engine.model import GpuState
from kube_vgpu.extender.engine.policies.base import Policy, Scratch, free_memory_after, node_fill_after

if TYPE_CHECKING:
    from kube_vgpu.extender.engine.model import NodeState, Placement, PlacementRequest
    from kube_vgpu.protocol import ContainerGpuRequest

BEST_LINK_SCORE = 118  # NVLink (100) + 18 lanes (H100)


def set_quality(matrix: list[list[int]], positions: Sequence[int]) -> tuple[int, int]:
    """(weakest pairwise link, sum of pairwise links) of a GPU set; higher is better."""
    weakest = 1 << 30
    total = 0
    for i, a in enumerate(positions):
        row = matrix[a]
        for b in positions[i + 1 :]:
            score = row[b]
            total += score
            if score < weakest:
                weakest = score
    return (weakest if len(positions) > 1 else 0, total)


def best_connected_set(matrix: list[list[int]], candidates: Sequence[int], count: int) -> list[int]:
    """Greedy best-connected set of `count` positions among `candidates`."""
    if count >= len(candidates):
        return list(candidates)
    if len(candidates) > 1 and _uniform_links(matrix, candidates):
        # every set is as good as any other (NVSwitch, or no links): the search keeps its first seed's set, the
        # first candidate and then the lowest positions (the tie-break -c), without its O(n^2 k) key calls
        first = candidates[0]
        return [first, *sorted(c for c in candidates if c != first)[: count - 1]]
    best: list[int] | None = None
    best_quality: tuple[int, int] = (-1, -1)
    for seed in candidates:
        chosen = [seed]
        remaining = [c for c in candidates if c != seed]
        while len(chosen) < count:
            # add the GPU whose weakest link into the set is strongest (then the most total bandwidth)
            pick = max(
                remaining,
                key=lambda c: (min(matrix[c][s] for s in chosen), sum(matrix[c][s] for s in chosen), -c),
            )
            chosen.append(pick)
            remaining.remove(pick)
        quality = set_quality(matrix, chosen)
        if quality > best_quality:
            best, best_quality = chosen, quality
    assert best is not None
    return best


def _uniform_links(matrix: list[list[int]], candidates: Sequence[int]) -> bool:
    """Whether every pair of the candidates has the same link score, both ways."""
    link = matrix[candidates[0]][candidates[1]]
    for i, a in enumerate(candidates):
        row = matrix[a]
        for b in candidates[i + 1:]:
            if row[b] != link or matrix[b][a] != link:
                return False
    return True


#: (link matrix id, candidate positions, count) -> best_connected_set; nodes of one hardware type in one usage
#: pattern share an entry, so a scan over thousands of alike nodes runs the greedy search a few times
_BEST_SET_MEMO: dict[tuple[int, tuple[int, ...], int], list[int]] = {}


def best_connected_positions(link_id: int, matrix: list[list[int]], positions: tuple[int, ...],
                             count: int) -> list[int]:
    """best_connected_set of sorted `positions`, memoised per link matrix (model.NodeState.link_id): the result
    depends only on the matrix, the positions and the count. Callers must not mutate the list returned."""
    key = (link_id, positions, count)
    chosen = _BEST_SET_MEMO.get(key)
    if chosen is None:
        chosen = best_connected_set(matrix, positions, count)
        if len(_BEST_SET_MEMO) > 100_000:  # bounded
            _BEST_SET_MEMO.clear()
        _BEST_SET_MEMO[key] = chosen
    return chosen


_gpu_index = attrgetter("index")


def least_damaging_gpu(node: NodeState, candidates: Sequence[GpuState], scratch: Scratch) -> GpuState:
    """The candidate whose loss least breaks up well-connected idle GPUs (weakest best link to the other idle
    GPUs, then least total link, then lowest index)."""
    if not node.has_links:  # every link is 0: the damage is the index alone
        return min(candidates, key=_gpu_index)
    matrix = node.link_matrix
    idle_positions = [g.position for g in node.gpus if g.schedulable and g.idle and not scratch.vgpus[g.position]]

    def damage(gpu: GpuState) -> tuple[int, int, int]:
        links = [matrix[gpu.position][p] for p in idle_positions if p != gpu.position]
        return (max(links, default=0), sum(links), gpu.index)

    return min(candidates, key=damage)


def best_connected_gpus(node: NodeState, candidates: Sequence[GpuState], count: int) -> list[GpuState]:
    """The best-connected `count` of the candidates (see best_connected_set)."""
    by_position = {gpu.position: gpu for gpu in candidates}
    chosen = best_connected_positions(node.link_id, node.link_matrix, tuple(sorted(by_position)), count)
    return [by_position[p] for p in chosen]


def connectivity(node: NodeState, placement: Placement) -> float | None:
    """How well the placement's multi-GPU containers are connected, 0..1 (weakest pairwise link against the best
    link there is); None when no container has more than one GPU."""
    quality: float | None = None
    for container in placement.containers:
        if len(container.devices) > 1 and not container.request.mig:  # MIG devices have no link matrix
            weakest, _ = set_quality(node.link_matrix, [d[0] for d in container.devices])
            quality = max(quality or 0.0, weakest / BEST_LINK_SCORE)
    return quality


class Topology(Policy):
    name = "topology"

    def choose_gpus(
        self,
        node: NodeState,
        request: PlacementRequest,
        container: ContainerGpuRequest,
        candidates: Sequence[GpuState],
        scratch: Scratch,
    ) -> Sequence[GpuState]:
        if container.count == 1:
            shared = [g for g in candidates if g.used_vgpus + scratch.vgpus[g.position] > 0]
            if shared:  # binpack onto GPUs that are already split
                return [min(shared, key=lambda g: (free_memory_after(g, container, scratch), g.index))]
            return [least_damaging_gpu(node, candidates, scratch)]
        return best_connected_gpus(node, candidates, container.count)

    def score(self, node: NodeState, request: PlacementRequest, placement: Placement) -> float:
        fill = node_fill_after(node, placement)
        quality = connectivity(node, placement)
        return 0.7 * quality + 0.3 * fill if quality is not None else fill
