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


@dataclass(frozen=True, slots=True)
class EvictionResult:
    outcome: EvictionOutcome
    detail: str = ""  # the API server's words when BLOCKED or FAILED (shown in the preemptor's reason)


class Evictor(Protocol):
    def evict(self, request: EvictionRequest) -> EvictionResult:
        """Mark, evict and record one victim (see the module's docstring). Never raises: failures are results."""
        ...
