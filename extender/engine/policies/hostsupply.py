"""hsafgd (ours): safgd whose hole prices know what the node's free host CPU and memory can still feed.

safgd (policies/supply.py) prices a GPU with h milli free by E(h), the residue it is expected to keep when each
filler ask s comes with its availability a_s. E is the same on every node: a 530 hole next to a 470 counts as
closable by the next 470 wherever it is. But a filler is a pod, and it lands only where the node also has the CPU
and memory it asks. At arrived = 130 % on the openb default trace (seed 42) safgd leaves about 20 GPUs with 200 to
650 milli free while 470s, 320s and 230s are still being dropped: their nodes have the GPU share but no memory
(G2 nodes: 48 GiB per GPU against 29-46 GiB per 470 task) or too little CPU for any of the asks that would fill
them (docs/simulator.md). FGD's next-task term sees CPU (a shape whose CPU does not fit counts the node's whole idle
GPU as fragmented) but not memory, and bfgd's balance term sees the node's CPU in aggregate, at the average
CPU-per-GPU ratio; neither sees that the 530 hole's own fillers no longer fit.

hsafgd keeps safgd's availability a_s (from the learned workload, as there) and scales it per node:

    a_s(node) = a_s * (share of the learned tasks asking s per GPU whose CPU and memory fit the node's free
                       CPU and memory)

so E on a node is the residue its holes can still be closed to by tasks that fit it. A placement that uses the
last CPU or memory of a node with a hole prices that hole as permanent; one that leaves a hole on a node that
can still feed its fillers does not. Tasks are counted whole (a 4-GPU filler of a fresh GPU needs its whole CPU
and memory on the node). The memory each shape asks is learned online from the pods seen (the learned shapes, as
FGD's, ignore memory), snapshotted when the learned model is refreshed, like bfgd's CPU-per-GPU ratio.

Nothing is fitted: safgd's weight (10) and availability model are kept as they are. Measured on the development
traces (default, gpushare40, gpuspec20, seeds 42-51; FGD's unallocated residual closed at arrived = 130 %, mean
of the three): safgd +19.0 %, the CPU filter alone +19.9 % (a multi-GPU task's CPU counted per GPU there), CPU and
memory (hsafgd) +20.3 %, above safgd on 29 of the 30 seeds. A memory analogue of bfgd's CPU balance term on top
changed nothing (+20.3 %) and was left out.

The extender keeps each node's allocatable memory and its pods' memory requests (ClusterState, as host CPU) and
hands the pod's memory request to this policy (uses_host_memory), so it sees there what the simulator gives it.
Where a node reports no allocatable memory the memory filter is off for it and hsafgd is safgd with the CPU filter;
where CPU is unknown too, it is safgd.
Cost: one table lookup per GPU as safgd, plus two bisections for the node's CPU and memory level; the tables
(h = 0..1000) are per GPU class and per distinct set of scaled availabilities, built lazily when a node in that
state is first measured and dropped when the learned model changes (a batch placement builds the availabilities
of the GPU classes it meets in one pass, supply_residues, and the levels it meets in another, residues_under: the
first placement after a change 38-65 ms on the openb default cluster half full, of which ~16 ms is the placement
itself; 52-78 ms with the classes one by one, 146-170 ms with the levels too). A new request shape is placed on many
nodes at once (policies.batch, hole_tables: each node's table by its levels, as measure() finds it).
"""

from __future__ import annotations

from bisect import bisect_right
from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar

import numpy as np

from kube_vgpu.extender.engine.fragmentation import TaskShape, WeightedShapes, task_shape
from kube_vgpu.extender.engine.policies._milli import frag_cpu_free_milli
from kube_vgpu.extender.engine.policies.batch import Bools, Floats, HoleTables, Ints
from kube_vgpu.extender.engine.policies.bfgd import BalancedFGD
from kube_vgpu.extender.engine.policies.lookahead import ask_probabilities
from kube_vgpu.extender.engine.policies.supply import (
    SUPPLY_LOOKAHEAD_WEIGHT,
    SupplyLookaheadFGD,
    _residue_under,
    residues_under,
    supply_residue,
    supply_residues,
)
from kube_vgpu.extender.engine.shares import MILLI_PER_GPU

if TYPE_CHECKING:
    from kube_vgpu.extender.engine.model import GpuState, NodeState, Placement, PlacementRequest
    from kube_vgpu.extender.engine.policies.base import Scratch
    from kube_vgpu.protocol import ContainerGpuRequest


class _ClassTables:
    """One GPU class's tables under one learned model: the asks, safgd's availability, each ask's tasks as
    (CPU, memory, probability), the CPU and memory levels at which a task starts to fit, and the tables built."""

    __slots__ = ("arrays", "asks", "available", "by_level", "cpu_levels", "memory_levels", "probabilities", "tables",
                 "tasks")

    def __init__(
        self,
        probabilities: dict[int, float],
        available: dict[int, float],
        tasks: dict[int, list[tuple[int, int, float]]],
    ) -> None:
        self.probabilities = probabilities
        self.asks = sorted(probabilities)
        self.available = available
        self.tasks = tasks
        self.cpu_levels = sorted({cpu for rows in tasks.values() for cpu, _, _ in rows})
        self.memory_levels = sorted({memory for rows in tasks.values() for _, memory, _ in rows})
        self.tables: dict[tuple[float, ...], tuple[float, ...]] = {}
        #: (CPU level, memory level) -> table
        self.by_level: dict[tuple[int, int], tuple[float, ...]] = {}
        #: (CPU level, memory level) -> table as an array (batch placement)
        self.arrays: dict[tuple[int, int], Floats] = {}

    def table(self, cpu_free: int | None, memory_free: int | None) -> tuple[float, ...]:
        """E(h) for a node with this free CPU and memory (None: unknown, every task fits)."""
        cpu_level = len(self.cpu_levels) if cpu_free is None else bisect_right(self.cpu_levels, cpu_free)
        memory_level = (
            len(self.memory_levels) if memory_free is None else bisect_right(self.memory_levels, memory_free)
        )
        return self.table_at(cpu_level, memory_level)

    def signature_at(self, cpu_level: int, memory_level: int) -> tuple[float, ...]:
        """Each ask's availability (in the order of asks) where the tasks that fit are those whose CPU and memory
        are among the first levels of each."""
        cpu_cap = self.cpu_levels[cpu_level - 1] if cpu_level else -1
        memory_cap = self.memory_levels[memory_level - 1] if memory_level else -1
        return tuple(
            self.available[ask] * min(1.0, sum(p for cpu, memory, p in self.tasks[ask]
                                               if cpu <= cpu_cap and memory <= memory_cap) / self.probabilities[ask])
            for ask in self.asks
        )

    def table_at(self, cpu_level: int, memory_level: int) -> tuple[float, ...]:
        """E(h) at these levels (signature_at)."""
        key = (cpu_level, memory_level)
        table = self.by_level.get(key)
        if table is not None:
            return table
        signature = self.signature_at(cpu_level, memory_level)
        table = self.tables.get(signature)
        if table is None:
            table = self.tables[signature] = tuple(_residue_under(self.asks, dict(zip(self.asks, signature,
                                                                                      strict=True)))[0])
        self.by_level[key] = table
        return table

    def build_levels(self, levels: Sequence[tuple[int, int]]) -> None:
        """Build the tables of these levels not built yet in one pass (residues_under): after the learned model
        changes, a batch placement meets most of its nodes' levels at once."""
        waiting: dict[tuple[float, ...], list[tuple[int, int]]] = {}
        for key in levels:
            if key in self.by_level:
                continue
            signature = self.signature_at(*key)
            table = self.tables.get(signature)
            if table is not None:
                self.by_level[key] = table
            else:
                waiting.setdefault(signature, []).append(key)
        if len(waiting) < 2:
            return  # table_at builds one as cheaply
        for (signature, keys), row in zip(waiting.items(), residues_under(self.asks, list(waiting)), strict=True):
            table = self.tables[signature] = tuple(row.tolist())
            for key in keys:
                self.by_level[key] = table
                self.arrays[key] = row  # the batch reads the array: not converted back from the tuple

    def array_at(self, cpu_level: int, memory_level: int) -> Floats:
        array = self.arrays.get((cpu_level, memory_level))
        if array is None:
            array = self.arrays[(cpu_level, memory_level)] = np.asarray(
                self.table_at(cpu_level, memory_level), dtype=np.float64)
        return array


class HostSupplyFGD(SupplyLookaheadFGD):
    name = "hsafgd"
    #: the extender keeps each node's host memory and hands the pod's memory request (ClusterState), as the
    #: simulator does
    uses_host_memory: ClassVar[bool] = True

    def __init__(
        self,
        lookahead_weight: float = SUPPLY_LOOKAHEAD_WEIGHT,
        quantised: bool = True,
        balance_weight: float = 1.0,
        coverage: float = 0.95,
    ) -> None:
        super().__init__(
            lookahead_weight=lookahead_weight, quantised=quantised, balance_weight=balance_weight, coverage=coverage
        )
        self._memory_seen: dict[TaskShape, Counter[int]] = {}  # shape -> host memory asked (MiB) -> pods
        #: shape -> (host memory asked, share of its pods), as of the last refresh
        self._memory_at_refresh: dict[TaskShape, tuple[tuple[int, float], ...]] = {}
        self._class_tables: dict[tuple[str, int], _ClassTables] = {}
        self._class_shapes: WeightedShapes = ()
        #: host memory of the pod whose placement is being measured (None: measuring the node as it is)
        self._memory_after: int | None = None

    def observe(self, request: PlacementRequest) -> None:
        shape = task_shape(request)
        seen = self._memory_seen.get(shape)
        if seen is None:
            seen = self._memory_seen[shape] = Counter()
        seen[request.memory_mib] += 1
        super().observe(request)

    def refresh(self) -> None:
        epoch = self._epoch
        super().refresh()
        # each shape's memory asks as shares of its pods: unchanged while the pods keep asking alike
        memory = {}
        for shape, seen in self._memory_seen.items():
            pods = sum(seen.values())
            memory[shape] = tuple((mib, count / pods) for mib, count in sorted(seen.items()))
        if memory != self._memory_at_refresh:
            self._memory_at_refresh = memory
            self._class_tables = {}
            if self._epoch == epoch:
                self._epoch += 1  # cached results depend on what the tasks ask of the host: a new model

    def _current_tables(self) -> tuple[WeightedShapes, dict[tuple[str, int], _ClassTables]]:
        """The learned shapes and the class tables built under them (dropped when the shapes changed)."""
        shapes = self.frag_model.shapes
        if shapes is not self._class_shapes:
            self._class_tables = {}
            self._class_shapes = shapes
        return shapes, self._class_tables

    def class_tables(self, model: str, gpu_memory_mib: int) -> _ClassTables:
        shapes, built = self._current_tables()
        key = (model, gpu_memory_mib)
        tables = built.get(key)
        if tables is None:
            probabilities = ask_probabilities(shapes, model, gpu_memory_mib)
            tables = built[key] = self.build_class_tables(shapes, model, gpu_memory_mib, probabilities,
                                                          supply_residue(probabilities)[1])
        return tables

    def prepare_classes(self, classes: Sequence[tuple[str, int]]) -> None:
        """batch.HoleTerm: the availabilities of the classes not built yet under this learned model, in one pass
        (supply_residues: after a model change, one batch placement meets all of them)."""
        shapes, built = self._current_tables()
        missing = [key for key in dict.fromkeys(classes) if key not in built]
        if len(missing) < 2:
            return  # class_tables builds one as cheaply
        probabilities = [ask_probabilities(shapes, *key) for key in missing]
        for key, row, (_, available) in zip(missing, probabilities, supply_residues(probabilities), strict=True):
            built[key] = self.build_class_tables(shapes, *key, row, available)

    def build_class_tables(self, shapes: WeightedShapes, model: str, gpu_memory_mib: int,
                           probabilities: dict[int, float], available: dict[int, float]) -> _ClassTables:
        tasks: dict[int, list[tuple[int, int, float]]] = {}
        for shape, p in shapes:
            if not shape.gpu_count or not shape.accessible(model):
                continue
            share = shape.share_on(gpu_memory_mib)
            if share is None or share <= 0:
                continue
            rows = tasks.setdefault(min(share, MILLI_PER_GPU), [])
            memory = self._memory_at_refresh.get(shape) or ((0, 1.0),)
            rows.extend((shape.cpu_milli, mib, p * fraction) for mib, fraction in memory)
        return _ClassTables(probabilities, available, tasks)

    def memory_free(self, node: NodeState) -> int | None:
        """The node's free host memory (MiB) for the measure, the measured pod's taken; None when unknown."""
        if node.memory_mib_total <= 0:
            return None
        return node.memory_mib_total - node.memory_mib_used - (self._memory_after or 0)

    def measure(self, node: NodeState, cpu_free: int, cpu_known: bool, free: Sequence[int]) -> float:
        value = BalancedFGD.measure(self, node, cpu_free, cpu_known, free)  # FGD's term and bfgd's CPU balance
        if not self.lookahead_weight:
            return value
        table = self.class_tables(node.gpu_model, node.gpu_memory_mib).table(
            cpu_free if cpu_known else None, self.memory_free(node))
        extra = 0.0
        for f in free:  # free shares are 0..1000 (engine.shares); clamp anything else
            extra += table[f] if 0 <= f <= MILLI_PER_GPU else table[0 if f < 0 else MILLI_PER_GPU]
        return value + self.lookahead_weight * extra

    def hole_tables(
        self, nodes: Sequence[NodeState], model: str, memory_mib: int, cpu_known: Bools, cpu_free: Ints,
        cpu_after: Ints, memory_taken_mib: int,
    ) -> tuple[HoleTables, HoleTables]:
        """batch.HoleTerm: each node's table by its CPU and memory level, as measure() looks it up, before and after
        the pod (one stack of the tables both need)."""
        tables = self.class_tables(model, memory_mib)
        cpu_levels = np.asarray(tables.cpu_levels, dtype=np.int64)
        memory_levels = np.asarray(tables.memory_levels, dtype=np.int64)
        count = len(nodes)
        memory_total = np.fromiter((node.memory_mib_total for node in nodes), dtype=np.int64, count=count)
        memory_free = memory_total - np.fromiter((node.memory_mib_used for node in nodes), dtype=np.int64, count=count)
        per_cpu_level = len(memory_levels) + 1

        def level_keys(cpu: Ints, memory_taken: int) -> Ints:
            # bisect_right's levels; every task fits where the CPU or the memory is unknown (memory_free's None)
            cpu_level = np.where(cpu_known, np.searchsorted(cpu_levels, cpu, side="right"), len(cpu_levels))
            memory_level = np.where(memory_total > 0,
                                    np.searchsorted(memory_levels, memory_free - memory_taken, side="right"),
                                    len(memory_levels))
            return cpu_level * per_cpu_level + memory_level

        keys, rows = np.unique(np.concatenate((level_keys(cpu_free, 0), level_keys(cpu_after, memory_taken_mib))),
                               return_inverse=True)
        levels = [divmod(key, per_cpu_level) for key in keys.tolist()]
        tables.build_levels(levels)
        stack = np.stack([tables.array_at(*level) for level in levels])
        rows = rows.reshape(-1)
        return (stack, rows[:count]), (stack, rows[count:])

    # The measure of a placement must see the pod's host memory taken, as it sees its CPU (FragPolicyBase passes
    # the CPU after the placement; memory is read from the node): the node's own measure is taken first (and
    # memoised), then the pod's memory is set for the measures of the placement.

    def score(self, node: NodeState, request: PlacementRequest, placement: Placement) -> float:
        cpu_free, cpu_known = frag_cpu_free_milli(node)
        self.node_measure(node, cpu_free, cpu_known)
        self._memory_after = request.memory_mib
        try:
            return super().score(node, request, placement)
        finally:
            self._memory_after = None

    def choose_gpus(
        self,
        node: NodeState,
        request: PlacementRequest,
        container: ContainerGpuRequest,
        candidates: Sequence[GpuState],
        scratch: Scratch,
    ) -> Sequence[GpuState]:
        if any(scratch.vgpus):  # a later container of the pod: "before" is measured here too, memory as is
            return super().choose_gpus(node, request, container, candidates, scratch)
        cpu_free, cpu_known = frag_cpu_free_milli(node)
        self.node_measure(node, cpu_free, cpu_known)
        self._memory_after = request.memory_mib
        try:
            return super().choose_gpus(node, request, container, candidates, scratch)
        finally:
            self._memory_after = None
