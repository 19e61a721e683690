"""Carrying a preemption out: the interface between the decision (scheduler.py, pure) and the API server (an
Evictor at the edge: sources/evictor.py in live mode, the snapshot's own in snapshot mode and tests).

One call evicts one victim, as kube-scheduler's preemption does it: the victim is marked with the DisruptionTarget
condition (reason PreemptionByScheduler, the message naming the preemptor and the rule), evicted through the
Eviction API (so PodDisruptionBudgets are honoured: a refusal is BLOCKED, never forced), and an event is recorded
on the victim ("Preempted") and on the preemptor ("Preempting"). Calls are blocking and made from a worker
thread, never under the cluster state's lock.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol


class EvictionOutcome(StrEnum):
    EVICTED = "evicted"  # the API server accepted the eviction (the pod is terminating or gone)
    GONE = "gone"  # the pod no longer exists, or its UID changed (another pod of the same name): nothing evicted
    BLOCKED = "blocked"  # a PodDisruptionBudget refused it (HTTP 429): choose other victims or wait
    FAILED = "failed"  # anything else (API error, timeout): the preemption is retried later, nothing assumed


@dataclass(frozen=True, slots=True)
class EvictionRequest:
    namespace: str
    name: str
    uid: str  # the victim's UID: the eviction's precondition, so a recreated pod of that name is never evicted
    preemptor_namespace: str
    preemptor_name: str
    preemptor_uid: str
    #: why, for the condition, the events and the logs: e.g. "priority 1000 > 0" or "reclaimWithinCohort: ..."
    rule: str
    node_name: str
    #: the preemptor's ClusterQueue ("" outside any), for metrics by queue
    preemptor_queue: str = ""


@dataclass(frozen=True, slots=True)
class EvictionResult:
    outcome: EvictionOutcome
    detail: str = ""  # the API server's words when BLOCKED or FAILED (shown in the preemptor's reason)


class Evictor(Protocol):
    def evict(self, request: EvictionRequest) -> EvictionResult:
        """Mark, evict and record one victim (see the module's docstring). Never raises: failures are results."""
        ...


# --- what is written, shared by every Evictor so the words are the same in live and snapshot mode ---------------

#: the pod condition kube-scheduler's preemption sets (and Job podFailurePolicy / controllers read)
DISRUPTION_TARGET = "DisruptionTarget"
PREEMPTION_BY_SCHEDULER = "PreemptionByScheduler"
#: event reasons, as kube-scheduler names them (on the victim, and on the preemptor)
REASON_PREEMPTED = "Preempted"
REASON_PREEMPTING = "Preempting"
#: reportingController / source component of the events
REPORTING_CONTROLLER = "kube-vgpu-extender"
#: an events.k8s.io/v1 note is at most 1 KiB (the API server refuses longer ones)
NOTE_LIMIT_BYTES = 1024


def condition_message(request: EvictionRequest, scheduler_name: str) -> str:
    """The DisruptionTarget condition's message: kube-scheduler's words, plus the preemptor and the rule."""
    return (
        f"{scheduler_name}: preempting to accommodate a higher priority pod "
        f"{request.preemptor_namespace}/{request.preemptor_name} ({request.rule})"
    )


def victim_event_message(request: EvictionRequest) -> str:
    return (
        f"Preempted by {request.preemptor_namespace}/{request.preemptor_name} on node {request.node_name}: "
        f"{request.rule}"
    )


def preemptor_event_message(request: EvictionRequest) -> str:
    return f"Preempting {request.namespace}/{request.name} on node {request.node_name}: {request.rule}"


def truncate_note(text: str) -> str:
    """At most NOTE_LIMIT_BYTES of UTF-8, cut on a character boundary."""
    encoded = text.encode()
    if len(encoded) <= NOTE_LIMIT_BYTES:
        return text
    return encoded[: NOTE_LIMIT_BYTES - 3].decode(errors="ignore") + "..."
