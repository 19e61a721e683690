"""Experiments (trace x policy x seed) run in worker processes, and their aggregation over seeds."""

from __future__ import annotations

import inspect
import json
import multiprocessing
import os
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from kube_vgpu.dev.simulator.bound import offline_packing, prefix_through, upper_bound
from kube_vgpu.dev.simulator.churn import ChurnResult, replay, size_cluster
from kube_vgpu.dev.simulator.engine import GPU_CORES, simulate
from kube_vgpu.dev.simulator.metrics import curve, mean_curve
from kube_vgpu.dev.simulator.trace import (
    NodeSpec,
    Task,
    TimedTask,
    arrival_sequence,
    load_nodes,
    load_tasks,
    load_timed_tasks,
    trace_name,
)
from kube_vgpu.extender.engine.fragmentation import WeightedShapes, typical_shapes
from kube_vgpu.extender.engine.policies import DEFAULT_NODE_POLICY, Policy, make_policy, policy_names

DEFAULT_SEEDS = tuple(range(42, 52))


@dataclass(frozen=True)
class Job:
    node_csv: str
    pod_csv: str
    policy: str
    seed: int
    inflate: float = 1.3
    tie_break: str = "order"


@dataclass
class ExperimentResult:
    job: Job
    curve: dict[int, float]
    frag_at_100: float | None
    seconds: float
    tasks: int
    placed: int
    failed: int
    engine_calls: int

    def to_json(self) -> dict[str, Any]:
        """What `bench/results` stores of one experiment: everything but the wall time, numbers as computed
        (a re-run on the same code gives the same object exactly)."""
        return {
            "trace": trace_name(self.job.pod_csv),
            "policy": self.job.policy,
            "seed": self.job.seed,
            "inflate": self.job.inflate,
            "tie_break": self.job.tie_break,
            "tasks": self.tasks,
            "placed": self.placed,
            "failed": self.failed,
            "alloc_at_100": self.curve.get(100),
            "alloc_at_130": self.curve.get(130),
            "frag_at_100": self.frag_at_100,
            "curve": [[arrived, alloc] for arrived, alloc in sorted(self.curve.items())],
        }


def stored_path(root: Path, job: Job) -> Path:
    """Where `bench/results/openb` keeps one experiment: <root>/<trace>/<policy>/<seed>.json."""
    return root / trace_name(job.pod_csv) / job.policy / f"{job.seed}.json"


def load_stored(root: Path, job: Job) -> ExperimentResult:
    """A stored experiment (`store`) as a result again (no wall time or engine calls)."""
    data = json.loads(stored_path(root, job).read_text())
    return ExperimentResult(
        job=job,
        curve={int(arrived): alloc for arrived, alloc in data["curve"]},
        frag_at_100=data["frag_at_100"],
        seconds=0.0,
        tasks=data["tasks"],
        placed=data["placed"],
        failed=data["failed"],
        engine_calls=0,
    )


def store(root: Path, result: ExperimentResult) -> Path:
    path = stored_path(root, result.job)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result.to_json(), separators=(",", ":")) + "\n")
    return path


@dataclass
class PolicySummary:
    policy: str
    trace: str
    seeds: list[int]
    alloc_at_100: float | None
    alloc_at_130: float | None
    alloc_at_100_per_seed: list[float | None]
    alloc_at_130_per_seed: list[float | None]
    frag_at_100: float | None
    curve: list[tuple[int, float]]
    seconds: float  # mean wall seconds per experiment
    tie_break: str
    inflate: float
    per_seed_curves: list[dict[int, float]] = field(default_factory=list, repr=False)

    def to_json(self) -> dict[str, Any]:
        return {
            "policy": self.policy,
            "trace": self.trace,
            "seeds": self.seeds,
            "alloc_at_100": self.alloc_at_100,
            "alloc_at_130": self.alloc_at_130,
            "alloc_at_130_per_seed": self.alloc_at_130_per_seed,
            "alloc_at_100_per_seed": self.alloc_at_100_per_seed,
            "frag_at_100": self.frag_at_100,
            "curve": [[arrived, round(alloc, 4)] for arrived, alloc in self.curve],
            "seconds": round(self.seconds, 3),
            "tie_break": self.tie_break,
            "inflate": self.inflate,
        }


@dataclass
class BoundSummary:
    """The ceiling (bound.py) of each seed's arrivals: no policy allocates more at arrived = 100 / 130 %."""

    trace: str
    seeds: list[int]
    bound_at_100_per_seed: list[float | None]
    bound_at_130_per_seed: list[float | None]
    seconds: float  # mean wall seconds per seed (both LPs)
    #: an offline packing of the same arrivals (bound.offline_packing, a lower bound on the offline optimum)
    offline_policy: str | None = None
    offline_at_130_per_seed: list[float | None] = field(default_factory=list)

    @property
    def bound_at_100(self) -> float | None:
        return _mean(self.bound_at_100_per_seed)

    @property
    def bound_at_130(self) -> float | None:
        return _mean(self.bound_at_130_per_seed)

    @property
    def offline_at_130(self) -> float | None:
        return _mean(self.offline_at_130_per_seed)

    def to_json(self) -> dict[str, Any]:
        return {
            "policy": "bound",
            "trace": self.trace,
            "seeds": self.seeds,
            "alloc_at_100": self.bound_at_100,
            "alloc_at_130": self.bound_at_130,
            "alloc_at_100_per_seed": self.bound_at_100_per_seed,
            "alloc_at_130_per_seed": self.bound_at_130_per_seed,
            "seconds": round(self.seconds, 3),
            "offline_policy": self.offline_policy,
            "offline_at_130": self.offline_at_130,
            "offline_at_130_per_seed": self.offline_at_130_per_seed,
        }


def offline_for(job: Job, pct: int, policy: str) -> float | None:
    """% of capacity an offline packing (bound.offline_packing, `policy` choosing nodes) gets from the arrivals of the
    metric's bucket `pct`: the offline optimum is at least this."""
    nodes, _, shapes = _load(job.node_csv, job.pod_csv)
    capacity = sum(spec.gpu_count for spec in nodes) * GPU_CORES
    prefix = prefix_through(arrivals_for(job), capacity, pct)
    if prefix is None:
        return None
    name = resolve_policy_name(policy)
    return 100.0 * offline_packing(nodes, prefix, lambda: build_policy(name, shapes)) / capacity


def bound_for(job: Job, pct: int) -> float | None:
    """Upper bound (% of capacity) on the metric at arrived = pct % for the job's arrivals, None when no event
    falls in that bucket (then no policy has a value there either)."""
    nodes, _, _ = _load(job.node_csv, job.pod_csv)
    capacity = sum(spec.gpu_count for spec in nodes) * GPU_CORES
    prefix = prefix_through(arrivals_for(job), capacity, pct)
    return None if prefix is None else upper_bound(nodes, prefix).pct


def bound_summary(
    node_csv: str,
    pod_csv: str,
    seeds: Sequence[int],
    inflate: float = 1.3,
    *,
    offline_policy: str | None = None,
    offline_seeds: Sequence[int] = (),
) -> BoundSummary:
    started = time.perf_counter()
    at100: list[float | None] = []
    at130: list[float | None] = []
    for seed in seeds:
        job = Job(node_csv, pod_csv, "bound", seed, inflate)
        at100.append(bound_for(job, 100))
        at130.append(bound_for(job, 130))
    seconds = (time.perf_counter() - started) / max(1, len(seeds))
    offline = (
        [offline_for(Job(node_csv, pod_csv, "offline", seed, inflate), 130, offline_policy) for seed in offline_seeds]
        if offline_policy
        else []
    )
    return BoundSummary(
        trace=trace_name(pod_csv),
        seeds=list(seeds),
        bound_at_100_per_seed=at100,
        bound_at_130_per_seed=at130,
        seconds=seconds,
        offline_policy=offline_policy,
        offline_at_130_per_seed=offline,
    )


#: simulator names for a policy with options: name -> (registered policy, constructor options)
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    # bfgd breaking ties as the FGD reference (lowest-index GPU, no fill term): the first published table's bfgd
    "bfgd-ref": ("bfgd", {"reference_ties": True}),
}


def resolve_policy_name(name: str) -> str:
    """`default` is whatever the extender uses by default."""
    return DEFAULT_NODE_POLICY if name == "default" else name


def known_policy_names() -> list[str]:
    """What the simulator accepts: the registered policies and their VARIANTS."""
    return sorted({*policy_names(), *VARIANTS})


@lru_cache(maxsize=8)
def _load(node_csv: str, pod_csv: str) -> tuple[list[NodeSpec], list[Task], WeightedShapes]:
    tasks = load_tasks(pod_csv)
    return load_nodes(node_csv), tasks, typical_shapes(task.shape for task in tasks)


def build_policy(name: str, trace_shapes: WeightedShapes) -> Policy:
    """A fresh policy. Policies that take a target workload (`shapes`) get the whole trace's typical shapes,
    as the FGD paper gives its policy; policies that learn it online ignore them."""
    name, options = VARIANTS.get(name, (name, {}))
    probe = make_policy(name, **options)
    if "shapes" in inspect.signature(type(probe).__init__).parameters:
        return make_policy(name, shapes=trace_shapes, **options)
    return probe


# progress shared with worker processes (tasks done, all experiments together)
_progress_counter: Any = None


def _init_worker(counter: Any) -> None:
    global _progress_counter
    _progress_counter = counter


def _bump(count: int) -> None:
    if _progress_counter is not None and count:
        with _progress_counter.get_lock():
            _progress_counter.value += count


def arrivals_for(job: Job) -> list[Task]:
    nodes, tasks, _ = _load(job.node_csv, job.pod_csv)
    capacity = sum(spec.gpu_count for spec in nodes) * GPU_CORES
    return arrival_sequence(tasks, capacity, job.seed, job.inflate)


def run_experiment(job: Job) -> ExperimentResult:
    nodes, _, shapes = _load(job.node_csv, job.pod_csv)
    arrivals = arrivals_for(job)
    policy = build_policy(resolve_policy_name(job.policy), shapes)
    result = simulate(
        nodes, arrivals, policy, seed=job.seed, frag_shapes=shapes, progress=_bump, tie_break=job.tie_break
    )
    return ExperimentResult(
        job=job,
        curve=curve(result.arrived_milli, result.allocated_milli, result.capacity_milli),
        frag_at_100=result.frag_at_100,
        seconds=result.seconds,
        tasks=len(arrivals),
        placed=result.placed,
        failed=result.failed,
        engine_calls=result.engine_calls,
    )


class ProgressBar:
    """A one-line progress bar on stderr, drawn only when stderr is a terminal."""

    def __init__(self, total: int, label: str, enabled: bool | None = None) -> None:
        self.total = max(total, 1)
        self.label = label
        self.enabled = sys.stderr.isatty() if enabled is None else enabled
        self.started = time.monotonic()

    def draw(self, done: int, finished: int, experiments: int) -> None:
        if not self.enabled:
            return
        fraction = min(done / self.total, 1.0)
        width = 30
        filled = int(fraction * width)
        elapsed = time.monotonic() - self.started
        eta = elapsed / fraction - elapsed if fraction > 0.01 else 0.0
        sys.stderr.write(
            f"\r{self.label} [{'#' * filled}{'.' * (width - filled)}] {100 * fraction:5.1f}% "
            f"{finished}/{experiments} runs, {elapsed:5.0f}s elapsed, ~{eta:4.0f}s left "
        )
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")
            sys.stderr.flush()


def run_jobs(
    jobs: Sequence[Job],
    workers: int,
    *,
    progress: bool | None = None,
    on_result: Callable[[ExperimentResult], None] | None = None,
) -> list[ExperimentResult]:
    """Run experiments, `workers` at a time in separate processes (1: in this process)."""
    total_tasks = sum(len(arrivals_for(job)) for job in jobs)
    label = f"simulating {len(jobs)} run{'s' if len(jobs) != 1 else ''}"
    bar = ProgressBar(total_tasks, label, progress)
    results: list[ExperimentResult] = []
    context = multiprocessing.get_context("fork" if sys.platform != "win32" else "spawn")
    counter = context.Value("q", 0)
    if workers <= 1:
        _init_worker(counter)
        try:
            for job in jobs:
                result = run_experiment(job)
                results.append(result)
                if on_result:
                    on_result(result)
                bar.draw(counter.value, len(results), len(jobs))
        finally:
            _init_worker(None)
        bar.close()
        return results
    pool_options: dict[str, Any] = {"mp_context": context, "initializer": _init_worker, "initargs": (counter,)}
    with ProcessPoolExecutor(max_workers=workers, **pool_options) as pool:
        pending: set[Future[ExperimentResult]] = {pool.submit(run_experiment, job) for job in jobs}
        while pending:
            done, pending = wait(pending, timeout=0.5, return_when=FIRST_COMPLETED)
            for future in done:
                result = future.result()
                results.append(result)
                if on_result:
                    on_result(result)
            bar.draw(counter.value, len(results), len(jobs))
    bar.close()
    order = {job: index for index, job in enumerate(jobs)}
    results.sort(key=lambda r: order[r.job])
    return results


def summarise(results: Sequence[ExperimentResult]) -> list[PolicySummary]:
    """One summary per (trace, policy), means over seeds."""
    groups: dict[tuple[str, str], list[ExperimentResult]] = {}
    for result in results:
        groups.setdefault((result.job.pod_csv, result.job.policy), []).append(result)
    summaries = []
    for (pod_csv, policy), group in groups.items():
        group.sort(key=lambda r: r.job.seed)
        curves = [r.curve for r in group]
        at100 = [c.get(100) for c in curves]
        at130 = [c.get(130) for c in curves]
        frags = [r.frag_at_100 for r in group if r.frag_at_100 is not None]
        summaries.append(
            PolicySummary(
                policy=policy,
                trace=trace_name(pod_csv),
                seeds=[r.job.seed for r in group],
                alloc_at_100=_mean(at100),
                alloc_at_130=_mean(at130),
                alloc_at_100_per_seed=at100,
                alloc_at_130_per_seed=at130,
                frag_at_100=sum(frags) / len(frags) if frags else None,
                curve=sorted(mean_curve(curves).items()),
                seconds=sum(r.seconds for r in group) / len(group),
                tie_break=group[0].job.tie_break,
                inflate=group[0].job.inflate,
                per_seed_curves=curves,
            )
        )
    return summaries


@dataclass(frozen=True)
class ChurnJob:
    node_csv: str
    pod_csv: str
    policy: str
    seed: int
    capacity_of_peak: float = 0.5
    tie_break: str = "order"


@lru_cache(maxsize=8)
def _load_timed(node_csv: str, pod_csv: str) -> tuple[list[NodeSpec], list[TimedTask], WeightedShapes]:
    timed = load_timed_tasks(pod_csv)
    return load_nodes(node_csv), timed, typical_shapes(item.task.shape for item in timed)


def run_churn(job: ChurnJob) -> ChurnResult:
    """One churn replay (churn.py): the seed picks the cluster's nodes and the tie-break order."""
    nodes, timed, shapes = _load_timed(job.node_csv, job.pod_csv)
    cluster = size_cluster(nodes, timed, job.capacity_of_peak, job.seed)
    policy = build_policy(resolve_policy_name(job.policy), shapes)
    return replay(cluster, timed, policy, seed=job.seed, tie_break=job.tie_break)


def run_churn_jobs(jobs: Sequence[ChurnJob], workers: int) -> list[ChurnResult]:
    """Run churn replays, `workers` at a time in separate processes (1: in this process); results in job order."""
    if workers <= 1:
        return [run_churn(job) for job in jobs]
    context = multiprocessing.get_context("fork" if sys.platform != "win32" else "spawn")
    with ProcessPoolExecutor(max_workers=workers, mp_context=context) as pool:
        return list(pool.map(run_churn, jobs))


@dataclass
class ChurnSummary:
    """Means over seeds of one policy's churn replays."""

    policy: str
    trace: str
    seeds: list[int]
    capacity_of_peak: float
    capacity_gpus: float
    alloc_pct: float
    ceiling_pct: float
    alloc_pct_when_full: float | None
    full_fraction: float
    never_placed: float
    never_placed_gpu: float
    delayed: float
    pending_mean_s: float
    seconds: float
    alloc_pct_per_seed: list[float]
    never_placed_gpu_per_seed: list[int]

    def to_json(self) -> dict[str, Any]:
        return {"protocol": "churn", **asdict(self)}


def summarise_churn(jobs: Sequence[ChurnJob], results: Sequence[ChurnResult]) -> list[ChurnSummary]:
    groups: dict[tuple[str, str], list[tuple[ChurnJob, ChurnResult]]] = {}
    for job, result in zip(jobs, results, strict=True):
        groups.setdefault((job.pod_csv, job.policy), []).append((job, result))
    summaries = []
    for (pod_csv, policy), group in groups.items():
        group.sort(key=lambda pair: pair[0].seed)
        runs = [result for _, result in group]
        full = [r.alloc_pct_when_full for r in runs]
        summaries.append(
            ChurnSummary(
                policy=policy,
                trace=trace_name(pod_csv),
                seeds=[job.seed for job, _ in group],
                capacity_of_peak=group[0][0].capacity_of_peak,
                capacity_gpus=sum(r.capacity_milli for r in runs) / len(runs) / GPU_CORES,
                alloc_pct=sum(r.alloc_pct for r in runs) / len(runs),
                ceiling_pct=sum(r.ceiling_pct for r in runs) / len(runs),
                alloc_pct_when_full=_mean(full),
                full_fraction=sum(r.full_fraction for r in runs) / len(runs),
                never_placed=sum(r.never_placed for r in runs) / len(runs),
                never_placed_gpu=sum(r.never_placed_gpu for r in runs) / len(runs),
                delayed=sum(r.delayed for r in runs) / len(runs),
                pending_mean_s=sum(r.pending_mean_s for r in runs) / len(runs),
                seconds=sum(r.seconds for r in runs) / len(runs),
                alloc_pct_per_seed=[r.alloc_pct for r in runs],
                never_placed_gpu_per_seed=[r.never_placed_gpu for r in runs],
            )
        )
    return summaries


def _mean(values: Sequence[float | None]) -> float | None:
    if not values or any(v is None for v in values):
        return None
    return sum(v for v in values if v is not None) / len(values)


def default_workers() -> int:
    return max(1, min(2, os.cpu_count() or 1))
