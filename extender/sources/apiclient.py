"""The extender's connection to the API server: every call has a deadline, every socket has TCP keepalive, and
nothing is retried behind the caller's back.

Budget. kube-scheduler gives the whole bind verb its extender `httpTimeout` (manifests/base/scheduler/
kube-scheduler-config.yaml; SCHEDULER_EXTENDER_TIMEOUT_S here, a test keeps the two equal). One bind makes at most
three API calls one after another: the pod read of prepare (only when filter did not see the pod), the Binding,
and, when the Binding failed, the read that checks whether it took effect anyway. Their deadlines add up to
`ApiTimeouts.bind_worst_case_s`, which must stay below the scheduler's timeout; what is left is the most a bind
may wait for its node's turn. urllib3's default retries (three more attempts of a call, each with its own
timeout) would multiply these numbers, so the pool retries nothing: callers decide (the watches re-list, a failed
bind is retried by kube-scheduler).

A deadline covers the whole call: connect and TLS handshake, the response headers, and the body. Per-read
socket timeouts alone would let a slow trickle of bytes last forever; the body is therefore read under a
reaper that shuts the socket down when the deadline passes.

Watches cannot have a deadline; a watch stream's socket read timeout is its progress timeout instead (see
extender/sources/watch.py).
"""

from __future__ import annotations

import heapq
import itertools
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import urllib3
from kubernetes import client, config

#: kube-scheduler's extender httpTimeout in the manifests (tests/extender/test_api_deadlines.py reads the file)
SCHEDULER_EXTENDER_TIMEOUT_S = 30.0
#: binds run concurrently (one per node at a time): keep enough kept-alive connections for them
CONNECTION_POOL_SIZE = 64
#: TCP keepalive: an idle connection is probed after KEEPALIVE_IDLE_S and given up after KEEPALIVE_PROBES
#: unanswered probes KEEPALIVE_INTERVAL_S apart (a peer that vanished without closing: a dead node, a NAT entry
#: dropped); TCP_USER_TIMEOUT_MS bounds data sent and never acknowledged the same way
KEEPALIVE_IDLE_S = 15
KEEPALIVE_INTERVAL_S = 5
KEEPALIVE_PROBES = 3
TCP_USER_TIMEOUT_MS = 30_000


@dataclass(frozen=True, slots=True)
class ApiTimeouts:
    """Deadlines of the extender's API calls (seconds, whole call unless noted)."""

    #: TCP connect plus TLS handshake (part of each call's deadline, not added to it)
    connect_s: float = 2.0
    #: one pod read (prepare, and the check after a failed Binding)
    read_s: float = 5.0
    #: one Binding
    bind_s: float = 10.0
    #: one write of a preemption (the victim's status patch, its Eviction, each event): evictions run on a
    #: worker thread outside any bind, so this is not part of the bind budget
    evict_s: float = 10.0
    #: one page of a list (LIST_PAGE_SIZE objects)
    list_page_s: float = 60.0
    #: a watch that delivers nothing (no event, no bookmark, no end) for this long is dead: it is closed and
    #: opened again, and /readyz answers 503 until it is. The API server sends a bookmark about once a minute,
    #: and ends each watch after watch_server_timeout_s, so a live watch is never silent this long.
    watch_progress_s: float = 90.0
    #: the API server ends each watch after this (the client re-watches from its last resourceVersion)
    watch_server_timeout_s: int = 60

    def __post_init__(self) -> None:
        for name in ("connect_s", "read_s", "bind_s", "evict_s", "list_page_s", "watch_progress_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"ApiTimeouts.{name} must be positive")
        if not 0 < self.watch_server_timeout_s < self.watch_progress_s:
            # a watch the server ends normally must never look dead
            raise ValueError("ApiTimeouts.watch_server_timeout_s must be positive and below watch_progress_s")

    @property
    def commit_worst_case_s(self) -> float:
        """The most a bind holds its node's turn: the Binding, then the check after a failed one."""
        return self.bind_s + self.read_s

    @property
    def bind_worst_case_s(self) -> float:
        """The most one bind verb spends in API calls: prepare's pod read, the Binding, the check after it."""
        return self.read_s + self.commit_worst_case_s

    @property
    def turn_wait_limit_s(self) -> float:
        """How long a bind may wait for its node's turn and still be answered within kube-scheduler's timeout."""
        return SCHEDULER_EXTENDER_TIMEOUT_S - self.bind_worst_case_s


DEFAULT_TIMEOUTS = ApiTimeouts()


class DeadlineExceeded(TimeoutError):
    """An API call did not complete within its deadline."""


def keepalive_socket_options() -> list[tuple[int, int, int]]:
    """urllib3 socket options: its defaults (TCP_NODELAY) plus keepalive and, on Linux, TCP_USER_TIMEOUT."""
    options: list[tuple[int, int, int]] = list(urllib3.connection.HTTPConnection.default_socket_options)
    options.append((socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1))
    for name, value in (
        ("TCP_KEEPIDLE", KEEPALIVE_IDLE_S),
        ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL_S),
        ("TCP_KEEPCNT", KEEPALIVE_PROBES),
        ("TCP_USER_TIMEOUT", TCP_USER_TIMEOUT_MS),
    ):
        if hasattr(socket, name):  # Linux has all of them; elsewhere the kernel's defaults apply
            options.append((socket.IPPROTO_TCP, getattr(socket, name), value))
    return options


def configure(configuration: client.Configuration, *, pool_size: int = CONNECTION_POOL_SIZE) -> None:
    """Keepalive, no hidden retries and the pool size; must be set before the ApiClient is made from it."""
    configuration.retries = False  # urllib3 raises the first error: each call's deadline is the whole story
    configuration.socket_options = keepalive_socket_options()
    configuration.connection_pool_maxsize = pool_size


def make_api_client(kubeconfig: str | None, *, pool_size: int = CONNECTION_POOL_SIZE) -> client.ApiClient:
    """A client from --kubeconfig, else in-cluster config, else the default kubeconfig."""
    configuration = client.Configuration()
    if kubeconfig:
        config.load_kube_config(config_file=kubeconfig, client_configuration=configuration)
    else:
        try:
            config.load_incluster_config(client_configuration=configuration)
        except config.ConfigException:
            config.load_kube_config(client_configuration=configuration)
    configure(configuration, pool_size=pool_size)
    return client.ApiClient(configuration)


def urllib3_timeout(total_s: float, connect_s: float) -> urllib3.Timeout:
    """Connect within connect_s, and connect plus the wait for the headers within total_s (the body is read under
    `read_body`'s reaper). The generated API methods take `_request_timeout=total_s`, which urllib3 reads as
    Timeout(total=total_s): the same bound without the shorter connect limit."""
    return urllib3.Timeout(connect=min(connect_s, total_s), total=total_s)


class _Reaper:
    """One thread that shuts down the sockets of responses still being read when their deadline passes."""

    def __init__(self) -> None:
        self._condition = threading.Condition()
        self._heap: list[tuple[float, int]] = []
        self._actions: dict[int, Callable[[], None]] = {}
        self._fired: set[int] = set()
        self._tokens = itertools.count()
        self._thread: threading.Thread | None = None

    def arm(self, deadline: float, action: Callable[[], None]) -> int:
        with self._condition:
            token = next(self._tokens)
            self._actions[token] = action
            heapq.heappush(self._heap, (deadline, token))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="api-deadlines", daemon=True)
                self._thread.start()
            elif self._heap[0][1] == token:
                self._condition.notify()  # a new earliest deadline
            return token

    def disarm(self, token: int) -> bool:
        """Forget the deadline; True if it had already fired."""
        with self._condition:
            self._actions.pop(token, None)
            if token in self._fired:
                self._fired.discard(token)
                return True
            return False

    def _run(self) -> None:
        while True:
            with self._condition:
                while self._heap and self._heap[0][1] not in self._actions:
                    heapq.heappop(self._heap)  # disarmed
                if not self._heap:
                    self._condition.wait()
                    continue
                deadline, token = self._heap[0]
                delay = deadline - time.monotonic()
                if delay > 0:
                    self._condition.wait(delay)
                    continue
                heapq.heappop(self._heap)
                action = self._actions.pop(token)
                self._fired.add(token)
            try:
                action()
            except Exception:  # the response finished meanwhile: nothing to interrupt
                pass


_reaper = _Reaper()


def read_body(response: Any, deadline: float, what: str) -> bytes:
    """The whole body of a raw (preload_content=False) response, by `deadline` (time.monotonic()), else
    DeadlineExceeded. The connection goes back to the pool only after a complete, timely read."""

    def interrupt() -> None:
        response.shutdown()  # wakes the reading thread; the read then fails or comes back short

    if deadline - time.monotonic() <= 0:
        response.close()
        raise DeadlineExceeded(f"{what}: no answer within the deadline")
    token = _reaper.arm(deadline, interrupt)
    data = b""
    error: BaseException | None = None
    try:
        data = response.read()
    except Exception as exc:
        error = exc
    fired = _reaper.disarm(token)
    if fired or error is not None:
        response.close()  # an interrupted or broken connection is not reused
        if fired:
            raise DeadlineExceeded(f"{what}: no complete answer within the deadline") from None
        assert error is not None
        raise error
    response.release_conn()
    body: bytes = data
    return body
