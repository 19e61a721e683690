"""The dashboard's HTTP server: the page and its assets (shipped in the package, no build step, nothing from a
CDN), and GET /api/view, the JSON the page polls.

Cost on the extender is bounded whatever the number of browsers: every /api/view within `interval_s` of the last
upstream read is answered from that read, and concurrent requests after it share one new read (single flight).
So the extender sees at most one GET /state and one GET /quota per interval (and Prometheus one query pair).
The interval stretches with the cluster: the next read waits at least `busy_share`'s inverse times as long as the
last one took (10 x by default), so the dashboard keeps the extender busy at most a tenth of the time. At 5000
nodes /state is ~20 MB and a read once a second raised filter's p99 by ~23% (docs/benchmarks.md); a small
cluster's read takes milliseconds and keeps the 1 s interval.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

import orjson
from fastapi import FastAPI
from fastapi.responses import Response

from kube_vgpu.extender.dashboard.model import PodUsage, build_view
from kube_vgpu.extender.top import StateFormatError

log = logging.getLogger(__name__)

ASSETS = {"index.html": "text/html; charset=utf-8", "app.js": "text/javascript; charset=utf-8",
          "style.css": "text/css; charset=utf-8"}
#: PromQL for what each pod uses (device plugin metrics, docs/operations.md), summed over containers and GPUs
USED_MEMORY_QUERY = "sum by (pod_uid) (kube_vgpu_container_gpu_memory_used_bytes)"
UTILIZATION_QUERY = "sum by (pod_uid) (kube_vgpu_container_gpu_utilization_ratio)"
MIB = 1024 * 1024


class UpstreamError(Exception):
    """An upstream answer that cannot be used (or none: `unreachable`); the message is shown on the page."""

    def __init__(self, message: str, *, unreachable: bool = False) -> None:
        super().__init__(message)
        self.unreachable = unreachable


def get_json(url: str, timeout_s: float) -> tuple[int, Any]:
    """(status, decoded body) of a GET; a 4xx/5xx with a JSON body is returned, not raised. Raises UpstreamError."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            status, body = response.status, response.read()
    except urllib.error.HTTPError as exc:
        status, body = exc.code, exc.read()
    except (urllib.error.URLError, OSError) as exc:
        reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
        raise UpstreamError(f"cannot reach {url}: {reason}", unreachable=True) from None
    try:
        return status, json.loads(body)
    except ValueError:
        text = body[:200].decode(errors="replace")
        raise UpstreamError(f"{url} answered {status} with something that is not JSON: {text!r}") from None


def prometheus_usage(base_url: str, timeout_s: float) -> dict[str, PodUsage]:
    """Pod UID -> measured use, from Prometheus' instant query API. Raises UpstreamError."""

    def query(promql: str) -> dict[str, float]:
        url = f"{base_url.rstrip('/')}/api/v1/query?{urllib.parse.urlencode({'query': promql})}"
        status, doc = get_json(url, timeout_s)
        if status != 200 or not isinstance(doc, dict) or doc.get("status") != "success":
            error = doc.get("error") if isinstance(doc, dict) else None
            raise UpstreamError(f"Prometheus answered {status}: {error if error else repr(doc)}")
        values = {}
        for sample in (doc.get("data") or {}).get("result") or []:
            uid = (sample.get("metric") or {}).get("pod_uid")
            try:
                values[str(uid)] = float(sample["value"][1])
            except (KeyError, IndexError, TypeError, ValueError):
                raise UpstreamError(f"Prometheus' answer to {promql} has a sample without a value") from None
        return values

    memory, utilization = query(USED_MEMORY_QUERY), query(UTILIZATION_QUERY)
    return {uid: PodUsage(memory.get(uid, 0.0) / MIB, 100 * utilization.get(uid, 0.0))
            for uid in memory.keys() | utilization.keys()}


@dataclass(slots=True)
class Upstream:
    """Reads the extender (and Prometheus) at most once per `interval_s`, for every browser together."""

    extender_url: str
    prometheus_url: str | None = None
    interval_s: float = 1.0
    #: the most of the extender's time the reads may take: the next read waits last read's seconds / busy_share
    #: (None: every interval_s, however long a read takes)
    busy_share: float | None = 0.1
    timeout_s: float = 5.0
    clock: Callable[[], float] = time.monotonic
    fetches: int = 0  # upstream reads made (each: one /state and one /quota)
    _view: dict[str, Any] | None = None
    _fetched_at_s: float | None = None
    _wait_s: float = 0.0  # interval_s, or longer after a slow read (busy_share)
    _last_good: dict[str, Any] | None = None
    _last_good_at_s: float | None = None
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    async def view(self) -> dict[str, Any]:
        if self._fresh():
            assert self._view is not None
            return self._stamped(self._view)
        async with self._lock:  # one read in flight; the requests that waited for it take its result
            if not self._fresh():
                started_s = self.clock()
                self._view = await asyncio.to_thread(self._read)
                self._fetched_at_s = self.clock()
                took_s = self._fetched_at_s - started_s
                self._wait_s = self.interval_s if self.busy_share is None else max(
                    self.interval_s, took_s / self.busy_share)
            assert self._view is not None
            return self._stamped(self._view)

    def _fresh(self) -> bool:
        return self._fetched_at_s is not None and self.clock() - self._fetched_at_s < self._wait_s

    def _stamped(self, view: dict[str, Any]) -> dict[str, Any]:
        age = None if self._last_good_at_s is None else round(self.clock() - self._last_good_at_s, 1)
        return {**view, "dataAgeSeconds": age, "upstreamReads": self.fetches}

    def _read(self) -> dict[str, Any]:
        """One upstream read (in a worker thread): the view, or the error and the last good data marked stale."""
        self.fetches += 1
        base = self.extender_url.rstrip("/")
        extender: dict[str, Any] = {"url": base, "reachable": True, "error": None}
        try:
            status, state_doc = get_json(f"{base}/state", self.timeout_s)
            if status != 200:
                raise UpstreamError(f"{base}/state answered {status}: {str(state_doc)[:200]}")
            quota_doc, quota_error = self._quota(base)
            usage, usage_error = self._usage()
            view = build_view(state_doc, quota_doc, quota_error, usage, usage_error)
        except UpstreamError as exc:
            return self._failed(extender, str(exc), reachable=not exc.unreachable)
        except StateFormatError as exc:
            return self._failed(extender, f"{base}/state is not a kube-vgpu extender's state: {exc}", reachable=True)
        self._last_good, self._last_good_at_s = view, self.clock()
        return {**view, "extender": extender, "stale": False}

    def _failed(self, extender: dict[str, Any], error: str, *, reachable: bool) -> dict[str, Any]:
        log.warning("dashboard: %s", error)
        extender = {**extender, "reachable": reachable, "error": error}
        return {**(self._last_good or {}), "extender": extender, "stale": self._last_good is not None}

    def _quota(self, base: str) -> tuple[Any | None, str | None]:
        try:
            status, doc = get_json(f"{base}/quota", self.timeout_s)
        except UpstreamError as exc:
            return None, str(exc)
        if status != 200:
            return None, str(doc.get("Error") if isinstance(doc, dict) else doc)
        return doc, None

    def _usage(self) -> tuple[dict[str, PodUsage] | None, str | None]:
        if self.prometheus_url is None:
            return None, None
        try:
            return prometheus_usage(self.prometheus_url, self.timeout_s), None
        except UpstreamError as exc:
            return None, str(exc)


def asset(name: str) -> bytes:
    return resources.files("kube_vgpu.extender.dashboard").joinpath("static", name).read_bytes()


def create_app(upstream: Upstream) -> FastAPI:
    app = FastAPI(title="kube-vgpu dashboard", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.upstream = upstream
    # read once: the page is small and never changes while the server runs
    files = {name: asset(name) for name in ASSETS}
    headers = {"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff",
               "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; object-src 'none'; "
                                          "base-uri 'none'; frame-ancestors 'none'"}

    @app.get("/")
    async def index() -> Response:
        return Response(files["index.html"], media_type=ASSETS["index.html"], headers=headers)

    @app.get("/static/{name}")
    async def static(name: str) -> Response:
        if name not in files:
            return Response("not found", status_code=404, media_type="text/plain")
        return Response(files[name], media_type=ASSETS[name], headers=headers)

    @app.get("/api/view")
    async def view() -> Response:
        return Response(orjson.dumps(await upstream.view()), media_type="application/json",
                        headers={"Cache-Control": "no-store"})

    @app.get("/healthz")
    async def healthz() -> Response:
        return Response("ok", media_type="text/plain")

    return app
