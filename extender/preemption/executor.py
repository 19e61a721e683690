"""Runs evictions off the filter path (issue 14): a small pool of worker threads calls the Evictor for each victim
and records the answer in the nominations under the cluster state's lock. Bounded: at most `max_in_flight`
evictions at once, so a burst of preemptors cannot flood the API server (no preemption storm); a preemptor that
finds the pool full waits for its next filter."""

from __future__ import annotations

import logging
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

from kube_vgpu.extender.preemption.evict import EvictionOutcome, EvictionRequest, EvictionResult, Evictor
from kube_vgpu.extender.preemption.nominations import Nominations, VictimState

log = logging.getLogger(__name__)

DEFAULT_MAX_IN_FLIGHT = 16
_STATES = {
    EvictionOutcome.EVICTED: VictimState.EVICTED,
    EvictionOutcome.GONE: VictimState.GONE,
    EvictionOutcome.BLOCKED: VictimState.BLOCKED,
    EvictionOutcome.FAILED: VictimState.FAILED,
}


class EvictionExecutor:
    def __init__(self, evictor: Evictor, nominations: Nominations, lock: threading.RLock, *,
                 max_in_flight: int = DEFAULT_MAX_IN_FLIGHT, inline: bool = False) -> None:
        self.evictor = evictor
        self.nominations = nominations
        self.lock = lock
        self.max_in_flight = max_in_flight
        #: run each eviction in the caller's thread (snapshot mode and tests: deterministic, nothing to wait for)
        self.inline = inline
        self.in_flight = 0
        #: (rule kind, preemptor's ClusterQueue, outcome) -> evictions, for /metrics: rule kind is the rule's first
        #: word ("priority", "withinClusterQueue", ...), outcome an EvictionOutcome value
        self.outcomes: Counter[tuple[str, str, str]] = Counter()
        self._counter_lock = threading.Lock()
        self._pool = None if inline else ThreadPoolExecutor(max_workers=4, thread_name_prefix="evict")

    def room(self) -> int:
        with self._counter_lock:
            return self.max_in_flight - self.in_flight

    def submit(self, requests: list[EvictionRequest]) -> None:
        with self._counter_lock:
            self.in_flight += len(requests)
        for request in requests:
            if self._pool is None:
                self._run(request)
            else:
                self._pool.submit(self._run, request)

    def _run(self, request: EvictionRequest) -> None:
        try:
            result = self.evictor.evict(request)
        except Exception as exc:  # the interface says it never raises; a bug must not lose the accounting
            log.exception("evicting %s/%s", request.namespace, request.name)
            result = EvictionResult(EvictionOutcome.FAILED, str(exc))
        finally:
            with self._counter_lock:
                self.in_flight -= 1
        with self._counter_lock:
            self.outcomes[(rule_kind(request.rule), request.preemptor_queue, result.outcome.value)] += 1
        log.info("preemption: %s/%s on %s for %s/%s: %s%s", request.namespace, request.name, request.node_name,
                 request.preemptor_namespace, request.preemptor_name, result.outcome.value,
                 f" ({result.detail})" if result.detail else "")
        with self.lock:
            self.nominations.record(request.preemptor_uid, request.uid, _STATES[result.outcome], result.detail)

    def counts(self) -> dict[tuple[str, str, str], int]:
        with self._counter_lock:
            return dict(self.outcomes)

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


def rule_kind(rule: str) -> str:
    """A rule text's kind, a bounded label: "priority: 0 is lower than 1000" -> "priority"."""
    head = rule.split(":", 1)[0].split(" ", 1)[0]
    return head if head in ("priority", "withinClusterQueue", "reclaimWithinCohort", "borrowWithinCohort") else "other"
