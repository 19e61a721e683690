"""The FGD paper's GPU fragmentation measure (Weng et al., USENIX ATC'23), pure functions.

A node's idle GPU capacity counts as fragmented for a task shape m when m cannot use it: m asks no GPU;
m's GPU model list excludes the node; the node lacks the CPU m needs; the node has fewer than m's GPU count of
GPUs with m's per-GPU ask free (then all idle capacity counts); or, when m fits, the idle capacity on the GPUs
whose free amount is below m's per-GPU ask. Node fragmentation = sum_m p_m * fragmented_m over a target
workload {m: p_m}. Units: milli-GPU (1000 = one whole GPU), milli-CPU.

Everything here is keyed by plain tuples so callers can memoise by node state (many nodes share one).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .model import NodeState, PlacementRequest

MILLI_PER_GPU = 1000
#: the reference keeps the most frequent shapes until they cover this share of tasks
DEFAULT_COVERAGE = 0.95


@dataclass(frozen=True, slots=True)
class TaskShape:
    """What fragmentation looks at in a task: CPU, milli-GPU per GPU, GPU count, allowed GPU models (memory is
    ignored, as in the reference)."""

    cpu_milli: int
    gpu_milli: int  # per GPU; 0 for CPU-only tasks; 1000 for whole GPUs
    gpu_count: int
    gpu_spec: tuple[str, ...] = ()  # allowed models, empty = any

    @property
    def total_gpu_milli(self) -> int:
        return self.gpu_milli * self.gpu_count

    def accessible(self, model: str) -> bool:
        return not self.gpu_spec or model in self.gpu_spec

    def sort_key(self) -> tuple[int, int, int, str]:
        # the reference's PodResource.Less order (ties in frequency are broken by it, descending)
        return (self.cpu_milli, self.gpu_milli, self.gpu_count, "|".join(self.gpu_spec))


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
    """The shape of an engine request (milli-GPU relative to a 1000-core GPU; whole-GPU asks become 1000)."""
    containers = request.gpu.containers
    if not containers:
        return TaskShape(request.cpu_milli, 0, 0, request.gpu_spec)
    container = containers[0]
    milli = min(container.cores, MILLI_PER_GPU) if container.cores else MILLI_PER_GPU
    count = sum(c.count for c in containers if not c.init) or container.count
    return TaskShape(request.cpu_milli, milli, count, request.gpu_spec)


class FragModel:
    """Node fragmentation under one target workload, memoised by node state.

    State = (GPU model, free milli-CPU, free milli-GPU per GPU sorted descending); the measure does not depend
    on GPU order, so sorting lets differently-ordered nodes share a memo entry.
    """

    __slots__ = ("_by_model", "_memo", "shapes")

    def __init__(self, shapes: WeightedShapes) -> None:
        self.shapes = shapes
        self._by_model: dict[str, tuple[float, tuple[tuple[int, int, int, float], ...]]] = {}
        self._memo: dict[tuple[str, int, tuple[int, ...]], float] = {}

    def _model_view(self, model: str) -> tuple[float, tuple[tuple[int, int, int, float], ...]]:
        """(probability of shapes that can never use this model's GPUs, the others as (cpu, milli, count, p))."""
        view = self._by_model.get(model)
        if view is None:
            never = 0.0
            usable: list[tuple[int, int, int, float]] = []
            for shape, p in self.shapes:
                if shape.gpu_milli == 0 or not shape.accessible(model):
                    never += p
                else:
                    usable.append((shape.cpu_milli, shape.gpu_milli, shape.gpu_count, p))
            view = (never, tuple(usable))
            self._by_model[model] = view
        return view

    def frag(self, model: str, cpu_free_milli: int, gpu_free_milli: tuple[int, ...]) -> float:
        """Fragmented milli-GPU of a node; gpu_free_milli must be sorted descending."""
        key = (model, cpu_free_milli, gpu_free_milli)
        value = self._memo.get(key)
        if value is None:
            value = node_frag(self._model_view(model), cpu_free_milli, gpu_free_milli)
            if len(self._memo) > 2_000_000:  # bound memory in very long runs
                self._memo.clear()
            self._memo[key] = value
        return value


def node_frag(
    model_view: tuple[float, Sequence[tuple[int, int, int, float]]], cpu_free_milli: int, gpu_free_milli: Sequence[int]
) -> float:
    """The measure itself for one node (see the module docstring); gpu_free_milli sorted descending."""
    total = 0
    for free in gpu_free_milli:
        total += free
    if total == 0:
        return 0.0
    never, usable = model_view
    frag = never * total
    for cpu, milli, count, p in usable:
        if cpu_free_milli < cpu:
            frag += p * total
            continue
        fitting = 0
        small = 0
        for free in gpu_free_milli:
            if free >= milli:
                fitting += 1
            else:
                small += free
        frag += p * (total if fitting < count else small)
    return frag


def frag_of(model: str, cpu_free_milli: int, gpu_free_milli: Iterable[int], shapes: WeightedShapes) -> float:
    """Convenience (tests, reports): fragmentation of one node described by plain numbers."""
    ordered = tuple(sorted(gpu_free_milli, reverse=True))
    return FragModel(shapes).frag(model, cpu_free_milli, ordered)


def node_view(node: NodeState) -> tuple[str, int, tuple[int, ...]]:
    """(model, free milli-CPU, free milli-GPU per GPU sorted descending) of an engine node."""
    gpus = node.gpus
    model = gpus[0].model if gpus else ""
    free = []
    for gpu in gpus:
        if gpu.exclusive_holders or not gpu.healthy or gpu.mig_mode:
            free.append(0)
        elif gpu.cores == MILLI_PER_GPU:
            free.append(gpu.cores - gpu.used_cores)
        else:
            free.append((gpu.cores - gpu.used_cores) * MILLI_PER_GPU // max(gpu.cores, 1))
    free.sort(reverse=True)
    return model, node.cpu_milli_total - node.cpu_milli_used, tuple(free)


def cluster_frag(nodes: Iterable[NodeState], model: FragModel) -> tuple[float, int]:
    """(fragmented milli-GPU, idle milli-GPU) summed over a cluster."""
    frag = 0.0
    idle = 0
    for node in nodes:
        name, cpu_free, free = node_view(node)
        frag += model.frag(name, cpu_free, free)
        idle += sum(free)
    return frag, idle
