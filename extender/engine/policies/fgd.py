"""fgd (reference): Fragmentation Gradient Descent (Weng et al., USENIX ATC'23).

Place each pod on the node, and a sharing pod on the GPU, that increases the node's fragmentation (see
engine.fragmentation) the least under the target workload. Score = int(100 * sigmoid((frag_before -
frag_after) / 1000)), an integer as in the reference simulator (ties go to a random node); for a sharing pod the
GPU with the best score, lowest index on ties; whole GPUs: the lowest-index idle ones.

The target workload is given (`shapes=`, the whole trace's typical shapes, as the paper does) or, when not
given, learned online from the pods seen so far (fragmentation.ShapeLearner).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..fragmentation import MILLI_PER_GPU, FragModel, ShapeLearner, WeightedShapes, task_shape
from ._milli import cpu_free_milli, free_after, free_milli_list, request_milli
from .base import Policy, Scratch, register

if TYPE_CHECKING:
    from kube_vgpu.protocol import ContainerGpuRequest

    from ..model import GpuState, NodeState, Placement, PlacementRequest


def sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def quantised_gain(frag_before: float, frag_after: float) -> int:
    """The reference's node score 0..100 for a change of fragmentation (milli-GPU)."""
    return int(sigmoid((frag_before - frag_after) / MILLI_PER_GPU) * 100)


class FragPolicyBase(Policy):
    """Holds the target workload (fixed or learned) and its memoised fragmentation model."""

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
            self.frag_model = FragModel(self._learner.shapes())
            self._epoch += 1

    def node_frag(self, node: NodeState, cpu_free: int, free: Sequence[int]) -> float:
        model = node.gpus[0].model if node.gpus else ""
        return self.frag_model.frag(model, cpu_free, tuple(sorted(free, reverse=True)))


@register
class FGD(FragPolicyBase):
    name = "fgd"

    def choose_gpus(
        self,
        node: NodeState,
        request: PlacementRequest,
        container: ContainerGpuRequest,
        candidates: Sequence[GpuState],
        scratch: Scratch,
    ) -> Sequence[GpuState]:
        milli, count = request_milli(request)
        if count != 1 or milli >= MILLI_PER_GPU or len(candidates) == 1:
            return list(candidates[: container.count])
        free = free_milli_list(node)
        for position, cores in enumerate(scratch.cores):
            free[position] -= cores
        cpu_free = cpu_free_milli(node)
        before = self.node_frag(node, cpu_free, free)
        cpu_after = cpu_free - request.cpu_milli
        by_free: dict[int, int] = {}  # GPUs with the same free amount lead to the same node state
        best: GpuState | None = None
        best_score = -1
        for gpu in candidates:
            left = free[gpu.position]
            score = by_free.get(left)
            if score is None:
                free[gpu.position] = left - milli
                score = quantised_gain(before, self.node_frag(node, cpu_after, free))
                free[gpu.position] = left
                by_free[left] = score
            if score > best_score:
                best, best_score = gpu, score
        assert best is not None
        return [best]

    def score(self, node: NodeState, request: PlacementRequest, placement: Placement) -> float:
        cpu_free = cpu_free_milli(node)
        before = self.node_frag(node, cpu_free, free_milli_list(node))
        after = self.node_frag(node, cpu_free - request.cpu_milli, free_after(node, placement))
        return float(quantised_gain(before, after))
