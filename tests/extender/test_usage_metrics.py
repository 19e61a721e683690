"""Allocation gauges per pod, node, namespace and ClusterQueue, fragmentation as the policy sees it, and the
usage-accounting counters, over real HTTP; the counters continue across an extender restart. The clock is
injected: nothing here depends on how much time passes while the test runs."""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kube_vgpu import protocol
from kube_vgpu.dev.fixtures import gpu_pod_object, synth_uuid
from kube_vgpu.extender.cli import build, parse_args
from tests.helpers import gpu_node, pod
from tests.servers import serve

EXAMPLES = Path(__file__).resolve().parents[2] / "manifests" / "examples" / "kueue"
A100 = "NVIDIA-A100-SXM4-80GB"
BOUND_AT = dt.datetime(2026, 3, 1, 9, 0, 0, tzinfo=dt.UTC)
T0 = BOUND_AT.timestamp()


def bound_pod(name: str, namespace: str, node: str, shares: list[tuple[int, int, int]], *,
              queue: str | None = None, bound_at: dt.datetime | None = BOUND_AT) -> dict[str, Any]:
    """A running pod bound by our extender: assignment, bind time and queue annotations as bind writes them.
    `shares`: (GPU index on `node`, MiB, cores) per vGPU."""
    devices = tuple(protocol.DeviceShare(synth_uuid(node, index), memory, cores) for index, memory, cores in shares)
    assignment = protocol.PodAssignment(node, (protocol.ContainerAssignment("main", devices),))
    obj = gpu_pod_object(name, namespace=namespace, gpus=len(shares), memory_mib=shares[0][1], cores=shares[0][2],
                         node_name=node, assignment=assignment)
    annotations = obj["metadata"]["annotations"]
    if bound_at is not None:
        annotations[protocol.POD_BIND_TIME_ANNOTATION] = protocol.format_bind_time(bound_at)
    if queue is not None:
        obj["metadata"]["labels"] = {protocol.LABEL_KUEUE_QUEUE_NAME: queue}
        annotations[protocol.POD_QUEUE_ANNOTATION] = queue
    return obj


def snapshot(tmp_path: Path) -> Path:
    items = [
        gpu_node("a100-0", gpus=4, memory_mib=81920),
        gpu_node("a100-1", gpus=4, memory_mib=81920),
        bound_pod("trainer", "research", "a100-0", [(0, 40960, 50), (1, 40960, 50)], queue="research-queue"),
        bound_pod("server", "inference", "a100-0", [(0, 20480, 25)], queue="inference-queue"),
        bound_pod("batch", "production", "a100-1", [(2, 81920, 100)], queue="production-queue"),
        # bound before bind times were written: allocated, not accounted
        bound_pod("legacy", "research", "a100-1", [(3, 8192, 10)], queue="research-queue", bound_at=None),
    ]
    path = tmp_path / "snapshot.json"
    path.write_bytes(orjson.dumps({"apiVersion": "v1", "kind": "List", "items": items}))
    return path


Samples = dict[str, dict[tuple[tuple[str, str], ...], float]]


def scrape(url: str) -> Samples:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return samples


def by(samples: Samples, name: str, *keys: str) -> dict[tuple[str, ...], float]:
    return {tuple(dict(labels)[key] for key in keys): value for labels, value in samples[name].items()}


def serve_extender(path: Path, clock: Callable[[], float], *extra: str) -> Any:
    args = parse_args(["--snapshot", str(path), "--quota-config", str(EXAMPLES / "quota.yaml"), *extra])
    return serve(build(args, clock=clock).app)


def test_allocation_gauges_per_pod_node_namespace_and_queue(tmp_path: Path) -> None:
    with serve_extender(snapshot(tmp_path), lambda: T0 + 100) as url:
        samples = scrape(url)
    uuid = synth_uuid
    assert by(samples, "kube_vgpu_pod_gpu_memory_allocated_mib", "namespace", "pod", "node", "gpu", "uuid",
              "cluster_queue") == {
        ("research", "trainer", "a100-0", "0", uuid("a100-0", 0), "ai-training-queue"): 40960,
        ("research", "trainer", "a100-0", "1", uuid("a100-0", 1), "ai-training-queue"): 40960,
        ("inference", "server", "a100-0", "0", uuid("a100-0", 0), "inference-queue"): 20480,
        ("production", "batch", "a100-1", "2", uuid("a100-1", 2), "ai-training-queue"): 81920,
        ("research", "legacy", "a100-1", "3", uuid("a100-1", 3), "ai-training-queue"): 8192,
    }
    assert by(samples, "kube_vgpu_pod_gpu_cores_allocated", "pod", "gpu")[("trainer", "1")] == 50
    assert set(by(samples, "kube_vgpu_pod_vgpus_allocated", "pod", "gpu").values()) == {1}
    assert by(samples, "kube_vgpu_node_gpu_memory_allocated_mib", "node") == {("a100-0",): 102400,
                                                                              ("a100-1",): 90112}
    assert by(samples, "kube_vgpu_node_vgpus_allocated", "node") == {("a100-0",): 3, ("a100-1",): 2}
    assert by(samples, "kube_vgpu_namespace_gpu_cores_allocated", "namespace") == {
        ("research",): 110, ("inference",): 25, ("production",): 100}
    assert by(samples, "kube_vgpu_namespace_gpu_pods", "namespace") == {
        ("research",): 2, ("inference",): 1, ("production",): 1}
    assert by(samples, "kube_vgpu_cluster_queue_vgpus_allocated", "cluster_queue") == {
        ("ai-training-queue",): 4, ("inference-queue",): 1}
    assert by(samples, "kube_vgpu_cluster_queue_gpu_memory_allocated_mib", "cluster_queue") == {
        ("ai-training-queue",): 40960 * 2 + 81920 + 8192, ("inference-queue",): 20480}
    # idle capacity: a100-0 has GPU 0 at 75 of 100 cores (0.25 free), GPU 1 at 50 (0.5), GPUs 2 and 3 idle
    idle = by(samples, "kube_vgpu_node_idle_gpus", "node")
    assert idle[("a100-0",)] == 0.25 + 0.5 + 2
    assert idle[("a100-1",)] == pytest.approx(2 + 0.9)  # GPUs 0 and 1 idle, GPU 2 full, GPU 3 at 10 %


def test_fragmentation_as_the_fgd_policy_sees_it(tmp_path: Path) -> None:
    with serve_extender(snapshot(tmp_path), lambda: T0, "--policy", "fgd") as url:
        before = scrape(url)
        # the policy learns the workload from the pods it sees: one vGPU of 60 % compute
        names = ["a100-0", "a100-1"]
        httpx.post(f"{url}/filter", json={"Pod": pod(gpus=1, memory_mib=8192, cores=60), "NodeNames": names},
                   timeout=10).raise_for_status()
        after = scrape(url)
    # nothing learned yet: nothing counts as fragmented
    assert by(before, "kube_vgpu_node_fragmented_gpus", "node", "policy") == {
        ("a100-0", "fgd"): 0, ("a100-1", "fgd"): 0}
    # a 60 % task fits neither a100-0's GPU 0 (25 % free) nor GPU 1 (50 % free): their 0.75 GPU is fragmented;
    # on a100-1 GPU 3 (90 % free) and GPU 0, 1 (idle) all fit it: nothing is
    assert by(after, "kube_vgpu_node_fragmented_gpus", "node", "policy") == {
        ("a100-0", "fgd"): 0.75, ("a100-1", "fgd"): 0}


def test_accounting_counters_from_bind_times_continue_across_a_restart(tmp_path: Path) -> None:
    path = snapshot(tmp_path)
    now = [T0 + 100.0]
    with serve_extender(path, lambda: now[0]) as url:
        first = scrape(url)
        now[0] = T0 + 130.0
        second = scrape(url)
    # the restarted extender (a new process's state, the same pods) reads the same bind times
    with serve_extender(path, lambda: T0 + 190.0) as url:
        restarted = scrape(url)
    keys = ("namespace", "pod", "cluster_queue")
    trainer = ("research", "trainer", "ai-training-queue")
    for samples, seconds in ((first, 100), (second, 130), (restarted, 190)):
        vgpu = by(samples, "kube_vgpu_pod_vgpu_seconds_total", *keys)
        assert vgpu == {trainer: 2 * seconds, ("inference", "server", "inference-queue"): seconds,
                        ("production", "batch", "ai-training-queue"): seconds}  # legacy: no bind time
        assert by(samples, "kube_vgpu_pod_gpu_memory_mib_seconds_total", *keys)[trainer] == 81920 * seconds
        assert by(samples, "kube_vgpu_pod_gpu_core_percent_seconds_total", *keys)[trainer] == 100 * seconds


def test_a_bind_time_ahead_of_the_clock_counts_as_just_bound(tmp_path: Path) -> None:
    with serve_extender(snapshot(tmp_path), lambda: T0 - 5) as url:
        samples = scrape(url)
    assert set(by(samples, "kube_vgpu_pod_vgpu_seconds_total", "pod").values()) == {0}


def test_names_follow_prometheus_conventions(tmp_path: Path) -> None:
    """Counters end in _total, gauges name their unit (or count things), labels are snake_case
    (https://prometheus.io/docs/practices/naming/)."""
    with serve_extender(snapshot(tmp_path), lambda: T0 + 1) as url:
        text = httpx.get(f"{url}/metrics", timeout=10).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    ours = [f for name, f in families.items() if name.startswith(("kube_vgpu_pod_", "kube_vgpu_namespace_",
                                                                   "kube_vgpu_cluster_queue_", "kube_vgpu_node_"))]
    assert len(ours) >= 18
    for family in ours:
        assert family.documentation, family.name
        if family.type == "counter":
            assert family.name.endswith("_seconds"), family.name  # the parser strips _total
            assert all(s.name.endswith(("_total", "_created")) for s in family.samples), family.name
        else:
            assert family.name.endswith(("_mib", "_allocated", "_gpus", "_pods", "_invalid")), family.name
        for sample in family.samples:
            assert all(re.fullmatch(r"[a-z_][a-z0-9_]*", label) for label in sample.labels), sample


def test_per_gpu_gauges(tmp_path: Path) -> None:
    with serve_extender(snapshot(tmp_path), lambda: T0) as url:
        samples = scrape(url)
    labels = ("node", "gpu", "uuid", "model")
    gpu0 = ("a100-0", "0", synth_uuid("a100-0", 0), A100)
    assert by(samples, "kube_vgpu_gpu_memory_allocated_mib", *labels)[gpu0] == 40960 + 20480
    assert by(samples, "kube_vgpu_gpu_cores_allocated", *labels)[gpu0] == 75
    assert by(samples, "kube_vgpu_gpu_vgpus_allocated", *labels)[gpu0] == 2
    assert set(by(samples, "kube_vgpu_gpu_memory_mib", *labels).values()) == {81920}
    assert len(by(samples, "kube_vgpu_gpu_healthy", *labels)) == 8
    assert set(by(samples, "kube_vgpu_gpu_healthy", *labels).values()) == {1}
    assert samples["kube_vgpu_nodes"] == {(): 2} and samples["kube_vgpu_assigned_pods"] == {(): 4}
