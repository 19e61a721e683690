"""Who uses what (Kueue's cache side): what a pod asks for and holds, in the units a ClusterQueue counts, and the
per-pod records the gate keeps (a counted charge; a pod waiting in its queue)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kube_vgpu import kubeapi, protocol
from kube_vgpu.extender.engine.dynmig import smallest_profile
from kube_vgpu.extender.engine.fit import gpu_eligible
from kube_vgpu.extender.engine.model import NodeState
from kube_vgpu.extender.quota.accounting import FlavorResource
from kube_vgpu.extender.quota.objects import TOTAL_GPU_CORES, TOTAL_GPU_MEMORY, Toleration, parse_tolerations
from kube_vgpu.protocol import ContainerGpuRequest, PodAssignment, PodGpuRequest

log = logging.getLogger(__name__)

#: the GPU resources a ClusterQueue may budget, in the order usage tuples list them (_moment)
GPU_RESOURCES = (protocol.RESOURCE_GPU, protocol.RESOURCE_GPU_MEMORY, protocol.RESOURCE_GPU_CORES,
                 TOTAL_GPU_MEMORY, TOTAL_GPU_CORES)


def _moment(vgpus: int, memory_mib: int, cores: int, charged_cores: int) -> tuple[int, int, int, int, int]:
    """One moment's usage in GPU_RESOURCES order. nvidia.com/gpumem and gpucores are already counted summed over
    the vGPUs (MiB and percent), which is exactly what the total-* outputs of Kueue's transformation are; only
    total-gpucores differs: a whole-GPU vGPU (no gpumem, no gpucores) is charged 100, as HAMi >= 2.7 with Kueue
    charges it (its webhook writes gpucores 100 on such pods), where nvidia.com/gpucores counts what was asked."""
    return (vgpus, memory_mib, cores, memory_mib, charged_cores)


def _max_into(totals: dict[str, int], values: tuple[int, ...]) -> None:
    """Per resource, the largest moment (Kueue's pod-request rule: the peak of init containers vs app containers)."""
    for resource, value in zip(GPU_RESOURCES, values, strict=True):
        totals[resource] = max(totals[resource], value)


@dataclass(frozen=True, slots=True)
class PodInfo:
    """What the gate needs from a pod object beyond the state's PodRecord."""

    spec_priority: int
    priority_class: str | None  # kueue.x-k8s.io/priority-class label
    created_s: float
    tolerations: tuple[Toleration, ...]
    cpu_milli: int
    memory_bytes: int


def _host_requests(pod: Mapping[str, Any]) -> tuple[int, int]:
    """The pod's CPU (millicores) and memory (bytes) as Kueue and kube-scheduler count them (native sidecars with
    the app containers, init containers at their peak, overhead; kube_vgpu.kubeapi). A quantity the API server
    would never have stored counts 0 rather than failing the pod's events."""
    try:
        requests = kubeapi.pod_requests(pod, (kubeapi.RESOURCE_CPU, kubeapi.RESOURCE_MEMORY))
    except kubeapi.InvalidQuantity as exc:
        metadata = pod.get("metadata") or {}
        log.warning("pod %s/%s: unreadable CPU or memory request (%s); charged 0", metadata.get("namespace"),
                    metadata.get("name"), exc)
        return 0, 0
    return requests.get(kubeapi.RESOURCE_CPU, 0), requests.get(kubeapi.RESOURCE_MEMORY, 0)


def pod_info(pod: Mapping[str, Any], now_s: float) -> PodInfo:
    metadata = pod.get("metadata") or {}
    spec = pod.get("spec") or {}
    labels = metadata.get("labels") or {}
    priority = spec.get("priority")
    try:
        tolerations = parse_tolerations(spec.get("tolerations"), "spec.tolerations")
    except ValueError:
        tolerations = ()
    cpu_milli, memory_bytes = _host_requests(pod)
    return PodInfo(
        spec_priority=priority if isinstance(priority, int) and not isinstance(priority, bool) else 0,
        priority_class=labels.get(protocol.LABEL_KUEUE_PRIORITY_CLASS) or None,
        created_s=kubeapi.timestamp_seconds(metadata.get("creationTimestamp"), now_s),
        tolerations=tolerations,
        cpu_milli=cpu_milli,
        memory_bytes=memory_bytes,
    )


def gpu_memory_by_uuid(node: NodeState | None) -> dict[str, int] | None:
    """A node's GPU UUID -> MiB, what assignment_usage needs to tell a whole-GPU vGPU; None for a node not known."""
    return {gpu.uuid: gpu.memory_mib for gpu in node.gpus} if node is not None else None


def assignment_usage(assignment: PodAssignment, gpu_memory_mib: Mapping[str, int] | None = None) -> dict[str, int]:
    """vGPUs, MiB and cores % a written assignment holds at its peak: the largest, per resource, of the moments
    that hold devices at once (protocol.container_phases: each init container beside the sidecars started before
    it, then the app containers beside every sidecar), as Kueue's pod-request rule counts them.
    `gpu_memory_mib`: uuid -> the GPU's MiB (the node's inventory), to tell a whole-GPU vGPU (all the memory, no
    cores asked) for total-gpucores; a GPU not in it counts its assigned cores."""
    sizes = gpu_memory_mib or {}
    totals = {r: 0 for r in GPU_RESOURCES}
    for phase in assignment.phases:
        devices = [d for c in phase for d in c.devices]
        charged = sum(protocol.CORES_PER_GPU if d.cores == 0 and d.memory_mib >= sizes.get(d.uuid, d.memory_mib + 1)
                      else d.cores for d in devices)
        _max_into(totals, _moment(len(devices), sum(d.memory_mib for d in devices), sum(d.cores for d in devices),
                                  charged))
    return totals


def _whole_gpu(container: ContainerGpuRequest) -> bool:
    """A vGPU asked with neither memory nor compute: HAMi gives it the whole GPU."""
    return container.memory_mib is None and container.memory_percent in (None, 100) and container.cores == 0


def request_usage_fixed(request: PodGpuRequest) -> dict[str, int] | None:
    """What the pod will hold on any node, when that does not depend on the node's GPUs (every container names
    its MiB per vGPU); None otherwise. Cores: what the engine assigns on a GPU of 100 compute units (for
    exclusive use it assigns the GPU's units, never more than the 100 requested)."""
    if any(c.memory_mib is None for c in request.containers):
        return None
    totals = {r: 0 for r in GPU_RESOURCES}
    for phase in request.phases:
        cores = sum(c.count * c.cores for c in phase)
        _max_into(totals, _moment(sum(c.count for c in phase), sum(c.count * (c.memory_mib or 0) for c in phase),
                                  cores, cores))  # memory named: never a whole-GPU vGPU
    return totals


def request_usage_on(request: PodGpuRequest, node: NodeState) -> dict[str, int]:
    """What the pod will hold if placed on `node`, before the GPUs are chosen. Exact when the node's eligible GPUs
    are alike (the usual case); otherwise an upper bound (the largest eligible GPU), so the assignment that is
    then counted never exceeds what was checked."""
    eligible = [g for g in node.gpus if g.schedulable and gpu_eligible(g, request.selectors, ())]
    totals = {r: 0 for r in GPU_RESOURCES}
    for phase in request.phases:
        count = memory_mib = cores = charged_cores = 0
        for container in phase:
            if container.mig:
                # a MIG device counts as one GPU with its memory and its whole compute, as its assignment will
                if container.mig_memory_mib is not None:  # vgpu-mode mig: the largest profile a node's model picks
                    per_memory = max((p.memory_mib for g in node.gpus if g.dynamic_mig is not None
                                      if (p := smallest_profile(g.dynamic_mig, container.mig_memory_mib))),
                                     default=container.mig_memory_mib)
                else:
                    per_memory = max((d.memory_mib for d in (*node.mig_devices, *node.dynamic_mig_devices)
                                      if d.mig_profile == container.mig_profile), default=0)
                count += container.count
                memory_mib += container.count * per_memory
                cores += container.count * protocol.CORES_PER_GPU
                charged_cores += container.count * protocol.CORES_PER_GPU
                continue
            per_memory = container.memory_mib if container.memory_mib is not None else max(
                (container.memory_on(g.memory_mib) for g in eligible), default=0)
            per_cores = max((g.cores if container.cores >= g.cores else container.cores for g in eligible),
                            default=container.cores)
            count += container.count
            memory_mib += container.count * per_memory
            cores += container.count * per_cores
            charged_cores += container.count * (protocol.CORES_PER_GPU if _whole_gpu(container) else per_cores)
        _max_into(totals, _moment(count, memory_mib, cores, charged_cores))
    return totals


#: Kueue's Configuration resources.quotaCheckStrategy: BlockUndeclared (its default) admits nothing of a resource
#: the workload requests and its ClusterQueue does not cover; IgnoreUndeclared checks covered resources only.
BLOCK_UNDECLARED = "BlockUndeclared"
IGNORE_UNDECLARED = "IgnoreUndeclared"
QUOTA_CHECK_STRATEGIES = (BLOCK_UNDECLARED, IGNORE_UNDECLARED)

#: a GPU resource a pod names -> the resources a ClusterQueue may budget it with: the resource itself, or the
#: output of the HAMi guide's transformation (Replace removes the input from Kueue's accounting). The gate counts
#: a gpumem-percentage in MiB, so a queue budgeting MiB declares it too.
DECLARED_BY = {
    protocol.RESOURCE_GPU: (protocol.RESOURCE_GPU,),
    protocol.RESOURCE_GPU_MEMORY: (protocol.RESOURCE_GPU_MEMORY, TOTAL_GPU_MEMORY),
    protocol.RESOURCE_GPU_MEMORY_PERCENTAGE: (protocol.RESOURCE_GPU_MEMORY_PERCENTAGE, protocol.RESOURCE_GPU_MEMORY,
                                              TOTAL_GPU_MEMORY),
    protocol.RESOURCE_GPU_CORES: (protocol.RESOURCE_GPU_CORES, TOTAL_GPU_CORES),
}


def named_gpu_resources(request: PodGpuRequest) -> list[str]:
    """The GPU resources the pod's containers name (what Kueue reads from the pod spec), in DECLARED_BY order."""
    containers = [c for c in request.containers if c.count > 0]
    shares = [c for c in containers if not c.mig]  # a MIG container names its device as one GPU only
    named = {
        protocol.RESOURCE_GPU: bool(containers),
        # vgpu-mode: mig containers name gpumem too (it sizes their instance); their cores are the profile's
        protocol.RESOURCE_GPU_MEMORY: any(c.memory_mib is not None for c in containers if c.mig_profile is None),
        protocol.RESOURCE_GPU_MEMORY_PERCENTAGE: any(c.memory_percent is not None for c in shares),
        protocol.RESOURCE_GPU_CORES: any(c.cores > 0 for c in shares),
    }
    return [resource for resource in DECLARED_BY if named[resource]]


def undeclared_gpu_resources(request: PodGpuRequest, covered: frozenset[str]) -> list[str]:
    """BlockUndeclared: the GPU resources the pod names that no resource group of its queue covers in any form.
    Only the GPU resources are checked: the gate does not see every resource a pod requests (CPU and memory
    are counted when covered, as with IgnoreUndeclared; docs/quota.md)."""
    return [r for r in named_gpu_resources(request) if not any(form in covered for form in DECLARED_BY[r])]


@dataclass(slots=True)
class Charge:
    """One pod's counted usage. Kept per pod, with priority, so a preemptor can pick victims later."""

    uid: str
    namespace: str
    name: str
    cluster_queue: str
    node_name: str
    resources: dict[str, int]  # what the pod holds, per resource (only resources the queue covers)
    amounts: dict[FlavorResource, int] = field(default_factory=dict)  # what is counted in the tree
    priority: int = 0
    created_s: float = 0.0
    counted: bool = False
    problem: str = ""  # why it is not counted (node unknown yet, node outside the queue's flavors)


@dataclass(slots=True)
class PendingPod:
    """A pod of a ClusterQueue seen by filter and not admitted yet."""

    uid: str
    namespace: str
    name: str
    cluster_queue: str
    priority: int
    created_s: float
    last_seen_s: float
    waiting_for_quota: bool = False
    reason: str = ""
    #: (flavor, resource) -> what it asked of its queue where quota refused it (fair sharing's admission order)
    needs: Mapping[FlavorResource, int] | None = None

    @property
    def order(self) -> tuple[int, float, str, str]:
        """Kueue's queue order: higher priority first, then older, then name (a total order: no ties)."""
        return (-self.priority, self.created_s, self.namespace, self.name)
