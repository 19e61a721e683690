"""The webhook's HTTPS server: a FastAPI app (POST /mutate, GET /healthz, GET /metrics) served by uvicorn with a
hot-reloading certificate, behind the connection bounds of `connections` (how many, how long, how many requests).

/mutate and /healthz are plain Starlette routes on the FastAPI app: no dependency injection or pydantic on the
request path, the body goes straight to the pure `mutate.review`.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import math
import socket
import threading
import time
from pathlib import Path
from types import FrameType

import orjson
import uvicorn
from fastapi import FastAPI
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.requests import ClientDisconnect, Request
from starlette.responses import PlainTextResponse, Response

from kube_vgpu.webhook.config import ConnectionLimits, WebhookConfig
from kube_vgpu.webhook.connections import ConnectionGate
from kube_vgpu.webhook.metrics import WebhookMetrics
from kube_vgpu.webhook.mutate import Result, review
from kube_vgpu.webhook.owners import OwnerResolver
from kube_vgpu.webhook.registration import MUTATE_PATH
from kube_vgpu.webhook.tls import DEFAULT_RELOAD_INTERVAL_S, ReloadingCertificate

log = logging.getLogger("kube_vgpu.webhook")

#: An AdmissionReview holds the pod twice at most (object + oldObject) and etcd caps an object at 1.5 MiB.
MAX_BODY_BYTES = 8 * 1024 * 1024
_JSON = "application/json"


def create_app(
    config: WebhookConfig,
    metrics: WebhookMetrics | None = None,
    limits: ConnectionLimits | None = None,
    owners: OwnerResolver | None = None,
) -> FastAPI:
    metrics = metrics or WebhookMetrics()
    limits = limits or ConnectionLimits()
    app = FastAPI(title="kube-vgpu webhook", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.metrics = metrics
    app.state.webhook_config = config
    app.state.draining = False
    # Each request in here may hold a body of up to MAX_BODY_BYTES: the slots bound that memory.
    slots = asyncio.Semaphore(limits.max_concurrent_requests)

    def refuse(code: int, reason: str, message: str) -> Response:
        metrics.admissions.labels("unknown", Result.MALFORMED.value).inc()
        metrics.requests_refused.labels(reason).inc()
        return Response(_status_body(code, message), status_code=code, media_type=_JSON)

    async def mutate(request: Request) -> Response:
        started_s = time.perf_counter()
        # A request waits at most body_timeout_s for a slot, then has body_timeout_s for its body: a waiting request
        # holds no body, and every slot is given back within body_timeout_s.
        try:
            async with asyncio.timeout(limits.body_timeout_s):
                await slots.acquire()
        except TimeoutError:
            return refuse(503, "busy", f"more than {limits.max_concurrent_requests} admission requests at once")
        try:
            try:
                async with asyncio.timeout(limits.body_timeout_s):
                    body = await _read_body(request)
            except TimeoutError:
                return refuse(408, "body_timeout", f"request body not received within {limits.body_timeout_s:g} s")
            except ClientDisconnect:  # the client left mid-body: nobody to answer, nothing to log but a count
                return refuse(400, "disconnected", "client disconnected before sending the whole body")
            if body is None:
                return refuse(413, "too_large", f"request body larger than {MAX_BODY_BYTES} bytes")
            if owners is None:
                outcome = review(body, config)
            else:  # may read owners from the API server: off the event loop (the request slots bound the threads)
                outcome = await asyncio.to_thread(review, body, config, owners)
        finally:
            slots.release()
        metrics.admissions.labels(outcome.operation or "unknown", outcome.result.value).inc()
        metrics.admission_duration.labels(outcome.result.value).observe(time.perf_counter() - started_s)
        if outcome.warnings:
            metrics.warnings.inc(len(outcome.warnings))
        if outcome.result is Result.DENIED:
            log.info("denied %s of pod %s: %s", outcome.operation, outcome.subject, outcome.message)
        elif outcome.result is Result.MALFORMED:
            log.warning("malformed admission review from %s: %s", _peer(request), outcome.message)
        return Response(outcome.body, status_code=outcome.http_status, media_type=_JSON)

    async def healthz(request: Request) -> Response:
        return PlainTextResponse("ok")

    async def readyz(request: Request) -> Response:
        # Not ready while draining: endpoints drop this replica while it still answers what is in flight.
        if app.state.draining:
            return PlainTextResponse("draining", status_code=503)
        return PlainTextResponse("ok")

    async def metrics_endpoint(request: Request) -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    app.add_route(MUTATE_PATH, mutate, methods=["POST"])
    app.add_route("/healthz", healthz, methods=["GET"])
    app.add_route("/readyz", readyz, methods=["GET"])
    app.add_route("/metrics", metrics_endpoint, methods=["GET"])
    return app


async def _read_body(request: Request) -> bytes | None:
    """The body, or None when it is larger than MAX_BODY_BYTES (checked while streaming, not after)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        return None
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


def _status_body(code: int, message: str) -> bytes:
    return orjson.dumps({"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": code, "message": message})


def _peer(request: Request) -> str:
    return f"{request.client.host}:{request.client.port}" if request.client else "?"


class WebhookServer:
    """The app behind HTTPS on (host, port); port 0 picks a free port (read it from `.port`)."""

    def __init__(
        self,
        config: WebhookConfig,
        *,
        cert_file: str | Path,
        key_file: str | Path,
        host: str = "0.0.0.0",
        port: int = 8443,
        reload_interval_s: float = DEFAULT_RELOAD_INTERVAL_S,
        log_level: str = "info",
        access_log: bool = False,
        shutdown_delay_s: float = 0.0,
        limits: ConnectionLimits | None = None,
        owners: OwnerResolver | None = None,
    ) -> None:
        self.metrics = WebhookMetrics()
        self.limits = limits or ConnectionLimits()

        def on_reload(ok: bool, not_after_s: float | None) -> None:
            self.metrics.certificate_reloads.labels("success" if ok else "failure").inc()
            if not_after_s is not None:
                self.metrics.certificate_expiry.set(not_after_s)

        self.certificate = ReloadingCertificate(cert_file, key_file, on_reload=on_reload)
        self.reload_interval_s = reload_interval_s
        self.app = create_app(config, self.metrics, self.limits, owners)
        # Bind here, not in uvicorn, so the port is known (port 0) and taken before anyone is told about it.
        self._socket = _bind(host, port)
        self.host = host
        self.port: int = self._socket.getsockname()[1]
        # TLS is not uvicorn's: the gate accepts each connection, counts it, runs the handshake with the reloading
        # certificate and then hands it to uvicorn's HTTP/1.1 protocol.
        self.gate = ConnectionGate(self.limits, lambda: self.certificate.server_context, self.metrics)
        uvicorn_config = uvicorn.Config(
            self.gate.asgi(self.app),
            http=self.gate.protocol_class(),
            log_level=log_level,
            access_log=access_log,
            lifespan="off",
            loop="asyncio",
            # the gate's idle deadline closes idle connections; uvicorn's own keep-alive timer only as a backstop
            timeout_keep_alive=math.ceil(self.limits.idle_timeout_s) + 1,
            timeout_graceful_shutdown=5,
        )
        self._server = _DrainingServer(uvicorn_config, self)
        self.shutdown_delay_s = shutdown_delay_s
        self._drain_timer: threading.Timer | None = None
        self._thread: threading.Thread | None = None

    @property
    def started(self) -> bool:
        return self._server.started

    def run(self) -> None:
        """Serve until SIGTERM / SIGINT (when called from the main thread) or stop()."""
        self.certificate.start(self.reload_interval_s)
        try:
            asyncio.run(self._server.serve(sockets=[self._socket]))
        finally:
            self.certificate.stop()
            self._socket.close()

    def start_in_thread(self, timeout_s: float = 30.0) -> None:
        """Serve from a background thread; returns once connections are accepted."""
        self._thread = threading.Thread(target=self.run, name="webhook-server", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the webhook server did not start")
            time.sleep(0.01)

    def drain(self) -> None:
        """Begin a graceful stop: /readyz answers 503 at once, admissions are still answered for
        `shutdown_delay_s` (while the endpoints controller and kube-proxy drop this replica), then the server
        stops. What SIGTERM does; a second SIGTERM stops at once."""
        if self._drain_timer is not None or self._server.should_exit:
            return
        self.app.state.draining = True
        log.info("draining: stopping in %.1f s", self.shutdown_delay_s)

        def finish() -> None:
            self._server.should_exit = True

        self._drain_timer = threading.Timer(self.shutdown_delay_s, finish)
        self._drain_timer.daemon = True
        self._drain_timer.start()

    @property
    def draining(self) -> bool:
        return self._drain_timer is not None

    def stop(self) -> None:
        if self._drain_timer is not None:
            self._drain_timer.cancel()
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join()
            self._thread = None


class _DrainingServer(uvicorn.Server):
    """uvicorn's server whose first SIGTERM / SIGINT drains (WebhookServer.drain) instead of stopping at once."""

    def __init__(self, config: uvicorn.Config, owner: WebhookServer) -> None:
        super().__init__(config)
        self._owner = owner

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._owner.shutdown_delay_s > 0 and not self._owner.draining and not self.should_exit:
            self._owner.drain()
            return
        if self._owner._drain_timer is not None:
            self._owner._drain_timer.cancel()
        super().handle_exit(sig, frame)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self._owner.gate.close_idle()
        await super().shutdown(sockets)


#: glibc's M_MMAP_THRESHOLD parameter (malloc.h)
_M_MMAP_THRESHOLD = -3
#: Blocks from this size up get a mapping of their own, given back to the OS when freed.
MMAP_THRESHOLD_BYTES = 128 * 1024


def return_freed_buffers_to_the_os() -> bool:
    """Make glibc give each TLS connection's buffers (256 KiB) back to the OS when the connection closes.

    glibc serves such blocks from their own mappings at first, but raises that threshold on the first free, after
    which they come from the heap and a burst of connections leaves the process at its peak size for good. Fixing the
    threshold keeps them in mappings. Returns False where the C library has no mallopt (then nothing changes)."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto must say TCP: asyncio sets TCP_NODELAY only on sockets whose proto is IPPROTO_TCP, and without it
    # Nagle + delayed ACKs add ~40 ms to every response written in two parts (headers, body).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if family == socket.AF_INET6:
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)  # "::" serves IPv4 too
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock
