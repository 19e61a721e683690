"""kube_vgpu.probes, the plain-HTTP probe and metrics listener of the extender and the device plugin, over real TCP:
its routes, and its bounds on connections, threads and waits (issue 20, item 6: 200 half-sent requests held 200
threads). Durations are the server's settings, made short; what is asserted is what happened, never how long it
took; WAIT_S only bounds a wait for something that must happen."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from kube_vgpu.probes import ProbeServer, Reply, serve_probes

WAIT_S = 20.0
LONG_S = 600.0


@contextmanager
def running(routes: dict[str, Callable[[], Reply]] | None = None, **limits: Any) -> Iterator[ProbeServer]:
    server = serve_probes("127.0.0.1", 0, routes or {"/healthz": lambda: (200, "text/plain", b"ok")}, **limits)
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def connect(server: ProbeServer) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.server_address[1]), timeout=WAIT_S)


def get(server: ProbeServer, path: str = "/healthz", method: str = "GET") -> bytes:
    with connect(server) as sock:
        sock.sendall(f"{method} {path} HTTP/1.1\r\nHost: probe\r\n\r\n".encode())
        return read_all(sock)


def read_all(sock: socket.socket) -> bytes:
    """Everything until the server closes (HTTP/1.0: one response per connection); b"" when it closed at once."""
    sock.settimeout(WAIT_S)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    return data


def partial(server: ProbeServer) -> socket.socket:
    """A connection that sends half a request head and then nothing."""
    sock = connect(server)
    sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: pro")
    return sock


def eventually(check: Callable[[], bool]) -> bool:
    deadline = time.monotonic() + WAIT_S
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_routes_and_what_is_not_a_route() -> None:
    routes: dict[str, Callable[[], Reply]] = {
        "/healthz": lambda: (200, "text/plain", b"ok"),
        "/readyz": lambda: (503, "text/plain", b"not yet"),
    }
    with running(routes) as server:
        ok = get(server, "/healthz?verbose=1")  # a query string does not change the route
        assert ok.startswith(b"HTTP/1.0 200") and ok.endswith(b"\r\n\r\nok") and b"Content-Length: 2" in ok
        assert get(server, "/readyz").startswith(b"HTTP/1.0 503")
        assert get(server, "/nope").startswith(b"HTTP/1.0 404")
        assert get(server, "/healthz", method="POST").startswith(b"HTTP/1.0 501")


def test_many_half_sent_requests_hold_a_bounded_number_of_threads_and_a_probe_still_gets_through() -> None:
    """The issue's case: 200 partial requests. Threads stay within the cap, and each new connection takes the place
    of the oldest stalled one, so a real probe is answered in the middle of the flood."""
    threads_before = threading.active_count()
    with running(max_connections=8, read_timeout_s=LONG_S, request_timeout_s=LONG_S) as server:
        stalled = [partial(server) for _ in range(200)]
        assert sum(not c.cut for c in list(server.connections.values())) <= 8
        # the handlers, the accept loop, and a cut one that has signalled its end but not yet returned
        assert threading.active_count() - threads_before <= 8 + 1 + 1
        assert get(server).startswith(b"HTTP/1.0 200")
        assert server.closed_counts["evicted"] >= 200 - 8
        assert server.closed_counts["refused"] == 0
        cut = [read_all(sock) for sock in stalled[:150]]  # the oldest were cut, unanswered
        assert cut == [b""] * 150
        for sock in stalled:
            sock.close()
    assert eventually(lambda: threading.active_count() <= threads_before)


def test_the_connection_cap_on_both_sides() -> None:
    with running(max_connections=3, read_timeout_s=LONG_S, request_timeout_s=LONG_S) as server:
        held = [partial(server) for _ in range(3)]
        assert eventually(lambda: len(server.connections) == 3)
        assert server.closed_counts["evicted"] == 0  # at the cap: all kept
        newest = partial(server)  # one over: the oldest unfinished one makes room
        assert read_all(held[0]) == b""
        assert server.closed_counts["evicted"] == 1
        assert eventually(lambda: len(server.connections) == 3)
        for sock in (*held[1:], newest):  # the others are still served once they finish their request
            sock.sendall(b"be\r\n\r\n")
            assert read_all(sock).startswith(b"HTTP/1.0 200")
            sock.close()
        held[0].close()


def test_when_every_connection_is_being_answered_a_new_one_is_refused() -> None:
    release = threading.Event()

    def slow() -> Reply:
        release.wait(WAIT_S)
        return 200, "text/plain", b"done"

    with running({"/slow": slow}, max_connections=2) as server:
        answering = [connect(server) for _ in range(2)]
        for sock in answering:
            sock.sendall(b"GET /slow HTTP/1.1\r\n\r\n")
        assert eventually(lambda: sum(c.requested for c in list(server.connections.values())) == 2)
        with connect(server) as refused:
            assert read_all(refused) == b""  # closed at once
        assert server.closed_counts["refused"] == 1
        release.set()
        for sock in answering:
            assert read_all(sock).endswith(b"done")
            sock.close()


def test_a_connection_that_sends_nothing_is_closed_after_the_read_timeout() -> None:
    with running(read_timeout_s=0.3) as server:
        with connect(server) as silent:
            assert read_all(silent) == b""
        with partial(server) as stalled:
            assert read_all(stalled) == b""
        assert eventually(lambda: not server.connections)
        assert get(server).startswith(b"HTTP/1.0 200")


def test_a_request_not_complete_in_time_is_cut_when_the_next_connection_comes() -> None:
    # reads never time out here: only the whole-request deadline, checked as connections arrive, can end it
    with running(read_timeout_s=LONG_S, request_timeout_s=0.3) as server:
        stalled = partial(server)
        assert eventually(lambda: get(server).startswith(b"HTTP/1.0 200") and server.closed_counts["request_timeout"])
        assert read_all(stalled) == b""
        stalled.close()


def test_limits_refuse_a_cap_below_one() -> None:
    with pytest.raises(ValueError, match="max_connections must be at least 1, got 0"):
        ProbeServer(("127.0.0.1", 0), {}, max_connections=0)
