"""Fencing between scheduler replicas: a bind is written only while this replica's kube-scheduler leads.

kube-scheduler replicas elect a leader through a Lease (manifests: kube-vgpu/kube-vgpu-scheduler); only the leader
calls its extender. But a deposed leader's extender may still hold binds queued for their node's turn, and the new
leader's extender never saw those reservations: written late, they over-commit a GPU (issue 20 item 2). The fence
closes that with two rules, checked before a bind reserves and again right before its Binding is written:

1. **Write only inside our own term.** The Lease must name our kube-scheduler (holderIdentity is
   "<hostname>_<uuid>", and a Pod's hostname is its name, so `identity_prefix` is "<POD_NAME>_") and stay valid until
   the write has certainly ended: now + write_window_s + margin_s < renewTime + leaseDurationSeconds. renewTime is
   written by the kube-scheduler beside us, in our Pod on our node, so both sides of that comparison read the same
   clock. A candidate elsewhere takes over only after it has seen the same renewTime unchanged for a whole
   leaseDuration, measured on its own clock from a moment after the renewal; so every write of ours has ended (the
   Binding carries a server-side timeout of write_window_s) before another leader exists.
2. **Decide only on state that includes the previous term.** When a term of ours begins (holder and
   leaseTransitions not yet synced), binds are refused until a full relist of the pods, started after we saw the
   term, has been applied: it holds every Binding the previous leader wrote, all of which ended before our term.

Clock-rate drift (not offset) between nodes is what leader election itself assumes small. Without a lease
(`--fence-lease` unset, a single replica, or the snapshot mode) there is no fence.
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

#: added to the write window: scheduling delay between the check and the write's start, and rounding
DEFAULT_MARGIN_S = 1.0


@dataclass(frozen=True, slots=True)
class LeaseTerm:
    """What the fence needs of a Lease."""

    holder: str
    transitions: int
    renew_time_s: float  # POSIX seconds
    duration_s: float

    @property
    def valid_until_s(self) -> float:
        return self.renew_time_s + self.duration_s


class InvalidLease(ValueError):
    """A Lease object the fence cannot read; the message names the field."""


def _parse_micro_time(text: Any, field_name: str) -> float:
    if not isinstance(text, str):
        raise InvalidLease(f"spec.{field_name} must be a string, got {type(text).__name__}")
    for layout in ("%Y-%m-%dT%H:%M:%S.%fZ", "%Y-%m-%dT%H:%M:%SZ"):
        try:
            return dt.datetime.strptime(text, layout).replace(tzinfo=dt.UTC).timestamp()
        except ValueError:
            continue
    raise InvalidLease(f"spec.{field_name} {text[:40]!r} is not an RFC 3339 UTC time")


def parse_lease(obj: Mapping[str, Any]) -> LeaseTerm | None:
    """The term a coordination.k8s.io/v1 Lease describes; None when nobody holds it. Raises InvalidLease."""
    spec = obj.get("spec")
    if not isinstance(spec, Mapping):
        raise InvalidLease("spec must be an object")
    holder = spec.get("holderIdentity")
    if holder is None or holder == "":
        return None
    if not isinstance(holder, str):
        raise InvalidLease("spec.holderIdentity must be a string")
    duration = spec.get("leaseDurationSeconds")
    if isinstance(duration, bool) or not isinstance(duration, int) or duration <= 0:
        raise InvalidLease("spec.leaseDurationSeconds must be a positive integer")
    transitions = spec.get("leaseTransitions", 0)
    if isinstance(transitions, bool) or not isinstance(transitions, int):
        raise InvalidLease("spec.leaseTransitions must be an integer")
    renew = _parse_micro_time(spec.get("renewTime"), "renewTime")
    return LeaseTerm(holder, transitions, renew, float(duration))


class LeaderFence:
    """Whether a bind may reserve or write now (thread-safe). Fed by a Lease watch (`observe`); asks for a pod relist
    through `request_relist` when a term of ours begins, and learns it is done through the callback it passes."""

    def __init__(
        self,
        identity_prefix: str,
        *,
        write_window_s: float,
        margin_s: float = DEFAULT_MARGIN_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if not identity_prefix:
            raise ValueError("the fence needs this replica's identity prefix (<POD_NAME>_)")
        self.identity_prefix = identity_prefix
        self.write_window_s = write_window_s
        self.margin_s = margin_s
        self.clock = clock
        #: called with a callback to run once a pod relist that started after this call has been applied
        self.request_relist: Callable[[Callable[[], None]], None] = lambda done: done()
        self._lock = threading.Lock()
        self._term: LeaseTerm | None = None
        self._seen = False  # a Lease (or its absence) was observed at least once
        self._problem = ""  # why the last Lease could not be read
        self._synced: tuple[str, int] | None = None  # the term whose relist was applied
        self._syncing: tuple[str, int] | None = None  # the term whose relist is under way

    def _ours(self, term: LeaseTerm | None) -> bool:
        return term is not None and term.holder.startswith(self.identity_prefix)

    def observe(self, lease: Mapping[str, Any] | None) -> None:
        """The Lease as the watch last delivered it (None: deleted or absent)."""
        try:
            term = parse_lease(lease) if lease is not None else None
            problem = ""
        except InvalidLease as exc:
            term, problem = None, f"the Lease cannot be read ({exc})"
        start: tuple[str, int] | None = None
        with self._lock:
            self._term, self._seen, self._problem = term, True, problem
            if term is not None and self._ours(term):
                key = (term.holder, term.transitions)
                if key not in (self._synced, self._syncing):
                    self._syncing = start = key
                    log.info("term of %s (transition %d) began: relisting pods before binding", *key)
        if start is not None:
            self.request_relist(lambda: self._relisted(start))

    def _relisted(self, key: tuple[str, int]) -> None:
        with self._lock:
            if self._syncing == key:
                self._synced, self._syncing = key, None
        log.info("pods relisted for the term of %s (transition %d): binding", *key)

    def refusal(self) -> str | None:
        """Why a bind must not reserve or write now; None when it may."""
        with self._lock:
            term, seen, problem, synced = self._term, self._seen, self._problem, self._synced
        if not seen:
            return "not binding: the scheduler's leader Lease has not been read yet"
        if problem:
            return f"not binding: {problem}"
        if term is None or not self._ours(term):
            holder = term.holder if term is not None else "nobody"
            return (f"not binding: this replica's kube-scheduler does not hold the leader Lease (held by {holder}); "
                    "the leader's replica binds")
        if (term.holder, term.transitions) != synced:
            return "not binding yet: this replica just became leader and is relisting pods (retried shortly)"
        remaining_s = term.valid_until_s - self.clock()
        if remaining_s <= self.write_window_s + self.margin_s:
            return (f"not binding: the leader Lease ends in {remaining_s:.1f} s, too soon for a bind's write "
                    f"({self.write_window_s:g} s + {self.margin_s:g} s margin); its renewal is late")
        return None
