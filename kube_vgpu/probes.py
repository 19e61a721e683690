"""The plain-HTTP listener for health probes and metrics that the extender and the device plugin run beside their main
port, with bounded resources.

The standard library's ThreadingHTTPServer starts a thread per connection and waits on it forever: 200 half-sent
requests held 200 threads (issue 20, item 6). Here:

* at most `max_connections` connections are served at once, one thread each. At the cap, a new connection takes
  the place of the oldest one that has not finished sending its request (a probe sends its request the moment it
  connects, so the oldest unfinished one is the stalled one); when every connection has its request and is being
  answered, the new one is closed at once;
* a read that waits longer than `read_timeout_s` ends its connection, and so does a request that is not complete
  `request_timeout_s` after the connection was accepted (checked whenever a connection arrives);
* HTTP/1.0: one request per connection, so nothing stays open between probes.

Only GET is served (anything else gets 501, so the extender's verbs are plainly not here); routes are functions of
no arguments returning (status, content type, body).
"""

from __future__ import annotations

import logging
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

log = logging.getLogger(__name__)

#: (status, content type, body); a big body may come as a list of pieces, sent a batch at a time (joining 75 MB of
#: /metrics into one bytes object would hold the GIL, and stall the extender's verbs, for tens of ms)
Reply = tuple[int, str, bytes | list[bytes]]
#: pieces of a list body handled at once: per send (sendmsg takes at most IOV_MAX, 1024, buffers), per length sum
BATCH_PIECES = 1000
Route = Callable[[], Reply]

DEFAULT_MAX_CONNECTIONS = 16
DEFAULT_READ_TIMEOUT_S = 5.0
DEFAULT_REQUEST_TIMEOUT_S = 10.0


@dataclass(slots=True)
class _Connection:
    accepted_s: float
    requested: bool = False  # the request head is complete; it is being answered
    cut: bool = False  # shut down by the server; its thread is ending
    finished: threading.Event = field(default_factory=threading.Event)  # its thread has ended


class ProbeServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128  # the listen backlog: connections wait there, not in SYN retries, while one is admitted

    def __init__(
        self,
        address: tuple[str, int],
        routes: Mapping[str, Route],
        *,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        read_timeout_s: float = DEFAULT_READ_TIMEOUT_S,
        request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
        send_pause: Callable[[], None] | None = None,
    ) -> None:
        if max_connections < 1:
            raise ValueError(f"max_connections must be at least 1, got {max_connections}")
        self.routes = dict(routes)
        self.max_connections = max_connections
        self.read_timeout_s = read_timeout_s
        self.request_timeout_s = request_timeout_s
        #: called before each batch of a list body is sent: the extender's waits while one of its verbs computes,
        #: so a 75 MB body goes out between verbs instead of taking both cores (the copy, the reader) for ~0.5 s
        self.send_pause = send_pause
        #: every connection whose thread runs (or is about to), oldest first
        self.connections: dict[socket.socket, _Connection] = {}
        self.closed_counts: dict[str, int] = {"evicted": 0, "refused": 0, "request_timeout": 0}
        self._lock = threading.Lock()
        super().__init__(address, _Handler)

    # --- admission: called in the accepting thread, once per connection ---

    def process_request(self, request: Any, client_address: Any) -> None:
        now_s = time.monotonic()
        cut: list[_Connection] = []
        with self._lock:
            for sock, connection in self.connections.items():
                late = now_s - connection.accepted_s > self.request_timeout_s
                if late and not connection.requested and not connection.cut:
                    cut.append(self._cut(sock, connection, "request_timeout"))
            serving = [(sock, c) for sock, c in self.connections.items() if not c.cut]
            if len(serving) >= self.max_connections:
                unfinished = [(sock, c) for sock, c in serving if not c.requested]
                if not unfinished:
                    self.closed_counts["refused"] += 1
                    self.shutdown_request(request)
                    return
                cut.append(self._cut(*unfinished[0], "evicted"))
            self.connections[request] = _Connection(now_s)
        for connection in cut:  # their threads end at once; waiting keeps the thread count within the cap
            connection.finished.wait(self.read_timeout_s)
        super().process_request(request, client_address)

    def _cut(self, sock: socket.socket, connection: _Connection, reason: str) -> _Connection:
        """Wake the thread reading from `sock`: its read returns at once and the thread ends."""
        self.closed_counts[reason] += 1
        connection.cut = True
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:  # already closed by the peer
            pass
        return connection

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self._lock:
                connection = self.connections.pop(request, None)
            if connection is not None:
                connection.finished.set()

    def mark_requested(self, request: socket.socket) -> bool:
        """Record that the request head is complete; False when the connection was cut meanwhile (what was read
        then ended at the cut, not at the client's blank line, and must not be answered)."""
        with self._lock:
            connection = self.connections.get(request)
            if connection is None or connection.cut:
                return False
            connection.requested = True
            return True

    def handle_error(self, request: Any, client_address: Any) -> None:
        if isinstance(sys.exc_info()[1], OSError):  # a client gone mid-answer (a probe that gave up, a cut connection)
            log.debug("probe connection from %s ended: %s", client_address, sys.exc_info()[1])
        else:
            log.exception("probe request from %s failed", client_address)

    def serve_in_thread(self, name: str = "probes") -> threading.Thread:
        thread = threading.Thread(target=self.serve_forever, name=name, daemon=True)
        thread.start()
        return thread


class _Handler(BaseHTTPRequestHandler):
    server: ProbeServer

    def setup(self) -> None:
        super().setup()
        self.connection.settimeout(self.server.read_timeout_s)  # a read waiting longer raises, ending the connection

    def parse_request(self) -> bool:
        return super().parse_request() and self.server.mark_requested(self.request)

    def do_GET(self) -> None:
        route = self.server.routes.get(self.path.split("?", 1)[0])
        status, content_type, body = route() if route is not None else (404, "text/plain", b"not found")
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        pieces = [body] if isinstance(body, bytes) else body
        self.send_header("Content-Length", str(body_length(pieces)))
        self.end_headers()
        send_pause = self.server.send_pause if isinstance(body, list) else None  # a probe's bytes go at once
        for start in range(0, len(pieces), BATCH_PIECES):
            if send_pause is not None:
                send_pause()
            send_all(self.connection, pieces[start:start + BATCH_PIECES])

    def log_message(self, format: str, *args: Any) -> None:  # probes every few seconds: keep logs quiet
        return


def body_length(pieces: list[bytes]) -> int:
    """A list body's bytes, summed a batch at a time: one C loop over 250,000 pieces (the extender's /metrics at
    40,000 pods) holds the GIL for milliseconds; between batches it can change hands."""
    return sum([sum(map(len, pieces[start:start + BATCH_PIECES])) for start in range(0, len(pieces), BATCH_PIECES)])


def send_all(sock: socket.socket, pieces: list[bytes]) -> None:
    """Write the pieces in order with scatter-gather sends (no copy into one buffer), whatever each send takes."""
    sent = sock.sendmsg(pieces)
    if sent == sum(map(len, pieces)):
        return  # the usual case: all of it at once
    pending: list[bytes | memoryview] = list(pieces)
    while True:
        done = 0
        while done < len(pending) and sent >= len(pending[done]):
            sent -= len(pending[done])
            done += 1
        del pending[:done]
        if sent:  # a piece went out in part
            pending[0] = memoryview(pending[0])[sent:]
        if not pending:
            return
        sent = sock.sendmsg(pending)


def serve_probes(host: str, port: int, routes: Mapping[str, Route], **limits: Any) -> ProbeServer:
    """Serve `routes` on (host, port) from a background thread; `limits` are ProbeServer's keyword arguments."""
    server = ProbeServer((host, port), routes, **limits)
    server.serve_in_thread()
    return server
