"""Preemptions in progress (issue 14), bookkeeping only: the decisions are in scheduler.py, the API calls in an
Evictor (evict.py) run by the executor (executor.py).

kube-scheduler cannot preempt for GPU shares (it ignores nvidia.com/gpumem and gpucores, so its dry run finds that
evicting anybody changes nothing). The extender does: when a pod fits no node, it chooses victims on one node
(victims.py, within the rules of rules.py), evicts them, and *nominates* the preemptor to that node. While the
nomination lasts, the capacity the victims free is held for the preemptor: a pod of lower or equal priority is
placed on that node only if it fits beside the preemptor's planned usage (as kube-scheduler treats nominated pods).
The nomination ends when the preemptor binds (anywhere), is deleted, when an eviction is refused or fails (the
next filter decides again, with a PodDisruptionBudget-protected victim left out for a while), or after a timeout.

Facts the rules and the victim search need about running pods (priority, start, preemptionPolicy, terminating)
are learnt from pod events (ClusterState.pod_listeners), like gangs.py learns gang members.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from kube_vgpu import kubeapi
from kube_vgpu.extender.engine.model import GpuUsage

#: a nomination whose victims are all gone but whose preemptor has not bound within this long is dropped
NOMINATION_TTL_S = 120.0
#: a nomination older than this is dropped whatever its state (a victim stuck terminating must not hold GPUs for ever)
NOMINATION_MAX_AGE_S = 600.0
#: a victim whose eviction a PodDisruptionBudget refused is left out of new decisions for this long
PROTECTED_FOR_S = 60.0


class VictimState(StrEnum):
    PENDING = "pending"  # eviction not answered yet
    EVICTED = "evicted"  # accepted: the pod is terminating (its GPUs count until it is gone)
    GONE = "gone"  # no longer holds anything
    BLOCKED = "blocked"  # refused by a PodDisruptionBudget
    FAILED = "failed"


@dataclass(frozen=True, slots=True)
class RunningPod:
    """What preemption reads of a pod beyond the state's PodRecord."""

    namespace: str
    name: str
    priority: int
    created_s: float
    started_s: float  # status.startTime, else the creation time: "most recently started" goes first
    never_preempts: bool  # spec.preemptionPolicy: Never
    terminating: bool  # metadata.deletionTimestamp is set


@dataclass(slots=True)
class Victim:
    uid: str
    namespace: str
    name: str
    state: VictimState = VictimState.PENDING
    detail: str = ""


@dataclass(slots=True)
class Nomination:
    preemptor_uid: str
    namespace: str
    name: str
    priority: int
    node_name: str
    #: the preemptor's usage on the node once the victims are gone (held against pods of lower or equal priority)
    usage: tuple[GpuUsage, ...]
    rule: str
    created_s: float
    victims: dict[str, Victim] = field(default_factory=dict)
    #: when the last victim went (0: some still hold GPUs)
    cleared_s: float = 0.0
    #: its needs are held in its ClusterQueue (a preemption on quota) until its victims are gone
    quota_hold: bool = False

    def waiting_for(self) -> list[Victim]:
        return [v for v in self.victims.values() if v.state is not VictimState.GONE]


def running_pod(pod: Mapping[str, Any]) -> RunningPod:
    metadata = pod.get("metadata") or {}
    spec = pod.get("spec") or {}
    status = pod.get("status") or {}
    priority = spec.get("priority")
    created_s = kubeapi.timestamp_seconds(metadata.get("creationTimestamp"), 0.0)
    return RunningPod(
        namespace=str(metadata.get("namespace") or ""),
        name=str(metadata.get("name") or ""),
        priority=priority if isinstance(priority, int) and not isinstance(priority, bool) else 0,
        created_s=created_s,
        started_s=kubeapi.timestamp_seconds(status.get("startTime"), created_s),
        never_preempts=spec.get("preemptionPolicy") == "Never",
        terminating=bool(metadata.get("deletionTimestamp")),
    )


class Nominations:
    """Preemptions in progress and the facts of running pods. The caller holds the cluster state's lock for every
    method (pod events arrive under it)."""

    def __init__(self, *, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.facts: dict[str, RunningPod] = {}
        self.by_preemptor: dict[str, Nomination] = {}
        #: node -> the nominations on it (a node with none is absent: filter's check is one dict lookup)
        self.by_node: dict[str, list[Nomination]] = {}
        #: victim uid -> the preemptors it is evicted for (one, unless a restart or a race chose it twice)
        self._victim_of: dict[str, set[str]] = {}
        #: victim uid -> until when new decisions leave it alone (a PodDisruptionBudget refused its eviction)
        self.protected_until_s: dict[str, float] = {}
        #: preemptor uid -> why its last preemption ended without a bind (for its next filter reasons)
        self.last_outcome: dict[str, str] = {}
        #: called with every nomination that ends (the preemptor releases a quota hold)
        self.on_drop: Callable[[Nomination], None] = lambda nomination: None

    # --- pod events ------------------------------------------------------------------------------------------
    def on_pod(self, uid: str, pod: Mapping[str, Any] | None) -> None:
        if pod is None or (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
            self.facts.pop(uid, None)
            self.protected_until_s.pop(uid, None)
            self._victim_left(uid)
            self.drop(uid, "")  # a deleted preemptor's nomination goes with it
            self.last_outcome.pop(uid, None)
            return
        if not (pod.get("spec") or {}).get("nodeName"):
            return  # only running pods are candidates; a preemptor's facts are read from the pod filter gets
        self.facts[uid] = running_pod(pod)
        if uid in self.by_preemptor:
            self.drop(uid, "")  # bound (wherever): its nomination has done its job

    def _victim_left(self, uid: str) -> None:
        for preemptor in self._victim_of.pop(uid, set()):
            nomination = self.by_preemptor.get(preemptor)
            if nomination is None or uid not in nomination.victims:
                continue
            nomination.victims[uid].state = VictimState.GONE
            if not nomination.waiting_for():
                nomination.cleared_s = self.clock()

    def claimed(self, uid: str) -> bool:
        """Whether the pod is being evicted for a nomination (its GPUs and quota are that preemptor's)."""
        return uid in self._victim_of

    # --- nominations -----------------------------------------------------------------------------------------
    def add(self, nomination: Nomination) -> None:
        self.drop(nomination.preemptor_uid, "")
        self.by_preemptor[nomination.preemptor_uid] = nomination
        self.by_node.setdefault(nomination.node_name, []).append(nomination)
        for victim_uid in nomination.victims:
            self._victim_of.setdefault(victim_uid, set()).add(nomination.preemptor_uid)
        self.last_outcome.pop(nomination.preemptor_uid, None)

    def drop(self, preemptor_uid: str, why: str) -> None:
        nomination = self.by_preemptor.pop(preemptor_uid, None)
        if nomination is None:
            return
        on_node = self.by_node.get(nomination.node_name, [])
        if nomination in on_node:
            on_node.remove(nomination)
        if not on_node:
            self.by_node.pop(nomination.node_name, None)
        for victim_uid in nomination.victims:
            preemptors = self._victim_of.get(victim_uid)
            if preemptors is not None:
                preemptors.discard(preemptor_uid)
                if not preemptors:
                    del self._victim_of[victim_uid]
        self.on_drop(nomination)
        if why:
            self.last_outcome[preemptor_uid] = why

    def record(self, preemptor_uid: str, victim_uid: str, state: VictimState, detail: str) -> None:
        """An eviction's answer (from the executor)."""
        nomination = self.by_preemptor.get(preemptor_uid)
        victim = nomination.victims.get(victim_uid) if nomination is not None else None
        if nomination is None or victim is None:
            return
        if victim.state is VictimState.GONE:
            return  # its pod event came first
        victim.state, victim.detail = state, detail
        if state is VictimState.BLOCKED:
            self.protected_until_s[victim_uid] = self.clock() + PROTECTED_FOR_S
            self.drop(preemptor_uid, f"the eviction of {victim.namespace}/{victim.name} was refused ({detail}); "
                                     "other victims are chosen on the next attempt")
        elif state is VictimState.FAILED:
            self.drop(preemptor_uid, f"the eviction of {victim.namespace}/{victim.name} failed ({detail}); "
                                     "retried on the next attempt")
        elif state is VictimState.GONE and not nomination.waiting_for():
            nomination.cleared_s = self.clock()

    def protected(self, uid: str) -> bool:
        until = self.protected_until_s.get(uid)
        if until is None:
            return False
        if self.clock() >= until:
            del self.protected_until_s[uid]
            return False
        return True

    def expire(self) -> list[Nomination]:
        """Drop nominations past their time; returns them (for logs)."""
        if not self.by_preemptor:
            return []
        now = self.clock()
        expired = [
            n for n in self.by_preemptor.values()
            if now - n.created_s > NOMINATION_MAX_AGE_S or (n.cleared_s and now - n.cleared_s > NOMINATION_TTL_S)
        ]
        for nomination in expired:
            self.drop(nomination.preemptor_uid, f"its nomination to node {nomination.node_name} expired before it "
                                                "bound")
        return expired

    def holding(self, node_name: str, uid: str, priority: int) -> list[Nomination]:
        """The nominations on a node that hold its GPUs against a pod of this priority (not its own)."""
        return [n for n in self.by_node.get(node_name, ()) if n.preemptor_uid != uid and n.priority >= priority]

    def view(self) -> list[dict[str, Any]]:
        """JSON-ready, for GET /state."""
        return [
            {
                "preemptor": f"{n.namespace}/{n.name}",
                "node": n.node_name,
                "priority": n.priority,
                "rule": n.rule,
                "victims": {f"{v.namespace}/{v.name}": v.state.value for v in n.victims.values()},
            }
            for n in sorted(self.by_preemptor.values(), key=lambda n: (n.namespace, n.name))
        ]
