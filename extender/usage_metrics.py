"""Allocation gauges per pod, node, namespace and ClusterQueue, and usage-accounting counters per pod, computed at
scrape time from the state (no cost per bind, nothing accumulated in memory).

Accounting: each bound pod's counters are its allocation times the seconds since its bind-time annotation (written
by our bind, carried by the Binding), read at scrape time:

    kube_vgpu_pod_vgpu_seconds_total            = vGPUs        x (now - bind time)
    kube_vgpu_pod_gpu_memory_mib_seconds_total  = MiB          x (now - bind time)
    kube_vgpu_pod_gpu_core_percent_seconds_total = cores (%)   x (now - bind time)   (100 %-seconds = 1 GPU-second)

A counter is per pod, not per namespace or queue, on purpose: a pod's value depends only on its annotations, so
an extender restart (or the other replica taking over) continues every series where it was, and a pod that ends
ends its series. A per-namespace sum would drop whenever a pod ended, and after a restart would count the running
pods' whole past again. Per team over a period: `sum by (namespace) (increase(kube_vgpu_pod_vgpu_seconds_total[
30d]))` (`kube-vgpu usage` runs this). Allocation is the peak over the moments a pod's containers run at once
(init containers, sidecars), the same figure quota counts.

Cardinality: the per-pod series exist for pods holding GPUs (one per pod and GPU for the gauges, one per pod for
the counters), and go away with the pod; per namespace, per ClusterQueue and per node there is one series each.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kube_vgpu.extender.engine.policies._milli import frag_cpu_free_milli, free_milli_list
from kube_vgpu.extender.engine.policies.fgd import FragPolicyBase
from kube_vgpu.extender.engine.shares import MILLI_PER_GPU

if TYPE_CHECKING:
    from kube_vgpu.extender.preemption.rules import QueueRules
    from kube_vgpu.extender.scheduler import Scheduler
    from kube_vgpu.extender.state import PodRecord

POD_GPU_LABELS = ["namespace", "pod", "pod_uid", "node", "gpu", "uuid", "cluster_queue"]
POD_LABELS = ["namespace", "pod", "cluster_queue"]

#: (field suffix, help) of the allocation gauges repeated per node, namespace and ClusterQueue
_ALLOCATED = (
    ("gpu_memory_allocated_mib", "GPU memory assigned to pods (MiB)"),
    ("gpu_cores_allocated", "GPU compute assigned to pods (percent of one GPU; 100 = a whole GPU)"),
    ("vgpus_allocated", "vGPUs assigned to pods"),
)


def _totals(record: PodRecord) -> tuple[int, int, int]:
    memory = cores = vgpus = 0
    for usage in record.usage:
        memory += usage.memory_mib
        cores += usage.cores
        vgpus += usage.vgpus
    return memory, cores, vgpus


class UsageCollector(Collector):
    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler

    def _queue_rules(self) -> QueueRules | None:
        for gate in self.scheduler.gates:
            rules = gate.queue_rules()
            if rules is not None:
                return rules
        return None

    def collect(self) -> Iterator[Metric]:
        state = self.scheduler.state
        rules = self._queue_rules()
        pod_gpu = {suffix: GaugeMetricFamily(f"kube_vgpu_pod_{suffix}", f"{text}, per pod and GPU",
                                             labels=POD_GPU_LABELS) for suffix, text in _ALLOCATED}
        scopes = {scope: {suffix: GaugeMetricFamily(f"kube_vgpu_{scope}_{suffix}", f"{text}, per {scope}",
                                                    labels=[scope]) for suffix, text in _ALLOCATED}
                  for scope in ("node", "namespace", "cluster_queue")}
        pods_per = {scope: GaugeMetricFamily(f"kube_vgpu_{scope}_gpu_pods", f"pods holding GPUs, per {scope}",
                                             labels=[scope]) for scope in ("namespace", "cluster_queue")}
        vgpu_seconds = CounterMetricFamily("kube_vgpu_pod_vgpu_seconds",
                                           "vGPUs held times seconds since the pod was bound", labels=POD_LABELS)
        memory_seconds = CounterMetricFamily("kube_vgpu_pod_gpu_memory_mib_seconds",
                                             "GPU memory held (MiB) times seconds since the pod was bound",
                                             labels=POD_LABELS)
        core_seconds = CounterMetricFamily("kube_vgpu_pod_gpu_core_percent_seconds",
                                           "GPU compute held (percent of a GPU) times seconds since the pod was bound",
                                           labels=POD_LABELS)
        fragmented = GaugeMetricFamily("kube_vgpu_node_fragmented_gpus",
                                       "idle GPU capacity the placement policy counts as fragmented (GPUs; fgd and "
                                       "bfgd only: the FGD measure over the workload learned so far)",
                                       labels=["node", "policy"])
        idle = GaugeMetricFamily("kube_vgpu_node_idle_gpus",
                                 "idle GPU capacity (GPUs: each GPU's free share of memory, compute and vGPU slots)",
                                 labels=["node"])
        totals: dict[str, dict[str, list[int]]] = {"node": {}, "namespace": {}, "cluster_queue": {}}
        policy = self.scheduler.default_node_policy
        with state.lock:
            now = state.clock()
            for record in state.pods.values():
                node = state.nodes.get(record.node_name)
                if not record.applied or node is None:
                    continue  # not counted on a node (its node is not known yet)
                queue = (rules.queue_of(record.uid, record.namespace, record.labels) if rules else None) or ""
                for usage in record.usage:
                    gpu = node.gpus[usage.position]
                    values = [record.namespace, record.name, record.uid, node.name, str(gpu.index), gpu.uuid, queue]
                    pod_gpu["gpu_memory_allocated_mib"].add_metric(values, usage.memory_mib)
                    pod_gpu["gpu_cores_allocated"].add_metric(values, usage.cores)
                    pod_gpu["vgpus_allocated"].add_metric(values, usage.vgpus)
                memory, cores, vgpus = _totals(record)
                for scope, key in (("node", node.name), ("namespace", record.namespace), ("cluster_queue", queue)):
                    total = totals[scope].setdefault(key, [0, 0, 0, 0])
                    total[0] += memory
                    total[1] += cores
                    total[2] += vgpus
                    total[3] += 1
                if record.confirmed and record.bound_at_s is not None:
                    # a bind time ahead of this clock (skew between replicas) counts as just bound
                    held_s = max(0.0, now - record.bound_at_s)
                    labels = [record.namespace, record.name, queue]
                    vgpu_seconds.add_metric(labels, vgpus * held_s)
                    memory_seconds.add_metric(labels, memory * held_s)
                    core_seconds.add_metric(labels, cores * held_s)
            for node in state.nodes.values():
                if not node.gpus:
                    continue
                free = free_milli_list(node)
                idle.add_metric([node.name], sum(free) / MILLI_PER_GPU)
                if isinstance(policy, FragPolicyBase):
                    cpu_free, cpu_known = frag_cpu_free_milli(node)
                    value = policy.measure(node, cpu_free, cpu_known, free)
                    fragmented.add_metric([node.name, policy.name], value / MILLI_PER_GPU)
        for scope, by_key in totals.items():
            for key, (memory, cores, vgpus, pods) in sorted(by_key.items()):
                scopes[scope]["gpu_memory_allocated_mib"].add_metric([key], memory)
                scopes[scope]["gpu_cores_allocated"].add_metric([key], cores)
                scopes[scope]["vgpus_allocated"].add_metric([key], vgpus)
                if scope in pods_per:
                    pods_per[scope].add_metric([key], pods)
        yield from pod_gpu.values()
        for families in scopes.values():
            yield from families.values()
        yield from pods_per.values()
        yield from (vgpu_seconds, memory_seconds, core_seconds, fragmented, idle)
