"""A real ClusterState + Scheduler + QuotaGate over the in-memory snapshot API (the extender's snapshot mode)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import yaml

from kube_vgpu import protocol
from kube_vgpu.extender.quota.accounting import CQ
from kube_vgpu.extender.quota.gate import QuotaGate
from kube_vgpu.extender.quota.usage import IGNORE_UNDECLARED
from kube_vgpu.extender.scheduler import FilterOutcome, Scheduler
from kube_vgpu.extender.sources.snapshot import SnapshotCluster
from kube_vgpu.extender.state import ClusterState
from tests.helpers import gpu_node, pod

A100 = "NVIDIA-A100-SXM4-80GB"
V100 = "Tesla-V100-SXM2-32GB"
GPU, GPUMEM, GPUCORES = protocol.RESOURCE_GPU, protocol.RESOURCE_GPU_MEMORY, protocol.RESOURCE_GPU_CORES


def a100_node(name: str, gpus: int = 4) -> dict[str, Any]:
    return gpu_node(name, gpus=gpus, model=A100, memory_mib=81920)


def v100_node(name: str, gpus: int = 8) -> dict[str, Any]:
    return gpu_node(name, gpus=gpus, model=V100, memory_mib=32768, topology="pcie")


FLAVORS = f"""
apiVersion: kueue.x-k8s.io/v1beta1
kind: ResourceFlavor
metadata: {{name: a100}}
spec: {{nodeLabels: {{nvidia.com/gpu.product: {A100}}}}}
---
apiVersion: kueue.x-k8s.io/v1beta1
kind: ResourceFlavor
metadata: {{name: v100}}
spec: {{nodeLabels: {{nvidia.com/gpu.product: {V100}}}}}
"""


def local_queue(namespace: str, name: str, cluster_queue: str) -> str:
    return f"""
---
apiVersion: kueue.x-k8s.io/v1beta1
kind: LocalQueue
metadata: {{namespace: {namespace}, name: {name}}}
spec: {{clusterQueue: {cluster_queue}}}
"""


def gpu_queue(name: str, flavors: dict[str, int], *, cohort: str | None = None, extra: str = "",
              selector: str = "{}", borrowing: dict[str, int] | None = None) -> str:
    """A v1beta1 ClusterQueue covering nvidia.com/gpu only: flavor -> nominal vGPUs."""
    lines = [f"""
---
apiVersion: kueue.x-k8s.io/v1beta1
kind: ClusterQueue
metadata: {{name: {name}}}
spec:
  namespaceSelector: {selector}
{extra}"""]
    if cohort:
        lines.append(f"  cohort: {cohort}\n")
    lines.append("  resourceGroups:\n  - coveredResources: [nvidia.com/gpu]\n    flavors:\n")
    for flavor, nominal in flavors.items():
        limit = f", borrowingLimit: {borrowing[flavor]}" if borrowing and flavor in borrowing else ""
        quota = f"{{name: nvidia.com/gpu, nominalQuota: {nominal}{limit}}}"
        lines.append(f"    - {{name: {flavor}, resources: [{quota}]}}\n")
    return "".join(lines)


def queued_pod(queue: str | None, namespace: str = "team-a", *, created: str | None = None,
               priority: int | None = None, priority_class: str | None = None, **kwargs: Any) -> dict[str, Any]:
    labels = dict(kwargs.pop("labels", {}) or {})
    if queue is not None:
        labels[protocol.LABEL_KUEUE_QUEUE_NAME] = queue
    if priority_class is not None:
        labels[protocol.LABEL_KUEUE_PRIORITY_CLASS] = priority_class
    p = pod(namespace=namespace, labels=labels, **kwargs)
    if created is not None:
        p["metadata"]["creationTimestamp"] = created
    if priority is not None:
        p["spec"]["priority"] = priority
    return p


@dataclass
class Env:
    state: ClusterState
    cluster: SnapshotCluster
    scheduler: Scheduler
    gate: QuotaGate
    node_names: list[str]

    def filter(self, p: dict[str, Any]) -> FilterOutcome:
        return self.scheduler.filter(p, self.node_names)

    def submit(self, p: dict[str, Any]) -> str | FilterOutcome:
        """Create the pod, filter it on every node and bind it to the first that passes (what kube-scheduler
        does with one extender); the node, or the filter outcome when none passes."""
        self.cluster.add_pod(p)
        return self.retry(p)

    def retry(self, p: dict[str, Any]) -> str | FilterOutcome:
        outcome = self.filter(p)
        if not outcome.passed:
            return outcome
        meta = p["metadata"]
        self.scheduler.bind(meta["namespace"], meta["name"], meta["uid"], outcome.passed[0])
        return outcome.passed[0]

    def delete(self, p: dict[str, Any]) -> None:
        self.cluster.delete_pod(p["metadata"]["namespace"], p["metadata"]["name"])

    def used(self, cluster_queue: str, flavor: str, resource: str = GPU) -> int:
        return self.gate.tree.node_usage((CQ, cluster_queue), (flavor, resource))


def make_env(quota_yaml: str, nodes: list[dict[str, Any]], *, unqueued: str = "admit",
             cluster_cls: type[SnapshotCluster] = SnapshotCluster, pods: list[dict[str, Any]] | None = None,
             fair_sharing: bool = False, quota_check_strategy: str = IGNORE_UNDECLARED) -> Env:
    """`quota_check_strategy`: IgnoreUndeclared by default here: these tests budget vGPUs only (gpu_queue) while
    their pods name nvidia.com/gpumem, which Kueue's default BlockUndeclared refuses (the gate's default;
    tests/quota/test_kueue_compat.py tests it)."""
    state = ClusterState()
    documents = [("test.yaml", doc) for doc in yaml.safe_load_all(quota_yaml) if doc]
    # first: it learns the pods as the state receives them
    gate = QuotaGate(state, documents, unqueued=unqueued, fair_sharing=fair_sharing,
                     quota_check_strategy=quota_check_strategy)
    cluster = cluster_cls(state, [*nodes, *(pods or [])])
    scheduler = Scheduler(state, cluster, gates=[gate])
    return Env(state, cluster, scheduler, gate, [n["metadata"]["name"] for n in nodes])
