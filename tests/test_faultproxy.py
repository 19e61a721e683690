"""The fault-injecting proxy (tests/faultproxy.py) does what it says, in front of a real HTTP server (the API
server stand-in, over plain HTTP and over TLS): every fault is checked from the client's side of the path."""

from __future__ import annotations

import socket
import ssl
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kube_vgpu.webhook.certs import ensure_ca_and_serving_cert
from tests.extender.fakeapi import FakeApiServer, running
from tests.faultproxy import Fault, FaultProxy
from tests.helpers import gpu_node
from tests.servers import serve

#: how long the client waits for an answer that must not come
SILENCE_S = 0.5


@pytest.fixture()
def upstream() -> Iterator[tuple[FakeApiServer, int]]:
    server = FakeApiServer()
    server.put("nodes", gpu_node("n1"))
    with running(server) as url:
        yield server, int(url.rsplit(":", 1)[1])


@pytest.fixture()
def proxy(upstream: tuple[FakeApiServer, int]) -> Iterator[FaultProxy]:
    with FaultProxy(("127.0.0.1", upstream[1])) as fault_proxy:
        yield fault_proxy


def get(url: str, path: str = "/api/v1/nodes", *, timeout_s: float = SILENCE_S,
        verify: ssl.SSLContext | bool = True) -> httpx.Response:
    with httpx.Client(base_url=url, timeout=timeout_s, verify=verify) as client:
        return client.get(path)


def watch_lines(client: httpx.Client, server_timeout_s: float = 60) -> Iterator[str]:
    params = {"watch": "true", "resourceVersion": "0", "timeoutSeconds": str(server_timeout_s)}
    # Connection: close: the server closes the connection when it ends the stream
    with client.stream("GET", "/api/v1/nodes", params=params, headers={"Connection": "close"}) as response:
        yield from response.iter_lines()


def test_pass_forwards_and_records_requests(proxy: FaultProxy) -> None:
    answer = get(proxy.url)
    assert answer.status_code == 200 and answer.json()["items"][0]["metadata"]["name"] == "n1"
    assert [(r.method, r.path, r.fault) for r in proxy.requests] == [("GET", "/api/v1/nodes", Fault.PASS)]


def test_delay_holds_each_piece_back(proxy: FaultProxy) -> None:
    proxy.set_fault(Fault.DELAY, delay_s=0.3)
    started = time.monotonic()
    assert get(proxy.url, timeout_s=10).status_code == 200
    assert time.monotonic() - started >= 0.6  # the request and the answer were each held back


def test_hang_accepts_and_never_answers_but_lets_open_streams_go_on(
    proxy: FaultProxy, upstream: tuple[FakeApiServer, int]
) -> None:
    server, _ = upstream
    with httpx.Client(base_url=proxy.url, timeout=10) as client:
        lines = watch_lines(client)
        assert "ADDED" in next(lines)
        proxy.set_fault(Fault.HANG)
        with pytest.raises(httpx.ReadTimeout):
            get(proxy.url)  # a new connection: accepted, never answered
        server.put("nodes", gpu_node("n2"))
        assert '"n2"' in next(lines)  # the answer already streaming goes on


def test_half_open_silences_open_connections_without_closing_them(
    proxy: FaultProxy, upstream: tuple[FakeApiServer, int]
) -> None:
    server, _ = upstream
    with httpx.Client(base_url=proxy.url, timeout=SILENCE_S) as client:
        lines = watch_lines(client, server_timeout_s=0.2)  # the server ends the stream while the path is dead
        assert "ADDED" in next(lines)
        proxy.set_fault(Fault.HALF_OPEN)
        server.put("nodes", gpu_node("n2"))
        with pytest.raises(httpx.ReadTimeout):  # silence, not an event or an end of stream: nothing gets through
            next(lines)
    with pytest.raises(httpx.ReadTimeout):
        get(proxy.url)
    proxy.set_fault(Fault.PASS)
    assert get(proxy.url).status_code == 200  # new connections work again


def test_drop_resets_open_and_new_connections(proxy: FaultProxy) -> None:
    with httpx.Client(base_url=proxy.url, timeout=10) as client:
        lines = watch_lines(client)
        assert "ADDED" in next(lines)
        proxy.set_fault(Fault.DROP)
        with pytest.raises((httpx.ReadError, httpx.RemoteProtocolError)):
            list(lines)
    with pytest.raises(ConnectionResetError):  # the reset may even beat connect() back to the caller
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as sock:
            sock.sendall(b"GET /api/v1/nodes HTTP/1.1\r\nHost: x\r\n\r\n")
            sock.recv(1)


def test_rules_pick_requests_by_method_and_path_and_run_out(proxy: FaultProxy) -> None:
    proxy.add_rule(Fault.HANG, method="GET", path="/nodes$", times=1)
    with pytest.raises(httpx.ReadTimeout):
        get(proxy.url)
    assert get(proxy.url).status_code == 200  # used up
    proxy.add_rule(Fault.DROP, path="/pods$", times=None)
    with pytest.raises((httpx.ReadError, httpx.RemoteProtocolError)):
        get(proxy.url, "/api/v1/pods")
    assert get(proxy.url).status_code == 200
    assert [r.fault for r in proxy.requests] == [Fault.HANG, Fault.PASS, Fault.DROP, Fault.PASS]


def test_through_tls_it_terminates_both_sides_and_still_sees_requests(tmp_path: Path) -> None:
    certs = ensure_ca_and_serving_cert(tmp_path, ("localhost",), ("127.0.0.1",))
    server = FakeApiServer()
    server.put("nodes", gpu_node("n1"))
    server_tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_tls.load_cert_chain(certs.cert, certs.key)
    upstream_tls = ssl.create_default_context(cafile=str(certs.ca_cert))
    with serve(server.app, ssl_certfile=str(certs.cert), ssl_keyfile=str(certs.key)) as url:
        try:
            port = int(url.rsplit(":", 1)[1])
            with FaultProxy(("127.0.0.1", port), server_tls=server_tls, upstream_tls=upstream_tls) as proxy:
                client_tls = ssl.create_default_context(cafile=str(certs.ca_cert))
                assert proxy.url.startswith("https://")
                assert get(proxy.url, verify=client_tls).status_code == 200
                proxy.add_rule(Fault.HANG, path="/nodes$")
                with pytest.raises(httpx.ReadTimeout):
                    get(proxy.url, verify=client_tls)
                assert [r.fault for r in proxy.requests] == [Fault.PASS, Fault.HANG]
        finally:
            server.stop.set()
