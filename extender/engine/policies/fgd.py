"""fgd (reference): Fragmentation Gradient Descent (Weng et al., USENIX ATC'23).

Place each pod on the node, and a sharing pod on the GPU, that increases the node's fragmentation (see
engine.fragmentation) the least under the target workload. Score = int(100 * sigmoid((frag_before -
frag_after) / 1000)), an integer as in the reference simulator (ties go to a random node); for a sharing pod the
GPU with the best score, lowest index on ties; whole GPUs: the lowest-index idle ones.

The target workload is given (`shapes=`, the whole trace's typical shapes, as the paper does) or, when not
given, learned online from the pods seen so far (fragmentation.ShapeLearner).

Units: milli-GPU per engine.shares (compute and memory, per GPU), so real HAMi pods (memory-only, cores-only,
whole-GPU asks) are measured as well as openb tasks. A node with unknown allocatable CPU counts as having CPU for
every task (CPU is then left out of the measure).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kube_vgpu.extender.engine.fragmentation import FragModel, ShapeLearner, WeightedShapes, task_shape
from kube_vgpu.extender.engine.policies._milli import (
    container_usage,
    frag_cpu_free_milli,
    free_after,
    free_milli_list,
    free_with_scratch,
)
from kube_vgpu.extender.engine.policies.base import Policy, Scratch
from kube_vgpu.extender.engine.shares import free_share_milli

if TYPE_CHECKING:
    from kube_vgpu.extender.engine.model import GpuState, NodeState, Placement, PlacementRequest
    from kube_vgpu.protocol import ContainerGpuRequest


def sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def quantised_gain(frag_before: float, frag_after: float) -> int:
    """The reference's node score 0..100 for a change of fragmentation (milli-GPU)."""
    return int(sigmoid((frag_before - frag_after) / 1000) * 100)


class FragPolicyBase(Policy):
    """Holds the target workload (fixed or learned) and its memoised fragmentation model; places like FGD.

    Subclasses change the node measure (`measure`) and the choice among equally good GPUs."""

    uses_host_cpu = True

    def __init__(self, shapes: WeightedShapes | None = None, coverage: float = 0.95) -> None:
        self._fixed = shapes is not None
        self._learner = ShapeLearner(coverage)
        self.frag_model = FragModel(shapes or ())
        self._epoch = 0

    def epoch(self) -> int:
        return self._epoch

    def observe(self, request: PlacementRequest) -> None:
        if self._fixed:
            return
        if self._learner.add(task_shape(request)):
            self.refresh()

    def refresh(self) -> None:
        """Re-derive the learned model; the epoch (and so every cached result) changes only when it differs
        (a live extender then avoids re-placing every node when the workload has not changed)."""
        shapes = self._learner.shapes()
        if shapes != self.frag_model.shapes:
            self.frag_model = FragModel(shapes)
            self._epoch += 1

    def node_frag(self, node: NodeState, cpu_free: int, free: Sequence[int]) -> float:
        return self.frag_model.frag(node.gpu_model, cpu_free, tuple(sorted(free, reverse=True)), node.gpu_memory_mib)

    def measure(self, node: NodeState, cpu_free: int, cpu_known: bool, free: Sequence[int]) -> float:
        """The node's fragmentation (milli-GPU) with this free CPU and free milli-GPU per GPU."""
        return self.node_frag(node, cpu_free, free)

    def node_measure(self, node: NodeState, cpu_free: int, cpu_known: bool) -> float:
        """measure() of the node's own free GPU shares (memoised for this version of the node: every request
        shape placed on it measures it before). One entry per policy, for the latest epoch and free CPU, so a node
        that does not change holds no more as the epochs go by."""
        cache = node.version_cache
        epoch = self.epoch()  # what every cached result of the policy is keyed by
        entry: tuple[int, int, bool, float] | None = cache.get(self)
        if entry is not None and entry[0] == epoch and entry[1] == cpu_free and entry[2] == cpu_known:
            return entry[3]
        value = self.measure(node, cpu_free, cpu_known, free_milli_list(node))
        cache[self] = (epoch, cpu_free, cpu_known, value)
        return value

    def choose_whole(
        self, node: NodeState, container: ContainerGpuRequest, candidates: Sequence[GpuState], scratch: Scratch
    ) -> Sequence[GpuState]:
        """Whole GPUs (or several GPUs): the reference takes the lowest-index idle ones."""
        return list(candidates[: container.count])

    def break_tie(self, node: NodeState, tied: list[GpuState], scratch: Scratch) -> GpuState:
        return tied[0]  # lowest index

    def gain(self, frag_before: float, frag_after: float) -> float:
        """Score (higher is better) of a change of the measure, for nodes and for a sharing pod's GPU: the
        reference's integer 0..100."""
        return quantised_gain(frag_before, frag_after)

    def choose_gpus(
        self,
        node: NodeState,
        request: PlacementRequest,
        container: ContainerGpuRequest,
        candidates: Sequence[GpuState],
        scratch: Scratch,
    ) -> Sequence[GpuState]:
        if container.count != 1 or container.cores >= candidates[0].cores:
            return self.choose_whole(node, container, candidates, scratch)
        if len(candidates) == 1:
            return [candidates[0]]
        free = free_with_scratch(node, scratch)
        cpu_free, cpu_known = frag_cpu_free_milli(node)
        cpu_after = cpu_free - request.cpu_milli if cpu_known else cpu_free
        # nothing of this pod on the node's GPUs yet (its first container): the node's own measure
        before = (
            self.measure(node, cpu_free, cpu_known, free)
            if any(scratch.vgpus)
            else self.node_measure(node, cpu_free, cpu_known)
        )
        s_memory, s_cores, s_vgpus, s_exclusive = scratch.memory_mib, scratch.cores, scratch.vgpus, scratch.exclusive
        # GPUs with the same free share before and after lead to the same node state
        by_change: dict[tuple[int, int], float] = {}
        tied: list[GpuState] = []
        best_score = -1.0
        for gpu in candidates:
            position = gpu.position
            left = free[position]
            memory, cores, exclusive = container_usage(container, gpu)
            taken = free_share_milli(
                gpu,
                s_memory[position] + memory,
                s_cores[position] + cores,
                s_vgpus[position] + 1,
                s_exclusive[position] or exclusive,
            )
            score = by_change.get((left, taken))
            if score is None:
                free[position] = taken
                score = self.gain(before, self.measure(node, cpu_after, cpu_known, free))
                free[position] = left
                by_change[(left, taken)] = score
            if score > best_score:
                tied, best_score = [gpu], score
            elif score == best_score:
                tied.append(gpu)
        return [tied[0] if len(tied) == 1 else self.break_tie(node, tied, scratch)]

    def score(self, node: NodeState, request: PlacementRequest, placement: Placement) -> float:
        cpu_free, cpu_known = frag_cpu_free_milli(node)
        cpu_after = cpu_free - request.cpu_milli if cpu_known else cpu_free
        before = self.node_measure(node, cpu_free, cpu_known)
        after = self.measure(node, cpu_after, cpu_known, free_after(node, placement))
        return float(self.gain(before, after))


class FGD(FragPolicyBase):
    name = "fgd"
