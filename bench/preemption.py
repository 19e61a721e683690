"""Preemption cost, in-process: N nodes x 8 A100-80GB carrying 8 running 1-GPU pods each (priority 0, ~50% of a
GPU's memory and cores: 4000 pods at 500 nodes), then high-priority pods that fit nowhere without evicting.

Measured in the same run, so ratios are what to read (the machine is noisy):
  * baseline: filter of a 1-GPU fractional pod that fits (no preemption involved);
  * deciding: the filter call that finds no node and decides a preemption (victim search on every refusing node);
  * beside nominations: filter of an ordinary pod while half the preemptors are nominated and not yet bound
    (their nodes' GPUs are held: checked on a copy);
  * arrival to bound: a preemptor's first filter, its evictions (in-process, as the snapshot evicts), its second
    filter and its bind;
  * reclaim (a second cluster of the same size): every running pod is team-a's, which borrows all of team-b's
    nominal quota in their cohort; team-b's 8-pod job arrives: time from its first pod's filter to its last bind
    (each pod reclaims one of team-a's), and a plain filter in the same cluster as the baseline.

    python bench/preemption.py                 # 500 nodes
    python bench/preemption.py --nodes 1000 --preemptors 20
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from bench.extender_latency import half_full_cluster, percentile
from kube_vgpu.dev.fixtures import scheduled_pod as make_pod
from kube_vgpu.extender.preemption.nominations import Nominations
from kube_vgpu.extender.scheduler import Scheduler
from kube_vgpu.extender.sources.snapshot import SnapshotCluster
from kube_vgpu.extender.state import ClusterState

WHOLE_GPU_MIB = 81920


def ms(samples: list[float]) -> str:
    return f"p50 {percentile(samples, 50) * 1e3:8.2f} ms  p99 {percentile(samples, 99) * 1e3:8.2f} ms"


def preemptor(index: int) -> dict[str, Any]:
    pod = make_pod(f"urgent-{index}", gpus=1, memory_mib=WHOLE_GPU_MIB, cores=100)
    pod["spec"]["priority"] = 1000
    return pod


def run(nodes: int, preemptors: int, baseline_pods: int) -> dict[str, list[float]]:
    items = half_full_cluster(nodes)
    names = [i["metadata"]["name"] for i in items if i["kind"] == "Node"]
    state = ClusterState(heartbeat_ttl_s=float("inf"))
    nominations = Nominations(clock=state.clock)  # listening before the snapshot's pods arrive
    state.pod_listeners.append(nominations.on_pod)
    cluster = SnapshotCluster(state, [dict(i) for i in items])
    scheduler = Scheduler(state, cluster, nominations=nominations)
    scheduler.enable_preemption(cluster, inline=True)  # the snapshot evicts from itself, as in snapshot mode
    timings: dict[str, list[float]] = {"baseline filter": [], "deciding filter": [], "filter beside nominations": [],
                                       "arrival to bound": []}

    def ordinary(index: int) -> dict[str, Any]:
        pod = make_pod(f"plain-{index}", gpus=1, memory_mib=2048, cores=5)
        cluster.remember_pod(pod)
        return pod

    for index in range(baseline_pods):
        pod = ordinary(index)
        started = time.perf_counter()
        scheduler.filter(pod, names)
        timings["baseline filter"].append(time.perf_counter() - started)
    for index in range(preemptors):
        pod = preemptor(index)
        cluster.add_pod(pod)
        started = time.perf_counter()
        outcome = scheduler.filter(pod, names)
        timings["deciding filter"].append(time.perf_counter() - started)
        assert not outcome.passed, "the preemptor fitted without preempting: the cluster is not full enough"
        assert pod["metadata"]["uid"] in scheduler.nominations.by_preemptor, "the preemptor found no victims"
        if index < preemptors // 2:
            continue  # the other half is bound after the ordinary pods below were filtered beside them
        outcome = scheduler.filter(pod, names)
        assert outcome.passed, outcome.failed
        meta = pod["metadata"]
        scheduler.bind(meta["namespace"], meta["name"], meta["uid"], outcome.passed[0])
        timings["arrival to bound"].append(time.perf_counter() - started)
    for index in range(baseline_pods):
        pod = ordinary(baseline_pods + index)
        started = time.perf_counter()
        scheduler.filter(pod, names)
        timings["filter beside nominations"].append(time.perf_counter() - started)
    print(f"# evicted {len(cluster.eviction_requests)} pods for {preemptors} preemptors", file=sys.stderr)
    return timings


RECLAIM_QUOTA = """
apiVersion: kueue.x-k8s.io/v1beta1
kind: ResourceFlavor
metadata: {{name: a100}}
---
apiVersion: kueue.x-k8s.io/v1beta1
kind: ClusterQueue
metadata: {{name: team-a}}
spec:
  namespaceSelector: {{}}
  cohort: ai
  resourceGroups:
  - coveredResources: [nvidia.com/gpu]
    flavors: [{{name: a100, resources: [{{name: nvidia.com/gpu, nominalQuota: {half}}}]}}]
---
apiVersion: kueue.x-k8s.io/v1beta1
kind: ClusterQueue
metadata: {{name: team-b}}
spec:
  namespaceSelector: {{}}
  cohort: ai
  preemption: {{reclaimWithinCohort: Any}}
  resourceGroups:
  - coveredResources: [nvidia.com/gpu]
    flavors: [{{name: a100, resources: [{{name: nvidia.com/gpu, nominalQuota: {half}}}]}}]
---
apiVersion: kueue.x-k8s.io/v1beta1
kind: LocalQueue
metadata: {{namespace: default, name: qa}}
spec: {{clusterQueue: team-a}}
---
apiVersion: kueue.x-k8s.io/v1beta1
kind: LocalQueue
metadata: {{namespace: default, name: qb}}
spec: {{clusterQueue: team-b}}
"""


def run_reclaim(nodes: int, job_pods: int, baseline_pods: int) -> dict[str, list[float]]:
    import yaml

    from kube_vgpu import protocol
    from kube_vgpu.extender.quota.gate import QuotaGate

    items = half_full_cluster(nodes)
    running = sum(1 for i in items if i["kind"] == "Pod")
    for item in items:  # every running pod is team-a's
        if item["kind"] == "Pod":
            item["metadata"].setdefault("labels", {})[protocol.LABEL_KUEUE_QUEUE_NAME] = "qa"
    names = [i["metadata"]["name"] for i in items if i["kind"] == "Node"]
    state = ClusterState(heartbeat_ttl_s=float("inf"))
    # team-a's nominal is half of what it runs: the other half borrows team-b's nominal, all of it
    text = RECLAIM_QUOTA.format(half=running // 2)
    # the queues budget vGPUs only while the pods name MiB and cores: Kueue's opt-out, not its BlockUndeclared
    gate = QuotaGate(state, [("bench", doc) for doc in yaml.safe_load_all(text) if doc],
                     quota_check_strategy="IgnoreUndeclared")
    nominations = Nominations(clock=state.clock)
    state.pod_listeners.append(nominations.on_pod)
    cluster = SnapshotCluster(state, [dict(i) for i in items])
    scheduler = Scheduler(state, cluster, gates=[gate], nominations=nominations)
    scheduler.enable_preemption(cluster, inline=True)  # the snapshot evicts from itself, as in snapshot mode
    timings: dict[str, list[float]] = {"baseline filter": [], "reclaiming job, arrival to all bound": []}
    for index in range(baseline_pods):
        pod = make_pod(f"plain-{index}", gpus=1, memory_mib=2048, cores=5)  # no queue: admitted uncounted
        cluster.remember_pod(pod)
        started = time.perf_counter()
        scheduler.filter(pod, names)
        timings["baseline filter"].append(time.perf_counter() - started)
    job = []
    for index in range(job_pods):
        pod = make_pod(f"b-{index}", gpus=1, memory_mib=2048, cores=5)
        pod["metadata"]["labels"][protocol.LABEL_KUEUE_QUEUE_NAME] = "qb"
        cluster.add_pod(pod)
        job.append(pod)
    started = time.perf_counter()
    for _round in range(3):  # kube-scheduler's retries: the first filter preempts, the next one binds
        for pod in job:
            meta = pod["metadata"]
            stored = cluster.get_pod(meta["namespace"], meta["name"])
            if stored is not None and stored["spec"].get("nodeName"):
                continue
            outcome = scheduler.filter(pod, names)
            if outcome.passed:
                scheduler.bind(meta["namespace"], meta["name"], meta["uid"], outcome.passed[0])
    bound = sum(1 for pod in job if (cluster.get_pod("default", pod["metadata"]["name"]) or {})
                .get("spec", {}).get("nodeName"))
    assert bound == job_pods, f"{bound} of {job_pods} reclaiming pods bound"
    timings["reclaiming job, arrival to all bound"].append(time.perf_counter() - started)
    print(f"# reclaim: evicted {len(cluster.eviction_requests)} of team-a's {running} pods for team-b's {job_pods}",
          file=sys.stderr)
    return timings


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=500)
    parser.add_argument("--preemptors", type=int, default=10)
    parser.add_argument("--baseline-pods", type=int, default=30)
    args = parser.parse_args()
    timings = run(args.nodes, args.preemptors, args.baseline_pods)
    base = percentile(timings["baseline filter"], 50)
    print(f"{args.nodes} nodes x 8 GPUs, {args.nodes * 8} running pods, {args.preemptors} preemptors")
    for name, samples in timings.items():
        print(f"  {name:28s} {ms(samples)}   p50 ratio to baseline filter {percentile(samples, 50) / base:6.1f}")
    reclaim = run_reclaim(args.nodes, 8, args.baseline_pods)
    base = percentile(reclaim["baseline filter"], 50)
    print(f"reclaim: {args.nodes} nodes, {args.nodes * 8} pods of team-a (half of them borrowed), an 8-pod job of "
          "team-b")
    for name, samples in reclaim.items():
        print(f"  {name:36s} {ms(samples)}   p50 ratio to baseline filter {percentile(samples, 50) / base:6.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
