"""The FGD paper's GPU fragmentation measure (Weng et al., USENIX ATC'23), pure functions.

A node's idle GPU capacity counts as fragmented for a task shape m when m cannot use it: m asks no GPU;
m's GPU model list excludes the node; the node lacks the CPU m needs; the node has fewer than m's GPU count of
GPUs with m's per-GPU ask free (then all idle capacity counts); or, when m fits, the idle capacity on the GPUs
whose free amount is below m's per-GPU ask. Node fragmentation = sum_m p_m * fragmented_m over a target
workload {m: p_m}. Units: milli-GPU (1000 = one whole GPU; see engine.shares for GPUs with memory and compute),
milli-CPU.

A task's per-GPU ask depends on the GPU's memory size when it asks fixed MiB, so the measure is evaluated per GPU
class (model, memory MiB). Everything here is keyed by plain tuples so callers can memoise by node state (many
nodes share one).
"""

from __future__ import annotations

from bisect import bisect_right
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kube_vgpu.extender.engine.shares import MILLI_PER_GPU, ask_share_milli, free_share_milli

if TYPE_CHECKING:
    from kube_vgpu.extender.engine.model import NodeState, PlacementRequest

__all__ = ["MILLI_PER_GPU", "ClassView", "FragModel", "ShapeLearner", "TaskShape", "WeightedShapes", "task_shape"]

#: the reference keeps the most frequent shapes until they cover this share of tasks
DEFAULT_COVERAGE = 0.95
#: FragModel memo bound (~250 bytes an entry). A live cluster's nodes rarely share a state (free CPU differs), so
#: there the memo mostly serves one placement's before/after states and a large one only holds memory (5000 nodes
#: filled it with ~12 MiB); clearing it more often costs the simulator nothing measurable (fgd, openb default).
MEMO_ENTRIES = 1 << 13


@dataclass(frozen=True, slots=True)
class TaskShape:
    """What fragmentation looks at in a task: CPU, per-GPU ask, GPU count, allowed GPU models.

    The per-GPU ask is GPU-independent: compute (`gpu_milli`) and memory as a fraction (`gpu_memory_milli`: a
    percentage ask, or 1000 when the pod names no memory and so takes all of it) or in MiB (`gpu_memory_mib`);
    share_on() turns it into milli-GPU of one GPU class. openb tasks ask compute only (both memory fields 0), as
    in the reference."""

    cpu_milli: int
    gpu_milli: int  # compute per GPU; 0 for CPU-only tasks (and for memory-only asks); 1000 for whole GPUs
    gpu_count: int
    gpu_spec: tuple[str, ...] = ()  # allowed models, empty = any
    gpu_memory_mib: int = 0  # fixed memory per GPU
    gpu_memory_milli: int = 0  # memory per GPU as a fraction of the GPU

    def share_on(self, gpu_memory_mib: int) -> int | None:
        """Milli-GPU per GPU on GPUs of this memory size (0 = unknown); None when it can never fit there."""
        return ask_share_milli(self.gpu_milli, self.gpu_memory_milli, self.gpu_memory_mib, gpu_memory_mib)

    def accessible(self, model: str) -> bool:
        return not self.gpu_spec or model in self.gpu_spec

    def sort_key(self) -> tuple[int, int, int, str, int, int]:
        # the reference's PodResource.Less order (ties in frequency are broken by it, descending); the memory
        # fields (0 on openb) come last so openb shapes keep the reference's order
        return (
            self.cpu_milli,
            self.gpu_milli,
            self.gpu_count,
            "|".join(self.gpu_spec),
            self.gpu_memory_mib,
            self.gpu_memory_milli,
        )


WeightedShapes = tuple[tuple[TaskShape, float], ...]


def typical_shapes(shapes: Iterable[TaskShape], coverage: float = DEFAULT_COVERAGE) -> WeightedShapes:
    """The most frequent shapes, in descending frequency (ties: larger shape first, as the reference sorts),
    taken until they cover `coverage` of all tasks, with probabilities renormalised to sum to 1."""
    return typical_from_counts(Counter(shapes), coverage)


def typical_from_counts(counts: Mapping[TaskShape, int], coverage: float = DEFAULT_COVERAGE) -> WeightedShapes:
    """typical_shapes() from precomputed counts."""
    total = sum(counts.values())
    if not total:
        return ()
    ordered = sorted(counts.items(), key=lambda item: (item[1], item[0].sort_key()), reverse=True)
    chosen: list[tuple[TaskShape, int]] = []
    covered = 0
    for shape, count in ordered:
        if covered >= coverage * total:
            break
        chosen.append((shape, count))
        covered += count
    return tuple((shape, count / covered) for shape, count in chosen)


class ShapeLearner:
    """Learns the target workload online from the tasks seen so far, as a running scheduler can.

    The typical shapes are recomputed at doubling task counts (8, 16, 32, ...) and every `refresh_tasks` tasks
    after that, so results cached per (node state, policy epoch) stay valid between refreshes.
    """

    __slots__ = ("_counts", "_next_refresh", "_seen", "coverage", "refresh_tasks")

    def __init__(self, coverage: float = DEFAULT_COVERAGE, refresh_tasks: int = 2048) -> None:
        self.coverage = coverage
        self.refresh_tasks = refresh_tasks
        self._counts: Counter[TaskShape] = Counter()
        self._seen = 0
        self._next_refresh = 8

    def add(self, shape: TaskShape) -> bool:
        """Count one task; True when the typical shapes should be recomputed now."""
        self._counts[shape] += 1
        self._seen += 1
        if self._seen >= self._next_refresh or self._seen == 1:
            if self._seen >= self._next_refresh:
                self._next_refresh = min(self._next_refresh * 2, self._next_refresh + self.refresh_tasks)
            return True
        return False

    @property
    def seen(self) -> int:
        return self._seen

    def shapes(self) -> WeightedShapes:
        return typical_from_counts(self._counts, self.coverage)


def task_shape(request: PlacementRequest) -> TaskShape:
    """The shape of an engine request: its first GPU container's per-GPU ask (compute in milli of the request's
    cores unit; exclusive = 1000; memory as asked, none = all of it), the vGPUs of the app containers and
    native sidecars (which run beside them) as the count."""
    containers = tuple(c for c in request.gpu.containers if not c.mig)  # MIG devices are no GPU shares
    if not containers:
        return TaskShape(request.cpu_milli, 0, 0, request.gpu_spec)
    container = containers[0]
    unit = request.cores_per_gpu
    if container.cores >= unit:
        compute_milli = MILLI_PER_GPU
    elif unit == MILLI_PER_GPU:
        compute_milli = container.cores
    else:
        compute_milli = -(-container.cores * MILLI_PER_GPU // unit)
    memory_mib = memory_milli = 0
    if container.memory_mib is not None:
        memory_mib = container.memory_mib  # openb asks 0 MiB: compute only
    elif container.memory_percent is not None:
        memory_milli = container.memory_percent * MILLI_PER_GPU // 100
    else:
        memory_milli = MILLI_PER_GPU  # no memory named: the whole GPU's memory
    count = sum(c.count for c in containers if c.sidecar or not c.init) or container.count  # the app phase
    return TaskShape(request.cpu_milli, compute_milli, count, request.gpu_spec, memory_mib, memory_milli)


#: one GPU class's view of the target workload (FragModel.class_view): the probability of the shapes that can never
#: use its GPUs; the distinct per-GPU asks of the others, descending; those shapes in the model's order as
#: (milli-CPU, index of their per-GPU ask in the asks, GPU count, probability); their distinct milli-CPU asks,
#: ascending
ClassView = tuple[float, tuple[int, ...], tuple[tuple[int, int, int, float], ...], tuple[int, ...]]


class FragModel:
    """Node fragmentation under one target workload, memoised by node state.

    State = (GPU model, free milli-CPU, free milli-GPU per GPU sorted descending); the measure does not depend
    on GPU order, so sorting lets differently-ordered nodes share a memo entry, and it depends on the free CPU
    only through the shapes whose CPU ask it meets, so the memo is keyed by how many distinct CPU asks it meets.
    """

    __slots__ = ("_by_class", "_memo", "shapes")

    def __init__(self, shapes: WeightedShapes) -> None:
        self.shapes = shapes
        self._by_class: dict[tuple[str, int], ClassView] = {}
        self._memo: dict[tuple[str, int, int, tuple[int, ...]], float] = {}

    def class_view(self, model: str, gpu_memory_mib: int) -> ClassView:
        """The workload as GPUs of this class see it (ClassView; policies.batch sums the measure from it)."""
        view = self._by_class.get((model, gpu_memory_mib))
        if view is None:
            never = 0.0
            usable: list[tuple[int, int, int, float]] = []
            for shape, p in self.shapes:
                share = shape.share_on(gpu_memory_mib) if shape.gpu_count else None
                if share is None or not shape.accessible(model):
                    never += p
                else:
                    usable.append((shape.cpu_milli, share, shape.gpu_count, p))
            asks = tuple(sorted({share for _, share, _, _ in usable}, reverse=True))
            where = {share: index for index, share in enumerate(asks)}
            cpus = tuple(sorted({cpu for cpu, _, _, _ in usable}))
            view = (never, asks, tuple((cpu, where[share], count, p) for cpu, share, count, p in usable), cpus)
            self._by_class[(model, gpu_memory_mib)] = view
        return view

    def frag(self, model: str, cpu_free_milli: int, gpu_free_milli: tuple[int, ...], gpu_memory_mib: int = 0) -> float:
        """Fragmented milli-GPU of a node whose GPUs are `model` with `gpu_memory_mib` each (0: unknown, fixed MiB
        asks are then judged by their other fractions); gpu_free_milli must be sorted descending."""
        view = self._by_class.get((model, gpu_memory_mib)) or self.class_view(model, gpu_memory_mib)
        # node_frag compares the free CPU with each shape's CPU ask alone: equal for every free CPU that meets the
        # same asks
        key = (model, gpu_memory_mib, bisect_right(view[3], cpu_free_milli), gpu_free_milli)
        value = self._memo.get(key)
        if value is None:
            value = node_frag(view, cpu_free_milli, gpu_free_milli)
            if len(self._memo) >= MEMO_ENTRIES:
                self._memo.clear()
            self._memo[key] = value
        return value


def node_frag(class_view: ClassView, cpu_free_milli: int, gpu_free_milli: Sequence[int]) -> float:
    """The measure itself for one node (see the module docstring); gpu_free_milli sorted descending.

    Per shape m: all idle capacity when the CPU is short or fewer than m's count of GPUs have m's ask free, else
    the idle capacity of the GPUs below m's ask, weighted by p_m and summed in the model's order. The GPU counts
    and idle capacities are integers, worked out once per distinct ask: the GPUs with the ask free are a prefix of
    the sorted free list."""
    total = 0
    for free in gpu_free_milli:
        total += free
    if total == 0:
        return 0.0
    never, asks, usable, _ = class_view
    fitting: list[int] = []  # by ask: GPUs with at least that much free
    small: list[int] = []  # by ask: idle milli-GPU on the other GPUs
    gpus = len(gpu_free_milli)
    position = 0
    above = 0  # free milli-GPU of the first `position` GPUs
    for ask in asks:
        while position < gpus and gpu_free_milli[position] >= ask:
            above += gpu_free_milli[position]
            position += 1
        fitting.append(position)
        small.append(total - above)
    frag = never * total
    for cpu, ask, count, p in usable:
        if cpu_free_milli < cpu or fitting[ask] < count:
            frag += p * total
        else:
            frag += p * small[ask]
    return frag


def frag_of(model: str, cpu_free_milli: int, gpu_free_milli: Iterable[int], shapes: WeightedShapes) -> float:
    """Convenience (tests, reports): fragmentation of one node described by plain numbers."""
    ordered = tuple(sorted(gpu_free_milli, reverse=True))
    return FragModel(shapes).frag(model, cpu_free_milli, ordered)


def node_view(node: NodeState) -> tuple[str, int, tuple[int, ...]]:
    """(model, free milli-CPU, free milli-GPU per GPU sorted descending) of an engine node."""
    free = sorted((free_share_milli(gpu) for gpu in node.gpus), reverse=True)
    return node.gpu_model, node.cpu_milli_total - node.cpu_milli_used, tuple(free)


def cluster_frag(nodes: Iterable[NodeState], model: FragModel) -> tuple[float, int]:
    """(fragmented milli-GPU, idle milli-GPU) summed over a cluster."""
    frag = 0.0
    idle = 0
    for node in nodes:
        name, cpu_free, free = node_view(node)
        frag += model.frag(name, cpu_free, free, node.gpu_memory_mib)
        idle += sum(free)
    return frag, idle
