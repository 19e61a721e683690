"""Extender latency: filter + prioritize for a 1-GPU fractional pod and a 4-GPU pod on N synthetic nodes
x 8 GPUs at ~50% usage, in-process and over HTTP (server in its own process), plus the server's RSS.

Each iteration is what kube-scheduler does for one pod: filter, prioritize, then bind to the best node,
so per-node caches are invalidated as in production. Baselines measured in the same run:
  * HTTP: a /filter round trip with the same pod and an empty node list (framework + JSON cost);
  * in-process: parsing the pod's GPU request alone.

    python bench/extender_latency.py                  # 500, 1000, 5000 nodes
    python bench/extender_latency.py --nodes 500 --iterations 100
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import orjson

from kube_vgpu import protocol
from kube_vgpu.dev.fixtures import gpu_pod_object, node_object, synth_inventory
from kube_vgpu.dev.fixtures import scheduled_pod as make_pod
from kube_vgpu.extender.engine.fit import place
from kube_vgpu.extender.engine.model import NodeState, Placement, PlacementRequest, assignment_from_placement
from kube_vgpu.extender.engine.policies import make_policy
from kube_vgpu.extender.scheduler import Scheduler
from kube_vgpu.extender.sources.snapshot import SnapshotCluster
from kube_vgpu.extender.state import ClusterState

ROOT = Path(__file__).resolve().parent.parent

GPU_MEMORY_MIB = 81920


def half_full_cluster(nodes: int, pods_per_node: int = 8, seed: int = 7) -> list[dict[str, Any]]:
    """nodes x 8 A100-80GB, each node carrying pods_per_node 1-GPU pods at ~50% memory and cores."""
    rng = random.Random(seed)
    policy = make_policy("spread")
    items: list[dict[str, Any]] = []
    for number in range(nodes):
        name = f"gpu-node-{number:05d}"
        inventory = synth_inventory(name, 8, "NVIDIA-A100-SXM4-80GB", GPU_MEMORY_MIB, "nvswitch")
        items.append(node_object(name, inventory))
        state = NodeState(name, inventory)
        for pod_number in range(pods_per_node):
            memory = rng.randrange(20000, 60000, 1024)
            cores = rng.randrange(30, 71, 5)
            pod = gpu_pod_object(f"{name}-p{pod_number}", memory_mib=memory, cores=cores)
            placement = place(state, PlacementRequest(protocol.parse_pod_gpu_request(pod)), policy, policy)
            assert isinstance(placement, Placement)
            state.apply_usage(placement.usage)
            items.append(
                gpu_pod_object(
                    f"{name}-p{pod_number}",
                    memory_mib=memory,
                    cores=cores,
                    node_name=name,
                    assignment=assignment_from_placement(state, placement),
                )
            )
    return items


def shapes() -> dict[str, dict[str, Any]]:
    return {
        "1-gpu-fractional": {"gpus": 1, "memory_mib": 8192, "cores": 20},
        "4-gpu": {"gpus": 4, "memory_mib": 10240, "cores": 10},
    }


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def summarise(samples_s: list[float]) -> str:
    return f"p50 {percentile(samples_s, 50) * 1e3:7.3f} ms  p99 {percentile(samples_s, 99) * 1e3:7.3f} ms"


def bench_in_process(
    items: list[dict[str, Any]], names: list[str], iterations: int
) -> dict[str, dict[str, list[float]]]:
    # a snapshot, as `kube-vgpu extender --snapshot` serves it: its heartbeats never expire, however long building
    # 5000 nodes took on a loaded machine (the default 120 s TTL would measure filters failing on stale nodes)
    state = ClusterState(heartbeat_ttl_s=float("inf"))
    cluster = SnapshotCluster(state, [dict(i) for i in items])
    scheduler = Scheduler(state, cluster)
    results: dict[str, dict[str, list[float]]] = {}
    for shape_name, shape in shapes().items():
        timings: dict[str, list[float]] = {"filter": [], "prioritize": [], "baseline-parse": []}
        for _ in range(iterations):
            pod = make_pod(**shape)
            started = time.perf_counter()
            protocol.parse_pod_gpu_request(pod)
            timings["baseline-parse"].append(time.perf_counter() - started)
            started = time.perf_counter()
            outcome = scheduler.filter(pod, names)
            timings["filter"].append(time.perf_counter() - started)
            started = time.perf_counter()
            scores = scheduler.prioritize(pod, outcome.passed)
            timings["prioritize"].append(time.perf_counter() - started)
            if scores:
                best = max(scores, key=lambda s: s[1])[0]
                cluster.remember_pod(pod)
                meta = pod["metadata"]
                scheduler.bind(meta["namespace"], meta["name"], meta["uid"], best)
        results[shape_name] = timings
    return results


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def bench_http(snapshot: Path, names: list[str], iterations: int) -> tuple[dict[str, dict[str, list[float]]], float]:
    port = 20000 + os.getpid() % 20000
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kube_vgpu.cli",
            "extender",
            "--snapshot",
            str(snapshot),
            "--port",
            str(port),
            "--log-level",
            "WARNING",
        ],
        cwd=ROOT,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        with httpx.Client(base_url=url, timeout=60) as client:
            deadline = time.monotonic() + 300
            while True:
                try:
                    if client.get("/readyz").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline or server.poll() is not None:
                    raise RuntimeError("extender did not become ready")
                time.sleep(0.2)
            results: dict[str, dict[str, list[float]]] = {}
            headers = {"Content-Type": "application/json"}
            for shape_name, shape in shapes().items():
                timings: dict[str, list[float]] = {"filter": [], "prioritize": [], "baseline-empty-filter": []}
                for _ in range(iterations):
                    pod = make_pod(**shape)
                    empty = orjson.dumps({"Pod": pod, "NodeNames": []})
                    started = time.perf_counter()
                    client.post("/filter", content=empty, headers=headers)
                    timings["baseline-empty-filter"].append(time.perf_counter() - started)
                    body = orjson.dumps({"Pod": pod, "NodeNames": names})
                    started = time.perf_counter()
                    reply = orjson.loads(client.post("/filter", content=body, headers=headers).content)
                    timings["filter"].append(time.perf_counter() - started)
                    passed = reply["NodeNames"]
                    body = orjson.dumps({"Pod": pod, "NodeNames": passed})
                    started = time.perf_counter()
                    scores = orjson.loads(client.post("/prioritize", content=body, headers=headers).content)
                    timings["prioritize"].append(time.perf_counter() - started)
                    if scores:
                        best = max(scores, key=lambda s: s["Score"])["Host"]
                        meta = pod["metadata"]
                        client.post(
                            "/bind",
                            json={
                                "PodName": meta["name"],
                                "PodNamespace": "default",
                                "PodUID": meta["uid"],
                                "Node": best,
                            },
                        )
                results[shape_name] = timings
            return results, rss_mib(server.pid)
    finally:
        server.terminate()
        server.wait(10)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, nargs="+", default=[500, 1000, 5000])
    parser.add_argument("--iterations", type=int, default=200)
    args = parser.parse_args()
    print(f"# extender latency: {args.iterations} pods per shape; each pod filtered, prioritized, bound")
    for nodes in args.nodes:
        started = time.perf_counter()
        items = half_full_cluster(nodes)
        names = [i["metadata"]["name"] for i in items if i["kind"] == "Node"]
        pods = sum(1 for i in items if i["kind"] == "Pod")
        print(
            f"\n## {nodes} nodes x 8 GPUs, {pods} assigned pods (~50% memory and cores), built in "
            f"{time.perf_counter() - started:.1f}s"
        )
        for shape_name, timings in bench_in_process(items, names, args.iterations).items():
            base = percentile(timings["baseline-parse"], 50)
            for verb in ("filter", "prioritize"):
                ratio = percentile(timings[verb], 50) / base
                print(
                    f"in-process {shape_name:17s} {verb:10s} {summarise(timings[verb])}  "
                    f"(p50 = {ratio:6.1f}x parsing alone)"
                )
        with tempfile.TemporaryDirectory() as tmp:
            snapshot = Path(tmp) / "snapshot.json"
            snapshot.write_bytes(orjson.dumps({"apiVersion": "v1", "kind": "List", "items": items}))
            http_results, rss = bench_http(snapshot, names, args.iterations)
        for shape_name, timings in http_results.items():
            base = percentile(timings["baseline-empty-filter"], 99)
            print(
                f"http       {shape_name:17s} {'empty-filter':10s} "
                f"{summarise(timings['baseline-empty-filter'])}  (baseline)"
            )
            for verb in ("filter", "prioritize"):
                ratio = percentile(timings[verb], 99) / base
                print(
                    f"http       {shape_name:17s} {verb:10s} {summarise(timings[verb])}  (p99 = {ratio:5.1f}x baseline)"
                )
        print(f"extender RSS after the run: {rss:.0f} MiB (snapshot mode, holding every Node and Pod object)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
