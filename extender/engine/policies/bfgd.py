"""bfgd (ours): Balanced Fragmentation Gradient Descent.

FGD (policies/fgd.py) counts a node's idle GPU capacity as fragmented for a task shape only once the node's free
CPU drops below that one shape's ask, so it happily spends the CPU of GPU-rich nodes (CPU-only and CPU-heavy
pods) until, many pods later, their idle GPUs cannot be fed. bfgd adds to each node's fragmentation the idle
milli-GPU its free CPU cannot feed at the CPU-per-GPU ratio of the GPU pods seen so far:

    F(node) = FGD_frag(node) + balance_weight * max(0, idle_gpu_milli - free_cpu_milli / cpu_per_gpu)

and scores a placement like FGD, int(100 * sigmoid((F_before - F_after) / 1000)). CPU then goes preferentially
to nodes whose GPUs are already used (or to CPU-rich nodes), and GPUs of CPU-poor nodes stay usable.

Everything it knows is learned online from the pods it has seen (fragmentation.ShapeLearner for the target
workload, running sums for cpu_per_gpu), refreshed at doubling pod counts (the policy's epoch changes then, so
per-node caches stay valid in between). A sharing pod takes the GPU with the best score (lowest index on ties);
whole GPUs the lowest-index idle ones.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..fragmentation import MILLI_PER_GPU
from ._milli import cpu_free_milli, free_after, free_milli_list, request_milli
from .base import Scratch, register
from .fgd import FragPolicyBase, quantised_gain

if TYPE_CHECKING:
    from kube_vgpu.protocol import ContainerGpuRequest

    from ..model import GpuState, NodeState, Placement, PlacementRequest

DEFAULT_BALANCE_WEIGHT = 1.0


@register
class BalancedFGD(FragPolicyBase):
    name = "bfgd"

    def __init__(self, balance_weight: float = DEFAULT_BALANCE_WEIGHT, coverage: float = 0.95) -> None:
        super().__init__(None, coverage)  # no given workload: a live scheduler only knows the pods it has seen
        self.balance_weight = balance_weight
        self._cpu_seen = 0  # milli-CPU of the GPU pods seen
        self._gpu_seen = 0  # milli-GPU of the GPU pods seen
        self.cpu_per_gpu = 0.0  # milli-CPU per milli-GPU of GPU pods, refreshed with the epoch

    def observe(self, request: PlacementRequest) -> None:
        milli, count = request_milli(request)
        if count:
            self._cpu_seen += request.cpu_milli
            self._gpu_seen += milli * count
        epoch = self._epoch
        super().observe(request)
        if self._epoch != epoch and self._gpu_seen:
            self.cpu_per_gpu = self._cpu_seen / self._gpu_seen

    def stranded(self, cpu_free: int, free: Sequence[int]) -> float:
        """Idle milli-GPU that the node's free CPU cannot feed at the learned CPU-per-GPU ratio."""
        if not self.cpu_per_gpu:
            return 0.0
        return max(0.0, sum(free) - cpu_free / self.cpu_per_gpu)

    def balanced_frag(self, node: NodeState, cpu_free: int, free: Sequence[int]) -> float:
        return self.node_frag(node, cpu_free, free) + self.balance_weight * self.stranded(cpu_free, free)

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
        before = self.balanced_frag(node, cpu_free, free)
        by_free: dict[int, int] = {}  # GPUs with the same free amount lead to the same node state
        best: GpuState | None = None
        best_score = -1
        for gpu in candidates:
            left = free[gpu.position]
            score = by_free.get(left)
            if score is None:
                free[gpu.position] = left - milli
                score = quantised_gain(before, self.balanced_frag(node, cpu_after, free))
                free[gpu.position] = left
                by_free[left] = score
            if score > best_score:
                best, best_score = gpu, score
        assert best is not None
        return [best]

    def score(self, node: NodeState, request: PlacementRequest, placement: Placement) -> float:
        cpu_free = cpu_free_milli(node)
        before = self.balanced_frag(node, cpu_free, free_milli_list(node))
        after = self.balanced_frag(node, cpu_free - request.cpu_milli, free_after(node, placement))
        return float(quantised_gain(before, after))
