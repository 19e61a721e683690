"""GPU discovery: NVML -> NodeInventory (protocol module), with topology.

Per GPU: UUID, index, name, total memory, PCI bus id, NUMA node (NVML, falling back to sysfs), MIG mode.
Per pair: NVLink lanes (direct, or through an NVSwitch fabric detected from the remote device type) and the
PCIe common-ancestor level.

Failures degrade, never lie: a query NVML does not support (NotSupported) or an old driver lacks
(FunctionNotFound) leaves the field at its most pessimistic value with a log line saying so; a GPU that is lost
is kept as unhealthy when it could still be identified, dropped otherwise; a missing libnvidia-ml gives an empty
inventory (nothing can be scheduled here) rather than a crash. `kube-vgpu cluster synth` runs this same code on a
fake NVML, so synthetic nodes carry exactly what a real device plugin would publish.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kube_vgpu import protocol
from kube_vgpu.deviceplugin import nvml as nv
from kube_vgpu.deviceplugin.nvml import Nvml, normalize_bus_id
from kube_vgpu.protocol import GpuInfo, GpuLink, NodeInventory, PcieLevel, mig

log = logging.getLogger(__name__)

_LEVELS = {
    nv.TOPOLOGY_INTERNAL: PcieLevel.SAME_BOARD,
    nv.TOPOLOGY_SINGLE: PcieLevel.SINGLE_SWITCH,
    nv.TOPOLOGY_MULTIPLE: PcieLevel.MULTI_SWITCH,
    nv.TOPOLOGY_HOSTBRIDGE: PcieLevel.HOST_BRIDGE,
    nv.TOPOLOGY_NODE: PcieLevel.SAME_NUMA,
    nv.TOPOLOGY_SYSTEM: PcieLevel.CROSS_NUMA,
}


@dataclass(slots=True)
class _Gpu:
    index: int
    handle: Any
    uuid: str
    model: str
    memory_mib: int
    bus_id: str = ""
    numa_node: int | None = None
    mig_mode: bool = False
    mig_devices: tuple[protocol.MigDevice, ...] = ()
    lost: bool = False
    direct_lanes: dict[int, int] = field(default_factory=dict)  # peer NVML index -> lanes
    switch_lanes: int = 0


@dataclass(slots=True)
class Discovery:
    """What discovery found. `handles` maps UUID -> NVML handle for the health monitor."""

    inventory: NodeInventory
    handles: dict[str, Any] = field(default_factory=dict)
    driver_version: str | None = None
    nvml_available: bool = True
    #: one human-readable line per degradation (also logged)
    problems: list[str] = field(default_factory=list)


class _Notes:
    def __init__(self) -> None:
        self.lines: list[str] = []
        self._seen: set[str] = set()

    def warn(self, line: str, *, once_key: str | None = None) -> None:
        key = once_key or line
        if key in self._seen:
            return
        self._seen.add(key)
        self.lines.append(line)
        log.warning("%s", line)


def discover(
    nvml: Nvml,
    *,
    sharing_count: int = protocol.DEFAULT_MAX_VGPUS_PER_GPU,
    sysfs_root: Path = Path("/sys"),
) -> Discovery:
    """Initialise NVML (left initialised for the health monitor) and describe every GPU."""
    if sharing_count < 1:
        raise ValueError(f"sharing count must be at least 1, got {sharing_count}")
    notes = _Notes()
    try:
        nvml.init()
    except nv.LibraryNotFound:
        notes.warn(
            "NVML library libnvidia-ml.so.1 not found: is the NVIDIA driver installed and does this container run "
            "with the NVIDIA container runtime? Publishing an empty GPU inventory."
        )
        return Discovery(NodeInventory(gpus=()), nvml_available=False, problems=notes.lines)
    except nv.NVMLError as exc:
        notes.warn(f"NVML failed to initialise ({exc}); publishing an empty GPU inventory")
        return Discovery(NodeInventory(gpus=()), nvml_available=False, problems=notes.lines)

    driver_version = None
    try:
        driver_version = nvml.driver_version()
    except nv.NVMLError as exc:
        notes.warn(f"NVML could not report the driver version ({exc})")

    try:
        count = nvml.device_count()
    except nv.NVMLError as exc:
        notes.warn(f"NVML cannot count the GPUs ({exc}); publishing an empty GPU inventory")
        return Discovery(NodeInventory(gpus=()), driver_version=driver_version, problems=notes.lines)
    gpus = [gpu for index in range(count) if (gpu := _describe(nvml, index, sysfs_root, notes))]
    by_bus = {normalize_bus_id(gpu.bus_id): gpu.index for gpu in gpus if gpu.bus_id}
    for gpu in gpus:
        if not gpu.lost:
            _scan_nvlinks(nvml, gpu, by_bus, notes)
    infos = []
    for gpu in gpus:
        links = []
        for peer in gpus:
            if peer.index == gpu.index:
                continue
            via_switch = gpu.switch_lanes > 0 and peer.switch_lanes > 0
            # lanes through the fabric are limited by the GPU with fewer of them; symmetric by construction
            lanes = gpu.direct_lanes.get(peer.index, 0) + (
                min(gpu.switch_lanes, peer.switch_lanes) if via_switch else 0
            )
            links.append(GpuLink(peer.index, lanes, via_switch, _pcie_level(nvml, gpu, peer, notes)))
        infos.append(
            GpuInfo(
                uuid=gpu.uuid,
                index=gpu.index,
                model=gpu.model,
                memory_mib=gpu.memory_mib,
                max_vgpus=sharing_count,
                numa_node=gpu.numa_node,
                pci_bus_id=gpu.bus_id,
                healthy=not gpu.lost,
                mig_mode=gpu.mig_mode,
                links=tuple(links),
                mig_devices=gpu.mig_devices,
            )
        )
    return Discovery(
        inventory=NodeInventory(gpus=tuple(infos)),
        handles={gpu.uuid: gpu.handle for gpu in gpus},
        driver_version=driver_version,
        problems=notes.lines,
    )


def _describe(nvml: Nvml, index: int, sysfs_root: Path, notes: _Notes) -> _Gpu | None:
    """One GPU's own properties; None when it cannot even be identified."""
    try:
        handle = nvml.handle(index)
        uuid = nvml.uuid(handle)
        model = nvml.name(handle)
    except nv.NVMLError as exc:
        notes.warn(f"GPU at NVML index {index} cannot be identified ({exc}); it is left out of the inventory")
        return None
    try:
        memory_mib = nvml.memory_total_mib(handle)
    except nv.NVMLError as exc:
        # without its size the GPU cannot be offered; keep it visible as unhealthy only if lost
        notes.warn(f"GPU {index} ({uuid}) does not report its memory ({exc}); it is left out of the inventory")
        return None
    gpu = _Gpu(index=index, handle=handle, uuid=uuid, model=model, memory_mib=memory_mib)
    try:
        gpu.bus_id = nvml.pci_bus_id(handle)
    except nv.GpuIsLost:
        return _lost(gpu, notes)
    except nv.NVMLError as exc:
        notes.warn(f"GPU {index} ({uuid}): PCI bus id unavailable ({exc}); NUMA from sysfs and NVLink peers unknown")
    try:
        gpu.numa_node = nvml.numa_node(handle)
    except nv.GpuIsLost:
        return _lost(gpu, notes)
    except nv.NVMLError as exc:
        gpu.numa_node = _sysfs_numa_node(sysfs_root, gpu.bus_id)
        notes.warn(
            f"NVML cannot report NUMA nodes ({exc}); read them from {sysfs_root}/bus/pci/devices/*/numa_node",
            once_key="numa",
        )
    try:
        gpu.mig_mode = nvml.mig_enabled(handle)
    except nv.GpuIsLost:
        return _lost(gpu, notes)
    except nv.UNAVAILABLE:
        gpu.mig_mode = False  # GPUs without MIG support answer NotSupported: not an error
    except nv.NVMLError as exc:
        notes.warn(f"GPU {index} ({uuid}): MIG mode unknown ({exc}); assumed off")
    if gpu.mig_mode:
        try:
            gpu.mig_devices = _mig_devices(nvml, gpu, notes)
        except nv.GpuIsLost:
            return _lost(gpu, notes)
    return gpu


def _mig_devices(nvml: Nvml, gpu: _Gpu, notes: _Notes) -> tuple[protocol.MigDevice, ...]:
    """The MIG devices of a GPU in MIG mode (static MIG: what an operator created). Only a compute instance that
    spans its whole GPU instance is published (NVIDIA's mixed strategy offers no others); the rest are logged. Any
    NVML failure publishes none for this GPU: it then takes no MIG pod rather than a wrongly described one."""
    where = f"GPU {gpu.index} ({gpu.uuid})"
    devices = []
    try:
        for index in range(nvml.max_mig_devices(gpu.handle)):
            try:
                handle = nvml.mig_device(gpu.handle, index)
            except nv.NotFound:
                continue
            uuid = nvml.uuid(handle)
            gpu_instance = nvml.gpu_instance_id(handle)
            compute_instance = nvml.compute_instance_id(handle)
            multiprocessors, gi_slices, ci_slices, memory_mib = nvml.mig_attributes(handle)
            if ci_slices != gi_slices:
                notes.warn(f"{where}: MIG device {uuid} is a {ci_slices}-slice compute instance of a {gi_slices}-slice "
                           "GPU instance; only compute instances spanning their GPU instance are offered")
                continue
            _profile_id, start, size = nvml.gpu_instance_placement(gpu.handle, gpu_instance)
            devices.append(protocol.MigDevice(
                uuid=uuid, profile=mig.profile_name(gi_slices, memory_mib, gpu.memory_mib), gpu_instance=gpu_instance,
                compute_instance=compute_instance, memory_mib=memory_mib, multiprocessors=multiprocessors,
                start=start, size=size,
            ))
    except nv.GpuIsLost:
        raise
    except (nv.NVMLError, ValueError) as exc:
        notes.warn(f"{where}: its MIG devices cannot be listed ({exc}); none are offered")
        return ()
    return tuple(devices)


def _lost(gpu: _Gpu, notes: _Notes) -> _Gpu:
    gpu.lost = True
    notes.warn(f"GPU {gpu.index} ({gpu.uuid}) is lost (fell off the bus?); published as unhealthy")
    return gpu


def _sysfs_numa_node(sysfs_root: Path, bus_id: str) -> int | None:
    if not bus_id:
        return None
    path = sysfs_root / "bus" / "pci" / "devices" / normalize_bus_id(bus_id) / "numa_node"
    try:
        node = int(path.read_text().strip())
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None  # -1: the platform reports no affinity


def _scan_nvlinks(nvml: Nvml, gpu: _Gpu, by_bus: dict[str, int], notes: _Notes) -> None:
    """Count active NVLink lanes to each peer GPU and to an NVSwitch fabric."""
    for link in range(nv.NVLINK_MAX_LINKS):
        try:
            if not nvml.nvlink_active(gpu.handle, link):
                continue
        except nv.InvalidArgument:
            return  # past the GPU's last link
        except nv.NotSupported:
            return  # no NVLink on this GPU (or past its last link on some drivers)
        except nv.GpuIsLost:
            _lost(gpu, notes)
            return
        except nv.NVMLError as exc:
            notes.warn(f"GPU {gpu.index} ({gpu.uuid}): NVLink state unavailable ({exc}); NVLinks not counted")
            return
        try:
            remote_bus = normalize_bus_id(nvml.nvlink_remote_bus_id(gpu.handle, link))
        except nv.GpuIsLost:
            _lost(gpu, notes)
            return
        except nv.NVMLError as exc:
            notes.warn(f"GPU {gpu.index} ({gpu.uuid}): NVLink {link} remote end unknown ({exc}); lane not counted")
            continue
        try:
            remote_type = nvml.nvlink_remote_type(gpu.handle, link)
        except nv.GpuIsLost:
            _lost(gpu, notes)
            return
        except nv.NVMLError as exc:
            # older drivers: a remote end that is not one of our GPUs is taken to be an NVSwitch
            remote_type = nv.NVLINK_DEVICE_TYPE_GPU if remote_bus in by_bus else nv.NVLINK_DEVICE_TYPE_SWITCH
            notes.warn(
                f"NVML cannot report NVLink remote device types ({exc}); a remote end that is not a local GPU "
                "is taken to be an NVSwitch",
                once_key="remote-type",
            )
        if remote_type == nv.NVLINK_DEVICE_TYPE_SWITCH:
            gpu.switch_lanes += 1
        elif remote_type == nv.NVLINK_DEVICE_TYPE_GPU and remote_bus in by_bus:
            peer = by_bus[remote_bus]
            gpu.direct_lanes[peer] = gpu.direct_lanes.get(peer, 0) + 1
        # other remote types (IBM NPU: a CPU link) do not connect GPUs


def _pcie_level(nvml: Nvml, gpu: _Gpu, peer: _Gpu, notes: _Notes) -> PcieLevel:
    if not (gpu.lost or peer.lost):
        try:
            return _LEVELS.get(nvml.common_ancestor(gpu.handle, peer.handle), PcieLevel.CROSS_NUMA)
        except nv.GpuIsLost:
            pass  # the lost one is marked when it is next queried; fall back below
        except nv.NVMLError as exc:
            notes.warn(
                f"NVML cannot report PCIe common ancestors ({exc}); levels estimated from NUMA nodes",
                once_key="pcie",
            )
    # pessimistic estimate: never claim a closer path than we know of
    if gpu.numa_node is not None and gpu.numa_node == peer.numa_node:
        return PcieLevel.SAME_NUMA
    return PcieLevel.CROSS_NUMA
