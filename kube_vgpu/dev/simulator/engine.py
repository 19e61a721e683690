"""One experiment: place an arrival sequence on an empty cluster with the extender's placement engine.

Every decision goes through `extender.engine.fit.place` and the named policy, exactly as the extender's
filter + prioritize would; the simulator only adds what kube-scheduler adds: CPU / memory fit (check_host),
picking the best-scoring node with a uniformly random tie-break (kube-scheduler's selectHost), and committing
the placement.

Speed: the cluster is kept as groups of nodes in identical state (same hardware class, same CPU / memory /
per-GPU usage). A cacheable policy's result depends only on (node state, request, policy epoch), so each
(state, task shape) pair is placed once, on one representative node, and reused for every node in that state
until the policy's epoch changes. Each task shape keeps a board of the states' scores as of its last task
(`_Board`); a task of that shape only brings its board up to date with the states that changed since (a log of
touched states: one node left a state, entered another), so after warm-up a task costs a few engine calls and
a heap lookup instead of a pass over every state. `scan=True` keeps the plain pass over every state (the
reference the indexed path is tested against; also used for policies that are not cacheable).
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import random
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kube_vgpu.dev.simulator.trace import NodeSpec, Task
from kube_vgpu.extender.engine.fit import place
from kube_vgpu.extender.engine.fragmentation import FragModel, WeightedShapes, cluster_frag
from kube_vgpu.extender.engine.model import FitFailure, NodeState, Placement, PlacementRequest
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

#: the memoised answer where `Cluster._cannot_fit` rules a state out without asking the engine
_PREFILTERED = FitFailure("does not fit (CPU, memory, GPU model or free GPU share)", code="host")


def _same_answer(a: Placement | FitFailure, b: Placement | FitFailure) -> bool:
    """Equal answers of the engine on two nodes (a placement names its node; usage and score must agree)."""
    if type(a) is Placement and type(b) is Placement:
        return (a.usage, a.score, a.containers) == (b.usage, b.score, b.containers)
    return type(a) is type(b)


class _Board:
    """One task shape's view of the cluster as of its last task: the score of every live state the shape fits
    (`scores`), ordered for the choice of the best node. Ordered ties (`heap`): (-score, rank of the state's
    first node, state), lazily pruned. Random ties (`buckets`): per score, the states with that score in the
    order they were (re)created, i.e. the order of `Cluster.members`, which the uniform pick walks."""

    __slots__ = ("buckets", "epoch", "heap", "scores", "seqs", "synced", "tops")

    def __init__(self, epoch: int, synced: int) -> None:
        self.epoch = epoch
        self.synced = synced  # position in Cluster.log up to which the board is current
        self.scores: dict[int, float] = {}
        self.heap: list[tuple[float, int, int]] = []
        self.buckets: dict[float, dict[int, int]] = {}  # score -> {state: its node count}
        self.tops: list[float] = []  # -score of each bucket (lazily pruned)
        self.seqs: dict[int, int] = {}  # state -> its creation number when it entered a bucket


class Cluster:
    """The simulated cluster: nodes kept as groups in identical state, placement through the engine and the
    policy (see the module docstring), commit and release. Shared by the arrivals-only protocol (`simulate`)
    and the churn protocol (`churn.replay`).

    tie_break: among the best-scoring nodes, "order" takes the first in a per-seed random order of the nodes
    (what the FGD reference simulator's scheduler does; its published numbers depend on it), "random" a
    uniformly random one (stock kube-scheduler's selectHost)."""

    def __init__(
        self,
        node_specs: Sequence[NodeSpec],
        policy: Policy,
        *,
        seed: int,
        tie_break: str = "order",
        scan: bool = False,
        audit: bool = False,
    ) -> None:
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
        self.memo: dict[int, dict[int, Placement | FitFailure]] = {}  # state id -> task shape id -> answer
        self.state_of = [0] * len(self.nodes)
        self.log: list[int] = []  # states whose node set changed (created, emptied, a node in or out), in order
        self.created: dict[int, int] = {}  # state id -> when it last entered `members` (its order there)
        self.boards: list[_Board | None] = []  # by task shape id
        #: state id -> (free CPU, free memory, GPU model, most free cores of one GPU, idle GPUs, GPU state id):
        #: `_cannot_fit`, and the GPU state (the state less host CPU and memory) for `gpu_memo`
        self.views: dict[int, tuple[int, int, str, int, int, int]] = {}
        self.gpu_interned: dict[tuple[Any, ...], int] = {}
        #: a policy that reads no host CPU (`Policy.uses_host_cpu` false) answers alike for nodes whose GPUs are
        #: in the same state once their CPU and memory fit: (GPU state id, GPU ask id) -> Placement | FitFailure
        self.gpu_memo: dict[tuple[int, int], Placement | FitFailure] = {}
        self.gpu_asks: list[int] = []  # by task shape id: id of its GPU ask (count, share, models)
        self.gpu_ask_ids: dict[tuple[Any, ...], int] = {}
        self.host_blind = not policy.uses_host_cpu
        self.audit = audit
        for index in range(len(self.nodes)):
            self._enter(index)
        self.shape_ids: dict[tuple[Any, ...], int] = {}
        self.requests: list[PlacementRequest] = []
        #: by task shape id: (CPU, memory, GPU count, share of one GPU or 0 for whole GPUs, allowed models)
        self.asks: list[tuple[int, int, int, int, tuple[str, ...]]] = []
        self.cacheable = policy.cacheable
        self.scan = scan or not policy.cacheable
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
            self.created[sid] = len(self.log)
            self.memo[sid] = {}
            if sid not in self.views:
                node = self.nodes[index]
                gpus = node.gpus
                gpu_key = (key[0], *key[3:])
                self.views[sid] = (
                    node.cpu_milli_total - node.cpu_milli_used,
                    node.memory_mib_total - node.memory_mib_used,
                    node.gpu_model,
                    max([g.cores - g.used_cores for g in gpus], default=0),
                    sum([1 for g in gpus if not g.used_vgpus]),
                    self.gpu_interned.setdefault(gpu_key, len(self.gpu_interned)),
                )
        elif self.by_order:
            bisect.insort(group, index, key=self.rank.__getitem__)
        else:
            group.append(index)
        self.log.append(sid)

    def _leave(self, index: int) -> None:
        sid = self.state_of[index]
        group = self.members[sid]
        group.remove(index)
        if not group:
            del self.members[sid]
            del self.memo[sid]
        self.log.append(sid)

    def request_of(self, task: Task) -> tuple[int, PlacementRequest]:
        shape_id = self.shape_ids.get(task.key)
        if shape_id is None:
            shape_id = self.shape_ids[task.key] = len(self.requests)
            self.requests.append(build_request(task))
            share = task.gpu_milli if task.gpu_count == 1 and task.gpu_milli < GPU_CORES else 0
            self.asks.append((task.cpu_milli, task.memory_mib, task.gpu_count, share, task.gpu_spec))
            ask = (task.gpu_count, task.gpu_milli, task.gpu_spec)
            self.gpu_asks.append(self.gpu_ask_ids.setdefault(ask, len(self.gpu_ask_ids)))
        return shape_id, self.requests[shape_id]

    def _cannot_fit(self, sid: int, shape_id: int) -> bool:
        """True only where `place` would certainly answer FitFailure: CPU or memory short (its own host check), or
        fewer GPUs of an allowed model with the share free (idle for whole GPUs) than asked, a condition every
        GPU the engine's fit offers meets. A state it passes is placed by the engine as before."""
        cpu_free, memory_free, model, most_free, idle, _ = self.views[sid]
        cpu, memory, count, share, models = self.asks[shape_id]
        if cpu > cpu_free or memory > memory_free:
            return True
        if not count:
            return False
        if models and model not in models:
            return True
        if share:
            return most_free < share
        return idle < count

    def _evaluate(self, sid: int, shape_id: int, request: PlacementRequest) -> Placement | FitFailure:
        """The engine's answer for one state and task shape (memoised per policy epoch; see _cannot_fit and
        gpu_memo for the answers known without asking the engine)."""
        results = self.memo[sid]
        result = results.get(shape_id)
        if result is not None:
            return result
        node = self.nodes[self.members[sid][0]]
        if self._cannot_fit(sid, shape_id):
            result = _PREFILTERED
            if self.audit:
                checked = place(node, request, self.policy, self.policy, check_host=True)
                assert type(checked) is FitFailure, f"state {sid} was filtered out but fits {request}"
        elif self.host_blind:
            # CPU and memory fit (_cannot_fit checked them as the engine does): the GPU state decides
            gpu_key = (self.views[sid][5], self.gpu_asks[shape_id])
            result = self.gpu_memo.get(gpu_key)
            if result is None:
                result = self.gpu_memo[gpu_key] = place(node, request, self.policy, self.policy, check_host=True)
                self.calls += 1
            elif self.audit:
                checked = place(node, request, self.policy, self.policy, check_host=True)
                assert _same_answer(checked, result), f"state {sid}: {checked} != {result} (GPU state memo)"
        else:
            result = place(node, request, self.policy, self.policy, check_host=True)
            self.calls += 1
        results[shape_id] = result
        return result

    def place(self, task: Task, *, observe: bool = True) -> tuple[int, Placement] | None:
        """Place the task on the best node and commit it: (node index, placement), or None when it fits
        nowhere. observe: show the request to the policy first (a learning policy sees each pod once)."""
        shape_id, request = self.request_of(task)
        policy = self.policy
        if observe:
            policy.observe(request)
        current = policy.epoch()
        if self.scan:
            return self._place_scan(shape_id, request, current)
        if current != self.epoch:
            self.epoch = current
            self.memo = {sid: {} for sid in self.members}
            self.gpu_memo = {}
        boards = self.boards
        while len(boards) <= shape_id:
            boards.append(None)
        board = boards[shape_id]
        if board is None or board.epoch != current:
            board = boards[shape_id] = _Board(current, 0)
            touched: Iterable[int] = list(self.members)  # every live state, in members' order
        elif board.synced < len(self.log):
            touched = dict.fromkeys(self.log[board.synced :])
        else:
            touched = ()
        board.synced = len(self.log)
        if touched:
            self._update(board, touched, shape_id, request)
        found = self._best_ordered(board) if self.by_order else self._best_random(board)
        if found is None:
            return None
        index, sid = found
        return self._commit(index, self.memo[sid][shape_id], request)

    def _best_ordered(self, board: _Board) -> tuple[int, int] | None:
        """(node, state) of the best score, ties to the node first in `rank`; None when nothing fits."""
        heap = board.heap
        scores = board.scores
        members = self.members
        rank = self.rank
        while heap:
            negative, first, sid = heap[0]
            group = members.get(sid)
            if group is not None and rank[group[0]] == first and scores.get(sid) == -negative:
                return group[0], sid
            heapq.heappop(heap)
        return None

    def _best_random(self, board: _Board) -> tuple[int, int] | None:
        """(node, state) of the best score, uniform over the tied nodes (as `_place_scan` draws it: the pick-th
        node counting through the tied states in members' order)."""
        buckets = board.buckets
        tops = board.tops
        while tops:
            tied = buckets.get(-tops[0])
            if tied:
                break
            heapq.heappop(tops)
        else:
            return None
        members = self.members
        if len(tied) == 1:
            sid = next(iter(tied))
            if tied[sid] == 1:
                return members[sid][0], sid
        pick = self.rng.randrange(sum(tied.values()))
        ends = list(itertools.accumulate(tied.values()))
        position = bisect.bisect_right(ends, pick)
        sid = list(tied)[position]
        return members[sid][pick - (ends[position - 1] if position else 0)], sid

    def _update(self, board: _Board, touched: Iterable[int], shape_id: int, request: PlacementRequest) -> None:
        """Bring the board up to date with the touched states (each evaluated once per epoch and shape)."""
        members = self.members
        evaluate = self._evaluate
        scores = board.scores
        if self.by_order:
            rank = self.rank
            heap = board.heap
            memo = self.memo
            cannot_fit = self._cannot_fit
            audit = self.audit
            for sid in touched:
                group = members.get(sid)
                if group is None:
                    scores.pop(sid, None)
                    continue
                results = memo[sid]
                result = results.get(shape_id)
                if result is None:
                    if not audit and cannot_fit(sid, shape_id):
                        results[shape_id] = _PREFILTERED
                        continue
                    result = evaluate(sid, shape_id, request)
                if type(result) is Placement:
                    score = scores[sid] = result.score
                    heapq.heappush(heap, (-score, rank[group[0]], sid))
            if len(heap) > 4 * len(scores) + 64:  # drop the stale entries
                board.heap = [(-score, rank[members[sid][0]], sid) for sid, score in scores.items()]
                heapq.heapify(board.heap)
            return
        self._update_random(board, touched, shape_id, request)

    def _update_random(
        self, board: _Board, touched: Iterable[int], shape_id: int, request: PlacementRequest
    ) -> None:
        """`_update` for random ties: keep each bucket in members' order (states by creation)."""
        members = self.members
        evaluate = self._evaluate
        scores = board.scores
        created = self.created
        buckets = board.buckets
        seqs = board.seqs
        memo = self.memo
        cannot_fit = self._cannot_fit
        audit = self.audit
        for sid in sorted(touched, key=created.__getitem__):
            group = members.get(sid)
            old = scores.get(sid)
            if old is not None:
                if group is not None and seqs[sid] == created[sid]:
                    buckets[old][sid] = len(group)  # the same state in the same place; its node count may differ
                    continue
                del scores[sid]
                bucket = buckets[old]
                del bucket[sid]
                if not bucket:
                    del buckets[old]
            if group is None:
                continue
            results = memo[sid]
            result = results.get(shape_id)
            if result is None:
                if not audit and cannot_fit(sid, shape_id):
                    results[shape_id] = _PREFILTERED
                    continue
                result = evaluate(sid, shape_id, request)
            if type(result) is Placement:
                score = scores[sid] = result.score
                seqs[sid] = created[sid]
                if score not in buckets:
                    buckets[score] = {}
                    heapq.heappush(board.tops, -score)
                buckets[score][sid] = len(group)

    def _commit(
        self, index: int, chosen: Placement | FitFailure, request: PlacementRequest
    ) -> tuple[int, Placement]:
        assert type(chosen) is Placement  # only states the shape fits are chosen
        node = self.nodes[index]
        self._leave(index)
        node.cpu_milli_used += request.cpu_milli
        node.memory_mib_used += request.memory_mib
        node.apply_usage(chosen.usage)  # also touches the node (its caches are dropped)
        self._enter(index)
        return index, chosen

    def _place_scan(self, shape_id: int, request: PlacementRequest, current: int) -> tuple[int, Placement] | None:
        """The plain pass over every state (see the module docstring)."""
        policy = self.policy
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
        return self._commit(index, memo[sid][shape_id], request)

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
