"""Bounded soak (issue 20): churn on the real control plane for a fixed time, with the API server's latency and
failures injected on the extender's path and the extender killed and restarted every few minutes; at the end (and
every --check-every-seconds) the ground truth is read back from the API server: every GPU's assigned memory, cores
and vGPU slots summed from the bound pods' assignment annotations against the node's inventory. Over-committed
GPUs must be 0. Not part of CI (it runs for --minutes); results go in docs/benchmarks.md.

    python bench/soak.py                                  # 30 minutes, 500 nodes x 8 GPUs
    python bench/soak.py --minutes 5 --nodes 100 --json soak.json

What runs: one dev cluster (kube_vgpu.dev.devcluster: etcd, kube-apiserver, kube-scheduler, our extender, the
simulated device plugins' heartbeat; no webhook: the pods name our scheduler themselves). The extender talks to the
API server through tests/faultproxy.py (TLS terminated with the API server's serving certificate), which in turn:
  delay       every request of the extender delayed --delay-ms for 10 s
  drop-binds  the next 5 Binding requests reset before they reach the API server
  hang-reads  the next 2 pod reads swallowed (the bind's deadline ends them)
  reset-all   every open connection reset (the watches reconnect), then normal again
one after another, one every --fault-every-seconds. Every --failover-every-seconds the extender is killed (SIGKILL)
and started again, rebuilding its state from the API server alone. Pods arrive at --create-per-second (shapes:
1 or 2 vGPUs, 2-40 GiB, 0-50% cores) and bound pods are deleted at random to hold about --target-bound of them.
"""

from __future__ import annotations

import argparse
import http.client
import random
import ssl
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import orjson
import yaml

from kube_vgpu import protocol
from kube_vgpu.dev.devcluster.cluster import ClusterOptions, DevCluster, NodeGroup, up
from kube_vgpu.dev.devcluster.workload import ensure_namespace, gpu_pod, gpu_usage, list_all
from tests.faultproxy import Fault, FaultProxy

NAMESPACE = "soak"
SHAPES_MIB = (2048, 4096, 8192, 16384, 40960)
SHAPES_CORES = (0, 10, 25, 50)


def _progress(message: str) -> None:
    print(f">> {time.strftime('%H:%M:%S')} {message}", file=sys.stderr, flush=True)


@dataclass
class Check:
    at_s: float
    bound_pods: int
    pending_pods: int
    gpus_in_use: int
    overcommitted_gpus: int
    examples: list[str] = field(default_factory=list)


@dataclass
class Report:
    minutes: float
    nodes: int
    created: int = 0
    create_errors: int = 0
    deleted: int = 0
    binds: int = 0  # pods bound (those deleted, all bound, plus those bound at the end)
    failed_binds: int = 0  # binds the extender answered with an Error (kube-scheduler retried the pod)
    failovers: int = 0
    faults: dict[str, int] = field(default_factory=dict)
    checks: list[Check] = field(default_factory=list)

    @property
    def overcommitted(self) -> int:
        return max((check.overcommitted_gpus for check in self.checks), default=0)


def _failed_binds(cluster: DevCluster) -> int:
    """kube_vgpu_extender_binds_total{outcome="failure"} of the running extender (it restarts from 0)."""
    if "extender" not in cluster.records:
        return 0
    connection = http.client.HTTPConnection("127.0.0.1", cluster.ports["extender"], timeout=10)
    try:
        connection.request("GET", "/metrics")
        text = connection.getresponse().read().decode()
    except OSError:
        return 0
    finally:
        connection.close()
    for line in text.splitlines():
        if line.startswith('kube_vgpu_extender_binds_total{outcome="failure"}'):
            return int(float(line.rsplit(" ", 1)[1]))
    return 0


def _proxied_kubeconfig(cluster: DevCluster, proxy: FaultProxy, path: Path) -> Path:
    document = yaml.safe_load(cluster.extender_kubeconfig.read_text())
    for entry in document["clusters"]:
        entry["cluster"]["server"] = proxy.url
    path.write_text(yaml.safe_dump(document))
    return path


def _check(cluster: DevCluster, started: float, seen_bound: set[str]) -> Check:
    nodes = list_all(cluster.api, "nodes")
    pods = [p for p in list_all(cluster.api, "pods") if p["metadata"].get("namespace") == NAMESPACE]
    bound = [p for p in pods if (p.get("spec") or {}).get("nodeName")]
    seen_bound.update(p["metadata"]["uid"] for p in bound)
    usage = gpu_usage(nodes, bound)
    bad = [use for use in usage.values() if use.overcommitted]
    return Check(
        at_s=round(time.monotonic() - started, 1),
        bound_pods=len(bound),
        pending_pods=len(pods) - len(bound),
        gpus_in_use=sum(1 for use in usage.values() if use.vgpus),
        overcommitted_gpus=len(bad),
        examples=[f"{u.node}/{u.uuid}: {u.used_memory_mib}/{u.memory_mib} MiB, {u.used_cores}/{u.cores} cores, "
                  f"{u.vgpus}/{u.max_vgpus} vGPUs ({', '.join(u.pods[:4])})" for u in bad[:5]],
    )


class Churn:
    """Creates pods at a steady rate and deletes bound ones at random to hold the bound count near a target."""

    def __init__(self, cluster: DevCluster, report: Report, per_second: float, target_bound: int, seed: int) -> None:
        self.cluster, self.report = cluster, report
        self.per_second, self.target_bound = per_second, target_bound
        self.random = random.Random(seed)
        self.stop = threading.Event()
        self.bound_names: list[str] = []
        self.lock = threading.Lock()
        self.counter = 0

    def run(self) -> None:
        core = self.cluster.core
        while not self.stop.is_set():
            tick = time.monotonic()
            for _ in range(max(1, round(self.per_second))):
                self.counter += 1
                pod = gpu_pod(f"soak-{self.counter:06d}", gpus=1 if self.random.random() < 0.9 else 2,
                              memory_mib=self.random.choice(SHAPES_MIB), cores=self.random.choice(SHAPES_CORES),
                              scheduler_name=protocol.DEFAULT_SCHEDULER_NAME)
                try:
                    core.create_namespaced_pod(NAMESPACE, pod, _preload_content=False)
                    self.report.created += 1
                except Exception:
                    self.report.create_errors += 1
            with self.lock:
                surplus = len(self.bound_names) - self.target_bound
                victims = self.random.sample(self.bound_names, max(0, surplus)) if surplus > 0 else []
                for name in victims:
                    self.bound_names.remove(name)
            for name in victims:
                try:
                    core.delete_namespaced_pod(name, NAMESPACE, grace_period_seconds=0, _preload_content=False)
                    self.report.deleted += 1
                except Exception:
                    pass
            self.stop.wait(max(0.0, 1.0 - (time.monotonic() - tick)))

    def refresh_bound(self) -> None:
        pods = [p for p in list_all(self.cluster.api, "pods") if p["metadata"].get("namespace") == NAMESPACE]
        names = [p["metadata"]["name"] for p in pods if (p.get("spec") or {}).get("nodeName")]
        with self.lock:
            self.bound_names = names


FAULTS = ("delay", "drop-binds", "hang-reads", "reset-all")


def _inject(proxy: FaultProxy, fault: str, delay_ms: int) -> None:
    if fault == "delay":
        proxy.set_fault(Fault.DELAY, delay_s=delay_ms / 1000)
        threading.Timer(10.0, proxy.set_fault, args=(Fault.PASS,)).start()
    elif fault == "drop-binds":
        proxy.add_rule(Fault.DROP, method="POST", path="/binding$", times=5)
    elif fault == "hang-reads":
        proxy.add_rule(Fault.HANG, method="GET", path="/namespaces/soak/pods/[^/]+$", times=2)
    elif fault == "reset-all":
        proxy.set_fault(Fault.DROP)
        proxy.set_fault(Fault.PASS)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--nodes", type=int, default=500)
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--create-per-second", type=float, default=10.0)
    parser.add_argument("--target-bound", type=int, default=3000, help="bound pods kept (older ones deleted)")
    parser.add_argument("--failover-every-seconds", type=float, default=180.0)
    parser.add_argument("--fault-every-seconds", type=float, default=30.0)
    parser.add_argument("--delay-ms", type=int, default=300)
    parser.add_argument("--check-every-seconds", type=float, default=60.0)
    parser.add_argument("--heartbeat-seconds", type=float, default=60.0)
    parser.add_argument("--seed", type=int, default=20)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)

    state_dir = Path(tempfile.mkdtemp(prefix="kube-vgpu-soak-"))
    cluster = up(ClusterOptions(
        state_dir=state_dir,
        node_groups=(NodeGroup(count=args.nodes, gpus=args.gpus_per_node, prefix="node"),),
        webhook=False,
        heartbeat_interval_s=args.heartbeat_seconds,
        die_with_parent=True,
        progress=_progress,
    ))
    report = Report(minutes=args.minutes, nodes=args.nodes)
    assert cluster.pki is not None
    server_tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_tls.load_cert_chain(cluster.pki.serving.cert, cluster.pki.serving.key)
    upstream_tls = ssl.create_default_context(cafile=str(cluster.pki.ca_cert))
    proxy = FaultProxy(("127.0.0.1", cluster.ports["kube-apiserver"]), server_tls=server_tls,
                       upstream_tls=upstream_tls)
    churn = Churn(cluster, report, args.create_per_second, args.target_bound, args.seed)
    seen_bound: set[str] = set()
    try:
        ensure_namespace(cluster.api, NAMESPACE)
        proxied = _proxied_kubeconfig(cluster, proxy, state_dir / "extender-via-proxy.kubeconfig")
        cluster.restart_extender(extra_args=(f"--kubeconfig={proxied}",))
        started = time.monotonic()
        end = started + args.minutes * 60
        next_fault = started + args.fault_every_seconds
        next_failover = started + args.failover_every_seconds
        next_check = started + args.check_every_seconds
        next_refresh = started
        fault_index = 0
        churner = threading.Thread(target=churn.run, name="churn", daemon=True)
        churner.start()
        while time.monotonic() < end:
            time.sleep(1.0)
            now = time.monotonic()
            if now >= next_refresh:
                churn.refresh_bound()
                next_refresh = now + 5.0
            if now >= next_fault:
                fault = FAULTS[fault_index % len(FAULTS)]
                fault_index += 1
                _inject(proxy, fault, args.delay_ms)
                report.faults[fault] = report.faults.get(fault, 0) + 1
                next_fault = now + args.fault_every_seconds
            if now >= next_failover:
                report.failed_binds += _failed_binds(cluster)
                _progress("failover: extender killed and started again")
                cluster.restart_extender(crash=True)
                report.failovers += 1
                next_failover = time.monotonic() + args.failover_every_seconds
            if now >= next_check:
                check = _check(cluster, started, seen_bound)
                report.checks.append(check)
                _progress(f"check: {check.bound_pods} bound, {check.pending_pods} pending, {check.gpus_in_use} GPUs "
                          f"in use, over-committed GPUs {check.overcommitted_gpus}; created {report.created}, "
                          f"deleted {report.deleted}, failovers {report.failovers}")
                next_check = now + args.check_every_seconds
        churn.stop.set()
        churner.join(30)
        proxy.set_fault(Fault.PASS)
        report.failed_binds += _failed_binds(cluster)
        report.checks.append(_check(cluster, started, seen_bound))
        # only bound pods are deleted: every bind is either still bound or was deleted
        report.binds = report.deleted + report.checks[-1].bound_pods
    finally:
        churn.stop.set()
        proxy.close()
        cluster.stop()

    final = report.checks[-1]
    print(f"soak: {report.minutes:g} min on {report.nodes} nodes x {args.gpus_per_node} GPUs")
    print(f"  pods created {report.created} (errors {report.create_errors}), deleted {report.deleted}, "
          f"bound {report.binds}")
    print(f"  binds refused by the extender (kube-scheduler retried them) {report.failed_binds}")
    print(f"  extender failovers {report.failovers}; faults injected "
          + ", ".join(f"{name} x{count}" for name, count in sorted(report.faults.items())))
    print(f"  checks {len(report.checks)}; at the end {final.bound_pods} bound, {final.pending_pods} pending, "
          f"{final.gpus_in_use} GPUs in use")
    print(f"  over-committed GPUs (max over all checks): {report.overcommitted}")
    for check in report.checks:
        for example in check.examples:
            print(f"    at {check.at_s} s: {example}")
    if args.json:
        doc = asdict(report) | {"overcommitted": report.overcommitted}
        args.json.write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2))
    return 1 if report.overcommitted else 0


if __name__ == "__main__":
    sys.exit(main())
