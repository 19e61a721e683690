"""The webhook's connection bounds over real TCP and TLS (issue 20, item 5): how many connections it keeps, how long a
connection may take to send a request head or stay idle, how long a body may take, how many requests run at once.

Durations here are the server's settings, made short so the tests finish quickly; what is asserted is what happened
(a connection closed, a status code), never how long it took. WAIT_S only bounds a wait for something that must
happen."""

from __future__ import annotations

import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from kube_vgpu.webhook.certs import CertificatePaths
from kube_vgpu.webhook.config import ConnectionLimits, WebhookConfig
from kube_vgpu.webhook.server import WebhookServer
from tests.servers import free_port
from tests.webhook.builders import admission_review, gpu_container, pod
from tests.webhook.conftest import client_context

WAIT_S = 20.0
LONG_S = 600.0  # a timeout that must not act during a test


def limits(**changes: Any) -> ConnectionLimits:
    values: dict[str, Any] = {"header_timeout_s": LONG_S, "idle_timeout_s": LONG_S, "body_timeout_s": LONG_S}
    values.update(changes)
    return ConnectionLimits(**values)


@contextmanager
def running(certs: CertificatePaths, connection_limits: ConnectionLimits) -> Iterator[WebhookServer]:
    server = WebhookServer(WebhookConfig(), cert_file=certs.cert, key_file=certs.key, host="127.0.0.1", port=0,
                           log_level="warning", limits=connection_limits)  # fmt: skip
    server.start_in_thread()
    try:
        yield server
    finally:
        server.stop()


def tls_connect(server: WebhookServer, ca_file: Path) -> ssl.SSLSocket:
    """A TLS connection with its handshake done (verified against our CA), sending nothing."""
    raw = socket.create_connection(("127.0.0.1", server.port), timeout=WAIT_S)
    return client_context(ca_file).wrap_socket(raw, server_hostname="localhost")


def closed_by_server(sock: socket.socket) -> bool:
    """Whether the server closes the connection (EOF or reset) within WAIT_S; reads and drops anything sent before."""
    sock.settimeout(WAIT_S)
    try:
        while sock.recv(65536):
            pass
    except (ConnectionResetError, ssl.SSLError):
        return True
    except TimeoutError:
        return False
    return True


def still_open(sock: ssl.SSLSocket) -> bool:
    """A request on the connection is answered (the server kept it)."""
    body = orjson.dumps(admission_review(pod()))
    sock.sendall(b"POST /mutate HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))  # fmt: skip
    return read_response(sock).startswith(b"HTTP/1.1 200")


def read_response(sock: socket.socket) -> bytes:
    """The next final response (head and its Content-Length body), after any 100 Continue."""
    sock.settimeout(WAIT_S)
    data = b""
    while True:
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(65536)
            if not chunk:
                return data
            data += chunk
        head, _, rest = data.partition(b"\r\n\r\n")
        if not head.startswith(b"HTTP/1.1 100"):
            break
        data = rest
    lengths = [line.split(b":", 1)[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")]
    length = int(lengths[0]) if lengths else 0
    while len(rest) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        rest += chunk
    return head + b"\r\n\r\n" + rest


def start_request_and_hold_body(sock: ssl.SSLSocket, body_length: int = 100) -> None:
    """Send a request head announcing a body, and wait until the server is reading it (its 100 Continue): the request
    is then in progress and holds one of the server's request slots."""
    sock.sendall(b"POST /mutate HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                 b"Expect: 100-continue\r\nContent-Length: %d\r\n\r\n" % body_length)  # fmt: skip
    sock.settimeout(WAIT_S)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, "the server closed a connection that was sending a request"
        data += chunk
    assert data.startswith(b"HTTP/1.1 100 Continue"), data


def closed_count(server: WebhookServer, reason: str) -> float:
    value = server.metrics.registry.get_sample_value("kube_vgpu_webhook_connections_closed_total", {"reason": reason})
    return value or 0.0


def eventually(check: Callable[[], bool]) -> bool:
    """True once `check()` is (the server may count a close just after the client sees it), False after WAIT_S."""
    deadline = time.monotonic() + WAIT_S
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


# ---------------------------------------------------------------------------------------------
# How many connections
# ---------------------------------------------------------------------------------------------


def test_the_connection_cap_on_both_sides(certs: CertificatePaths) -> None:
    with running(certs, limits(max_connections=4)) as server:
        held = [tls_connect(server, certs.ca_cert) for _ in range(4)]
        assert len(server.gate.connections) == 4  # at the cap: all kept
        assert closed_count(server, "evicted") == 0
        newest = tls_connect(server, certs.ca_cert)  # one over: the longest-idle one makes room
        assert closed_by_server(held[0])
        assert closed_count(server, "evicted") == 1
        assert len(server.gate.connections) == 4
        assert all(still_open(sock) for sock in (*held[1:], newest))
        for sock in (*held, newest):
            sock.close()


def test_a_flood_of_idle_connections_never_locks_out_a_real_request(certs: CertificatePaths) -> None:
    """The issue's case, scaled down: far more idle TLS connections than the cap; memory stays bounded by the cap,
    and a real admission still gets through (it evicts an idle connection)."""
    with running(certs, limits(max_connections=8)) as server:
        flood = [tls_connect(server, certs.ca_cert) for _ in range(40)]
        assert len(server.gate.connections) == 8
        assert server.metrics.registry.get_sample_value("kube_vgpu_webhook_connections") == 8
        with httpx.Client(base_url=f"https://localhost:{server.port}", verify=client_context(certs.ca_cert)) as http:
            reply = http.post("/mutate", content=orjson.dumps(admission_review(pod(gpu_container(gpu="1")))))
            assert reply.status_code == 200 and reply.json()["response"]["allowed"] is True
        assert sum(closed_by_server(sock) for sock in flood[:32]) == 32  # the oldest made room, in order
        assert closed_count(server, "evicted") >= 33
        for sock in flood:
            sock.close()


def test_at_the_cap_with_every_connection_mid_request_a_new_one_is_refused(certs: CertificatePaths) -> None:
    with running(certs, limits(max_connections=2)) as server:
        busy = [tls_connect(server, certs.ca_cert) for _ in range(2)]
        for sock in busy:
            start_request_and_hold_body(sock)
        with pytest.raises((ConnectionError, ssl.SSLError)):  # refused at accept: reset before any TLS
            tls_connect(server, certs.ca_cert).recv(1)
        assert closed_count(server, "refused") == 1
        for sock in busy:  # the requests in progress finish normally
            sock.sendall(b" " * 99 + b"x")
            reply = read_response(sock)
            assert reply.startswith(b"HTTP/1.1 400") and b"malformed AdmissionReview" in reply
            sock.close()
        with tls_connect(server, certs.ca_cert) as sock:
            assert still_open(sock)


def test_stopping_drops_idle_connections_and_lets_a_request_in_progress_finish(certs: CertificatePaths) -> None:
    server = WebhookServer(WebhookConfig(), cert_file=certs.cert, key_file=certs.key, host="127.0.0.1", port=0,
                           log_level="warning", limits=limits())  # fmt: skip
    server.start_in_thread()
    idle = [tls_connect(server, certs.ca_cert) for _ in range(3)]
    busy = tls_connect(server, certs.ca_cert)
    start_request_and_hold_body(busy)
    stopping = threading.Thread(target=server.stop)
    stopping.start()
    assert all(closed_by_server(sock) for sock in idle)
    assert eventually(lambda: closed_count(server, "shutdown") == 3)
    busy.sendall(b" " * 100)
    assert read_response(busy).startswith(b"HTTP/1.1 400")
    stopping.join(WAIT_S)
    assert not stopping.is_alive()
    for sock in (*idle, busy):
        sock.close()


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def _open_connections(port: int, ca_file: Path) -> float:
    with httpx.Client(base_url=f"https://localhost:{port}", verify=client_context(ca_file)) as http:
        text = http.get("/metrics").text
    lines = [line for line in text.splitlines() if line.startswith("kube_vgpu_webhook_connections ")]
    return float(lines[0].split()[1])


def test_memory_of_closed_connections_goes_back_to_the_os(tmp_path: Path) -> None:
    """Each TLS connection holds ~0.27 MiB; after a burst closes, the process shrinks again instead of keeping its
    peak (the issue saw memory not returned)."""
    directory = tmp_path / "certs"
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "kube_vgpu.cli", "webhook", "--host", "127.0.0.1", "--port", str(port),
         "--self-signed-dir", str(directory), "--log-level", "warning"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        assert eventually(lambda: (directory / "ca.crt").exists() and _answers(port, directory / "ca.crt"))
        before_mib = _rss_mib(process.pid)
        burst = [_tls_to(port, directory / "ca.crt") for _ in range(150)]
        peak_mib = _rss_mib(process.pid)
        assert peak_mib - before_mib > 150 * 0.2  # what the burst costs while it is open
        for sock in burst:
            sock.close()
        assert eventually(lambda: _open_connections(port, directory / "ca.crt") <= 1)
        after_mib = _rss_mib(process.pid)
        assert after_mib - before_mib < (peak_mib - before_mib) / 2, (before_mib, peak_mib, after_mib)
    finally:
        process.terminate()
        process.wait(WAIT_S)


def _tls_to(port: int, ca_file: Path) -> ssl.SSLSocket:
    raw = socket.create_connection(("127.0.0.1", port), timeout=WAIT_S)
    return client_context(ca_file).wrap_socket(raw, server_hostname="localhost")


def _answers(port: int, ca_file: Path) -> bool:
    try:
        with httpx.Client(verify=client_context(ca_file)) as http:
            return http.get(f"https://localhost:{port}/healthz").status_code == 200
    except (httpx.HTTPError, OSError):
        return False


# ---------------------------------------------------------------------------------------------
# How long
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("stall", ["no-tls-handshake", "no-request", "partial-head"])
def test_a_connection_without_a_request_head_in_time_is_closed(certs: CertificatePaths, stall: str) -> None:
    with running(certs, limits(header_timeout_s=0.5)) as server:
        reason = "header_timeout"
        if stall == "no-tls-handshake":
            sock: socket.socket = socket.create_connection(("127.0.0.1", server.port), timeout=WAIT_S)
        else:
            sock = tls_connect(server, certs.ca_cert)
            if stall == "partial-head":
                sock.sendall(b"POST /mutate HTTP/1.1\r\nHost: localhost\r\n")  # ... and never the blank line
        assert closed_by_server(sock)
        assert closed_count(server, reason) == 1
        assert len(server.gate.connections) == 0
        sock.close()
        with tls_connect(server, certs.ca_cert) as fresh:  # the server is fine
            assert still_open(fresh)


def test_a_failed_handshake_is_closed_and_counted(certs: CertificatePaths) -> None:
    with running(certs, limits()) as server:
        with socket.create_connection(("127.0.0.1", server.port), timeout=WAIT_S) as sock:
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: localhost\r\n\r\n")  # plain HTTP to the TLS port
            assert closed_by_server(sock)
        assert eventually(lambda: closed_count(server, "handshake_failed") == 1)
        assert eventually(lambda: len(server.gate.connections) == 0)


def test_a_request_in_time_keeps_its_connection_and_the_idle_deadline_then_closes_it(
    certs: CertificatePaths,
) -> None:
    with running(certs, limits(header_timeout_s=LONG_S, idle_timeout_s=0.5)) as server:
        sock = tls_connect(server, certs.ca_cert)
        assert still_open(sock)  # keep-alive: answered, connection kept for the next request
        assert closed_by_server(sock)  # ... until it has been idle too long
        assert closed_count(server, "idle_timeout") == 1
        assert closed_count(server, "header_timeout") == 0
        sock.close()


def test_a_request_in_progress_is_never_cut_by_the_idle_or_header_deadline(certs: CertificatePaths) -> None:
    with running(certs, limits(header_timeout_s=0.3, idle_timeout_s=0.3, body_timeout_s=LONG_S)) as server:
        sock = tls_connect(server, certs.ca_cert)
        start_request_and_hold_body(sock)
        other = tls_connect(server, certs.ca_cert)
        assert closed_by_server(other)  # the header deadline has passed for a connection without a request...
        sock.sendall(b"{" + b" " * 99)  # ... but the one mid-request is still served
        assert read_response(sock).startswith(b"HTTP/1.1 400")
        sock.close()
        other.close()


def test_a_slow_body_gets_408_and_the_server_keeps_serving(certs: CertificatePaths) -> None:
    with running(certs, limits(body_timeout_s=0.5)) as server:
        sock = tls_connect(server, certs.ca_cert)
        start_request_and_hold_body(sock, body_length=1000)
        sock.sendall(b'{"apiVersion"')  # then nothing more
        reply = read_response(sock)
        assert reply.startswith(b"HTTP/1.1 408")
        assert orjson.loads(reply.partition(b"\r\n\r\n")[2])["message"] == "request body not received within 0.5 s"
        assert server.metrics.registry.get_sample_value(
            "kube_vgpu_webhook_requests_refused_total", {"reason": "body_timeout"}
        ) == 1
        sock.close()
        with tls_connect(server, certs.ca_cert) as fresh:
            assert still_open(fresh)


def test_a_client_leaving_mid_body_is_counted_and_frees_its_slot(certs: CertificatePaths) -> None:
    with running(certs, limits(max_concurrent_requests=1)) as server:
        leaving = tls_connect(server, certs.ca_cert)
        start_request_and_hold_body(leaving)
        leaving.sendall(b'{"apiVersion"')
        leaving.close()
        assert eventually(lambda: server.metrics.registry.get_sample_value(
            "kube_vgpu_webhook_requests_refused_total", {"reason": "disconnected"}) == 1)  # fmt: skip
        with tls_connect(server, certs.ca_cert) as fresh:  # the one slot is free again
            assert still_open(fresh)


# ---------------------------------------------------------------------------------------------
# How many requests at once
# ---------------------------------------------------------------------------------------------


def _full_request() -> bytes:
    body = orjson.dumps(admission_review(pod(gpu_container(gpu="1"))))
    return (b"POST /mutate HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body))  # fmt: skip


def test_a_request_beyond_the_concurrency_limit_waits_for_a_slot(certs: CertificatePaths) -> None:
    with running(certs, limits(max_concurrent_requests=1)) as server:
        first = tls_connect(server, certs.ca_cert)
        start_request_and_hold_body(first)  # holds the only slot
        second = tls_connect(server, certs.ca_cert)
        second.sendall(_full_request())
        second.settimeout(0.2)
        with pytest.raises(TimeoutError):  # waiting: nothing answered while the slot is taken
            second.recv(1)
        first.sendall(b" " * 100)
        assert read_response(first).startswith(b"HTTP/1.1 400")
        assert read_response(second).startswith(b"HTTP/1.1 200")
        first.close()
        second.close()


def test_no_slot_within_the_body_timeout_is_a_503(certs: CertificatePaths) -> None:
    # Each request waits up to the body timeout for a slot, then has the body timeout for its body. Two stalled
    # bodies in a row hold the one slot for two timeouts: the request queued behind them gets 503 after one.
    with running(certs, limits(max_concurrent_requests=1, body_timeout_s=2.0)) as server:
        holder = tls_connect(server, certs.ca_cert)
        start_request_and_hold_body(holder)
        next_holder = tls_connect(server, certs.ca_cert)
        next_holder.sendall(b"POST /mutate HTTP/1.1\r\nHost: localhost\r\nContent-Length: 100\r\n\r\n")
        waiting = tls_connect(server, certs.ca_cert)
        waiting.sendall(_full_request())
        reply = read_response(waiting)
        assert reply.startswith(b"HTTP/1.1 503")
        assert orjson.loads(reply.partition(b"\r\n\r\n")[2])["message"] == "more than 1 admission requests at once"
        assert read_response(holder).startswith(b"HTTP/1.1 408")  # the stalled bodies run out of time themselves
        assert read_response(next_holder).startswith(b"HTTP/1.1 408")
        assert server.metrics.registry.get_sample_value(
            "kube_vgpu_webhook_requests_refused_total", {"reason": "busy"}
        ) == 1
        for sock in (holder, next_holder, waiting):
            sock.close()


# ---------------------------------------------------------------------------------------------
# Settings
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"max_connections": 0}, "max_connections must be at least 1, got 0"),
        ({"max_concurrent_requests": 0}, "max_concurrent_requests must be at least 1, got 0"),
        ({"header_timeout_s": 0}, "header_timeout_s must be a positive number of seconds, got 0"),
        ({"idle_timeout_s": -1.0}, "idle_timeout_s must be a positive number of seconds, got -1.0"),
        ({"body_timeout_s": float("inf")}, "body_timeout_s must be a positive number of seconds, got inf"),
        ({"body_timeout_s": float("nan")}, "body_timeout_s must be a positive number of seconds, got nan"),
    ],
)
def test_limits_refuse_bad_values(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError) as refused:
        ConnectionLimits(**changes)
    assert str(refused.value) == message


def test_limits_accept_their_smallest_values() -> None:
    smallest = ConnectionLimits(max_connections=1, max_concurrent_requests=1, header_timeout_s=0.001,
                                idle_timeout_s=0.001, body_timeout_s=0.001)  # fmt: skip
    assert (smallest.max_connections, smallest.max_concurrent_requests) == (1, 1)


def test_cli_flags_reach_the_limits() -> None:
    import argparse

    from kube_vgpu.webhook.cli import add_arguments, limits_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--max-connections", "3", "--max-concurrent-requests", "2", "--header-timeout-seconds",
                              "4", "--idle-timeout-seconds", "5", "--body-timeout-seconds", "6"])  # fmt: skip
    wanted = ConnectionLimits(max_connections=3, max_concurrent_requests=2, header_timeout_s=4, idle_timeout_s=5,
                              body_timeout_s=6)  # fmt: skip
    assert limits_from_args(args) == wanted
    assert limits_from_args(parser.parse_args([])) == ConnectionLimits()

