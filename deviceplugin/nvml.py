"""The thin interface the device plugin uses to talk to NVML.

`Nvml` wraps a pynvml-shaped object: the real `pynvml` module (distribution nvidia-ml-py) or
`deviceplugin.fakenvml.FakeNvml`. Each method is one pynvml call plus normalisation of its result (str vs bytes,
bus-id spelling); NVML errors propagate as pynvml's own exception classes, re-exported here, so the callers
(discovery, health) handle them identically for either backend.
"""

from __future__ import annotations

import ctypes
import logging
from typing import Any

import pynvml

log = logging.getLogger(__name__)

# pynvml's exception classes (the fake raises these same classes)
NVMLError = pynvml.NVMLError
NotSupported: type[pynvml.NVMLError] = pynvml.NVMLError_NotSupported
FunctionNotFound: type[pynvml.NVMLError] = pynvml.NVMLError_FunctionNotFound
GpuIsLost: type[pynvml.NVMLError] = pynvml.NVMLError_GpuIsLost
LibraryNotFound: type[pynvml.NVMLError] = pynvml.NVMLError_LibraryNotFound
Timeout: type[pynvml.NVMLError] = pynvml.NVMLError_Timeout
InvalidArgument: type[pynvml.NVMLError] = pynvml.NVMLError_InvalidArgument
NotFound: type[pynvml.NVMLError] = pynvml.NVMLError_NotFound
InsufficientResources: type[pynvml.NVMLError] = pynvml.NVMLError_InsufficientResources
InUse: type[pynvml.NVMLError] = pynvml.NVMLError_InUse
#: errors meaning "this query is not available here"; callers degrade instead of failing
UNAVAILABLE: tuple[type[pynvml.NVMLError], ...] = (NotSupported, FunctionNotFound)

TOPOLOGY_INTERNAL = pynvml.NVML_TOPOLOGY_INTERNAL
TOPOLOGY_SINGLE = pynvml.NVML_TOPOLOGY_SINGLE
TOPOLOGY_MULTIPLE = pynvml.NVML_TOPOLOGY_MULTIPLE
TOPOLOGY_HOSTBRIDGE = pynvml.NVML_TOPOLOGY_HOSTBRIDGE
TOPOLOGY_NODE = pynvml.NVML_TOPOLOGY_NODE
TOPOLOGY_SYSTEM = pynvml.NVML_TOPOLOGY_SYSTEM
NVLINK_MAX_LINKS = pynvml.NVML_NVLINK_MAX_LINKS
NVLINK_DEVICE_TYPE_GPU = pynvml.NVML_NVLINK_DEVICE_TYPE_GPU
NVLINK_DEVICE_TYPE_SWITCH = pynvml.NVML_NVLINK_DEVICE_TYPE_SWITCH
EVENT_XID_CRITICAL_ERROR = pynvml.nvmlEventTypeXidCriticalError


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def normalize_bus_id(bus_id: str) -> str:
    """NVML writes "00000000:17:00.0" (8-digit domain, upper case), sysfs "0000:17:00.0": compare and look up
    with the sysfs spelling."""
    text = _text(bus_id).strip().lower()
    parts = text.split(":")
    if len(parts) == 3:
        try:
            return f"{int(parts[0], 16):04x}:{parts[1]}:{parts[2]}"
        except ValueError:
            return text
    if len(parts) == 2:  # no domain
        return f"0000:{text}"
    return text


class Nvml:
    """NVML calls the device plugin makes. `lib` is the pynvml module or a FakeNvml."""

    def __init__(self, lib: Any = pynvml) -> None:
        self.lib = lib

    def init(self) -> None:
        self.lib.nvmlInit()

    def shutdown(self) -> None:
        self.lib.nvmlShutdown()

    def driver_version(self) -> str:
        return _text(self.lib.nvmlSystemGetDriverVersion())

    def device_count(self) -> int:
        return int(self.lib.nvmlDeviceGetCount())

    def handle(self, index: int) -> Any:
        return self.lib.nvmlDeviceGetHandleByIndex(index)

    def handle_key(self, handle: Any) -> Any:
        """A hashable identity for a handle: pynvml's are ctypes pointers (compared by address)."""
        try:
            return ctypes.cast(handle, ctypes.c_void_p).value
        except (ctypes.ArgumentError, TypeError):
            return handle

    def uuid(self, handle: Any) -> str:
        return _text(self.lib.nvmlDeviceGetUUID(handle))

    def name(self, handle: Any) -> str:
        return _text(self.lib.nvmlDeviceGetName(handle))

    def memory_total_mib(self, handle: Any) -> int:
        return int(self.lib.nvmlDeviceGetMemoryInfo(handle).total) // (1024 * 1024)

    def pci_bus_id(self, handle: Any) -> str:
        """NVML's spelling, e.g. "00000000:17:00.0" (what goes into the inventory)."""
        return _text(self.lib.nvmlDeviceGetPciInfo(handle).busId)

    def numa_node(self, handle: Any) -> int | None:
        node = int(self.lib.nvmlDeviceGetNumaNodeId(handle))
        return node if node >= 0 else None

    def mig_enabled(self, handle: Any) -> bool:
        current, _pending = self.lib.nvmlDeviceGetMigMode(handle)
        return bool(current == pynvml.NVML_DEVICE_MIG_ENABLE)

    # static MIG: the MIG devices of a GPU in MIG mode

    def max_mig_devices(self, handle: Any) -> int:
        return int(self.lib.nvmlDeviceGetMaxMigDeviceCount(handle))

    def mig_device(self, handle: Any, index: int) -> Any:
        """The MIG device at `index`; raises NotFound when there is none there."""
        return self.lib.nvmlDeviceGetMigDeviceHandleByIndex(handle, index)

    def gpu_instance_id(self, mig_handle: Any) -> int:
        return int(self.lib.nvmlDeviceGetGpuInstanceId(mig_handle))

    def compute_instance_id(self, mig_handle: Any) -> int:
        return int(self.lib.nvmlDeviceGetComputeInstanceId(mig_handle))

    def mig_attributes(self, mig_handle: Any) -> tuple[int, int, int, int]:
        """(multiprocessors, GPU instance slices, compute instance slices, memory MiB) of a MIG device."""
        attributes = self.lib.nvmlDeviceGetAttributes(mig_handle)
        return (int(attributes.multiprocessorCount), int(attributes.gpuInstanceSliceCount),
                int(attributes.computeInstanceSliceCount), int(attributes.memorySizeMB))

    def gpu_instance_placement(self, handle: Any, gpu_instance: int) -> tuple[int, int, int]:
        """(profile ID, start slot, size in slots) of a GPU's GPU instance."""
        info = self.lib.nvmlGpuInstanceGetInfo(self.lib.nvmlDeviceGetGpuInstanceById(handle, gpu_instance))
        return int(info.profileId), int(info.placement.start), int(info.placement.size)

    # dynamic MIG (issue 16 item 2): the plugin partitions GPUs itself

    def set_mig_mode(self, handle: Any, enabled: bool) -> bool:
        """Switch MIG mode; True when it took effect now, False when it waits for a GPU reset (A100 may)."""
        mode = pynvml.NVML_DEVICE_MIG_ENABLE if enabled else pynvml.NVML_DEVICE_MIG_DISABLE
        self.lib.nvmlDeviceSetMigMode(handle, mode)
        return self.mig_enabled(handle) == enabled

    def possible_placements(self, handle: Any, profile_id: int) -> list[tuple[int, int]]:
        """(start, size) of every legal placement of a GPU instance profile, free or not."""
        count = ctypes.c_uint(0)
        self.lib.nvmlDeviceGetGpuInstancePossiblePlacements(handle, profile_id, None, ctypes.byref(count))
        placements = (pynvml.c_nvmlGpuInstancePlacement_t * max(1, count.value))()
        self.lib.nvmlDeviceGetGpuInstancePossiblePlacements(handle, profile_id, placements, ctypes.byref(count))
        return [(int(placements[i].start), int(placements[i].size)) for i in range(count.value)]

    def create_gpu_instance(self, handle: Any, profile_id: int, start: int, size: int) -> Any:
        placement = pynvml.c_nvmlGpuInstancePlacement_t()
        placement.start, placement.size = start, size
        return self.lib.nvmlDeviceCreateGpuInstanceWithPlacement(handle, profile_id, ctypes.byref(placement))

    def create_compute_instance(self, gpu_instance: Any, compute_profile: int) -> Any:
        return self.lib.nvmlGpuInstanceCreateComputeInstance(gpu_instance, compute_profile)

    def gpu_instance_id_of(self, gpu_instance: Any) -> int:
        return int(self.lib.nvmlGpuInstanceGetInfo(gpu_instance).id)

    def gpu_instance(self, handle: Any, gpu_instance: int) -> Any:
        return self.lib.nvmlDeviceGetGpuInstanceById(handle, gpu_instance)

    def destroy_compute_instance(self, compute_instance: Any) -> None:
        self.lib.nvmlComputeInstanceDestroy(compute_instance)

    def compute_instance(self, gpu_instance: Any, compute_instance: int) -> Any:
        return self.lib.nvmlGpuInstanceGetComputeInstanceById(gpu_instance, compute_instance)

    def destroy_gpu_instance(self, gpu_instance: Any) -> None:
        self.lib.nvmlGpuInstanceDestroy(gpu_instance)

    def nvlink_active(self, handle: Any, link: int) -> bool:
        return bool(self.lib.nvmlDeviceGetNvLinkState(handle, link) == pynvml.NVML_FEATURE_ENABLED)

    def nvlink_remote_bus_id(self, handle: Any, link: int) -> str:
        return _text(self.lib.nvmlDeviceGetNvLinkRemotePciInfo(handle, link).busId)

    def nvlink_remote_type(self, handle: Any, link: int) -> int:
        return int(self.lib.nvmlDeviceGetNvLinkRemoteDeviceType(handle, link))

    def common_ancestor(self, first: Any, second: Any) -> int:
        return int(self.lib.nvmlDeviceGetTopologyCommonAncestor(first, second))

    # current use (metrics)

    def utilization_percent(self, handle: Any) -> tuple[int, int]:
        """(percent of the last sample period a kernel ran, percent memory was read or written)."""
        rates = self.lib.nvmlDeviceGetUtilizationRates(handle)
        return int(rates.gpu), int(rates.memory)

    def memory_bytes(self, handle: Any) -> tuple[int, int]:
        """(used, total) device memory in bytes."""
        info = self.lib.nvmlDeviceGetMemoryInfo(handle)
        return int(info.used), int(info.total)

    def temperature_celsius(self, handle: Any) -> int:
        return int(self.lib.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU))

    def power_milliwatts(self, handle: Any) -> int:
        return int(self.lib.nvmlDeviceGetPowerUsage(handle))

    def ecc_errors(self, handle: Any, *, corrected: bool) -> int:
        """Memory ECC errors since the driver loaded (NVML's volatile counter)."""
        kind = pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED if corrected else pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
        return int(self.lib.nvmlDeviceGetTotalEccErrors(handle, kind, pynvml.NVML_VOLATILE_ECC))

    # events (health)

    def event_set_create(self) -> Any:
        return self.lib.nvmlEventSetCreate()

    def register_events(self, handle: Any, event_types: int, event_set: Any) -> None:
        self.lib.nvmlDeviceRegisterEvents(handle, event_types, event_set)

    def event_wait(self, event_set: Any, timeout_ms: int) -> Any:
        """The next event (`.device`, `.eventType`, `.eventData`); raises Timeout when none came."""
        return self.lib.nvmlEventSetWait_v2(event_set, timeout_ms)

    def event_set_free(self, event_set: Any) -> None:
        self.lib.nvmlEventSetFree(event_set)


def open_nvml(fake_profile: str | None, seed: str) -> Nvml:
    """The real NVML, or fake hardware from a profile (UUIDs derived from `seed`, the node name)."""
    if not fake_profile:
        return Nvml(pynvml)
    from kube_vgpu.deviceplugin.fakenvml import FakeNvml, load_profile

    return Nvml(FakeNvml(load_profile(fake_profile, seed)))
