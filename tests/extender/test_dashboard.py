"""`kube-vgpu dashboard` over real HTTP against a real extender app serving a real ClusterState (snapshot mode with
the example quota configuration): the view's figures equal GET /state's, upstream reads are coalesced however many
pages poll, and an extender that is down or answers something else is said so on the page's data."""

from __future__ import annotations

import asyncio
import http.server
import json
import urllib.parse
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from starlette.types import ASGIApp, Receive, Scope, Send

from kube_vgpu.extender.cli import build, parse_args
from kube_vgpu.extender.dashboard.cli import listen_address
from kube_vgpu.extender.dashboard.server import Upstream, create_app
from kube_vgpu.extender.top import parse_state
from tests.extender.test_top import plain_server
from tests.extender.test_usage_metrics import BOUND_AT, EXAMPLES, T0, bound_pod
from tests.helpers import gpu_node
from tests.servers import free_port, serve, serve_handler


class CountingApp:
    """The extender's real app, counting the requests it gets per path (the dashboard's cost on it)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.paths: Counter[str] = Counter()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            self.paths[scope["path"]] += 1
        await self.app(scope, receive, send)


def cluster_items() -> list[dict[str, Any]]:
    return [
        gpu_node("a100-0", gpus=4, memory_mib=81920, heartbeat=BOUND_AT),
        gpu_node("a100-1", gpus=4, memory_mib=81920, heartbeat=BOUND_AT),
        bound_pod("trainer", "research", "a100-0", [(0, 40960, 50), (1, 40960, 50)], queue="research-queue"),
        bound_pod("server", "inference", "a100-0", [(0, 20480, 25)], queue="inference-queue"),
        bound_pod("batch", "production", "a100-1", [(2, 81920, 100)], queue="production-queue"),
        bound_pod("small", "research", "a100-1", [(3, 70000, 10)], queue="research-queue"),
    ]


@contextmanager
def extender(tmp_path: Path, items: list[dict[str, Any]] | None = None) -> Iterator[tuple[str, CountingApp]]:
    path = tmp_path / "snapshot.json"
    path.write_bytes(orjson.dumps({"apiVersion": "v1", "kind": "List", "items": items or cluster_items()}))
    args = parse_args(["--snapshot", str(path), "--quota-config", str(EXAMPLES / "quota.yaml")])
    app = CountingApp(build(args, clock=lambda: T0 + 30).app)
    with serve(app) as url:
        yield url, app


@contextmanager
def dashboard(upstream: Upstream) -> Iterator[httpx.Client]:
    with serve(create_app(upstream)) as url, httpx.Client(base_url=url, timeout=10) as client:
        yield client


def test_the_view_holds_what_state_and_quota_say(tmp_path: Path) -> None:
    with extender(tmp_path) as (url, _), dashboard(Upstream(url)) as client:
        view = client.get("/api/view").json()
        state = httpx.get(f"{url}/state", timeout=10).json()
        quota = httpx.get(f"{url}/quota", timeout=10).json()
    assert view["extender"] == {"url": url, "reachable": True, "error": None}
    assert view["stale"] is False
    gpus = [g for n in state["nodes"] for g in n["gpus"]]
    o = view["overview"]
    assert (o["nodes"], o["gpus"], o["pods"]) == (2, 8, 4)
    assert o["memoryMiB"] == sum(g["memoryMiB"] for g in gpus) == 8 * 81920
    assert o["usedMemoryMiB"] == sum(g["usedMemoryMiB"] for g in gpus) == 2 * 40960 + 20480 + 81920 + 70000
    assert o["usedCores"] == sum(g["usedCores"] for g in gpus) == 235
    assert o["usedShares"] == sum(g["usedShares"] for g in gpus) == 5
    # the typical vGPU is the median of the five assigned (40960 MiB, 50 cores): GPU 0 of a100-0 (20480 MiB free)
    # and GPU 3 of a100-1 (11920 free) cannot take one; the idle GPUs and GPU 1 (40960 free, 50 cores) can
    assert o["stranded"] == {"gpus": 2, "freeMemoryMiB": 20480 + 11920, "typicalMemoryMiB": 40960,
                             "typicalCores": 50, "typicalLearned": True}
    gpu0 = view["nodes"][0]["gpus"][0]
    assert gpu0["pods"] == ["research/trainer", "inference/server"]
    assert (gpu0["usedMemoryMiB"], gpu0["usedCores"], gpu0["usedShares"]) == (61440, 75, 2)
    assert [(p["namespace"], p["name"], p["node"], p["gpus"], p["memoryMiB"], p["cores"], p["usedMemoryMiB"])
            for p in view["pods"]] == [
        ("inference", "server", "a100-0", ["0"], 20480, 25, None),
        ("production", "batch", "a100-1", ["2"], 81920, 100, None),
        ("research", "small", "a100-1", ["3"], 70000, 10, None),
        ("research", "trainer", "a100-0", ["0", "1"], 81920, 100, None),
    ]
    assert view["usage"] == {"source": None, "error": None}
    assert view["quota"]["available"] and view["quota"]["mode"] == quota["mode"]
    assert [q["name"] for q in view["quota"]["queues"]] == [q["name"] for q in quota["clusterQueues"]]
    training = next(q for q in view["quota"]["queues"] if q["name"] == "ai-training-queue")
    raw = next(q for q in quota["clusterQueues"] if q["name"] == "ai-training-queue")
    assert training["admittedPods"] == raw["admittedPods"]
    assert [(r["flavor"], r["resource"], r["nominal"], r["used"]) for r in training["resources"]] == [
        (f["flavor"], r["resource"], r["nominal"], r["used"]) for f in raw["flavors"] for r in f["resources"]]


def test_upstream_reads_are_coalesced_across_pages(tmp_path: Path) -> None:
    with extender(tmp_path) as (url, app):
        upstream = Upstream(url, interval_s=30.0)
        with dashboard(upstream) as client:
            client.get("/api/view")

            async def many() -> list[int]:
                async with httpx.AsyncClient(base_url=str(client.base_url), timeout=10) as pages:
                    replies = await asyncio.gather(*(pages.get("/api/view") for _ in range(40)))
                return [r.status_code for r in replies]

            assert asyncio.run(many()) == [200] * 40
        assert (app.paths["/state"], app.paths["/quota"], upstream.fetches) == (1, 1, 1)
        # concurrent requests when the cached read has expired share one new read (single flight)
        upstream.interval_s, upstream.busy_share = 0.0, None
        with dashboard(upstream) as client:
            async def burst() -> None:
                async with httpx.AsyncClient(base_url=str(client.base_url), timeout=10) as pages:
                    await asyncio.gather(*(pages.get("/api/view") for _ in range(10)))

            asyncio.run(burst())
        assert app.paths["/state"] <= 11 and upstream.fetches == app.paths["/state"]


def test_a_slow_read_stretches_the_interval_to_keep_the_extender_mostly_free() -> None:
    """A read that took 0.5 s (this clock moves 0.5 s per look) is not repeated for 5 s (busy_share 0.1), however
    often the page asks; without busy_share the interval alone counts."""
    ticks = iter(range(1000))

    def clock() -> float:
        return next(ticks) * 0.5

    dead = f"http://127.0.0.1:{free_port()}"
    slow = Upstream(dead, interval_s=0.0, timeout_s=2, clock=clock)
    for _ in range(3):
        asyncio.run(slow.view())
    assert slow.fetches == 1
    fixed = Upstream(dead, interval_s=0.0, busy_share=None, timeout_s=2, clock=clock)
    for _ in range(3):
        asyncio.run(fixed.view())
    assert fixed.fetches == 3


def test_an_unreachable_extender_is_said_so_and_the_last_data_kept_as_stale(tmp_path: Path) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    with dashboard(Upstream(dead, interval_s=0.0, busy_share=None, timeout_s=2)) as client:
        reply = client.get("/api/view")
        assert reply.status_code == 200
        view = reply.json()
    assert view["extender"]["reachable"] is False
    assert view["extender"]["error"].startswith(f"cannot reach {dead}/state")
    assert view["stale"] is False and "overview" not in view
    # up, read once, then gone: the page keeps the last good figures, marked stale with their age
    with extender(tmp_path) as (url, _):
        upstream = Upstream(url, interval_s=0.0, busy_share=None, timeout_s=2)
        with dashboard(upstream) as client:
            assert client.get("/api/view").json()["overview"]["pods"] == 4
    with dashboard(upstream) as client:
        view = client.get("/api/view").json()
    assert view["stale"] is True and view["extender"]["reachable"] is False
    assert view["overview"]["pods"] == 4 and view["dataAgeSeconds"] >= 0


@pytest.mark.parametrize(
    ("status", "body", "message"),
    [
        (200, b"<html>hello</html>", "answered 200 with something that is not JSON: '<html>hello</html>'"),
        (200, b'{"nodes": {}, "assignments": []}', "is not a kube-vgpu extender's state: state.nodes is {}"),
        (200, b"[1, 2]", "is not a kube-vgpu extender's state: state is not an object"),
        (500, b'{"Error": "boom"}', "/state answered 500: {'Error': 'boom'}"),
    ],
)
def test_something_else_than_an_extender_is_said_so(status: int, body: bytes, message: str) -> None:
    with plain_server(status, body) as url, dashboard(Upstream(url, timeout_s=2)) as client:
        view = client.get("/api/view").json()
    assert view["extender"]["reachable"] is True
    assert message in view["extender"]["error"]
    assert "overview" not in view


def test_assets_ship_in_the_package_and_are_served(tmp_path: Path) -> None:
    with dashboard(Upstream(f"http://127.0.0.1:{free_port()}")) as client:
        page = client.get("/")
        assert page.headers["content-type"].startswith("text/html")
        assert "default-src 'self'" in page.headers["content-security-policy"]
        assert '<script src="static/app.js" defer></script>' in page.text
        script = client.get("/static/app.js")
        assert script.headers["content-type"].startswith("text/javascript")
        assert "innerHTML" not in script.text.replace("never innerHTML", "")  # text nodes only
        assert client.get("/static/style.css").status_code == 200
        assert client.get("/static/../server.py").status_code == 404
        assert client.get("/static/model.py").status_code == 404
        assert client.get("/healthz").text == "ok"


def test_the_probes_listener_serves_what_the_dashboard_reads(tmp_path: Path) -> None:
    """In a cluster the dashboard reads the extender's probes port (the verbs stay on loopback in the Pod)."""
    from kube_vgpu.extender.server import serve_probes

    path = tmp_path / "snapshot.json"
    path.write_bytes(orjson.dumps({"apiVersion": "v1", "kind": "List", "items": cluster_items()}))
    built = build(parse_args(["--snapshot", str(path), "--quota-config", str(EXAMPLES / "quota.yaml")]),
                  clock=lambda: T0 + 30)
    port = free_port()
    server = serve_probes(built.app.state.registry, built.scheduler, "127.0.0.1", port)
    try:
        with dashboard(Upstream(f"http://127.0.0.1:{port}")) as client:
            view = client.get("/api/view").json()
    finally:
        server.shutdown()
    assert view["extender"]["error"] is None
    assert view["overview"]["pods"] == 4 and view["quota"]["available"]


@contextmanager
def prometheus(samples: dict[str, dict[str, float]]) -> Iterator[str]:
    """Prometheus' instant-query API (GET /api/v1/query), answering each query from `samples` (query -> pod UID ->
    value) in the documented shape: https://prometheus.io/docs/prometheus/latest/querying/api/."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            path, _, query = self.path.partition("?")
            promql = dict(urllib.parse.parse_qsl(query)).get("query", "")
            if path != "/api/v1/query" or promql not in samples:
                status, doc = 400, {"status": "error", "errorType": "bad_data", "error": f"unknown {promql}"}
            else:
                result = [{"metric": {"pod_uid": uid}, "value": [T0, repr(value)]}
                          for uid, value in samples[promql].items()]
                status, doc = 200, {"status": "success", "data": {"resultType": "vector", "result": result}}
            body = json.dumps(doc).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            return

    with serve_handler(Handler) as url:
        yield url


def test_measured_use_from_prometheus(tmp_path: Path) -> None:
    from kube_vgpu.extender.dashboard.server import USED_MEMORY_QUERY, UTILIZATION_QUERY

    with extender(tmp_path) as (url, _):
        state = httpx.get(f"{url}/state", timeout=10).json()
        uid = next(a["uid"] for a in state["assignments"] if a["pod"] == "research/trainer")
        samples = {USED_MEMORY_QUERY: {uid: 3 * 1024 * 1024 * 1024}, UTILIZATION_QUERY: {uid: 0.425}}
        with prometheus(samples) as prom, dashboard(Upstream(url, prom)) as client:
            view = client.get("/api/view").json()
        with prometheus({}) as prom, dashboard(Upstream(url, prom)) as client:
            broken = client.get("/api/view").json()
    trainer = next(p for p in view["pods"] if p["name"] == "trainer")
    assert (trainer["usedMemoryMiB"], trainer["utilizationPercent"]) == (3072, 42.5)
    assert view["usage"] == {"source": "prometheus", "error": None}
    assert next(p for p in view["pods"] if p["name"] == "server")["usedMemoryMiB"] is None
    # Prometheus refusing the query: the allocation figures still show, the use says why it is missing
    assert broken["usage"]["source"] is None and "Prometheus answered 400: unknown" in broken["usage"]["error"]
    assert broken["overview"]["pods"] == 4


def test_listen_address() -> None:
    assert listen_address("127.0.0.1:8080") == ("127.0.0.1", 8080)
    assert listen_address(":9000") == ("0.0.0.0", 9000)
    assert listen_address("[::1]:80") == ("::1", 80)
    with pytest.raises(Exception, match="HOST:PORT"):
        listen_address("localhost")


def test_parse_state_is_the_same_as_top(tmp_path: Path) -> None:
    """The dashboard and `kube-vgpu top` read /state with one parser: their pod lists agree."""
    with extender(tmp_path) as (url, _), dashboard(Upstream(url)) as client:
        view = client.get("/api/view").json()
        _, pods = parse_state(httpx.get(f"{url}/state", timeout=10).json())
    assert sorted((p.namespace, p.name, p.memory_mib) for p in pods) == [
        (p["namespace"], p["name"], p["memoryMiB"]) for p in view["pods"]]


def test_mig_devices_and_gpus_in_mig_mode(tmp_path: Path) -> None:
    from kube_vgpu.dev.screenshots import cluster_items as populated

    with extender(tmp_path, populated()) as (url, _), dashboard(Upstream(url)) as client:
        view = client.get("/api/view").json()
        state = httpx.get(f"{url}/state", timeout=10).json()
    (mig,) = [n for n in view["nodes"] if n["name"] == "mig-0"]
    (raw,) = [n for n in state["nodes"] if n["name"] == "mig-0"]
    assert [g["migMode"] for g in mig["gpus"]] == [True, True, False, False]
    assert mig["mig"] == raw["migDevices"] and len(mig["mig"]) == 11
    assert sorted({d["profile"] for d in mig["mig"]}) == ["1g.5gb", "2g.10gb", "3g.20gb"]
    # stranded capacity leaves MIG-mode GPUs out: only the two T4s (15360 MiB free each) and a100-0's GPU 0 and
    # a100-1's GPUs 0 and 3 are too full or too small for the typical vGPU (40960 MiB, 40 cores)
    assert view["overview"]["stranded"]["gpus"] == 5


def test_the_command_serves_the_page(tmp_path: Path) -> None:
    """`kube-vgpu dashboard` itself, as a process, against a real extender."""
    import os
    import subprocess
    import sys
    import time

    port = free_port()
    with extender(tmp_path) as (url, _):
        process = subprocess.Popen(
            [sys.executable, "-m", "kube_vgpu.cli", "dashboard", "--extender", url, "--listen", f"127.0.0.1:{port}"],
            env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 30
            while True:
                try:
                    view = httpx.get(f"http://127.0.0.1:{port}/api/view", timeout=5).json()
                    break
                except httpx.TransportError:
                    assert time.monotonic() < deadline and process.poll() is None, "the dashboard did not start"
                    time.sleep(0.2)
            assert view["overview"]["pods"] == 4
            assert "kube-vgpu dashboard" in httpx.get(f"http://127.0.0.1:{port}/", timeout=5).text
        finally:
            process.terminate()
            process.wait(10)
