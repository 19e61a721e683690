"""fragfit (ours): fragmentation gradient descent with exact gains, learned workload, best-fit tie-break.

Like fgd, a pod goes where it increases GPU fragmentation (engine.fragmentation, the FGD measure) the least,
but: (1) the gain is used exactly, not squashed into an integer 0..100 (the reference's quantisation makes many
nodes tie and the tie-break then decides); (2) among nodes with (nearly) the same gain, the one left with the
least free GPU and CPU wins (best fit keeps large holes for large pods); (3) the target workload is learned
online from the pods seen so far (no knowledge of the future).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..fragmentation import MILLI_PER_GPU, WeightedShapes
from ._milli import MAX_SPEC_CPU_MILLI, MAX_SPEC_GPU_MILLI, cpu_free_milli, free_after, free_milli_list, request_milli
from .base import Policy, Scratch, register
from .fgd import FragPolicyBase, quantised_gain

if TYPE_CHECKING:
    from kube_vgpu.protocol import ContainerGpuRequest

    from ..model import GpuState, NodeState, Placement, PlacementRequest

_ = Policy


@register
class FragFit(FragPolicyBase):
    name = "fragfit"

    def __init__(
        self,
        shapes: WeightedShapes | None = None,
        coverage: float = 0.95,
        fit_weight: float = 0.05,
        cpu_weight: float = 0.5,
        learn: bool = True,
        quantize: bool = False,
        step_milli: float = 0.0,
        balance_weight: float = 0.0,
    ) -> None:
        # learn=True ignores given shapes: a live scheduler only knows the pods it has seen
        super().__init__(None if learn else shapes, coverage)
        self.fit_weight = fit_weight
        self.cpu_weight = cpu_weight
        self.quantize = quantize
        self.step_milli = step_milli
        self.balance_weight = balance_weight
        self._cpu_seen = 0  # milli-CPU of GPU pods seen
        self._gpu_seen = 0  # milli-GPU of GPU pods seen
        self.cpu_per_gpu = 0.0  # learned milli-CPU a GPU pod brings per milli-GPU (updated with the epoch)

    def observe(self, request: PlacementRequest) -> None:
        milli, count = request_milli(request)
        if count:
            self._cpu_seen += request.cpu_milli
            self._gpu_seen += milli * count
        epoch = self._epoch
        super().observe(request)
        if self._epoch != epoch and self._gpu_seen:
            self.cpu_per_gpu = self._cpu_seen / self._gpu_seen

    def _stranded(self, cpu_free: int, free: Sequence[int]) -> float:
        """Idle milli-GPU that the node's free CPU cannot feed at the learned CPU-per-GPU ratio."""
        if not self.cpu_per_gpu:
            return 0.0
        return max(0.0, sum(free) - cpu_free / self.cpu_per_gpu)
    def _gain(self, node: NodeState, cpu_free: int, free_before: Sequence[int], cpu_after: int, free: Sequence[int]) -> float:
        before = self.node_frag(node, cpu_free, free_before)
        after = self.node_frag(node, cpu_after, free)
        if self.balance_weight:
            before += self.balance_weight * self._stranded(cpu_free, free_before)
            after += self.balance_weight * self._stranded(cpu_after, free)
        gpus = len(free) or 1
        # best fit: fraction of this node's GPU and CPU left free after placing (less is better)
        left = sum(free) / (gpus * MILLI_PER_GPU) * (1 - self.cpu_weight) + self.cpu_weight * cpu_after / max(
            node.cpu_milli_total, 1
        )
        if self.step_milli:
            return math.floor((before - after) / self.step_milli) - self.fit_weight * left
        if self.quantize:
            return quantised_gain(before, after) - self.fit_weight * left
        return (before - after) / MILLI_PER_GPU - self.fit_weight * left

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
        cpu_after = cpu_free - request.cpu_milli
        before = list(free)
        best: GpuState | None = None
        best_key: tuple[float, int] = (-float("inf"), 0)
        seen: dict[int, tuple[float, int]] = {}
        for gpu in candidates:
            left = free[gpu.position]
            key = seen.get(left)
            if key is None:
                free[gpu.position] = left - milli
                key = (self._gain(node, cpu_free, before, cpu_after, free), -left)
                free[gpu.position] = left
                seen[left] = key
            if key > best_key:
                best, best_key = gpu, key
        assert best is not None
        return [best]

    def score(self, node: NodeState, request: PlacementRequest, placement: Placement) -> float:
        cpu_free = cpu_free_milli(node)
        return self._gain(
            node, cpu_free, free_milli_list(node), cpu_free - request.cpu_milli, free_after(node, placement)
        )


_unused = (MAX_SPEC_CPU_MILLI, MAX_SPEC_GPU_MILLI)
