"""The churn protocol: tasks arrive at their trace `creation_time` and leave at their `deletion_time`.

Replayed in time order on a cluster sized below the trace's peak GPU demand (`size_cluster`), with the same
placement engine and policies as the arrivals-only protocol (`engine.Cluster`). What kube-scheduler does around
an extender is modelled as follows:

* At each instant, first the departures (a running task frees exactly what it took; a pending one gives up),
  then, if anything was freed, every pending task is retried oldest first (kube-scheduler requeues
  unschedulable pods on a cluster event and pops them by arrival; there is no head-of-line blocking: one that
  still does not fit waits, the next is tried), then the arrivals of that instant in trace order. A task that
  does not fit when it arrives waits; it is placed at the first retry it fits, or never, if its deletion time
  comes first. A task placed late still leaves at its deletion time.
* Tasks with deletion_time <= creation_time exist for no time and are skipped (counted in `skipped`).

Metrics (all over [first creation, last deletion] of the replayed tasks):
* `alloc_pct`: time-averaged allocated GPU as % of capacity;
* `ceiling_pct`: time-averaged min(capacity, GPU asked by the tasks alive at that time), % of capacity. No
  policy can allocate more than the GPU of the live tasks, nor more than the cluster, so this bounds alloc_pct;
* `alloc_pct_when_full`: allocated % averaged over the time during which the live tasks ask more GPU than the
  cluster has (the only time when placement quality shows);
* `never_placed` (`never_placed_gpu`: GPU tasks only), `delayed` (placed after waiting), `pending_mean_s`: mean
  time from creation to placement (to deletion for tasks never placed), over all replayed tasks.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kube_vgpu.dev.simulator.engine import GPU_CORES, Cluster
from kube_vgpu.dev.simulator.trace import NodeSpec, TimedTask
from kube_vgpu.extender.engine.model import Placement
from kube_vgpu.extender.engine.policies import Policy


def peak_gpu_demand(timed: Sequence[TimedTask]) -> int:
    """The most GPU milli asked by tasks alive at one time ([created, deleted); departures first)."""
    events: list[tuple[int, int]] = []
    for item in timed:
        if item.deleted > item.created and item.task.gpu_milli_total:
            events.append((item.created, item.task.gpu_milli_total))
            events.append((item.deleted, -item.task.gpu_milli_total))
    events.sort()  # at equal times the negative (departure) sorts first
    alive = peak = 0
    for _, delta in events:
        alive += delta
        peak = max(peak, alive)
    return peak


def size_cluster(
    node_specs: Sequence[NodeSpec], timed: Sequence[TimedTask], fraction: float, seed: int
) -> list[NodeSpec]:
    """GPU nodes drawn in a seeded random order until their GPU capacity reaches `fraction` x the trace's peak
    GPU demand (fraction < 1: demand exceeds the cluster at peak)."""
    target = fraction * peak_gpu_demand(timed)
    order = [spec for spec in node_specs if spec.gpu_count]
    random.Random(seed).shuffle(order)
    chosen: list[NodeSpec] = []
    capacity = 0
    for spec in order:
        if chosen and capacity >= target:
            break
        chosen.append(spec)
        capacity += spec.gpu_count * GPU_CORES
    return chosen


@dataclass
class ChurnResult:
    seed: int
    capacity_milli: int
    nodes: int
    span_s: int
    tasks: int
    skipped: int
    alloc_pct: float
    ceiling_pct: float
    alloc_pct_when_full: float | None  # None: the live tasks never asked more than the cluster
    full_fraction: float  # share of the span during which they did
    placed_on_arrival: int
    delayed: int
    never_placed: int
    never_placed_gpu: int
    pending_mean_s: float
    seconds: float
    #: per task (trace order of the replayed ones): placement time, or None if never placed
    placed_at: list[int | None]
    #: (time, allocated milli) after each instant's events
    allocation: list[tuple[int, int]]
    #: CPU milli, memory MiB, GPU cores and vGPUs still in use on the nodes after the replay (every task left: 0s)
    final_usage: tuple[int, int, int, int] = (0, 0, 0, 0)

    def to_json(self) -> dict[str, Any]:
        return {
            "seed": self.seed,
            "capacity_milli": self.capacity_milli,
            "nodes": self.nodes,
            "span_s": self.span_s,
            "tasks": self.tasks,
            "skipped": self.skipped,
            "alloc_pct": self.alloc_pct,
            "ceiling_pct": self.ceiling_pct,
            "alloc_pct_when_full": self.alloc_pct_when_full,
            "full_fraction": self.full_fraction,
            "placed_on_arrival": self.placed_on_arrival,
            "delayed": self.delayed,
            "never_placed": self.never_placed,
            "never_placed_gpu": self.never_placed_gpu,
            "pending_mean_s": self.pending_mean_s,
            "seconds": round(self.seconds, 3),
        }


# complexity: one event loop (departures, retries, arrivals, integrals) kept in one place on purpose
def replay(
    node_specs: Sequence[NodeSpec], timed: Sequence[TimedTask], policy: Policy, *, seed: int, tie_break: str = "order"
) -> ChurnResult:
    """Replay `timed` in time order on an empty cluster of `node_specs` (see the module docstring)."""
    started = time.perf_counter()
    cluster = Cluster(node_specs, policy, seed=seed, tie_break=tie_break)
    capacity = cluster.capacity
    live = [item for item in timed if item.deleted > item.created]
    skipped = len(timed) - len(live)
    arrivals = sorted(range(len(live)), key=lambda i: (live[i].created, i))
    departures = sorted(range(len(live)), key=lambda i: (live[i].deleted, i))
    where: dict[int, tuple[int, Placement]] = {}  # running task -> (node index, placement)
    pending: dict[int, None] = {}  # waiting tasks, oldest first
    placed_at: list[int | None] = [None] * len(live)
    allocation: list[tuple[int, int]] = []

    allocated = alive = 0  # GPU milli placed; GPU milli asked by tasks alive (running or waiting)
    alloc_area = ceiling_area = full_alloc_area = full_time = 0
    start = live[arrivals[0]].created if live else 0
    last = start
    ai = di = 0
    while ai < len(arrivals) or di < len(departures):
        # every task departs after it arrives, so departures outlast arrivals: di < len(departures) here
        now = live[departures[di]].deleted
        if ai < len(arrivals):
            now = min(now, live[arrivals[ai]].created)
        # integrate the state that held on [last, now)
        span = now - last
        alloc_area += allocated * span
        ceiling_area += min(alive, capacity) * span
        if alive > capacity:
            full_alloc_area += allocated * span
            full_time += span
        last = now

        freed = False
        while di < len(departures) and live[departures[di]].deleted == now:
            index = departures[di]
            di += 1
            alive -= live[index].task.gpu_milli_total
            if index in where:
                node, placement = where.pop(index)
                cluster.release(node, live[index].task, placement)
                allocated -= live[index].task.gpu_milli_total
                freed = True
            else:
                pending.pop(index, None)  # it waited all its life: gives up
        if freed and pending:
            failed_shapes: set[tuple[Any, ...]] = set()  # within one pass resources only shrink
            for index in list(pending):
                task = live[index].task
                if task.key in failed_shapes:
                    continue
                hit = cluster.place(task, observe=False)
                if hit is None:
                    failed_shapes.add(task.key)
                    continue
                del pending[index]
                where[index] = hit
                placed_at[index] = now
                allocated += task.gpu_milli_total
        while ai < len(arrivals) and live[arrivals[ai]].created == now:
            index = arrivals[ai]
            ai += 1
            task = live[index].task
            alive += task.gpu_milli_total
            hit = cluster.place(task)
            if hit is None:
                pending[index] = None
            else:
                where[index] = hit
                placed_at[index] = now
                allocated += task.gpu_milli_total
        allocation.append((now, allocated))

    total_span = last - start
    pending_total = 0
    delayed = never = never_gpu = 0
    for index, item in enumerate(live):
        at = placed_at[index]
        if at is None:
            never += 1
            never_gpu += 1 if item.task.gpu_milli_total else 0
            pending_total += item.deleted - item.created
        else:
            pending_total += at - item.created
            delayed += 1 if at > item.created else 0
    scale = 100.0 / capacity if capacity else 0.0
    return ChurnResult(
        seed=seed,
        capacity_milli=capacity,
        nodes=len(node_specs),
        span_s=total_span,
        tasks=len(live),
        skipped=skipped,
        alloc_pct=alloc_area * scale / total_span if total_span else 0.0,
        ceiling_pct=ceiling_area * scale / total_span if total_span else 0.0,
        alloc_pct_when_full=full_alloc_area * scale / full_time if full_time else None,
        full_fraction=full_time / total_span if total_span else 0.0,
        placed_on_arrival=len(live) - never - delayed,
        delayed=delayed,
        never_placed=never,
        never_placed_gpu=never_gpu,
        pending_mean_s=pending_total / len(live) if live else 0.0,
        seconds=time.perf_counter() - started,
        placed_at=placed_at,
        allocation=allocation,
        final_usage=(
            sum(node.cpu_milli_used for node in cluster.nodes),
            sum(node.memory_mib_used for node in cluster.nodes),
            sum(gpu.used_cores for node in cluster.nodes for gpu in node.gpus),
            sum(gpu.used_vgpus for node in cluster.nodes for gpu in node.gpus),
        ),
    )
