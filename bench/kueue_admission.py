"""Admission throughput under the real Kueue controller (quota mode kueue): Jobs created at once, timed from the first
create request until every pod of every Job is bound, (a) with kube-vgpu's extender placing the pods Kueue admitted
and (b) Kueue alone with the same kube-scheduler minus its extenders block (nvidia.com/gpu as a plain extended
resource), in one run on one dev cluster.

    python bench/kueue_admission.py                          # 500 nodes x 8 GPUs, 100 Jobs x 4 pods, 2 repeats
    python bench/kueue_admission.py --nodes 500 --jobs 100 --pods-per-job 4 --repeat 3 --json out.json

The dev cluster runs Kueue v0.19.2 (built from its module the first time), kube-controller-manager (the Job
controller creates the pods once Kueue resumes a Job) and KWOK; no webhook (the pod templates name the scheduler).
Kueue: one ClusterQueue of Kueue's HAMi guide with room for every Job (the comparison is the placement layer, not
quota). Reported per trial: Jobs/s and pods/s (count / (last bind - first create)), the time creating the Jobs took,
and the CPU seconds each component spent (2 shared cores: where the time went).
(a) pods: nvidia.com/gpu 1, nvidia.com/gpumem 4096, nvidia.com/gpucores 10; (b) pods: nvidia.com/gpu 1 only.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import orjson
from kubernetes import client
from kubernetes.client.rest import ApiException

from bench.e2e_throughput import CLK_TCK, BindWatch, _cpu_snapshot, post_concurrently
from kube_vgpu import protocol
from kube_vgpu.dev.devcluster.cluster import ClusterOptions, DevCluster, NodeGroup, up
from kube_vgpu.dev.devcluster.workload import PAUSE_IMAGE, delete_pods, ensure_namespace, wait_until_gone

NAMESPACE = "bench"
GROUP, VERSION = protocol.KUEUE_API_GROUP, "v1beta2"
TRIAL_TIMEOUT_S = 900.0
MODES = ("kueue+extender", "kueue+bare")


def _progress(message: str) -> None:
    print(f">> {message}", file=sys.stderr, flush=True)


@dataclass
class Trial:
    mode: str
    jobs: int
    pods: int
    jobs_per_s: float
    pods_per_s: float
    create_s: float
    total_s: float
    cpu_s: dict[str, float] = field(default_factory=dict)


def _queues(cluster: DevCluster, gpus: int) -> None:
    custom: Any = client.CustomObjectsApi(cluster.api)
    objects = [
        ("resourceflavors", {"apiVersion": f"{GROUP}/{VERSION}", "kind": "ResourceFlavor",
                             "metadata": {"name": "gpus"}}),
        ("clusterqueues", {"apiVersion": f"{GROUP}/{VERSION}", "kind": "ClusterQueue", "metadata": {"name": "bench"},
                           "spec": {"namespaceSelector": {}, "resourceGroups": [{
                               "coveredResources": [protocol.RESOURCE_GPU, "nvidia.com/total-gpumem",
                                                    "nvidia.com/total-gpucores"],
                               "flavors": [{"name": "gpus", "resources": [
                                   {"name": protocol.RESOURCE_GPU, "nominalQuota": gpus},
                                   {"name": "nvidia.com/total-gpumem", "nominalQuota": gpus * 81920},
                                   {"name": "nvidia.com/total-gpucores", "nominalQuota": gpus * 100}]}]}]}}),
    ]
    for plural, obj in objects:
        custom.create_cluster_custom_object(GROUP, VERSION, plural, obj)
    local = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "LocalQueue", "metadata": {"name": "team"},
             "spec": {"clusterQueue": "bench"}}
    custom.create_namespaced_custom_object(GROUP, VERSION, NAMESPACE, "localqueues", local)


def _job_bodies(mode: str, jobs: int, pods_per_job: int, run_id: str) -> list[bytes]:
    limits = ({protocol.RESOURCE_GPU: "1", protocol.RESOURCE_GPU_MEMORY: "4096", protocol.RESOURCE_GPU_CORES: "10"}
              if mode == "kueue+extender" else {protocol.RESOURCE_GPU: "1"})
    bodies = []
    for index in range(jobs):
        job = {
            "apiVersion": "batch/v1", "kind": "Job",
            "metadata": {"name": f"{run_id}-{index:04d}", "labels": {protocol.LABEL_KUEUE_QUEUE_NAME: "team"}},
            "spec": {"parallelism": pods_per_job, "completions": pods_per_job, "template": {
                "metadata": {"labels": {"bench-run": run_id}},
                "spec": {"schedulerName": protocol.DEFAULT_SCHEDULER_NAME, "restartPolicy": "Never",
                         "terminationGracePeriodSeconds": 0,
                         "containers": [{"name": "main", "image": PAUSE_IMAGE, "resources": {"limits": limits}}]}}},
        }
        bodies.append(orjson.dumps(job))
    return bodies


def run_trial(cluster: DevCluster, mode: str, jobs: int, pods_per_job: int, creators: int, run_id: str) -> Trial:
    total_pods = jobs * pods_per_job
    watch = BindWatch(cluster, NAMESPACE, run_id, total_pods, TRIAL_TIMEOUT_S)
    watch.start()
    bodies = _job_bodies(mode, jobs, pods_per_job, run_id)
    cpu_before = _cpu_snapshot(cluster)
    start_s = time.monotonic()
    failures = post_concurrently(cluster, f"/apis/batch/v1/namespaces/{NAMESPACE}/jobs", bodies, creators)
    created_s = time.monotonic()
    if failures:
        raise RuntimeError(f"{len(failures)} Job creations failed, e.g. {failures[0]}")
    if not watch.done.wait(TRIAL_TIMEOUT_S):
        raise RuntimeError(f"{mode}: only {len(watch.bound_at)} of {total_pods} pods bound after {TRIAL_TIMEOUT_S:g} s"
                           f"{'; watch failed: ' + repr(watch.errors[0]) if watch.errors else ''}\nkueue log:\n"
                           f"{cluster.log_tail('kueue')}\nextender log:\n{cluster.log_tail('extender')}")
    cpu_after = _cpu_snapshot(cluster)
    total_s = max(watch.bound_at.values()) - start_s
    cpu = {name: (ticks - cpu_before.get(name, (pid, 0))[1]) / CLK_TCK for name, (pid, ticks) in cpu_after.items()}
    return Trial(mode, jobs, total_pods, jobs / total_s, total_pods / total_s, created_s - start_s, total_s, cpu)


def _reset(cluster: DevCluster) -> None:
    batch: Any = client.BatchV1Api(cluster.api)
    try:
        batch.delete_collection_namespaced_job(NAMESPACE, propagation_policy="Background", _preload_content=False)
    except ApiException as exc:
        raise RuntimeError(f"deleting the trial's Jobs failed: HTTP {exc.status}") from None
    delete_pods(cluster.api, NAMESPACE)
    if not wait_until_gone(cluster.api, NAMESPACE, timeout_s=180):
        raise RuntimeError("the previous trial's pods were not deleted within 180 s")
    custom: Any = client.CustomObjectsApi(cluster.api)
    deadline = time.monotonic() + 180
    while orjson.loads(custom.list_namespaced_custom_object(GROUP, VERSION, NAMESPACE, "workloads",
                                                            _preload_content=False).data).get("items"):
        if time.monotonic() > deadline:
            raise RuntimeError("the previous trial's Workloads were not deleted within 180 s")
        time.sleep(0.5)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=500)
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--jobs", type=int, default=100)
    parser.add_argument("--pods-per-job", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--creators", type=int, default=4, help="threads creating Jobs")
    parser.add_argument("--json", type=Path, help="write the trials here")
    args = parser.parse_args(argv)
    if args.jobs * args.pods_per_job > args.nodes * args.gpus_per_node:
        parser.error("more pods than GPUs: every pod must fit")
    state_dir = Path(tempfile.mkdtemp(prefix="kube-vgpu-bench-kueue-"))
    options = ClusterOptions(state_dir=state_dir, webhook=False, lifecycle=True, kueue=True,
                             node_groups=(NodeGroup(count=args.nodes, gpus=args.gpus_per_node),),
                             die_with_parent=True, progress=_progress, heartbeat_interval_s=30.0)
    trials: list[Trial] = []
    with up(options) as cluster:
        ensure_namespace(cluster.api, NAMESPACE)
        _queues(cluster, args.nodes * args.gpus_per_node)
        for repeat in range(args.repeat):
            for mode in MODES:  # alternated, so drift on a noisy machine hits both
                if cluster.is_running("kube-scheduler"):
                    cluster.stop_component("kube-scheduler")
                cluster.start_scheduler(with_extender=mode == "kueue+extender")
                run_id = f"r{repeat}-{'ext' if mode == 'kueue+extender' else 'bare'}"
                _progress(f"trial {run_id}: {args.jobs} Jobs x {args.pods_per_job} pods, {mode}")
                trial = run_trial(cluster, mode, args.jobs, args.pods_per_job, args.creators, run_id)
                trials.append(trial)
                _progress(f"  {trial.jobs_per_s:.1f} Jobs/s ({trial.pods_per_s:.0f} pods/s) in {trial.total_s:.1f} s")
                _reset(cluster)
    print(f"\n{args.nodes} nodes x {args.gpus_per_node} GPUs, {args.jobs} Jobs x {args.pods_per_job} pods per trial, "
          f"Kueue v0.19.2 admitting; median of {args.repeat}")
    print(f"{'mode':<16} {'Jobs/s':>8} {'pods/s':>8} {'create s':>9} {'total s':>8}  CPU s (kueue / kube-scheduler / "
          "extender / kube-apiserver)")
    medians: dict[str, float] = {}
    for mode in MODES:
        mine = [t for t in trials if t.mode == mode]
        medians[mode] = statistics.median(t.jobs_per_s for t in mine)
        cpu = {name: statistics.median(t.cpu_s.get(name, 0.0) for t in mine)
               for name in ("kueue", "kube-scheduler", "extender", "kube-apiserver")}
        print(f"{mode:<16} {medians[mode]:>8.1f} {statistics.median(t.pods_per_s for t in mine):>8.0f} "
              f"{statistics.median(t.create_s for t in mine):>9.1f} {statistics.median(t.total_s for t in mine):>8.1f}"
              f"  {' / '.join(f'{value:.1f}' for value in cpu.values())}")
    print(f"ratio kueue+extender / kueue+bare: {medians['kueue+extender'] / medians['kueue+bare']:.2f}")
    if args.json:
        args.json.write_text(orjson.dumps([asdict(t) for t in trials], option=orjson.OPT_INDENT_2).decode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
