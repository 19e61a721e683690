"""Extender latency: filter + prioritize for a 1-GPU fractional pod and a 4-GPU pod on N synthetic nodes
x 8 GPUs at ~50% usage, in-process and over HTTP (server in its own process), the first pod of new request shapes
(cold), plus the server's RSS, in snapshot mode and in live mode.

Each iteration is what kube-scheduler does for one pod: filter, prioritize, then bind to the best node,
so per-node caches are invalidated as in production. In-process, the calls are the server's: after the filter,
prioritize's answer is prepared (`prepare`, which the server does once the filter's reply is sent, while
kube-scheduler reads it), then the prioritize reads it; a new shape's prioritize counts both. Baselines measured in
the same run:
  * HTTP: a /filter round trip with the same pod and an empty node list (framework + JSON cost);
  * in-process: parsing the pod's GPU request alone.

Clusters (--cluster):
  * distinct: each node carries 8 1-GPU pods of random memory (20-60 GiB) and cores (30-70%), one per GPU (the
    `spread` policy): every node's state differs from every other's, the worst case for sharing work between nodes;
  * packed: each node runs one workload, 4 to 12 pods (8 on average) of one of four shapes, placed by the
    extender's default policy (`bfgd`), as a cluster the extender filled itself looks: few distinct node states;
  * whole-gpu: each node runs 1-6 whole-GPU pods of random memory (a training cluster): every node's state its own,
    its idle GPUs all alike (a fractional pod's choice among them is the topology tie-break on every node).

The learned workload (--learned-pods, default 1500): before the phases the extender's policy observes that many pods
of the openb default trace's shapes (../shared/traces/openb: its GPU share, GPU count and CPU ask, in a random
order), as a running extender has learned its cluster's workload. The measure a new shape is placed by has a term
per shape of that workload (tens of them, against the phases' own few): `--learned-pods 0` measures the extender
fresh, as before the twelfth stop. 1500 leaves the phases' pods (400 at the default iterations) short of the next
change of the learned model (at 2048 pods).

Modes (--modes): `snapshot` serves the cluster from a snapshot file (`kube-vgpu extender --snapshot`), which also
holds every Node and Pod object; `live` runs `kube-vgpu extender --kubeconfig` against a stand-in API server (a
process of its own: tests/extender/fakeapi.py, serving lists and watches over HTTP), so the state is built by the
live source's list + watch, binds are written as Bindings and come back as watch events, and only the parsed state
is held. Each pod of the live phase is created in the API server before it is filtered (untimed).

    python bench/extender_latency.py                  # 500, 1000, 5000 nodes
    python bench/extender_latency.py --nodes 5000 --cluster distinct packed --modes snapshot live
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import orjson
from fastapi import Request  # the stand-in API server's routes resolve their annotations in this module
from fastapi.responses import Response

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from kube_vgpu import protocol  # noqa: E402
from kube_vgpu.dev.fixtures import gpu_pod_object, node_object, synth_inventory  # noqa: E402
from kube_vgpu.dev.fixtures import scheduled_pod as make_pod  # noqa: E402
from kube_vgpu.dev.simulator.trace import find_openb_traces, load_tasks, openb_trace_folders  # noqa: E402
from kube_vgpu.extender.engine.fit import place  # noqa: E402
from kube_vgpu.extender.engine.model import (  # noqa: E402
    NodeState,
    Placement,
    PlacementRequest,
    assignment_from_placement,
)
from kube_vgpu.extender.engine.policies import make_policy  # noqa: E402
from kube_vgpu.extender.scheduler import Scheduler  # noqa: E402
from kube_vgpu.extender.sources.snapshot import SnapshotCluster  # noqa: E402
from kube_vgpu.extender.state import ClusterState  # noqa: E402

GPU_MEMORY_MIB = 81920
#: (memory MiB, cores) of the packed cluster's four workloads
PACKED_SHAPES = ((8192, 20), (16384, 25), (20480, 50), (40960, 30))


def _node_with_pods(
    name: str, pods: list[tuple[int, int]], policy_name: str
) -> list[dict[str, Any]]:
    inventory = synth_inventory(name, 8, "NVIDIA-A100-SXM4-80GB", GPU_MEMORY_MIB, "nvswitch")
    items = [node_object(name, inventory)]
    state = NodeState(name, inventory)
    policy = make_policy(policy_name)
    for pod_number, (memory, cores) in enumerate(pods):
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


def half_full_cluster(nodes: int, pods_per_node: int = 8, seed: int = 7) -> list[dict[str, Any]]:
    """nodes x 8 A100-80GB, each node carrying pods_per_node 1-GPU pods at ~50% memory and cores (every node's
    state its own: the `distinct` cluster)."""
    rng = random.Random(seed)
    items: list[dict[str, Any]] = []
    for number in range(nodes):
        pods = [(rng.randrange(20000, 60000, 1024), rng.randrange(30, 71, 5)) for _ in range(pods_per_node)]
        items.extend(_node_with_pods(f"gpu-node-{number:05d}", pods, "spread"))
    return items


def packed_cluster(nodes: int, seed: int = 7) -> list[dict[str, Any]]:
    """nodes x 8 A100-80GB, each running 4-12 pods of one workload shape (PACKED_SHAPES), placed by `bfgd`."""
    rng = random.Random(seed)
    items: list[dict[str, Any]] = []
    for number in range(nodes):
        shape = rng.choice(PACKED_SHAPES)
        items.extend(_node_with_pods(f"gpu-node-{number:05d}", [shape] * rng.randint(4, 12), "bfgd"))
    return items


def whole_gpu_cluster(nodes: int, seed: int = 7) -> list[dict[str, Any]]:
    """nodes x 8 A100-80GB, each running 1-6 whole-GPU pods (gpucores 100) of random memory: every node's state its
    own, and its idle GPUs all alike (a training cluster)."""
    rng = random.Random(seed)
    items: list[dict[str, Any]] = []
    for number in range(nodes):
        pods = [(rng.randrange(20480, 81921, 1024), 100) for _ in range(rng.randint(1, 6))]
        items.extend(_node_with_pods(f"gpu-node-{number:05d}", pods, "spread"))
    return items


CLUSTERS: dict[str, Callable[[int], list[dict[str, Any]]]] = {
    "distinct": half_full_cluster, "packed": packed_cluster, "whole-gpu": whole_gpu_cluster}


def shapes() -> dict[str, dict[str, Any]]:
    return {
        "1-gpu-fractional": {"gpus": 1, "memory_mib": 8192, "cores": 20},
        "4-gpu": {"gpus": 4, "memory_mib": 10240, "cores": 10},
    }


def cold_shapes() -> dict[str, dict[str, Any]]:
    """Request shapes the extender has not seen before this phase (each one's first pod is placed on every node)."""
    return {
        "1 GPU, 12 GiB, 25%": {"gpus": 1, "memory_mib": 12288, "cores": 25},
        "1 GPU, 4 GiB, 5%": {"gpus": 1, "memory_mib": 4096, "cores": 5},
        "2 GPUs, 6 GiB, 15%": {"gpus": 2, "memory_mib": 6144, "cores": 15},
        "3 GPUs, 2 GiB, 10%": {"gpus": 3, "memory_mib": 2048, "cores": 10},
    }


def learned_pods(count: int, seed: int = 1) -> list[dict[str, Any]]:
    """count pending GPU pods of the openb default trace's shapes, in a random order (a share of a GPU asks that
    share of its cores and memory; the trace's CPU ask); none, with a warning, where the trace is not found."""
    if count <= 0:
        return []
    folder = find_openb_traces()
    trace_path = None if folder is None else folder / "openb_pod_list_default.csv"
    if trace_path is None or not trace_path.is_file():
        print(f"# warning: openb_pod_list_default.csv not found in {', '.join(map(str, openb_trace_folders()))} "
              "(set KUBE_VGPU_OPENB_TRACES): the policy learns no workload before the phases")
        return []
    tasks = [task for task in load_tasks(trace_path) if task.gpu_count]
    random.Random(seed).shuffle(tasks)
    pods = []
    for number in range(count):
        task = tasks[number % len(tasks)]
        share_percent = min(100, -(-task.gpu_milli // 10))
        pod = make_pod(f"learned-{number}", gpus=task.gpu_count, cores=share_percent, memory_percent=share_percent)
        for container in pod["spec"]["containers"]:
            resources = container["resources"]
            resources["limits"]["cpu"] = resources["requests"]["cpu"] = f"{task.cpu_milli}m"
        pods.append(pod)
    return pods


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def summarise(samples_s: list[float]) -> str:
    return f"p50 {percentile(samples_s, 50) * 1e3:7.3f} ms  p99 {percentile(samples_s, 99) * 1e3:7.3f} ms"


def bench_in_process(
    items: list[dict[str, Any]], names: list[str], iterations: int, policy: str | None = None,
    learned: list[dict[str, Any]] | None = None,
) -> tuple[dict[str, dict[str, list[float]]], dict[str, tuple[float, float]]]:
    # a snapshot, as `kube-vgpu extender --snapshot` serves it: its heartbeats never expire, however long building
    # 5000 nodes took on a loaded machine (the default 120 s TTL would measure filters failing on stale nodes); and
    # the collector as the serving extender runs it (the state frozen once loaded, then the survivors of each full
    # collection), else a full collection over everything (0.2-0.4 s here) lands in a verb
    state = ClusterState(heartbeat_ttl_s=float("inf"), freeze_gc_when_synced=True)
    cluster = SnapshotCluster(state, [dict(i) for i in items])
    try:
        from kube_vgpu.extender.gcpolicy import freeze_survivors  # type: ignore[import-not-found,unused-ignore]

        freeze_survivors()
    except ImportError:
        pass  # code from before the survivor freezer
    if policy is None:
        scheduler = Scheduler(state, cluster)
    else:
        scheduler = Scheduler(state, cluster, node_policy=policy, gpu_policy=policy)
    try:
        from kube_vgpu.extender.scheduler import equivalence_key  # type: ignore[attr-defined,unused-ignore]

        classes = len({equivalence_key(node) for node in state.nodes.values()})
        print(f"in-process distinct node states (equivalence keys): {classes}")
    except ImportError:
        pass  # code from before node-equivalence classes
    for pod in learned or ():  # each pod's filter on no node: the policy observes its shape
        scheduler.filter(pod, [])

    def one_pod(shape: dict[str, Any]) -> tuple[float, float, float]:
        """(filter, prepare, prioritize) seconds of one pod, through the calls the server makes: prioritize's answer
        is prepared once the filter's reply is sent (Verbs.after_filter), then read by the prioritize."""
        pod = make_pod(**shape)
        started = time.perf_counter()
        outcome = scheduler.filter(pod, names)
        filtered = time.perf_counter()
        scheduler.prepare_scores(pod, outcome.passed)
        prepared = time.perf_counter()
        hosts, scores = scheduler.scaled_scores(pod, outcome.passed)
        prioritized = time.perf_counter()
        # the best score's node (hosts holds the nonzero ones: all scoring 0, the first passing node, as ties go)
        best = hosts[max(range(len(scores)), key=scores.__getitem__)] if hosts else next(iter(outcome.passed), None)
        if best is not None:
            cluster.remember_pod(pod)
            meta = pod["metadata"]
            scheduler.bind(meta["namespace"], meta["name"], meta["uid"], best)
        return filtered - started, prepared - filtered, prioritized - prepared

    results: dict[str, dict[str, list[float]]] = {}
    for shape_name, shape in shapes().items():
        timings: dict[str, list[float]] = {"filter": [], "prepare": [], "prioritize": [], "baseline-parse": []}
        for _ in range(iterations):
            started = time.perf_counter()
            protocol.parse_pod_gpu_request(make_pod(**shape))
            timings["baseline-parse"].append(time.perf_counter() - started)
            filter_s, prepare_s, prioritize_s = one_pod(shape)
            timings["filter"].append(filter_s)
            timings["prepare"].append(prepare_s)
            timings["prioritize"].append(prioritize_s)
        results[shape_name] = timings
    cold: dict[str, tuple[float, float]] = {}
    for shape_name, shape in cold_shapes().items():
        filter_s, prepare_s, prioritize_s = one_pod(shape)
        cold[shape_name] = (filter_s, prepare_s + prioritize_s)  # the server's work for the prioritize, all of it
    return results, cold


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def wait_ready(client: httpx.Client, process: subprocess.Popen[bytes], path: str, timeout_s: float = 900) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if client.get(path).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline or process.poll() is not None:
            raise RuntimeError(f"{path} never answered 200")
        time.sleep(0.2)


def serve_fake_api(snapshot: Path, port: int) -> None:
    """The stand-in API server of the live phase (run as its own process: `--serve-fake-api`): the snapshot's
    objects, lists served without copying them (they are replaced, never changed in place), pod creation."""
    import uvicorn

    from tests.extender.fakeapi import FakeApiServer

    class BenchApiServer(FakeApiServer):
        copy_lists = False

        def __init__(self) -> None:
            super().__init__()
            self.app.add_api_route("/api/v1/namespaces/{namespace}/pods", self.create_pod, methods=["POST"])

        async def create_pod(self, namespace: str, request: Request) -> Response:
            self.put("pods", orjson.loads(await request.body()))
            return Response(b"{}", status_code=201, media_type="application/json")

    server = BenchApiServer()
    for item in orjson.loads(snapshot.read_bytes())["items"]:
        plural = "nodes" if item["kind"] == "Node" else "pods"
        item["metadata"]["resourceVersion"] = "1"
        server.objects[plural][server.key(item)] = item  # the initial state: listed, no watch events
    uvicorn.run(server.app, host="127.0.0.1", port=port, log_level="warning")


@contextmanager
def client_collector_off() -> Iterator[None]:
    """The bench client's own cyclic collector off while a request is timed, on between requests: its pauses are not
    the extender's latency (httpx leaves reference cycles, ~250 objects a pod; in one run a young collection of them
    took 13 ms and an old one 113 ms of a timed request, found with a collector hook in every process)."""
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def bench_http(
    snapshot: Path, names: list[str], iterations: int, mode: str, policy: str | None = None, shuffle: bool = False,
    learned: list[dict[str, Any]] | None = None,
) -> tuple[dict[str, dict[str, list[float]]], dict[str, tuple[float, float]], float, float]:
    """(steady timings per shape, cold (filter s, prioritize s) per shape, RSS MiB after the run, seconds until the
    extender was ready)."""
    port = 20000 + os.getpid() % 20000
    command = [sys.executable, "-m", "kube_vgpu.cli", "extender", "--port", str(port), "--log-level", "WARNING"]
    if policy is not None:
        command += ["--policy", policy, "--gpu-policy", policy]
    api: subprocess.Popen[bytes] | None = None
    api_url = f"http://127.0.0.1:{port + 1}"
    tmp = tempfile.TemporaryDirectory()
    if mode == "snapshot":
        command += ["--snapshot", str(snapshot)]
    else:
        api = subprocess.Popen([sys.executable, __file__, "--serve-fake-api", str(snapshot), str(port + 1)], cwd=ROOT)
        from tests.extender.fakeapi import write_kubeconfig

        kubeconfig = write_kubeconfig(Path(tmp.name) / "kubeconfig", api_url)
        with httpx.Client(base_url=api_url, timeout=60) as api_client:
            wait_ready(api_client, api, "/api/v1/nodes?limit=1")
        command += ["--kubeconfig", str(kubeconfig), "--quota-mode", "off", "--no-require-admission-mark",
                    "--heartbeat-ttl-seconds", "86400"]
    started = time.perf_counter()
    server = subprocess.Popen(command, cwd=ROOT)
    try:
        url = f"http://127.0.0.1:{port}"
        with httpx.Client(base_url=url, timeout=60) as client, httpx.Client(base_url=api_url, timeout=60) as api_client:
            wait_ready(client, server, "/readyz")
            ready_s = time.perf_counter() - started
            headers = {"Content-Type": "application/json"}
            for pod in learned or ():  # each pod's filter on no node: the policy observes its shape
                client.post("/filter", content=orjson.dumps({"Pod": pod, "NodeNames": []}), headers=headers)
            gc.collect()
            gc.freeze()  # the client's set-up (names, learned pods) out of its old collections' reach

            def one_pod(shape: dict[str, Any], timings: dict[str, list[float]] | None) -> tuple[float, float]:
                pod = make_pod(**shape)
                if api is not None:
                    api_client.post("/api/v1/namespaces/default/pods", content=orjson.dumps(pod))
                if timings is not None:
                    empty = orjson.dumps({"Pod": pod, "NodeNames": []})
                    with client_collector_off():
                        started = time.perf_counter()
                        client.post("/filter", content=empty, headers=headers)
                        timings["baseline-empty-filter"].append(time.perf_counter() - started)
                if shuffle:  # kube-scheduler's filter plugins run in parallel: the feasible nodes come in any order
                    random.shuffle(names)
                body = orjson.dumps({"Pod": pod, "NodeNames": names})
                with client_collector_off():
                    started = time.perf_counter()
                    reply = orjson.loads(client.post("/filter", content=body, headers=headers).content)
                    filter_s = time.perf_counter() - started
                body = orjson.dumps({"Pod": pod, "NodeNames": reply["NodeNames"]})
                with client_collector_off():
                    started = time.perf_counter()
                    scores = orjson.loads(client.post("/prioritize", content=body, headers=headers).content)
                    prioritize_s = time.perf_counter() - started
                if scores:
                    best = max(scores, key=lambda s: s["Score"])["Host"]
                    meta = pod["metadata"]
                    client.post("/bind", json={"PodName": meta["name"], "PodNamespace": "default",
                                               "PodUID": meta["uid"], "Node": best})
                return filter_s, prioritize_s

            results: dict[str, dict[str, list[float]]] = {}
            for shape_name, shape in shapes().items():
                timings: dict[str, list[float]] = {"filter": [], "prioritize": [], "baseline-empty-filter": []}
                for _ in range(iterations):
                    filter_s, prioritize_s = one_pod(shape, timings)
                    timings["filter"].append(filter_s)
                    timings["prioritize"].append(prioritize_s)
                results[shape_name] = timings
            cold = {shape_name: one_pod(shape, None) for shape_name, shape in cold_shapes().items()}
            return results, cold, rss_mib(server.pid), ready_s
    finally:
        server.terminate()
        server.wait(10)
        if api is not None:
            api.terminate()
            api.wait(10)
        tmp.cleanup()


def print_cold(where: str, cold: dict[str, tuple[float, float]]) -> None:
    for shape_name, (filter_s, prioritize_s) in cold.items():
        print(f"{where:10s} cold {shape_name:19s} filter {filter_s * 1e3:8.2f} ms  prioritize "
              f"{prioritize_s * 1e3:7.2f} ms  together {(filter_s + prioritize_s) * 1e3:8.2f} ms")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, nargs="+", default=[500, 1000, 5000])
    parser.add_argument("--iterations", type=int, default=200)
    parser.add_argument("--cluster", choices=sorted(CLUSTERS), nargs="+", default=["distinct"])
    parser.add_argument("--modes", choices=("snapshot", "live"), nargs="+", default=["snapshot", "live"])
    parser.add_argument("--skip-in-process", action="store_true", help="HTTP phases only")
    parser.add_argument("--policy", default=None, help="node and GPU policy (default: the extender's defaults)")
    parser.add_argument("--shuffle-nodes", action="store_true",
                        help="HTTP phases: the node names in a new order for every pod, as kube-scheduler's parallel "
                             "filter plugins hand them to the extender (default: one order, as a sequential client)")
    parser.add_argument("--learned-pods", type=int, default=1500,
                        help="pods of the openb default trace's shapes the policy observes before the phases (0: "
                             "none)")
    parser.add_argument("--serve-fake-api", nargs=2, metavar=("SNAPSHOT", "PORT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_fake_api:
        serve_fake_api(Path(args.serve_fake_api[0]), int(args.serve_fake_api[1]))
        return 0
    if args.learned_pods < 0:
        parser.error(f"--learned-pods must be 0 or more, got {args.learned_pods}")
    learned = learned_pods(args.learned_pods)
    print(f"# extender latency: {args.iterations} pods per shape; each pod filtered, prioritized, bound; "
          f"load average {os.getloadavg()[0]:.2f}; policy {args.policy or 'default'}; learned workload: "
          f"{len(learned)} pods of openb's shapes")
    for cluster_name in args.cluster:
        for nodes in args.nodes:
            started = time.perf_counter()
            items = CLUSTERS[cluster_name](nodes)
            names = [i["metadata"]["name"] for i in items if i["kind"] == "Node"]
            pods = sum(1 for i in items if i["kind"] == "Pod")
            print(f"\n## {cluster_name} cluster: {nodes} nodes x 8 GPUs, {pods} assigned pods, built in "
                  f"{time.perf_counter() - started:.1f}s")
            if not args.skip_in_process:
                in_process, cold = bench_in_process(items, names, args.iterations, args.policy, learned)
                for shape_name, timings in in_process.items():
                    base = percentile(timings["baseline-parse"], 50)
                    for verb in ("filter", "prepare", "prioritize"):
                        ratio = percentile(timings[verb], 50) / base
                        print(f"in-process {shape_name:17s} {verb:10s} {summarise(timings[verb])}  "
                              f"(p50 = {ratio:6.1f}x parsing alone)")
                print_cold("in-process", cold)
            with tempfile.TemporaryDirectory() as tmp:
                snapshot = Path(tmp) / "snapshot.json"
                snapshot.write_bytes(orjson.dumps({"apiVersion": "v1", "kind": "List", "items": items}))
                del items
                for mode in args.modes:
                    http_results, http_cold, rss, ready_s = bench_http(
                        snapshot, list(names), args.iterations, mode, args.policy, args.shuffle_nodes, learned
                    )
                    where = f"http-{mode}"
                    for shape_name, timings in http_results.items():
                        base50 = percentile(timings["baseline-empty-filter"], 50)
                        base99 = percentile(timings["baseline-empty-filter"], 99)
                        print(f"{where:13s} {shape_name:17s} {'empty-filter':10s} "
                              f"{summarise(timings['baseline-empty-filter'])}  (baseline)")
                        for verb in ("filter", "prioritize"):
                            print(f"{where:13s} {shape_name:17s} {verb:10s} {summarise(timings[verb])}  "
                                  f"(p50 = {percentile(timings[verb], 50) / base50:5.1f}x, "
                                  f"p99 = {percentile(timings[verb], 99) / base99:5.1f}x baseline)")
                    print_cold(where, http_cold)
                    held = ("holding every Node and Pod object" if mode == "snapshot"
                            else "state built by list + watch from the stand-in API server")
                    print(f"{where:13s} extender RSS after the run: {rss:.0f} MiB ({held}; ready after "
                          f"{ready_s:.0f} s); load average {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
