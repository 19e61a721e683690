"""Webhook latency: p50 / p99 per admission over real HTTPS on loopback, for a GPU pod (validated and mutated) and a
pod asking for no GPU (the fast path), with the server in its own process (`kube-vgpu webhook --self-signed-dir`).

The client keeps one TLS connection open, as the kube-apiserver does, and sends the requests one at a time, the
kinds interleaved so that noise from other load on the machine hits every kind alike. Baselines from the same run:
  * GET /healthz over the same connection: TLS + HTTP + framework with an empty handler;
  * in-process `mutate.review` on the same bodies: the webhook's own work, with no network.
A smaller series on a fresh TLS connection per request shows the cost of a cold connection (handshake).

    python bench/webhook_latency.py                      # 2000 requests per kind
    python bench/webhook_latency.py --requests 500
"""

from __future__ import annotations

import argparse
import http.client
import os
import platform
import re
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson

from kube_vgpu.dev.fixtures.admission import admission_review, container, gpu_container, pod
from kube_vgpu.webhook.config import WebhookConfig
from kube_vgpu.webhook.mutate import Result, review

ROOT = Path(__file__).resolve().parent.parent

TARGET_P99_MS = 5.0
STARTUP_TIMEOUT_S = 60.0


def gpu_pod() -> dict[str, Any]:
    """A training pod: 2 vGPUs with memory and cores, user env, a data volume, and a CPU sidecar."""
    trainer = gpu_container(
        "trainer",
        gpu="2",
        gpumem="20000",
        gpucores="50",
        env=[{"name": "EPOCHS", "value": "10"}, {"name": "DATA", "value": "/data"}],
        volumeMounts=[{"name": "data", "mountPath": "/data"}],
    )
    sidecar = container("logs", limits={"cpu": "100m", "memory": "64Mi"}, requests={"cpu": "100m", "memory": "64Mi"})
    return pod(trainer, sidecar, volumes=[{"name": "data", "emptyDir": {}}])


def cpu_pod() -> dict[str, Any]:
    """The same shape without GPU resources."""
    web = container(
        "web",
        limits={"cpu": "2", "memory": "8Gi"},
        requests={"cpu": "2", "memory": "8Gi"},
        env=[{"name": "EPOCHS", "value": "10"}, {"name": "DATA", "value": "/data"}],
        volumeMounts=[{"name": "data", "mountPath": "/data"}],
    )
    sidecar = container("logs", limits={"cpu": "100m", "memory": "64Mi"}, requests={"cpu": "100m", "memory": "64Mi"})
    return pod(web, sidecar, volumes=[{"name": "data", "emptyDir": {}}])


def percentile(samples_ns: list[int], fraction: float) -> float:
    """Nearest-rank percentile, in milliseconds."""
    ordered = sorted(samples_ns)
    rank = max(0, min(len(ordered) - 1, round(fraction * len(ordered) + 0.5) - 1))
    return ordered[rank] / 1e6


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_server(directory: Path, port: int) -> subprocess.Popen[bytes]:
    process = subprocess.Popen(
        [sys.executable, "-m", "kube_vgpu.cli", "webhook", "--host", "127.0.0.1", "--port", str(port),
         "--self-signed-dir", str(directory), "--log-level", "warning"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        cwd=ROOT,
    )  # fmt: skip
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while True:
        if process.poll() is not None:
            raise SystemExit(f"webhook exited: {process.communicate()[1].decode()}")
        try:
            connection = connect(port, directory / "ca.crt")
            connection.request("GET", "/healthz")
            if connection.getresponse().read() == b"ok":
                connection.close()
                return process
        except (OSError, ssl.SSLError, http.client.HTTPException):
            pass
        if time.monotonic() > deadline:
            process.kill()
            raise SystemExit("webhook did not become healthy")
        time.sleep(0.1)


def connect(port: int, ca_file: Path) -> http.client.HTTPSConnection:
    context = ssl.create_default_context(cafile=str(ca_file))
    connection = http.client.HTTPSConnection("localhost", port, context=context, timeout=10)
    connection.connect()
    connection.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return connection


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=2000, help="requests per kind (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=200, help="unmeasured requests per kind first")
    parser.add_argument("--cold", type=int, default=200, help="fresh-connection requests (default: %(default)s)")
    args = parser.parse_args()

    bodies = {
        "GPU pod": orjson.dumps(admission_review(gpu_pod())),
        "non-GPU pod": orjson.dumps(admission_review(cpu_pod())),
    }
    config = WebhookConfig()
    expected = {"GPU pod": Result.MUTATED, "non-GPU pod": Result.ALLOWED}
    for kind, body in bodies.items():
        assert review(body, config).result is expected[kind], kind

    with tempfile.TemporaryDirectory(prefix="webhook-bench-") as temp:
        directory = Path(temp)
        port = free_port()
        process = start_server(directory, port)
        try:
            connection = connect(port, directory / "ca.crt")

            def post(body: bytes) -> Callable[[], bytes]:
                headers = {"Content-Type": "application/json"}

                def call() -> bytes:
                    connection.request("POST", "/mutate", body=body, headers=headers)
                    reply = connection.getresponse()
                    data = reply.read()
                    assert reply.status == 200, data
                    return data

                return call

            def healthz() -> bytes:
                connection.request("GET", "/healthz")
                return connection.getresponse().read()

            calls: dict[str, Callable[[], bytes]] = {
                "baseline GET /healthz": healthz,
                "non-GPU pod": post(bodies["non-GPU pod"]),
                "GPU pod": post(bodies["GPU pod"]),
            }
            first = orjson.loads(calls["GPU pod"]())["response"]
            assert first["allowed"] and first["patchType"] == "JSONPatch"
            assert set(orjson.loads(calls["non-GPU pod"]())["response"]) == {"uid", "allowed"}
            samples: dict[str, list[int]] = {kind: [] for kind in calls}
            for round_number in range(args.warmup + args.requests):
                for kind, call in calls.items():
                    started_ns = time.perf_counter_ns()
                    call()
                    elapsed_ns = time.perf_counter_ns() - started_ns
                    if round_number >= args.warmup:
                        samples[kind].append(elapsed_ns)
            connection.close()

            cold: list[int] = []
            for _ in range(args.cold):
                started_ns = time.perf_counter_ns()
                fresh = connect(port, directory / "ca.crt")
                fresh.request("POST", "/mutate", body=bodies["GPU pod"], headers={"Content-Type": "application/json"})
                fresh.getresponse().read()
                cold.append(time.perf_counter_ns() - started_ns)
                fresh.close()

            metrics_connection = connect(port, directory / "ca.crt")
            metrics_connection.request("GET", "/metrics")
            metrics_text = metrics_connection.getresponse().read().decode()
            metrics_connection.close()
        finally:
            process.terminate()
            process.wait(timeout=30)

    in_process: dict[str, list[int]] = {}
    for kind, body in bodies.items():
        in_process[kind] = []
        for _ in range(args.requests):
            started_ns = time.perf_counter_ns()
            review(body, config)
            in_process[kind].append(time.perf_counter_ns() - started_ns)

    print(f"webhook latency: {args.requests} requests per kind after {args.warmup} warm-up, one keep-alive TLS 1.3")
    python = f"{platform.python_implementation()} {platform.python_version()}"
    machine = f"{os.cpu_count()} CPUs ({platform.processor() or platform.machine()})"
    print(f"connection on 127.0.0.1, server in its own process; {python}, {machine}")
    print()
    baseline = samples["baseline GET /healthz"]
    base_p50, base_p99 = percentile(baseline, 0.50), percentile(baseline, 0.99)
    header = f"{'over HTTPS':<28}{'p50 ms':>9}{'p99 ms':>9}{'max ms':>9}{'p50/base':>10}{'p99/base':>10}"
    print(header)
    print("-" * len(header))
    for kind, values in samples.items():
        p50, p99 = percentile(values, 0.50), percentile(values, 0.99)
        print(
            f"{kind:<28}{p50:>9.3f}{p99:>9.3f}{max(values) / 1e6:>9.3f}{p50 / base_p50:>10.2f}{p99 / base_p99:>10.2f}"
        )
    p50, p99 = percentile(cold, 0.50), percentile(cold, 0.99)
    print(f"{'GPU pod, new TLS connection':<28}{p50:>9.3f}{p99:>9.3f}{max(cold) / 1e6:>9.3f}"
          f"{p50 / base_p50:>10.2f}{p99 / base_p99:>10.2f}   ({args.cold} requests)")  # fmt: skip
    print()
    print(f"{'in-process mutate.review':<28}{'p50 us':>9}{'p99 us':>9}")
    for kind, values in in_process.items():
        print(f"{kind:<28}{percentile(values, 0.5) * 1000:>9.1f}{percentile(values, 0.99) * 1000:>9.1f}")
    print()
    for result in ("mutated", "allowed"):
        total = re.search(rf'admission_duration_seconds_sum{{result="{result}"}} (\S+)', metrics_text)
        count = re.search(rf'admission_duration_seconds_count{{result="{result}"}} (\S+)', metrics_text)
        if total and count and float(count.group(1)):
            mean_us = float(total.group(1)) / float(count.group(1)) * 1e6
            print(f"server-side handler time (from /metrics), {result}: mean {mean_us:.1f} us")
    worst = max(percentile(samples["GPU pod"], 0.99), percentile(samples["non-GPU pod"], 0.99))
    verdict = "met" if worst < TARGET_P99_MS else "MISSED"
    print(f"target p99 < {TARGET_P99_MS} ms per admission (keep-alive): {verdict} (worst p99 {worst:.3f} ms)")
    return 0 if worst < TARGET_P99_MS else 1


if __name__ == "__main__":
    sys.exit(main())
