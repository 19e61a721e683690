"""An upper bound on the GPU any placement policy can allocate from an arrival sequence (the "ceiling").

Why it is an upper bound (docs/simulator.md, "The ceiling", has the argument in full): under METHOD.md tasks never
leave, so whatever a policy does, the tasks it holds at the end form one feasible packing of a subset of the
arrived tasks onto the empty cluster. The allocated GPU after the last arrival is therefore at most the best
packing of any subset, an offline optimum no online policy can exceed, and the metric at arrived = 130 % (a mean
of allocated values that only grow) is at most that. This module relaxes that offline optimum to a linear
program over node classes (identical nodes grouped) and task shapes:

    maximise   sum_{t,c} g_t x_tc                      x_tc >= 0: tasks of shape t placed on nodes of class c
    subject to sum_c x_tc           <= a_t             (a_t tasks of shape t arrived)
               sum_t cpu_t x_tc     <= n_c cpu_c       (per class c: n_c nodes; also memory)
               sum_t g_t x_tc       <= n_c G_c 1000    (GPU milli)
               sum_t f_e(t) x_tc    <= n_c G_c 1000    (per GPU packing, for e in DFF_THRESHOLDS)

where x_tc exists only when one empty node of class c can host shape t (model allowed, CPU, memory, GPU count),
and f_e is a dual feasible function of bin packing applied per GPU (a whole GPU counts 1000). Every row is a sum
over the nodes of a class of a constraint each node satisfies, so any real packing gives a feasible x.

The number reported is not the solver's objective but the value of a dual solution recomputed here in exact
rational arithmetic: any row prices rho >= 0 give the valid bound
    sum_r cap_r rho_r + sum_t a_t max(0, max_c (g_t - sum_r A_r(t,c) rho_r)),
(weak LP duality), so solver tolerances can only make the bound looser, never invalid.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from fractions import Fraction

from kube_vgpu.dev.simulator.engine import Cluster, simulate
from kube_vgpu.dev.simulator.metrics import bucket
from kube_vgpu.dev.simulator.trace import NodeSpec, Task
from kube_vgpu.extender.engine.fragmentation import MILLI_PER_GPU
from kube_vgpu.extender.engine.policies import Policy

#: e of the dual feasible functions f_e (Fekete & Schepers): a per-GPU share s counts 1000 if s > 1000 - e, s if
#: e <= s <= 1000 - e, 0 if s < e. Valid for 0 < e <= 500: a GPU holding a share above 1000 - e has under e left
#: for the others (they count 0); otherwise every share counts at most its size. Either way a GPU sums to <= 1000.
DFF_THRESHOLDS: tuple[int, ...] = (500, 334, 250, 200)


@dataclass(frozen=True, slots=True)
class NodeClass:
    cpu_milli: int
    memory_mib: int
    gpu_count: int
    model: str
    count: int

    def hosts(self, task: Task) -> bool:
        """Whether one empty node of this class can host the task (METHOD.md step 1)."""
        return (
            task.cpu_milli <= self.cpu_milli
            and task.memory_mib <= self.memory_mib
            and task.gpu_count <= self.gpu_count
            and (not task.gpu_spec or self.model in task.gpu_spec)
        )


def node_classes(specs: Iterable[NodeSpec]) -> list[NodeClass]:
    counts = Counter((s.cpu_milli, s.memory_mib, s.gpu_count, s.model) for s in specs)
    return [NodeClass(cpu, mem, gpus, model, n) for (cpu, mem, gpus, model), n in sorted(counts.items())]


def dff(share: int, threshold: int) -> int:
    """f_e of one GPU's share (milli), scaled to 1000."""
    if share > MILLI_PER_GPU - threshold:
        return MILLI_PER_GPU
    return share if share >= threshold else 0


@dataclass(frozen=True)
class Bound:
    """An upper bound on allocated GPU milli (and the LP's own optimum, for reference)."""

    bound_milli: Fraction  # exact value of the recomputed dual solution: the bound
    lp_milli: float  # the solver's primal objective (<= bound_milli up to solver tolerance)
    capacity_milli: int
    arrived_milli: int
    seconds: float

    @property
    def pct(self) -> float:
        """The bound as % of capacity, rounded up in the 6th decimal (never below the exact value)."""
        return math.ceil(self.bound_milli * 100 * 10**6 / self.capacity_milli) / 10**6


def _shape_key(task: Task) -> tuple[int, int, int, int, tuple[str, ...]]:
    return (task.cpu_milli, task.memory_mib, task.gpu_count, task.gpu_milli, task.gpu_spec)


def upper_bound(node_specs: Sequence[NodeSpec], arrivals: Sequence[Task]) -> Bound:
    """An upper bound on the GPU milli any policy holds after `arrivals` on the empty cluster `node_specs`."""
    from scipy.optimize import linprog  # the sim extra; the extender's image does not ship scipy
    from scipy.sparse import coo_array

    started = time.perf_counter()
    classes = node_classes(node_specs)
    capacity = sum(c.count * c.gpu_count for c in classes) * MILLI_PER_GPU
    arrived = sum(task.gpu_milli_total for task in arrivals)
    # CPU-only tasks allocate no GPU and only take resources: an optimum needs none of them
    shapes = Counter(_shape_key(task) for task in arrivals if task.gpu_milli_total)
    representative = {_shape_key(task): task for task in arrivals}
    keys = sorted(shapes)

    # rows: per class cpu, memory, GPU milli, one per DFF threshold
    per_class = 3 + len(DFF_THRESHOLDS)
    caps: list[int] = []
    for c in classes:
        gpu_cap = c.count * c.gpu_count * MILLI_PER_GPU
        caps += [c.count * c.cpu_milli, c.count * c.memory_mib, gpu_cap] + [gpu_cap] * len(DFF_THRESHOLDS)
    n_class_rows = len(caps)

    # columns: (shape, class) pairs where one empty node of the class hosts the shape
    columns: list[tuple[int, int]] = []
    coefficients: list[dict[int, int]] = []  # row -> coefficient, class rows only
    for t, key in enumerate(keys):
        task = representative[key]
        for ci, c in enumerate(classes):
            if not c.hosts(task):
                continue
            base = ci * per_class
            row = {base: task.cpu_milli, base + 1: task.memory_mib, base + 2: task.gpu_milli_total}
            for k, threshold in enumerate(DFF_THRESHOLDS):
                row[base + 3 + k] = task.gpu_count * dff(task.gpu_milli, threshold)
            columns.append((t, ci))
            coefficients.append(row)

    lp_value = 0.0
    prices: list[float] = [0.0] * n_class_rows
    if columns:
        data: list[float] = []
        rows: list[int] = []
        cols: list[int] = []
        for j, (t, _) in enumerate(columns):
            for r, value in coefficients[j].items():
                if value:
                    rows.append(r)
                    cols.append(j)
                    data.append(float(value))
            rows.append(n_class_rows + t)  # availability of the shape
            cols.append(j)
            data.append(1.0)
        a_ub = coo_array((data, (rows, cols)), shape=(n_class_rows + len(keys), len(columns))).tocsr()
        b_ub = [float(cap) for cap in caps] + [float(shapes[key]) for key in keys]
        objective = [-float(representative[keys[t]].gpu_milli_total) for t, _ in columns]
        result = linprog(objective, A_ub=a_ub, b_ub=b_ub, bounds=(0, None), method="highs")
        if result.status != 0:
            raise RuntimeError(f"bound LP failed: {result.message}")
        lp_value = -float(result.fun)
        # marginals of <= rows of a minimisation are <= 0; the prices of the maximisation are their negation
        prices = [max(0.0, -float(m)) for m in result.ineqlin.marginals[:n_class_rows]]

    return Bound(
        bound_milli=dual_value(caps, prices, keys, shapes, columns, coefficients, representative),
        lp_milli=lp_value,
        capacity_milli=capacity,
        arrived_milli=arrived,
        seconds=time.perf_counter() - started,
    )


def dual_value(
    caps: Sequence[int],
    prices: Sequence[float],
    keys: Sequence[tuple[int, int, int, int, tuple[str, ...]]],
    shapes: Counter[tuple[int, int, int, int, tuple[str, ...]]],
    columns: Sequence[tuple[int, int]],
    coefficients: Sequence[dict[int, int]],
    representative: dict[tuple[int, int, int, int, tuple[str, ...]], Task],
) -> Fraction:
    """The LP dual objective at class-row prices `prices` (>= 0) with the best shape prices for them, in exact
    arithmetic: an upper bound on the LP (and so on any packing) whatever the prices are."""
    # any prices >= 0 are valid; simple fractions near the solver's keep an exact optimum exact (1200, not 1200.0001)
    rho = [Fraction(p).limit_denominator(10**6) for p in prices]
    best_margin = [Fraction(0)] * len(keys)  # pi_t = max(0, max_c (g_t - sum_r A_r rho_r))
    for (t, _), row in zip(columns, coefficients, strict=True):
        cost = sum((value * rho[r] for r, value in row.items()), Fraction(0))
        margin = representative[keys[t]].gpu_milli_total - cost
        if margin > best_margin[t]:
            best_margin[t] = margin
    return sum((cap * price for cap, price in zip(caps, rho, strict=True)), Fraction(0)) + sum(
        (shapes[key] * best_margin[t] for t, key in enumerate(keys)), Fraction(0)
    )


def prefix_through(arrivals: Sequence[Task], capacity_milli: int, pct: int) -> list[Task] | None:
    """The arrivals up to the last event whose arrived % rounds to `pct` (metrics.bucket, the metric's own
    rounding), None when no event does (the metric has no value there). Every event of the bucket lies in this
    prefix and allocation only grows, so a bound on the prefix bounds the metric at `pct`."""
    arrived = 0
    end: int | None = None
    for index, task in enumerate(arrivals, start=1):
        arrived += task.gpu_milli_total
        point = bucket(arrived, capacity_milli)
        if point == pct:
            end = index
        elif point > pct:
            break
    return None if end is None else list(arrivals[:end])


def offline_order(arrivals: Sequence[Task]) -> list[Task]:
    """The GPU tasks of `arrivals` largest first (GPU count, then share, then least CPU): first-fit decreasing's
    order. CPU-only tasks are left out (they only take resources)."""
    return sorted(
        (task for task in arrivals if task.gpu_milli_total),
        key=lambda task: (-task.gpu_count, -task.gpu_milli, task.cpu_milli),
    )


def cpu_rich_first(node_specs: Sequence[NodeSpec], arrivals: Sequence[Task], make: Callable[[], Policy]) -> int:
    """GPU milli of an offline packing that sends CPU-hungry tasks to CPU-rich nodes: node classes are filled in
    falling order of CPU per GPU, each task going to the first class that takes it; whole-GPU tasks first (most
    GPUs, then most CPU first), then sharing tasks (largest share, then most CPU first)."""
    groups: dict[tuple[int, int, int, str], list[NodeSpec]] = {}
    for spec in node_specs:
        if spec.gpu_count:
            groups.setdefault((spec.cpu_milli, spec.memory_mib, spec.gpu_count, spec.model), []).append(spec)
    order = sorted(groups, key=lambda key: (-key[0] / key[2], key))
    clusters = [Cluster(groups[key], make(), seed=0) for key in order]
    whole = sorted(
        (t for t in arrivals if t.gpu_count and t.gpu_milli >= MILLI_PER_GPU),
        key=lambda t: (-t.gpu_count, -t.cpu_milli),
    )
    share = sorted(
        (t for t in arrivals if t.gpu_count and t.gpu_milli < MILLI_PER_GPU), key=lambda t: (-t.gpu_milli, -t.cpu_milli)
    )
    allocated = 0
    for task in whole + share:
        for cluster in clusters:
            if cluster.place(task) is not None:
                allocated += task.gpu_milli_total
                break
    return allocated


def offline_packing(node_specs: Sequence[NodeSpec], arrivals: Sequence[Task], make: Callable[[], Policy]) -> int:
    """GPU milli of a real packing of a subset of `arrivals`, found offline: the better of first-fit decreasing
    (a fresh `make()` policy placing `offline_order`) and `cpu_rich_first`. A LOWER bound on the offline optimum
    that `upper_bound` bounds from above. Both go through the simulator's engine, so they obey every fit rule."""
    ordered = offline_order(arrivals)
    if not ordered:
        return 0
    decreasing = simulate(node_specs, ordered, make(), seed=0).allocated_milli[-1]
    return max(decreasing, cpu_rich_first(node_specs, arrivals, make))
