"""Mutable in-memory model of GPU nodes used by the placement engine.

Pure data, no I/O. Hot paths (filter over thousands of nodes) read these objects directly, so they
use __slots__ and plain attributes; derived numbers are kept up to date on every change instead of
being recomputed per request.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, NamedTuple

from kube_vgpu.protocol import (
    CORES_PER_GPU,
    ContainerAssignment,
    ContainerGpuRequest,
    DeviceShare,
    DynamicMigPlacement,
    GpuInfo,
    GpuLink,
    MigDevice,
    NodeInventory,
    PodAssignment,
    PodGpuRequest,
)
from kube_vgpu.protocol.mig import MIG_MODELS, MigModel, MigProfile

#: link matrix (as a tuple) -> small id; one entry per distinct hardware layout in the cluster
_LINK_IDS: dict[tuple[tuple[int, ...], ...], int] = {}
_LINK_IDS_LOCK = threading.Lock()


def link_score(link: GpuLink | None) -> int:
    """How well two GPUs talk, higher is better: any NVLink beats any PCIe path."""
    if link is None:
        return 0
    if link.nvlinks > 0:
        return 100 + link.nvlinks
    return 6 - link.pcie.rank  # 6 (same board) .. 1 (cross NUMA)


class GpuState:
    """One physical GPU and what is reserved on it."""

    __slots__ = (
        "cores",
        "dynamic_mig",
        "exclusive_holders",
        "healthy",
        "index",
        "max_vgpus",
        "memory_mib",
        "mig_mask",
        "mig_mode",
        "mig_parent",
        "mig_profile",
        "mig_start",
        "model",
        "model_lower",
        "numa_node",
        "position",
        "used_cores",
        "used_memory_mib",
        "used_vgpus",
        "uuid",
    )

    def __init__(self, info: GpuInfo, position: int) -> None:
        self.uuid = info.uuid
        self.index = info.index
        self.position = position  # place in NodeState.gpus; the link matrix is indexed by it
        self.model = info.model
        self.model_lower = info.model.lower()
        self.memory_mib = info.memory_mib
        self.cores = info.cores
        self.max_vgpus = info.max_vgpus
        self.numa_node = info.numa_node
        self.healthy = info.healthy
        self.mig_mode = info.mig_mode
        self.used_memory_mib = 0
        self.used_cores = 0
        self.used_vgpus = 0
        # pods that reached the GPU without kube-vgpu (reported by the device plugin) hold it entirely
        self.exclusive_holders = 1 if info.external_pods else 0
        self.mig_profile: str | None = None  # set on a MIG device (mig_device)
        self.mig_parent: int | None = None  # a MIG device's GPU (its position)
        #: dynamic MIG, on a GPU the device plugin partitions per pod: its model's table, allowlist and the slots
        #: its existing instances occupy (None elsewhere)
        self.dynamic_mig: DynamicGpu | None = None
        #: dynamic MIG, on a placement (a virtual MIG device): its start slot and the slots it occupies (0 elsewhere)
        self.mig_start = -1
        self.mig_mask = 0

    @classmethod
    def mig_device(cls, parent: GpuInfo, parent_position: int, device: MigDevice, position: int) -> GpuState:
        """One MIG device of a GPU in MIG mode, as a unit of its own: held whole by one container (one slot, the
        whole compute), never offered to vGPUs (mig_mode), healthy and held by outside pods as its GPU is."""
        unit = cls(parent, position)
        unit.uuid = device.uuid
        unit.memory_mib = device.memory_mib
        unit.cores = CORES_PER_GPU
        unit.max_vgpus = 1
        unit.mig_profile = device.profile
        unit.mig_parent = parent_position
        return unit

    @classmethod
    def dynamic_placement(cls, parent: GpuInfo, parent_position: int, profile: MigProfile, start: int,
                          position: int) -> GpuState:
        """Dynamic MIG: one legal placement of a profile on a dynamic GPU, a virtual MIG device held whole by one
        container (an assignment names it DynamicMigPlacement.device). It exists on the GPU only once the device
        plugin created it for the pod; until then holding it reserves its slots."""
        device = MigDevice(DynamicMigPlacement(parent.uuid, profile.name, start).device, profile.name, 0, 0,
                           profile.memory_mib, profile.multiprocessors, start, profile.memory_slices)
        unit = cls.mig_device(parent, parent_position, device, position)
        unit.mig_start = start
        unit.mig_mask = ((1 << profile.memory_slices) - 1) << start
        return unit

    @property
    def free_memory_mib(self) -> int:
        return self.memory_mib - self.used_memory_mib

    @property
    def free_cores(self) -> int:
        return self.cores - self.used_cores

    @property
    def free_shares(self) -> int:
        return self.max_vgpus - self.used_vgpus

    @property
    def schedulable(self) -> bool:
        # MIG-enabled GPUs are partitioned by the hardware; HAMi-core's limiter cannot share them.
        return self.healthy and not self.mig_mode

    @property
    def idle(self) -> bool:
        return self.used_vgpus == 0

    def copy(self) -> GpuState:
        """An independent copy (what-if planning changes its usage without touching the original)."""
        twin = object.__new__(GpuState)
        for name in GpuState.__slots__:
            setattr(twin, name, getattr(self, name))
        return twin


@dataclass(frozen=True, slots=True)
class DynamicGpu:
    """A dynamic MIG GPU's hardware facts (from the inventory's migDynamic): NVIDIA's table of its model, the
    profiles the operator allows, and the slots its existing instances occupy."""

    model: MigModel
    profiles: tuple[MigProfile, ...]
    instance_mask: int
    instances: tuple[tuple[str, int], ...]  # (profile, start) of the instances that exist now


@dataclass(frozen=True, slots=True)
class GpuUsage:
    """What one pod holds on one GPU (the peak over the moments its containers run at once: peak_usage)."""

    position: int
    memory_mib: int
    cores: int
    vgpus: int  # vGPU slots taken (one per vGPU; inventory key maxShares bounds them)
    exclusive: bool


@dataclass(frozen=True, slots=True)
class ContainerPlacement:
    request: ContainerGpuRequest
    # (gpu position, memory MiB, cores) per vGPU
    devices: tuple[tuple[int, int, int], ...]

    # the container's kind, so placements group into phases like requests and assignments (container_phases)
    @property
    def init(self) -> bool:
        return self.request.init

    @property
    def sidecar(self) -> bool:
        return self.request.sidecar


def peak_usage(node: NodeState, phases: Iterable[Iterable[tuple[int, int, int]]]) -> tuple[GpuUsage, ...]:
    """What a pod holds per GPU of `node`: for every GPU, the largest memory, cores, vGPU count and exclusivity
    over the moments its containers run at once. `phases`: per moment (protocol.container_phases), the
    (GPU position, memory MiB, cores) of every vGPU running then. A vGPU with the GPU's whole compute is exclusive.

    The one phase peak of the extender: placement computes a pod's usage with it, and the cluster state applies the
    same to the written assignment, so a placement and its assignment always count the same after a restart.
    Positions address node.devices (a MIG device is held whole: its one slot and its whole compute)."""
    gpus = node.devices
    peak: dict[int, list[int]] = {}  # position -> [memory, cores, shares, exclusive]
    for phase in phases:
        totals: dict[int, list[int]] = {}
        for position, memory_mib, cores in phase:
            entry = totals.get(position)
            if entry is None:
                entry = totals[position] = [0, 0, 0, 0]
            entry[0] += memory_mib
            entry[1] += cores
            entry[2] += 1
            if cores >= gpus[position].cores:
                entry[3] = 1
        for position, values in totals.items():
            current = peak.get(position)
            if current is None:
                peak[position] = values
            else:
                for i in range(4):
                    if values[i] > current[i]:
                        current[i] = values[i]
    return tuple(GpuUsage(position, v[0], v[1], v[2], bool(v[3])) for position, v in sorted(peak.items()))


class Placement(NamedTuple):
    """Where a pod's vGPUs go on one node, with the node's score under the policy that chose it. A named tuple, not
    a frozen dataclass: as immutable, and a new request shape's batch builds one per node (new_placement), 5000 in
    ~2 ms, against ~7 ms through a frozen dataclass's slots."""

    node_name: str
    containers: tuple[ContainerPlacement, ...]
    usage: tuple[GpuUsage, ...]
    score: float = 0.0


#: tuple.__new__, for loops that build many named tuples (Placement) without their own __new__, a Python call
NEW_TUPLE = tuple.__new__


def new_placement(node_name: str, containers: tuple[ContainerPlacement, ...], usage: tuple[GpuUsage, ...],
                  score: float) -> Placement:
    """Placement(node_name, containers, usage, score) without the named tuple's own __new__ (a Python call); hot
    loops inline the same NEW_TUPLE call."""
    return NEW_TUPLE(Placement, (node_name, containers, usage, score))


@dataclass(frozen=True, slots=True)
class FitFailure:
    """Why a pod cannot go on a node. `unresolvable`: no amount of waiting makes it fit."""

    reason: str
    unresolvable: bool = False
    #: short class of the reason for metrics: no-gpus, count, memory, cores, shares, exclusive, health, numa, host, ...
    code: str = "unfit"


@dataclass(frozen=True, slots=True)
class PlacementRequest:
    """Everything the engine needs to place a pod: its GPU request plus host resources (used by the
    simulator and by policies that weigh CPU; the live extender leaves host checks to kube-scheduler)."""

    gpu: PodGpuRequest
    cpu_milli: int = 0
    memory_mib: int = 0
    gpu_spec: tuple[str, ...] = ()  # exact model names allowed (openb traces); empty = any
    #: what the containers' `cores` are out of: percent for real pods (nvidia.com/gpucores); the simulator asks in
    #: milli-GPU of GPUs modelled with 1000 cores. Only GPU-independent views (task shapes) need it; fit compares
    #: cores with each GPU's own `cores`.
    cores_per_gpu: int = CORES_PER_GPU

    @property
    def cpu_only(self) -> bool:
        return self.gpu.is_empty


def usage_kind(usage: tuple[GpuUsage, ...]) -> str | None:
    """A pod's GPU kind from what it holds: None (no GPU), "share" (part of one GPU) or "<n>-gpu"."""
    if not usage:
        return None
    if len(usage) == 1 and not usage[0].exclusive:
        return "share"
    return f"{len(usage)}-gpu"


class NodeState:
    """A node, its GPUs and the totals the engine keeps current."""

    __slots__ = (
        "cpu_milli_total",
        "cpu_milli_used",
        "devices",
        "dynamic_mig_devices",
        "equivalence_key",
        "fit_cache",
        "free_milli_cache",
        "gpu_by_uuid",
        "gpu_memory_mib",
        "gpu_model",
        "gpus",
        "has_links",
        "heartbeat_s",
        "inventory_external",
        "inventory_text",
        "journal",
        "labels",
        "link_id",
        "link_matrix",
        "memory_mib_total",
        "memory_mib_used",
        "mig_devices",
        "models_lower",
        "name",
        "pod_kinds",
        "version",
        "version_cache",
    )

    def __init__(
        self,
        name: str,
        inventory: NodeInventory | None,
        *,
        labels: dict[str, str] | None = None,
        cpu_milli_total: int = 0,
        memory_mib_total: int = 0,
    ) -> None:
        self.name = name
        self.labels = labels or {}
        self.heartbeat_s: float | None = None
        self.inventory_text: str | None = None
        self.cpu_milli_total = cpu_milli_total
        self.memory_mib_total = memory_mib_total
        self.cpu_milli_used = 0
        self.memory_mib_used = 0
        self.version = 0
        # scheduler's request key -> Placement | FitFailure; valid for this node version only (after a learning
        # policy's model changes, the scheduler re-places these a few nodes at a time)
        self.fit_cache: dict[Any, Any] = {}
        self.free_milli_cache: tuple[int, ...] | None = None  # engine.shares free share per GPU (policies._milli)
        #: values policies derive from this version of the node (keyed by what else they depend on); dropped by touch()
        self.version_cache: dict[Any, Any] = {}
        #: the extender's node-equivalence key of this version (scheduler.equivalence_key; None: not computed yet)
        self.equivalence_key: Any = None
        #: where touch() records this node's name (the cluster state's change journal; None: nowhere, e.g. a copy)
        self.journal: list[str] | None = None
        # how many pods of each GPU kind ("share", "1-gpu", "2-gpu", ...) hold GPUs here (kept by apply_usage;
        # the gpu-clustering policy groups pods of one kind on the same nodes)
        self.pod_kinds: dict[str, int] = {}
        self.gpus: list[GpuState] = []
        #: static MIG: the MIG devices of the GPUs in MIG mode, positioned after the GPUs; `devices` is both lists,
        #: indexed by position (usage, scratch and assignments address either kind). Everything that measures the
        #: node's GPUs (totals, fragmentation, policies) reads `gpus` alone.
        self.mig_devices: list[GpuState] = []
        #: dynamic MIG: every legal placement of every allowed profile on the dynamic GPUs (virtual MIG devices),
        #: positioned after the static MIG devices
        self.dynamic_mig_devices: list[GpuState] = []
        self.devices: list[GpuState] = []
        self.gpu_by_uuid: dict[str, GpuState] = {}
        self.link_matrix: list[list[int]] = []
        self.inventory_external: dict[str, tuple[str, ...]] = {}
        self.models_lower: frozenset[str] = frozenset()
        self.set_inventory(inventory)

    def set_inventory(self, inventory: NodeInventory | None) -> None:
        """Replace the hardware description; reservations must be re-applied by the caller."""
        gpus_info = sorted(inventory.gpus, key=lambda g: g.index) if inventory else []
        self.pod_kinds = {}  # reservations are re-applied by the caller, kinds with them
        self.gpus = [GpuState(info, position) for position, info in enumerate(gpus_info)]
        self.mig_devices = []
        for parent_position, info in enumerate(gpus_info):
            if info.mig_mode:
                for device in sorted(info.mig_devices, key=lambda d: d.start):
                    position = len(self.gpus) + len(self.mig_devices)
                    self.mig_devices.append(GpuState.mig_device(info, parent_position, device, position))
        self.dynamic_mig_devices = []
        for parent_position, info in enumerate(gpus_info):
            dynamic = _dynamic_gpu(info)
            if dynamic is None:
                continue
            self.gpus[parent_position].dynamic_mig = dynamic
            for profile in dynamic.profiles:
                for start in profile.starts:
                    position = len(self.gpus) + len(self.mig_devices) + len(self.dynamic_mig_devices)
                    self.dynamic_mig_devices.append(
                        GpuState.dynamic_placement(info, parent_position, profile, start, position))
        self.devices = self.gpus + self.mig_devices + self.dynamic_mig_devices
        self.gpu_by_uuid = {gpu.uuid: gpu for gpu in self.devices}
        position_of_index = {gpu.index: gpu.position for gpu in self.gpus}
        size = len(self.gpus)
        matrix = [[0] * size for _ in range(size)]
        for info in gpus_info:
            here = position_of_index[info.index]
            for link in info.links:
                there = position_of_index.get(link.peer_index)
                if there is not None and there != here:
                    matrix[here][there] = link_score(link)
        # links should be symmetric; if a producer only described one direction, mirror the better one
        for a in range(size):
            for b in range(a + 1, size):
                best = max(matrix[a][b], matrix[b][a])
                matrix[a][b] = matrix[b][a] = best
        self.link_matrix = matrix
        self.has_links = any(any(row) for row in matrix)
        # nodes of one hardware type share link matrices: an id lets policies memoise topology choices across them
        layout = tuple(tuple(row) for row in matrix)
        with _LINK_IDS_LOCK:
            self.link_id = _LINK_IDS.setdefault(layout, len(_LINK_IDS))
        # the node's GPU class for GPU-independent measures (fragmentation): first GPU's model, smallest memory
        self.gpu_model = self.gpus[0].model if self.gpus else ""
        self.gpu_memory_mib = min((gpu.memory_mib for gpu in self.gpus), default=0)
        self.models_lower = frozenset(gpu.model_lower for gpu in self.gpus)
        self.inventory_external = {info.uuid: info.external_pods for info in gpus_info if info.external_pods}
        self.touch()

    def copy(self) -> NodeState:
        """A what-if copy: its GPUs' usage can change without touching this node, its version or its caches.
        Hardware (link matrix, labels, inventory) is shared, never mutated after set_inventory."""
        twin = object.__new__(NodeState)
        for name in NodeState.__slots__:
            setattr(twin, name, getattr(self, name))
        twin.gpus = [gpu.copy() for gpu in self.gpus]
        twin.mig_devices = [device.copy() for device in self.mig_devices]
        twin.dynamic_mig_devices = [device.copy() for device in self.dynamic_mig_devices]
        twin.devices = twin.gpus + twin.mig_devices + twin.dynamic_mig_devices
        twin.gpu_by_uuid = {gpu.uuid: gpu for gpu in twin.devices}
        twin.pod_kinds = dict(self.pod_kinds)
        twin.fit_cache = {}
        twin.free_milli_cache = None
        twin.version_cache = {}
        twin.equivalence_key = None
        twin.journal = None  # what-if changes are nobody's news
        return twin

    def touch(self) -> None:
        """Record a change: cached fit results and policy data are no longer valid."""
        self.version += 1
        if self.fit_cache:
            self.fit_cache = {}
        self.free_milli_cache = None
        if self.version_cache:
            self.version_cache = {}
        self.equivalence_key = None
        if self.journal is not None:
            self.journal.append(self.name)

    def apply_usage(self, usage: tuple[GpuUsage, ...], sign: int = 1) -> None:
        """Add (sign=1) or remove (sign=-1) a pod's usage (on GPUs and MIG devices)."""
        gpus = self.devices
        for item in usage:
            gpu = gpus[item.position]
            gpu.used_memory_mib += sign * item.memory_mib
            gpu.used_cores += sign * item.cores
            gpu.used_vgpus += sign * item.vgpus
            if item.exclusive:
                gpu.exclusive_holders += sign
            if gpu.mig_mask and gpu.mig_parent is not None:
                # a dynamic MIG instance makes its GPU a MIG GPU: no vGPU shares it while the instance is held
                gpus[gpu.mig_parent].exclusive_holders += sign
        gpu_count = len(self.gpus)  # a pod's kind (clustering) is its GPU shares' kind, MIG devices aside
        kind = usage_kind(usage if all(u.position < gpu_count for u in usage)
                          else tuple(u for u in usage if u.position < gpu_count))
        if kind is not None:
            count = self.pod_kinds.get(kind, 0) + sign
            if count > 0:
                self.pod_kinds[kind] = count
            else:
                self.pod_kinds.pop(kind, None)
        self.touch()

    # --- totals for scoring and reporting -------------------------------------------------------
    @property
    def total_memory_mib(self) -> int:
        return sum(gpu.memory_mib for gpu in self.gpus)

    @property
    def used_memory_mib(self) -> int:
        return sum(gpu.used_memory_mib for gpu in self.gpus)

    @property
    def total_cores(self) -> int:
        return sum(gpu.cores for gpu in self.gpus)

    @property
    def used_cores(self) -> int:
        return sum(gpu.used_cores for gpu in self.gpus)


def _dynamic_gpu(info: GpuInfo) -> DynamicGpu | None:
    """The engine's view of a dynamic MIG GPU; None for other GPUs, and for one whose model this extender does not
    know (a newer device plugin's): it is left alone rather than refused."""
    dynamic = info.dynamic_mig
    if dynamic is None:
        return None
    model = next((m for m in MIG_MODELS if m.key == dynamic.model), None)
    if model is None:
        return None
    profiles = tuple(p for name in dynamic.profiles if (p := model.profile(name)) and not name.endswith("+me"))
    mask = 0
    for device in dynamic.instances:
        mask |= ((1 << device.size) - 1) << device.start
    return DynamicGpu(model, profiles, mask, tuple((d.profile, d.start) for d in dynamic.instances))


def assignment_from_placement(node: NodeState, placement: Placement) -> PodAssignment:
    """The wire assignment for an engine placement (GPU positions on `node` -> UUIDs)."""
    return PodAssignment(
        node=placement.node_name,
        containers=tuple(
            ContainerAssignment(
                name=container.request.name,
                init=container.request.init,
                sidecar=container.request.sidecar,
                devices=tuple(
                    DeviceShare(node.devices[position].uuid, memory, cores)
                    for position, memory, cores in container.devices
                ),
            )
            for container in placement.containers
        ),
    )
