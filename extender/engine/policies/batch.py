"""Batch placement: one request shape placed on many nodes at once, over arrays (numpy), for bfgd and the look-ahead
policies built on it (lafgd, safgd, hsafgd: bfgd's measure plus a per-GPU term, HoleTerm).

Why: the first pod of a request shape is placed on every node (the scheduler shares one placement per
node-equivalence class, so on a cluster whose nodes all differ that is one fit.place per node: 70-160 us each in
Python, 0.3-0.8 s at 5000 nodes). Here the same arithmetic runs over arrays of all the nodes' GPUs at once.

Exactly fit.place's results (GPU positions in the same order, the same score): the same integer arithmetic, and
the same float operations in the same order (an elementwise IEEE operation gives the same bits in numpy as in
Python), except the sigmoid's exp, whose last bit numpy may round otherwise; a score within 1e-9 of an integer
step is recomputed with math.exp. One sum is taken in another order for speed, a 1-GPU container's measure of
each GPU choice (of_each_change_rounded), with a bound on its rounding: a node whose gain that rounding could
move across an integer step is measured again in the model's order (gains_of_each_change).

Whatever the array rules do not cover is left to fit.place (None in the result): requests with init or several
containers, MIG, selectors or NUMA binding; nodes with MIG devices, GPUs held by pods outside kube-vgpu or GPUs of
mixed hardware; nodes where the pod does not fit (their reasons are fit.explain_failure's).
tests/engine/test_batch.py compares every result with fit.place on random nodes.

Pure: no I/O; GPU positions index each node's `gpus` (a group's nodes all have the same number of GPUs).
"""

from __future__ import annotations

import math
import os
from array import array
from collections.abc import Sequence
from itertools import repeat
from operator import attrgetter, itemgetter
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

# numpy's BLAS is never used here: one thread instead of one per core (each with its buffers) in the extender; set
# before numpy is imported, which reads it once
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np
import numpy.typing as npt

from kube_vgpu.extender.engine.model import NEW_TUPLE, ContainerPlacement, GpuUsage, Placement
from kube_vgpu.extender.engine.policies.base import Scratch
from kube_vgpu.extender.engine.policies.topology import (
    BEST_LINK_SCORE,
    best_connected_positions,
    least_damaging_gpu,
    set_quality,
)
from kube_vgpu.extender.engine.shares import MILLI_PER_GPU

if TYPE_CHECKING:
    from kube_vgpu.extender.engine.model import NodeState, PlacementRequest
    from kube_vgpu.extender.engine.policies.bfgd import BalancedFGD
    from kube_vgpu.protocol import ContainerGpuRequest

Ints = npt.NDArray[np.signedinteger[Any]]  # int64, or the columns' COLUMN_DTYPE
Floats = npt.NDArray[np.floating[Any]]
Bools = npt.NDArray[np.bool_]

#: scores this close to an integer step of the sigmoid are recomputed with math.exp (numpy's exp may differ from
#: it in the last bit; the quantised score is 100 * sigmoid truncated, so only values at a step can differ)
_STEP_GUARD = 1e-9


#: look-ahead tables [k, 1001] and each node's row among them
HoleTables = tuple[Floats, Ints]


class HoleTerm(Protocol):
    """The look-ahead policies' addition to bfgd's measure: lookahead_weight * the sum over a node's GPUs (in
    position order) of a table indexed by the GPU's free milli (0..1000, clamped), the table chosen per node."""

    lookahead_weight: float

    def hole_tables(
        self, nodes: Sequence[NodeState], model: str, memory_mib: int, cpu_known: Bools, cpu_free: Ints,
        cpu_after: Ints, memory_taken_mib: int,
    ) -> tuple[HoleTables, HoleTables]:
        """The tables for these nodes of one GPU class as they are (free CPU cpu_free) and once the pod being
        measured is placed (free CPU cpu_after, memory_taken_mib of host memory taken)."""
        ...

    def prepare_classes(self, classes: Sequence[tuple[str, int]]) -> None:
        """The GPU classes (model, GPU memory MiB) whose tables hole_tables is about to be asked for, once per
        placement before them: a term whose per-class work is cheaper together does it here."""
        ...


#: per GPU in a node's row (node_row): used memory MiB, used cores, used vGPUs, vGPU slots, usable (healthy, not
#: in MIG mode, not held by a pod outside kube-vgpu: 1, else 0)
GPU_COLUMNS = 5
#: the columns' integers: 32 bits hold every value (MiB, cores, counts), and half the bytes of 64 make the arrays'
#: passes faster; sums are taken in 64 bits (numpy's default for smaller integers); a batch whose products could
#: overflow them computes in 64 bits (_place_group)
COLUMN_DTYPE = np.int32
_COLUMN_TYPECODE = "i"
assert array(_COLUMN_TYPECODE).itemsize == np.dtype(COLUMN_DTYPE).itemsize


class GroupColumns(NamedTuple):
    """What the batch reads of nodes all of one group, gathered by the caller (extender.node_columns keeps them
    from one pod to the next): the group (GPUs, model, memory MiB, cores), each node's GPU columns [node, GPU,
    GPU_COLUMNS], host CPU (allocatable and requested, milli), link matrix (node_links) and name (each node's own
    string: the placements are named from it without reading 5000 nodes scattered over the heap, ~1.7 ms)."""

    group: tuple[int, str, int, int]
    columns: Ints
    cpu_total: Ints
    cpu_used: Ints
    links: Ints
    names: Sequence[str]


def batch_container(request: PlacementRequest) -> ContainerGpuRequest | None:
    """The request's one container when the array rules cover the request, else None."""
    containers = request.gpu.containers
    if len(containers) != 1 or request.gpu_spec or not request.gpu.selectors.empty:
        return None
    container = containers[0]
    if container.init or container.mig or container.count < 1:
        return None
    return container


def node_group(node: NodeState) -> tuple[int, str, int, int] | None:
    """(GPUs, model, memory MiB, cores) of a node whose GPUs are all alike and nothing else (MIG, outside pods),
    or None: the node is left to fit.place."""
    row = node_row(node)
    return None if row is None else row[0]


def node_row(node: NodeState) -> tuple[tuple[int, str, int, int], bytes] | None:
    """The node's group and its GPUs' columns (GPU_COLUMNS of COLUMN_DTYPE each), once per version of the node: a new
    request shape then reads 5000 nodes' GPUs as one join of bytes instead of 40,000 objects' attributes."""
    cache = node.version_cache
    row: tuple[tuple[int, str, int, int], bytes] | None = cache.get(node_row, _NO_ROW)
    if row is _NO_ROW:
        row = None
        gpus = node.gpus
        if gpus and not node.mig_devices and not node.dynamic_mig_devices and not node.inventory_external:
            first = gpus[0]
            model, memory_mib, cores = first.model, first.memory_mib, first.cores
            values: list[int] = []
            for gpu in gpus:
                if gpu.model != model or gpu.memory_mib != memory_mib or gpu.cores != cores:
                    break
                values += (gpu.used_memory_mib, gpu.used_cores, gpu.used_vgpus, gpu.max_vgpus,
                           1 if gpu.healthy and not gpu.mig_mode and not gpu.exclusive_holders else 0)
            else:
                row = ((len(gpus), model, memory_mib, cores), array(_COLUMN_TYPECODE, values).tobytes())
        cache[node_row] = row
    return row


_NO_ROW: Any = object()


def _free_share(used_memory: Ints, used_cores: Ints, vgpus: Ints, max_vgpus: Ints, usable: Bools,
                memory_mib: int, cores: int) -> Ints:
    """engine.shares.free_share_milli over arrays (extras already added to the used amounts)."""
    share = cores - used_cores
    if cores != MILLI_PER_GPU:
        share = share * MILLI_PER_GPU // (cores or 1)
    free_memory = memory_mib - used_memory
    memory = free_memory * MILLI_PER_GPU // (memory_mib or 1)
    # untouched memory is 1000 and never the minimum (free_share_milli skips it); the choices are made by
    # multiplying with the flags (_choose), not np.where
    share = _choose((free_memory < memory_mib) & (memory < share), memory, share)
    return share * (usable & (vgpus < max_vgpus) & (share > 0))


def _choose(flags: Bools, chosen: Ints, otherwise: Ints) -> Ints:
    """np.where(flags, chosen, otherwise) for integers, as otherwise + flags * (chosen - otherwise): the same values,
    and ~10x faster where the flags are mixed (np.where's branch per element is mispredicted half the time: ~180 us
    against ~35 us over 5000 nodes x 8 GPUs)."""
    difference = chosen - otherwise
    difference *= flags
    difference += otherwise
    return difference


def _row_sums(values: Ints | Bools) -> Ints:
    """values.sum(axis=-1) of a [node, GPU] array of flags or of per-GPU amounts (a row's sum fits their integers:
    the columns fall back to 64 bits where a GPU's amounts x 1000 would not fit 32): einsum's loop over a row of a
    few GPUs is ~2.5x faster than sum's."""
    if values.dtype == np.bool_:  # 0 or 1 per GPU, counted in bytes (a node has far fewer than 128 GPUs)
        counts: Ints = np.einsum("ij->i", values.view(np.int8)).astype(np.int32)
        return counts
    sums: Ints = np.einsum("ij->i", values)
    return sums


class _Measure:
    """bfgd's measure (FGD's fragmentation + balance_weight * stranded GPU) of one GPU class, over arrays."""

    def __init__(self, policy: BalancedFGD, model: str, memory_mib: int, lookahead_weight: float) -> None:
        never, asks, usable, _ = policy.frag_model.class_view(model, memory_mib)
        self.never = never
        self.asks = asks
        self.usable = usable
        self.ratio = policy.cpu_per_gpu_on(memory_mib)
        self.balance_weight = policy.balance_weight
        self.lookahead_weight = lookahead_weight
        #: per ask (its index), the shapes asking it: (CPU ask, GPU count, p), in the model's order
        self.shapes_of_ask: list[list[tuple[int, int, float]]] = [[] for _ in self.asks]
        for cpu, ask, count, p in self.usable:
            self.shapes_of_ask[ask].append((cpu, count, p))
        #: _per_ask's last free array and its sums (of and of_each_change read the same one)
        self._summed: tuple[Ints, Ints, list[_AskSums]] | None = None

    def _per_ask(self, free: Ints) -> tuple[Ints, list[_AskSums]]:
        """Per row, the free shares' total; per ask, _AskSums."""
        summed = self._summed
        if summed is not None and summed[0] is free:
            return summed[1], summed[2]
        total = _row_sums(free)
        per_ask = []
        for ask in self.asks:
            at_least = free >= ask
            large = free * at_least
            above = _row_sums(large)
            per_ask.append(_AskSums(at_least, _row_sums(at_least), total - above, large, above))
        self._summed = (free, total, per_ask)
        return total, per_ask

    def of(self, free: Ints, cpu_free: Ints, cpu_known: Bools, holes: HoleTables | None) -> Floats:
        """Per row: the measure of a node with these free milli-GPU per GPU (last axis) and free milli-CPU; holes:
        the look-ahead tables and each node's row (HoleTerm.hole_tables) when the policy has the term."""
        total, per_ask = self._per_ask(free)
        fitting = [sums.fits for sums in per_ask]
        small = [sums.below for sums in per_ask]
        frag = self._sum(total, fitting, small, cpu_free, cpu_known)
        if holes is None:
            return frag
        tables, row = holes
        looked_up = tables[row[:, None], np.clip(free, 0, MILLI_PER_GPU)]
        extra = np.zeros(len(free))
        for column in looked_up.T:  # the GPUs in position order, as the policy's measure adds them
            extra = extra + column
        return frag + self.lookahead_weight * extra

    def of_each_change(
        self, free: Ints, taken: Ints, cpu_free: Ints, cpu_known: Bools, holes: HoleTables | None
    ) -> Floats:
        """[node, j]: the measure with GPU j's free share replaced by taken[node, j] (<= free), the others as they
        are; counted from the node's own per-ask sums instead of re-summing every variant."""
        total, per_ask = self._per_ask(free)
        total_after = total[:, None] - (free - taken)
        fitting = []
        small = []
        for ask, (at_least, fits, below, _, _) in zip(self.asks, per_ask, strict=True):
            taken_small = taken < ask
            drops_out = at_least & taken_small  # the GPU no longer has the ask free: its rest is small
            fitting.append(fits[:, None] - drops_out)
            # the small shares' sum with GPU j's counted as taken instead of free (each only where below the ask)
            changed = taken * taken_small
            changed -= free * ~at_least
            changed += below[:, None]
            small.append(changed)
        frag = self._sum(total_after, fitting, small, cpu_free[:, None], cpu_known[:, None])
        return self._with_holes_of_each_change(frag, free, taken, holes)

    def of_each_change_rounded(
        self, free: Ints, taken: Ints, cpu_free: Ints, cpu_known: Bools, holes: HoleTables | None
    ) -> tuple[Floats, float]:
        """of_each_change's values with the shapes' terms summed in another order, and a bound on how far any of
        them may be from of_each_change's (rounding only: the same sum of the same products); taken <= free.

        Why: of_each_change keeps the model's order of the shapes, a pass over every variant per shape (30 shapes
        on a learned workload: 4-8 ms at 5000 nodes x 8 GPUs, caches warm or cold); here the shapes asking one
        share are weighed per node first, and the variants see one pass per ask. The measure is
        frag = (never + sum p) * total - sum over asks of W_ask * large_ask, where large_ask is the free share of
        the GPUs with the ask free and W_ask the weight of the shapes asking it that the node still meets: it
        depends on the variant only through whether GPU j drops below the ask, so it is one of two per-node
        sums."""
        total, per_ask = self._per_ask(free)
        total_after = total[:, None] - (free - taken)
        count = len(total)
        coefficient = self.never  # never + sum p, each shape's total counted once
        weights = abs(self.never)
        cpu_ok_of: dict[int, Bools] = {}
        large_terms: Floats = np.zeros(free.shape)
        for ask, sums, shapes in zip(self.asks, per_ask, self.shapes_of_ask, strict=True):
            if not shapes:
                continue
            met = np.zeros(count)  # W where GPU j keeps the ask free
            met_one_short = np.zeros(count)  # W where it drops below it: one GPU fewer has it
            for cpu, gpu_count, p in shapes:
                coefficient += p
                weights += abs(p)
                cpu_ok = cpu_ok_of.get(cpu)
                if cpu_ok is None:
                    cpu_ok = cpu_ok_of[cpu] = cpu_free >= cpu
                met += p * ((sums.fits >= gpu_count) & cpu_ok)
                met_one_short += p * ((sums.fits > gpu_count) & cpu_ok)
            keeps = taken >= ask  # (taken <= free: a GPU that keeps the ask free had it)
            large_after = taken * keeps  # the large shares' sum with GPU j's changed
            large_after -= sums.large
            large_after += sums.above[:, None]
            weight = (met_one_short - met)[:, None] * (sums.at_least ^ keeps)
            weight += met[:, None]
            large_terms -= weight * large_after
        frag: Floats = coefficient * total_after + large_terms
        if self.ratio:  # as _sum adds it
            stranded = np.maximum(0.0, total_after - cpu_free[:, None] / self.ratio) * cpu_known[:, None]
            frag = frag + self.balance_weight * stranded
        frag = self._with_holes_of_each_change(frag, free, taken, holes)
        # Both sums are of the same products, each within ~(terms) * eps * |its terms| of the real sum; every term
        # is at most the weights times the largest total; the additions after them are alike, a rounding each
        terms = len(self.usable) + len(self.asks) + 8
        largest = float(np.abs(total_after).max(initial=0)) * weights + float(np.abs(frag).max(initial=0))
        return frag, 8 * terms * _EPSILON * largest

    def _with_holes_of_each_change(self, frag: Floats, free: Ints, taken: Ints, holes: HoleTables | None) -> Floats:
        if holes is None:
            return frag
        tables, row = holes
        as_is = tables[row[:, None], np.clip(free, 0, MILLI_PER_GPU)]
        changed = tables[row[:, None], np.clip(taken, 0, MILLI_PER_GPU)]
        # variant j adds GPU k's entry as is, GPU j's changed, in position order (the same floats as the measure)
        extra = np.zeros(free.shape)
        for position in range(free.shape[1]):
            is_changed = np.arange(free.shape[1]) == position
            extra = extra + np.where(is_changed, changed[:, position, None], as_is[:, position, None])
        return frag + self.lookahead_weight * extra

    def _sum(self, total: Ints, fitting: list[Ints], small: list[Ints], cpu_free: Ints, cpu_known: Bools) -> Floats:
        # node_frag's sum, term by term in the model's order (the same floats as fragmentation.node_frag: each
        # integer made a float, as p * integer does, then p times it, then added). The tests each shape makes are
        # shared by the shapes with the same GPU ask and count, or the same CPU ask, and a CPU ask every node meets
        # is left out: the learned workload of a real cluster has tens of shapes, each a pass over every GPU
        # A shape's term is its ask's small sum where the node meets it, else the total: chosen as integers
        # (_choose's arithmetic, not np.where), made a float, then times p
        frag: Floats = self.never * total.astype(np.float64)
        meets_gpus: dict[tuple[int, int], Bools] = {}
        meets_cpu: dict[int, Bools | None] = {}
        small_less_total: dict[int, Ints] = {}
        for cpu, ask, count, p in self.usable:
            gpus_ok = meets_gpus.get((ask, count))
            if gpus_ok is None:
                gpus_ok = meets_gpus[ask, count] = fitting[ask] >= count
            if cpu in meets_cpu:
                cpu_ok = meets_cpu[cpu]
            else:
                cpu_ok = cpu_free >= cpu
                cpu_ok = meets_cpu[cpu] = None if cpu_ok.all() else cpu_ok
            difference = small_less_total.get(ask)
            if difference is None:
                difference = small_less_total[ask] = small[ask] - total
            chosen = difference * (gpus_ok if cpu_ok is None else gpus_ok & cpu_ok)
            chosen += total
            frag += chosen * p
        if self.ratio:  # BalancedFGD.stranded: 0.0 where the CPU is unknown (max(0.0, x) * 1.0 is x, * 0.0 is 0.0)
            stranded = np.maximum(0.0, total - cpu_free / self.ratio) * cpu_known
            frag = frag + self.balance_weight * stranded
        return frag


class _AskSums(NamedTuple):
    """One ask's sums over the free shares [node, GPU] (_Measure._per_ask): which GPUs have it free and how many,
    the free share of the others (small), and of those (large, per GPU and summed)."""

    at_least: Bools
    fits: Ints
    below: Ints
    large: Ints
    above: Ints


_EPSILON = float(np.finfo(np.float64).eps)


def quantised_gains(before: Floats, after: Floats) -> Ints:
    """fgd.quantised_gain over arrays: int(100 * sigmoid((before - after) / 1000))."""
    x = (before - after) / 1000
    scaled = 1.0 / (1.0 + np.exp(-x)) * 100
    gains = scaled.astype(np.int64)
    # x == 0 (no change, common) is exactly 50 either way
    near_step = (np.abs(scaled - np.rint(scaled)) < _STEP_GUARD) & (x != 0)
    for where in zip(*np.nonzero(near_step), strict=True):
        gains[where] = int(1.0 / (1.0 + math.exp(-float(x[where]))) * 100)
    return gains


def gains_of_each_change(
    measure: _Measure, before: Floats, free: Ints, taken: Ints, cpu_free: Ints, cpu_known: Bools,
    holes: HoleTables | None,
) -> Ints:
    """quantised_gains(before[:, None], measure.of_each_change(...)), from of_each_change_rounded: the rows
    where a rounded value's gain could be a step off (100 * sigmoid within the rounding bound of an integer step)
    are measured again exactly, so the gains are of_each_change's."""
    # the exact sum throughout where a GPU is freer with the pod on it (never from a valid request: the rounded sum
    # counts a changed GPU's ask as kept only where it had it) or the values hold NaN or inf
    changes, error = ((free, math.inf) if bool((taken > free).any())
                      else measure.of_each_change_rounded(free, taken, cpu_free, cpu_known, holes))
    if not math.isfinite(error):
        return quantised_gains(before[:, None], measure.of_each_change(free, taken, cpu_free, cpu_known, holes))
    x = (before[:, None] - changes) / 1000
    scaled = 1.0 / (1.0 + np.exp(-x)) * 100
    gains = scaled.astype(np.int64)
    # 100 * sigmoid(m / 1000) moves by at most 1/40 per unit of the measure m (taken twice over); the exact
    # gains are quantised_gains', which itself recomputes within _STEP_GUARD of a step
    guard = 2 * _STEP_GUARD + error / 20
    rows = np.flatnonzero((np.abs(scaled - np.rint(scaled)) < guard).any(axis=1))
    if len(rows):
        exact = measure.of_each_change(free[rows], taken[rows], cpu_free[rows], cpu_known[rows],
                                       None if holes is None else (holes[0], holes[1][rows]))
        gains[rows] = quantised_gains(before[rows, None], exact)
    return gains


def place_batch(
    nodes: Sequence[NodeState], request: PlacementRequest, policy: BalancedFGD, holes: HoleTerm | None = None,
    gathered: GroupColumns | None = None,
) -> list[Placement | None]:
    """fit.place(node, request, policy, policy) for each node where the array rules cover it, else None. holes: the
    policy's look-ahead term (the same object as the policy) when its measure has one; gathered: the nodes' columns
    as the caller keeps them (all of one group), instead of reading each node's."""
    results: list[Placement | None] = [None] * len(nodes)
    container = batch_container(request)
    if container is None:
        return results
    if gathered is not None:
        width, model, memory_mib, cores = gathered.group
        if holes is not None:
            holes.prepare_classes([(model, memory_mib)])
        return _place_group(list(nodes), gathered.columns, gathered.cpu_total, gathered.cpu_used, model, memory_mib,
                            cores, request, container, policy, holes, gathered.links, gathered.names)
    # each node's row as kept for its version, read in C; the nodes changed since their last row are computed
    rows: list[Any] = list(map(dict.get, map(_VERSION_CACHE, nodes), repeat(node_row), repeat(_NO_ROW)))
    if _NO_ROW in rows:
        rows = [node_row(node) if row is _NO_ROW else row for node, row in zip(nodes, rows, strict=True)]
    coverable = None not in rows
    kinds = set(map(_GROUP, rows)) if coverable else set(map(_group_of, rows))
    if holes is not None:
        holes.prepare_classes([(kind[1], kind[2]) for kind in kinds if kind is not None])
    kind = kinds.pop() if len(kinds) == 1 else None
    if kind is not None:  # the usual cluster: every node of one kind, in one pass
        width, model, memory_mib, cores = kind
        columns = np.frombuffer(b"".join(map(_COLUMNS, rows)), dtype=COLUMN_DTYPE).reshape(
            len(rows), width, GPU_COLUMNS)
        return _place_group(list(nodes), columns, *host_cpu(nodes), model, memory_mib, cores, request, container,
                            policy, holes)
    groups: dict[tuple[int, str, int, int], list[int]] = {}
    for number, row in enumerate(rows):
        if row is not None:
            groups.setdefault(row[0], []).append(number)
    for (width, model, memory_mib, cores), numbers in groups.items():
        columns = np.frombuffer(b"".join(_columns_of(rows[i]) for i in numbers), dtype=COLUMN_DTYPE).reshape(
            len(numbers), width, GPU_COLUMNS)
        members = [nodes[i] for i in numbers]
        placed = _place_group(members, columns, *host_cpu(members), model, memory_mib, cores, request, container,
                              policy, holes)
        for number, placement in zip(numbers, placed, strict=True):
            results[number] = placement
    return results


_VERSION_CACHE = attrgetter("version_cache")
_GROUP = itemgetter(0)
_COLUMNS = itemgetter(1)


def _group_of(row: tuple[tuple[int, str, int, int], bytes] | None) -> tuple[int, str, int, int] | None:
    return None if row is None else row[0]


def _columns_of(row: tuple[tuple[int, str, int, int], bytes] | None) -> bytes:
    return b"" if row is None else row[1]


_NAME = attrgetter("name")
_HAS_LINKS = attrgetter("has_links")
_LINK_ID = attrgetter("link_id")
_CPU_TOTAL = attrgetter("cpu_milli_total")
_CPU_USED = attrgetter("cpu_milli_used")


def node_links(nodes: Sequence[NodeState]) -> Ints:
    """Each node's link matrix id (NodeState.link_id), -1 where its GPUs have no links."""
    count = len(nodes)
    linked = np.fromiter(map(_HAS_LINKS, nodes), dtype=np.bool_, count=count)
    return np.where(linked, np.fromiter(map(_LINK_ID, nodes), dtype=np.int64, count=count), -1)


def host_cpu(nodes: Sequence[NodeState]) -> tuple[Ints, Ints]:
    """The nodes' allocatable and requested milli-CPU, as the batch reads them."""
    count = len(nodes)
    return (np.fromiter(map(_CPU_TOTAL, nodes), dtype=np.int64, count=count),
            np.fromiter(map(_CPU_USED, nodes), dtype=np.int64, count=count))


def _place_group(  # noqa: C901 - one vectorised pass, in fit.place's order
    nodes: list[NodeState], columns: Ints, cpu_total: Ints, cpu_used: Ints, model: str, memory_mib: int, cores: int,
    request: PlacementRequest, container: ContainerGpuRequest, policy: BalancedFGD, holes: HoleTerm | None,
    links: Ints | None = None, names: Sequence[str] | None = None,
) -> list[Placement | None]:
    """fit.place's results for nodes of one group, from their columns; links and names: node_links of them and
    their names, where the caller keeps them (links are read only for a container choosing whole GPUs)."""
    count, width, _ = columns.shape
    need_memory = container.memory_on(memory_mib)
    need_cores = container.cores
    if (max(memory_mib + need_memory, cores + need_cores) * MILLI_PER_GPU > np.iinfo(columns.dtype).max
            or min(need_memory, need_cores) < 0):  # sums and products beyond the columns' integers
        columns = columns.astype(np.int64)
    used_memory = columns[:, :, 0]
    used_cores = columns[:, :, 1]
    vgpus = columns[:, :, 2]
    max_vgpus = columns[:, :, 3]
    usable = columns[:, :, 4] == 1
    cpu_known = cpu_total > 0  # policies._milli.frag_cpu_free_milli
    cpu_free = np.where(cpu_known, cpu_total - cpu_used, 1 << 40)
    cpu_after = np.where(cpu_known, cpu_free - request.cpu_milli, cpu_free)

    # fit.fitting_gpus (a plain request: no selectors, no model list)
    exclusive = need_cores >= cores
    fits = usable & (vgpus < max_vgpus) & (used_memory + need_memory <= memory_mib)
    fits &= (vgpus == 0) if exclusive else (used_cores + need_cores <= cores)
    placeable = _row_sums(fits) >= container.count

    free = _free_share(used_memory, used_cores, vgpus, max_vgpus, usable, memory_mib, cores)
    measure = _Measure(policy, model, memory_mib, 0.0 if holes is None else holes.lookahead_weight)
    # the look-ahead's tables for the node as it is, and once the pod's CPU and host memory are taken
    holes_before = holes_after = None
    if holes is not None:
        holes_before, holes_after = holes.hole_tables(nodes, model, memory_mib, cpu_known, cpu_free, cpu_after,
                                                      request.memory_mib)
    before = measure.of(free, cpu_free, cpu_known, holes_before)
    taken_cores = cores if exclusive else need_cores
    # each GPU's free share once it holds one more vGPU of the container
    taken = np.zeros_like(free) if exclusive else _free_share(
        used_memory + need_memory, used_cores + need_cores, vgpus + 1, max_vgpus, usable, memory_mib, cores)
    bit = 1 << np.arange(width)

    chosen: list[tuple[int, ...] | None] = [None] * count
    gains: Ints
    quality: Floats | None = None
    if container.count == 1 and not exclusive:
        # FragPolicyBase.choose_gpus: the fitting GPU whose change scores best; ties by break_tie
        each = gains_of_each_change(measure, before, free, taken, cpu_after, cpu_known, holes_after)
        each = np.where(fits, each, -1)
        best = each.max(axis=1)
        tied = fits & (each == best[:, None])
        picked = tied.argmax(axis=1)  # the first tied: the lowest index
        if not policy.reference_ties:
            # break_tie: a GPU already split first (least free memory, then lowest index), else least damaging
            ties = placeable & (_row_sums(tied) > 1)
            shared = tied & (vgpus > 0)
            has_shared = shared.any(axis=1)
            fullest = np.where(shared, used_memory, -1).argmax(axis=1)  # alike GPUs: least free = most used
            picked = np.where(ties & has_shared, fullest, picked)
            tied_bits = (tied @ bit).tolist()
            idle_bits = ((usable & (vgpus == 0)) @ bit).tolist()
            for row in np.nonzero(ties & ~has_shared)[0].tolist():
                node = nodes[row]
                if node.has_links:  # else the lowest index, already picked
                    picked[row] = _least_damaging(node, tied_bits[row], idle_bits[row])
        gains = np.take_along_axis(each, picked[:, None], axis=1)[:, 0]
        shapes: list[tuple[int, ...] | None] = [(position,) for position in range(width)]
        chosen = list(map(shapes.__getitem__, picked.tolist()))
    else:
        # choose_whole: the lowest-index fitting GPUs, or on nodes with links the best-connected ones; chosen once
        # per distinct (link matrix, fitting GPUs, idle GPUs) and spread to the nodes over arrays (a loop over 5000
        # nodes took ~5 ms)
        fit_bits = fits @ bit
        if links is None:
            links = node_links(nodes)
        idle_bits = (usable & (vgpus == 0)) @ bit
        keyed_idle = np.where(links >= 0, idle_bits, 0) if container.count == 1 else np.zeros_like(idle_bits)
        parts: tuple[Any, Any, Any] = (links + 1, fit_bits, keyed_idle)
        if 2 * width >= 62 or int(parts[0].max(initial=0)) >= 1 << (62 - 2 * width):  # a key in 64 bits, else in
            # Python's integers (nodes of 21 GPUs or more)
            parts = (parts[0].astype(object), parts[1].astype(object), parts[2].astype(object))
        keys = (parts[0] << (2 * width)) | (parts[1] << width) | parts[2]
        _, firsts, which = np.unique(keys, return_index=True, return_inverse=True)
        choices: list[tuple[int, ...] | None] = []
        choice_bits: list[int] = []
        choice_quality: list[float] = []
        for row in firsts.tolist():
            node = nodes[row]
            bits = int(fit_bits[row])
            candidates = [p for p in range(width) if bits >> p & 1]
            quality_of = 0.0
            if len(candidates) < container.count:
                positions: tuple[int, ...] = ()
            elif links[row] < 0:
                positions = tuple(candidates[: container.count])
            elif container.count == 1:
                positions = (_least_damaging(node, bits, int(idle_bits[row])),)
            else:
                positions = tuple(best_connected_positions(node.link_id, node.link_matrix, tuple(candidates),
                                                           container.count))
                quality_of = set_quality(node.link_matrix, positions)[0] / BEST_LINK_SCORE
            choices.append(positions or None)
            choice_bits.append(sum(1 << p for p in positions))
            choice_quality.append(quality_of)
        chosen = list(map(choices.__getitem__, which.tolist()))
        chosen_bits = np.array(choice_bits, dtype=np.int64)[which]
        in_chosen = (chosen_bits[:, None] & bit) != 0
        gains = quantised_gains(before, measure.of(np.where(in_chosen, taken, free), cpu_after, cpu_known, holes_after))
        if container.count > 1:
            quality = np.array(choice_quality)[which]

    # bfgd.score: the gain, the connectivity of a multi-GPU placement, the fill tie-break
    scores = gains.astype(np.float64)
    if quality is not None:
        scores = scores + 100.0 * quality  # bfgd.TOPOLOGY_WEIGHT; 0.0 on nodes without links
    if not policy.reference_ties:
        total_memory = memory_mib * width
        if total_memory:
            memory_sum = _row_sums(used_memory) + need_memory * container.count
            cores_sum = _row_sums(used_cores) + taken_cores * container.count
            fill = 0.5 * memory_sum / total_memory + 0.5 * cores_sum / max(cores * width, 1)
            scores = scores + 0.5 * fill  # bfgd.FILL_TIE_BREAK (no GPU memory: a fill of 0.0, nothing to add)

    # each distinct choice's containers and usage, built once (None: nothing chosen, the node is not placeable)
    containers_of: dict[tuple[int, ...] | None, tuple[ContainerPlacement, ...]] = {None: ()}
    usage_of: dict[tuple[int, ...] | None, tuple[GpuUsage, ...]] = {None: ()}
    for where in set(chosen):
        if where is not None:
            devices = tuple((p, need_memory, taken_cores) for p in where)
            containers_of[where] = (ContainerPlacement(container, devices),)
            usage_of[where] = tuple(GpuUsage(p, need_memory, taken_cores, 1, exclusive) for p in sorted(where))
    # Placement(name, containers, usage, score) for every node, built in C (new_placement's tuple.__new__ mapped
    # over the columns: 5000 nodes in ~1 ms), then None where the pod does not fit
    placed: list[Placement | None] = list(map(
        NEW_TUPLE, repeat(Placement, count),
        zip(map(_NAME, nodes) if names is None else names, map(containers_of.__getitem__, chosen),
            map(usage_of.__getitem__, chosen), scores.tolist(), strict=True)))
    for row in np.flatnonzero(~placeable).tolist():
        placed[row] = None
    if None in chosen:  # no GPUs chosen (too few fit): not placeable either, kept explicit
        for row, where in enumerate(chosen):
            if where is None:
                placed[row] = None
    return placed


#: (link matrix id, candidate bits, idle bits) -> _least_damaging's position: the same on every node with that
#: matrix (a node's GPUs are in index order, the search's last tie-break), so an empty cluster's 5000 alike nodes
#: cost one search (each ~20 us: 110 ms for a new 1-GPU shape before, against ~18 ms on a half-full cluster)
_LEAST_DAMAGING_MEMO: dict[tuple[int, int, int], int] = {}


def _least_damaging(node: NodeState, candidate_bits: int, idle_bits: int) -> int:
    """topology.least_damaging_gpu's position among the candidates (nothing of the pod placed yet); idle_bits: the
    node's usable GPUs no vGPU holds (least_damaging_gpu's idle GPUs: a GPU held exclusively holds a vGPU)."""
    key = (node.link_id, candidate_bits, idle_bits)
    position = _LEAST_DAMAGING_MEMO.get(key)
    if position is None:
        candidates = [gpu for gpu in node.gpus if candidate_bits >> gpu.position & 1]
        position = least_damaging_gpu(node, candidates, Scratch(len(node.gpus))).position
        if len(_LEAST_DAMAGING_MEMO) > 100_000:  # bounded
            _LEAST_DAMAGING_MEMO.clear()
        _LEAST_DAMAGING_MEMO[key] = position
    return position
