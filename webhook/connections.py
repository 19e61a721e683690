"""What one client can hold of the webhook: how many connections, for how long, and how many requests at once.

Why: an open TLS connection costs about 0.27 MiB (asyncio's 256 KiB TLS read buffer), and uvicorn closes none that
never sends a request, so ~800 idle connections once took the webhook past its 256Mi memory limit. The bounds:

* **connections** (`max_connections`): counted at accept, before any TLS state exists. At the cap, a new connection
  takes the place of the longest-idle one (no request in progress: still in its handshake, or between requests),
  so the API server's next call always gets in; only when every connection is mid-request is it refused, which costs
  a TCP reset and no memory.
* **time to the request head** (`header_timeout_s`): from accept (TLS handshake included) until a complete request
  head; a connection that is slower (a stalled handshake, a dribbled head) is closed.
* **idle time** (`idle_timeout_s`): from the end of one response until the next complete request head.
* **the body** (`body_timeout_s`) and **requests at once** (`max_concurrent_requests`, each may buffer a body of up
  to 8 MiB) are enforced by the server's /mutate handler with these limits.

How: uvicorn is given this module's protocol class instead of its own, and no TLS settings. The class accepts the raw
TCP connection, applies the cap, runs the TLS handshake itself (`loop.start_tls`, with the handshake bounded by the
header timeout) and then hands the encrypted transport to uvicorn's HTTP/1.1 protocol, which parses requests as
usual. An ASGI wrapper tells each connection when a request starts and ends (requests are matched to connections by
the client's address and port, unique per open TCP connection), which switches its deadline off and on.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Callable
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn import Config
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.server import ServerState

from kube_vgpu.webhook.config import ConnectionLimits
from kube_vgpu.webhook.metrics import WebhookMetrics

log = logging.getLogger("kube_vgpu.webhook.connections")

Peer = tuple[str, int]


def _peer_of(transport: asyncio.BaseTransport) -> Peer | None:
    """(host, port) as uvicorn writes it into the ASGI scope's `client`."""
    info = transport.get_extra_info("peername")
    if isinstance(info, tuple | list) and len(info) >= 2:
        return (str(info[0]), int(info[1]))
    return None


class ConnectionGate:
    """The open connections of one server, and the limits they live under."""

    def __init__(
        self,
        limits: ConnectionLimits,
        tls_context: Callable[[], ssl.SSLContext],
        metrics: WebhookMetrics | None = None,
    ) -> None:
        self.limits = limits
        self.tls_context = tls_context
        self.metrics = metrics
        self.connections: dict[GatedConnection, None] = {}  # insertion-ordered: oldest first
        self._by_peer: dict[Peer, GatedConnection] = {}

    def admit(self, connection: GatedConnection) -> bool:
        if len(self.connections) >= self.limits.max_connections:
            idle = [c for c in self.connections if c.idle]
            if not idle:
                self.count_closed("refused")
                return False
            min(idle, key=lambda c: c.idle_since_s).close("evicted")
        self.connections[connection] = None
        if connection.peer is not None:
            self._by_peer[connection.peer] = connection
        self._set_gauge()
        return True

    def release(self, connection: GatedConnection) -> None:
        if connection not in self.connections:
            return
        del self.connections[connection]
        if connection.peer is not None and self._by_peer.get(connection.peer) is connection:
            del self._by_peer[connection.peer]
        self._set_gauge()

    def close_idle(self) -> None:
        """On shutdown: drop every connection without a request in progress at once (uvicorn would wait for each TLS
        peer to answer its close, up to its graceful-shutdown timeout); requests in progress are left to finish."""
        for connection in list(self.connections):
            if connection.idle:
                connection.close("shutdown")

    def _set_gauge(self) -> None:
        if self.metrics is not None:
            self.metrics.connections.set(len(self.connections))

    def count_closed(self, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.connections_closed.labels(reason).inc()

    def asgi(self, app: ASGIApp) -> ASGIApp:
        """`app` wrapped so that each connection knows when it has a request in progress."""

        async def gated(scope: Scope, receive: Receive, send: Send) -> None:
            client = scope.get("client") if scope["type"] == "http" else None
            connection = self._by_peer.get((str(client[0]), int(client[1]))) if client else None
            if connection is None:
                await app(scope, receive, send)
                return
            connection.request_started()
            try:
                await app(scope, receive, send)
            finally:
                connection.request_finished()

        return gated

    def protocol_class(self) -> type[asyncio.Protocol]:
        """The class to give uvicorn as `http=`: uvicorn builds one per accepted connection."""
        gate = self

        class Connection(GatedConnection):
            def __init__(
                self,
                config: Config,
                server_state: ServerState,
                app_state: dict[str, Any],
                _loop: asyncio.AbstractEventLoop | None = None,
            ) -> None:
                loop = _loop or asyncio.get_running_loop()

                def make_http() -> asyncio.Protocol:
                    return H11Protocol(config=config, server_state=server_state, app_state=app_state, _loop=loop)

                super().__init__(gate, make_http, loop)

        return Connection


class GatedConnection(asyncio.Protocol):
    """One accepted TCP connection: admitted by the gate, given TLS, then passed through to uvicorn's HTTP protocol.

    It stays the protocol of the TLS transport (the handshake delivers decrypted data to it), forwarding every call,
    so it sees the connection end and can release its place."""

    def __init__(
        self, gate: ConnectionGate, make_http: Callable[[], asyncio.Protocol], loop: asyncio.AbstractEventLoop
    ) -> None:
        self.gate = gate
        self.loop = loop
        self._make_http = make_http
        self.http: asyncio.Protocol | None = None
        self.peer: Peer | None = None
        self.busy = 0  # requests in progress
        self.idle_since_s = loop.time()
        self._raw: asyncio.Transport | None = None
        self._tls: asyncio.Transport | None = None
        self._deadline: asyncio.TimerHandle | None = None
        self._closed = False
        self._early: list[bytes] = []  # decrypted bytes that arrive before the handshake's await returns
        self._early_eof = False
        self._handshake: asyncio.Task[None] | None = None

    # --- the raw TCP connection, then the TLS transport's callbacks ---

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._raw = transport
        self.peer = _peer_of(transport)
        if not self.gate.admit(self):
            self._closed = True
            transport.abort()
            return
        transport.pause_reading()  # nothing is read until start_tls hands the socket to the TLS layer
        self._arm(self.gate.limits.header_timeout_s, "header_timeout")
        self._handshake = self.loop.create_task(self._start_tls(transport))

    async def _start_tls(self, raw: asyncio.Transport) -> None:
        try:
            tls = await self.loop.start_tls(
                raw,
                self,
                self.gate.tls_context(),
                server_side=True,
                # a backstop only: the connection's own deadline (the same header timeout) closes it first
                ssl_handshake_timeout=2 * self.gate.limits.header_timeout_s,
            )
        except asyncio.CancelledError:
            raw.abort()
            self._release()
            raise
        except Exception as exc:  # a failed, timed-out or abandoned handshake; start_tls closed the transport
            if not self._closed:
                self.gate.count_closed("handshake_failed")
                log.debug("TLS handshake with %s failed: %s", self.peer, exc)
            raw.abort()
            self._release()
            return
        if tls is None or self._closed:  # closed (evicted, timed out) while the handshake finished
            if tls is not None:
                tls.abort()
            self._release()
            return
        self._tls = tls
        http = self._make_http()
        http.connection_made(tls)
        self.http = http
        for chunk in self._early:
            http.data_received(chunk)
        self._early.clear()
        if self._early_eof:
            http.eof_received()

    def data_received(self, data: bytes) -> None:
        if self.http is None:
            self._early.append(data)
        else:
            self.http.data_received(data)

    def eof_received(self) -> bool | None:
        if self.http is None:
            self._early_eof = True
            return None
        return self.http.eof_received()

    def pause_writing(self) -> None:
        if self.http is not None:
            self.http.pause_writing()

    def resume_writing(self) -> None:
        if self.http is not None:
            self.http.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self._release()
        if self._handshake is not None and not self._handshake.done() and self.http is None:
            self._handshake.cancel()
        if self.http is not None:
            self.http.connection_lost(exc)

    # --- deadlines and the gate ---

    @property
    def idle(self) -> bool:
        """No request in progress and nothing left to send: closing it loses nothing."""
        if self.busy:
            return False
        transport = self._tls or self._raw
        return transport is None or transport.get_write_buffer_size() == 0

    def request_started(self) -> None:
        self.busy += 1
        self._disarm()

    def request_finished(self) -> None:
        self.busy -= 1
        if self.busy == 0 and not self._closed:
            self.idle_since_s = self.loop.time()
            self._arm(self.gate.limits.idle_timeout_s, "idle_timeout")

    def _arm(self, delay_s: float, reason: str) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(delay_s, self._expire, reason)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expire(self, reason: str) -> None:
        self._deadline = None
        if self.idle:
            self.close(reason)
        elif self.busy == 0:  # a response still being sent: look again once more time has passed
            self._arm(self.gate.limits.idle_timeout_s, reason)

    def close(self, reason: str) -> None:
        """Drop the connection now (a TCP reset: nothing more is sent, its memory is freed at once)."""
        if self._closed:
            return
        self._closed = True
        self._disarm()
        self.gate.count_closed(reason)
        log.debug("closing connection from %s: %s", self.peer, reason)
        self._release()
        transport = self._tls or self._raw
        if transport is not None:
            transport.abort()

    def _release(self) -> None:
        self._closed = True
        self._disarm()
        self.gate.release(self)
