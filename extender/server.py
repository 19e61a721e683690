"""The HTTP edge of the extender: kube-scheduler's extender protocol (Go field names), health, metrics.

Bodies are parsed with orjson straight from bytes (no pydantic on the hot path) and validated by
hand, so malformed input gets a 400 with a message and the service keeps serving.
"""

from __future__ import annotations

import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from starlette.concurrency import run_in_threadpool

from kube_vgpu.protocol import InvalidGpuRequest

from .scheduler import BindError, Scheduler
from .state import ClusterState

MAX_BODY_BYTES = 64 * 1024 * 1024  # full Node objects for 5000 nodes fit comfortably
LATENCY_BUCKETS_S = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.015, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class BadRequest(Exception):
    pass


def _json(data: Any, status_code: int = 200) -> Response:
    return Response(orjson.dumps(data), status_code=status_code, media_type="application/json")


class GpuCollector(Collector):
    """Per-GPU allocation gauges computed at scrape time from the state (no cost per bind)."""

    def __init__(self, state: ClusterState) -> None:
        self.state = state

    def collect(self) -> Iterator[GaugeMetricFamily]:
        labels = ["node", "gpu", "uuid", "model"]
        families = {
            "memory_total": GaugeMetricFamily("kube_vgpu_gpu_memory_mib", "GPU memory (MiB)", labels=labels),
            "memory_used": GaugeMetricFamily(
                "kube_vgpu_gpu_memory_allocated_mib", "GPU memory assigned to pods (MiB)", labels=labels
            ),
            "cores_total": GaugeMetricFamily("kube_vgpu_gpu_cores", "GPU compute units (100 per GPU)", labels=labels),
            "cores_used": GaugeMetricFamily(
                "kube_vgpu_gpu_cores_allocated", "GPU compute units assigned to pods", labels=labels
            ),
            "shares_used": GaugeMetricFamily("kube_vgpu_gpu_vgpus_allocated", "vGPUs on the GPU", labels=labels),
            "healthy": GaugeMetricFamily("kube_vgpu_gpu_healthy", "1 if the GPU is healthy", labels=labels),
        }
        with self.state.lock:
            for node in self.state.nodes.values():
                for gpu in node.gpus:
                    values = [node.name, str(gpu.index), gpu.uuid, gpu.model]
                    families["memory_total"].add_metric(values, gpu.memory_mib)
                    families["memory_used"].add_metric(values, gpu.used_memory_mib)
                    families["cores_total"].add_metric(values, gpu.cores)
                    families["cores_used"].add_metric(values, gpu.used_cores)
                    families["shares_used"].add_metric(values, gpu.used_shares)
                    families["healthy"].add_metric(values, 1 if gpu.healthy else 0)
            nodes = GaugeMetricFamily("kube_vgpu_nodes", "GPU nodes known to the extender")
            nodes.add_metric([], len(self.state.nodes))
            pods = GaugeMetricFamily("kube_vgpu_assigned_pods", "pods holding GPU assignments")
            pods.add_metric([], len(self.state.pods))
        yield from families.values()
        yield nodes
        yield pods


async def read_json_body(request: Request) -> Any:
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            if int(declared) > MAX_BODY_BYTES:
                raise BadRequest(f"request body too large ({declared} bytes; limit {MAX_BODY_BYTES})")
        except ValueError:
            raise BadRequest("invalid Content-Length header") from None
    chunks = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise BadRequest(f"request body too large (over {MAX_BODY_BYTES} bytes)")
        chunks.append(chunk)
    body = b"".join(chunks)
    if not body:
        raise BadRequest("empty request body; expected JSON")
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from None


def _extender_args(doc: Any) -> tuple[dict[str, Any], list[str], list[dict[str, Any]] | None]:
    """ExtenderArgs -> (pod, node names, full node objects or None when nodeCacheCapable)."""
    if not isinstance(doc, dict):
        raise BadRequest("ExtenderArgs must be a JSON object with Pod and NodeNames or Nodes")
    pod = doc.get("Pod")
    if not isinstance(pod, dict):
        raise BadRequest("ExtenderArgs.Pod must be a Pod object")
    names = doc.get("NodeNames")
    nodes = doc.get("Nodes")
    if names is not None:
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise BadRequest("ExtenderArgs.NodeNames must be a list of strings")
        return pod, names, None
    if nodes is not None:
        items = nodes.get("items") if isinstance(nodes, dict) else None
        if items is None:
            items = []
        if not isinstance(items, list) or not all(isinstance(n, dict) for n in items):
            raise BadRequest("ExtenderArgs.Nodes.items must be a list of Node objects")
        return pod, [((n.get("metadata") or {}).get("name") or "") for n in items], items
    raise BadRequest("ExtenderArgs needs NodeNames (nodeCacheCapable) or Nodes")


def create_app(scheduler: Scheduler, *, on_startup: Callable[[], None] | None = None) -> FastAPI:
    state = scheduler.state
    registry = CollectorRegistry()
    latency = Histogram(
        "kube_vgpu_extender_request_seconds",
        "extender verb latency",
        ["verb"],
        buckets=LATENCY_BUCKETS_S,
        registry=registry,
    )
    rejections = Counter(
        "kube_vgpu_extender_rejections_total", "nodes rejected by filter, by reason", ["reason"], registry=registry
    )
    binds = Counter("kube_vgpu_extender_binds_total", "bind calls by outcome", ["outcome"], registry=registry)
    bad_requests = Counter("kube_vgpu_extender_bad_requests_total", "malformed requests", ["verb"], registry=registry)
    registry.register(GpuCollector(state))
    for gate in scheduler.gates:  # gates may publish their own gauges (the quota gate: issue 6)
        make_collector = getattr(gate, "collector", None)
        if make_collector is not None:
            registry.register(make_collector())
    rejection_children: dict[str, Any] = {}

    def count_rejection(code: str) -> None:
        child = rejection_children.get(code)
        if child is None:
            child = rejection_children[code] = rejections.labels(code)
        child.inc()

    scheduler.on_rejection = count_rejection
    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if on_startup is not None:
            on_startup()  # live mode: start the watches once the server is up
        yield

    app = FastAPI(title="kube-vgpu extender", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.state.scheduler = scheduler
    app.state.registry = registry

    def bad(verb: str, message: str) -> Response:
        bad_requests.labels(verb).inc()
        return _json({"Error": message}, 400)

    @app.post("/filter")
    async def filter_verb(request: Request) -> Response:
        started = time.perf_counter()
        try:
            pod, names, node_objects = _extender_args(await read_json_body(request))
        except BadRequest as exc:
            return bad("filter", str(exc))
        outcome = scheduler.filter(pod, names)
        passed = set(outcome.passed)
        result: dict[str, Any] = {
            "FailedNodes": outcome.failed,
            "FailedAndUnresolvableNodes": outcome.unresolvable,
            "Error": outcome.error,
        }
        if node_objects is None:
            result["NodeNames"] = outcome.passed
            result["Nodes"] = None
        else:
            result["NodeNames"] = None
            result["Nodes"] = {"items": [n for n in node_objects if (n.get("metadata") or {}).get("name") in passed]}
        response = _json(result)
        latency.labels("filter").observe(time.perf_counter() - started)
        return response

    @app.post("/prioritize")
    async def prioritize_verb(request: Request) -> Response:
        started = time.perf_counter()
        try:
            pod, names, _ = _extender_args(await read_json_body(request))
        except BadRequest as exc:
            return bad("prioritize", str(exc))
        try:
            scores = scheduler.prioritize(pod, names)
        except InvalidGpuRequest:
            scores = [(name, 0) for name in names]
        response = _json([{"Host": name, "Score": score} for name, score in scores])
        latency.labels("prioritize").observe(time.perf_counter() - started)
        return response

    @app.post("/bind")
    async def bind_verb(request: Request) -> Response:
        started = time.perf_counter()
        try:
            doc = await read_json_body(request)
            if not isinstance(doc, dict):
                raise BadRequest("ExtenderBindingArgs must be a JSON object")
            fields: dict[str, str] = {}
            missing = []
            for key in ("PodName", "PodNamespace", "PodUID", "Node"):
                value = doc.get(key)
                if isinstance(value, str) and value:
                    fields[key] = value
                else:
                    missing.append(key)
            if missing:
                raise BadRequest(f"ExtenderBindingArgs is missing {', '.join(missing)}")
        except BadRequest as exc:
            return bad("bind", str(exc))
        try:
            await run_in_threadpool(
                scheduler.bind, fields["PodNamespace"], fields["PodName"], fields["PodUID"], fields["Node"]
            )
            binds.labels("success").inc()
            error = ""
        except BindError as exc:
            binds.labels("failure").inc()
            error = str(exc)
        latency.labels("bind").observe(time.perf_counter() - started)
        return _json({"Error": error})

    @app.get("/healthz")
    async def healthz() -> Response:
        return Response("ok", media_type="text/plain")

    @app.get("/readyz")
    async def readyz() -> Response:
        if state.synced.is_set():
            return Response("ok", media_type="text/plain")
        return Response("initial sync with the API server not finished", status_code=503, media_type="text/plain")

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/state")
    async def state_view() -> Response:
        return _json(state.snapshot())

    @app.get("/quota")
    async def quota_view() -> Response:
        """Per ClusterQueue and flavor: nominal, borrowed, lent, used, pending pods (issue 6)."""
        for gate in scheduler.gates:
            quota_snapshot = getattr(gate, "snapshot", None)
            if quota_snapshot is not None:
                return _json(await run_in_threadpool(quota_snapshot))
        return _json({"Error": "no quota gate: start the extender with --quota-config or in live mode"}, 404)

    return app


def serve_probes(registry: CollectorRegistry, state: ClusterState, host: str, port: int) -> ThreadingHTTPServer:
    """/metrics, /healthz and /readyz on their own listener (a thread), so the extender's verbs can stay on
    loopback beside kube-scheduler while Prometheus and the kubelet's probes reach these from outside the Pod."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                status, content_type, body = 200, CONTENT_TYPE_LATEST, generate_latest(registry)
            elif path == "/healthz":
                status, content_type, body = 200, "text/plain", b"ok"
            elif path == "/readyz":
                ready = state.synced.is_set()
                status, content_type = (200 if ready else 503), "text/plain"
                body = b"ok" if ready else b"initial sync with the API server not finished"
            else:
                status, content_type, body = 404, "text/plain", b"not found"
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:  # probes every few seconds: keep logs quiet
            return

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="probes", daemon=True).start()
    return server
