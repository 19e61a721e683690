"""`kube-vgpu usage` against a small real HTTP server speaking Prometheus' query_range API (request form fields,
response JSON and error shapes as Prometheus documents them: https://prometheus.io/docs/prometheus/latest/querying/api/).
The server answers from per-step increases it holds, at the timestamps the request's start, end and step give, so a
wrong period or step shows in the totals."""

from __future__ import annotations

import datetime as dt
import http.server
import json
import urllib.parse
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest

from kube_vgpu.cli import main as kube_vgpu_main
from tests.servers import free_port, serve_handler

START = "2026-11-01"
END = "2026-11-02T00:00:00Z"
DAY_START = 1793491200.0  # 2026-11-01T00:00:00Z

#: counter -> team label value -> increase per step (the counter's own unit-seconds)
INCREASES: dict[str, dict[str, dict[str, float]]] = {
    "namespace": {
        "kube_vgpu_pod_vgpu_seconds_total": {"research": 2 * 21600.0, "inference": 21600.0},
        "kube_vgpu_pod_gpu_core_percent_seconds_total": {"research": 100 * 21600.0, "inference": 25 * 21600.0},
        "kube_vgpu_pod_gpu_memory_mib_seconds_total": {"research": 81920 * 21600.0, "inference": 20480 * 21600.0},
    },
    "cluster_queue": {
        "kube_vgpu_pod_vgpu_seconds_total": {"ai-training-queue": 3 * 21600.0},
        "kube_vgpu_pod_gpu_core_percent_seconds_total": {"ai-training-queue": 125 * 21600.0},
        "kube_vgpu_pod_gpu_memory_mib_seconds_total": {"ai-training-queue": 102400 * 21600.0},
    },
}


@dataclass
class FakePrometheus:
    """Prometheus' /api/v1/query_range: form-encoded POST in, {"status": "success", "data": {"resultType": "matrix",
    "result": [{"metric": {...}, "values": [[ts, "v"], ...]}]}} out. `override` answers every request instead."""

    requests: list[dict[str, str]] = field(default_factory=list)
    override: tuple[int, bytes] | None = None

    def answer(self, form: dict[str, str]) -> tuple[int, bytes]:
        self.requests.append(form)
        if self.override is not None:
            return self.override
        query = form["query"]
        team = query.split("sum by (", 1)[1].split(")", 1)[0]
        counter = query.split("increase(", 1)[1].split("[", 1)[0]
        start, end = float(form["start"]), float(form["end"])
        step = float(form["step"].rstrip("s"))
        stamps = []
        moment = start
        while moment <= end:
            stamps.append(moment)
            moment += step
        result = [{"metric": {team: name}, "values": [[stamp, repr(per_step)] for stamp in stamps]}
                  for name, per_step in INCREASES[team][counter].items()]
        return 200, json.dumps({"status": "success", "data": {"resultType": "matrix", "result": result}}).encode()


@contextmanager
def prometheus(fake: FakePrometheus) -> Iterator[str]:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            if self.path != "/api/v1/query_range":
                status, body = 404, b"404 page not found"
            else:
                length = int(self.headers["Content-Length"])
                form = dict(urllib.parse.parse_qsl(self.rfile.read(length).decode()))
                status, body = fake.answer(form)
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            return

    with serve_handler(Handler) as url:
        yield url


def usage(capsys: pytest.CaptureFixture[str], *words: str) -> tuple[int, str, str]:
    code = kube_vgpu_main(["usage", *words])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_gpu_hours_per_namespace(capsys: pytest.CaptureFixture[str]) -> None:
    fake = FakePrometheus()
    with prometheus(fake) as url:
        code, out, err = usage(capsys, "--prometheus-url", url, "--start", START, "--end", END, "--step", "6h")
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0] == "GPU use from 2026-11-01T00:00:00+00:00 to 2026-11-02T00:00:00+00:00 (steps of 21600 s)"
    # 4 steps of 6 h: research held 2 vGPUs, 100 % compute and 80 GiB for 24 h
    assert [line.split() for line in lines[1:]] == [
        ["NAMESPACE", "VGPU-HOURS", "GPU-HOURS", "MEMORY-GIB-HOURS"],
        ["research", "48.00", "24.00", "1920.00"],
        ["inference", "24.00", "6.00", "480.00"],
        ["TOTAL", "72.00", "30.00", "2400.00"],
    ]
    assert [r["query"] for r in fake.requests] == [
        "sum by (namespace) (max by (namespace, pod, cluster_queue) "
        f"(increase({counter}[21600s])))"
        for counter in ("kube_vgpu_pod_vgpu_seconds_total", "kube_vgpu_pod_gpu_core_percent_seconds_total",
                        "kube_vgpu_pod_gpu_memory_mib_seconds_total")
    ]
    # the windows end at start + step, ..., end: they cover the period once
    assert {(float(r["start"]), float(r["end"]), r["step"]) for r in fake.requests} == {
        (DAY_START + 21600, DAY_START + 86400, "21600s")}


def test_by_cluster_queue_as_json(capsys: pytest.CaptureFixture[str]) -> None:
    with prometheus(FakePrometheus()) as url:
        code, out, err = usage(capsys, "--prometheus-url", url, "--start", START, "--end", END, "--step", "6h",
                               "--by", "cluster_queue", "-o", "json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["teams"] == {"ai-training-queue": {"VGPU-HOURS": 72.0, "GPU-HOURS": 30.0,
                                                  "MEMORY-GIB-HOURS": 2400.0}}
    assert doc["by"] == "cluster_queue"


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ((400, b'{"status":"error","errorType":"bad_data","error":"1:1: parse error: unexpected character"}'),
         "answered 400: bad_data: 1:1: parse error: unexpected character"),
        ((503, b"Service Unavailable"), "answered 503: Service Unavailable"),
        ((200, b"<html>not prometheus</html>"), "did not answer JSON"),
        ((200, b'{"status":"success","data":{"resultType":"vector","result":[]}}'),
         "expected data.resultType matrix"),
        ((200, b'{"status":"success","data":{"resultType":"matrix","result":[{"metric":{},"values":[[1,"NaN"]]}]}}'),
         "value NaN at 1 is not finite"),
        ((200, b'{"status":"success","data":{"resultType":"matrix","result":[{"metric":{},"values":[[1, 2]]}]}}'),
         "a value must be [timestamp, \"number\"], got [1, 2]"),
    ],
)
def test_prometheus_answers_that_cannot_be_used(
    override: tuple[int, bytes], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with prometheus(FakePrometheus(override=override)) as url:
        code, out, err = usage(capsys, "--prometheus-url", url, "--start", START, "--end", END)
    assert (code, out) == (1, "")
    assert err.startswith("kube-vgpu usage: ") and message in err


@pytest.mark.parametrize(
    ("words", "message"),
    [
        (["--start", "yesterday"], "expected a date (2026-11-01) or an ISO 8601 time"),
        (["--start", END, "--end", START], "must be after --start"),
        (["--start", START, "--end", "2026-11-01T01:30:00Z"], "the period (5400 s) must be a whole number of steps"),
        (["--start", "2025-01-01", "--end", "2026-11-01", "--step", "1h"], "Prometheus answers at most 11000"),
        (["--start", START, "--step", "0h"], "expected a duration like 1h"),
    ],
)
def test_bad_arguments_are_refused_before_asking(
    words: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    fake = FakePrometheus()
    with prometheus(fake) as url:
        code, _, err = usage(capsys, "--prometheus-url", url, *words)
    assert code == 1 and message in err
    assert fake.requests == []


def test_without_an_end_the_period_ends_at_the_last_whole_step(capsys: pytest.CaptureFixture[str]) -> None:
    start = (dt.datetime.now(dt.UTC) - dt.timedelta(days=3)).replace(hour=0, minute=0, second=0, microsecond=0)
    fake = FakePrometheus()
    with prometheus(fake) as url:
        code, _, err = usage(capsys, "--prometheus-url", url, "--start", start.isoformat(), "--step", "1h")
    assert code == 0, err
    end = float(fake.requests[0]["end"])
    assert (end - start.timestamp()) % 3600 == 0 and end <= dt.datetime.now(dt.UTC).timestamp()


def test_unreachable_prometheus(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = usage(capsys, "--prometheus-url", f"http://127.0.0.1:{free_port()}", "--start", START, "--end",
                         END, "--timeout-seconds", "5")
    assert code == 1 and "cannot reach http://127.0.0.1:" in err


def test_no_use_in_the_period(capsys: pytest.CaptureFixture[str]) -> None:
    empty = (200, b'{"status":"success","data":{"resultType":"matrix","result":[]}}')
    with prometheus(FakePrometheus(override=empty)) as url:
        code, out, _ = usage(capsys, "--prometheus-url", url, "--start", START, "--end", END)
    assert code == 0 and out.splitlines()[-1] == "no GPU use recorded in this period"
