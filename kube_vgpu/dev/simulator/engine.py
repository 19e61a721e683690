"""One experiment: place an arrival sequence on an empty cluster with the extender's placement engine.

Every decision goes through `extender.engine.fit.place` and the named policy, exactly as the extender's
filter + prioritize would; the simulator only adds what kube-scheduler adds: CPU / memory fit (check_host),
picking the best-scoring node with a uniformly random tie-break (kube-scheduler's selectHost), and committing
the placement.

Speed: the cluster is kept as groups of nodes in identical state (same hardware class, same CPU / memory /
per-GPU usage). A cacheable policy's result depends only on (node state, request, policy epoch), so each
(state, task shape) pair is placed once, on one representative node, and reused for every node in that state
until the policy's epoch changes. Only the node that received the last task changes state, so after warm-up
a task costs one dict lookup per distinct state plus a few engine calls.
"""

from __future__ import annotations

import bisect
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kube_vgpu.dev.simulator.trace import NodeSpec, Task
from kube_vgpu.extender.engine.fit import place
from kube_vgpu.extender.engine.fragmentation import FragModel, WeightedShapes, cluster_frag
from kube_vgpu.extender.engine.model import NodeState, Placement, PlacementRequest
from kube_vgpu.extender.engine.policies import Policy
from kube_vgpu.protocol import ContainerGpuRequest, GpuInfo, NodeInventory, PodGpuRequest

#: engine view of an openb GPU: 1000 "cores" = 1000 milli-GPU; memory is not asked by openb tasks
GPU_CORES = 1000
GPU_MAX_VGPUS = 1000  # never binds: the smallest openb share is several milli-GPU
#: nominal memory per model (only reported; openb tasks ask no GPU memory)
MODEL_MEMORY_MIB = {"T4": 15109, "P100": 16280, "V100M16": 16160, "V100M32": 32510, "A10": 22731}
DEFAULT_GPU_MEMORY_MIB = 16384


def build_node(spec: NodeSpec) -> NodeState:
    gpus = tuple(
        GpuInfo(
            uuid=f"{spec.name}-gpu{index}",
            index=index,
            model=spec.model,
            memory_mib=MODEL_MEMORY_MIB.get(spec.model, DEFAULT_GPU_MEMORY_MIB),
            cores=GPU_CORES,
            max_vgpus=GPU_MAX_VGPUS,
        )
        for index in range(spec.gpu_count)
    )
    return NodeState(
        spec.name,
        NodeInventory(gpus=gpus),
        cpu_milli_total=spec.cpu_milli,
        memory_mib_total=spec.memory_mib,
    )


def build_request(task: Task) -> PlacementRequest:
    containers: tuple[ContainerGpuRequest, ...] = ()
    if task.gpu_count:
        # cores >= GPU_CORES means a whole (idle) GPU, as the fit code compares against gpu.cores
        containers = (ContainerGpuRequest(name="main", count=task.gpu_count, memory_mib=0, cores=task.gpu_milli),)
    return PlacementRequest(
        gpu=PodGpuRequest(containers=containers),
        cpu_milli=task.cpu_milli,
        memory_mib=task.memory_mib,
        gpu_spec=task.gpu_spec,
        cores_per_gpu=GPU_CORES,  # cores are milli-GPU here, not percent
    )


@dataclass
class RunResult:
    """Per-event series (one event per task, in arrival order) and totals of one experiment."""

    seed: int
    capacity_milli: int
    arrived_milli: list[int]
    allocated_milli: list[int]
    placed: int = 0
    failed: int = 0
    seconds: float = 0.0
    #: fragmented milli-GPU (FGD measure, whole-trace typical shapes) as % of capacity at arrived = 100 %
    frag_at_100: float | None = None
    engine_calls: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


ProgressFn = Callable[[int], None]


class Cluster:
    """The simulated cluster: nodes kept as groups in identical state, placement through the engine and the
    policy (see the module docstring), commit and release. Shared by the arrivals-only protocol (`simulate`)
    and the churn protocol (`churn.replay`).

    tie_break: among the best-scoring nodes, "order" takes the first in a per-seed random order of the nodes
    (what the FGD reference simulator's scheduler does; its published numbers depend on it), "random" a
    uniformly random one (stock kube-scheduler's selectHost)."""

    def __init__(self, node_specs: Sequence[NodeSpec], policy: Policy, *, seed: int, tie_break: str = "order") -> None:
        self.policy = policy
        self.rng = random.Random(seed ^ 0x5EED)  # tie-breaks; independent of the arrival generator's stream
        self.nodes = [build_node(spec) for spec in node_specs]
        self.rank = list(range(len(self.nodes)))
        self.rng.shuffle(self.rank)
        # the random policy needs a uniform choice even where ties otherwise go by node order
        self.by_order = tie_break == "order" and not policy.random_tie_break
        self.capacity = sum(len(node.gpus) for node in self.nodes) * GPU_CORES
        self.uses_kinds = policy.uses_pod_kinds
        # hardware classes: nodes that are interchangeable when empty
        hw_ids: dict[tuple[Any, ...], int] = {}
        self.hw_of = [
            hw_ids.setdefault((s.cpu_milli, s.memory_mib, s.gpu_count, s.model), len(hw_ids)) for s in node_specs
        ]
        self.interned: dict[tuple[Any, ...], int] = {}
        self.members: dict[int, list[int]] = {}  # state id -> node indices in that state (insertion-ordered)
        self.memo: dict[int, dict[int, Any]] = {}  # state id -> task shape id -> Placement | FitFailure
        self.state_of = [0] * len(self.nodes)
        for index in range(len(self.nodes)):
            self._enter(index)
        self.shape_ids: dict[tuple[Any, ...], int] = {}
        self.requests: list[PlacementRequest] = []
        self.cacheable = policy.cacheable
        self.epoch = policy.epoch()
        self.calls = 0

    def _state_key(self, index: int) -> tuple[Any, ...]:
        node = self.nodes[index]
        gpus = node.gpus
        return (
            self.hw_of[index],
            node.cpu_milli_used,
            node.memory_mib_used,
            tuple([g.used_cores for g in gpus]),
            tuple([g.used_vgpus for g in gpus]),
            tuple([g.used_memory_mib for g in gpus]),
            tuple([g.exclusive_holders for g in gpus]),
            tuple(sorted(node.pod_kinds.items())) if self.uses_kinds else (),
        )

    def _enter(self, index: int) -> None:
        key = self._state_key(index)
        sid = self.interned.get(key)
        if sid is None:
            sid = self.interned[key] = len(self.interned)
        self.state_of[index] = sid
        group = self.members.get(sid)
        if group is None:
            self.members[sid] = [index]
            self.memo[sid] = {}
        elif self.by_order:
            bisect.insort(group, index, key=self.rank.__getitem__)
        else:
            group.append(index)

    def _leave(self, index: int) -> None:
        sid = self.state_of[index]
        group = self.members[sid]
        group.remove(index)
        if not group:
            del self.members[sid]
            del self.memo[sid]

    def request_of(self, task: Task) -> tuple[int, PlacementRequest]:
        shape_id = self.shape_ids.get(task.key)
        if shape_id is None:
            shape_id = self.shape_ids[task.key] = len(self.requests)
            self.requests.append(build_request(task))
        return shape_id, self.requests[shape_id]

    def place(self, task: Task, *, observe: bool = True) -> tuple[int, Placement] | None:
        """Place the task on the best node and commit it: (node index, placement), or None when it fits
        nowhere. observe: show the request to the policy first (a learning policy sees each pod once)."""
        shape_id, request = self.request_of(task)
        policy = self.policy
        if observe:
            policy.observe(request)
        current = policy.epoch()
        memo = self.memo
        if current != self.epoch or not self.cacheable:
            self.epoch = current
            for sid in memo:
                memo[sid] = {}

        nodes = self.nodes
        members = self.members
        best = -float("inf")
        tied: list[int] = []
        for sid, group in members.items():
            results = memo[sid]
            result = results.get(shape_id)
            if result is None:
                result = place(nodes[group[0]], request, policy, policy, check_host=True)
                results[shape_id] = result
                self.calls += 1
            if type(result) is Placement:
                score = result.score
                if score > best:
                    best = score
                    tied = [sid]
                elif score == best:
                    tied.append(sid)
        if not tied:
            return None
        rank = self.rank
        # uniform over the tied nodes (not states): weight each state by its node count
        if self.by_order:
            sid = min(tied, key=lambda s: rank[members[s][0]])
            index = members[sid][0]
        elif len(tied) == 1 and len(members[tied[0]]) == 1:
            sid = tied[0]
            index = members[sid][0]
        else:
            pick = self.rng.randrange(sum(len(members[s]) for s in tied))
            for sid in tied:
                group = members[sid]
                if pick < len(group):
                    index = group[pick]
                    break
                pick -= len(group)
        chosen: Placement = memo[sid][shape_id]
        node = nodes[index]
        self._leave(index)
        node.cpu_milli_used += request.cpu_milli
        node.memory_mib_used += request.memory_mib
        node.apply_usage(chosen.usage)  # also touches the node (its caches are dropped)
        self._enter(index)
        return index, chosen

    def release(self, index: int, task: Task, placement: Placement) -> None:
        """Remove a placed task from its node: exactly what `place` added."""
        node = self.nodes[index]
        self._leave(index)
        node.cpu_milli_used -= task.cpu_milli
        node.memory_mib_used -= task.memory_mib
        node.apply_usage(placement.usage, sign=-1)
        self._enter(index)


def simulate(
    node_specs: Sequence[NodeSpec],
    arrivals: Sequence[Task],
    policy: Policy,
    *,
    seed: int,
    frag_shapes: WeightedShapes = (),
    progress: ProgressFn | None = None,
    progress_every: int = 250,
    tie_break: str = "order",
) -> RunResult:
    """Place `arrivals` one by one (no departures); a task that fits nowhere is dropped. tie_break: see
    `Cluster`."""
    started = time.perf_counter()
    cluster = Cluster(node_specs, policy, seed=seed, tie_break=tie_break)
    capacity = cluster.capacity
    arrived = allocated = placed = failed = 0
    arrived_series: list[int] = []
    allocated_series: list[int] = []
    frag_at_100: float | None = None
    frag_model = FragModel(frag_shapes) if frag_shapes else None

    for number, task in enumerate(arrivals, start=1):
        arrived += task.gpu_milli_total
        if cluster.place(task) is not None:
            allocated += task.gpu_milli_total
            placed += 1
        else:
            failed += 1
        arrived_series.append(arrived)
        allocated_series.append(allocated)
        if frag_at_100 is None and frag_model is not None and arrived >= capacity:
            frag_at_100 = 100.0 * cluster_frag(cluster.nodes, frag_model)[0] / capacity
        if progress is not None and number % progress_every == 0:
            progress(progress_every)
    if progress is not None:
        progress(len(arrivals) % progress_every)

    return RunResult(
        seed=seed,
        capacity_milli=capacity,
        arrived_milli=arrived_series,
        allocated_milli=allocated_series,
        placed=placed,
        failed=failed,
        seconds=time.perf_counter() - started,
        frag_at_100=frag_at_100,
        engine_calls=cluster.calls,
    )
