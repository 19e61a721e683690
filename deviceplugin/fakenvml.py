"""A stand-in for the `pynvml` module (distribution nvidia-ml-py) describing made-up hardware.

It is the only stand-in the project allows: CI has no GPU. It mimics pynvml's function names, argument order,
return shapes (structures with `.total`, `.busId`, event data with `.device`/`.eventType`/`.eventData`) and its
exceptions: it raises pynvml's own `NVMLError` subclasses (`NVMLError_NotSupported`, `NVMLError_FunctionNotFound`,
`NVMLError_GpuIsLost`, `NVMLError_LibraryNotFound`, `NVMLError_Timeout`, ...), so `deviceplugin.nvml` runs
unchanged against either. Importing pynvml does not load libnvidia-ml; only `pynvml.nvmlInit` does.

Hardware is described by `FakeHardware`: GPUs with a PCIe path (for the common-ancestor level), NVLink lanes to
peer GPUs or to an NVSwitch fabric, NUMA node, MIG mode, and failure knobs (functions answering NotSupported or
FunctionNotFound, lost GPUs, a missing library). Named profiles cover the usual shapes; `from-file:PATH` reads
a JSON description; `layout_hardware` is the synthetic layout `kube-vgpu cluster synth` uses.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import deque
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pynvml

from kube_vgpu.protocol import mig

# --- hardware description ---------------------------------------------------------------------------------------

#: PCIe path element kinds, outermost first. A GPU's path lists its ancestors from the NUMA node down to the
#: switch (or board) it hangs off; the deepest element two GPUs share decides NVML's common-ancestor level.
PCIE_KINDS = ("numa", "hostbridge", "switch", "board")

#: Lanes per GPU to an NVSwitch fabric (H100 SXM) and per NVLink-bridged pair (A100: 3 bridges x 4 links).
NVSWITCH_LANES = 18
PAIR_LANES = 12

BYTES_PER_MIB = 1024 * 1024

#: error names usable in FakeGpu.failing / the JSON "failing" map -> pynvml error codes
ERRORS = {
    "NotSupported": pynvml.NVML_ERROR_NOT_SUPPORTED,
    "FunctionNotFound": pynvml.NVML_ERROR_FUNCTION_NOT_FOUND,
    "GpuIsLost": pynvml.NVML_ERROR_GPU_IS_LOST,
    "NoPermission": pynvml.NVML_ERROR_NO_PERMISSION,
    "Unknown": pynvml.NVML_ERROR_UNKNOWN,
}


@dataclass(frozen=True, slots=True)
class FakeUsage:
    """What a GPU reports about its current use (nvmlDeviceGetUtilizationRates, GetMemoryInfo's used, GetTemperature,
    GetPowerUsage, GetTotalEccErrors with the volatile counter). The default is an idle, healthy GPU."""

    utilization_percent: int = 0  # .gpu: percent of time a kernel ran
    memory_utilization_percent: int = 0  # .memory: percent of time memory was read or written
    memory_used_mib: int = 0
    temperature_c: int = 35
    power_mw: int = 60_000
    ecc_corrected: int = 0
    ecc_uncorrected: int = 0


@dataclass(frozen=True, slots=True)
class FakeGpu:
    uuid: str
    name: str
    memory_mib: int
    bus_id: str  # NVML format, e.g. "00000000:17:00.0"
    pcie_path: tuple[str, ...]  # e.g. ("numa:0", "hostbridge:0", "switch:0-0")
    numa_node: int | None = None  # what nvmlDeviceGetNumaNodeId answers (None: -1, no affinity)
    #: NVLink lanes to peer GPUs, by peer position in FakeHardware.gpus
    nvlink_peers: tuple[tuple[int, int], ...] = ()
    nvswitch_lanes: int = 0  # lanes to an NVSwitch fabric
    nvlink_max: int | None = None  # links the GPU has; default: the lanes it uses (0 = no NVLink at all)
    mig_capable: bool = False
    mig_enabled: bool = False
    lost: bool = False  # every query answers GpuIsLost
    #: nvml function names answering NotSupported for this GPU
    unsupported: frozenset[str] = frozenset()
    #: (nvml function name, error name from ERRORS) pairs: that call fails that way for this GPU
    failing: tuple[tuple[str, str], ...] = ()
    usage: FakeUsage = FakeUsage()
    #: static MIG: the GPU instances of a GPU in MIG mode, as (profile name, start slot), each with one compute
    #: instance spanning it. Checked against NVIDIA's profile table of the model (protocol.mig) by FakeNvml.
    mig_layout: tuple[tuple[str, int], ...] = ()
    #: dynamic MIG: switching MIG mode waits for a GPU reset (as on A100 with processes or without a reset): the
    #: mode stays pending (nvmlDeviceGetMigMode's second value) and never takes effect in the fake
    mig_mode_needs_reset: bool = False


@dataclass(frozen=True, slots=True)
class FakeHardware:
    gpus: tuple[FakeGpu, ...]
    driver_version: str = "550.54.15"
    #: nvml function names the (old) driver lacks: they answer FunctionNotFound for every GPU
    missing_functions: frozenset[str] = frozenset()
    library_missing: bool = False  # nvmlInit answers LibraryNotFound (no libnvidia-ml.so.1)


def layout_hardware(
    uuids: list[str],
    model: str,
    memory_mib: int,
    topology: str,
    *,
    bus_ids: list[str] | None = None,
) -> FakeHardware:
    """The standard synthetic layout: half the GPUs on each of two NUMA nodes (one host bridge each), two GPUs
    per PCIe switch, and NVLink per `topology`: "nvswitch" (every GPU NVSWITCH_LANES lanes to a fabric),
    "nvlink-pairs" (the two GPUs of a switch bridged with PAIR_LANES lanes) or "pcie" (no NVLink)."""
    if topology not in ("nvswitch", "nvlink-pairs", "pcie"):
        raise ValueError(f"unknown topology {topology!r}; choose one of nvswitch, nvlink-pairs, pcie")
    count = len(uuids)
    numa_nodes = 2 if count > 1 else 1
    per_numa = max(1, (count + numa_nodes - 1) // numa_nodes)
    gpus = []
    for index, uuid in enumerate(uuids):
        numa = index // per_numa
        pair = index // 2
        peers: tuple[tuple[int, int], ...] = ()
        if topology == "nvlink-pairs":
            peers = tuple((peer, PAIR_LANES) for peer in range(count) if peer != index and peer // 2 == pair)
        gpus.append(
            FakeGpu(
                uuid=uuid,
                name=model,
                memory_mib=memory_mib,
                bus_id=bus_ids[index] if bus_ids else f"00000000:{0x10 + index * 0x10:02X}:00.0",
                # the switch id carries the NUMA node: a pair split across NUMA nodes is two switches
                pcie_path=(f"numa:{numa}", f"hostbridge:{numa}", f"switch:{numa}-{pair}"),
                numa_node=numa,
                nvlink_peers=peers,
                nvswitch_lanes=NVSWITCH_LANES if topology == "nvswitch" else 0,
            )
        )
    return FakeHardware(gpus=tuple(gpus))


def profile_uuid(seed: str, index: int) -> str:
    """Stable, unique-looking GPU UUID for fake hardware, derived from a seed (the node name) and the index.
    `cluster synth` uses this same function, so a node's UUIDs do not depend on which tool described it."""
    digest = hashlib.sha1(f"{seed}/{index}".encode()).hexdigest()
    return f"GPU-{digest[:8]}-{digest[8:12]}-{digest[12:16]}-{digest[16:20]}-{digest[20:32]}"


def _uuids(seed: str, count: int) -> list[str]:
    return [profile_uuid(seed, index) for index in range(count)]


def _dgx_h100_8(seed: str) -> FakeHardware:
    return layout_hardware(_uuids(seed, 8), "NVIDIA H100 80GB HBM3", 81559, "nvswitch")


def _a100_4_nvlink_pairs(seed: str) -> FakeHardware:
    return layout_hardware(_uuids(seed, 4), "NVIDIA A100 80GB PCIe", 81920, "nvlink-pairs")


def _t4_4_pcie(seed: str) -> FakeHardware:
    hardware = layout_hardware(_uuids(seed, 4), "Tesla T4", 15360, "pcie")
    # T4 has no NVLink: NVML answers NotSupported for link queries (nvlink_max 0 does that)
    return replace(hardware, gpus=tuple(replace(gpu, nvlink_max=0) for gpu in hardware.gpus))


#: The static MIG layouts of the a100-mig profile's GPUs 0 and 1 (A100-SXM4-40GB): one 3g.20gb, one 2g.10gb and two
#: 1g.5gb; and seven 1g.5gb.
A100_MIG_LAYOUTS: tuple[tuple[tuple[str, int], ...], ...] = (
    (("3g.20gb", 4), ("2g.10gb", 0), ("1g.5gb", 2), ("1g.5gb", 3)),
    tuple(("1g.5gb", start) for start in range(7)),
)


def _a100_mig(seed: str) -> FakeHardware:
    """HGX A100 4-GPU board: direct NVLink mesh, 4 lanes to each of the 3 peers; GPUs 0 and 1 run in MIG mode
    (A100_MIG_LAYOUTS)."""
    hardware = layout_hardware(_uuids(seed, 4), "NVIDIA A100-SXM4-40GB", 40960, "pcie")
    gpus = []
    for index, gpu in enumerate(hardware.gpus):
        gpus.append(
            replace(
                gpu,
                nvlink_peers=tuple((peer, 4) for peer in range(4) if peer != index),
                nvlink_max=12,
                mig_capable=True,
                mig_enabled=index < 2,
                mig_layout=A100_MIG_LAYOUTS[index] if index < 2 else (),
            )
        )
    return replace(hardware, gpus=tuple(gpus))


def _h100_mig_capable(seed: str) -> FakeHardware:
    """Two H100 80GB, MIG-capable, MIG mode off: a node for dynamic MIG (the plugin partitions them per pod)."""
    hardware = layout_hardware(_uuids(seed, 2), "NVIDIA H100 80GB HBM3", 81559, "nvswitch")
    return replace(hardware, gpus=tuple(replace(gpu, mig_capable=True) for gpu in hardware.gpus))


def _missing_library(seed: str) -> FakeHardware:
    return FakeHardware(gpus=(), library_missing=True)


PROFILES = {
    "dgx-h100-8": _dgx_h100_8,
    "a100-4-nvlink-pairs": _a100_4_nvlink_pairs,
    "t4-4-pcie": _t4_4_pcie,
    "a100-mig": _a100_mig,
    "h100-mig-capable": _h100_mig_capable,
    "missing-library": _missing_library,
}
FROM_FILE = "from-file"


def profile_names() -> list[str]:
    return [*PROFILES, FROM_FILE + ":PATH"]


def load_profile(name: str, seed: str) -> FakeHardware:
    """A named profile (UUIDs derived from `seed`, normally the node name) or `from-file:PATH` (JSON)."""
    if name.startswith(FROM_FILE + ":"):
        return hardware_from_file(Path(name[len(FROM_FILE) + 1 :]), seed)
    try:
        return PROFILES[name](seed)
    except KeyError:
        raise ValueError(f"unknown fake NVML profile {name!r}; choose one of {', '.join(profile_names())}") from None


#: the JSON "usage" keys -> FakeUsage fields
USAGE_KEYS = {
    "utilizationPercent": "utilization_percent",
    "memoryUtilizationPercent": "memory_utilization_percent",
    "memoryUsedMiB": "memory_used_mib",
    "temperatureC": "temperature_c",
    "powerMilliwatts": "power_mw",
    "eccCorrected": "ecc_corrected",
    "eccUncorrected": "ecc_uncorrected",
}


def _usage_from_json(raw: Any) -> FakeUsage:
    if not isinstance(raw, dict):
        raise ValueError(f"usage must be an object, got {raw!r}")
    unknown = sorted(set(raw) - set(USAGE_KEYS))
    if unknown:
        raise ValueError(f"unknown usage keys {unknown}; choose from {', '.join(USAGE_KEYS)}")
    values = {}
    for key, value in raw.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"usage.{key} must be a non-negative integer, got {value!r}")
        values[USAGE_KEYS[key]] = value
    return FakeUsage(**values)


def hardware_from_file(path: Path, seed: str) -> FakeHardware:
    """Hardware from JSON. Either a synthetic layout:

        {"layout": {"gpus": 4, "model": "Tesla T4", "memoryMiB": 15360, "topology": "pcie"}}

    or explicit GPUs (omitted uuid/pciBusId are derived; pciePath defaults to the layout's):

        {"driverVersion": "535.104.05", "missingFunctions": ["nvmlDeviceGetNumaNodeId"],
         "gpus": [{"name": "NVIDIA L4", "memoryMiB": 23034, "numa": 0,
                   "pciePath": ["numa:0", "hostbridge:0", "switch:0"],
                   "nvlinkPeers": {"1": 4}, "nvswitchLanes": 0, "nvlinkMax": 0,
                   "migEnabled": false, "migLayout": [["3g.20gb", 4]], "lost": false,
                   "unsupported": ["nvmlDeviceGetTopologyCommonAncestor"],
                   "failing": {"nvmlDeviceGetPciInfo": "GpuIsLost"},
                   "usage": {"utilizationPercent": 40, "memoryUtilizationPercent": 10, "memoryUsedMiB": 2048,
                             "temperatureC": 50, "powerMilliwatts": 120000, "eccCorrected": 0,
                             "eccUncorrected": 0}}]}

    ("failing" error names: the keys of ERRORS; "usage" keys: USAGE_KEYS, each optional.)
    """
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"fake NVML file {path}: {exc}") from None
    if not isinstance(doc, dict):
        raise ValueError(f"fake NVML file {path}: must be a JSON object")
    common: dict[str, Any] = {
        "driver_version": str(doc.get("driverVersion", "550.54.15")),
        "missing_functions": frozenset(doc.get("missingFunctions", ())),
        "library_missing": bool(doc.get("libraryMissing", False)),
    }
    if "layout" in doc:
        layout = doc["layout"]
        count = int(layout["gpus"])
        hardware = layout_hardware(
            _uuids(seed, count), str(layout["model"]), int(layout["memoryMiB"]), str(layout.get("topology", "pcie"))
        )
        return replace(hardware, **common)
    raw_gpus = doc.get("gpus")
    if not isinstance(raw_gpus, list):
        raise ValueError(f"fake NVML file {path}: needs 'layout' or a 'gpus' list")
    defaults = layout_hardware(_uuids(seed, len(raw_gpus)), "GPU", 1, "pcie").gpus
    gpus = []
    for index, raw in enumerate(raw_gpus):
        where = f"fake NVML file {path} gpus[{index}]"
        try:
            base = defaults[index]
            gpus.append(
                FakeGpu(
                    uuid=str(raw.get("uuid", base.uuid)),
                    name=str(raw["name"]),
                    memory_mib=int(raw["memoryMiB"]),
                    bus_id=str(raw.get("pciBusId", base.bus_id)),
                    pcie_path=tuple(raw.get("pciePath", base.pcie_path)),
                    numa_node=raw.get("numa", base.numa_node),
                    nvlink_peers=tuple(
                        sorted((int(peer), int(lanes)) for peer, lanes in raw.get("nvlinkPeers", {}).items())
                    ),
                    nvswitch_lanes=int(raw.get("nvswitchLanes", 0)),
                    nvlink_max=raw.get("nvlinkMax"),
                    mig_capable=bool(raw.get("migCapable", raw.get("migEnabled", False))),
                    mig_enabled=bool(raw.get("migEnabled", False)),
                    lost=bool(raw.get("lost", False)),
                    unsupported=frozenset(raw.get("unsupported", ())),
                    failing=tuple(sorted((str(fn), str(err)) for fn, err in raw.get("failing", {}).items())),
                    usage=_usage_from_json(raw.get("usage", {})),
                    mig_layout=tuple((str(name), int(start)) for name, start in raw.get("migLayout", ())),
                )
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{where}: {exc!r}") from None
        unknown = [err for _, err in gpus[-1].failing if err not in ERRORS]
        if unknown:
            raise ValueError(f"{where}: unknown error names {unknown}; choose from {', '.join(ERRORS)}")
        # an unknown kind would silently read as a NUMA-level ancestor (_common_ancestor)
        odd = [part for part in gpus[-1].pcie_path if not isinstance(part, str) or part.partition(":")[0] not in
               PCIE_KINDS or not part.partition(":")[2]]
        if odd:
            kinds = ", ".join(PCIE_KINDS)
            raise ValueError(f"{where}: pciePath elements {odd} are not KIND:ID with KIND one of {kinds}")
    return FakeHardware(gpus=tuple(gpus), **common)


# --- the pynvml look-alike --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class FakeHandle:
    """What nvmlDeviceGetHandleByIndex returns (pynvml: a c_nvmlDevice_t pointer; opaque either way)."""

    position: int


@dataclass(frozen=True, slots=True)
class FakeMigHandle:
    """A MIG device's handle (nvmlDeviceGetMigDeviceHandleByIndex): the parent GPU and its GPU instance's ID - 1
    (its position in mig_layout for a static layout)."""

    position: int
    instance: int


@dataclass(frozen=True, slots=True)
class FakeGpuInstance:  # pynvml's nvmlGpuInstance_t
    position: int
    instance: int  # GPU instance ID - 1


@dataclass(frozen=True, slots=True)
class FakeComputeInstance:  # pynvml's nvmlComputeInstance_t
    position: int
    gi_id: int
    ci_id: int


@dataclass(slots=True)
class _FakeGi:
    """One GPU instance and its compute instances (IDs; the fake makes at most one, 0, spanning it)."""

    gi_id: int
    profile: mig.MigProfile
    start: int
    uuid: str  # its MIG device's, once it has a compute instance
    compute: set[int]


#: The compute instance profile that spans a GPU instance of n compute slices (pynvml's
#: NVML_COMPUTE_INSTANCE_PROFILE_<n>_SLICE).
COMPUTE_PROFILE_BY_SLICES = {
    1: pynvml.NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE, 2: pynvml.NVML_COMPUTE_INSTANCE_PROFILE_2_SLICE,
    3: pynvml.NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE, 4: pynvml.NVML_COMPUTE_INSTANCE_PROFILE_4_SLICE,
    7: pynvml.NVML_COMPUTE_INSTANCE_PROFILE_7_SLICE,
}


def _deref(ref: Any) -> Any:
    """What a ctypes byref() points to (pynvml passes out-parameters so); a plain object as it is."""
    return getattr(ref, "_obj", ref)


def _dynamic_mig_uuid(gpu_uuid: str, serial: int) -> str:
    """A created MIG device's UUID: new for every creation, as real ones are."""
    digest = hashlib.sha1(f"{gpu_uuid}/created{serial}".encode()).hexdigest()
    return f"MIG-{digest[:8]}-{digest[8:12]}-{digest[12:16]}-{digest[16:20]}-{digest[20:32]}"


@dataclass(frozen=True, slots=True)
class FakePlacement:  # pynvml.c_nvmlGpuInstancePlacement_t
    start: int
    size: int


@dataclass(frozen=True, slots=True)
class FakeGpuInstanceInfo:  # pynvml.c_nvmlGpuInstanceInfo_t
    device: FakeHandle
    id: int
    profileId: int
    placement: FakePlacement


@dataclass(frozen=True, slots=True)
class FakeDeviceAttributes:  # pynvml.c_nvmlDeviceAttributes (the fields discovery reads)
    multiprocessorCount: int
    gpuInstanceSliceCount: int
    computeInstanceSliceCount: int
    memorySizeMB: int


#: MIG devices NVML numbers per GPU (nvmlDeviceGetMaxMigDeviceCount on A100 and H100)
MAX_MIG_DEVICES = 7


def mig_device_uuid(gpu_uuid: str, gpu_instance: int) -> str:
    """Stable MIG device UUID for fake hardware (real ones are "MIG-" and a UUID of their own)."""
    digest = hashlib.sha1(f"{gpu_uuid}/gi{gpu_instance}".encode()).hexdigest()
    return f"MIG-{digest[:8]}-{digest[8:12]}-{digest[12:16]}-{digest[16:20]}-{digest[20:32]}"


def gpu_instance_id(instance: int) -> int:
    """The fake's GPU instance IDs: 1, 2, ... in layout order (NVML picks its own; any distinct numbers do)."""
    return instance + 1


@dataclass(frozen=True, slots=True)
class FakeMemory:  # pynvml.c_nvmlMemory_t
    total: int
    free: int
    used: int


@dataclass(frozen=True, slots=True)
class FakeUtilization:  # pynvml.c_nvmlUtilization_t
    gpu: int
    memory: int


@dataclass(frozen=True, slots=True)
class FakePciInfo:  # pynvml.nvmlPciInfo_t (string fields come back as str)
    busId: str
    busIdLegacy: str


@dataclass(frozen=True, slots=True)
class FakeEventData:  # pynvml.c_nvmlEventData_t
    device: FakeHandle
    eventType: int
    eventData: int
    gpuInstanceId: int = 0xFFFFFFFF
    computeInstanceId: int = 0xFFFFFFFF


@dataclass(slots=True)
class FakeEventSet:
    registered: dict[int, int] = field(default_factory=dict)  # position -> event type mask
    pending: deque[FakeEventData] = field(default_factory=deque)
    freed: bool = False


def _error(code: int) -> pynvml.NVMLError:
    # pynvml.NVMLError(code) returns the matching subclass (NVMLError_NotSupported, ...)
    return pynvml.NVMLError(code)


class FakeNvml:
    """Module-like object with pynvml's names. Constants and exception classes are pynvml's own."""

    def __init__(self, hardware: FakeHardware) -> None:
        self.hardware = hardware
        self._lock = threading.Condition()
        self._initialized = 0
        self._lost: set[int] = {position for position, gpu in enumerate(hardware.gpus) if gpu.lost}
        self._event_sets: list[FakeEventSet] = []
        self._link_tables = [self._links(gpu) for gpu in hardware.gpus]  # discovery asks per link: build once
        self._usage: list[FakeUsage] = [gpu.usage for gpu in hardware.gpus]
        self._gis = [self._mig_table(gpu) for gpu in hardware.gpus]  # GPU instance ID -> instance, per GPU
        self._mig_mode = [gpu.mig_enabled for gpu in hardware.gpus]
        self._mig_pending: list[int | None] = [None for _gpu in hardware.gpus]  # a mode waiting for a GPU reset
        self._created = 0  # dynamic GPU instances created so far (their MIG device UUIDs are all distinct)
        self._failures: dict[str, list[int]] = {}  # function -> [calls left to fail, NVML error code]
        self.calls: dict[str, int] = {}  # function name -> call count (tests look at what was queried)

    # Constants, error classes (NVMLError_*), event masks: exactly pynvml's, so `except` clauses and
    # comparisons written against pynvml work against the fake. Unimplemented nvml* functions are an
    # AttributeError, never a silent call into the real library.
    def __getattr__(self, name: str) -> Any:
        if name.startswith(("NVML_", "NVMLError", "nvmlEventType")):
            return getattr(pynvml, name)
        raise AttributeError(f"fake NVML does not implement {name}")

    # -- test controls (not part of pynvml) ---------------------------------------------------------------------

    def inject_xid(self, position: int, xid: int) -> None:
        """Queue an XID critical-error event for the GPU at `position` on every set registered for it."""
        with self._lock:
            for event_set in self._event_sets:
                mask = event_set.registered.get(position, 0)
                if mask & pynvml.nvmlEventTypeXidCriticalError and not event_set.freed:
                    event_set.pending.append(
                        FakeEventData(FakeHandle(position), pynvml.nvmlEventTypeXidCriticalError, xid)
                    )
            self._lock.notify_all()

    def set_usage(self, position: int, usage: FakeUsage) -> None:
        """From now on the GPU at `position` reports `usage` (utilisation, memory used, temperature, power, ECC)."""
        with self._lock:
            self._usage[position] = usage

    def fail_next(self, function: str, times: int = 1, code: int = pynvml.NVML_ERROR_UNKNOWN) -> None:
        """The next `times` calls of a MIG-changing function (nvmlDeviceSetMigMode,
        nvmlDeviceCreateGpuInstanceWithPlacement, nvmlGpuInstanceCreateComputeInstance, nvmlComputeInstanceDestroy,
        nvmlGpuInstanceDestroy) fail with `code`, after their argument checks and before they change anything."""
        with self._lock:
            self._failures[function] = [times, code]

    def _fail_injected(self, function: str) -> None:
        with self._lock:
            failure = self._failures.get(function)
            if failure is None or failure[0] <= 0:
                return
            failure[0] -= 1
        raise _error(failure[1])

    def lose_gpu(self, position: int) -> None:
        """The GPU falls off the bus: every later query about it answers GpuIsLost."""
        with self._lock:
            self._lost.add(position)
            self._lock.notify_all()

    # -- helpers ------------------------------------------------------------------------------------------------

    def _enter(self, name: str, handle: FakeHandle | None = None) -> FakeGpu | None:
        self.calls[name] = self.calls.get(name, 0) + 1
        if self.hardware.library_missing:
            # pynvml without a loaded library: nvmlInit raises LibraryNotFound, the rest Uninitialized
            raise _error(pynvml.NVML_ERROR_UNINITIALIZED)
        if name in self.hardware.missing_functions:
            raise _error(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
        if not self._initialized:
            raise _error(pynvml.NVML_ERROR_UNINITIALIZED)
        if handle is None:
            return None
        if not isinstance(handle, FakeHandle) or not 0 <= handle.position < len(self.hardware.gpus):
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if handle.position in self._lost:
            raise _error(pynvml.NVML_ERROR_GPU_IS_LOST)
        gpu = self.hardware.gpus[handle.position]
        if name in gpu.unsupported:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        for function, error in gpu.failing:
            if function == name:
                raise _error(ERRORS[error])
        return gpu

    def _gpu(self, name: str, handle: FakeHandle) -> FakeGpu:
        gpu = self._enter(name, handle)
        assert gpu is not None
        return gpu

    # -- library ------------------------------------------------------------------------------------------------

    def nvmlInit(self) -> None:
        self.calls["nvmlInit"] = self.calls.get("nvmlInit", 0) + 1
        if self.hardware.library_missing:
            raise _error(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)
        self._initialized += 1

    def nvmlShutdown(self) -> None:
        self._enter("nvmlShutdown")
        self._initialized -= 1

    def nvmlSystemGetDriverVersion(self) -> bytes:
        self._enter("nvmlSystemGetDriverVersion")
        return self.hardware.driver_version.encode()

    def nvmlDeviceGetCount(self) -> int:
        self._enter("nvmlDeviceGetCount")
        return len(self.hardware.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeHandle:
        self._enter("nvmlDeviceGetHandleByIndex")
        if not 0 <= index < len(self.hardware.gpus):
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if index in self._lost:
            raise _error(pynvml.NVML_ERROR_GPU_IS_LOST)
        return FakeHandle(index)

    # -- per device ---------------------------------------------------------------------------------------------

    def nvmlDeviceGetUUID(self, handle: FakeHandle | FakeMigHandle) -> str:
        if isinstance(handle, FakeMigHandle):
            self._mig("nvmlDeviceGetUUID", handle)
            return self._gis[handle.position][gpu_instance_id(handle.instance)].uuid
        return self._gpu("nvmlDeviceGetUUID", handle).uuid

    def nvmlDeviceGetName(self, handle: FakeHandle) -> str:
        return self._gpu("nvmlDeviceGetName", handle).name

    def nvmlDeviceGetMemoryInfo(self, handle: FakeHandle | FakeMigHandle, version: int | None = None) -> FakeMemory:
        if isinstance(handle, FakeMigHandle):  # a MIG device: its own memory, nothing used (no usage modelled)
            total = self._mig("nvmlDeviceGetMemoryInfo", handle)[1].memory_mib * BYTES_PER_MIB
            return FakeMemory(total=total, free=total, used=0)
        total = self._gpu("nvmlDeviceGetMemoryInfo", handle).memory_mib * BYTES_PER_MIB
        used = min(total, self._usage[handle.position].memory_used_mib * BYTES_PER_MIB)
        return FakeMemory(total=total, free=total - used, used=used)

    def nvmlDeviceGetUtilizationRates(self, handle: FakeHandle) -> FakeUtilization:
        self._gpu("nvmlDeviceGetUtilizationRates", handle)
        usage = self._usage[handle.position]
        return FakeUtilization(gpu=usage.utilization_percent, memory=usage.memory_utilization_percent)

    def nvmlDeviceGetTemperature(self, handle: FakeHandle, sensor: int) -> int:
        self._gpu("nvmlDeviceGetTemperature", handle)
        if sensor != pynvml.NVML_TEMPERATURE_GPU:
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return self._usage[handle.position].temperature_c

    def nvmlDeviceGetPowerUsage(self, handle: FakeHandle) -> int:
        self._gpu("nvmlDeviceGetPowerUsage", handle)
        return self._usage[handle.position].power_mw

    def nvmlDeviceGetTotalEccErrors(self, handle: FakeHandle, errorType: int, counterType: int) -> int:
        self._gpu("nvmlDeviceGetTotalEccErrors", handle)
        usage = self._usage[handle.position]
        if counterType != pynvml.NVML_VOLATILE_ECC:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)  # the fake keeps only the since-driver-load counts
        if errorType == pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED:
            return usage.ecc_corrected
        if errorType == pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED:
            return usage.ecc_uncorrected
        raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)

    def nvmlDeviceGetPciInfo(self, handle: FakeHandle) -> FakePciInfo:
        gpu = self._gpu("nvmlDeviceGetPciInfo", handle)
        return FakePciInfo(busId=gpu.bus_id, busIdLegacy=gpu.bus_id[-12:])

    def nvmlDeviceGetNumaNodeId(self, handle: FakeHandle) -> int:
        gpu = self._gpu("nvmlDeviceGetNumaNodeId", handle)
        return -1 if gpu.numa_node is None else gpu.numa_node

    # -- MIG: GPU instances, each with one compute instance spanning it (a MIG device) ---------------------------
    # Static MIG seeds them from mig_layout (GPU instance IDs 1, 2, ... in layout order, compute instance ID 0);
    # dynamic MIG (issue 16 item 2) creates and destroys them through pynvml's calls below, under NVIDIA's
    # placement rules of protocol.mig. A GPU instance without a compute instance is no MIG device yet.

    def _mig_table(self, gpu: FakeGpu) -> dict[int, _FakeGi]:
        """The static layout's instances; a layout the model's MIG rules forbid is a mistake in the test's hardware."""
        if not gpu.mig_layout:
            return {}
        model = mig.mig_model(gpu.name, gpu.memory_mib)
        if model is None or not gpu.mig_capable or not gpu.mig_enabled:
            raise ValueError(f"fake GPU {gpu.uuid} ({gpu.name}, {gpu.memory_mib} MiB): a MIG layout needs a "
                             "MIG-capable model of protocol.mig in MIG mode")
        problem = mig.legal_layout(model, list(gpu.mig_layout))
        if problem:
            raise ValueError(f"fake GPU {gpu.uuid}: {problem}")
        instances = {}
        for position, (name, start) in enumerate(gpu.mig_layout):
            profile = model.profile(name)
            assert profile is not None
            gi_id = gpu_instance_id(position)
            instances[gi_id] = _FakeGi(gi_id, profile, start, mig_device_uuid(gpu.uuid, gi_id), {0})
        return instances

    def _mig(self, name: str, handle: FakeMigHandle) -> tuple[FakeGpu, mig.MigProfile]:
        gpu = self._gpu(name, FakeHandle(handle.position))
        instance = self._gis[handle.position].get(gpu_instance_id(handle.instance))
        if not self._mig_mode[handle.position] or instance is None or not instance.compute:
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return gpu, instance.profile

    def _devices(self, position: int) -> list[_FakeGi]:
        """The MIG devices of a GPU (GPU instances with a compute instance), by GPU instance ID."""
        return [gi for _id, gi in sorted(self._gis[position].items()) if gi.compute]

    def _mig_model(self, name: str, handle: FakeHandle) -> mig.MigModel:
        gpu = self._gpu(name, handle)
        model = mig.mig_model(gpu.name, gpu.memory_mib)
        if not gpu.mig_capable or model is None:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return model

    def nvmlDeviceGetMigMode(self, handle: FakeHandle) -> list[int]:
        gpu = self._gpu("nvmlDeviceGetMigMode", handle)
        if not gpu.mig_capable:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        mode = pynvml.NVML_DEVICE_MIG_ENABLE if self._mig_mode[handle.position] else pynvml.NVML_DEVICE_MIG_DISABLE
        pending = self._mig_pending[handle.position]
        return [mode, mode if pending is None else pending]

    def nvmlDeviceSetMigMode(self, device: FakeHandle, mode: int) -> int:
        """Takes effect at once (activation status NVML_SUCCESS), as on H100 with no process on the GPU; with
        FakeGpu.mig_mode_needs_reset it stays pending (status NVML_ERROR_RESET_REQUIRED) until a reset the fake
        never does. Turning MIG off while GPU instances exist is refused with InUse."""
        self._mig_model("nvmlDeviceSetMigMode", device)
        self._fail_injected("nvmlDeviceSetMigMode")
        if mode not in (pynvml.NVML_DEVICE_MIG_ENABLE, pynvml.NVML_DEVICE_MIG_DISABLE):
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        with self._lock:
            if mode == pynvml.NVML_DEVICE_MIG_DISABLE and self._gis[device.position]:
                raise _error(pynvml.NVML_ERROR_IN_USE)
            if self.hardware.gpus[device.position].mig_mode_needs_reset:
                current = pynvml.NVML_DEVICE_MIG_ENABLE if self._mig_mode[device.position] else \
                    pynvml.NVML_DEVICE_MIG_DISABLE
                self._mig_pending[device.position] = None if mode == current else mode
                return int(pynvml.NVML_ERROR_RESET_REQUIRED)
            self._mig_mode[device.position] = mode == pynvml.NVML_DEVICE_MIG_ENABLE
        return int(pynvml.NVML_SUCCESS)

    def nvmlDeviceGetGpuInstancePossiblePlacements(self, device: FakeHandle, profileId: int, placementsRef: Any,
                                                   countRef: Any) -> int:
        """Every legal placement of the profile, free or not, whatever the MIG mode (as NVML documents it).
        placementsRef: None (count only) or a ctypes array of pynvml.c_nvmlGpuInstancePlacement_t; countRef:
        byref(c_uint) holding the array's length, set to the number of placements."""
        model = self._mig_model("nvmlDeviceGetGpuInstancePossiblePlacements", device)
        profile = model.profile_by_id(profileId)
        if profile is None:
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        count = _deref(countRef)
        if placementsRef is not None:
            if count.value < len(profile.starts):
                raise _error(pynvml.NVML_ERROR_INSUFFICIENT_SIZE)
            for slot, start in enumerate(profile.starts):
                placementsRef[slot].start = start
                placementsRef[slot].size = profile.memory_slices
        count.value = len(profile.starts)
        return int(pynvml.NVML_SUCCESS)

    def nvmlDeviceCreateGpuInstanceWithPlacement(self, device: FakeHandle, profileId: int,
                                                 placement: Any) -> FakeGpuInstance:
        """NVML's rules: MIG mode on, a profile of the model, a legal start with the profile's size (each
        InvalidArgument otherwise), no overlap with a GPU instance there and no more instances than the profile allows
        (InsufficientResources)."""
        model = self._mig_model("nvmlDeviceCreateGpuInstanceWithPlacement", device)
        self._fail_injected("nvmlDeviceCreateGpuInstanceWithPlacement")
        wanted = _deref(placement)
        profile = model.profile_by_id(profileId)
        if profile is None or wanted.start not in profile.starts or wanted.size != profile.memory_slices:
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        with self._lock:
            if not self._mig_mode[device.position]:
                raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
            instances = self._gis[device.position]
            layout = [(gi.profile.name, gi.start) for gi in instances.values()] + [(profile.name, wanted.start)]
            if mig.legal_layout(model, layout) is not None:
                raise _error(pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES)
            gi_id = min(set(range(1, len(instances) + 2)) - set(instances))  # NVML reuses freed IDs
            self._created += 1
            gpu_uuid = self.hardware.gpus[device.position].uuid
            instances[gi_id] = _FakeGi(gi_id, profile, wanted.start, _dynamic_mig_uuid(gpu_uuid, self._created),
                                       set())
        return FakeGpuInstance(device.position, gi_id - 1)

    def _gi(self, name: str, gpuInstance: FakeGpuInstance) -> _FakeGi:
        self._gpu(name, FakeHandle(gpuInstance.position))
        instance = self._gis[gpuInstance.position].get(gpu_instance_id(gpuInstance.instance))
        if instance is None:
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)  # destroyed, or never created
        return instance

    def nvmlGpuInstanceCreateComputeInstance(self, gpuInstance: FakeGpuInstance, profileId: int) -> FakeComputeInstance:
        """One compute instance spanning the GPU instance (the compute profile of its slice count); the fake does
        not split a GPU instance into smaller compute instances (NotSupported)."""
        instance = self._gi("nvmlGpuInstanceCreateComputeInstance", gpuInstance)
        self._fail_injected("nvmlGpuInstanceCreateComputeInstance")
        if COMPUTE_PROFILE_BY_SLICES.get(instance.profile.compute_slices) != profileId:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        with self._lock:
            if instance.compute:
                raise _error(pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES)
            instance.compute.add(0)
        return FakeComputeInstance(gpuInstance.position, instance.gi_id, 0)

    def nvmlGpuInstanceGetComputeInstanceById(self, gpuInstance: FakeGpuInstance, id: int) -> FakeComputeInstance:
        instance = self._gi("nvmlGpuInstanceGetComputeInstanceById", gpuInstance)
        if id not in instance.compute:
            raise _error(pynvml.NVML_ERROR_NOT_FOUND)
        return FakeComputeInstance(gpuInstance.position, instance.gi_id, id)

    def nvmlComputeInstanceDestroy(self, computeInstance: FakeComputeInstance) -> int:
        self._gpu("nvmlComputeInstanceDestroy", FakeHandle(computeInstance.position))
        self._fail_injected("nvmlComputeInstanceDestroy")
        with self._lock:
            instance = self._gis[computeInstance.position].get(computeInstance.gi_id)
            if instance is None or computeInstance.ci_id not in instance.compute:
                raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
            instance.compute.discard(computeInstance.ci_id)
        return int(pynvml.NVML_SUCCESS)

    def nvmlGpuInstanceDestroy(self, gpuInstance: FakeGpuInstance) -> int:
        """A GPU instance that still has compute instances is InUse (as NVML answers)."""
        instance = self._gi("nvmlGpuInstanceDestroy", gpuInstance)
        self._fail_injected("nvmlGpuInstanceDestroy")
        with self._lock:
            if instance.compute:
                raise _error(pynvml.NVML_ERROR_IN_USE)
            del self._gis[gpuInstance.position][instance.gi_id]
        return int(pynvml.NVML_SUCCESS)

    # As a real H200 answers with MIG off (driver 580): max count 0, every index and GPU instance NotFound.

    def nvmlDeviceGetMaxMigDeviceCount(self, handle: FakeHandle) -> int:
        gpu = self._gpu("nvmlDeviceGetMaxMigDeviceCount", handle)
        if not gpu.mig_capable:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return MAX_MIG_DEVICES if self._mig_mode[handle.position] else 0

    def nvmlDeviceGetMigDeviceHandleByIndex(self, device: FakeHandle, index: int) -> FakeMigHandle:
        gpu = self._gpu("nvmlDeviceGetMigDeviceHandleByIndex", device)
        if not gpu.mig_capable:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if not self._mig_mode[device.position]:
            raise _error(pynvml.NVML_ERROR_NOT_FOUND)
        if not 0 <= index < MAX_MIG_DEVICES:
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        devices = self._devices(device.position)
        if index >= len(devices):
            raise _error(pynvml.NVML_ERROR_NOT_FOUND)  # no MIG device at this index
        return FakeMigHandle(device.position, devices[index].gi_id - 1)

    def nvmlDeviceIsMigDeviceHandle(self, device: FakeHandle | FakeMigHandle) -> bool:
        self._enter("nvmlDeviceIsMigDeviceHandle")
        return isinstance(device, FakeMigHandle)

    def nvmlDeviceGetGpuInstanceId(self, device: FakeMigHandle) -> int:
        if not isinstance(device, FakeMigHandle):
            self._gpu("nvmlDeviceGetGpuInstanceId", device)
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)  # not a MIG device
        self._mig("nvmlDeviceGetGpuInstanceId", device)
        return gpu_instance_id(device.instance)

    def nvmlDeviceGetComputeInstanceId(self, device: FakeMigHandle) -> int:
        if not isinstance(device, FakeMigHandle):
            self._gpu("nvmlDeviceGetComputeInstanceId", device)
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        self._mig("nvmlDeviceGetComputeInstanceId", device)
        return 0

    def nvmlDeviceGetAttributes(self, device: FakeMigHandle) -> FakeDeviceAttributes:
        if not isinstance(device, FakeMigHandle):
            self._gpu("nvmlDeviceGetAttributes", device)
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)  # the fake describes MIG devices only
        _gpu, profile = self._mig("nvmlDeviceGetAttributes", device)
        return FakeDeviceAttributes(profile.multiprocessors, profile.compute_slices, profile.compute_slices,
                                    profile.memory_mib)

    def nvmlDeviceGetGpuInstanceById(self, device: FakeHandle, id: int) -> FakeGpuInstance:
        self._gpu("nvmlDeviceGetGpuInstanceById", device)
        if not self._mig_mode[device.position] or id not in self._gis[device.position]:
            raise _error(pynvml.NVML_ERROR_NOT_FOUND)
        return FakeGpuInstance(device.position, id - 1)

    def nvmlGpuInstanceGetInfo(self, gpuInstance: FakeGpuInstance) -> FakeGpuInstanceInfo:
        instance = self._gi("nvmlGpuInstanceGetInfo", gpuInstance)
        return FakeGpuInstanceInfo(FakeHandle(gpuInstance.position), instance.gi_id, instance.profile.profile_id,
                                   FakePlacement(instance.start, instance.profile.memory_slices))

    def mig_instances(self, position: int) -> list[tuple[str, int, bool]]:
        """Test view (not pynvml): the GPU instances of a GPU as (profile, start, has a compute instance)."""
        with self._lock:
            return [(gi.profile.name, gi.start, bool(gi.compute)) for _id, gi in sorted(self._gis[position].items())]

    def nvmlDeviceGetTopologyCommonAncestor(self, device1: FakeHandle, device2: FakeHandle) -> int:
        first = self._gpu("nvmlDeviceGetTopologyCommonAncestor", device1)
        second = self._gpu("nvmlDeviceGetTopologyCommonAncestor", device2)
        return _common_ancestor(first.pcie_path, second.pcie_path)

    # NVLink: links are numbered peers first (in peer order), then the fabric lanes; a GPU without NVLink
    # answers NotSupported, a link number past the GPU's links InvalidArgument (as the real library does).

    def _links(self, gpu: FakeGpu) -> list[tuple[str, int | None]]:
        links: list[tuple[str, int | None]] = []
        for peer, lanes in gpu.nvlink_peers:
            links.extend([("gpu", peer)] * lanes)
        links.extend([("switch", None)] * gpu.nvswitch_lanes)
        return links

    def _link(self, name: str, handle: FakeHandle, link: int) -> tuple[str, int | None] | None:
        gpu = self._gpu(name, handle)
        links = self._link_tables[handle.position]
        link_count = len(links) if gpu.nvlink_max is None else max(gpu.nvlink_max, len(links))
        if link_count == 0:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if not 0 <= link < link_count:
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return links[link] if link < len(links) else None  # None: a link the GPU has but is not trained

    def nvmlDeviceGetNvLinkState(self, device: FakeHandle, link: int) -> int:
        active = self._link("nvmlDeviceGetNvLinkState", device, link) is not None
        state: int = pynvml.NVML_FEATURE_ENABLED if active else pynvml.NVML_FEATURE_DISABLED
        return state

    def nvmlDeviceGetNvLinkRemotePciInfo(self, device: FakeHandle, link: int) -> FakePciInfo:
        target = self._link("nvmlDeviceGetNvLinkRemotePciInfo", device, link)
        if target is None:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        kind, peer = target
        if kind == "gpu" and peer is not None:
            bus_id = self.hardware.gpus[peer].bus_id
        else:
            bus_id = "00000000:E0:00.0"  # an NVSwitch's PCI address
        return FakePciInfo(busId=bus_id, busIdLegacy=bus_id[-12:])

    def nvmlDeviceGetNvLinkRemoteDeviceType(self, handle: FakeHandle, link: int) -> int:
        target = self._link("nvmlDeviceGetNvLinkRemoteDeviceType", handle, link)
        device_type: int
        if target is None:
            device_type = pynvml.NVML_NVLINK_DEVICE_TYPE_UNKNOWN
        elif target[0] == "gpu":
            device_type = pynvml.NVML_NVLINK_DEVICE_TYPE_GPU
        else:
            device_type = pynvml.NVML_NVLINK_DEVICE_TYPE_SWITCH
        return device_type

    # -- events -------------------------------------------------------------------------------------------------

    def nvmlEventSetCreate(self) -> FakeEventSet:
        self._enter("nvmlEventSetCreate")
        event_set = FakeEventSet()
        with self._lock:
            self._event_sets.append(event_set)
        return event_set

    def nvmlDeviceRegisterEvents(self, handle: FakeHandle, eventTypes: int, eventSet: FakeEventSet) -> None:
        self._gpu("nvmlDeviceRegisterEvents", handle)
        with self._lock:
            eventSet.registered[handle.position] = eventSet.registered.get(handle.position, 0) | eventTypes

    def nvmlEventSetWait_v2(self, eventSet: FakeEventSet, timeoutms: int) -> FakeEventData:
        self._enter("nvmlEventSetWait_v2")
        with self._lock:
            # the real call blocks in the driver for up to timeoutms; here a condition variable does
            self._lock.wait_for(lambda: bool(eventSet.pending) or eventSet.freed, timeout=timeoutms / 1000)
            if not eventSet.pending:
                raise _error(pynvml.NVML_ERROR_TIMEOUT)
            return eventSet.pending.popleft()

    def nvmlEventSetFree(self, eventSet: FakeEventSet) -> None:
        self._enter("nvmlEventSetFree")
        with self._lock:
            eventSet.freed = True
            if eventSet in self._event_sets:
                self._event_sets.remove(eventSet)
            self._lock.notify_all()


def _common_ancestor(first: tuple[str, ...], second: tuple[str, ...]) -> int:
    """NVML's nvmlDeviceGetTopologyCommonAncestor level for two PCIe paths."""
    depth = 0
    while depth < min(len(first), len(second)) and first[depth] == second[depth]:
        depth += 1
    if depth == 0:
        return int(pynvml.NVML_TOPOLOGY_SYSTEM)  # different NUMA nodes: across the CPU interconnect
    kind = first[depth - 1].split(":", 1)[0]
    if kind == "board":
        return int(pynvml.NVML_TOPOLOGY_INTERNAL)
    if kind == "switch":
        # both directly under the shared switch: one switch traversed; otherwise several
        directly = depth == len(first) == len(second)
        return int(pynvml.NVML_TOPOLOGY_SINGLE if directly else pynvml.NVML_TOPOLOGY_MULTIPLE)
    if kind == "hostbridge":
        return int(pynvml.NVML_TOPOLOGY_HOSTBRIDGE)
    return int(pynvml.NVML_TOPOLOGY_NODE)
