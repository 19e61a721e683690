"""Which prepared binds of one node may write their Binding now, and the waiting for that turn: one
implementation with two faces, `commit_async` (the ASGI server, in the event loop) and `commit_blocking` (tests,
tools, any synchronous caller), so tests exercise the very code production runs.

Why turns: kubelet admits a node's pods in the order their Bindings reach it, and kubelet's Allocate never names the
pod, so the device plugin takes the pending pod with the earliest bind time (deviceplugin/allocate.py). The two
orders agree if a bind starts writing only after every bind with an earlier bind time has been answered: binds to
one node are written one at a time.

One exception keeps bursts fast: binds whose assignments are identical (the same GPUs, MiB and cores for the same
containers; the annotation names no pod) may be written together. If kubelet admits such pods in another order
than their bind times, the device plugin hands each the other's assignment, which is the same assignment, so every
pod still runs exactly what its own annotation says. Turns are granted in arrival order: a bind joins the group
being written only if nobody waits ahead of it, and a different assignment waits until the node has nothing in
flight.

Giving up: a bind that stops waiting before its turn (its caller cancelled it, or it waited longer than
`turn_wait_limit_s`) leaves the queue and its reservation is released (`abandon_bind`), so nothing it reserved
stays taken. A bind whose turn came is committed to the end (the Binding call has its own deadline); cancelling it
then does not unwind a write that may already have reached the API server: the commit finishes in its worker
thread, its outcome stands (bound and counted, or failed and rolled back), the turn is passed on when it ends, and
only the caller stops waiting. A bind cancelled while its prepare still reads the pod from the API server
(`prepare_async`) is abandoned as soon as that prepare returns. In the server, the one who cancels is uvicorn at
shutdown, for requests still running after its graceful timeout.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

log = logging.getLogger(__name__)

Wake = Callable[[], None]

#: How long a bind waits for its node's turn before it gives up (each bind ahead of it is bounded by the API
#: deadlines, extender/sources/apiclient.py; kube-scheduler's httpTimeout is 30 s, and the wait plus this bind's own
#: calls must fit in it).
DEFAULT_TURN_WAIT_LIMIT_S = 10.0
#: concurrent API calls of the async face: Binding writes (binds to different nodes, or identical ones to one node)
#: and the reads of pods that filter did not see
COMMIT_THREADS = 64


class BindError(Exception):
    """A bind that failed; the message goes back to kube-scheduler in the Error field."""


@dataclass(frozen=True, slots=True)
class PreparedBind:
    """A bind decided and reserved in memory, not yet written (Scheduler.prepare_bind -> commit_bind)."""

    namespace: str
    name: str
    uid: str
    node_name: str
    assignment: str  # the encoded assignment annotation


class Committer(Protocol):
    """What commits a prepared bind (the Scheduler)."""

    def commit_bind(self, prepared: PreparedBind) -> None:
        """Write it (the caller holds the node's turn); raise BindError, with the reservation released, on failure."""
        ...

    def abandon_bind(self, prepared: PreparedBind) -> None:
        """Give up a prepared bind that will not be committed: release its reservation."""
        ...


@dataclass(slots=True)
class NodeTurns:
    """The turns of one node. Pure bookkeeping; the caller holds a lock and does the waiting."""

    #: the assignment being written, and how many binds are writing it
    writing: str | None = None
    writers: int = 0
    #: (assignment, wake) in arrival order
    waiting: deque[tuple[str, Wake]] = field(default_factory=deque)

    def request(self, assignment: str, wake: Wake) -> bool:
        """True: write now. False: `wake` is called (by a later finish()) when it is this bind's turn."""
        if not self.waiting and (self.writers == 0 or self.writing == assignment):
            self.writing = assignment
            self.writers += 1
            return True
        self.waiting.append((assignment, wake))
        return False

    def finish(self) -> None:
        """A bind that had its turn is done (answered, failed or given up)."""
        if self.writers <= 0:
            raise RuntimeError("finish() without a turn")
        self.writers -= 1
        if self.writers:
            return
        self.writing = None
        # the first waiter, and everyone right behind it with the same assignment, write together
        while self.waiting and (self.writing is None or self.waiting[0][0] == self.writing):
            assignment, wake = self.waiting.popleft()
            self.writing = assignment
            self.writers += 1
            wake()

    def withdraw(self, wake: Wake) -> bool:
        """Leave the queue before the turn came (the caller gave up). False if the turn was already granted:
        the caller then holds it and must finish()."""
        for index, (_, queued) in enumerate(self.waiting):
            if queued is wake:
                del self.waiting[index]
                return True
        return False

    @property
    def idle(self) -> bool:
        return not self.writers and not self.waiting


class BindOrdering:
    """The turns of every node, and the two faces that wait for a turn and commit in it."""

    def __init__(self, turn_wait_limit_s: float = DEFAULT_TURN_WAIT_LIMIT_S) -> None:
        self.turn_wait_limit_s = turn_wait_limit_s
        self._lock = threading.Lock()
        self._turns: dict[str, NodeTurns] = {}
        self._executor: ThreadPoolExecutor | None = None

    def _commit_threads(self) -> ThreadPoolExecutor:
        """The async face's API calls run here: one thread per bind in flight (each is an API call), up to the API
        client's connection pool (extender/sources/live.py), not the event loop's small default executor."""
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=COMMIT_THREADS, thread_name_prefix="bind-commit")
            return self._executor

    # --- the core: `wake` is called under the lock and must not block (an Event's set, call_soon_threadsafe) ----
    def request_turn(self, prepared: PreparedBind, wake: Wake) -> bool:
        """True: commit now. False: `wake` is called when it is this bind's turn."""
        with self._lock:
            turns = self._turns.get(prepared.node_name)
            if turns is None:
                turns = self._turns[prepared.node_name] = NodeTurns()
            return turns.request(prepared.assignment, wake)

    def withdraw_turn(self, prepared: PreparedBind, wake: Wake) -> bool:
        """Stop waiting for a turn; False if it was granted meanwhile (then finish_turn() passes it on)."""
        with self._lock:
            turns = self._turns.get(prepared.node_name)
            return turns is not None and turns.withdraw(wake)

    def finish_turn(self, prepared: PreparedBind) -> None:
        with self._lock:
            turns = self._turns[prepared.node_name]
            turns.finish()
            if turns.idle:
                del self._turns[prepared.node_name]

    def busy_nodes(self) -> list[str]:
        """Nodes with a bind writing or waiting (for /state and tests)."""
        with self._lock:
            return sorted(self._turns)

    def turn_counts(self) -> tuple[int, int]:
        """(binds holding their node's turn, binds waiting for it), over all nodes (/metrics)."""
        with self._lock:
            turns = self._turns.values()
            return sum(t.writers for t in turns), sum(len(t.waiting) for t in turns)

    def _give_up(self, committer: Committer, prepared: PreparedBind, wake: Wake) -> None:
        """The caller stops waiting: leave the queue (or pass on a turn granted meanwhile), release the bind."""
        if not self.withdraw_turn(prepared, wake):
            self.finish_turn(prepared)
        committer.abandon_bind(prepared)

    def _waited_too_long(self, prepared: PreparedBind) -> BindError:
        return BindError(f"binding {prepared.namespace}/{prepared.name} to {prepared.node_name}: waited more than "
                         f"{self.turn_wait_limit_s:.0f} s for the node's earlier binds; the pod will be retried")

    # --- the two faces ------------------------------------------------------------------------------------------
    def commit_blocking(self, committer: Committer, prepared: PreparedBind) -> None:
        """Wait (blocking this thread) for the node's turn, then commit. Raises BindError."""
        turn = threading.Event()
        if not self.request_turn(prepared, turn.set) and not turn.wait(self.turn_wait_limit_s):
            self._give_up(committer, prepared, turn.set)
            raise self._waited_too_long(prepared)
        try:
            committer.commit_bind(prepared)
        finally:
            self.finish_turn(prepared)

    async def commit_async(self, committer: Committer, prepared: PreparedBind) -> None:
        """Wait in the event loop (no parked worker thread) for the node's turn, then commit in a worker thread.
        Raises BindError; a cancellation while waiting releases the bind (see the module's docstring)."""
        loop = asyncio.get_running_loop()
        turn: asyncio.Future[None] = loop.create_future()

        def grant() -> None:
            if not turn.done():
                turn.set_result(None)

        def wake() -> None:  # called under the lock, from whichever thread finished a turn
            loop.call_soon_threadsafe(grant)

        if not self.request_turn(prepared, wake):
            try:
                await asyncio.wait_for(asyncio.shield(turn), self.turn_wait_limit_s)
            except TimeoutError:
                self._give_up(committer, prepared, wake)
                raise self._waited_too_long(prepared) from None
            except BaseException:  # cancelled while waiting (shutdown, caller gone)
                self._give_up(committer, prepared, wake)
                raise
        commit = loop.run_in_executor(self._commit_threads(), self._commit_in_turn, committer, prepared)
        try:
            await asyncio.shield(commit)
        except asyncio.CancelledError:
            # the caller stops waiting; the commit runs to its end in its thread, passes the turn on, and its
            # outcome (which nobody awaits now) goes to the log
            commit.add_done_callback(lambda done: _log_orphaned_commit(prepared, done))
            raise

    async def prepare_async(
        self, committer: Committer, prepare: Callable[[], PreparedBind | None]
    ) -> PreparedBind | None:
        """Run a prepare that may read the pod from the API server in a worker thread (the async face's first
        step when filter did not see the pod). A caller cancelled meanwhile leaks nothing: what the prepare
        reserved is abandoned as soon as it returns."""
        handoff = _PrepareHandoff(committer, prepare)
        try:
            return await asyncio.get_running_loop().run_in_executor(self._commit_threads(), handoff.run)
        except asyncio.CancelledError:
            handoff.caller_gone()
            raise

    def _commit_in_turn(self, committer: Committer, prepared: PreparedBind) -> None:
        try:
            committer.commit_bind(prepared)
        finally:
            self.finish_turn(prepared)


class _PrepareHandoff:
    """A prepare run in a worker thread, handed to its caller, or abandoned if the caller went away first (whichever
    of the two comes second releases it, so nothing stays reserved for a bind nobody commits)."""

    def __init__(self, committer: Committer, prepare: Callable[[], PreparedBind | None]) -> None:
        self._committer = committer
        self._prepare = prepare
        self._lock = threading.Lock()
        self._caller_gone = False
        self._prepared: PreparedBind | None = None

    def run(self) -> PreparedBind | None:
        prepared = self._prepare()
        with self._lock:
            if not self._caller_gone:
                self._prepared = prepared
                return prepared
        if prepared is not None:
            self._committer.abandon_bind(prepared)
        return None

    def caller_gone(self) -> None:
        with self._lock:
            self._caller_gone = True
            prepared, self._prepared = self._prepared, None  # finished, but its result never reached the caller
        if prepared is not None:
            self._committer.abandon_bind(prepared)


def _log_orphaned_commit(prepared: PreparedBind, commit: asyncio.Future[None]) -> None:
    if commit.cancelled():
        return
    error = commit.exception()  # retrieved here: nobody awaits it any more
    where = f"{prepared.namespace}/{prepared.name} to {prepared.node_name}"
    if error is None:
        log.info("bind of %s written after its caller was cancelled", where)
    else:
        log.warning("bind of %s, whose caller was cancelled, failed: %s", where, error)
