"""Decisions on the cluster state: filter, prioritize (pure, in memory) and bind (decide and commit).

filter and prioritize never call the API server; per-node results are cached on the node keyed by
(request shape, policies) and dropped whenever that node changes. A new request shape is placed once per
node-equivalence class (equivalence_key: nodes whose GPUs, links, CPU and pod kinds are in the same state get the
same placement and score), all classes at once where the policy places in batches (Policy.place_batch: bfgd, over
arrays, when BATCH_MIN_NODES or more classes wait), and each shape keeps its answer (_Answer: which judged nodes
pass, which fail and why), brought up to date from the state's journal of changed nodes, so a burst of pods of few
shapes costs a list comprehension over the node names per verb plus a re-judging of the nodes changed since the
shape's last pod.

bind has two steps: prepare_bind re-checks on fresh state and reserves the GPUs in memory as soon as the bind
arrives; commit_bind, when the node's turn comes (one at a time per node, or together with identical assignments:
extender/binding.py), writes the Binding that carries the assignment, and rolls the reservation back if it fails.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import itertools
import logging
import math
import operator
import re
import threading
from collections import Counter, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

import numpy as np
import numpy.typing as npt

from kube_vgpu import kubeapi, protocol
from kube_vgpu.extender.binding import BindError, BindOrdering, PreparedBind
from kube_vgpu.extender.engine.fit import place
from kube_vgpu.extender.engine.model import (
    FitFailure,
    NodeState,
    Placement,
    PlacementRequest,
    assignment_from_placement,
    new_placement,
)
from kube_vgpu.extender.engine.policies import (
    DEFAULT_GPU_POLICY,
    DEFAULT_NODE_POLICY,
    REGISTRY,
    Policy,
    make_policy,
)
from kube_vgpu.extender.engine.policies.batch import GroupColumns
from kube_vgpu.extender.fence import LeaderFence
from kube_vgpu.extender.gangs import DEFAULT_TIMEOUT_S as DEFAULT_GANG_TIMEOUT_S
from kube_vgpu.extender.gangs import Gang, GangKey, GangTracker, InvalidGang, Member, gang_of
from kube_vgpu.extender.gates import Gate
from kube_vgpu.extender.gcpolicy import collector_paused
from kube_vgpu.extender.name_set import LazyNameSet
from kube_vgpu.extender.node_columns import REBUILD_SHARE, NodeColumns
from kube_vgpu.extender.preemption.evict import Evictor
from kube_vgpu.extender.preemption.executor import DEFAULT_MAX_IN_FLIGHT, EvictionExecutor
from kube_vgpu.extender.preemption.nominations import Nominations
from kube_vgpu.extender.preemption.preemptor import Preemptor
from kube_vgpu.extender.recent_pods import RecentPods
from kube_vgpu.extender.state import HOST_RESOURCES, ClusterState, PodRecord, host_asks
from kube_vgpu.protocol import InvalidGpuRequest, PodGpuRequest

log = logging.getLogger(__name__)

MAX_EXTENDER_SCORE = 10  # kube-scheduler's extenderv1.MaxExtenderPriority
#: When a learning policy's model changes (its epoch), every node's cached result for a request shape is
#: outdated. Re-placing all nodes at once would cost one full scan (~200 ms on 5000 nodes) on that pod; instead
#: each filter of the shape re-places this many of them (~0.7 ms) and the others answer with their previous
#: result (the fit is the same; only the score is the previous model's) until their turn. Nodes that change are
#: re-placed anyway. The per-node lookup stays one dict access.
STALE_REFRESH_PER_CALL = 16
#: request shapes whose outdated nodes are being worked through at once (a shape evicted starts over when seen)
REFRESHING_SHAPES = 64
#: request shapes whose answer (every judged node's verdict, `_Answer`) is kept, least recently used beyond: filter
#: and prioritize of such a shape cost one dict lookup per node in a list comprehension, plus a re-judging of the
#: nodes changed since the shape's last pod (the state's journal)
ANSWERED_SHAPES = 32
#: per request shape, the results kept per node-equivalence class under the policies' current model (cleared beyond)
CLASS_RESULTS_PER_SHAPE = 50_000
#: nodes changed between a filter and its prioritize that the prepared answer is brought up to date for, one by one;
#: more, and prioritize computes afresh
PREPARED_CHANGES_MAX = 8
#: nodes changed since the previous pod's prepared answer, at most, for it to be carried over to the next pod's
#: (_scores_carried_over): each is a lookup in the shape's answer, not a judgement as in PREPARED_CHANGES_MAX; one
#: filter re-places up to STALE_REFRESH_PER_CALL nodes of an older model besides the nodes the journal names
CARRIED_CHANGES_MAX = 64
#: a shape's answer's refreshed nodes (_Answer.refreshed) before that list starts over
REFRESHED_LIMIT = 20_000
#: request shapes whose last filter's outcome is kept for the next one (_RepeatedFilter: each holds the names asked,
#: ~0.3 MB at 5000 nodes); the pods of a burst interleave a few shapes
REPEATED_SHAPES = 4
#: a prepared answer's positions looked up by searching its list, before its map of positions is built
POSITIONS_SEARCHED_MAX = 8
#: nodes asked from which a filter checks whether they are the last prepared answer's (fewer: judged as asked)
CARRIED_MIN_NODES = 32
#: nodes to judge in one filter (a new request shape at scale) from which the cyclic collector is off meanwhile and
#: what the filter kept is frozen after (gcpolicy.collector_paused)
COLLECTOR_PAUSE_MIN_NODES = 1000
#: a request shape's nodes to place, at least, before the policy's batch placement (Policy.place_batch) places them
#: together: below, one by one costs less than building the arrays
BATCH_MIN_NODES = 32
#: request shapes whose per-class results are kept (all are dropped beyond: they are only the cold path's shortcut)
CLASS_RESULT_SHAPES = 256
NOT_SYNCED = "kube-vgpu extender is still loading the cluster state (initial sync); the pod will be retried"
NOT_ADMITTED = (
    f"pod was not admitted by kube-vgpu's webhook (no {protocol.POD_ADMITTED_ANNOTATION} annotation: its namespace "
    f"opts out with the label {protocol.LABEL_WEBHOOK}={protocol.LABEL_WEBHOOK_DISABLED} or is excluded, or the "
    "webhook was not installed when the pod was created), so its GPU limits were never set up; recreate it in a "
    "namespace the webhook serves"
)


_score_of = operator.attrgetter("score")


def admitted_by_webhook(pod: Mapping[str, Any]) -> bool:
    annotations = (pod.get("metadata") or {}).get("annotations") or {}
    return annotations.get(protocol.POD_ADMITTED_ANNOTATION) == protocol.ADMISSION_MARK_VALUE


class Binder(Protocol):
    """Writes decisions to the API server (live) or to the in-memory snapshot."""

    def get_pod(self, namespace: str, name: str) -> dict[str, Any] | None: ...

    def remember_pod(self, pod: Mapping[str, Any]) -> None:
        """Called with the pod object kube-scheduler sent before it is bound (snapshot mode stores it)."""
        ...

    def bind(self, namespace: str, name: str, uid: str, node: str, annotations: dict[str, str]) -> None:
        """Bind the pod (UID as precondition) and set these annotations on it, in one API call."""
        ...


#: node state (equivalence_key's tuple) -> a small number, so that per-shape class results are keyed by an int (a
#: tuple of a node's 8 GPU tuples is hashed anew on every lookup; an int is not). Numbers are never reused.
_EQUIVALENCE_IDS: dict[tuple[Any, ...], int] = {}
_NEXT_EQUIVALENCE_ID = itertools.count(1)
#: distinct node states remembered before the table starts over (their nodes get new numbers when they change)
EQUIVALENCE_IDS_LIMIT = 200_000


def equivalence_key(node: NodeState) -> int | None:
    """A number for everything fit.place and the policies read of a node except its name and GPU UUIDs: two nodes
    with equal numbers get the same placement (GPU positions), score and failure reason for any request without UUID
    selectors or MIG containers, so a new request shape is placed once per distinct number, not once per node.
    Cached on the node until it changes (NodeState.touch). None: the node is placed on its own (MIG devices, GPUs
    held by pods outside kube-vgpu, whose reasons name them, or no GPUs)."""
    key = node.equivalence_key
    if key is None:
        if node.mig_devices or node.dynamic_mig_devices or node.inventory_external or not node.gpus:
            key = 0
        else:
            state = (node.link_id, node.cpu_milli_total, node.cpu_milli_used, node.memory_mib_total,
                     node.memory_mib_used, tuple(sorted(node.pod_kinds.items())),
                     *[(gpu.index, gpu.model, gpu.memory_mib, gpu.cores, gpu.max_vgpus, gpu.numa_node, gpu.healthy,
                        gpu.mig_mode, gpu.used_memory_mib, gpu.used_cores, gpu.used_vgpus, gpu.exclusive_holders)
                       for gpu in node.gpus])
            key = _EQUIVALENCE_IDS.get(state)
            if key is None:
                if len(_EQUIVALENCE_IDS) >= EQUIVALENCE_IDS_LIMIT:
                    _EQUIVALENCE_IDS.clear()
                key = _EQUIVALENCE_IDS.setdefault(state, next(_NEXT_EQUIVALENCE_ID))
        node.equivalence_key = key
    return key or None


def _named_for(result: Placement | FitFailure, node_name: str) -> Placement | FitFailure:
    """A node-equivalence class's result for one of its nodes: a placement under that node's own name."""
    if isinstance(result, Placement) and result.node_name != node_name:
        return new_placement(node_name, result.containers, result.usage, result.score)
    return result


def _store_placed(nodes: list[NodeState], names: list[str], equivalences: list[int], placed: list[Placement | None],
                  key: int, results: dict[int, Placement | FitFailure], passed: dict[str, Placement]) -> None:
    """A batch's placements, each in its node-equivalence class's results, its node's fit cache and the shape's
    answer (passed, keyed by names); a node placed None is left to the per-node loop."""
    if None in placed:
        for node, name, equivalence, result in zip(nodes, names, equivalences, placed, strict=True):
            if result is not None:
                results[equivalence] = node.fit_cache[key] = passed[name] = result
        return
    # every node placed (the usual new shape): the three stores in C
    placements = cast(list[Placement], placed)
    results.update(zip(equivalences, placements, strict=True))
    passed.update(zip(names, placements, strict=True))
    _consume(map(operator.setitem, map(_FIT_CACHE, nodes), itertools.repeat(key), placements))


_FIT_CACHE = operator.attrgetter("fit_cache")
_HEARTBEAT = operator.attrgetter("heartbeat_s")
_EQUIVALENCE = operator.attrgetter("equivalence_key")
#: Scheduler._kept_batch: the kept columns say the per-node loop decides
_LOOP_DECIDES = object()
#: runs an iterator to its end, keeping nothing
_consume: Callable[[Iterable[object]], None] = deque[object](maxlen=0).extend


def _whole_batch(names: list[str], nodes: Mapping[str, NodeState], failed_answers: Mapping[str, FitFailure],
                 key: int, results: Mapping[int, Placement | FitFailure], now: float, ttl: float,
                 first_judged: bool = False) -> tuple[list[NodeState], list[int], float] | None:
    """(nodes, their equivalence keys, the earliest heartbeat) when every name asked is a node for the batch, as
    Scheduler._place_in_batch's loop would take it: known, not refused for the shape, no result cached, heartbeat
    fresh, its own equivalence class not placed yet. Read in C, pass by pass; None: one is not (the loop sorts
    them out)."""
    found = list(map(nodes.get, names))
    if None in found:
        return None
    todo = cast(list[NodeState], found)
    heartbeats = list(map(_HEARTBEAT, todo))
    if None in heartbeats:
        return None
    earliest_heartbeat_s = min(heartbeats, default=math.inf)
    if now - earliest_heartbeat_s > ttl:  # the loop's test, on the oldest
        return None
    if not first_judged and not _none_judged(names, todo, failed_answers, key):
        return None
    equivalences: list[Any] = list(map(_EQUIVALENCE, todo))
    if not all(equivalences):  # computed as the loop does (a node changed since its last: None; of no class: 0)
        equivalences = [equivalence or equivalence_key(node) for node, equivalence in zip(todo, equivalences,
                                                                                          strict=True)]
        if None in equivalences:
            return None
    if len(set(equivalences)) != len(equivalences) or not results.keys().isdisjoint(equivalences):
        return None
    return todo, equivalences, earliest_heartbeat_s


def _none_judged(names: list[str], nodes: list[NodeState], failed_answers: Mapping[str, FitFailure], key: int
                 ) -> bool:
    """Whether none of these nodes (names: theirs) has a verdict for the shape yet: not refused in its answer, no
    result in its fit cache. (Needless under a request key judged for the first time: Scheduler._first_judged.)"""
    if failed_answers and not failed_answers.keys().isdisjoint(names):
        return False
    return not any(map(operator.contains, map(_FIT_CACHE, nodes), itertools.repeat(key)))


def _batch_by_loop(names: list[str], nodes: Mapping[str, NodeState], failed_answers: Mapping[str, FitFailure],
                   key: int, results: Mapping[int, Placement | FitFailure], now: float, ttl: float,
                   ) -> tuple[list[NodeState], list[int], float, list[str]]:
    """The nodes among names for Scheduler._place_in_batch, read one by one: known, not refused for the shape, no
    result cached, heartbeat fresh, the first of its node-equivalence class not placed yet (its twins among names
    get its result). (nodes, their equivalence keys, the earliest of their heartbeats, their names as asked: the
    answer is keyed by them, as the filter's loop keys it.) The answer holds until the first of its nodes'
    heartbeats expires."""
    todo: list[NodeState] = []
    equivalences: list[int] = []
    asked: list[str] = []
    seen: set[int] = set()
    earliest_heartbeat_s = math.inf
    for name in names:
        node = nodes.get(name)
        if node is None or name in failed_answers or key in node.fit_cache:
            continue
        heartbeat_s = node.heartbeat_s
        if heartbeat_s is None or now - heartbeat_s > ttl:
            continue
        equivalence = node.equivalence_key or equivalence_key(node)  # cached on the node (0: None) but once
        if equivalence is None or equivalence in results or equivalence in seen:
            continue
        seen.add(equivalence)
        todo.append(node)
        equivalences.append(equivalence)
        asked.append(name)
        if heartbeat_s < earliest_heartbeat_s:
            earliest_heartbeat_s = heartbeat_s
    return todo, equivalences, earliest_heartbeat_s, asked


def groupable(request: PlacementRequest, node_policy: Policy, gpu_policy: Policy) -> bool:
    """Whether nodes of one equivalence key get one result for this request (equivalence_key)."""
    selectors = request.gpu.selectors
    return (node_policy.node_equivalence and gpu_policy.node_equivalence and not selectors.use_uuids
            and not selectors.nouse_uuids and not any(container.mig for container in request.gpu.containers))


@dataclass(slots=True)
class _Answer:
    """One request shape's verdicts on the nodes judged so far (each also in node.fit_cache), as of the state's
    journal position: nodes changed since are dropped when the shape is next asked for, and judged again then.
    Only nodes whose heartbeat was fresh are kept, and the whole answer only until the earliest of their heartbeats
    expires. Used when no gate and no nomination can refuse a fitting node (those depend on the pod)."""

    journal_epoch: int
    journal_position: int
    expires_s: float = math.inf
    passed: dict[str, Placement] = field(default_factory=dict)
    failed: dict[str, FitFailure] = field(default_factory=dict)
    #: nodes whose verdicts were dropped or replaced for a reason the journal does not name (a result of an older
    #: model re-placed), in order: a prepared prioritize answer carried over to the next pod reads them again as it does
    #: the journal's (a new list past REFRESHED_LIMIT: the positions in the old one then mean nothing)
    refreshed: list[str] = field(default_factory=list)

    def note_refreshed(self, name: str) -> None:
        """Record a node whose verdict was dropped or replaced outside the journal (refreshed)."""
        if len(self.refreshed) >= REFRESHED_LIMIT:
            self.refreshed = []
        self.refreshed.append(name)


@dataclass(slots=True)
class _RepeatedFilter:
    """A filter's outcome, for the next filter of its shape that asks the same nodes in any order (kube-scheduler
    asks for every node its own plugins pass, pod after pod): that filter judges again only the nodes changed since
    (the state's journal, the answer's refreshed list) and keeps the rest of this outcome. Where many nodes cannot
    take the pod (4-GPU pods on a cluster of whole-GPU jobs: ~1600 of 5000) each filter walked, reported and counted
    every one of them again. Kept only for an outcome that passed some node and answered from its shape's answer,
    as of the answer's journal position (no gate or nomination refuses a node, so a node's verdict is its state's)."""

    answer: _Answer
    refreshed: list[str]
    refreshed_position: int
    journal_epoch: int
    journal_position: int
    #: the nodes as asked (distinct), and each one's position there, built when first needed
    asked: list[str]
    passed: list[str]
    failed: dict[str, str]
    unresolvable: dict[str, str]
    #: each refused node's rejection code (FitFailure codes, "stale"): what on_rejection counts
    codes: dict[str, str]
    #: the nodes refused for a stale heartbeat: judged again every time (their reason tells its age)
    stale: list[str]
    #: the nodes asked as a NameSet, built when wanted again (carried over from the filter repeated, if any)
    name_set: LazyNameSet
    positions: dict[str, int] | None = None

    def same_nodes(self, names: list[str]) -> bool:
        """Whether names are the nodes asked, in any order, all distinct (a name asked twice is answered twice: such
        a filter is never repeated)."""
        asked = self.asked
        if len(names) != len(asked):
            return False
        name_set = self.name_set.wanted()
        if name_set is not None:  # (its names are distinct)
            return names is asked or names == asked or name_set.same_names(names)
        positions = self.position_map()  # (carried over from the filter repeated, if any: the same nodes)
        if len(positions) != len(asked):
            return False
        return names is asked or names == asked or _permutation_of(names, positions)

    def position_map(self) -> dict[str, int]:
        """Each node asked and a position (the last, for a name asked twice), built once."""
        positions = self.positions
        if positions is None:
            positions = self.positions = dict(zip(self.asked, itertools.count()))
        return positions


@dataclass(slots=True, frozen=True)
class _PassesEdit:
    """How a filter's passing nodes came from a list passed before: `result` is `base` less the nodes `gone` (each
    in base), in base's order, then the nodes `new` (none in base). A prepared prioritize answer of base's nodes is
    carried over to result's through it, a few nodes removed and added (_scores_carried_over), not computed afresh."""

    base: list[str]
    gone: set[str]
    new: list[str]
    result: list[str]


def _repeated_passes(last: _RepeatedFilter, changed: list[str], passed_now: Mapping[str, Placement]
                     ) -> tuple[list[str], _PassesEdit | None]:
    """A repeated filter's passing nodes (_RepeatedFilter): the last filter's, in its order, less the changed nodes
    that no longer pass, then the changed nodes that pass now and did not then; its very list while none changed
    its verdict (the prepared prioritize answer then carries over with one list comparison), else a new list and how
    it came from the last one."""
    failed_then, unresolvable_then = last.failed, last.unresolvable
    gone = {name for name in changed
            if name not in passed_now and name not in failed_then and name not in unresolvable_then}
    new = [name for name in changed if name in passed_now and (name in failed_then or name in unresolvable_then)]
    if not gone and not new:
        return last.passed, None
    passed = [name for name in last.passed if name not in gone] if gone else last.passed.copy()
    passed += new
    return passed, _PassesEdit(last.passed, gone, new, passed)


def _permutation_of(names: list[str], positions: dict[str, int]) -> bool:
    """Whether names are the keys of positions (distinct names, positions 0..n-1) in any order: each name's position
    read once, and every position met (a name given twice leaves one of them out)."""
    if len(names) != len(positions):
        return False
    try:
        asked = np.fromiter(map(positions.__getitem__, names), dtype=np.int64, count=len(names))
    except KeyError:
        return False
    seen = np.zeros(len(positions), dtype=np.bool_)
    seen[asked] = True
    return bool(seen.all())


@dataclass(slots=True)
class _ClassResults:
    """One request shape's results per node-equivalence class under the policies' current model (epochs)."""

    epochs: tuple[int, int]
    results: dict[int, Placement | FitFailure] = field(default_factory=dict)
    #: the state's journal (epoch, length) when the policy's batch placement last looked for nodes to place: it looks
    #: again only once enough nodes changed since (with a gate, every verb walks every node, and most have results)
    batched_at: tuple[int, int] = (-1, 0)


def _scores_of(placements: Mapping[str, Placement], names: list[str]) -> npt.NDArray[np.float64]:
    """The placements' scores in the order of names, over an array: 5000 nodes cost ~0.3 ms, not ~2 ms of Python
    per node. KeyError for a name without a placement."""
    return np.fromiter(map(_score_of, map(placements.__getitem__, names)), dtype=np.float64, count=len(names))


def _scaled(passed: list[str], raw: npt.NDArray[np.float64]) -> tuple[list[str], list[int]]:
    """The nodes and their scores, raw scores scaled from the lowest (0) to the highest (MAX_EXTENDER_SCORE); the
    nodes scaled to 0 left out where they are more than ZERO_SCORES_KEPT_SHARE of them, all left out when the raw
    scores are equal."""
    return _Scaling.of(passed, raw).answer


_NO_POSITIONS: npt.NDArray[np.int64] = np.zeros(0, dtype=np.int64)


#: the nodes scaled to 0 are kept in prioritize's answer while they are at most this share of them. A 0 adds what a
#: node missing from the answer adds to kube-scheduler: nothing. Kept, the hosts stay the same when a node's score
#: falls to 0 or rises from it, and so does the reply's layout (server.ScoreReplies: a new one costs 1-3 ms at 5000
#: hosts; the hosts changed for 9 of 200 pods bound one after another, each time 1-13 nodes at 0). Left out when
#: most are 0 (a burst onto an empty cluster: the reply shrinks from 5000 entries to a few).
ZERO_SCORES_KEPT_SHARE = 0.25


@dataclass(slots=True)
class _Scaling:
    """Scores scaled (_scaled) with what it takes to change one node's score without scaling them all again."""

    #: (hosts, scores): the nodes kept (all of them, or those scaled above 0), and their scaled scores
    answer: tuple[list[str], list[int]]
    #: the hosts' positions among the nodes scaled
    kept: npt.NDArray[np.int64]
    low: float
    high: float
    #: how many of the hosts are scaled to 0 where they are kept (ZERO_SCORES_KEPT_SHARE); -1 where they are left out
    zeros_kept: int = -1

    @classmethod
    def of(cls, passed: list[str], raw: npt.NDArray[np.float64]) -> _Scaling:
        if not len(raw):
            return cls(([], []), _NO_POSITIONS, 0.0, 0.0)
        low, high = float(raw.min()), float(raw.max())
        spread = high - low
        if spread <= 1e-12:
            return cls(([], []), _NO_POSITIONS, low, high)  # all equal: nothing to prefer (to kube-scheduler: all 10)
        # round((raw - low) / spread * MAX_EXTENDER_SCORE) per node: the same float operations, and np.rint rounds
        # halves to even as round() does
        scaled = np.rint((raw - low) / spread * MAX_EXTENDER_SCORE)
        kept = np.flatnonzero(scaled)
        zeros = len(passed) - len(kept)
        if zeros <= ZERO_SCORES_KEPT_SHARE * len(passed):  # every node (a list of its own: callers may change it)
            return cls((passed.copy(), scaled.astype(np.int64).tolist()), np.arange(len(passed)), low, high, zeros)
        return cls((list(map(passed.__getitem__, kept.tolist())), scaled[kept].astype(np.int64).tolist()), kept, low,
                   high)

    def copy(self) -> _Scaling:
        """Another scaling of the same scores, for another pod: rescoring it leaves this one as it is (its hosts
        list is shared: rescore never changes it)."""
        return _Scaling(self.answer, self.kept, self.low, self.high, self.zeros_kept)

    def rescore(self, raw: npt.NDArray[np.float64], position: int, old: float) -> bool:
        """Node `position`'s raw score went from old to raw[position]: change its scaled score alone (a new scores
        list, the hosts list kept) where the scaling stays as it was: the lowest and highest raw scores unchanged,
        and the node among the hosts before and after (the nodes scaled to 0 kept, and still few enough to be; or
        the node scaled above 0 before and after). False: scale them all again."""
        low, high = self.low, self.high
        spread = high - low
        new = float(raw[position])
        if spread <= 1e-12 or not low <= new <= high:
            return False
        if (old == low or old == high) and (float(raw.min()) != low or float(raw.max()) != high):
            return False  # it held the lowest or highest alone
        # the same float operations as `of`, on one node
        before = int(np.rint((old - low) / spread * MAX_EXTENDER_SCORE))
        after = int(np.rint((new - low) / spread * MAX_EXTENDER_SCORE))
        if not before or not after:
            zeros = self.zeros_kept + (not after) - (not before)
            if self.zeros_kept < 0 or zeros > ZERO_SCORES_KEPT_SHARE * len(self.kept):
                return False  # the node joins or leaves the hosts, or the zeros are left out from now on
            self.zeros_kept = zeros
        hosts, scores = self.answer
        scores = scores.copy()
        scores[int(np.searchsorted(self.kept, position))] = after
        self.answer = (hosts, scores)
        return True


@dataclass(slots=True)
class _PreparedScores:
    """prioritize's answer (scaled_scores) for the pod and nodes a filter just passed, computed before kube-scheduler
    asks for it (Scheduler.prepare_scores). It stays that answer while the pod and the nodes asked are the same, the
    policies' models are the same, no passing node's heartbeat has gone stale (the shape's answer's expiry) and no
    gate or nomination could refuse a node, once the nodes changed since (the state's journal) are judged again;
    otherwise prioritize computes afresh."""

    pod: Mapping[str, Any]
    #: the nodes as the filter passed them (prioritize asks in this order)
    names: list[str]
    #: the same nodes in the order of raw and of the answer's hosts: names' own, or the order of the answer it was
    #: carried over from (kube-scheduler's parallel filter plugins hand the nodes over in a new order every pod; a
    #: HostPriorityList's order means nothing to it)
    order: list[str]
    policies: tuple[Policy, Policy]
    epochs: tuple[int, int]
    #: the shape's answer it was computed from, its refreshed nodes (the list) and how many of them the raw
    #: scores include (_Answer.refreshed)
    answer: _Answer
    refreshed: list[str]
    refreshed_position: int
    journal_epoch: int
    #: the state's journal length up to which changes are in raw
    journal_position: int
    expires_s: float
    #: each node's policy score, in the order of `order`
    raw: npt.NDArray[np.float64]
    scaling: _Scaling
    #: the nodes as a NameSet, built when wanted again and carried over with the order
    name_set: LazyNameSet
    #: each node's position in order, built when first needed and carried over with the scores
    positions: dict[str, int] | None = None
    #: positions looked for in order while there is no map (position)
    searches: int = 0

    def position_map(self) -> dict[str, int]:
        """Each node's position in order (the nodes are distinct), built once."""
        positions = self.positions
        if positions is None:
            positions = self.positions = dict(zip(self.order, itertools.count()))
        return positions

    def position(self, name: str) -> int:
        """name's position in order; -1 when not asked. The first few are searched for in the list: an answer carried
        over a few nodes removed or added (_edited_order) is looked up a few nodes at a time, pod after pod, and a
        map of 5000 costs about as much as ten searches."""
        positions = self.positions
        if positions is None and self.searches < POSITIONS_SEARCHED_MAX:
            self.searches += 1
            try:
                return self.order.index(name)
            except ValueError:
                return -1
        return self.position_map().get(name, -1)

    def same_nodes(self, names: list[str]) -> bool:
        """Whether names are this answer's nodes, in any order (its nodes are distinct): each name's position read
        once, and every position met (a name given twice leaves one of them out)."""
        order = self.order
        if len(names) != len(order):
            return False
        if names == self.names or names == order:
            return True
        name_set = self.name_set.wanted()
        if name_set is not None:
            return name_set.same_names(names)
        return _permutation_of(names, self.position_map())


@dataclass(slots=True)
class FilterOutcome:
    passed: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    unresolvable: dict[str, str] = field(default_factory=dict)
    error: str = ""


class Scheduler:
    def __init__(
        self,
        state: ClusterState,
        binder: Binder,
        *,
        node_policy: str = DEFAULT_NODE_POLICY,
        gpu_policy: str = DEFAULT_GPU_POLICY,
        gates: Iterable[Gate] = (),
        policies: Mapping[str, type[Policy]] = REGISTRY,
        require_admission_mark: bool = False,
        fence: LeaderFence | None = None,
        gang_timeout_s: float = DEFAULT_GANG_TIMEOUT_S,
        gang_topology_labels: Sequence[str] = protocol.DEFAULT_GANG_TOPOLOGY_LABELS,
        nominations: Nominations | None = None,
        share_results: bool = True,
        batch_min_nodes: int = BATCH_MIN_NODES,
    ) -> None:
        self.state = state
        #: place a request shape once per node-equivalence class and keep each shape's answer (equivalence_key,
        #: _Answer); False: every node on its own, every verb over every node (tests compare the two)
        self.share_results = share_results
        #: nodes to place, at least, before a request shape's first pods go to the policy's batch placement
        self.batch_min_nodes = batch_min_nodes
        #: refuse GPU pods that did not pass the webhook (live clusters: `kube-vgpu extender` turns it on)
        self.require_admission_mark = require_admission_mark
        #: between scheduler replicas: binds reserve and write only in this replica's own leader term (fence.py)
        self.fence = fence
        #: all-or-nothing groups (gangs.py): members learnt from pod events, plans reserved in the state
        self.gangs = GangTracker(timeout_s=gang_timeout_s, clock=state.clock)
        #: node labels a gang's members prefer to share when they span nodes, narrowest first
        self.gang_topology_labels = tuple(gang_topology_labels)
        #: preemptions in progress and the running pods' priorities (preemption/nominations.py); decisions are
        #: made only once enable_preemption gave an Evictor
        #: (a caller whose source loads pods before the scheduler exists, a snapshot, passes one already listening)
        if nominations is None:
            nominations = Nominations(clock=state.clock)
            with state.lock:
                state.pod_listeners.append(nominations.on_pod)
        self.nominations = nominations
        self.preemptor: Preemptor | None = None
        with state.lock:
            state.pod_listeners.append(self.gangs.on_pod)
        self.binder = binder
        self._registry = policies  # name -> policy class; REGISTRY unless a caller adds policies of its own
        self._policies: dict[str, Policy] = {}
        self.default_node_policy = self.policy(node_policy)
        self.default_gpu_policy = self.policy(gpu_policy)
        self.gates = list(gates)
        # the request keys are interned so per-node caches are keyed by small ints
        self._request_keys: dict[Any, int] = {}
        self._next_request_key = 0
        #: request keys made but not judged yet (no node can hold a result under one): a new shape's batch then
        #: skips looking for results in 5000 nodes' caches (~1.5 ms)
        self._unjudged_keys: set[int] = set()
        # request key -> the policies' epochs its cached node results were computed under, and the nodes still
        # holding results of an older model (see _outdated_nodes)
        self._key_epochs: dict[int, tuple[int, int]] = {}
        self._outdated: dict[int, list[str]] = {}
        #: request keys whose outdated nodes the policy's batch placement has re-placed already: their lists hold
        #: only the nodes it left to be re-placed one by one (_refresh_in_batch)
        self._outdated_batched: set[int] = set()
        # request key -> (policies' epochs, equivalence key -> result of the node placed for that class)
        self._class_results: dict[int, _ClassResults] = {}
        # request key -> its answer (least recently used first)
        self._answers: dict[int, _Answer] = {}
        #: request key -> its last filter's outcome, for the next one of the shape that asks the same nodes
        #: (_RepeatedFilter), for the REPEATED_SHAPES shapes filtered last (least recently filtered first)
        self._last_filters: dict[int, _RepeatedFilter] = {}
        #: what the last new shape's batch read of its nodes, kept for the next (node_columns)
        self._node_columns: NodeColumns | None = None
        # the last _evaluate's policies, answer and pod, when it answered from a shape's answer (else None)
        self._answered_by: tuple[Policy, Policy, _Answer, Mapping[str, Any]] | None = None
        self._prepared: _PreparedScores | None = None
        #: the last answer prepared, for the next pod's to start from (_scores_carried_over): kept when a filter
        #: prepares nothing (an empty one), dropped when brought up to date in part
        self._carry: _PreparedScores | None = None
        #: how the last filter's passing nodes came from those of the filter before it, where they changed
        #: (_PassesEdit), for the prepared answer to carry over
        self._passes_edit: _PassesEdit | None = None
        #: the hosts the last prepared answer left out and added against the answer it was carried over from (its
        #: hosts otherwise in the same order), or None: where the server's reply layout may be edited, not laid out
        #: again (server.ScoreReplies)
        self.prepared_change: tuple[set[str], list[str]] | None = None
        #: pods seen by filter, for bind (which only gets name / uid)
        self._recent_pods = RecentPods()
        # pods between prepare_bind and the end of commit_bind
        self._binding: set[str] = set()
        self._binding_lock = threading.Lock()
        #: node name -> whose turn it is to write (extender/binding.py); binds to different nodes stay concurrent,
        #: and nothing waits on kubelet
        self.ordering = BindOrdering()
        #: hook for metrics: called once per filter and rejection reason (a FitFailure code, "stale", "nominated",
        #: "quota") with the number of nodes refused for it (per node, 1600 refusals cost ~3 ms of counter locks)
        self.on_rejection: Callable[[str, int], None] = lambda code, count: None

    def enable_preemption(self, evictor: Evictor, *, inline: bool = False,
                          max_in_flight: int = DEFAULT_MAX_IN_FLIGHT) -> None:
        """Preempt on GPU shares (issue 14) through this Evictor; `inline` runs evictions in the filter's thread
        (snapshot mode, tests)."""
        executor = EvictionExecutor(evictor, self.nominations, self.state.lock, max_in_flight=max_in_flight,
                                    inline=inline)
        self.preemptor = Preemptor(self.state, self.gangs, executor, self.gates)

    # --- policies -------------------------------------------------------------------------------
    def policy(self, name: str) -> Policy:
        found = self._policies.get(name)
        if found is None:
            found = make_policy(name, self._registry)
            self._policies[name] = found
            if found.uses_host_cpu or found.uses_host_memory:
                # from now on a node's CPU (memory) changes invalidate its cached results (see ClusterState)
                with self.state.lock:
                    self.state.touch_on_cpu_change |= found.uses_host_cpu
                    self.state.touch_on_memory_change |= found.uses_host_memory
        return found

    def _policies_for(self, request: PodGpuRequest) -> tuple[Policy, Policy]:
        try:
            node_policy = self.policy(request.node_policy) if request.node_policy else self.default_node_policy
            gpu_policy = self.policy(request.gpu_policy) if request.gpu_policy else self.default_gpu_policy
        except ValueError as exc:  # the message lists the known policies
            raise InvalidGpuRequest(str(exc)) from None
        return node_policy, gpu_policy

    @staticmethod
    def _placement_request(
        pod: Mapping[str, Any], request: PodGpuRequest, node_policy: Policy, gpu_policy: Policy
    ) -> PlacementRequest:
        """The engine's request; the pod's CPU (memory) request only when a policy reads it (it is then part of the
        cache key, so other policies keep sharing cache entries between pods of different CPU or memory asks)."""
        cpu = node_policy.uses_host_cpu or gpu_policy.uses_host_cpu
        memory = node_policy.uses_host_memory or gpu_policy.uses_host_memory
        if not cpu and not memory:
            return PlacementRequest(request)
        try:
            cpu_milli, memory_mib = host_asks(kubeapi.pod_requests(pod, HOST_RESOURCES))
        except kubeapi.InvalidQuantity:
            cpu_milli = memory_mib = 0  # a scoring hint: the API server never stores such a pod
        return PlacementRequest(request, cpu_milli=cpu_milli if cpu else 0, memory_mib=memory_mib if memory else 0)

    def _cache_key(self, request: PlacementRequest, node_policy: Policy, gpu_policy: Policy) -> int:
        shape = (request.gpu.containers, request.gpu.selectors, request.cpu_milli, request.memory_mib, node_policy.name,
                 gpu_policy.name)
        key = self._request_keys.get(shape)
        if key is None:
            if len(self._request_keys) > 100_000:  # bounded: a flood of unique shapes must not leak memory
                self._request_keys.clear()
                self._key_epochs.clear()
                self._unjudged_keys.clear()  # (their numbers never come back)
            # never reuse a number: nodes may still cache results under the old ones
            key = self._next_request_key
            self._next_request_key += 1
            self._request_keys[shape] = key
            self._unjudged_keys.add(key)
        return key

    def _first_judged(self, key: int) -> bool:
        """Whether this is the first judging under a request key (caller holds the state lock, and judges under it
        now): no node holds a result under it yet. Every judging asks, before it stores a result."""
        if key in self._unjudged_keys:
            self._unjudged_keys.discard(key)
            return True
        return False

    def _outdated_nodes(self, key: int, epochs: tuple[int, int]) -> list[str] | None:
        """Nodes whose cached result for this request shape predates the policies' current model (caller holds
        the state lock)."""
        known = self._key_epochs.get(key)
        if known != epochs:
            self._key_epochs[key] = epochs
            if known is not None or key in self._outdated:
                # every node may hold a result of the older model: work through all of them, a few per filter
                self._outdated.pop(key, None)
                self._outdated_batched.discard(key)
                if len(self._outdated) >= REFRESHING_SHAPES:
                    evicted = next(iter(self._outdated))
                    del self._outdated[evicted]
                    self._outdated_batched.discard(evicted)
                    self._key_epochs[evicted] = (-1, -1)  # seen again: start over
                self._outdated[key] = list(self.state.nodes)
        return self._outdated.get(key)

    def _classes_for(self, key: int, epochs: tuple[int, int]) -> _ClassResults:
        """The per-equivalence-class results of a request shape under the policies' current model (caller holds the
        state lock)."""
        entry = self._class_results.get(key)
        if entry is None or entry.epochs != epochs or len(entry.results) >= CLASS_RESULTS_PER_SHAPE:
            if entry is None and len(self._class_results) >= CLASS_RESULT_SHAPES:
                self._class_results.clear()
            entry = self._class_results[key] = _ClassResults(epochs)
        return entry

    @staticmethod
    def _place(node: NodeState, request: PlacementRequest, gpu_policy: Policy, node_policy: Policy,
               classes: dict[int, Placement | FitFailure] | None) -> Placement | FitFailure:
        """fit.place, once per node-equivalence class when `classes` is given (the results of this request shape
        under the current model): a node of a class already placed gets that class's result, under its own name."""
        if classes is not None:
            equivalence = equivalence_key(node)
            if equivalence is not None:
                shared = classes.get(equivalence)
                if shared is None:
                    shared = classes[equivalence] = place(node, request, gpu_policy, node_policy)
                    return shared
                return _named_for(shared, node.name)
        return place(node, request, gpu_policy, node_policy)

    def _place_in_batch(self, names: list[str], failed_answers: Mapping[str, FitFailure], key: int,
                        classes: _ClassResults, request: PlacementRequest, policy: Policy, now: float,
                        answer: _Answer | None, first_judged: bool = False) -> int:
        """Place the node-equivalence classes among `names` that the per-node loop would place one by one (no
        result cached, not placed for this shape yet, heartbeat fresh) with the policy's batch placement, if it has
        one, into `classes`; the loop then finds them there (caller holds the state lock). With the shape's
        answer, the nodes that pass go into it as the loop would put them (their placement, the answer's expiry;
        `names` holds none it passed before): how many, which the loop has nothing left to do for."""
        state = self.state
        journal_at = (state.journal_epoch, len(state.journal))
        if journal_at[0] == classes.batched_at[0] and journal_at[1] - classes.batched_at[1] < self.batch_min_nodes:
            return 0  # too few nodes changed since the last look to make a batch
        classes.batched_at = journal_at
        results = classes.results
        nodes = state.nodes
        ttl = state.heartbeat_ttl_s
        gathered: GroupColumns | None = None
        batch: tuple[list[NodeState], list[int], float] | None = None
        kept = self._kept_batch(names, failed_answers, key, results, now, ttl, first_judged)
        if isinstance(kept, tuple):  # read from the columns kept of these nodes
            todo, equivalences, earliest_heartbeat_s, gathered = kept
            batch = todo, equivalences, earliest_heartbeat_s
        elif kept is None:  # not all of them kept: every node read, and kept for the next new shape if more
            batch = _whole_batch(names, nodes, failed_answers, key, results, now, ttl, first_judged)
            known = self._node_columns
            if batch is not None and len(names) >= max(self.batch_min_nodes, len(known.names) if known else 0):
                columns = NodeColumns.gather(list(names), batch[0], batch[1], *journal_at)
                if columns is not None:
                    self._node_columns = columns
                    gathered = columns.gathered()
        if batch is not None:  # the usual new shape: every node asked is one to place
            todo, equivalences, earliest_heartbeat_s = batch
            asked = names
        else:
            todo, equivalences, earliest_heartbeat_s, asked = _batch_by_loop(names, nodes, failed_answers, key,
                                                                              results, now, ttl)
        if len(todo) < self.batch_min_nodes:
            return 0
        placed = policy.place_batch(todo, request, gathered)
        if placed is None:
            return 0
        if answer is None:
            for node, equivalence, result in zip(todo, equivalences, placed, strict=True):
                if result is not None:  # else left to the per-node loop
                    results[equivalence] = node.fit_cache[key] = result
            return 0
        passed = answer.passed
        before = len(passed)
        _store_placed(todo, asked, equivalences, placed, key, results, passed)
        if len(passed) > before and earliest_heartbeat_s + ttl < answer.expires_s:
            answer.expires_s = earliest_heartbeat_s + ttl
        return len(passed) - before

    def _refresh_in_batch(self, outdated: list[str], key: int, request: PlacementRequest, policy: Policy,
                          classes: dict[int, Placement | FitFailure]) -> None:
        """Re-place the outdated nodes (results of this request shape under an older model) in one batch of the
        policy's, where it has one, once per node-equivalence class as the filter does; `outdated` keeps only the
        nodes the batch left to fit.place (where the pod does not fit, or what its arrays do not cover), which the
        filter re-places a few per call (caller holds the state lock). One batch costs about a new shape's filter,
        once; one by one, STALE_REFRESH_PER_CALL nodes (~1.3 ms at 5000 nodes) went on every filter of the shape
        for ~300 pods after each change of the model."""
        nodes = self.state.nodes
        batch: list[NodeState] = []
        batch_classes: list[int | None] = []
        twins: list[tuple[NodeState, int]] = []  # of a class placed in the batch or before it
        seen: set[int] = set()
        for name in outdated:
            node = nodes.get(name)
            if node is None or key not in node.fit_cache:
                continue
            equivalence = node.equivalence_key or equivalence_key(node)  # cached on the node (0: None) but once
            if equivalence is not None:
                if equivalence in classes or equivalence in seen:
                    twins.append((node, equivalence))
                    continue
                seen.add(equivalence)
            batch.append(node)
            batch_classes.append(equivalence)
        placed = policy.place_batch(batch, request) if len(batch) >= self.batch_min_nodes else None
        if placed is None:
            return  # one by one, as without a batch
        answer = self._answers.get(key)
        left: list[str] = []
        for node, equivalence, result in zip(batch, batch_classes, placed, strict=True):
            if result is None:  # nor its twins: the filter places it alone
                left.append(node.name)
                continue
            if equivalence is not None:
                classes[equivalence] = result
            self._refreshed(node, key, result, answer)
        for node, equivalence in twins:
            shared = classes.get(equivalence)
            if shared is None:  # its class is left to fit.place
                left.append(node.name)
                continue
            self._refreshed(node, key, _named_for(shared, node.name), answer)
        outdated[:] = left

    def _kept_batch(self, names: list[str], failed_answers: Mapping[str, FitFailure], key: int,
                    results: Mapping[int, Placement | FitFailure], now: float, ttl: float, first_judged: bool = False,
                    ) -> tuple[list[NodeState], list[int], float, GroupColumns] | object | None:
        """_whole_batch's answer, and the batch's columns, read from the columns kept of these nodes (node_columns:
        the list a new shape was walked in, or part of it), patched from the journal (caller holds the state
        lock); None: none kept for all of them; _LOOP_DECIDES: they say not every node is one to place (the
        per-node loop sorts them out, no other reading of them needed)."""
        kept = self._node_columns
        if kept is None:
            return None
        state = self.state
        journal_epoch, position = state.journal_epoch, len(state.journal)
        if (kept.journal_epoch != journal_epoch or position - kept.journal_position > REBUILD_SHARE * len(kept.names)
                or not kept.patch(state.journal[kept.journal_position:position], state.nodes, equivalence_key,
                                  journal_epoch, position)):
            self._node_columns = None
            return None
        selected = kept.select(names)
        if selected is None:
            return None
        earliest_heartbeat_s = float(selected.heartbeats.min())  # NaN where a node has none
        if not now - earliest_heartbeat_s <= ttl or not selected.all_distinct_classes():
            return _LOOP_DECIDES
        if results and not results.keys().isdisjoint(selected.equivalences):
            return _LOOP_DECIDES
        if not first_judged and not _none_judged(names, selected.nodes, failed_answers, key):
            return _LOOP_DECIDES
        return selected.nodes, selected.equivalences, earliest_heartbeat_s, selected.gathered

    @staticmethod
    def _refreshed(node: NodeState, key: int, result: Placement | FitFailure, answer: _Answer | None) -> None:
        """Record a node re-placed under the current model in a batch (_refresh_in_batch)."""
        node.fit_cache[key] = result
        if answer is None:
            return
        # a node the answer passed passes still (fit does not depend on the model): its new placement, as the
        # filter would put it; prepared answers read its new score (refreshed)
        name = node.name
        if isinstance(result, Placement) and name in answer.passed:
            answer.passed[name] = result
        else:
            answer.passed.pop(name, None)
            answer.failed.pop(name, None)
        answer.note_refreshed(name)

    def _answer(self, key: int, now: float) -> _Answer:
        """The request shape's answer, brought up to date with the state's journal (caller holds the state lock)."""
        state = self.state
        state.trim_journal()
        journal = state.journal
        answers = self._answers
        answer = answers.pop(key, None)
        if answer is None or answer.journal_epoch != state.journal_epoch or now > answer.expires_s:
            answer = _Answer(state.journal_epoch, len(journal))
            if len(answers) >= ANSWERED_SHAPES:
                del answers[next(iter(answers))]
        elif answer.journal_position < len(journal):
            passed, failed = answer.passed, answer.failed
            for name in journal[answer.journal_position:]:
                passed.pop(name, None)
                failed.pop(name, None)
            answer.journal_position = len(journal)
        answers[key] = answer  # the most recently used last
        return answer

    # --- filter / prioritize ----------------------------------------------------------------------
    # complexity: filter's per-node loop, inlined on purpose: it runs for every node of every pod
    def _evaluate(  # noqa: C901
        self, pod: Mapping[str, Any], node_names: Iterable[str], refresh_budget: int = 0, repeatable: bool = False
    ) -> tuple[FilterOutcome, dict[str, Placement]]:
        """The filter's outcome for the pod on node_names, and the passing nodes' placements. refresh_budget: results
        of an older model to re-place on the way; repeatable: kube-scheduler's filter, whose outcome the next filter
        of the shape may repeat (_RepeatedFilter)."""
        outcome = FilterOutcome()
        placements: dict[str, Placement] = {}
        self._answered_by = None
        if not self.state.synced.is_set():
            # before the first full list, free-looking GPUs may be held by pods not seen yet: never guess
            outcome.error = NOT_SYNCED
            return outcome, placements
        try:
            request = protocol.parse_pod_gpu_request(pod)
            node_policy, gpu_policy = self._policies_for(request)
        except InvalidGpuRequest as exc:
            outcome.error = f"invalid GPU request: {exc}"
            return outcome, placements
        if self.require_admission_mark and not admitted_by_webhook(pod):
            outcome.error = NOT_ADMITTED
            return outcome, placements
        try:
            declared = gang_of(pod)
        except InvalidGang as exc:
            outcome.error = f"invalid gang: {exc}"
            return outcome, placements
        if declared is not None and not request.is_empty:
            return self._gang_outcome(pod, declared, node_names), placements
        uid = (pod.get("metadata") or {}).get("uid")
        placement_request = self._placement_request(pod, request, node_policy, gpu_policy)
        cacheable = node_policy.cacheable and gpu_policy.cacheable
        key = self._cache_key(placement_request, node_policy, gpu_policy)
        state = self.state
        ttl = state.heartbeat_ttl_s
        # observe under the lock: a model refresh must not interleave with a bind's place()
        with state.lock, contextlib.ExitStack() as burst:
            first_judged = self._first_judged(key)
            # a learning policy sees each pod once, in arrival order (kube-scheduler retries re-filter it)
            if uid and self._recent_pods.remember(uid, pod):
                node_policy.observe(placement_request)
                if gpu_policy is not node_policy:
                    gpu_policy.observe(placement_request)
            now = state.clock()
            nodes = state.nodes
            preemptor = self.preemptor
            held_nodes = self.nominations.by_node
            if held_nodes:
                self.nominations.expire()
            pod_priority = _priority(pod) if held_nodes else 0
            gpu_failed: list[str] = []  # nodes refused for GPU reasons only: where preemption could help
            rejected: dict[str, int] = {}  # nodes refused by a nomination or a gate (on_rejection)
            quota_failed: list[tuple[str, Placement]] = []  # GPUs fit, the quota gate refused
            if preemptor is not None and uid and self.nominations.by_preemptor:
                preemptor.before_filter(str(uid))
            classes = None
            class_results = None
            if cacheable:
                epochs = (node_policy.epoch(), gpu_policy.epoch())
                if self.share_results and groupable(placement_request, node_policy, gpu_policy):
                    class_results = self._classes_for(key, epochs)
                    classes = class_results.results
                outdated = self._outdated_nodes(key, epochs)
                if (outdated and refresh_budget > 0 and class_results is not None and node_policy is gpu_policy
                        and key not in self._outdated_batched):
                    self._outdated_batched.add(key)
                    if len(outdated) >= COLLECTOR_PAUSE_MIN_NODES:
                        burst.enter_context(collector_paused())
                    self._refresh_in_batch(outdated, key, placement_request, node_policy, class_results.results)
                budget_pops = refresh_budget * 4  # nodes without a result of this shape cost nothing to skip
                while outdated and refresh_budget > 0 and budget_pops > 0:
                    budget_pops -= 1
                    node = nodes.get(outdated.pop())
                    if node is not None and key in node.fit_cache:
                        node.fit_cache[key] = self._place(node, placement_request, gpu_policy, node_policy, classes)
                        refresh_budget -= 1
                        stale_answer = self._answers.get(key)
                        if stale_answer is not None:
                            stale_answer.note_refreshed(node.name)
                            stale_answer.passed.pop(node.name, None)
                            stale_answer.failed.pop(node.name, None)
                if outdated is not None and not outdated:
                    del self._outdated[key]
                    self._outdated_batched.discard(key)
            names = node_names if isinstance(node_names, list) else list(node_names)
            asked = names
            todo = names
            answer = None
            failed_answers: dict[str, FitFailure] = {}
            carried_todo: list[str] | None = None
            repeated: _RepeatedFilter | None = None  # the last filter's outcome, kept but for the changed nodes
            if repeatable:
                self._passes_edit = None
            codes: dict[str, str] = {}  # each refused node's rejection code, counted once the walk is done
            stale: list[str] = []  # nodes refused for a stale heartbeat
            if cacheable and self.share_results and not self.gates and not held_nodes:
                # every fitting node passes: the nodes already judged for this shape answer from its _Answer
                answer = self._answer(key, now)
                if not self.nominations.by_preemptor:
                    self._answered_by = (node_policy, gpu_policy, answer, pod)
                placements = answer.passed  # the caller reads it under the state lock
                failed_answers = answer.failed
                carried = self._carried_nodes(names, answer)
                if carried is not None:  # the nodes the last prepared answer passed: only its changed ones are read
                    names, carried_todo = carried
                    todo = carried_todo
                elif repeatable and (last := self._repeated_filter(key, names, answer)) is not None:
                    # the nodes the last filter asked: its outcome, but for the changed ones, judged below
                    repeated, todo = last
                    outcome.failed = repeated.failed.copy()
                    outcome.unresolvable = repeated.unresolvable.copy()
                    codes = repeated.codes.copy()
                    for name in todo:
                        outcome.failed.pop(name, None)
                        outcome.unresolvable.pop(name, None)
                        codes.pop(name, None)
                else:
                    outcome.passed = [name for name in names if name in placements] if placements else []
                    if len(outcome.passed) < len(names):
                        todo = [name for name in names if name not in placements] if outcome.passed else names
                    else:
                        todo = []
            judged_passes = False
            if len(todo) >= COLLECTOR_PAUSE_MIN_NODES:  # a result for each kept in the shape's answer (gcpolicy)
                burst.enter_context(collector_paused())
            if todo:  # many (a new shape): walked in the order the nodes' data lies in memory (NodeOrder)
                ordered = state.node_order.in_order(todo)
                if todo is names:  # and answered in it: the prepared answer then reads them so too
                    names = ordered
                todo = ordered
            judged = todo  # every node judged below, the batch's included (a repeated filter's changed nodes)
            if class_results is not None and len(todo) >= self.batch_min_nodes and node_policy is gpu_policy:
                batch_passed = self._place_in_batch(todo, failed_answers, key, class_results, placement_request,
                                                    node_policy, now, answer, first_judged)
                if batch_passed:
                    # passing nodes the batch put in the shape's answer itself (placements): the loop skips them (as
                    # many new answers as names: every name, each once)
                    todo = [] if batch_passed == len(todo) else [name for name in todo if name not in placements]
                    judged_passes = True
            for name in todo:
                known = failed_answers.get(name) if answer is not None else None
                if known is not None:
                    (outcome.unresolvable if known.unresolvable else outcome.failed)[name] = known.reason
                    codes[name] = known.code
                    if not known.unresolvable:
                        gpu_failed.append(name)
                    continue
                node = nodes.get(name)
                if node is None:
                    outcome.failed[name] = "not known to kube-vgpu yet (no GPU inventory seen)"
                    continue
                if not node.gpus:
                    error = state.inventory_errors.get(name)
                    outcome.unresolvable[name] = (
                        f"invalid GPU inventory ({error})"
                        if error
                        else "no GPUs (no kube-vgpu GPU inventory on this node)"
                    )
                    continue
                heartbeat_s = node.heartbeat_s
                if heartbeat_s is None or now - heartbeat_s > ttl:
                    age = "never" if heartbeat_s is None else f"{now - heartbeat_s:.0f} s ago"
                    outcome.failed[name] = f"GPU inventory stale (last heartbeat {age})"
                    codes[name] = "stale"
                    stale.append(name)
                    continue
                result = node.fit_cache.get(key) if cacheable else None
                if result is None:
                    result = self._place(node, placement_request, gpu_policy, node_policy, classes)
                    if cacheable:
                        node.fit_cache[key] = result
                if answer is not None:
                    expires_s = heartbeat_s + ttl
                    if expires_s < answer.expires_s:
                        answer.expires_s = expires_s
                    if isinstance(result, FitFailure):
                        failed_answers[name] = result
                    else:
                        judged_passes = True  # placements is the answer's: recorded below
                if isinstance(result, FitFailure):
                    (outcome.unresolvable if result.unresolvable else outcome.failed)[name] = result.reason
                    codes[name] = result.code
                    if not result.unresolvable:
                        gpu_failed.append(name)
                    continue
                if held_nodes and name in held_nodes and preemptor is not None:
                    held = preemptor.held(node, str(uid or ""), pod_priority, placement_request, gpu_policy,
                                          node_policy)
                    if held:
                        outcome.failed[name] = held
                        rejected["nominated"] = rejected.get("nominated", 0) + 1
                        continue
                gate_reason = None
                for gate in self.gates:
                    gate_reason = gate.check(pod, request, node)
                    if gate_reason:
                        break
                if gate_reason:
                    outcome.failed[name] = gate_reason
                    rejected["quota"] = rejected.get("quota", 0) + 1
                    quota_failed.append((name, result))
                    continue
                if answer is None:
                    outcome.passed.append(name)
                placements[name] = result
            for code, count in Counter(codes.values()).items():
                self.on_rejection(code, count)
            for code, count in rejected.items():
                self.on_rejection(code, count)
            if repeated is not None:
                outcome.passed, self._passes_edit = _repeated_passes(repeated, judged, placements)
                if not outcome.passed:  # every node it passed changed: those refused for their GPUs, in its order
                    gpu_failed = [name for name, code in codes.items() if code != "stale" and name in outcome.failed]
            elif carried_todo is not None:  # the last prepared answer's nodes, in its order
                passing = all(name in placements for name in carried_todo)
                outcome.passed = names.copy() if passing else [name for name in names if name in placements]
                if not passing and repeatable:  # (checked where used: only those refused now are left out)
                    self._passes_edit = _PassesEdit(names, {name for name in carried_todo if name not in placements},
                                                    [], outcome.passed)
            elif judged_passes:  # in the order walked, with the nodes that answered from the shape's answer
                # every node refused is named in failed or unresolvable: with none, every name passed
                passing = not outcome.failed and not outcome.unresolvable
                outcome.passed = names.copy() if passing else [name for name in names if name in placements]
            if repeatable and asked:  # (a filter of no node says nothing of the last one's nodes: it stays)
                self._last_filters.pop(key, None)
            if repeatable and answer is not None and carried_todo is None and outcome.passed:
                if len(self._last_filters) >= REPEATED_SHAPES:
                    del self._last_filters[next(iter(self._last_filters))]
                self._last_filters[key] = _RepeatedFilter(
                    answer, answer.refreshed, len(answer.refreshed), answer.journal_epoch, answer.journal_position,
                    asked, outcome.passed, outcome.failed, outcome.unresolvable, codes, stale,
                    repeated.name_set if repeated is not None else LazyNameSet(asked),
                    repeated.positions if repeated is not None else None)
            if not outcome.passed and preemptor is not None and uid and (gpu_failed or quota_failed):
                preemptor.on_unplaced(pod, str(uid), request, placement_request, gpu_policy, node_policy,
                                      gpu_failed, quota_failed, outcome.failed)
            for gate in self.gates:  # gates that track waiting pods (quota StrictFIFO) learn the whole outcome
                gate.observe_filter(pod, request, outcome.passed)
        return outcome, placements

    def filter(self, pod: Mapping[str, Any], node_names: Iterable[str]) -> FilterOutcome:
        return self._evaluate(pod, node_names, STALE_REFRESH_PER_CALL, repeatable=True)[0]

    def prioritize(self, pod: Mapping[str, Any], node_names: Iterable[str]) -> list[tuple[str, int]]:
        """Every node's score, 0..MAX_EXTENDER_SCORE, in the order asked."""
        names = node_names if isinstance(node_names, list) else list(node_names)
        nonzero = dict(self.nonzero_scores(pod, names))
        if not nonzero:
            return [(name, 0) for name in names]
        return [(name, nonzero.get(name, 0)) for name in names]

    def nonzero_scores(self, pod: Mapping[str, Any], node_names: Iterable[str]) -> list[tuple[str, int]]:
        """The nodes prioritize answers with, and their scores: the passing nodes' raw scores scaled from the lowest
        (0) to the highest (MAX_EXTENDER_SCORE), every node scored above 0 and those at 0 while they are few
        (ZERO_SCORES_KEPT_SHARE; kube-scheduler adds nothing for a node missing from the list, exactly as for a 0);
        none when the raw scores are equal. Raises InvalidGpuRequest."""
        names, scores = self.scaled_scores(pod, node_names)
        return list(zip(names, scores, strict=True))

    def prepare_scores(self, pod: Mapping[str, Any], passed: list[str]) -> tuple[list[str], list[int]] | None:
        """Compute prioritize's answer for the nodes a filter of this pod just passed, before kube-scheduler asks for
        it: the server calls this once the filter's reply is sent, in the moment kube-scheduler takes to ask (for
        5000 nodes most of prioritize's ~2 ms of work). scaled_scores then returns it, brought up to date, while it
        can be (_PreparedScores). None (and nothing kept) where it would not be reused: fewer than two nodes
        (kube-scheduler scores none), an invalid request, nodes named twice, a node no longer passing, or a filter
        that did not answer from a shape's answer (gates, nominations, gangs: their verdicts depend on more than
        the nodes' state)."""
        self._prepared = None
        self.prepared_change = None
        if len(passed) < 2 or not self._nodes_alone_decide():
            return None
        state = self.state
        with state.lock:
            # the same nodes as the last answer prepared, in any order: computed in that answer's order, so the
            # reply keeps its layout (kube-scheduler's parallel filter plugins order the nodes anew every pod)
            carry = self._carry if self._carry is not None and self._carry.same_nodes(passed) else None
            scored = self._scores_carried_over(carry, pod) if carry is not None else None
            edit = self._passes_edit
            previous = self._carry
            change = None
            if (carry is None and edit is not None and edit.result is passed and previous is not None
                    and (edit.base is previous.names or edit.base is previous.order)):
                # a few nodes left or joined the last answer's (a bind filled a node): carried over all the same
                scored = self._scores_carried_over(previous, pod, edit)
                if scored is not None:
                    change = (edit.gone, edit.new)
            if scored is None:
                order = carry.order if carry is not None else passed
                if carry is None and len(set(passed)) < len(passed):
                    return None
                raw = self._filtered_scores(pod, order)
                if raw is None:
                    try:
                        evaluated, raw = self._raw_scores(pod, order)
                    except InvalidGpuRequest:
                        return None
                    if len(evaluated) != len(order):  # (evaluated is order's passing nodes)
                        return None
                scaling = None
                positions = carry.positions if carry is not None else None
            else:
                raw, scaling, positions, order = scored
            answered_by = self._answered_by
            if answered_by is None:
                return None
            node_policy, gpu_policy, answer, _ = answered_by
            if scaling is None:
                scaling = _Scaling.of(order, raw)
            self._prepared = self._carry = _PreparedScores(
                pod, passed, order, (node_policy, gpu_policy), (node_policy.epoch(), gpu_policy.epoch()), answer,
                answer.refreshed, len(answer.refreshed), answer.journal_epoch, answer.journal_position,
                answer.expires_s, raw, scaling,
                previous.name_set if previous is not None and previous.order is order else LazyNameSet(order),
                positions,
            )
            self.prepared_change = change
        return scaling.answer

    def _scores_carried_over(self, previous: _PreparedScores, pod: Mapping[str, Any], edit: _PassesEdit | None = None
                             ) -> tuple[npt.NDArray[np.float64], _Scaling, dict[str, int] | None, list[str]] | None:
        """The previous pod's prepared scores carried over to this pod (caller holds the state lock, and has found
        the filter of this pod passed the same nodes, in any order: the scores keep the previous answer's), where
        that filter just answered from the same shape's answer, up to date: only the nodes changed since (the
        journal; the previous pod's bind) are read again, and rescored alone where the scaling allows
        (_Scaling.rescore). Consecutive pods of one shape then cost a few nodes, not a pass over 5000 (and the reply
        keeps its layout: ScoreReplies). With an edit (the filter passed the previous nodes less edit.gone, plus
        edit.new: _PassesEdit), those gone are taken out of the previous order and the new ones added at its end,
        and the scores scaled again (~0.1 ms over arrays, against ~2 ms to look 5000 nodes up afresh). None:
        compute afresh."""
        answered_by = self._answered_by
        if answered_by is None or answered_by[3] is not pod:
            return None
        node_policy, gpu_policy, answer, _ = answered_by
        state = self.state
        if (previous.answer is not answer or answer.refreshed is not previous.refreshed
                or previous.policies[0] is not node_policy or previous.policies[1] is not gpu_policy
                or (node_policy.epoch(), gpu_policy.epoch()) != previous.epochs
                or previous.journal_epoch != state.journal_epoch or answer.journal_epoch != state.journal_epoch
                or state.clock() > answer.expires_s):
            return None
        # as of the filter (the shape's answer's journal position): changes since, prioritize reads (_prepared_for)
        changed = self._changed_since(answer, previous.journal_position, previous.refreshed_position)
        if changed is None:
            return None
        raw = previous.raw.copy()
        scaling = previous.scaling.copy()
        gone = edit.gone if edit is not None else frozenset()
        rescale = edit is not None  # (an edit scales anew: the nodes scaled are others)
        for name in changed:
            if name in gone:
                continue  # taken out below
            position = previous.position(name)
            if position < 0:
                continue  # not asked: its score is not in the answer (or a new node: read below)
            placement = answer.passed.get(name)
            if placement is None:
                return None  # (not passing: the filter would not have passed it)
            old, raw[position] = float(raw[position]), placement.score
            if not rescale and old != placement.score:
                rescale = not scaling.rescore(raw, position, old)
        order = previous.order
        positions = previous.positions
        if edit is not None:
            edited = self._edited_order(previous, edit, answer, raw)
            if edited is None:
                return None
            order, raw = edited
            positions = None  # (built again when needed: _PreparedScores.position)
        return raw, (_Scaling.of(order, raw) if rescale else scaling), positions, order

    @staticmethod
    def _edited_order(previous: _PreparedScores, edit: _PassesEdit, answer: _Answer, raw: npt.NDArray[np.float64]
                      ) -> tuple[list[str], npt.NDArray[np.float64]] | None:
        """previous's order and raw scores less the nodes edit.gone, plus edit.new (their scores from the shape's
        answer) at the end; None where the edit does not fit (a node gone that was not there, or one new that was or
        does not pass): compute afresh."""
        if len(edit.gone) + len(edit.new) > CARRIED_CHANGES_MAX or len(set(edit.new)) < len(edit.new):
            return None
        removed = sorted(map(previous.position, edit.gone))
        if removed and removed[0] < 0:
            return None
        order = previous.order.copy()
        for position in reversed(removed):
            del order[position]
        added = []
        for name in edit.new:
            placement = answer.passed.get(name)
            if placement is None or previous.position(name) >= 0:
                return None
            added.append(placement.score)
        order += edit.new
        if len(order) != len(edit.result):
            return None  # (the filter's list is not this edit of these nodes)
        raw = np.delete(raw, removed) if removed else raw
        if added:
            raw = np.concatenate((raw, np.array(added, dtype=np.float64)))
        return order, raw

    def _carried_nodes(self, names: list[str], answer: _Answer) -> tuple[list[str], list[str]] | None:
        """Where names are the nodes of the last prepared answer (self._carry) in any order, and it is of the same
        shape's answer, as it is now (caller holds the state lock): its nodes in its order, and those of them the
        shape's answer no longer passes, to judge again. The rest still pass: the carried answer's nodes all passed
        as of its journal position, and a node leaves the shape's answer only through the journal or its
        refreshed list. kube-scheduler's parallel filter plugins name the nodes in a new order every pod: this
        reads each name once, as the passing check would, and replies in the carried answer's order, which
        prioritize then asks in, so the prepared answer carries over without matching a permutation again. None:
        judge the names as asked."""
        carry = self._carry
        if (carry is None or len(names) < CARRIED_MIN_NODES or carry.answer is not answer
                or answer.refreshed is not carry.refreshed or carry.journal_epoch != self.state.journal_epoch
                or not carry.same_nodes(names)):
            return None
        changed = self._changed_since(answer, carry.journal_position, carry.refreshed_position)
        if changed is None:
            return None
        positions = carry.position_map()
        placements = answer.passed
        return carry.order, [name for name in changed if name in positions and name not in placements]

    def _changed_since(self, answer: _Answer, journal_position: int, refreshed_position: int
                       ) -> dict[str, None] | None:
        """The nodes whose verdicts in the shape's answer changed since a carried or repeated answer was taken from
        it (caller holds the state lock): the state's journal from its position up to the answer's, then the
        answer's refreshed list from its position; each once, in order. None: more than CARRIED_CHANGES_MAX, so
        judging afresh is cheaper."""
        changed = dict.fromkeys(itertools.chain(self.state.journal[journal_position:answer.journal_position],
                                                answer.refreshed[refreshed_position:]))
        return None if len(changed) > CARRIED_CHANGES_MAX else changed

    def _repeated_filter(self, key: int, names: list[str], answer: _Answer
                         ) -> tuple[_RepeatedFilter, list[str]] | None:
        """Where names are the nodes the shape's last filter asked (in any order), and it answered from the shape's
        answer as it is now (caller holds the state lock): that filter's outcome and the nodes asked to judge again,
        those changed since and those stale (few: else None, judge the names as asked)."""
        last = self._last_filters.get(key)
        if (last is None or last.answer is not answer or answer.refreshed is not last.refreshed
                or last.journal_epoch != self.state.journal_epoch or not last.same_nodes(names)):
            return None
        changed = self._changed_since(answer, last.journal_position, last.refreshed_position)
        if changed is None:
            return None
        positions = last.position_map()
        return last, [*(name for name in changed if name in positions),
                      *(name for name in last.stale if name not in changed)]

    def _nodes_alone_decide(self) -> bool:
        """Whether a node's verdict for a pod depends on the node's state alone: no gate (quota) and no nomination
        (preemption) could refuse it."""
        return not (self.gates or self.nominations.by_node or self.nominations.by_preemptor)

    def _filtered_scores(self, pod: Mapping[str, Any], passed: list[str]) -> npt.NDArray[np.float64] | None:
        """The passing nodes' scores straight from the shape's answer the filter of this very pod just filled, if
        nothing changed since (caller holds the state lock): the filter's own evaluation, not a second one."""
        answered_by = self._answered_by
        if answered_by is None or answered_by[3] is not pod:
            return None
        state, answer = self.state, answered_by[2]
        # as of the filter: nodes changed since (a watch event between the filter's reply and now) are read again
        # when prioritize asks (_prepared_for), as for any change after the preparing
        if answer.journal_epoch != state.journal_epoch or state.clock() > answer.expires_s:
            return None
        try:
            return _scores_of(answer.passed, passed)
        except KeyError:  # not every node passed
            return None

    def _prepared_for(self, pod: Mapping[str, Any], names: list[str]) -> _PreparedScores | None:
        """The prepared answer brought up to date, if it is this pod's and these nodes' (caller holds the state
        lock). Nodes changed since it was computed (the state's journal, as for a shape's _Answer) are judged again
        one by one and the scores scaled anew; more than PREPARED_CHANGES_MAX of them, or one that no longer passes,
        and it is dropped."""
        prepared = self._prepared
        if prepared is None or pod != prepared.pod or names != prepared.names:
            return None
        state = self.state
        node_policy, gpu_policy = prepared.policies
        if ((node_policy.epoch(), gpu_policy.epoch()) != prepared.epochs
                or state.journal_epoch != prepared.journal_epoch or state.clock() > prepared.expires_s
                or not self._nodes_alone_decide()):
            self._prepared = self._carry = None  # (the carry is the same answer)
            return None
        journal = state.journal
        if prepared.journal_position < len(journal):
            changed = set(journal[prepared.journal_position:])
            prepared.journal_position = len(journal)
            if len(changed) > PREPARED_CHANGES_MAX:
                self._prepared = self._carry = None  # (the carry is the same answer)
                return None
            raw = prepared.raw
            rescale = False
            for name in changed:
                position = prepared.position(name)
                if position < 0:
                    continue  # not asked: its score is not in the answer
                outcome, placements = self._evaluate(pod, [name])
                placement = placements.get(name)
                answered_by = self._answered_by
                if outcome.error or not outcome.passed or placement is None or answered_by is None:
                    self._prepared = self._carry = None  # (the carry is the same answer)
                    return None
                old, raw[position] = float(raw[position]), placement.score
                prepared.expires_s = min(prepared.expires_s, answered_by[2].expires_s)
                if not rescale and old != placement.score:
                    rescale = not prepared.scaling.rescore(raw, position, old)
            if rescale:
                prepared.scaling = _Scaling.of(prepared.order, raw)
        return prepared

    def scaled_scores(self, pod: Mapping[str, Any], node_names: Iterable[str]) -> tuple[list[str], list[int]]:
        """nonzero_scores as two lists, names and scores (the server encodes them without a pair per node)."""
        names = node_names if isinstance(node_names, list) else list(node_names)
        with self.state.lock:
            prepared = self._prepared_for(pod, names)
            if prepared is not None:
                return prepared.scaling.answer
            passed, raw = self._raw_scores(pod, names)
        return _scaled(passed, raw)

    def _raw_scores(self, pod: Mapping[str, Any], names: list[str]) -> tuple[list[str], npt.NDArray[np.float64]]:
        """The passing nodes among names and their policy scores (caller holds the state lock: placements may be a
        shape's answer, which the next verb updates). Raises InvalidGpuRequest."""
        # no re-placing of outdated results here: filter just did it for this pod (prioritize is the slower verb)
        outcome, placements = self._evaluate(pod, names)
        if outcome.error:
            raise InvalidGpuRequest(outcome.error)
        return outcome.passed, _scores_of(placements, outcome.passed)

    # --- gangs (all-or-nothing; extender/gangs.py) -------------------------------------------------
    def _gang_outcome(
        self, pod: Mapping[str, Any], declared: tuple[GangKey, int], node_names: Iterable[str]
    ) -> FilterOutcome:
        """A gang member passes only the node planned for it; the gang is planned whole, once every member exists."""
        outcome = FilterOutcome()
        names = list(node_names)
        uid = str((pod.get("metadata") or {}).get("uid") or "")
        state = self.state
        with state.lock:
            for _expired, released in self.gangs.expired():
                for member_uid in released:
                    state.release(member_uid, only_unconfirmed=True)
            gang = self.gangs.note(uid, pod, *declared, known=self._bound_members)
            gang.members[uid].feasible = frozenset(names)  # what kube-scheduler's own plugins allow it
            node = gang.plan.get(uid)
            if node is not None and uid not in state.pods:
                del gang.plan[uid]  # its reservation went (a failed bind released it): plan it again
                node = None
            reason = ""
            if node is None:
                reason = self._plan_gang(gang, uid)
                node = gang.plan.get(uid)
            if node is None:
                if not reason and not gang.members[uid].bound_to:
                    reason = (f"gang {gang.key}: this member is beyond the gang's {gang.size} members and is placed "
                              "after them, on its own")
                why = reason or f"gang {gang.key}: this member is already bound"
                outcome.failed = dict.fromkeys(names, why)
                return outcome
            for name in names:
                if name == node:
                    outcome.passed.append(name)
                else:
                    outcome.failed[name] = f"gang {gang.key}: this member's GPUs are reserved on node {node}"
            return outcome

    def _bound_members(self, key: GangKey) -> list[Member]:
        """Members the state holds as bound (from their assignments), for a gang first seen after they were loaded."""
        return [
            Member(record.uid, record.name, "", {}, bound_to=record.node_name)
            for record in self.state.pods.values()
            if record.namespace == key.namespace and record.confirmed
            and record.labels.get(protocol.LABEL_KUEUE_POD_GROUP_NAME) == key.name
        ]

    def _plan_gang(self, gang: Gang, uid: str) -> str:
        """Place and reserve the pending members at once (caller holds the state lock); "" when planned, else why
        the gang waits (then nothing is reserved). Only the first `size` members (in creation order) are planned
        together: a coscheduling PodGroup's minMember means "at least", so members beyond it must not hold the gang
        back (nor wait for a capacity the gang never needed); once `size` members are planned or bound, each of them
        (`uid`, the member being filtered) is planned on its own."""
        now = self.state.clock()
        if now < gang.retry_after_s:
            # back-off after a timed-out plan: say when the next try comes, so nobody waits blind
            return f"{gang.waiting}; next plan in {max(1, round(gang.retry_after_s - now))} s"
        if len(gang.members) < gang.size:
            missing = gang.size - len(gang.members)
            gang.waiting = (f"gang {gang.key}: {len(gang.members)} of {gang.size} members created; waiting for "
                            f"{missing} more pod(s) labelled {protocol.LABEL_KUEUE_POD_GROUP_NAME}={gang.key.name} "
                            f"in namespace {gang.key.namespace} before placing any (the size is the annotation "
                            f"{protocol.ANNOTATION_KUEUE_POD_GROUP_TOTAL_COUNT}={gang.size})")
            return gang.waiting
        reserved: list[str] = []
        started = gang.bound() + len(gang.plan)
        pending = gang.pending()
        if started < gang.size:
            pending = pending[:gang.size - started]
        else:
            pending = [member for member in pending if member.uid == uid]
        for member in pending:
            why = self._plan_member(gang, member.uid, member.pod)
            if why:
                for member_uid in reserved:
                    gang.plan.pop(member_uid, None)
                    self.state.release(member_uid, only_unconfirmed=True)
                fit = gang.bound() + len(gang.plan) + len(reserved)
                gang.waiting = _no_percent(f"gang {gang.key}: {fit} of {gang.size} members fit; waiting for {why}")
                return gang.waiting
            reserved.append(member.uid)
        gang.planned_at_s = now
        gang.waiting = ""
        return ""

    def _held(self, node: NodeState, uid: str, pod: Mapping[str, Any], request: PlacementRequest,
              gpu_policy: Policy, node_policy: Policy) -> str | None:
        """Why the node's GPUs are held against this pod for a nominated preemptor (None: they are not)."""
        if self.preemptor is None or node.name not in self.nominations.by_node:
            return None
        return self.preemptor.held(node, uid, _priority(pod), request, gpu_policy, node_policy)

    def _plan_member(self, gang: Gang, uid: str, pod: Mapping[str, Any]) -> str:
        """Reserve the best node for one member (preferring nodes the gang already uses); "" or why it fits nowhere."""
        try:
            request = protocol.parse_pod_gpu_request(pod)
            node_policy, gpu_policy = self._policies_for(request)
        except InvalidGpuRequest as exc:
            return f"member {(pod.get('metadata') or {}).get('name')}: invalid GPU request: {exc}"
        if request.is_empty:
            gang.plan[uid] = ""  # asks for no GPU: nothing to reserve
            return ""
        state = self.state
        placement_request = self._placement_request(pod, request, node_policy, gpu_policy)
        # the nodes' cached results of this request shape serve here too (a gang's members usually share one)
        cacheable = node_policy.cacheable and gpu_policy.cacheable
        key = self._cache_key(placement_request, node_policy, gpu_policy)
        self._first_judged(key)  # results are stored under it below
        used_nodes = set(gang.plan.values()) | {m.bound_to for m in gang.members.values() if m.bound_to}
        # the topology domains (rack, zone, ...) the gang already occupies: a member that needs another node prefers
        # one in the same rack, else the same zone (fewer hops between the gang's members)
        used_domains = [
            {value for used in used_nodes if used and (value := _label_of(state, used, label))}
            for label in self.gang_topology_labels
        ]
        feasible = gang.members[uid].feasible
        best: tuple[tuple[bool, tuple[bool, ...], float, str], NodeState, Placement] | None = None
        misses = _Misses()  # why each node was passed over: the reason counts them when none is left
        for node in state.nodes.values():
            age = state.heartbeat_age_s(node)
            if not node.gpus or age is None or age > state.heartbeat_ttl_s:
                misses.add(_NO_INVENTORY, node.name, "")
                continue
            # only nodes kube-scheduler would allow it: the nodes it last offered for this member, if it did, and
            # the member's node selector and required affinity in any case
            if (feasible is not None and node.name not in feasible) or not kubeapi.node_matches_pod(
                pod, node.labels, node.name
            ):
                misses.add(_NOT_OFFERED, node.name, "")
                continue
            result = node.fit_cache.get(key) if cacheable else None
            if result is None:
                result = place(node, placement_request, gpu_policy, node_policy)
                if cacheable:
                    node.fit_cache[key] = result
            if isinstance(result, FitFailure):
                misses.add(_NO_ROOM, node.name, result.reason, node.name in used_nodes)
                continue
            held = self._held(node, uid, pod, placement_request, gpu_policy, node_policy)
            if held:  # its GPUs are promised to a preemptor of higher or equal priority
                misses.add(_NO_ROOM, node.name, held, node.name in used_nodes)
                continue
            refused = next((r for r in (gate.check(pod, request, node) for gate in self.gates) if r), None)
            if refused:
                misses.add(_QUOTA, node.name, refused, node.name in used_nodes)
                continue
            near = tuple(node.labels.get(label, "") in domains for label, domains in
                         zip(self.gang_topology_labels, used_domains, strict=True))
            rank = (node.name in used_nodes, near, result.score, node.name)
            if best is None or rank[:3] > best[0][:3]:
                best = (rank, node, result)
        member_text = f"member {(pod.get('metadata') or {}).get('name')} ({_shape(request)})"
        if best is None:
            return f"a node for {member_text}: {misses.describe(len(gang.plan))}"
        _, node, placement = best
        for gate in self.gates:
            refusal = gate.reserve(pod, request, node, uid)
            if refusal:
                return f"quota for {member_text} on node {node.name}: {refusal}"
        metadata = pod.get("metadata") or {}
        state.reserve(uid, str(metadata.get("namespace") or ""), str(metadata.get("name") or ""),
                      assignment_from_placement(node, placement), metadata.get("labels") or {})
        gang.plan[uid] = node.name
        return ""

    def _planned_gang_bind(self, namespace: str, name: str, uid: str, node_name: str) -> PreparedBind | None:
        """The bind of a planned gang member: its reservation, as planned (no new placement); None when the pod is
        not a planned member."""
        with self.state.lock:
            gang = self.gangs.gang_of_uid(uid)
            if gang is None or uid not in gang.plan:
                return None
            planned = gang.plan[uid]
            if planned != node_name:
                raise BindError(f"gang {gang.key}: member {namespace}/{name} is reserved on node {planned}, "
                                f"not {node_name}")
            record = self.state.pods.get(uid)
            if record is None or record.confirmed or record.bound:
                del gang.plan[uid]
                return None  # its reservation went meanwhile: bind it as any pod (re-placed on fresh state)
            return PreparedBind(namespace, name, uid, node_name, record.assignment_text)

    # --- bind -----------------------------------------------------------------------------------
    def bind(self, namespace: str, name: str, uid: str, node_name: str) -> None:
        """Decide the exact GPUs and commit in the node's turn, blocking this thread (the blocking face of
        extender/binding.py; the HTTP server uses its async face). Raises BindError; idempotent for a repeat."""
        prepared = self.prepare_bind(namespace, name, uid, node_name)
        if prepared is not None:
            self.ordering.commit_blocking(self, prepared)

    def recent_pod(self, uid: str) -> Mapping[str, Any] | None:
        """The pod as filter last saw it; given to prepare_bind, no API call is needed (it may run on an event
        loop)."""
        return self._recent_pods.get(uid)

    def prepare_bind(
        self, namespace: str, name: str, uid: str, node_name: str, pod: Mapping[str, Any] | None = None
    ) -> PreparedBind | None:
        """Decide the exact GPUs and reserve them in memory, at once: filter and prioritize of the next pods
        already see them while this bind waits for its turn on the node. None if the pod is already bound as
        asked (a repeat). Raises BindError. Needs no node lock; reads the pod from the API only when it is neither
        given nor recently seen by filter."""
        with self._binding_lock:
            if uid in self._binding:
                raise BindError(f"pod {namespace}/{name} is already being bound")
            self._binding.add(uid)
        try:
            prepared = self._prepare(namespace, name, uid, node_name, pod)
        except BaseException:
            self._done_binding(uid)
            raise
        if prepared is None:
            self._done_binding(uid)
        return prepared

    def _done_binding(self, uid: str) -> None:
        with self._binding_lock:
            self._binding.discard(uid)

    def _prepare(
        self, namespace: str, name: str, uid: str, node_name: str, pod: Mapping[str, Any] | None
    ) -> PreparedBind | None:
        state = self.state
        if not state.synced.is_set():
            raise BindError(NOT_SYNCED)
        self._check_fence()
        self._settle_uncertain(namespace, name, uid)
        with state.lock:
            existing = state.pods.get(uid)
            if existing is not None and existing.node_name == node_name and existing.bound:
                # a repeat of a bind that took effect (its reply said so, or the watch): same answer, nothing counted
                # twice and nothing re-placed (the watch may not have shown the first bind yet)
                return None
            self._refuse_if_bound_elsewhere(existing, namespace, name, node_name)
        if pod is None:
            pod = self._recent_pods.get(uid)
        pod = self._pod_to_bind(namespace, name, uid, node_name, pod)
        try:
            request = protocol.parse_pod_gpu_request(pod)
            node_policy, gpu_policy = self._policies_for(request)
        except InvalidGpuRequest as exc:
            raise BindError(f"invalid GPU request: {exc}") from None
        if self.require_admission_mark and not admitted_by_webhook(pod):
            raise BindError(NOT_ADMITTED)
        planned = self._planned_gang_bind(namespace, name, uid, node_name)
        if planned is not None:
            self.binder.remember_pod(pod)
            return planned
        self.binder.remember_pod(pod)

        with state.lock:
            node = state.nodes.get(node_name)
            if node is None:
                raise BindError(f"node {node_name}: not known to kube-vgpu")
            age = state.heartbeat_age_s(node)
            if age is None or age > state.heartbeat_ttl_s:
                raise BindError(f"node {node_name}: GPU inventory stale, not binding")
            previous = state.pods.get(uid)
            self._refuse_if_bound_elsewhere(previous, namespace, name, node_name)
            if previous is not None:
                if previous.bound:
                    return None  # bound meanwhile (a concurrent repeat): nothing to do
                # an earlier attempt left a reservation that was never written (e.g. on another node): superseded
                state.release(uid, only_unconfirmed=True)
            placement_request = self._placement_request(pod, request, node_policy, gpu_policy)
            placement = place(node, placement_request, gpu_policy, node_policy)
            if isinstance(placement, FitFailure):
                raise BindError(placement.reason)
            for gate in self.gates:
                reason = gate.reserve(pod, request, node, uid)
                if reason:
                    raise BindError(reason)
            assignment = assignment_from_placement(node, placement)
            labels = (pod.get("metadata") or {}).get("labels") or {}
            state.reserve(uid, namespace, name, assignment, labels)
        return PreparedBind(namespace, name, uid, node_name, protocol.encode_assignment(assignment))

    def _settle_uncertain(self, namespace: str, name: str, uid: str) -> None:
        """Before a new bind of a pod whose earlier Binding has an unknown outcome: read the pod. Bound there: the
        record is its usage (a bind elsewhere is then refused); not bound: the reservation may be superseded."""
        with self.state.lock:
            record = self.state.pods.get(uid)
            if record is None or not record.uncertain:
                return
        try:
            pod = self.binder.get_pod(namespace, name)
        except Exception as exc:
            raise BindError(f"an earlier bind of {namespace}/{name} to {record.node_name} has an unknown outcome and "
                            f"the pod cannot be read ({exc}); retried once the API server answers") from None
        with self.state.lock:
            current = self.state.pods.get(uid)
            if current is not record:
                return  # the watch settled it meanwhile
            bound_to = (pod or {}).get("spec", {}).get("nodeName") if pod else None
            if pod is not None and (pod.get("metadata") or {}).get("uid") == uid and bound_to == record.node_name:
                record.bound = True
            record.uncertain = False

    def _pod_to_bind(
        self, namespace: str, name: str, uid: str, node_name: str, pod: Mapping[str, Any] | None
    ) -> Mapping[str, Any]:
        """The pod object a bind decides on: the one filter saw, else read from the API; refused when it is gone,
        another pod of that name, or already bound to another node."""
        if pod is None:
            try:
                pod = self.binder.get_pod(namespace, name)
            except Exception as exc:  # the API server did not answer in time: an Error for kube-scheduler, not a 500
                raise BindError(f"reading pod {namespace}/{name} failed: {exc}") from None
        if pod is None:
            raise BindError(f"pod {namespace}/{name} not found")
        if (pod.get("metadata") or {}).get("uid") not in (None, uid):
            raise BindError(f"pod {namespace}/{name} has a different UID than the one being bound")
        bound_to = (pod.get("spec") or {}).get("nodeName")
        if isinstance(bound_to, str) and bound_to and bound_to != node_name:
            raise BindError(f"pod {namespace}/{name} is already bound to node {bound_to}; not binding it to "
                            f"{node_name} (a late or repeated bind)")
        return pod

    @staticmethod
    def _refuse_if_bound_elsewhere(record: PodRecord | None, namespace: str, name: str, node_name: str) -> None:
        """A pod whose bind took effect (seen bound, or its Binding answered) keeps its node and its usage: a late
        or duplicate bind to another node (kube-scheduler retried after its 30 s timeout) must not touch them."""
        if record is not None and (record.bound or record.confirmed) and record.node_name != node_name:
            raise BindError(f"pod {namespace}/{name} is already bound to node {record.node_name}; not binding it to "
                            f"{node_name} (a late or repeated bind)")

    def commit_bind(self, prepared: PreparedBind) -> None:
        """Write the prepared decision; the caller holds the node's turn (request_turn). On failure the
        reservation is released and BindError raised."""
        try:
            self._commit(prepared)
        finally:
            self._done_binding(prepared.uid)

    def _commit(self, prepared: PreparedBind) -> None:
        namespace, name, uid, node_name = prepared.namespace, prepared.name, prepared.uid, prepared.node_name
        with self.state.lock:
            record = self.state.pods.get(uid)
            if record is None or record.node_name != node_name:
                # the pod was deleted while its bind waited for the node (the delete dropped the reservation)
                raise BindError(f"pod {namespace}/{name} went away while waiting to be bound to {node_name}")
            queue = record.labels.get(protocol.LABEL_KUEUE_QUEUE_NAME, "")
        # The assignment travels in the Binding: the API server copies a Binding's annotations onto the pod as
        # it sets spec.nodeName, so the pod is never bound without its assignment nor annotated without being
        # bound. The bind time, taken once the node's turn came, orders a node's pending pods for Allocate.
        annotations = {
            protocol.POD_ASSIGNMENT_ANNOTATION: prepared.assignment,
            protocol.POD_BIND_TIME_ANNOTATION: protocol.format_bind_time(dt.datetime.now(dt.UTC)),
            # the queue whose quota this pod uses, fixed for its life (state.pod_labels_at_bind reads it back)
            protocol.POD_QUEUE_ANNOTATION: queue,
        }
        try:
            self._check_fence()  # the last moment before the write: the term may have ended while this bind waited
        except BindError:
            self.state.release(uid, only_unconfirmed=True)
            raise
        try:
            self.binder.bind(namespace, name, uid, node_name, annotations)
        except Exception as exc:
            verdict = self._bound_as_asked(namespace, name, uid, node_name, annotations)
            if verdict is None:
                # written or not, nobody can tell now: keep the GPUs reserved (the watch confirms the pod, or its
                # next bind reads the pod first, or its delete drops it); freeing them could over-commit
                with self.state.lock:
                    record = self.state.pods.get(uid)
                    if record is not None and not record.confirmed:
                        record.uncertain = True
                raise BindError(f"binding {namespace}/{name} to {node_name} failed ({exc}) and its outcome could not "
                                "be read back; its GPUs stay reserved until the API server shows it") from None
            if not verdict:
                self.state.release(uid, only_unconfirmed=True)
                raise BindError(f"binding {namespace}/{name} to {node_name} failed: {exc}") from None
            # else the call failed after the API server committed it (a timeout, a lost reply)
        # The Binding took effect: from now on the reservation is the pod's real usage, before the watch says so
        # (a late bind of the same pod to another node must find it bound, not a reservation to supersede).
        self.state.mark_bound(uid, node_name)
        with self.state.lock:
            self.gangs.mark_bound(uid, node_name)

    def _check_fence(self) -> None:
        if self.fence is not None:
            reason = self.fence.refusal()
            if reason:
                raise BindError(reason)

    def abandon_bind(self, prepared: PreparedBind) -> None:
        """Give up a prepared bind that will not be committed (its caller went away)."""
        try:
            self.state.release(prepared.uid, only_unconfirmed=True)
        finally:
            self._done_binding(prepared.uid)

    def _bound_as_asked(
        self, namespace: str, name: str, uid: str, node_name: str, annotations: Mapping[str, str]
    ) -> bool | None:
        """After a failed Binding call: did it take effect anyway? None when that cannot be read either."""
        try:
            pod = self.binder.get_pod(namespace, name)
        except Exception:
            return None
        if pod is None or (pod.get("metadata") or {}).get("uid") != uid:
            return False
        if (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
            return False  # a repeat of a bind whose pod has finished meanwhile: nothing to count
        written = (pod.get("metadata") or {}).get("annotations") or {}
        return (pod.get("spec") or {}).get("nodeName") == node_name and written.get(
            protocol.POD_ASSIGNMENT_ANNOTATION
        ) == annotations[protocol.POD_ASSIGNMENT_ANNOTATION]


def _priority(pod: Mapping[str, Any]) -> int:
    value = (pod.get("spec") or {}).get("priority")
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _label_of(state: ClusterState, node_name: str, label: str) -> str:
    node = state.nodes.get(node_name)
    return node.labels.get(label, "") if node is not None else ""


def _shape(request: PodGpuRequest) -> str:
    """A member's ask, for gang reasons: '2 x 40960 MiB, gpucores 50'."""
    parts = []
    for container in request.containers:
        if container.memory_mib is not None:
            memory = f"{container.memory_mib} MiB"
        elif container.memory_percent is not None:
            memory = f"gpumem-percentage {container.memory_percent}"
        else:
            memory = "a whole GPU"
        # no '%': kube-scheduler formats an extender's reason as a format string in its events
        parts.append(f"{container.count} x {memory}, gpucores {container.cores}")
    return "; ".join(parts)


# why _plan_member passed a node over, in the order its reason lists them
_NO_ROOM = "whose GPUs cannot take it"
_QUOTA = "refused by quota"
_NOT_OFFERED = "not offered for it by kube-scheduler (its node selector, affinity, taints or other resources)"
_NO_INVENTORY = "without GPUs or a fresh GPU inventory"


@dataclass(slots=True)
class _Misses:
    """The nodes a gang member fits on none of, counted by why, with the first such node's own words for each."""

    counts: dict[str, int] = field(default_factory=dict)
    first: dict[str, str] = field(default_factory=dict)
    #: whys whose example is a node the gang itself uses (a node it does not use is the better example)
    example_is_gang_node: set[str] = field(default_factory=set)

    def add(self, why: str, node_name: str, detail: str, gang_node: bool = False) -> None:
        self.counts[why] = self.counts.get(why, 0) + 1
        if detail and (why not in self.first or (why in self.example_is_gang_node and not gang_node)):
            self.first[why] = f"{node_name}: {detail}"
            (self.example_is_gang_node.add if gang_node else self.example_is_gang_node.discard)(why)

    def describe(self, planned_before: int) -> str:
        total_nodes = sum(self.counts.values())
        if not total_nodes:
            return "no node is known to kube-vgpu"
        parts = []
        for why in (_NO_ROOM, _QUOTA, _NOT_OFFERED, _NO_INVENTORY):
            if why in self.counts:
                example = f" (e.g. {self.first[why]})" if why in self.first else ""
                parts.append(f"{self.counts[why]} {why}{example}")
        text = f"none of {total_nodes} node(s) fits it: {'; '.join(parts)}"
        if planned_before and (_NO_ROOM in self.counts or _QUOTA in self.counts):
            # their reservations are held while this member is placed: the user may wonder where the room went
            text += f"; the {planned_before} member(s) planned before it count as using their GPUs and quota"
        return text


def _no_percent(text: str) -> str:
    """kube-scheduler formats an extender's reason as a format string in its events: spell '%' out."""
    return re.sub(r"\s*%", " percent", text)
