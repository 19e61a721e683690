"""A fault-injecting TCP/HTTP proxy for tests: put it between a client and a real server and make the path
misbehave the way networks and overloaded servers do.

Faults, for the whole proxy (`set_fault`) or for matching HTTP requests (`add_rule`):

* ``PASS``       forward everything;
* ``DELAY``      forward each piece of data `delay_s` late (a request matched by a rule: that request only);
* ``HANG``       accept and never answer: new connections are accepted and then silent, and a request on an open
                 connection is swallowed (its connection goes silent); answers already streaming (a watch) go on;
* ``HALF_OPEN``  every open connection stops forwarding in both directions without closing, as when a NAT entry
                 or a network path disappears: neither end learns anything; new connections are silent too;
* ``DROP``       connections are reset (RST): open ones at once, new ones as soon as they are accepted.

A connection that went silent stays silent for good (a dead path does not come back); after `set_fault(PASS)`
new connections work again. Silent connections keep reading and discarding, so the sender never blocks.

HTTP awareness: with `http=True` the proxy reads HTTP/1.1 requests (Content-Length framed, as urllib3 sends
them) to apply rules by method and path, and records every request in `requests`. Through TLS, give it
`server_tls` (a server context with a certificate the client trusts) and `upstream_tls` (a client context that
trusts the server): it then terminates TLS on both sides and still sees the requests. Without `http` it forwards
bytes and applies only the proxy-wide fault.

One thread per connection (a select loop over both ends: an SSL socket must not be read and written from two
threads at once).
"""

from __future__ import annotations

import contextlib
import enum
import re
import select
import socket
import ssl
import struct
import threading
import time
from dataclasses import dataclass, field
from types import TracebackType


class Fault(enum.Enum):
    PASS = "pass"
    DELAY = "delay"
    HANG = "hang"
    HALF_OPEN = "half-open"
    DROP = "drop"


@dataclass
class Rule:
    """Apply `fault` to the next `times` requests (None: every request) matching method and path."""

    fault: Fault
    method: str | None = None
    path: re.Pattern[str] = field(default_factory=lambda: re.compile(""))
    times: int | None = 1
    delay_s: float = 0.0
    matched: int = 0

    def matches(self, method: str, path: str) -> bool:
        if self.times is not None and self.matched >= self.times:
            return False
        return (self.method is None or self.method == method) and self.path.search(path) is not None


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    fault: Fault


def _reset(sock: socket.socket) -> None:
    """Close with RST instead of FIN."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(OSError):
        sock.close()


class _Connection:
    def __init__(self, proxy: FaultProxy, client: socket.socket, silent: bool) -> None:
        self.proxy = proxy
        self.client = client
        self.upstream: socket.socket | None = None
        self.silent = silent
        self.upstream_closed = False
        self.dropped = False
        self.raw = not proxy.http  # forward bytes without reading requests
        self.request_buffer = b""

    # --- life cycle -------------------------------------------------------------------------------
    def run(self) -> None:
        try:
            if self.silent:
                self._sink()
                return
            if self.proxy.server_tls is not None:
                self.client.settimeout(10)
                self.client = self.proxy.server_tls.wrap_socket(self.client, server_side=True)
            upstream = socket.create_connection(self.proxy.upstream, timeout=10)
            if self.proxy.upstream_tls is not None:
                upstream = self.proxy.upstream_tls.wrap_socket(upstream, server_hostname=self.proxy.upstream[0])
            self.upstream = upstream
            self._pump()
        except (OSError, ssl.SSLError, ValueError):
            pass  # a peer went away or the proxy closed: nothing to report
        finally:
            self.close()

    def close(self) -> None:
        for sock in (self.client, self.upstream):
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.close()
        self.proxy._forget(self)

    def drop(self) -> None:
        self.dropped = True
        for sock in (self.client, self.upstream):
            if sock is not None:
                _reset(sock)

    def go_silent(self) -> None:
        self.silent = True

    # --- data -------------------------------------------------------------------------------------
    def _sink(self) -> None:
        """Accepted, never answered: read and discard until the client or the proxy gives up."""
        self.client.settimeout(0.2)
        while not self.proxy.closed and not self.dropped:
            try:
                if not self.client.recv(65536):
                    return
            except TimeoutError:
                continue

    def _readable(self) -> list[socket.socket]:
        assert self.upstream is not None
        ends = [self.client] if self.upstream_closed else [self.client, self.upstream]
        pending = [s for s in ends if isinstance(s, ssl.SSLSocket) and s.pending()]
        if pending:
            return pending
        ready, _, _ = select.select(ends, [], [], 0.2)
        return ready

    def _pump(self) -> None:
        assert self.upstream is not None
        for sock in (self.client, self.upstream):
            sock.settimeout(0.2)
        while not self.proxy.closed and not self.dropped:
            for sock in self._readable():
                try:
                    data = sock.recv(65536)
                except (TimeoutError, ssl.SSLWantReadError):
                    continue
                if not data:
                    if sock is self.upstream and self.silent:
                        # the server ended its side; on a dead path the client never hears of it
                        self.upstream_closed = True
                        continue
                    return
                if self.silent:
                    continue  # a dead path: the bytes go nowhere
                if sock is self.client:
                    self._from_client(data)
                else:
                    self._from_upstream(data)
                if self.dropped:
                    return

    def _from_upstream(self, data: bytes) -> None:
        fault, delay_s = self.proxy.fault, self.proxy.delay_s
        if fault is Fault.DELAY:
            time.sleep(delay_s)
        if not self.silent and not self.dropped:
            self.client.sendall(data)

    def _from_client(self, data: bytes) -> None:
        assert self.upstream is not None
        if self.raw:
            fault = self.proxy.fault
            if fault is Fault.HANG:
                self.go_silent()
            elif fault is Fault.DROP:
                self.drop()
            else:
                if fault is Fault.DELAY:
                    time.sleep(self.proxy.delay_s)
                self.upstream.sendall(data)
            return
        self.request_buffer += data
        while not self.silent and not self.dropped:
            request = self._next_request()
            if request is None:
                return
            method, path, raw = request
            fault, delay_s = self.proxy._decide(method, path)
            if fault is Fault.HANG or fault is Fault.HALF_OPEN:
                self.go_silent()
            elif fault is Fault.DROP:
                self.drop()
            else:
                if fault is Fault.DELAY:
                    time.sleep(delay_s)
                self.upstream.sendall(raw)

    def _next_request(self) -> tuple[str, str, bytes] | None:
        """The next whole request in the buffer (method, path, bytes), or None until more arrives."""
        end = self.request_buffer.find(b"\r\n\r\n")
        if end < 0:
            return None
        head = self.request_buffer[:end].decode("latin-1")
        request_line, *header_lines = head.split("\r\n")
        method, target = [*request_line.split(" "), "", ""][:2]
        headers = {}
        for line in header_lines:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        if "chunked" in headers.get("transfer-encoding", "").lower():
            # not framed by length: forward this and everything after it as bytes
            self.raw = True
            raw, self.request_buffer = self.request_buffer, b""
            return method, target.split("?", 1)[0], raw
        total = end + 4 + int(headers.get("content-length") or 0)
        if len(self.request_buffer) < total:
            return None
        raw, self.request_buffer = self.request_buffer[:total], self.request_buffer[total:]
        return method, target.split("?", 1)[0], raw


class FaultProxy:
    """Listens on 127.0.0.1 (a free port) and forwards to `upstream` (host, port)."""

    def __init__(
        self,
        upstream: tuple[str, int],
        *,
        http: bool = True,
        server_tls: ssl.SSLContext | None = None,
        upstream_tls: ssl.SSLContext | None = None,
    ) -> None:
        self.upstream = upstream
        self.http = http
        self.server_tls = server_tls
        self.upstream_tls = upstream_tls
        self.fault = Fault.PASS
        self.delay_s = 0.0
        self.rules: list[Rule] = []
        #: every HTTP request seen, with the fault it met
        self.requests: list[Request] = []
        self.closed = False
        self._lock = threading.Lock()
        self._connections: set[_Connection] = set()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.2)
        self.port: int = self._listener.getsockname()[1]
        self._thread = threading.Thread(target=self._accept, name="fault-proxy", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        scheme = "https" if self.server_tls is not None else "http"
        return f"{scheme}://127.0.0.1:{self.port}"

    def set_fault(self, fault: Fault, delay_s: float = 0.0) -> None:
        """The fault for everything from now on (rules still come first for the requests they match)."""
        with self._lock:
            self.fault, self.delay_s = fault, delay_s
            connections = list(self._connections)
        if fault is Fault.HALF_OPEN:
            for connection in connections:
                connection.go_silent()
        elif fault is Fault.DROP:
            for connection in connections:
                connection.drop()

    def add_rule(
        self,
        fault: Fault,
        *,
        method: str | None = None,
        path: str = "",
        times: int | None = 1,
        delay_s: float = 0.0,
    ) -> Rule:
        rule = Rule(fault, method, re.compile(path), times, delay_s)
        with self._lock:
            self.rules.append(rule)
        return rule

    def requests_matching(self, method: str, path: str) -> list[Request]:
        pattern = re.compile(path)
        with self._lock:
            return [r for r in self.requests if r.method == method and pattern.search(r.path)]

    @property
    def open_connections(self) -> int:
        with self._lock:
            return len(self._connections)

    def close(self) -> None:
        self.closed = True
        with contextlib.suppress(OSError):
            self._listener.close()
        with self._lock:
            connections = list(self._connections)
        for connection in connections:
            connection.drop()
        self._thread.join(5)

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.close()

    # --- internals --------------------------------------------------------------------------------
    def _decide(self, method: str, path: str) -> tuple[Fault, float]:
        with self._lock:
            for rule in self.rules:
                if rule.matches(method, path):
                    rule.matched += 1
                    fault, delay_s = rule.fault, rule.delay_s
                    break
            else:
                fault, delay_s = self.fault, self.delay_s
            self.requests.append(Request(method, path, fault))
        return fault, delay_s

    def _forget(self, connection: _Connection) -> None:
        with self._lock:
            self._connections.discard(connection)

    def _accept(self) -> None:
        while not self.closed:
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with self._lock:
                fault = self.fault
                if fault is Fault.DROP:
                    connection = None
                else:
                    connection = _Connection(self, client, silent=fault in (Fault.HANG, Fault.HALF_OPEN))
                    self._connections.add(connection)
            if connection is None:
                _reset(client)
                continue
            threading.Thread(target=connection.run, name="fault-proxy-connection", daemon=True).start()
