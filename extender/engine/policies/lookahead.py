"""lafgd (ours, experimental): bfgd with a look-ahead over the learned shape distribution.

FGD (policies/fgd.py) judges a GPU with `h` milli free by the next task only: the free milli counts as
fragmented for the shapes that cannot use it, and as not fragmented at all for those that can, whatever they
would leave behind. A GPU with 530 free is "usable" by a 470 and a 320 alike, although the 470 leaves 60 and
the 320 leaves 210, which only the rare shapes of at most 210 can ever fill.

lafgd follows the learned workload one step further, recursively. Per GPU, with p_m the learned probability of
shape m and s_m its per-GPU ask,

    V(h) = sum_m p_m * (h            if m cannot use a GPU with h free
                        V(h - s_m)   otherwise)

the fragmentation expected once the GPU has been filled by a random sequence of tasks from the workload. FGD's
per-GPU term is the first line alone (the second taken as 0); lafgd adds the rest,

    L(node) = bfgd(node) + lookahead_weight * sum_g D(free_g),    D(h) = sum_{m fits h} p_m * V(h - s_m),

and scores like bfgd. Everything is derived from bfgd's learned shapes (fragmentation.ShapeLearner): no
constant is fitted to a trace, no task ahead is known. V is a table over h = 0..1000 per GPU class (model,
memory size), rebuilt when the learned model changes (bfgd's epoch).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kube_vgpu.extender.engine.fragmentation import WeightedShapes
from kube_vgpu.extender.engine.policies.bfgd import BalancedFGD
from kube_vgpu.extender.engine.policies.fgd import quantised_gain, sigmoid
from kube_vgpu.extender.engine.shares import MILLI_PER_GPU

if TYPE_CHECKING:
    from kube_vgpu.extender.engine.model import NodeState

DEFAULT_LOOKAHEAD_WEIGHT = 1.0


def lookahead_table(shapes: WeightedShapes, model: str, gpu_memory_mib: int) -> tuple[float, ...]:
    """D(h) for h = 0..1000 (see the module docstring) on GPUs of this class."""
    by_share: dict[int, float] = {}
    for shape, p in shapes:
        if not shape.gpu_count or not shape.accessible(model):
            continue
        share = shape.share_on(gpu_memory_mib)
        if share is None or share <= 0:
            continue
        share = min(share, MILLI_PER_GPU)
        by_share[share] = by_share.get(share, 0.0) + p
    asks = sorted(by_share.items())
    value = [0.0] * (MILLI_PER_GPU + 1)  # V
    deeper = [0.0] * (MILLI_PER_GPU + 1)  # D
    for h in range(1, MILLI_PER_GPU + 1):
        fits = 0.0
        rest = 0.0
        for share, p in asks:
            if share > h:
                break
            fits += p
            rest += p * value[h - share]
        deeper[h] = rest
        value[h] = (1.0 - fits) * h + rest
    return tuple(deeper)


class LookaheadFGD(BalancedFGD):
    name = "lafgd"

    def __init__(
        self,
        lookahead_weight: float = DEFAULT_LOOKAHEAD_WEIGHT,
        quantised: float = 1.0,
        balance_weight: float = 1.0,
        coverage: float = 0.95,
        resolution: float = 1.0,
        cpu_aware: float = 0.0,
        table_coverage: float = 0.0,
    ) -> None:
        super().__init__(balance_weight=balance_weight, coverage=coverage)
        self.lookahead_weight = lookahead_weight
        self.quantised = bool(quantised)
        self.resolution = resolution
        self.cpu_aware = bool(cpu_aware)
        self._tables: dict[tuple[str, int, int], tuple[float, ...]] = {}
        self._tables_shapes: WeightedShapes = ()
        self._cpu_levels: list[int] = []
        #: shapes the look-ahead follows: FGD's typical ones, or (table_coverage > 0) those covering that share
        self.table_coverage = table_coverage
        self.table_shapes: WeightedShapes = ()

    def refresh(self) -> None:
        epoch = self._epoch
        super().refresh()
        shapes = self._learner.shapes(self.table_coverage) if self.table_coverage else self.frag_model.shapes
        if shapes != self.table_shapes:
            self.table_shapes = shapes
            if self._epoch == epoch:
                self._epoch += 1

    def table(self, node: NodeState, cpu_free: int, cpu_known: bool) -> tuple[float, ...]:
        shapes = self.table_shapes
        if shapes is not self._tables_shapes:
            self._tables = {}
            self._tables_shapes = shapes
            self._cpu_levels = sorted({shape.cpu_milli for shape, _ in shapes})
        level = len(self._cpu_levels)
        if self.cpu_aware and cpu_known:
            level = bisect.bisect_right(self._cpu_levels, cpu_free)
        key = (node.gpu_model, node.gpu_memory_mib, level)
        table = self._tables.get(key)
        if table is None:
            limit = self._cpu_levels[level - 1] if level else -1
            feedable = tuple((shape, p) for shape, p in shapes if shape.cpu_milli <= limit)
            table = self._tables[key] = lookahead_table(feedable, node.gpu_model, node.gpu_memory_mib)
        return table

    def measure(self, node: NodeState, cpu_free: int, cpu_known: bool, free: Sequence[int]) -> float:
        base = super().measure(node, cpu_free, cpu_known, free)
        if not self.lookahead_weight:
            return base
        table = self.table(node, cpu_free, cpu_known)
        return base + self.lookahead_weight * sum(table[min(max(f, 0), MILLI_PER_GPU)] for f in free)

    def gain(self, frag_before: float, frag_after: float) -> float:
        if self.quantised:
            if self.resolution != 1.0:
                return int(sigmoid((frag_before - frag_after) / 1000) * 100 * self.resolution) / self.resolution
            return quantised_gain(frag_before, frag_after)
        return 100.0 * sigmoid((frag_before - frag_after) / 1000)
