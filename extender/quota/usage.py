"""Who uses what (Kueue's cache side): what a pod asks for and holds, in the units a ClusterQueue counts, and the
per-pod records the gate keeps (a counted charge; a pod waiting in its queue)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kube_vgpu import kubeapi, protocol
from kube_vgpu.extender.engine.dynmig import profile_for_memory
from kube_vgpu.extender.engine.fit import gpu_eligible
from kube_vgpu.extender.engine.model import FitFailure, NodeState
from kube_vgpu.extender.quota import mig
from kube_vgpu.extender.quota.accounting import FlavorResource
from kube_vgpu.extender.quota.objects import TOTAL_GPU_CORES, TOTAL_GPU_MEMORY, Toleration, parse_tolerations
from kube_vgpu.protocol import ContainerGpuRequest, PodAssignment, PodGpuRequest

log = logging.getLogger(__name__)

#: the vGPU resources a ClusterQueue may budget, in the order usage tuples list them (_moment); a pod's usage
#: also names each nvidia.com/mig-<profile> it holds (quota/mig.py), only when it holds one
GPU_RESOURCES = (protocol.RESOURCE_GPU, protocol.RESOURCE_GPU_MEMORY, protocol.RESOURCE_GPU_CORES,
                 TOTAL_GPU_MEMORY, TOTAL_GPU_CORES)


def _moment(vgpus: int, memory_mib: int, cores: int, charged_cores: int) -> tuple[int, int, int, int, int]:
    """One moment's usage in GPU_RESOURCES order. nvidia.com/gpumem and gpucores are already counted summed over
    the vGPUs (MiB and percent), which is exactly what the total-* outputs of Kueue's transformation are; only
    total-gpucores differs: a whole-GPU vGPU (no gpumem, no gpucores) is charged 100, as HAMi >= 2.7 with Kueue
    charges it (its webhook writes gpucores 100 on such pods), where nvidia.com/gpucores counts what was asked."""
    return (vgpus, memory_mib, cores, memory_mib, charged_cores)


def _max_into(totals: dict[str, int], values: tuple[int, ...], mig_devices: Mapping[str, int]) -> None:
    """Per resource, the largest moment (Kueue's pod-request rule: the peak of init containers vs app containers).
    `mig_devices`: the moment's MIG devices per MIG resource (quota/mig.py), added to the totals when held."""
    for resource, value in zip(GPU_RESOURCES, values, strict=True):
        totals[resource] = max(totals[resource], value)
    for resource, count in mig_devices.items():
        totals[resource] = max(totals.get(resource, 0), count)


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


def assignment_usage(assignment: PodAssignment, gpu_memory_mib: Mapping[str, int] | None = None,
                     mig_profiles: Mapping[str, str] | None = None) -> dict[str, int]:
    """vGPUs, MiB and cores % a written assignment holds at its peak: the largest, per resource, of the moments
    that hold devices at once (protocol.container_phases: each init container beside the sidecars started before
    it, then the app containers beside every sidecar), as Kueue's pod-request rule counts them.
    `gpu_memory_mib`: uuid -> the GPU's MiB (the node's inventory), to tell a whole-GPU vGPU (all the memory, no
    cores asked) for total-gpucores; a GPU not in it counts its assigned cores.
    `mig_profiles`: uuid -> profile of the node's MIG devices (quota/mig.py): a MIG device counts one of its
    nvidia.com/mig-<profile> and its memory, no vGPU and no cores. Without it (node not known) a MIG device, told
    by its UUID, counts its memory only."""
    sizes = gpu_memory_mib or {}
    profiles = mig_profiles or {}
    totals = {r: 0 for r in GPU_RESOURCES}
    for phase in assignment.phases:
        devices = []
        memory_mib = 0
        mig_devices: dict[str, int] = {}
        for device in (d for c in phase for d in c.devices):
            memory_mib += device.memory_mib
            dynamic = protocol.parse_dynamic_mig_device(device.uuid)
            profile = profiles.get(device.uuid) or (dynamic.profile if dynamic is not None else None)
            if profile is not None:
                resource = mig.mig_resource(profile)
                mig_devices[resource] = mig_devices.get(resource, 0) + 1
            elif not device.uuid.startswith(mig.MIG_UUID_PREFIX):
                devices.append(device)
        charged = sum(protocol.CORES_PER_GPU if d.cores == 0 and d.memory_mib >= sizes.get(d.uuid, d.memory_mib + 1)
                      else d.cores for d in devices)
        _max_into(totals, _moment(len(devices), memory_mib, sum(d.cores for d in devices), charged), mig_devices)
    return totals


def _whole_gpu(container: ContainerGpuRequest) -> bool:
    """A vGPU asked with neither memory nor compute: HAMi gives it the whole GPU."""
    return container.memory_mib is None and container.memory_percent in (None, 100) and container.cores == 0


def request_usage_fixed(request: PodGpuRequest) -> dict[str, int] | None:
    """What the pod will hold on any node, when that does not depend on the node's GPUs (every container names
    its MiB per vGPU); None otherwise (a MIG device's MiB is the node's). Cores: what the engine assigns on a GPU
    of 100 compute units (for exclusive use it assigns the GPU's units, never more than the 100 requested)."""
    if any(c.memory_mib is None or c.mig for c in request.containers):  # vgpu-mode mig: the node picks the profile
        return None
    totals = {r: 0 for r in GPU_RESOURCES}
    for phase in request.phases:
        cores = sum(c.count * c.cores for c in phase)
        _max_into(totals, _moment(sum(c.count for c in phase), sum(c.count * (c.memory_mib or 0) for c in phase),
                                  cores, cores), {})  # memory named: never a whole-GPU vGPU
    return totals


def request_usage_on(request: PodGpuRequest, node: NodeState) -> dict[str, int]:
    """What the pod will hold if placed on `node`, before the GPUs are chosen. Exact when the node's eligible GPUs
    are alike (the usual case); otherwise an upper bound (the largest eligible GPU), so the assignment that is
    then counted never exceeds what was checked."""
    eligible = [g for g in node.gpus if g.schedulable and gpu_eligible(g, request.selectors, ())]
    totals = {r: 0 for r in GPU_RESOURCES}
    for phase in request.phases:
        count = memory_mib = cores = charged_cores = 0
        mig_devices: dict[str, int] = {}
        for container in phase:
            if container.mig:
                # its MIG resource as written (vgpu-mode mig: the profile this node gives it), and its memory: no
                # vGPU, no cores (quota/mig.py says why)
                profile = container.mig_profile
                if profile is None:
                    picked = profile_for_memory(node, container.mig_memory_mib or 0)
                    if isinstance(picked, FitFailure):  # the node cannot place it: charge what it asks
                        memory_mib += container.count * (container.mig_memory_mib or 0)
                        continue
                    profile = picked
                resource = mig.mig_resource(profile)
                mig_devices[resource] = mig_devices.get(resource, 0) + container.count
                memory_mib += container.count * mig.profile_memory_mib(profile, node)
                continue
            per_memory = container.memory_mib if container.memory_mib is not None else max(
                (container.memory_on(g.memory_mib) for g in eligible), default=0)
            per_cores = max((g.cores if container.cores >= g.cores else container.cores for g in eligible),
                            default=container.cores)
            count += container.count
            memory_mib += container.count * per_memory
            cores += container.count * per_cores
            charged_cores += container.count * (protocol.CORES_PER_GPU if _whole_gpu(container) else per_cores)
        _max_into(totals, _moment(count, memory_mib, cores, charged_cores), mig_devices)
    return totals


def request_counts(request: PodGpuRequest) -> dict[str, int]:
    """The device counts a pod asks, which no node changes: its peak of vGPUs (nvidia.com/gpu) and of each MIG
    resource; what a view shows of a pod whose MiB and cores depend on the node."""
    totals: dict[str, int] = {protocol.RESOURCE_GPU: 0}
    for phase in request.phases:
        moment: dict[str, int] = {}
        for container in phase:
            resource = protocol.RESOURCE_GPU if container.mig_profile is None else mig.mig_resource(
                container.mig_profile)
            moment[resource] = moment.get(resource, 0) + container.count
        for resource, count in moment.items():
            totals[resource] = max(totals.get(resource, 0), count)
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


def declared_by(resource: str) -> tuple[str, ...]:
    """The resources a ClusterQueue may cover `resource` with (DECLARED_BY); a MIG resource only itself: the
    gate also charges a MIG device's memory, but as Kueue would with a Retain transformation, which still needs
    the MIG resource covered (so the same ClusterQueue admits the same pods in quota modes enforce and kueue)."""
    return DECLARED_BY.get(resource, (resource,))


def named_gpu_resources(request: PodGpuRequest) -> list[str]:
    """The GPU resources the pod's containers name (what Kueue reads from the pod spec), in DECLARED_BY order,
    then the MIG resources sorted."""
    containers = [c for c in request.containers if c.count > 0]
    shares = [c for c in containers if not c.mig]  # a MIG container names its MIG resource only
    named = {
        # vgpu-mode: mig containers write nvidia.com/gpu and gpumem (which sizes their instance), as Kueue reads them
        protocol.RESOURCE_GPU: any(c.mig_profile is None for c in containers),
        protocol.RESOURCE_GPU_MEMORY: any(c.memory_mib is not None for c in containers if c.mig_profile is None),
        protocol.RESOURCE_GPU_MEMORY_PERCENTAGE: any(c.memory_percent is not None for c in shares),
        protocol.RESOURCE_GPU_CORES: any(c.cores > 0 for c in shares),
    }
    migs = sorted({mig.mig_resource(c.mig_profile) for c in containers if c.mig_profile is not None})
    return [resource for resource in DECLARED_BY if named[resource]] + migs


def undeclared_gpu_resources(request: PodGpuRequest, covered: frozenset[str]) -> list[str]:
    """BlockUndeclared: the GPU resources the pod names that no resource group of its queue covers in any form.
    Only the GPU resources are checked: the gate does not see every resource a pod requests (CPU and memory
    are counted when covered, as with IgnoreUndeclared; docs/quota.md)."""
    return [r for r in named_gpu_resources(request) if not any(form in covered for form in declared_by(r))]


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
