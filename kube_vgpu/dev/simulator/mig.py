"""MIG layout placement on a cluster of MIG-capable GPUs partitioned on demand (dynamic MIG), trace-driven.

Workload: the openb traces' GPU tasks (Weng et al., ATC'23; METHOD.md), each turned into the smallest MIG profile
of the GPU model that gives it at least its share of both compute and memory: a task asking `gpu_milli` of a GPU
needs ceil(gpu_milli x 7 / 1000) compute slices and ceil(gpu_milli x 8 / 1000) memory slots (openb's share is of
the whole GPU, compute and memory alike). On A100-80GB that maps openb `default` to mostly 7g.80gb (whole GPUs and
shares above 4/7), then 4g.40gb, 3g.40gb, 2g.20gb and a few 1g.10gb. A k-GPU task takes k whole GPUs (7g) of one
node. CPU-only tasks ask nothing here and are left out; CPU and host memory are not modelled (the question is the
GPUs' slot layout).

Protocol (METHOD.md's, in MIG units): the cluster starts with every GPU unpartitioned; per seed, shuffle the
trace's GPU tasks, then draw tasks uniformly with replacement until the asked compute slices reach `inflate` x the
cluster's (7 per GPU); tasks never leave; one that fits nowhere is dropped. Metric: allocated compute slices as %
of the cluster's, against arrived %, at arrived 100 and 130.

Every policy sees the same arrivals; single-GPU asks go through the layout policy under test
(kube_vgpu.extender.engine.mig_layout), multi-GPU asks take the node with the fewest empty GPUs that has enough
(the same rule for every policy, so the comparison is of the layout choices alone).
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass

from kube_vgpu.dev.simulator.metrics import curve
from kube_vgpu.dev.simulator.trace import Task, TimedTask
from kube_vgpu.extender.engine.mig_layout import MigLayoutPolicy, make_layout_policy, placement_mask
from kube_vgpu.extender.engine.shares import MILLI_PER_GPU
from kube_vgpu.protocol.mig import MIG_COMPUTE_SLICES, MIG_MEMORY_SLOTS, MigModel, MigProfile


@dataclass(frozen=True, slots=True)
class MigAsk:
    profile: MigProfile
    gpu_count: int  # > 1 only for whole GPUs (7g)

    @property
    def compute_slices(self) -> int:
        return self.profile.compute_slices * self.gpu_count


def smallest_profile(model: MigModel, gpu_milli: int) -> MigProfile:
    """The smallest profile (compute, then memory) with at least the task's share of compute and of memory."""
    compute = math.ceil(gpu_milli * MIG_COMPUTE_SLICES / MILLI_PER_GPU)
    memory = math.ceil(gpu_milli * MIG_MEMORY_SLOTS / MILLI_PER_GPU)
    fitting = [p for p in model.profiles if not p.name.endswith("+me")
               and p.compute_slices >= compute and p.memory_slices >= memory]
    return min(fitting, key=lambda p: (p.compute_slices, p.memory_slices))


def mig_asks(tasks: Sequence[Task], model: MigModel) -> list[MigAsk]:
    """The trace's GPU tasks as MIG asks on `model` (CPU-only tasks are left out)."""
    whole = smallest_profile(model, MILLI_PER_GPU)
    asks = []
    for task in tasks:
        if not task.gpu_count:
            continue
        if task.gpu_count > 1:
            asks.append(MigAsk(whole, task.gpu_count))
        else:
            asks.append(MigAsk(smallest_profile(model, task.gpu_milli), 1))
    return asks


def mig_arrivals(asks: Sequence[MigAsk], capacity_slices: int, seed: int, inflate: float = 1.3) -> list[MigAsk]:
    """METHOD.md step 2 in compute slices: shuffle, then draw with replacement up to inflate x capacity (stopping
    at the first draw that would pass it), or drop random asks when the shuffled trace already asks more."""
    rng = random.Random(seed)
    order = list(asks)
    rng.shuffle(order)
    target = inflate * capacity_slices
    total = sum(ask.compute_slices for ask in order)
    while total > target and order:
        total -= order.pop(rng.randrange(len(order))).compute_slices
    while asks:
        ask = asks[rng.randrange(len(asks))]
        if total + ask.compute_slices > target:
            break
        order.append(ask)
        total += ask.compute_slices
    return order


@dataclass(frozen=True, slots=True)
class MigRunResult:
    policy: str
    seed: int
    curve: dict[int, float]
    placed: int
    failed: int
    seconds: float
    occupied_masks: tuple[int, ...]  # the final layout, for checks


def simulate_mig(
    model: MigModel, nodes: int, gpus_per_node: int, arrivals: Sequence[MigAsk], policy: MigLayoutPolicy,
    seed: int = 0,
) -> MigRunResult:
    started = time.perf_counter()
    cluster = _MigCluster(nodes * gpus_per_node, gpus_per_node, policy)
    capacity = len(cluster.masks) * MIG_COMPUTE_SLICES
    arrived = allocated = placed = failed = 0
    arrived_curve: list[int] = []
    allocated_curve: list[int] = []
    for index, ask in enumerate(arrivals):
        policy.observe(ask.profile)
        arrived += ask.compute_slices
        if cluster.place(index, ask):
            allocated += ask.compute_slices
            placed += 1
        else:
            failed += 1
        arrived_curve.append(arrived)
        allocated_curve.append(allocated)
    return MigRunResult(policy.name, seed, curve(arrived_curve, allocated_curve, capacity), placed, failed,
                        time.perf_counter() - started, tuple(cluster.masks))


def _whole_gpus_node(masks: Sequence[int], gpus_per_node: int, count: int) -> int | None:
    """The node with the fewest empty GPUs among those with at least `count` (ties: lowest index)."""
    best: tuple[int, int] | None = None
    for node in range(len(masks) // gpus_per_node):
        first = node * gpus_per_node
        empty = sum(1 for gpu in range(first, first + gpus_per_node) if not masks[gpu])
        if empty >= count and (best is None or (empty, node) < best):
            best = (empty, node)
    return None if best is None else best[1]


def run_mig_experiment(
    model: MigModel, tasks: Sequence[Task], policy_name: str, seed: int, nodes: int, gpus_per_node: int = 8,
    inflate: float = 1.3,
) -> MigRunResult:
    asks = mig_asks(tasks, model)
    arrivals = mig_arrivals(asks, nodes * gpus_per_node * MIG_COMPUTE_SLICES, seed, inflate)
    return simulate_mig(model, nodes, gpus_per_node, arrivals, make_layout_policy(policy_name, model), seed)


# --- churn: instances created when a task arrives (or later, when it fits) and destroyed when it leaves ------------


@dataclass(frozen=True, slots=True)
class TimedMigAsk:
    ask: MigAsk
    created: int
    deleted: int


def timed_mig_asks(timed: Sequence[TimedTask], model: MigModel) -> list[TimedMigAsk]:
    """The trace's GPU tasks with their lifetimes (tasks that live no time are left out)."""
    asks = mig_asks([item.task for item in timed], model)
    gpu_items = [item for item in timed if item.task.gpu_count]
    return [TimedMigAsk(ask, item.created, item.deleted)
            for ask, item in zip(asks, gpu_items, strict=True) if item.deleted > item.created]


def peak_slices(timed: Sequence[TimedMigAsk]) -> int:
    """The most compute slices asked by asks alive at one time (departures first at equal times)."""
    events = sorted([(item.created, item.ask.compute_slices) for item in timed]
                    + [(item.deleted, -item.ask.compute_slices) for item in timed])
    alive = peak = 0
    for _, delta in events:
        alive += delta
        peak = max(peak, alive)
    return peak


@dataclass(frozen=True, slots=True)
class MigChurnResult:
    policy: str
    gpus: int
    alloc_pct: float  # time-averaged allocated compute slices, % of the cluster's
    alloc_pct_when_full: float | None  # the same over the time the live asks exceed the cluster
    never_placed: int
    pending_mean_s: float
    final_masks: tuple[int, ...]  # after the replay every instance is gone: all 0


class _MigCluster:
    """GPU layouts (occupied masks, node-major) and which slots each running ask holds."""

    __slots__ = ("gpus_per_node", "held", "masks", "policy")

    def __init__(self, gpus: int, gpus_per_node: int, policy: MigLayoutPolicy) -> None:
        self.masks = [0] * gpus
        self.gpus_per_node = gpus_per_node
        self.policy = policy
        self.held: dict[int, list[tuple[int, int]]] = {}  # running ask -> [(gpu, mask bits)]

    def place(self, key: int, ask: MigAsk) -> bool:
        masks = self.masks
        if ask.gpu_count == 1:
            choice = self.policy.choose(ask.profile, masks)
            if choice is None:
                return False
            bits = placement_mask(ask.profile, choice.start)
            masks[choice.gpu] |= bits
            self.held[key] = [(choice.gpu, bits)]
            return True
        node = _whole_gpus_node(masks, self.gpus_per_node, ask.gpu_count)
        if node is None:
            return False
        first = node * self.gpus_per_node
        empty = [gpu for gpu in range(first, first + self.gpus_per_node) if not masks[gpu]][:ask.gpu_count]
        bits = placement_mask(ask.profile, 0)
        for gpu in empty:
            masks[gpu] = bits
        self.held[key] = [(gpu, bits) for gpu in empty]
        return True

    def release(self, key: int) -> bool:
        """Free what `key` holds; False when it holds nothing (it never ran)."""
        slots = self.held.pop(key, None)
        for gpu, bits in slots or ():
            self.masks[gpu] &= ~bits
        return slots is not None


def replay_mig_churn(
    timed: Sequence[TimedMigAsk], nodes: int, gpus_per_node: int, policy: MigLayoutPolicy
) -> MigChurnResult:
    """churn.replay's event order on MIG layouts: at each instant the departures (an instance frees exactly its
    slots), then pending asks oldest first if anything was freed, then the arrivals; an ask that does not fit
    waits until it fits or its deletion time comes."""
    cluster = _MigCluster(nodes * gpus_per_node, gpus_per_node, policy)
    capacity = len(cluster.masks) * MIG_COMPUTE_SLICES
    arrivals = sorted(range(len(timed)), key=lambda i: (timed[i].created, i))
    departures = sorted(range(len(timed)), key=lambda i: (timed[i].deleted, i))
    pending: dict[int, None] = {}
    placed_at: dict[int, int] = {}
    allocated = alive = 0
    alloc_area = full_alloc_area = full_time = 0
    start = last = timed[arrivals[0]].created if timed else 0

    ai = di = 0
    while di < len(departures):
        now = timed[departures[di]].deleted
        if ai < len(arrivals):
            now = min(now, timed[arrivals[ai]].created)
        span = now - last
        alloc_area += allocated * span
        if alive > capacity:
            full_alloc_area += allocated * span
            full_time += span
        last = now
        freed = False
        while di < len(departures) and timed[departures[di]].deleted == now:
            index = departures[di]
            di += 1
            alive -= timed[index].ask.compute_slices
            if cluster.release(index):
                allocated -= timed[index].ask.compute_slices
                freed = True
            else:
                pending.pop(index, None)
        if freed and pending:
            failed: set[tuple[str, int]] = set()  # within one pass free slots only shrink
            for index in list(pending):
                ask = timed[index].ask
                key = (ask.profile.name, ask.gpu_count)
                if key in failed:
                    continue
                if not cluster.place(index, ask):
                    failed.add(key)
                    continue
                del pending[index]
                placed_at[index] = now
                allocated += ask.compute_slices
        while ai < len(arrivals) and timed[arrivals[ai]].created == now:
            index = arrivals[ai]
            ai += 1
            ask = timed[index].ask
            policy.observe(ask.profile)
            alive += ask.compute_slices
            if cluster.place(index, ask):
                placed_at[index] = now
                allocated += ask.compute_slices
            else:
                pending[index] = None
    total = last - start
    waits = [placed_at.get(i, timed[i].deleted) - timed[i].created for i in range(len(timed))]
    return MigChurnResult(
        policy=policy.name,
        gpus=len(cluster.masks),
        alloc_pct=100.0 * alloc_area / (capacity * total) if total else 0.0,
        alloc_pct_when_full=100.0 * full_alloc_area / (capacity * full_time) if full_time else None,
        never_placed=len(timed) - len(placed_at),
        pending_mean_s=sum(waits) / len(waits) if waits else 0.0,
        final_masks=tuple(cluster.masks),
    )


def run_mig_churn(
    model: MigModel, timed: Sequence[TimedTask], policy_name: str, fraction: float, gpus_per_node: int = 8
) -> MigChurnResult:
    """The churn replay on a cluster of `gpus_per_node`-GPU nodes with `fraction` x the trace's peak demand."""
    asks = timed_mig_asks(timed, model)
    nodes = max(1, math.ceil(fraction * peak_slices(asks) / MIG_COMPUTE_SLICES / gpus_per_node))
    return replay_mig_churn(asks, nodes, gpus_per_node, make_layout_policy(policy_name, model))
