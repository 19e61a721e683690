"""Gangs: all-or-nothing groups of pods (issue 13), bookkeeping only; the decisions are in scheduler.py.

A gang is declared as Kueue declares a plain-pod group: every member carries the label
`kueue.x-k8s.io/pod-group-name` and the annotation `kueue.x-k8s.io/pod-group-total-count` (the gang's size). The
extender learns where kube-scheduler puts a pod only at bind, so members filtered one by one could be handed the same
GPU, or some of them placed while the rest never fit (a half gang holding GPUs nobody else can use). Instead, the
first filter after every member exists plans the whole gang: each member is placed in turn and reserved in the
cluster state (quota included), so no other pod can take the capacity, and each member's filter then passes only the
node planned for it. If some member does not fit, nothing is reserved and every member waits, with a reason that
says how many fit.

A plan that is not fully bound within the gang's timeout (kube-scheduler's own plugins may refuse a planned node) is
dropped and its reservations released; the gang is then not planned again for a while (`retry_after_s`) so that
others can use the capacity. Plans live in memory only: after a restart the members already bound are known from
their assignment annotations, and the members still pending are planned again (on what is free then).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kube_vgpu import protocol

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 300.0
MIN_TIMEOUT_S = protocol.MIN_GANG_TIMEOUT_S
MAX_TIMEOUT_S = protocol.MAX_GANG_TIMEOUT_S
MAX_GANG_SIZE = protocol.MAX_GANG_SIZE
#: phases after which a pod no longer holds anything
FINISHED = ("Succeeded", "Failed")
#: the pod's gang declaration cannot be read (protocol.parse_gang_declaration says what to fix)
InvalidGang = protocol.InvalidGangDeclaration


@dataclass(frozen=True, slots=True, order=True)
class GangKey:
    namespace: str
    name: str

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name}"


def gang_timeout_of(pod: Mapping[str, Any]) -> float | None:
    """The pod's own gang timeout (annotation), None when it sets none or is in no gang. Raises InvalidGang."""
    declared = protocol.parse_gang_declaration(pod)
    return declared.timeout_s if declared is not None else None


def gang_of(pod: Mapping[str, Any]) -> tuple[GangKey, int] | None:
    """(gang, size) of a pod that declares one; None for a pod outside any gang. Raises InvalidGang."""
    declared = protocol.parse_gang_declaration(pod)
    if declared is None:
        return None
    return GangKey(str((pod.get("metadata") or {}).get("namespace") or ""), declared.name), declared.size


@dataclass(slots=True)
class Member:
    uid: str
    name: str
    created: str  # creationTimestamp: members are planned in creation order
    pod: Mapping[str, Any]
    bound_to: str = ""
    #: the nodes kube-scheduler last found feasible for it (its own plugins: resources, taints, ...), when known
    feasible: frozenset[str] | None = None


@dataclass(slots=True)
class Gang:
    key: GangKey
    size: int
    members: dict[str, Member] = field(default_factory=dict)
    #: uid -> the node planned for that member (its reservation is in the cluster state)
    plan: dict[str, str] = field(default_factory=dict)
    planned_at_s: float = 0.0
    #: no new plan before this (after a timeout: let other pods use the capacity)
    retry_after_s: float = 0.0
    #: why the gang waits, for filter reasons and /state
    waiting: str = ""
    #: the members' own timeout (annotation); None: the tracker's
    timeout_s: float | None = None

    def bound(self) -> int:
        return sum(1 for member in self.members.values() if member.bound_to)

    def pending(self) -> list[Member]:
        """Members neither bound nor planned, in creation order."""
        found = [m for m in self.members.values() if not m.bound_to and m.uid not in self.plan]
        return sorted(found, key=lambda m: (m.created, m.name))

    def complete(self) -> bool:
        return self.bound() >= self.size


class GangTracker:
    """Every gang's members (from pod events, and from filter, whichever comes first) and plans. The caller holds
    the cluster state's lock for every method (pod events arrive under it)."""

    def __init__(self, *, timeout_s: float = DEFAULT_TIMEOUT_S, clock: Callable[[], float]) -> None:
        self.timeout_s = timeout_s
        self.clock = clock
        self.gangs: dict[GangKey, Gang] = {}
        self._gang_of_uid: dict[str, GangKey] = {}

    # --- membership ------------------------------------------------------------------------------------------
    def on_pod(self, uid: str, pod: Mapping[str, Any] | None) -> None:
        """A pod event (ClusterState.pod_listeners; None: deleted)."""
        if pod is None or (pod.get("status") or {}).get("phase") in FINISHED:
            self.forget(uid)
            return
        try:
            declared = gang_of(pod)
        except InvalidGang:
            declared = None  # filter says why, to the pod's owner
        if declared is None:
            if uid in self._gang_of_uid:
                self.forget(uid)
            return
        self.note(uid, pod, *declared, known=lambda _key: [])

    def note(
        self, uid: str, pod: Mapping[str, Any], key: GangKey, size: int, known: Callable[[GangKey], list[Member]]
    ) -> Gang:
        gang = self.gangs.get(key)
        if gang is None:
            gang = self.gangs[key] = Gang(key, size)
            # members bound before this tracker saw their events (it started after the state was loaded)
            for bound in known(key):
                if bound.uid not in gang.members:
                    gang.members[bound.uid] = bound
                    self._gang_of_uid[bound.uid] = key
        gang.size = size  # the latest declaration wins
        try:
            own_timeout_s = gang_timeout_of(pod)
        except InvalidGang:
            own_timeout_s = None  # gang_of refused it already where it is read (filter)
        if own_timeout_s is not None:
            gang.timeout_s = own_timeout_s
        metadata = pod.get("metadata") or {}
        found = gang.members.get(uid)
        if found is None:
            member = Member(uid, str(metadata.get("name") or ""), str(metadata.get("creationTimestamp") or ""), pod)
            gang.members[uid] = member
            self._gang_of_uid[uid] = key
        else:
            member = found
            member.pod = pod
        node = (pod.get("spec") or {}).get("nodeName")
        if isinstance(node, str) and node:
            member.bound_to = node
            gang.plan.pop(uid, None)
        return gang

    def forget(self, uid: str) -> None:
        """A member went away (its reservation goes with its pod record, in the cluster state)."""
        key = self._gang_of_uid.pop(uid, None)
        gang = self.gangs.get(key) if key is not None else None
        if gang is None:
            return
        gang.members.pop(uid, None)
        gang.plan.pop(uid, None)
        if not gang.members:
            del self.gangs[gang.key]

    def gang_of_uid(self, uid: str) -> Gang | None:
        key = self._gang_of_uid.get(uid)
        return self.gangs.get(key) if key is not None else None

    def mark_bound(self, uid: str, node: str) -> None:
        gang = self.gang_of_uid(uid)
        if gang is not None and uid in gang.members:
            gang.members[uid].bound_to = node
            gang.plan.pop(uid, None)

    # --- plans -----------------------------------------------------------------------------------------------
    def timeout_of(self, gang: Gang) -> float:
        return gang.timeout_s if gang.timeout_s is not None else self.timeout_s

    def expired(self) -> list[tuple[Gang, list[str]]]:
        """Plans older than the timeout with members still unbound: (gang, the uids whose reservations to release).
        Their plans are dropped here."""
        now = self.clock()
        found = []
        for gang in self.gangs.values():
            timeout_s = self.timeout_of(gang)
            # complete or not: a member beyond the size, planned once the gang was whole, must not hold its
            # reservation forever either
            if gang.plan and now - gang.planned_at_s > timeout_s:
                released = list(gang.plan)
                # name the members that never bound and where: their events say what refused the planned node
                unbound = ", ".join(
                    f"{gang.members[uid].name} on {node or 'any node'}"
                    for uid, node in sorted(gang.plan.items(), key=lambda item: gang.members[item[0]].name)
                    if uid in gang.members
                )
                gang.plan.clear()
                gang.retry_after_s = now + timeout_s / 2
                gang.waiting = (f"gang {gang.key}: {gang.bound()} of {gang.size} members were bound within "
                                f"{timeout_s:g} s of the plan; not bound: {unbound} (see those pods' events for "
                                "what refused the planned node); their reservations were released")
                log.warning("%s", gang.waiting)
                found.append((gang, released))
        return found


def gang_summary(gang: Gang) -> dict[str, Any]:
    """The counts every view of a gang shows (/state, /quota): size, members seen and bound, and why it waits."""
    return {
        "name": str(gang.key),
        "size": gang.size,
        "membersSeen": len(gang.members),
        "bound": gang.bound(),
        "waiting": gang.waiting if not gang.complete() else "",
    }


def gangs_view(tracker: GangTracker) -> list[dict[str, Any]]:
    """JSON-ready gangs for GET /state (caller holds the state lock): members seen, bound, planned, and why waiting."""
    view = []
    for key in sorted(tracker.gangs):
        gang = tracker.gangs[key]
        view.append({
            **gang_summary(gang),
            "timeoutSeconds": tracker.timeout_of(gang),
            "planned": {gang.members[uid].name: node for uid, node in sorted(gang.plan.items())
                        if uid in gang.members},
        })
    return view
