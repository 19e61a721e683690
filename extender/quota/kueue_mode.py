"""Quota mode `kueue`: Kueue's controller admits, the extender places (docs/quota.md#quota-modes).

Kueue's controller owns admission: it suspends and resumes Jobs, reserves and charges quota, preempts. Counting the
same pods a second time with our own gate would be two admission layers disagreeing, so in this mode the gate:

* refuses a pod whose Workload Kueue has not admitted (with Kueue's own reason), a pod in a Kueue queue for which
  Kueue has no Workload yet, and everything until Kueue's Workloads were listed once;
* lets every other pod through (pods of admitted Workloads; pods Kueue does not manage: no queue label, no
  Workload); a gang's members are therefore placed only once Kueue admitted the whole Workload (Kueue admits a
  Workload whole), and then all or nothing on GPUs by the gang planner;
* reports per ClusterQueue what really landed on GPUs (vGPUs, MiB and percent of compute actually assigned, from
  the assignments) beside what Kueue charged (its status.flavorsReservation), in /quota and in metrics.

Kueue's preemption is Kueue's: the gate gives preemption no queue rules (PriorityClass rules only, for GPU shares).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from kube_vgpu import protocol
from kube_vgpu.extender.engine.model import NodeState
from kube_vgpu.extender.quota.mig import mig_profiles_by_uuid
from kube_vgpu.extender.quota.usage import GPU_RESOURCES, assignment_usage, gpu_memory_by_uuid
from kube_vgpu.extender.quota.workloads import Workload, WorkloadIndex
from kube_vgpu.extender.state import ClusterState
from kube_vgpu.kubeapi import quantity_value
from kube_vgpu.protocol import PodGpuRequest

if TYPE_CHECKING:
    from kube_vgpu.extender.gangs import GangTracker
    from kube_vgpu.extender.preemption.rules import QueueRules
    from kube_vgpu.extender.quota.live import KueueWatcher

log = logging.getLogger(__name__)

MODE = "kueue"
#: /quota's name for pods in no ClusterQueue (no queue label, or a LocalQueue that does not exist)
NO_QUEUE = ""


class KueueModeGate:
    """Implements extender.gates.Gate for quota mode kueue. Methods take or expect `state.lock`."""

    def __init__(self, state: ClusterState, *, live: bool = True) -> None:
        self.state = state
        self.index = WorkloadIndex()
        #: (namespace, LocalQueue) -> its ClusterQueue
        self.local_queues: dict[tuple[str, str], str] = {}
        #: ClusterQueue name -> the object as Kueue's controller keeps it (spec and status)
        self.cluster_queues: dict[str, Mapping[str, Any]] = {}
        self.synced = not live
        self.watcher: KueueWatcher | None = None
        self._version = 0
        self._last: tuple[object, int, str | None] | None = None  # (pod object, version, refusal): filter's cache

    # --- fed by the watcher -------------------------------------------------------------------
    def set_cluster_objects(self, kind: str, objects: Mapping[tuple[str, str], Mapping[str, Any]]) -> None:
        with self.state.lock:
            if kind == "Workload":
                self.index = WorkloadIndex(objects.values())
            elif kind == "LocalQueue":
                self.local_queues = {key: str((obj.get("spec") or {}).get("clusterQueue") or "")
                                     for key, obj in objects.items()}
            elif kind == "ClusterQueue":
                self.cluster_queues = {key[1]: obj for key, obj in objects.items()}
            self._version += 1

    def set_namespaces(self, namespaces: Mapping[str, Mapping[str, str]]) -> None:
        """Not needed in this mode (no namespaceSelectors are evaluated here)."""

    def mark_synced(self) -> None:
        with self.state.lock:
            self.synced = True
            self._version += 1

    # --- the decision -------------------------------------------------------------------------
    def refusal(self, pod: Mapping[str, Any]) -> str | None:
        """None if Kueue admitted the pod's Workload or does not manage the pod; else why it waits."""
        if not self.synced:
            return "Kueue's Workloads have not been listed from the cluster yet (quota mode kueue)"
        workload = self.index.for_pod(pod)
        metadata = pod.get("metadata") or {}
        queue = str((metadata.get("labels") or {}).get(protocol.LABEL_KUEUE_QUEUE_NAME) or "")
        if workload is None:
            if not queue:
                return None  # not Kueue's: Kueue manages only what carries a queue name (its default)
            return (f"pod is in Kueue queue {queue!r} but Kueue has no Workload for it or its owner yet: Kueue's "
                    f"controller admits it first (quota mode kueue)")
        if workload.finished:
            return f"Kueue's Workload {workload.key} has finished"
        if not workload.admitted:
            why = f": {workload.message}" if workload.message else ""
            return f"Kueue has not admitted Workload {workload.key}{why}"
        return None

    def check(self, pod: Mapping[str, Any], request: PodGpuRequest, node: NodeState) -> str | None:
        """Filter calls this per node with state.lock held: the answer depends on the pod only, so it is kept."""
        last = self._last
        if last is not None and last[0] is pod and last[1] == self._version:
            return last[2]
        result = self.refusal(pod)
        self._last = (pod, self._version, result)
        return result

    def reserve(self, pod: Mapping[str, Any], request: PodGpuRequest, node: NodeState, uid: str) -> str | None:
        with self.state.lock:
            return self.refusal(pod)

    def observe_filter(self, pod: Mapping[str, Any], request: PodGpuRequest, passed: list[str]) -> None:
        """Nothing to learn: Kueue orders its own queues."""

    def queue_rules(self) -> QueueRules | None:
        return None  # Kueue's controller preempts for quota; ours only for GPU shares, by PriorityClass

    # --- what landed, beside what Kueue charged -----------------------------------------------
    def landed(self) -> dict[str, dict[str, int]]:
        """ClusterQueue -> GPU resources actually assigned to its pods now (vGPUs, MiB, percent; GPU_RESOURCES), and
        the MIG devices per nvidia.com/mig-<profile> (as Kueue charges them: the pod's request as written)."""
        totals: dict[str, dict[str, int]] = {}
        #: node -> (GPU UUID -> MiB, MIG device UUID -> profile), once per node
        devices_of: dict[str, tuple[dict[str, int] | None, dict[str, str] | None]] = {}
        for record in self.state.pods.values():
            if not record.applied:
                continue
            if record.node_name not in devices_of:
                node = self.state.nodes.get(record.node_name)
                devices_of[record.node_name] = (gpu_memory_by_uuid(node), mig_profiles_by_uuid(node))
            usage = assignment_usage(record.assignment, *devices_of[record.node_name])
            queue = record.labels.get(protocol.LABEL_KUEUE_QUEUE_NAME, "")
            cluster_queue = self.local_queues.get((record.namespace, queue), NO_QUEUE) if queue else NO_QUEUE
            into = totals.setdefault(cluster_queue, _zero())
            for resource, value in usage.items():  # MIG resources (nvidia.com/mig-<profile>) only where held
                into[resource] = into.get(resource, 0) + value
            into["pods"] += 1
        return totals

    def charged(self, name: str) -> list[dict[str, Any]]:
        """What Kueue's controller reports a ClusterQueue holds: status.flavorsReservation (quota reserved by
        admitted and reserving Workloads), per flavor and resource."""
        status = (self.cluster_queues.get(name) or {}).get("status") or {}
        flavors = []
        for flavor in status.get("flavorsReservation") or []:
            resources = []
            for usage in flavor.get("resources") or []:
                try:
                    total = quantity_value(usage.get("total", 0))
                    borrowed = quantity_value(usage.get("borrowed", 0))
                except (ValueError, ArithmeticError):
                    continue
                resources.append({"resource": str(usage.get("name")), "total": total, "borrowed": borrowed})
            flavors.append({"flavor": str(flavor.get("name")), "resources": resources})
        return flavors

    def snapshot(self, gangs: GangTracker | None = None) -> dict[str, Any]:
        with self.state.lock:
            landed = self.landed()
            workloads: dict[str, list[Workload]] = {}
            for workload in self.index.workloads:
                workloads.setdefault(workload.cluster_queue, []).append(workload)
            names = sorted(set(self.cluster_queues) | {name for name in landed if name})
            queues = []
            for name in names:
                status = (self.cluster_queues.get(name) or {}).get("status") or {}
                mine = workloads.get(name, [])
                queues.append({
                    "name": name,
                    "landed": landed.get(name, _zero()),
                    "kueueCharged": self.charged(name),
                    "admittedWorkloads": int(status.get("admittedWorkloads") or 0),
                    "pendingWorkloads": int(status.get("pendingWorkloads") or 0),
                    "workloadsSeen": len(mine),
                })
            return {
                "mode": MODE,
                "synced": self.synced,
                "clusterQueues": queues,
                "landedOutsideQueues": landed.get(NO_QUEUE, _zero()),
                "warnings": self.warnings(),
            }

    def warnings(self) -> list[str]:
        """What makes this mode misbehave, said where operators look (/quota, quota status)."""
        if self.watcher is not None and self.synced and self.watcher.versions.get("Workload", "") is None:
            return ["quota mode kueue, but the API server serves no Kueue Workloads (Kueue's CRDs are not "
                    "installed): every pod in a Kueue queue is refused until Kueue runs (or use --quota-mode=enforce)"]
        return []

    def collector(self) -> Collector:
        return KueueModeCollector(self)

    # --- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        if self.watcher is not None:
            self.watcher.start()

    def stop(self) -> None:
        if self.watcher is not None:
            self.watcher.stop()


def _zero() -> dict[str, int]:
    return {resource: 0 for resource in (*GPU_RESOURCES, "pods")}


class KueueModeCollector(Collector):
    """Per ClusterQueue: what landed on GPUs and what Kueue charged, side by side (computed at scrape time)."""

    def __init__(self, gate: KueueModeGate) -> None:
        self.gate = gate

    def collect(self) -> Iterator[GaugeMetricFamily]:
        landed = GaugeMetricFamily(
            "kube_vgpu_queue_landed", "GPU resources actually assigned to the ClusterQueue's running pods (vGPUs, "
            "MiB, percent of a GPU; pods), quota mode kueue", labels=["cluster_queue", "resource"])
        charged = GaugeMetricFamily(
            "kube_vgpu_queue_kueue_charged", "What Kueue's controller reports the ClusterQueue reserved "
            "(status.flavorsReservation), in the resource's unit", labels=["cluster_queue", "flavor", "resource"])
        view = self.gate.snapshot()
        for queue in view["clusterQueues"]:
            for resource, value in queue["landed"].items():
                landed.add_metric([queue["name"], resource], value)
            for flavor in queue["kueueCharged"]:
                for usage in flavor["resources"]:
                    charged.add_metric([queue["name"], flavor["flavor"], usage["resource"]], usage["total"])
        for resource, value in view["landedOutsideQueues"].items():
            landed.add_metric([NO_QUEUE, resource], value)
        yield landed
        yield charged
