"""lafgd (ours): bfgd plus a look-ahead at what a GPU's free share can still become under the learned workload.

FGD (policies/fgd.py) judges a GPU with `h` milli free by the next task only: the free milli counts as
fragmented for the shapes that cannot use it and as not fragmented at all for those that can, whatever they
leave behind. So a 230 share goes next to a 650 (350 free, which most shapes cannot use) rather than on a GPU
holding a 230 (770 free): FGD sees the fragmentation drop, but the 650's GPU ends with 120 free, which no
common shape fills, where a 320 would have left 30. At arrived = 130 % such pairs hold about 0.7 % of the
capacity of the openb default trace under bfgd, formed before the cluster is full (docs/simulator.md).

lafgd adds, per GPU, a term that looks beyond the next task, computed from the shapes bfgd has learned (the
same typical shapes, fragmentation.ShapeLearner; nothing of the future is known):

    L(node) = bfgd(node) + lookahead_weight * sum over GPUs g of T(free_g)

and scores like bfgd (the reference's integer 0..100 score of the change). T is one of (`mode`):

* `residue` (the default): R(h), what stays free after the best completion of the GPU by the learned per-GPU
  asks, any number of each: h minus the largest sum of asks that is at most h (R(350) = 30 with 320s in the
  workload, R(120) = 120 with no ask below 120). It prices a placement by the waste that no later task can
  remove, which FGD's next-task term does not see.
* `deep`: D(h) = sum over shapes m that fit of p_m V(h - s_m), V(h) = sum_m p_m (h if m does not fit else
  V(h - s_m)): FGD's measure followed recursively (a random sequence of tasks fills the GPU).
* `conditioned`: V'(h) - (1 - fits(h)) h, V'(h) = the mean of V'(h - s) over the shapes that fit (h if none):
  the GPU is filled by the shapes that fit it, in proportion.

Only `residue` beat bfgd on the development traces (docs/simulator.md, "lafgd"); the others stay for the
measurements. The weight 1 adds the term at the scale of FGD's own (milli-GPU); it was not tuned. Tables are
over h = 0..1000 per GPU class (model, memory size), rebuilt when the learned model changes (bfgd's epoch), so a
node's measure costs one table lookup per GPU more than bfgd's. Live nodes (real units, links) are handled by
bfgd's machinery unchanged: lafgd only adds to the measure, and places a new request shape on many nodes at once
as bfgd does (policies.batch, with this term as its HoleTerm).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from kube_vgpu.extender.engine.fragmentation import WeightedShapes
from kube_vgpu.extender.engine.policies.batch import Bools, GroupColumns, HoleTables, Ints, place_batch
from kube_vgpu.extender.engine.policies.bfgd import BalancedFGD
from kube_vgpu.extender.engine.policies.fgd import quantised_gain, sigmoid
from kube_vgpu.extender.engine.shares import MILLI_PER_GPU

if TYPE_CHECKING:
    from kube_vgpu.extender.engine.model import NodeState, Placement, PlacementRequest

DEFAULT_LOOKAHEAD_WEIGHT = 1.0


def ask_probabilities(shapes: WeightedShapes, model: str, gpu_memory_mib: int) -> dict[int, float]:
    """Learned probability of each per-GPU ask (milli, at most 1000) on GPUs of this class."""
    probabilities: dict[int, float] = {}
    for shape, p in shapes:
        if not shape.gpu_count or not shape.accessible(model):
            continue
        share = shape.share_on(gpu_memory_mib)
        if share is None or share <= 0:
            continue
        share = min(share, MILLI_PER_GPU)
        probabilities[share] = probabilities.get(share, 0.0) + p
    return probabilities


def residue_table(shapes: WeightedShapes, model: str, gpu_memory_mib: int) -> tuple[float, ...]:
    """R(h): what stays free of a GPU with h free after the best completion by the shapes' per-GPU asks (any
    number of each): h minus the largest sum of asks that is at most h."""
    asks = set(ask_probabilities(shapes, model, gpu_memory_mib))
    reachable = [False] * (MILLI_PER_GPU + 1)
    reachable[0] = True
    for h in range(1, MILLI_PER_GPU + 1):
        reachable[h] = any(ask <= h and reachable[h - ask] for ask in asks)
    residue = [0.0] * (MILLI_PER_GPU + 1)
    best = 0
    for h in range(MILLI_PER_GPU + 1):
        if reachable[h]:
            best = h
        residue[h] = float(h - best)
    return tuple(residue)


def lookahead_table(
    shapes: WeightedShapes, model: str, gpu_memory_mib: int, conditioned: bool = False
) -> tuple[float, ...]:
    """D(h) for h = 0..1000 (see the module docstring) on GPUs of this class. conditioned: the hole is filled by
    a random shape among those that fit it (V'(h) = E[V'(h - s) | s <= h]), returned as V'(h) minus FGD's
    per-GPU term (1 - fits(h)) h, so that adding it to FGD's measure replaces that term by V'."""
    asks = sorted(ask_probabilities(shapes, model, gpu_memory_mib).items())
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
        if conditioned:
            value[h] = rest / fits if fits > 0 else float(h)
            deeper[h] = value[h] - (1.0 - fits) * h
        else:
            deeper[h] = rest
            value[h] = (1.0 - fits) * h + rest
    return tuple(deeper)


#: how a GPU with h milli free is judged beyond FGD's next-task term (see the module docstring)
MODES = ("residue", "deep", "conditioned")
DEFAULT_MODE = "residue"


class LookaheadFGD(BalancedFGD):
    name = "lafgd"

    def __init__(
        self,
        lookahead_weight: float = DEFAULT_LOOKAHEAD_WEIGHT,
        mode: str = DEFAULT_MODE,
        quantised: bool = True,
        balance_weight: float = 1.0,
        coverage: float = 0.95,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"unknown look-ahead mode {mode!r}; known: {', '.join(MODES)}")
        super().__init__(balance_weight=balance_weight, coverage=coverage)
        self.lookahead_weight = lookahead_weight
        self.mode = mode
        self.quantised = quantised
        self._tables: dict[tuple[str, int], tuple[float, ...]] = {}
        self._tables_shapes: WeightedShapes = ()

    def table(self, node: NodeState) -> tuple[float, ...]:
        """The per-GPU look-ahead term by free milli, for this node's GPU class under the current model."""
        return self.class_table(node.gpu_model, node.gpu_memory_mib)

    def class_table(self, model: str, gpu_memory_mib: int) -> tuple[float, ...]:
        """The per-GPU look-ahead term by free milli on GPUs of this model and memory size."""
        shapes = self.frag_model.shapes
        if shapes is not self._tables_shapes:  # a new learned model (the epoch changed with it)
            self._tables = {}
            self._tables_shapes = shapes
        key = (model, gpu_memory_mib)
        table = self._tables.get(key)
        if table is None:
            table = self._tables[key] = self.build_table(shapes, *key)
        return table

    def build_table(self, shapes: WeightedShapes, model: str, gpu_memory_mib: int) -> tuple[float, ...]:
        """The term's table for one GPU class under these shapes (a subclass may price holes otherwise)."""
        if self.mode == "residue":
            return residue_table(shapes, model, gpu_memory_mib)
        return lookahead_table(shapes, model, gpu_memory_mib, conditioned=self.mode == "conditioned")

    def measure(self, node: NodeState, cpu_free: int, cpu_known: bool, free: Sequence[int]) -> float:
        base = super().measure(node, cpu_free, cpu_known, free)
        if not self.lookahead_weight:
            return base
        table = self.table(node)
        extra = 0.0
        for f in free:  # free shares are 0..1000 (engine.shares); clamp anything else
            extra += table[f] if 0 <= f <= MILLI_PER_GPU else table[0 if f < 0 else MILLI_PER_GPU]
        return base + self.lookahead_weight * extra

    def place_batch(self, nodes: Sequence[NodeState], request: PlacementRequest,
                    gathered: GroupColumns | None = None) -> list[Placement | None] | None:
        if not self.quantised:
            return None  # policies.batch scores by the quantised gain only: fit.place on every node
        return place_batch(nodes, request, self, self if self.lookahead_weight else None, gathered)

    def hole_tables(
        self, nodes: Sequence[NodeState], model: str, memory_mib: int, cpu_known: Bools, cpu_free: Ints,
        cpu_after: Ints, memory_taken_mib: int,
    ) -> tuple[HoleTables, HoleTables]:
        """batch.HoleTerm: one table for the whole GPU class (it depends on nothing else of the node)."""
        tables = (np.asarray(self.class_table(model, memory_mib), dtype=np.float64)[None, :],
                  np.zeros(len(nodes), dtype=np.int64))
        return tables, tables

    def prepare_classes(self, classes: Sequence[tuple[str, int]]) -> None:
        """batch.HoleTerm: nothing to share between classes (one table each, built when first asked)."""

    def gain(self, frag_before: float, frag_after: float) -> float:
        if self.quantised:
            return quantised_gain(frag_before, frag_after)  # the reference's integer score, as bfgd
        return 100.0 * sigmoid((frag_before - frag_after) / 1000)
