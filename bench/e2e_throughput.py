"""End-to-end scheduling throughput through the real control plane: 1000 single-fractional-GPU pods created at
once, timed until every one is bound, on 500 and on 1000 nodes, (a) with our extender and (b) with the same
kube-scheduler configuration minus its extenders block (nvidia.com/gpu as a plain extended resource), in one run.

    python bench/e2e_throughput.py                        # 500 and 1000 nodes x 8 GPUs, 1000 pods
    python bench/e2e_throughput.py --nodes 500 --pods 1000 --repeat 3 --json out.json

One dev cluster serves every trial (kube_vgpu.dev.devcluster): nodes are added between node counts; before each trial
kube-scheduler is restarted with or without the extender, so each starts from a synced, idle scheduler. The pods
are created by --creators threads over kept-open HTTPS connections (pre-serialised bodies), and a watch records
when each pod gets its nodeName. Reported per trial:
  pods/s      pods / (last bind - first create request): what a user submitting a burst experiences
  create s    how long creating the burst took (when it is close to the total, creation is the bottleneck)
  cpu s       CPU seconds each component spent during the trial (2 shared cores: where the time went)
(a) pods: nvidia.com/gpu 1, nvidia.com/gpumem 4096 (--gpumem-mib), nvidia.com/gpucores 10; (b) pods:
nvidia.com/gpu 1 only (no node advertises gpumem/gpucores, so without the extender those would never fit). No
webhook in either (the pods name the scheduler themselves): the comparison is the scheduler with and without the
extender.
Reference (published): a trivial Go HTTP extender on localhost ~111 pods/s at 500 nodes vs ~991 bare.
"""

from __future__ import annotations

import argparse
import http.client
import os
import signal
import ssl
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import yaml

from kube_vgpu import protocol
from kube_vgpu.dev.devcluster.cluster import ClusterOptions, DevCluster, NodeGroup, up
from kube_vgpu.dev.devcluster.processes import ProcessRecord
from kube_vgpu.dev.devcluster.workload import delete_pods, ensure_namespace, gpu_pod, wait_until_gone

ROOT = Path(__file__).resolve().parent.parent

NAMESPACE = "bench"
REFERENCE = {"go_extender_pods_per_s": 111.0, "bare_pods_per_s": 991.0, "nodes": 500}
TARGET_PODS_PER_S = 150.0
GANG_SIZE = 8
#: modes whose kube-scheduler calls our extender
WITH_EXTENDER = ("extender", "gang")
TRIAL_TIMEOUT_S = 600.0
CLK_TCK = os.sysconf("SC_CLK_TCK")


def _progress(message: str) -> None:
    print(f">> {message}", file=sys.stderr, flush=True)


@dataclass
class Trial:
    nodes: int
    mode: str  # "extender", "gang" (the same pods in 8-pod gangs, with the extender) or "bare"
    pods: int
    pods_per_s: float
    create_s: float
    total_s: float
    cpu_s: dict[str, float] = field(default_factory=dict)
    #: the extender's mean time per verb during the trial (its own histogram), milliseconds
    verb_ms: dict[str, float] = field(default_factory=dict)
    #: binds the extender refused during the trial (kube-scheduler retried those pods)
    failed_binds: int = 0


# --- raw HTTPS to the API server --------------------------------------------------------------------------------


class ApiConnection:
    """One kept-open TLS connection with the admin's client cert, read from the dev cluster's kubeconfig."""

    def __init__(self, cluster: DevCluster) -> None:
        assert cluster.pki is not None
        context = ssl.create_default_context(cafile=str(cluster.pki.ca_cert))
        context.load_cert_chain(str(cluster.pki.admin.cert), str(cluster.pki.admin.key))
        self.connection = http.client.HTTPSConnection("127.0.0.1", cluster.ports["kube-apiserver"], context=context,
                                                      timeout=60)

    def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        self.connection.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        response = self.connection.getresponse()
        return response.status, response.read()

    def stream(self, path: str) -> Iterator[dict[str, Any]]:
        self.connection.request("GET", path)
        response = self.connection.getresponse()
        if response.status != 200:
            raise RuntimeError(f"watch {path}: HTTP {response.status} {response.read()[:300]!r}")
        buffer = b""
        while True:
            chunk = response.read1(65536)
            if not chunk:
                return
            buffer += chunk
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                if line.strip():
                    yield orjson.loads(line)

    def close(self) -> None:
        self.connection.close()


def _bodies(mode: str, count: int, run_id: str, memory_mib: int = 4096) -> list[bytes]:
    bodies = []
    for index in range(count):
        if mode in WITH_EXTENDER:
            pod = gpu_pod(f"{run_id}-{index:05d}", memory_mib=memory_mib, cores=10,
                          scheduler_name=protocol.DEFAULT_SCHEDULER_NAME)
            if mode == "gang":  # consecutive pods form gangs of GANG_SIZE (the last one smaller if need be)
                first = index - index % GANG_SIZE
                pod["metadata"]["labels"] = {protocol.LABEL_KUEUE_POD_GROUP_NAME: f"{run_id}-g{first // GANG_SIZE}"}
                pod["metadata"]["annotations"] = {
                    protocol.ANNOTATION_KUEUE_POD_GROUP_TOTAL_COUNT: str(min(GANG_SIZE, count - first))}
        else:
            pod = gpu_pod(f"{run_id}-{index:05d}", scheduler_name=protocol.DEFAULT_SCHEDULER_NAME)
        pod["metadata"].setdefault("labels", {})["bench-run"] = run_id
        bodies.append(orjson.dumps(pod))
    return bodies


@dataclass
class ExtenderCounters:
    """Read from the extender's /metrics: verb -> (sum of seconds, count) of kube_vgpu_extender_request_seconds,
    and the binds it refused (kube_vgpu_extender_binds_total{outcome="failure"})."""

    verbs: dict[str, tuple[float, float]] = field(default_factory=dict)
    failed_binds: float = 0.0


def _extender_counters(cluster: DevCluster) -> ExtenderCounters:
    counters = ExtenderCounters()
    if "extender" not in cluster.records:
        return counters
    connection = http.client.HTTPConnection("127.0.0.1", cluster.ports["extender"], timeout=10)
    try:
        connection.request("GET", "/metrics")
        text = connection.getresponse().read().decode()
    finally:
        connection.close()
    totals: dict[str, list[float]] = {}
    for line in text.splitlines():
        if line.startswith('kube_vgpu_extender_binds_total{outcome="failure"}'):
            counters.failed_binds = float(line.rsplit(" ", 1)[1])
        for suffix, position in (("_sum", 0), ("_count", 1)):
            prefix = f"kube_vgpu_extender_request_seconds{suffix}{{verb=\""
            if line.startswith(prefix):
                verb = line[len(prefix) :].split('"', 1)[0]
                totals.setdefault(verb, [0.0, 0.0])[position] = float(line.rsplit(" ", 1)[1])
    counters.verbs = {verb: (values[0], values[1]) for verb, values in totals.items()}
    return counters


def _cpu_ticks(record: ProcessRecord) -> int:
    try:
        text = Path(f"/proc/{record.pid}/stat").read_text()
    except OSError:
        return 0
    fields = text[text.rindex(")") + 2 :].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


def _cpu_snapshot(cluster: DevCluster) -> dict[str, tuple[int, int]]:
    """component -> (pid, CPU ticks so far)."""
    snapshot = {name: (record.pid, _cpu_ticks(record)) for name, record in cluster.records.items()}
    times = os.times()
    snapshot["bench client"] = (os.getpid(), int((times.user + times.system) * CLK_TCK))
    return snapshot


def _start_profiler(cluster: DevCluster, profile_dir: Path | None, label: str) -> subprocess.Popen[bytes] | None:
    """py-spy on the extender during the trial (collapsed stacks: one line per stack, sample count last). Only the
    thread holding the GIL is sampled, so the profile says where the extender's CPU goes, not where it waits."""
    if profile_dir is None or "extender" not in cluster.records:
        return None
    profile_dir.mkdir(parents=True, exist_ok=True)
    py_spy = Path(sys.executable).parent / "py-spy"
    command = [str(py_spy), "record", "--pid", str(cluster.records["extender"].pid), "--rate", "250", "--format",
               "raw", "--output", str(profile_dir / f"{label}.txt"), "--threads", "--gil", "--nonblocking"]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(1.0)  # py-spy attaches before the burst
    return process


def _stop_profiler(process: subprocess.Popen[bytes] | None) -> None:
    if process is not None:
        process.send_signal(signal.SIGINT)
        process.wait(30)


class BindWatch:
    """A watch of a trial's pods (label bench-run=<run_id> in `namespace`) recording when each got its nodeName,
    until `total` did. The API server drops a watcher that falls behind (a burst, and this thread shares the GIL with
    the creators): it resumes from the last resourceVersion seen, so no event is missed."""

    def __init__(self, cluster: DevCluster, namespace: str, run_id: str, total: int, timeout_s: float) -> None:
        self.cluster, self.namespace, self.run_id, self.total, self.timeout_s = (
            cluster, namespace, run_id, total, timeout_s)
        self.bound_at: dict[str, float] = {}
        self.done = threading.Event()
        self.watching = threading.Event()
        self.errors: list[BaseException] = []
        self.thread = threading.Thread(target=self._run, name="watch", daemon=True)

    def start(self) -> None:
        self.thread.start()
        self.watching.wait(30)
        time.sleep(0.2)  # the request is sent before stream() yields: give the server a moment to register it

    def _run(self) -> None:
        resource_version = ""
        deadline_s = time.monotonic() + self.timeout_s + 60
        try:
            while time.monotonic() < deadline_s and not self.done.is_set():
                connection = ApiConnection(self.cluster)
                try:
                    path = (f"/api/v1/namespaces/{self.namespace}/pods?watch=true&labelSelector=bench-run%3D"
                            f"{self.run_id}&timeoutSeconds={int(self.timeout_s) + 60}&allowWatchBookmarks=true")
                    if resource_version:
                        path += f"&resourceVersion={resource_version}"
                    events = connection.stream(path)
                    self.watching.set()
                    for event in events:
                        resource_version = self._seen(event) or resource_version
                        if self.done.is_set():
                            return
                finally:
                    connection.close()
        except BaseException as exc:  # reported by the main thread
            self.errors.append(exc)
            self.watching.set()

    def _seen(self, event: dict[str, Any]) -> str:
        obj = event.get("object") or {}
        if event.get("type") == "ERROR":
            raise RuntimeError(f"watch error: {obj.get('message')}")
        metadata = obj.get("metadata") or {}
        name = metadata.get("name")
        if name and (obj.get("spec") or {}).get("nodeName") and name not in self.bound_at:
            self.bound_at[name] = time.monotonic()
            if len(self.bound_at) == self.total:
                self.done.set()
        return str(metadata.get("resourceVersion") or "")


def post_concurrently(cluster: DevCluster, path: str, bodies: list[bytes], creators: int) -> list[str]:
    """POST every body to `path` from `creators` threads, each over one kept-open connection; returns the failures
    (one line each)."""
    next_index = iter(range(len(bodies)))
    lock = threading.Lock()
    failures: list[str] = []

    def create() -> None:
        connection = ApiConnection(cluster)
        try:
            while True:
                with lock:
                    index = next(next_index, None)
                if index is None:
                    return
                status, body = connection.post(path, bodies[index])
                if status != 201:
                    failures.append(f"HTTP {status}: {body[:200]!r}")
        finally:
            connection.close()

    threads = [threading.Thread(target=create, name=f"create-{i}") for i in range(creators)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return failures


def run_trial(
    cluster: DevCluster,
    nodes: int,
    mode: str,
    pods: int,
    creators: int,
    run_id: str,
    profile_dir: Path | None = None,
    timeout_s: float = TRIAL_TIMEOUT_S,
    precreate: bool = False,
    memory_mib: int = 4096,
) -> Trial:
    """One burst. With `precreate`, the pods are created while kube-scheduler is stopped and the rate is measured
    from its start to the last bind: scheduling alone, without the creation ramp."""
    bodies = _bodies(mode, pods, run_id, memory_mib)
    watch = BindWatch(cluster, NAMESPACE, run_id, pods, timeout_s)
    watch.start()

    profiler = (_start_profiler(cluster, profile_dir, f"extender-{nodes}-nodes-{run_id}") if mode in WITH_EXTENDER
                else None)
    cpu_before = _cpu_snapshot(cluster)
    before = _extender_counters(cluster) if mode in WITH_EXTENDER else ExtenderCounters()
    if precreate:
        cluster.stop_component("kube-scheduler")
    start_s = time.monotonic()
    failures = post_concurrently(cluster, f"/api/v1/namespaces/{NAMESPACE}/pods", bodies, creators)
    created_s = time.monotonic()
    if failures:
        raise RuntimeError(f"{len(failures)} pod creations failed, e.g. {failures[0]}")
    if precreate:
        create_took_s = created_s - start_s
        start_s = time.monotonic()
        cluster.start_scheduler(with_extender=(mode in WITH_EXTENDER))
        created_s = start_s + create_took_s  # reported as the creation time
    if not watch.done.wait(timeout_s):
        raise RuntimeError(
            f"{mode} at {nodes} nodes: only {len(watch.bound_at)} of {pods} pods bound after {timeout_s:g} s"
            f"{'; watch failed: ' + repr(watch.errors[0]) if watch.errors else ''}\n"
            f"kube-scheduler log:\n{cluster.log_tail('kube-scheduler')}\nextender log:\n{cluster.log_tail('extender')}"
        )
    cpu_after = _cpu_snapshot(cluster)
    after = _extender_counters(cluster) if mode in WITH_EXTENDER else ExtenderCounters()
    _stop_profiler(profiler)
    last_s = max(watch.bound_at.values())
    total_s = last_s - start_s
    cpu = {}
    for name, (pid, ticks) in cpu_after.items():
        before_pid, before_ticks = cpu_before.get(name, (pid, 0))
        # a process started during the trial (kube-scheduler with --precreate) counts from zero
        cpu[name] = (ticks - (before_ticks if before_pid == pid else 0)) / CLK_TCK
    verb_ms = {}
    for verb, (seconds, count) in after.verbs.items():
        before_seconds, before_count = before.verbs.get(verb, (0.0, 0.0))
        if count > before_count:
            verb_ms[verb] = 1000 * (seconds - before_seconds) / (count - before_count)
    return Trial(nodes, mode, pods, pods / total_s, created_s - start_s, total_s, cpu, verb_ms,
                 int(after.failed_binds - before.failed_binds))


def _reset(cluster: DevCluster) -> None:
    delete_pods(cluster.api, NAMESPACE)
    if not wait_until_gone(cluster.api, NAMESPACE, timeout_s=120):
        raise RuntimeError("the previous trial's pods were not deleted within 120 s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, nargs="+", default=[500, 1000])
    parser.add_argument("--pods", type=int, default=1000)
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=1, help="trials per (nodes, mode); the median is reported")
    parser.add_argument("--gpumem-mib", type=int, default=4096,
                        help="nvidia.com/gpumem of the extender trial's pods (default %(default)s; 30000 puts two on "
                             "an 80 GB GPU, far fewer than kube-scheduler's own slot count allows)")
    parser.add_argument("--creators", type=int, default=16, help="concurrent pod-creating connections")
    parser.add_argument("--modes", nargs="+", choices=("extender", "gang", "bare"), default=["extender", "bare"],
                        help="gang: the extender trial's pods in gangs of 8 (Kueue pod groups)")
    parser.add_argument("--heartbeat-seconds", type=float, default=60.0,
                        help="node heartbeat interval (spread over the interval; default %(default)s)")
    parser.add_argument("--trial-timeout-seconds", type=float, default=TRIAL_TIMEOUT_S)
    parser.add_argument("--precreate", action="store_true",
                        help="create the pods while kube-scheduler is stopped, then time from its start: scheduling "
                             "throughput without the creation ramp (creation caps the bare scheduler on small "
                             "machines)")
    parser.add_argument("--state-dir", type=Path, default=None)
    parser.add_argument("--keep", action="store_true", help="leave the cluster running afterwards")
    parser.add_argument("--json", type=Path, help="also write the trials as JSON")
    parser.add_argument("--profile", type=Path, metavar="DIR",
                        help="record the extender with py-spy during its trials (pip install py-spy)")
    args = parser.parse_args(argv)

    state_dir = args.state_dir or Path(tempfile.mkdtemp(prefix="kube-vgpu-bench-"))
    options = ClusterOptions(
        state_dir=state_dir,
        node_groups=(),
        webhook=False,
        heartbeat_interval_s=args.heartbeat_seconds,
        die_with_parent=not args.keep,
        progress=_progress,
    )
    cluster = up(options)
    trials: list[Trial] = []
    try:
        ensure_namespace(cluster.api, NAMESPACE)
        config = yaml.safe_load(cluster.scheduler_config_path.read_text())
        connection = config.get("clientConnection", {})
        _progress(f"kube-scheduler client qps {connection.get('qps')} burst {connection.get('burst')}")
        registered = 0
        run_number = 0
        for nodes in sorted(args.nodes):
            if nodes > registered:
                cluster.add_nodes(NodeGroup(count=nodes - registered, gpus=args.gpus_per_node, first_index=registered,
                                            prefix="node"))
                registered = nodes
            for _ in range(args.repeat):
                for mode in args.modes:
                    run_number += 1
                    if not args.precreate:  # with --precreate the trial starts kube-scheduler itself
                        cluster.restart_scheduler(with_extender=(mode in WITH_EXTENDER))
                    load = os.getloadavg()[0]
                    trial = run_trial(cluster, nodes, mode, args.pods, args.creators, f"r{run_number}",
                                      args.profile, args.trial_timeout_seconds, args.precreate, args.gpumem_mib)
                    trials.append(trial)
                    cpu = ", ".join(f"{name} {seconds:.1f}" for name, seconds in sorted(trial.cpu_s.items())
                                    if seconds >= 0.05)
                    verbs = ", ".join(f"{verb} {ms:.1f}" for verb, ms in sorted(trial.verb_ms.items()))
                    _progress(f"{nodes} nodes, {mode}: {trial.pods_per_s:.0f} pods/s ({trial.pods} pods in "
                              f"{trial.total_s:.2f} s, created in {trial.create_s:.2f} s; load before {load:.1f}; "
                              f"cpu s: {cpu}" + (f"; extender mean ms: {verbs}" if verbs else "")
                              + (f"; failed binds: {trial.failed_binds}" if mode in WITH_EXTENDER else "") + ")")
                    _reset(cluster)
    finally:
        if args.keep:
            _progress(f"cluster kept: export KUBECONFIG={cluster.kubeconfig}")
        else:
            cluster.stop()

    print()
    print(f"| nodes x {args.gpus_per_node} GPUs | pods | with extender (pods/s) | bare kube-scheduler (pods/s) | "
          "bare / extender |")
    print("|---|---|---|---|---|")
    for nodes in sorted(args.nodes):
        rates = {
            mode: statistics.median(t.pods_per_s for t in trials if t.nodes == nodes and t.mode == mode)
            for mode in args.modes
            if any(t.nodes == nodes and t.mode == mode for t in trials)
        }
        ext, bare = rates.get("extender"), rates.get("bare")
        ratio = f"{bare / ext:.1f}x" if ext and bare else "-"
        print(f"| {nodes} | {args.pods} | {ext or 0:.0f} | {bare or 0:.0f} | {ratio} |")
    if "gang" in args.modes:
        print(f"\n| nodes | pods | gangs of {GANG_SIZE} (pods/s) | same pods without gangs (pods/s) | gang / plain |")
        print("|---|---|---|---|---|")
        for nodes in sorted(args.nodes):
            by_mode = {mode: [t.pods_per_s for t in trials if t.nodes == nodes and t.mode == mode]
                       for mode in ("gang", "extender")}
            gang_rate = statistics.median(by_mode["gang"]) if by_mode["gang"] else 0.0
            plain = statistics.median(by_mode["extender"]) if by_mode["extender"] else 0.0
            share = f"{gang_rate / plain:.2f}" if plain else "-"
            print(f"| {nodes} | {args.pods} | {gang_rate:.0f} | {plain:.0f} | {share} |")
    print(f"\nreference (published, 500 nodes): trivial Go extender ~{REFERENCE['go_extender_pods_per_s']:.0f} pods/s, "
          f"bare ~{REFERENCE['bare_pods_per_s']:.0f} pods/s (9x); target with our extender at 500 nodes: "
          f">= {TARGET_PODS_PER_S:.0f} pods/s")
    if args.json:
        args.json.write_bytes(orjson.dumps([t.__dict__ for t in trials], option=orjson.OPT_INDENT_2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
