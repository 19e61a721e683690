"""The kube-vgpu wire protocol: the only module that knows annotation keys, label keys,
resource names, environment variable names and the JSON schemas exchanged through the API server.

Every component (extender, webhook, device plugin, dev cluster, simulator) imports this module;
it imports nothing heavier than orjson so the webhook and device plugin stay light.

Schemas are versioned (`"v": 1`). Encoders are deterministic (fixed key order, compact) so that
two producers describing the same hardware emit byte-identical annotations.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import re
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol, TypeVar

import orjson

from kube_vgpu import kubeapi
from kube_vgpu.protocol import mig as mig_tables

# ---------------------------------------------------------------------------------------------
# Names
# ---------------------------------------------------------------------------------------------

ANNOTATION_PREFIX = "kube-vgpu.io/"

#: Node annotation written by the device plugin: the GPU inventory (JSON, schema below).
NODE_INVENTORY_ANNOTATION = ANNOTATION_PREFIX + "gpu-inventory"
#: Node annotation written by the device plugin at every heartbeat (RFC 3339 UTC, seconds).
NODE_HEARTBEAT_ANNOTATION = ANNOTATION_PREFIX + "gpu-heartbeat"
#: Pod annotation written by the extender at bind: the exact device assignment (JSON).
POD_ASSIGNMENT_ANNOTATION = ANNOTATION_PREFIX + "gpu-assignment"

#: The scheduler name GPU pods are routed to by the webhook.
DEFAULT_SCHEDULER_NAME = "kube-vgpu-scheduler"

# Resources of the HAMi-compatible pod API.
RESOURCE_GPU = "nvidia.com/gpu"  # number of vGPUs; each on a different physical GPU
RESOURCE_GPU_MEMORY = "nvidia.com/gpumem"  # MiB per vGPU
RESOURCE_GPU_MEMORY_PERCENTAGE = "nvidia.com/gpumem-percentage"  # % of the GPU's memory per vGPU
RESOURCE_GPU_CORES = "nvidia.com/gpucores"  # % of one GPU's compute per vGPU; 100 = exclusive
GPU_RESOURCES = (RESOURCE_GPU, RESOURCE_GPU_MEMORY, RESOURCE_GPU_MEMORY_PERCENTAGE, RESOURCE_GPU_CORES)
#: HAMi's task priority of a container's vGPUs (0 = high, 1 = low), read by the limiter as ENV_TASK_PRIORITY. Not a
#: resource any node advertises: the webhook turns it into that env and removes it from the container's resources.
RESOURCE_TASK_PRIORITY = "nvidia.com/priority"
TASK_PRIORITY_HIGH = 0
TASK_PRIORITY_LOW = 1
#: NVIDIA's mixed-strategy MIG resources: nvidia.com/mig-<profile>, e.g. nvidia.com/mig-3g.20gb.
MIG_RESOURCE_PREFIX = "nvidia.com/mig-"

# Selector / policy annotations of the HAMi-compatible pod API.
ANNOTATION_USE_GPU_TYPE = "nvidia.com/use-gputype"
ANNOTATION_NOUSE_GPU_TYPE = "nvidia.com/nouse-gputype"
ANNOTATION_USE_GPU_UUID = "nvidia.com/use-gpuuuid"
ANNOTATION_NOUSE_GPU_UUID = "nvidia.com/nouse-gpuuuid"
ANNOTATION_NUMA_BIND = "nvidia.com/numa-bind"
ANNOTATION_GPU_POLICY = "hami.io/gpu-scheduler-policy"
ANNOTATION_NODE_POLICY = "hami.io/node-scheduler-policy"
#: HAMi's per-pod sharing mode: "hami-core" (the in-container limiter, what kube-vgpu does), "mig", "mps".
ANNOTATION_VGPU_MODE = "nvidia.com/vgpu-mode"
VGPU_MODE_HAMI_CORE = "hami-core"
#: dynamic MIG (issue 16 item 2): each vGPU a new MIG instance of the smallest allowed profile with its gpumem
VGPU_MODE_MIG = "mig"

#: The placement policies of the extender's registry (extender/engine/policies/registry.py; a test keeps the two
#: equal), for the webhook, which must refuse a name the extender would not know without importing the extender.
POLICY_NAMES = (
    "bestfit", "bfgd", "binpack", "clustering", "dotprod", "fgd", "hsafgd", "lafgd", "mutex", "packing", "random",
    "safgd", "spread", "topology",
)
#: HAMi's policy names that mean one of ours: topology-aware picks the best-connected GPUs, as `topology` does.
POLICY_ALIASES = {"topology-aware": "topology"}
#: HAMi's GPU policies kube-vgpu does not implement, each with what to write instead (refused at admission).
UNSUPPORTED_HAMI_POLICIES = {
    "numa": 'for GPUs of one NUMA node, set the annotation nvidia.com/numa-bind: "true"',
}

# GPU node labels in the style of NVIDIA's GPU feature discovery, which people already query.
LABEL_GPU_PRODUCT = "nvidia.com/gpu.product"
LABEL_GPU_COUNT = "nvidia.com/gpu.count"
LABEL_GPU_MEMORY_MIB = "nvidia.com/gpu.memory"
#: Node label set by the device plugin while the limiter library installed on the node (`kube-vgpu limiter install`)
#: is present and intact; value: its version directory (<version>-<sha256[:12]>). The webhook makes pods that load
#: the limiter require it (node affinity), so none starts where the library is missing.
LABEL_LIMITER = ANNOTATION_PREFIX + "limiter"
#: Its value on simulated nodes (fake NVML, the dev cluster): they stand for nodes with the limiter installed.
LIMITER_LABEL_SIMULATED = "simulated"
#: Dynamic MIG by node label (issue 16 item 2): an operator sets it on a node ("all", or GPU indexes joined by "."
#: such as "0.1": label values take no commas); a device plugin started with --dynamic-mig-profiles and without
#: --dynamic-mig partitions those GPUs. Read at the plugin's start.
LABEL_DYNAMIC_MIG = ANNOTATION_PREFIX + "dynamic-mig"

# Environment variables read by the in-container limiter (HAMi-core's libvgpu.so).
ENV_MEMORY_LIMIT_PREFIX = "CUDA_DEVICE_MEMORY_LIMIT_"  # + vGPU index; value "<MiB>m"
ENV_SM_LIMIT = "CUDA_DEVICE_SM_LIMIT"  # percent; 0 = no limit
ENV_SHARED_CACHE = "CUDA_DEVICE_MEMORY_SHARED_CACHE"
#: The emptyDir volume the webhook adds to GPU pods for the limiter's shared cache (one `<container>.cache` file per
#: GPU container); the device plugin reads those files from kubelet's pods directory for usage metrics.
LIMITER_CACHE_VOLUME = "kube-vgpu-cache"
ENV_NVIDIA_VISIBLE_DEVICES = "NVIDIA_VISIBLE_DEVICES"
ENV_CUDA_VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"
ENV_TASK_PRIORITY = "CUDA_TASK_PRIORITY"  # 0 = high, 1 = low (HAMi-core's default when unset)

#: Compute units of one physical GPU (gpucores are percent of one GPU).
CORES_PER_GPU = 100
#: The most gpumem a vGPU may ask for: 1 TiB, several times the largest GPU made (288 GB). More is a unit mistake
#: (bytes, or `8Gi`, which reads as 8589934592 MiB) that no node could ever fit, so it is refused, not left Pending.
MAX_GPU_MEMORY_MIB = 1024 * 1024
#: Default number of vGPUs one physical GPU may be split into.
DEFAULT_MAX_VGPUS_PER_GPU = 10

INVENTORY_SCHEMA_VERSION = 1
ASSIGNMENT_SCHEMA_VERSION = 1


def is_internal_annotation(key: str) -> bool:
    """True for annotations only kube-vgpu components may write (users may not)."""
    return key.startswith(ANNOTATION_PREFIX)


# --- Added for the admission webhook (webhook/): limiter wiring and the namespace opt-out label. ---
#: The dynamic loader's preload list; the webhook's LD_PRELOAD mode puts the limiter library first in it.
ENV_LD_PRELOAD = "LD_PRELOAD"
#: HAMi-core switches that loosen or switch off the limiter (CUDA_DISABLE_CONTROL=true disables it,
#: CUDA_OVERSUBSCRIBE lets memory exceed the limit, GPU_CORE_UTILIZATION_POLICY=disable drops the core limit);
#: the webhook strips them from GPU containers so a pod's spec cannot raise its limits (docs/security.md: what a
#: process inside the container can still do).
ENV_LIMITER_OVERRIDES = ("CUDA_DISABLE_CONTROL", "CUDA_OVERSUBSCRIBE", "GPU_CORE_UTILIZATION_POLICY")
#: Where GPU nodes keep the limiter library (HAMi's location, so HAMi nodes work unchanged); mounted read-only
#: into GPU containers at the same path.
DEFAULT_LIMITER_LIBRARY_PATH = "/usr/local/vgpu/libvgpu.so"
#: Host file listing the limiter library, mounted at /etc/ld.so.preload in the webhook's ld.so.preload mode.
DEFAULT_LIMITER_LD_SO_PRELOAD_PATH = "/usr/local/vgpu/ld.so.preload"
#: Namespace label exempting a namespace from the webhook when set to LABEL_WEBHOOK_DISABLED. Only a namespace
#: label (not a pod label), so a pod's author cannot opt their own GPU pod out of the limits.
LABEL_WEBHOOK = ANNOTATION_PREFIX + "webhook"
LABEL_WEBHOOK_DISABLED = "disabled"
# --- end of webhook additions ---


# --- Added for the quota gate (extender/quota/, issue 6): Kueue's names, read as Kueue writes them. ---
#: API group of Kueue's objects (ClusterQueue, LocalQueue, ResourceFlavor, Cohort, WorkloadPriorityClass).
KUEUE_API_GROUP = "kueue.x-k8s.io"
#: Pod label naming the LocalQueue (in the pod's namespace) whose ClusterQueue's quota the pod uses.
LABEL_KUEUE_QUEUE_NAME = KUEUE_API_GROUP + "/queue-name"
#: Pod label naming a Kueue WorkloadPriorityClass; as in Kueue, it wins over the pod's PriorityClass.
LABEL_KUEUE_PRIORITY_CLASS = KUEUE_API_GROUP + "/priority-class"
#: Kueue's plain-pod groups (all-or-nothing gangs): the group's name (pod label) and its size (pod annotation).
LABEL_KUEUE_POD_GROUP_NAME = KUEUE_API_GROUP + "/pod-group-name"
ANNOTATION_KUEUE_POD_GROUP_TOTAL_COUNT = KUEUE_API_GROUP + "/pod-group-total-count"
#: The most members one gang may have (the webhook refuses a PodGroup's larger size; the extender a larger count): a
#: typo like 40000 must not make every member wait forever unseen.
MAX_GANG_SIZE = 4096
#: Annotation on a batch/v1 Job (not on its pods): "true" makes the Job's pods one gang of `parallelism` members
#: (the webhook stamps the Kueue pod-group label and count above on them).
ANNOTATION_JOB_GANG = ANNOTATION_PREFIX + "gang"
#: Pod annotation (set it in the Job's pod template): seconds a gang's plan may wait for all its members to bind
#: before its reservations are released; overrides the extender's --gang-timeout-seconds for that gang. Users
#: write it, so it lies outside kube-vgpu.io/, which only kube-vgpu's components may write.
ANNOTATION_GANG_TIMEOUT_SECONDS = "gang.kube-vgpu.io/timeout-seconds"
#: Node labels a multi-node gang's members prefer to share, narrowest first (rack, then zone): a tie-breaker
#: after "a node the gang already uses" (override with the extender's --gang-topology-labels).
DEFAULT_GANG_TOPOLOGY_LABELS: tuple[str, ...] = ("topology.kubernetes.io/rack", "topology.kubernetes.io/zone")
#: scheduler-plugins' coscheduling PodGroup (CRD podgroups.scheduling.x-k8s.io, v1alpha1): pods name theirs with this
#: label; the webhook reads its spec.minMember and stamps the Kueue pod-group label and count above.
COSCHEDULING_API_GROUP = "scheduling.x-k8s.io"
COSCHEDULING_API_VERSION = "v1alpha1"
COSCHEDULING_POD_GROUPS = "podgroups"
LABEL_COSCHEDULING_POD_GROUP = COSCHEDULING_API_GROUP + "/pod-group"
#: Prefix of the Kueue pod-group name stamped for a PodGroup: "_" cannot occur in a Job's name (a DNS subdomain),
#: so a PodGroup's gang never shares a name with a Job's gang (named after the Job) in the same namespace.
POD_GROUP_GANG_PREFIX = "podgroup_"
#: Kubernetes' own PodGroups (Workload API, scheduling.k8s.io/v1beta1 in 1.37, feature gate GenericWorkload, off by
#: default): a pod names its PodGroup in spec.schedulingGroup.podGroupName; a gang's size is the PodGroup's
#: spec.schedulingPolicy.gang.minCount. Its gang's Kueue pod-group name has its own prefix ("_": never a Job's).
WORKLOAD_API_GROUP = "scheduling.k8s.io"
WORKLOAD_API_VERSION = "v1beta1"
WORKLOAD_POD_GROUPS = "podgroups"
WORKLOAD_POD_GROUP_GANG_PREFIX = "workload_"
#: Namespace label the API server sets on every namespace (ClusterQueue namespaceSelectors may use it).
LABEL_NAMESPACE_NAME = "kubernetes.io/metadata.name"
# --- end of quota additions ---


# ---------------------------------------------------------------------------------------------
# Node inventory
# ---------------------------------------------------------------------------------------------


class PcieLevel(StrEnum):
    """Closest common PCIe ancestor of two GPUs, best first (NVML's topology levels)."""

    SAME_BOARD = "same-board"  # NVML_TOPOLOGY_INTERNAL
    SINGLE_SWITCH = "single-switch"  # NVML_TOPOLOGY_SINGLE
    MULTI_SWITCH = "multi-switch"  # NVML_TOPOLOGY_MULTIPLE
    HOST_BRIDGE = "host-bridge"  # NVML_TOPOLOGY_HOSTBRIDGE
    SAME_NUMA = "same-numa"  # NVML_TOPOLOGY_NODE
    CROSS_NUMA = "cross-numa"  # NVML_TOPOLOGY_SYSTEM

    @property
    def rank(self) -> int:
        """0 for the closest level, 5 for the farthest."""
        return _PCIE_RANK[self]


_PCIE_RANK = {level: rank for rank, level in enumerate(PcieLevel)}
_PCIE_LEVELS = {level.value: level for level in PcieLevel}


@dataclass(frozen=True, slots=True)
class GpuLink:
    """How this GPU reaches one peer GPU on the same node."""

    peer_index: int
    nvlinks: int = 0  # active NVLink lanes to the peer (through an NVSwitch: the GPU's lanes to the fabric)
    via_nvswitch: bool = False
    pcie: PcieLevel = PcieLevel.CROSS_NUMA


@dataclass(frozen=True, slots=True)
class MigDevice:
    """One MIG device (a GPU instance with its compute instance) of a GPU in MIG mode, as NVML describes it."""

    uuid: str  # "MIG-...": what NVIDIA_VISIBLE_DEVICES takes
    profile: str  # e.g. "3g.20gb", the <profile> of the resource nvidia.com/mig-<profile>
    gpu_instance: int  # NVML's GPU instance ID
    compute_instance: int  # NVML's compute instance ID within it
    memory_mib: int
    multiprocessors: int
    start: int  # first memory slot (of protocol.mig.MIG_MEMORY_SLOTS) the GPU instance occupies
    size: int  # memory slots it occupies


@dataclass(frozen=True, slots=True)
class DynamicMig:
    """Dynamic MIG (issue 16 item 2): the operator lets kube-vgpu partition this GPU itself. The extender chooses
    (profile, start slot) per pod among `profiles`; the device plugin creates the instance before Allocate answers
    and destroys it when its pod is gone. `instances` are the MIG devices that exist now (the GPU is in MIG mode
    exactly while it has any); they are listed here and never in GpuInfo.mig_devices, so a reader that does not
    know dynamic MIG sees a GPU in MIG mode without devices and never places a pod on one of them."""

    model: str  # protocol.mig.MigModel.key, e.g. "A100-40GB"; a reader that does not know it leaves the GPU alone
    profiles: tuple[str, ...]  # the operator's allowlist for this model, e.g. ("1g.10gb", "3g.40gb")
    instances: tuple[MigDevice, ...] = ()


@dataclass(frozen=True, slots=True)
class GpuInfo:
    uuid: str
    index: int
    model: str
    memory_mib: int
    cores: int = CORES_PER_GPU
    max_vgpus: int = DEFAULT_MAX_VGPUS_PER_GPU
    numa_node: int | None = None
    pci_bus_id: str = ""
    healthy: bool = True
    mig_mode: bool = False
    links: tuple[GpuLink, ...] = ()
    #: Device plugin (issue 5): "namespace/name" of pods holding this GPU without a kube-vgpu assignment (they reached
    #: the node another way). Consumers must treat such a GPU as fully used. Encoded only when non-empty, so
    #: inventories without such pods stay byte-identical to earlier v1 producers.
    external_pods: tuple[str, ...] = ()
    #: Static MIG (issue 16): the MIG devices of a GPU in MIG mode. Encoded only when non-empty ("migDevices"), so
    #: inventories without MIG stay byte-identical to earlier v1 producers, and an older reader, which ignores the
    #: field, keeps never using a GPU in MIG mode.
    mig_devices: tuple[MigDevice, ...] = ()
    #: Dynamic MIG (issue 16 item 2): set on a GPU the operator marked for it; encoded only when set ("migDynamic").
    dynamic_mig: DynamicMig | None = None


@dataclass(frozen=True, slots=True)
class NodeInventory:
    gpus: tuple[GpuInfo, ...]
    version: int = INVENTORY_SCHEMA_VERSION

    def link(self, a_index: int, b_index: int) -> GpuLink | None:
        for gpu in self.gpus:
            if gpu.index == a_index:
                for link in gpu.links:
                    if link.peer_index == b_index:
                        return link
        return None


class ProtocolError(ValueError):
    """An annotation that does not follow the schema; the message says which field."""


#: Bounds of the inventory's numbers. NVML numbers a node's GPUs from 0 and no machine has close to this many; a
#: bound keeps a corrupt annotation from passing as a node with absurd indexes or link counts.
MAX_GPUS_PER_NODE = 256
MAX_NUMA_NODE = 1023
MAX_NVLINKS = 1024


def _integer(value: Any, where: str, field_name: str, low: int, high: int | None = None) -> int:
    """An integer (not a bool, not a float) in [low, high]."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise ProtocolError(f"{where}: field {field_name!r} must be an integer, not {type(value).__name__}")
    if value < low or (high is not None and value > high):
        bound = f"between {low} and {high}" if high is not None else f"at least {low}"
        raise ProtocolError(f"{where}: field {field_name!r} must be {bound}, got {value}")
    return value


def encode_inventory(inventory: NodeInventory) -> str:
    """Deterministic compact JSON for the node inventory annotation."""
    doc = {
        "v": inventory.version,
        "gpus": [
            {
                "uuid": gpu.uuid,
                "index": gpu.index,
                "model": gpu.model,
                "memoryMiB": gpu.memory_mib,
                "cores": gpu.cores,
                "maxShares": gpu.max_vgpus,
                "numa": gpu.numa_node,
                "pciBusId": gpu.pci_bus_id,
                "healthy": gpu.healthy,
                "mig": gpu.mig_mode,
                "links": [[link.peer_index, link.nvlinks, link.via_nvswitch, link.pcie.value] for link in gpu.links],
                **({"external": list(gpu.external_pods)} if gpu.external_pods else {}),
                **({"migDevices": [[m.uuid, m.profile, m.gpu_instance, m.compute_instance, m.memory_mib,
                                    m.multiprocessors, m.start, m.size] for m in gpu.mig_devices]}
                   if gpu.mig_devices else {}),
                **({"migDynamic": _encode_dynamic_mig(gpu.dynamic_mig)} if gpu.dynamic_mig is not None else {}),
            }
            for gpu in inventory.gpus
        ],
    }
    return orjson.dumps(doc).decode()


def _encode_mig_device(m: MigDevice) -> list[Any]:
    return [m.uuid, m.profile, m.gpu_instance, m.compute_instance, m.memory_mib, m.multiprocessors, m.start, m.size]


def _encode_dynamic_mig(dynamic: DynamicMig) -> dict[str, Any]:
    return {"model": dynamic.model, "profiles": list(dynamic.profiles),
            "instances": [_encode_mig_device(m) for m in dynamic.instances]}


def _require(doc: Mapping[str, Any], key: str, kind: type | tuple[type, ...], where: str) -> Any:
    if key not in doc:
        raise ProtocolError(f"{where}: missing field {key!r}")
    value = doc[key]
    # bool is an int subclass; refuse it where an int is meant
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ProtocolError(f"{where}: field {key!r} has the wrong type ({type(value).__name__})")
    return value


# complexity: one check per inventory field, each with its own ProtocolError message
def decode_inventory(text: str) -> NodeInventory:  # noqa: C901
    """Parse the node inventory annotation; raises ProtocolError (and nothing else) naming the bad field.

    Beyond the types: GPU indexes in [0, MAX_GPUS_PER_NODE), UUIDs non-empty and unique, and every link's peer
    another GPU of the same node, named once per GPU."""
    if not isinstance(text, str | bytes):
        raise ProtocolError(f"inventory must be a JSON string, not {type(text).__name__}")
    try:
        doc = orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        raise ProtocolError(f"inventory is not valid JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise ProtocolError("inventory must be a JSON object")
    version = _require(doc, "v", int, "inventory")
    if version != INVENTORY_SCHEMA_VERSION:
        raise ProtocolError(
            f"inventory schema version {version} is not supported (expected {INVENTORY_SCHEMA_VERSION})"
        )
    gpus = []
    seen_indexes: set[int] = set()
    seen_uuids: set[str] = set()
    raw_gpus = _require(doc, "gpus", list, "inventory")
    if len(raw_gpus) > MAX_GPUS_PER_NODE:
        raise ProtocolError(f"inventory: {len(raw_gpus)} GPUs; at most {MAX_GPUS_PER_NODE} are supported")
    for position, raw in enumerate(raw_gpus):
        where = f"inventory gpus[{position}]"
        if not isinstance(raw, dict):
            raise ProtocolError(f"{where}: must be an object")
        numa = raw.get("numa")
        if numa is not None:
            numa = _integer(numa, where, "numa", 0, MAX_NUMA_NODE)
        links = []
        peers: set[int] = set()
        for link_position, raw_link in enumerate(_require(raw, "links", list, where)):
            link_where = f"{where} links[{link_position}]"
            if not (isinstance(raw_link, list) and len(raw_link) == 4):
                raise ProtocolError(f"{link_where}: must be [peer, nvlinks, nvswitch, pcie]")
            peer, nvlinks, via_nvswitch, pcie = raw_link
            peer = _integer(peer, link_where, "peer", 0, MAX_GPUS_PER_NODE - 1)
            if peer in peers:
                raise ProtocolError(f"{link_where}: peer {peer} is described twice")
            peers.add(peer)
            nvlinks = _integer(nvlinks, link_where, "nvlinks", 0, MAX_NVLINKS)
            if not isinstance(via_nvswitch, bool):
                raise ProtocolError(f"{link_where}: field 'nvswitch' must be true or false")
            if not isinstance(pcie, str) or pcie not in _PCIE_LEVELS:
                raise ProtocolError(f"{link_where}: unknown PCIe level {pcie!r}")
            links.append(GpuLink(peer, nvlinks, via_nvswitch, _PCIE_LEVELS[pcie]))
        external = raw.get("external", [])  # optional (device plugin, issue 5)
        if not isinstance(external, list) or not all(isinstance(item, str) for item in external):
            raise ProtocolError(f"{where}: field 'external' must be a list of strings")
        index = _integer(_require(raw, "index", int, where), where, "index", 0, MAX_GPUS_PER_NODE - 1)
        if index in seen_indexes:
            raise ProtocolError(f"{where}: duplicate GPU index {index}")
        seen_indexes.add(index)
        if index in peers:
            raise ProtocolError(f"{where}: GPU {index} lists a link to itself")
        uuid = _require(raw, "uuid", str, where)
        if not uuid:
            raise ProtocolError(f"{where}: field 'uuid' must not be empty")
        if uuid in seen_uuids:
            raise ProtocolError(f"{where}: duplicate GPU UUID {uuid}")
        seen_uuids.add(uuid)
        memory_mib = _require(raw, "memoryMiB", int, where)
        cores = _require(raw, "cores", int, where)
        max_vgpus = _require(raw, "maxShares", int, where)
        if memory_mib <= 0 or cores <= 0 or max_vgpus <= 0:
            raise ProtocolError(f"{where}: memoryMiB, cores and maxShares must be positive")
        mig_mode = _require(raw, "mig", bool, where)
        mig_devices = _decode_mig_devices(raw.get("migDevices", []), where, mig_mode, memory_mib, seen_uuids)
        dynamic_mig = None
        if "migDynamic" in raw:
            dynamic_mig = _decode_dynamic_mig(raw["migDynamic"], where, mig_mode, memory_mib, seen_uuids)
            if dynamic_mig.instances and mig_devices:
                raise ProtocolError(f"{where}: a dynamic MIG GPU lists its instances under migDynamic, not migDevices")
        gpus.append(
            GpuInfo(
                uuid=sys.intern(uuid),  # shared with the assignments that name it (decode_assignment)
                index=index,
                model=sys.intern(_require(raw, "model", str, where)),  # one copy for the cluster's 40,000 GPUs
                memory_mib=memory_mib,
                cores=cores,
                max_vgpus=max_vgpus,
                numa_node=numa,
                pci_bus_id=_require(raw, "pciBusId", str, where),
                healthy=_require(raw, "healthy", bool, where),
                mig_mode=mig_mode,
                links=tuple(links),
                external_pods=tuple(external),
                mig_devices=mig_devices,
                dynamic_mig=dynamic_mig,
            )
        )
    for position, gpu in enumerate(gpus):
        for link in gpu.links:
            if link.peer_index not in seen_indexes:
                raise ProtocolError(
                    f"inventory gpus[{position}]: link to GPU {link.peer_index}, which is not on this node"
                )
    return NodeInventory(gpus=tuple(gpus), version=version)


#: MIG memory slots of a GPU (protocol.mig.MIG_MEMORY_SLOTS; repeated here so decoding needs no table)
_MIG_SLOTS = 8
#: NVML numbers GPU and compute instances below this
_MAX_MIG_INSTANCE_ID = 1023


def _decode_dynamic_mig(
    raw: Any, where: str, mig_mode: bool, gpu_memory_mib: int, seen_uuids: set[str]
) -> DynamicMig:
    """A GPU's "migDynamic": {"model", "profiles", "instances"}. Keys this reader does not know are ignored (a newer
    device plugin may add some); a model or profile it does not know is kept and left unused by the engine."""
    where = f"{where} migDynamic"
    if not isinstance(raw, dict):
        raise ProtocolError(f"{where}: must be an object")
    model = _require(raw, "model", str, where)
    profiles = _require(raw, "profiles", list, where)
    for profile in profiles:
        if not isinstance(profile, str) or not re.fullmatch(r"[1-7]g\.[0-9]+gb(\+me)?", profile):
            raise ProtocolError(f"{where}: profile {profile!r} is not a MIG profile name like 3g.20gb")
    instances = _decode_mig_devices(raw.get("instances", []), f"{where} instances", mig_mode, gpu_memory_mib,
                                    seen_uuids)
    return DynamicMig(model, tuple(profiles), instances)


def _decode_mig_devices(
    raw: Any, where: str, mig_mode: bool, gpu_memory_mib: int, seen_uuids: set[str]
) -> tuple[MigDevice, ...]:
    """A GPU's "migDevices": [[uuid, profile, gpuInstance, computeInstance, memoryMiB, multiprocessors, start, size]].
    Only a GPU in MIG mode has them; UUIDs are unique on the node (GPUs' included); two devices never share a
    memory slot or a (GPU instance, compute instance) pair."""
    if not isinstance(raw, list):
        raise ProtocolError(f"{where}: field 'migDevices' must be a list")
    if raw and not mig_mode:
        raise ProtocolError(f"{where}: lists MIG devices but is not in MIG mode ('mig' is false)")
    devices = []
    slots: dict[int, str] = {}
    instances: set[tuple[int, int]] = set()
    for position, item in enumerate(raw):
        item_where = f"{where} migDevices[{position}]"
        if not (isinstance(item, list) and len(item) == 8):
            raise ProtocolError(
                f"{item_where}: must be [uuid, profile, gpuInstance, computeInstance, memoryMiB, multiprocessors, "
                "start, size]"
            )
        uuid, profile, gpu_instance, compute_instance, memory_mib, multiprocessors, start, size = item
        if not isinstance(uuid, str) or not uuid:
            raise ProtocolError(f"{item_where}: the UUID must be a non-empty string")
        if uuid in seen_uuids:
            raise ProtocolError(f"{item_where}: duplicate UUID {uuid}")
        seen_uuids.add(uuid)
        if not isinstance(profile, str) or not re.fullmatch(r"[1-7]g\.[0-9]+gb(\+me)?", profile):
            raise ProtocolError(f"{item_where}: profile {profile!r} is not a MIG profile name like 3g.20gb")
        gpu_instance = _integer(gpu_instance, item_where, "gpuInstance", 0, _MAX_MIG_INSTANCE_ID)
        compute_instance = _integer(compute_instance, item_where, "computeInstance", 0, _MAX_MIG_INSTANCE_ID)
        if (gpu_instance, compute_instance) in instances:
            raise ProtocolError(f"{item_where}: GPU instance {gpu_instance} compute instance {compute_instance} "
                                "is described twice")
        instances.add((gpu_instance, compute_instance))
        memory_mib = _integer(memory_mib, item_where, "memoryMiB", 1, gpu_memory_mib)
        multiprocessors = _integer(multiprocessors, item_where, "multiprocessors", 1, 1024)
        start = _integer(start, item_where, "start", 0, _MIG_SLOTS - 1)
        size = _integer(size, item_where, "size", 1, _MIG_SLOTS - start)
        for slot in range(start, start + size):
            if slot in slots:
                raise ProtocolError(f"{item_where}: memory slot {slot} is also used by {slots[slot]}")
            slots[slot] = uuid
        devices.append(MigDevice(uuid, profile, gpu_instance, compute_instance, memory_mib, multiprocessors, start,
                                 size))
    return tuple(devices)


def format_heartbeat(moment: _dt.datetime) -> str:
    return moment.astimezone(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_heartbeat(text: str) -> float:
    """Heartbeat annotation -> POSIX seconds. Raises ProtocolError."""
    try:
        moment = _dt.datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=_dt.UTC)
    except (TypeError, ValueError):
        raise ProtocolError(f"heartbeat {text!r} is not an RFC 3339 UTC time like 2026-01-31T12:00:00Z") from None
    return moment.timestamp()


def gpu_node_labels(inventory: NodeInventory) -> dict[str, str]:
    """Node labels describing the GPUs, as GPU feature discovery names them."""
    if not inventory.gpus:
        return {}
    first = inventory.gpus[0]
    return {
        LABEL_GPU_PRODUCT: label_safe(first.model),
        LABEL_GPU_COUNT: str(len(inventory.gpus)),
        LABEL_GPU_MEMORY_MIB: str(first.memory_mib),
    }


def label_safe(text: str) -> str:
    """A label value from free text (GPU names contain spaces): as GFD does, spaces become '-'."""
    cleaned = re.sub(r"[^A-Za-z0-9._-]+", "-", text.strip()).strip("-._")
    return cleaned[:63]


# ---------------------------------------------------------------------------------------------
# Pod assignment
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class DeviceShare:
    """One vGPU: a slice of one physical GPU."""

    uuid: str
    memory_mib: int
    cores: int


@dataclass(frozen=True, slots=True)
class ContainerAssignment:
    name: str
    devices: tuple[DeviceShare, ...]
    init: bool = False
    #: a native sidecar (init container with restartPolicy Always; init is True too). Encoded only when set, so
    #: assignments without sidecars stay byte-identical, and an assignment written before the flag existed reads as
    #: having none.
    sidecar: bool = False


@dataclass(frozen=True, slots=True)
class PodAssignment:
    node: str
    containers: tuple[ContainerAssignment, ...]
    version: int = ASSIGNMENT_SCHEMA_VERSION

    def all_devices(self) -> list[DeviceShare]:
        return [device for container in self.containers for device in container.devices]

    @property
    def phases(self) -> tuple[tuple[ContainerAssignment, ...], ...]:
        """The containers that hold their devices at the same moment (see container_phases)."""
        return container_phases(self.containers)


#: Dynamic MIG: an assignment names a MIG instance that does not exist yet by this device name, built from the
#: GPU's UUID, the profile and the start slot the extender chose ("dynmig/GPU-.../1g.10gb@3"). The device plugin
#: creates that instance before Allocate answers and hands the container the new MIG device's UUID. A device name,
#: not a new assignment field, so quota, state and every reader that counts a pod's devices keep working unchanged.
DYNAMIC_MIG_DEVICE_PREFIX = "dynmig/"


@dataclass(frozen=True, slots=True)
class DynamicMigPlacement:
    gpu_uuid: str
    profile: str
    start: int

    @property
    def device(self) -> str:
        return f"{DYNAMIC_MIG_DEVICE_PREFIX}{self.gpu_uuid}/{self.profile}@{self.start}"


def parse_dynamic_mig_device(device: str) -> DynamicMigPlacement | None:
    """The placement a dynamic MIG device name stands for; None for any other device (a GPU or MIG UUID)."""
    if not device.startswith(DYNAMIC_MIG_DEVICE_PREFIX):
        return None
    gpu_uuid, _, rest = device[len(DYNAMIC_MIG_DEVICE_PREFIX):].rpartition("/")
    profile, _, start = rest.partition("@")
    if not gpu_uuid or not re.fullmatch(r"[1-7]g\.[0-9]+gb", profile) or not start.isdigit():
        return None
    if int(start) >= _MIG_SLOTS:
        return None
    return DynamicMigPlacement(gpu_uuid, profile, int(start))


def encode_assignment(assignment: PodAssignment) -> str:
    doc = {
        "v": assignment.version,
        "node": assignment.node,
        "containers": [
            {
                "name": container.name,
                "init": container.init,
                **({"sidecar": True} if container.sidecar else {}),
                "devices": [[d.uuid, d.memory_mib, d.cores] for d in container.devices],
            }
            for container in assignment.containers
        ],
    }
    return orjson.dumps(doc).decode()


def decode_assignment(text: str) -> PodAssignment:
    """Parse a pod's assignment annotation; raises ProtocolError (and nothing else) naming the bad field."""
    if not isinstance(text, str | bytes):
        raise ProtocolError(f"assignment must be a JSON string, not {type(text).__name__}")
    try:
        doc = orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        raise ProtocolError(f"assignment is not valid JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise ProtocolError("assignment must be a JSON object")
    version = _require(doc, "v", int, "assignment")
    if version != ASSIGNMENT_SCHEMA_VERSION:
        raise ProtocolError(f"assignment schema version {version} is not supported")
    containers = []
    for position, raw in enumerate(_require(doc, "containers", list, "assignment")):
        where = f"assignment containers[{position}]"
        if not isinstance(raw, dict):
            raise ProtocolError(f"{where}: must be an object")
        devices = []
        for raw_device in _require(raw, "devices", list, where):
            if not (isinstance(raw_device, list) and len(raw_device) == 3):
                raise ProtocolError(f"{where}: each device must be [uuid, memoryMiB, cores]")
            uuid, memory_mib, cores = raw_device
            if not isinstance(uuid, str) or not uuid:
                raise ProtocolError(f"{where}: a device's UUID must be a non-empty string")
            memory_mib = _integer(memory_mib, where, "memoryMiB", 0)
            cores = _integer(cores, where, "cores", 0)
            devices.append(DeviceShare(sys.intern(uuid), memory_mib, cores))
        init = raw.get("init", False)
        if not isinstance(init, bool):
            raise ProtocolError(f"{where}: field 'init' must be true or false")
        sidecar = raw.get("sidecar", False)  # absent in assignments written before sidecars were counted
        if not isinstance(sidecar, bool):
            raise ProtocolError(f"{where}: field 'sidecar' must be true or false")
        if sidecar and not init:
            raise ProtocolError(f"{where}: a sidecar is an init container ('init' must be true)")
        containers.append(
            ContainerAssignment(
                name=sys.intern(_require(raw, "name", str, where)), devices=tuple(devices), init=init, sidecar=sidecar
            )
        )
    # the strings interned: 40,000 pods' assignments name the same GPUs, nodes and container names as the inventories
    # and each other, and hold one copy of each instead of ~8 MiB of duplicates at 5000 nodes
    node = sys.intern(_require(doc, "node", str, "assignment"))
    return PodAssignment(node=node, containers=tuple(containers), version=version)


# --- Added for the device plugin (deviceplugin/, issue 5): matching kubelet's Allocate to a pod. ---
# kubelet's Allocate names only device IDs, never the pod. The device plugin therefore matches it against the
# pods on its node that have an assignment and a GPU container not yet allocated, in the order kubelet admits
# them (the order they were bound), and claims the container with a resourceVersion-guarded patch.

#: Pod annotation the extender writes at bind, in the SAME patch as POD_ASSIGNMENT_ANNOTATION (before creating the
#: Binding, under its per-node lock): when the assignment was committed (format_bind_time). Orders a node's
#: pending pods the way kubelet will admit them.
POD_BIND_TIME_ANNOTATION = ANNOTATION_PREFIX + "gpu-bind-time"
#: Pod annotation the device plugin writes in Allocate (JSON, encode_allocation): which containers already got
#: their devices, with the kubelet device IDs they got. Written with the pod's resourceVersion as a precondition
#: so two concurrent Allocates can never claim the same container.
POD_ALLOCATION_ANNOTATION = ANNOTATION_PREFIX + "gpu-allocation"
ALLOCATION_SCHEMA_VERSION = 1

# --- Added for hardening (issue 20): what admission fixed about a pod, so later stages can trust it. ---
#: Pod annotation the webhook adds to every GPU pod it admits (value: ADMISSION_MARK_VALUE). The extender and the
#: device plugin refuse GPU pods without it: such a pod skipped the webhook (opted-out namespace, webhook removed)
#: and would run without limiter wiring. Users cannot write it themselves (the webhook refuses kube-vgpu.io/
#: annotations from users; the ValidatingAdmissionPolicy refuses it in namespaces the webhook does not see).
POD_ADMITTED_ANNOTATION = ANNOTATION_PREFIX + "admitted"
ADMISSION_MARK_VALUE = "v1"
#: Pod annotation the extender writes at bind, in the same Binding as POD_ASSIGNMENT_ANNOTATION: the pod's
#: LABEL_KUEUE_QUEUE_NAME at bind ("" = none), fixed for the pod's life: quota keeps counting the pod in that queue
#: even if the label is later changed or removed.
POD_QUEUE_ANNOTATION = ANNOTATION_PREFIX + "queue"


def format_bind_time(moment: _dt.datetime) -> str:
    """RFC 3339 UTC with microseconds: binds to one node are milliseconds apart, seconds would tie."""
    return moment.astimezone(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def parse_bind_time(text: str) -> float:
    """Bind-time annotation -> POSIX seconds (also accepts whole seconds). Raises ProtocolError."""
    for layout in ("%Y-%m-%dT%H:%M:%S.%fZ", "%Y-%m-%dT%H:%M:%SZ"):
        try:
            return _dt.datetime.strptime(text, layout).replace(tzinfo=_dt.UTC).timestamp()
        except (TypeError, ValueError):
            continue
    raise ProtocolError(f"bind time {text!r} is not an RFC 3339 UTC time like 2026-01-31T12:00:00.123456Z")


def encode_allocation(containers: Mapping[str, tuple[str, ...] | list[str]]) -> str:
    """{"v":1,"containers":{name: [kubelet device IDs]}} with containers sorted by name (deterministic)."""
    doc = {
        "v": ALLOCATION_SCHEMA_VERSION,
        "containers": {name: list(containers[name]) for name in sorted(containers)},
    }
    return orjson.dumps(doc).decode()


def decode_allocation(text: str) -> dict[str, tuple[str, ...]]:
    """Container name -> kubelet device IDs it was allocated. Raises ProtocolError."""
    try:
        doc = orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        raise ProtocolError(f"allocation is not valid JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise ProtocolError("allocation must be a JSON object")
    version = _require(doc, "v", int, "allocation")
    if version != ALLOCATION_SCHEMA_VERSION:
        raise ProtocolError(f"allocation schema version {version} is not supported")
    raw = _require(doc, "containers", dict, "allocation")
    result: dict[str, tuple[str, ...]] = {}
    for name, ids in raw.items():
        if not isinstance(ids, list) or not all(isinstance(item, str) for item in ids):
            raise ProtocolError(f"allocation container {name!r}: device IDs must be a list of strings")
        result[name] = tuple(ids)
    return result


# --- end of device plugin additions ---


# ---------------------------------------------------------------------------------------------
# The HAMi-compatible pod API: parsing a pod's GPU request
# ---------------------------------------------------------------------------------------------


#: a gang's own timeout (annotation) must lie in this range: seconds, not a typo's days or an instant release
MIN_GANG_TIMEOUT_S = 10.0
MAX_GANG_TIMEOUT_S = 86400.0


class InvalidGangDeclaration(ValueError):
    """A pod's gang declaration cannot be read; the message says what to fix."""


@dataclass(frozen=True, slots=True)
class GangDeclaration:
    name: str  # the gang, in the pod's namespace
    size: int
    timeout_s: float | None  # the gang's own plan timeout; None: the extender's


def parse_gang_declaration(pod: Mapping[str, Any]) -> GangDeclaration | None:
    """A pod's gang (Kueue's plain-pod group labels, our timeout annotation); None for a pod outside any gang.
    Read by the webhook (refused at admission) and the extender (the same rules, whatever passed admission)."""
    metadata = pod.get("metadata") or {}
    name = (metadata.get("labels") or {}).get(LABEL_KUEUE_POD_GROUP_NAME)
    if not name:
        return None
    annotations = metadata.get("annotations") or {}
    text = annotations.get(ANNOTATION_KUEUE_POD_GROUP_TOTAL_COUNT)
    if text is None:
        raise InvalidGangDeclaration(
            f"pod has the label {LABEL_KUEUE_POD_GROUP_NAME}={name} but no annotation "
            f"{ANNOTATION_KUEUE_POD_GROUP_TOTAL_COUNT} (the number of pods in the group)")
    try:
        size = int(str(text))
    except ValueError:
        size = 0
    if not 1 <= size <= MAX_GANG_SIZE:
        raise InvalidGangDeclaration(
            f"annotation {ANNOTATION_KUEUE_POD_GROUP_TOTAL_COUNT} must be a whole number from 1 to {MAX_GANG_SIZE}, "
            f"got {str(text)[:20]!r}")
    timeout_text = annotations.get(ANNOTATION_GANG_TIMEOUT_SECONDS)
    timeout_s: float | None = None
    if timeout_text is not None:
        try:
            timeout_s = float(str(timeout_text))
        except ValueError:
            timeout_s = float("nan")
        if not MIN_GANG_TIMEOUT_S <= timeout_s <= MAX_GANG_TIMEOUT_S:  # NaN fails too
            raise InvalidGangDeclaration(
                f"annotation {ANNOTATION_GANG_TIMEOUT_SECONDS} must be a number of seconds from "
                f"{MIN_GANG_TIMEOUT_S:g} to {MAX_GANG_TIMEOUT_S:g}, got {str(timeout_text)[:20]!r}")
    return GangDeclaration(str(name), size, timeout_s)


class InvalidGpuRequest(ValueError):
    """A pod's GPU request that can never be honoured; the message is meant for the pod's author."""


@dataclass(frozen=True, slots=True)
class ContainerGpuRequest:
    """What one container asks for. memory_mib None and memory_percent None mean the whole GPU's memory."""

    name: str
    count: int  # vGPUs, each on a different physical GPU
    memory_mib: int | None = None
    memory_percent: int | None = None
    cores: int = 0  # percent of one GPU; 0 = no compute reservation (best effort), 100 = exclusive
    init: bool = False
    #: a native sidecar: an init container with restartPolicy Always (init is True too). kubelet starts it in init
    #: order and it keeps running, beside every later init container and the app containers.
    sidecar: bool = False
    #: HAMi's nvidia.com/priority (TASK_PRIORITY_HIGH or TASK_PRIORITY_LOW); None when the container does not set it
    task_priority: int | None = None
    #: static MIG: the container asks for `count` MIG devices of this profile (nvidia.com/mig-<profile>), each held
    #: whole (cores is CORES_PER_GPU, memory the device's); None for vGPUs
    mig_profile: str | None = None
    #: HAMi's nvidia.com/vgpu-mode: mig (dynamic MIG by memory): each of `count` vGPUs is a new MIG instance of the
    #: smallest profile a dynamic MIG GPU allows with at least this much memory (its nvidia.com/gpumem); None else
    mig_memory_mib: int | None = None

    @property
    def mig(self) -> bool:
        """Held as whole MIG devices (a named profile, or vgpu-mode: mig), not as a shared vGPU."""
        return self.mig_profile is not None or self.mig_memory_mib is not None

    @property
    def exclusive(self) -> bool:
        return self.cores >= CORES_PER_GPU

    def memory_on(self, gpu_memory_mib: int) -> int:
        """MiB this request takes on a GPU of the given size."""
        if self.memory_mib is not None:
            return self.memory_mib
        if self.memory_percent is not None:
            return gpu_memory_mib * self.memory_percent // 100
        return gpu_memory_mib


@dataclass(frozen=True, slots=True)
class GpuSelectors:
    use_types: tuple[str, ...] = ()
    nouse_types: tuple[str, ...] = ()
    use_uuids: tuple[str, ...] = ()
    nouse_uuids: tuple[str, ...] = ()
    numa_bind: bool = False

    def model_allowed(self, model: str) -> bool:
        # HAMi matches types by substring, case-insensitively ("A100" selects "NVIDIA-A100-SXM4-80GB").
        lowered = model.lower()
        if self.use_types and not any(t in lowered for t in self.use_types):
            return False
        return not any(t in lowered for t in self.nouse_types)

    def uuid_allowed(self, uuid: str) -> bool:
        if self.use_uuids and uuid not in self.use_uuids:
            return False
        return uuid not in self.nouse_uuids

    @property
    def empty(self) -> bool:
        return not (self.use_types or self.nouse_types or self.use_uuids or self.nouse_uuids or self.numa_bind)


class _PhasedContainer(Protocol):
    @property
    def init(self) -> bool: ...

    @property
    def sidecar(self) -> bool: ...


_Phased = TypeVar("_Phased", bound=_PhasedContainer)


def container_phases(containers: Iterable[_Phased]) -> tuple[tuple[_Phased, ...], ...]:
    """The groups of a pod's containers that run at the same moment, as kubelet runs them (the sidecar KEP): init
    containers one at a time in order, each beside the native sidecars started before it (a sidecar keeps running),
    then the app containers beside every sidecar. What a pod holds is, per resource, the largest of these moments.

    `containers` in any order of app against init containers, but init containers in the pod's spec order (both
    requests and assignments keep it). A sidecar's own start (it beside the sidecars before it) is contained in the
    app moment and is not listed; empty moments are not listed. The one rule every phase peak in kube-vgpu uses
    (placement, state, quota, webhook cap), so they cannot disagree."""
    moments: list[tuple[_Phased, ...]] = []
    sidecars: list[_Phased] = []
    app: list[_Phased] = []
    for container in containers:
        if not container.init:
            app.append(container)
        elif container.sidecar:
            sidecars.append(container)
        else:
            moments.append((*sidecars, container))
    if app or sidecars:
        moments.append((*sidecars, *app))
    return tuple(moments)


@dataclass(frozen=True, slots=True)
class PodGpuRequest:
    """A pod's whole GPU request. `phases` lists what must fit at once (container_phases): each init container
    beside the sidecars started before it, then the app containers beside every sidecar."""

    containers: tuple[ContainerGpuRequest, ...]
    selectors: GpuSelectors = field(default_factory=GpuSelectors)
    gpu_policy: str | None = None
    node_policy: str | None = None

    @property
    def app_containers(self) -> tuple[ContainerGpuRequest, ...]:
        return tuple(c for c in self.containers if not c.init)

    @property
    def init_containers(self) -> tuple[ContainerGpuRequest, ...]:
        """Every init container, native sidecars included, in spec order."""
        return tuple(c for c in self.containers if c.init)

    @property
    def phases(self) -> tuple[tuple[ContainerGpuRequest, ...], ...]:
        return container_phases(self.containers)

    @property
    def total_vgpus(self) -> int:
        """vGPUs the pod holds at its peak: app containers and sidecars add up, each init container counts beside
        the sidecars started before it."""
        return max((sum(c.count for c in phase) for phase in self.phases), default=0)

    @property
    def is_empty(self) -> bool:
        return not self.containers

    @property
    def mig_containers(self) -> tuple[ContainerGpuRequest, ...]:
        """The containers asking for MIG devices (static MIG)."""
        return tuple(c for c in self.containers if c.mig_profile is not None)


def _shown(text: str, limit: int = 80) -> str:
    """A value quoted in a message, cut short: a hostile 5000-digit quantity must not become a 5000-character
    event."""
    return repr(text) if len(text) <= limit else repr(text[:limit]) + f"... ({len(text)} characters)"


def parse_count_quantity(value: Any, *, what: str) -> int:
    """A Kubernetes quantity that must be a non-negative whole number ("2", 2, "1k"), as the API server requires of
    extended resources.

    Refuses fractions ("0.5", "500m") and negatives with a message naming `what`."""
    if isinstance(value, bool):
        raise InvalidGpuRequest(f"{what} must be a whole number, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise InvalidGpuRequest(f"{what} must not be negative, got {value}")
        return value
    if isinstance(value, float):
        if value < 0 or not value.is_integer():
            raise InvalidGpuRequest(f"{what} must be a non-negative whole number, got {value}")
        return int(value)
    text = str(value).strip()
    try:
        amount = kubeapi.parse_quantity(text)
    except kubeapi.InvalidQuantity:
        if text.startswith("-"):
            raise InvalidGpuRequest(f"{what} must not be negative, got {_shown(text)}") from None
        raise InvalidGpuRequest(f"{what} must be a non-negative whole number, got {_shown(text)}") from None
    if amount < 0:
        raise InvalidGpuRequest(f"{what} must not be negative, got {_shown(text)}")
    if amount != amount.to_integral_value():  # "0.5", "500m": a vGPU, a MiB, a percent are never split
        raise InvalidGpuRequest(f"{what} must be a non-negative whole number, got {_shown(text)}")
    return int(amount)


def _annotation_list(annotations: Mapping[str, str], key: str, *, lower: bool) -> tuple[str, ...]:
    raw = annotations.get(key, "")
    if not isinstance(raw, str):
        raise InvalidGpuRequest(f"annotation {key} must be a string")
    items = [item.strip() for item in raw.split(",") if item.strip()]
    return tuple(item.lower() for item in items) if lower else tuple(items)


def _container_resources(container: Mapping[str, Any]) -> dict[str, Any]:
    """Limits win over requests (extended resources must have limits; requests default to them)."""
    resources = container.get("resources") or {}
    merged: dict[str, Any] = {}
    merged.update(resources.get("requests") or {})
    merged.update(resources.get("limits") or {})
    return merged


_BINARY_UNITS = ("Ki", "Mi", "Gi", "Ti", "Pi", "Ei")


def _parse_gpu_memory_mib(value: Any, what: str) -> int:
    """gpumem counts MiB: a byte unit (`8Gi`) would be read as that many MiB, so it is refused with the number to
    write instead; so is anything above MAX_GPU_MEMORY_MIB."""
    text = value.strip() if isinstance(value, str) else ""
    if text.endswith(_BINARY_UNITS) and len(text) <= kubeapi.MAX_QUANTITY_TEXT:
        as_bytes = parse_count_quantity(text, what=what)
        hint = f"; for {text} write {as_bytes // 2**20}" if as_bytes and as_bytes % 2**20 == 0 else ""
        raise InvalidGpuRequest(f"{what} counts MiB, so it takes no Ki/Mi/Gi/Ti/Pi/Ei unit, got {text!r}{hint}")
    memory_mib = parse_count_quantity(value, what=what)
    if memory_mib <= 0:
        raise InvalidGpuRequest(f"{what} must be greater than 0 MiB, got {memory_mib}")
    if memory_mib > MAX_GPU_MEMORY_MIB:
        raise InvalidGpuRequest(
            f"{what} must be at most {MAX_GPU_MEMORY_MIB} MiB (more than any GPU has; it counts MiB, not bytes), "
            f"got {memory_mib}"
        )
    return memory_mib


def mig_resources(resources: Iterable[str]) -> list[str]:
    """The MIG resources (nvidia.com/mig-<profile>) among resource names, sorted."""
    return sorted(name for name in resources if isinstance(name, str) and name.startswith(MIG_RESOURCE_PREFIX))


def _parse_task_priority(value: Any, what: str) -> int:
    priority = parse_count_quantity(value, what=what)
    if priority not in (TASK_PRIORITY_HIGH, TASK_PRIORITY_LOW):
        raise InvalidGpuRequest(
            f"{what} must be {TASK_PRIORITY_HIGH} (high priority) or {TASK_PRIORITY_LOW} (low priority), got {priority}"
        )
    return priority


def parse_container_request(container: Mapping[str, Any], *, init: bool) -> ContainerGpuRequest | None:
    """The container's GPU request, or None when it asks for no GPU resource. An init container with
    restartPolicy Always is a native sidecar."""
    name = str(container.get("name", "?"))
    resources = _container_resources(container)
    prefix = f"container {name}: "
    mig = mig_resources(resources)
    if mig:
        return _parse_mig_request(name, resources, mig, init=init, sidecar=init and kubeapi.is_sidecar(container))
    asks = any(key in resources for key in GPU_RESOURCES)
    if RESOURCE_TASK_PRIORITY in resources and not asks:
        raise InvalidGpuRequest(
            f"{prefix}{RESOURCE_TASK_PRIORITY} is the priority of a container's vGPUs, and this container asks for "
            f"none: add {RESOURCE_GPU} (or {RESOURCE_GPU_MEMORY} / {RESOURCE_GPU_CORES}) or remove it"
        )
    if not asks:
        return None
    count = parse_count_quantity(resources.get(RESOURCE_GPU, 1), what=prefix + RESOURCE_GPU)
    memory_mib = memory_percent = None
    if RESOURCE_GPU_MEMORY in resources:
        memory_mib = _parse_gpu_memory_mib(resources[RESOURCE_GPU_MEMORY], prefix + RESOURCE_GPU_MEMORY)
    if RESOURCE_GPU_MEMORY_PERCENTAGE in resources:
        memory_percent = parse_count_quantity(
            resources[RESOURCE_GPU_MEMORY_PERCENTAGE], what=prefix + RESOURCE_GPU_MEMORY_PERCENTAGE
        )
        if memory_percent == 0:  # as in HAMi: 0 is "not set" (gpumem, else the whole GPU's memory)
            memory_percent = None
        elif memory_percent > 100:
            raise InvalidGpuRequest(
                f"{prefix}{RESOURCE_GPU_MEMORY_PERCENTAGE} must be between 1 and 100, got {memory_percent}"
            )
    if memory_mib is not None and memory_percent is not None:
        raise InvalidGpuRequest(
            f"{prefix}set either {RESOURCE_GPU_MEMORY} or {RESOURCE_GPU_MEMORY_PERCENTAGE}, not both"
        )
    cores = parse_count_quantity(resources.get(RESOURCE_GPU_CORES, 0), what=prefix + RESOURCE_GPU_CORES)
    if cores > CORES_PER_GPU:
        raise InvalidGpuRequest(f"{prefix}{RESOURCE_GPU_CORES} must be between 0 and 100, got {cores}")
    task_priority = None
    if RESOURCE_TASK_PRIORITY in resources:
        task_priority = _parse_task_priority(resources[RESOURCE_TASK_PRIORITY], prefix + RESOURCE_TASK_PRIORITY)
    if count == 0:
        if memory_mib is not None or memory_percent is not None or RESOURCE_GPU_CORES in resources:
            raise InvalidGpuRequest(f"{prefix}{RESOURCE_GPU} is 0 but GPU memory or cores are requested")
        if task_priority is not None:
            raise InvalidGpuRequest(f"{prefix}{RESOURCE_GPU} is 0 but {RESOURCE_TASK_PRIORITY} is set")
        return None
    return ContainerGpuRequest(
        name=name,
        count=count,
        memory_mib=memory_mib,
        memory_percent=memory_percent,
        cores=cores,
        init=init,
        sidecar=init and kubeapi.is_sidecar(container),
        task_priority=task_priority,
    )


_MIG_PROFILE = re.compile(r"[1-7]g\.[0-9]{1,4}gb(\+me)?")


def _parse_mig_request(
    name: str, resources: Mapping[str, Any], mig: list[str], *, init: bool, sidecar: bool
) -> ContainerGpuRequest | None:
    """A container asking for MIG devices (nvidia.com/mig-<profile>: N): one profile, no vGPU resources beside it."""
    prefix = f"container {name}: "
    if len(mig) > 1:
        raise InvalidGpuRequest(f"{prefix}asks for several MIG profiles ({', '.join(mig)}); kube-vgpu places one "
                                "MIG profile per container: split it into containers")
    (resource,) = mig
    vgpu = [key for key in (*GPU_RESOURCES, RESOURCE_TASK_PRIORITY) if key in resources]
    if vgpu:
        raise InvalidGpuRequest(f"{prefix}asks for {resource} and {', '.join(vgpu)}: a container gets either MIG "
                                "devices or vGPU shares, not both")
    profile = resource[len(MIG_RESOURCE_PREFIX):]
    if not _MIG_PROFILE.fullmatch(profile):
        raise InvalidGpuRequest(f"{prefix}{_shown(resource)} is not a MIG resource like nvidia.com/mig-3g.20gb")
    if profile.endswith("+me"):
        raise InvalidGpuRequest(f"{prefix}{resource}: media-extension MIG devices are offered under their plain "
                                f"profile, ask for {MIG_RESOURCE_PREFIX}{profile.removesuffix('+me')}")
    if profile not in mig_tables.MIG_PROFILE_NAMES:
        raise InvalidGpuRequest(f"{prefix}{resource}: kube-vgpu places the MIG profiles of A100 40GB/80GB, H100 80GB "
                                f"and H200 141GB ({', '.join(mig_tables.MIG_PROFILE_NAMES)}), not {profile}")
    count = parse_count_quantity(resources[resource], what=prefix + resource)
    if count == 0:
        return None
    return ContainerGpuRequest(name=name, count=count, cores=CORES_PER_GPU, init=init, sidecar=sidecar,
                               mig_profile=profile)


def parse_pod_gpu_request(pod: Mapping[str, Any]) -> PodGpuRequest:
    """Parse a Pod object (as JSON-decoded dict) into its GPU request. Raises InvalidGpuRequest."""
    spec = pod.get("spec") or {}
    metadata = pod.get("metadata") or {}
    annotations = metadata.get("annotations") or {}
    containers: list[ContainerGpuRequest] = []
    for init, key in ((True, "initContainers"), (False, "containers")):
        for container in spec.get(key) or ():
            parsed = parse_container_request(container, init=init)
            if parsed is not None:
                containers.append(parsed)
    selectors = GpuSelectors(
        use_types=_annotation_list(annotations, ANNOTATION_USE_GPU_TYPE, lower=True),
        nouse_types=_annotation_list(annotations, ANNOTATION_NOUSE_GPU_TYPE, lower=True),
        use_uuids=_annotation_list(annotations, ANNOTATION_USE_GPU_UUID, lower=False),
        nouse_uuids=_annotation_list(annotations, ANNOTATION_NOUSE_GPU_UUID, lower=False),
        numa_bind=str(annotations.get(ANNOTATION_NUMA_BIND, "")).lower() == "true",
    )
    if _check_vgpu_mode(annotations):
        containers = [_mig_by_memory(container) for container in containers]
    return PodGpuRequest(
        containers=tuple(containers),
        selectors=selectors,
        gpu_policy=_policy_annotation(annotations, ANNOTATION_GPU_POLICY),
        node_policy=_policy_annotation(annotations, ANNOTATION_NODE_POLICY),
    )


def _check_vgpu_mode(annotations: Mapping[str, Any]) -> bool:
    """HAMi's nvidia.com/vgpu-mode: hami-core is the in-container limiter (what kube-vgpu does by default); mig is
    dynamic MIG (True: the GPU containers are to get new MIG instances sized by their memory); mps is refused, never
    silently turned into a shared vGPU."""
    mode = annotations.get(ANNOTATION_VGPU_MODE)
    if mode is None:
        return False
    if not isinstance(mode, str):
        raise InvalidGpuRequest(f"annotation {ANNOTATION_VGPU_MODE} must be a string")
    if mode.strip().lower() == VGPU_MODE_HAMI_CORE:
        return False
    if mode.strip().lower() == VGPU_MODE_MIG:
        return True
    raise InvalidGpuRequest(
        f"annotation {ANNOTATION_VGPU_MODE}: {_shown(mode)} is not supported; kube-vgpu shares GPUs with the "
        f"in-container limiter ({VGPU_MODE_HAMI_CORE}) or partitions them with MIG ({VGPU_MODE_MIG}): remove the "
        f"annotation or set it to one of those"
    )


def _mig_by_memory(container: ContainerGpuRequest) -> ContainerGpuRequest:
    """vgpu-mode: mig: a vGPU container becomes `count` dynamic MIG instances of the smallest allowed profile with
    its nvidia.com/gpumem (the node decides the profile: names differ by GPU model). A container naming a MIG
    resource keeps it."""
    if container.mig_profile is not None:
        return container
    if container.memory_mib is None:
        raise InvalidGpuRequest(
            f"container {container.name}: annotation {ANNOTATION_VGPU_MODE}: mig chooses the MIG profile by memory: "
            f"set {RESOURCE_GPU_MEMORY} (MiB) per GPU ({RESOURCE_GPU_MEMORY_PERCENTAGE} is not read in this mode), or "
            f"ask for a profile with {MIG_RESOURCE_PREFIX}<profile>"
        )
    return dataclasses.replace(container, mig_memory_mib=container.memory_mib, cores=CORES_PER_GPU,
                               memory_percent=None)


def _policy_annotation(annotations: Mapping[str, Any], key: str) -> str | None:
    """A policy annotation's name, HAMi's aliases read as ours (topology-aware is topology). HAMi's comma chains
    and the HAMi policies kube-vgpu does not implement are refused with what to write instead; other unknown names
    are the extender's to judge (its registry may hold more), and the webhook's (protocol.POLICY_NAMES)."""
    raw = annotations.get(key)
    if raw is None:
        return None
    if not isinstance(raw, str):
        raise InvalidGpuRequest(f"annotation {key} must be a string")
    name = raw.strip()
    if not name:
        return None
    names = ", ".join(POLICY_NAMES)
    if "," in name:
        parts = [part.strip() for part in name.split(",") if part.strip()]
        hints = [UNSUPPORTED_HAMI_POLICIES[part] for part in parts if part in UNSUPPORTED_HAMI_POLICIES]
        raise InvalidGpuRequest(
            f"annotation {key}: {_shown(name)} is a chain of policies, which kube-vgpu does not read; name one policy "
            f"({names})" + "".join(f"; {hint}" for hint in hints)
        )
    name = POLICY_ALIASES.get(name, name)
    if name in UNSUPPORTED_HAMI_POLICIES:
        raise InvalidGpuRequest(
            f"annotation {key}: HAMi's policy {name!r} is not implemented by kube-vgpu: "
            f"{UNSUPPORTED_HAMI_POLICIES[name]}, or name one policy ({names})"
        )
    return name


def pod_asks_for_gpu(pod: Mapping[str, Any]) -> bool:
    """Cheap check (no parsing) whether any container names a GPU resource, HAMi's task priority or a MIG slice."""
    spec = pod.get("spec") or {}
    for key in ("initContainers", "containers"):
        for container in spec.get(key) or ():
            resources = container.get("resources") or {}
            for section in ("limits", "requests"):
                names = resources.get(section)
                if names and any(
                    isinstance(r, str)
                    and (r in GPU_RESOURCES or r == RESOURCE_TASK_PRIORITY or r.startswith(MIG_RESOURCE_PREFIX))
                    for r in names
                ):
                    return True
    return False
