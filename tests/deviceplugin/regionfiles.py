"""Limiter shared-region files for tests, built from HAMi-core's C declarations (src/multiprocess/
multiprocess_memory_limit.h) with ctypes, which lays a Structure out by the C ABI's rules: the offsets come from
the declarations here, not from the parser's constants, so the tests check those constants too."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from pathlib import Path

MAX_DEVICES = 16
MAX_PROCESSES = 1024
MAGIC = 19920718


class DeviceMemory(ctypes.Structure):  # device_memory_t
    _fields_ = [
        ("context_size", ctypes.c_uint64),
        ("module_size", ctypes.c_uint64),
        ("data_size", ctypes.c_uint64),
        ("offset", ctypes.c_uint64),
        ("total", ctypes.c_uint64),
        ("unused", ctypes.c_uint64 * 3),
    ]


class DeviceUtil(ctypes.Structure):  # device_util_t
    _fields_ = [
        ("dec_util", ctypes.c_uint64),
        ("enc_util", ctypes.c_uint64),
        ("sm_util", ctypes.c_uint64),
        ("unused", ctypes.c_uint64 * 3),
    ]


class ProcSlot(ctypes.Structure):  # shrreg_proc_slot_t, version 1.2 (1.1: unused[3] where seqlock, unused[2] are)
    _fields_ = [
        ("pid", ctypes.c_int32),
        ("hostpid", ctypes.c_int32),
        ("used", DeviceMemory * MAX_DEVICES),
        ("monitorused", ctypes.c_uint64 * MAX_DEVICES),
        ("device_util", DeviceUtil * MAX_DEVICES),
        ("status", ctypes.c_int32),
        ("seqlock", ctypes.c_uint64),
        ("unused", ctypes.c_uint64 * 2),
    ]


class SemT(ctypes.Union):  # glibc's sem_t on LP64: 32 bytes, aligned as a long
    _fields_ = [("size", ctypes.c_char * 32), ("align", ctypes.c_long)]


class SharedRegionT(ctypes.Structure):  # shared_region_t
    _fields_ = [
        ("initialized_flag", ctypes.c_int32),
        ("major_version", ctypes.c_uint32),
        ("minor_version", ctypes.c_uint32),
        ("sm_init_flag", ctypes.c_int32),
        ("owner_pid", ctypes.c_size_t),
        ("sem", SemT),
        ("device_num", ctypes.c_uint64),
        ("uuids", (ctypes.c_char * 96) * MAX_DEVICES),
        ("limit", ctypes.c_uint64 * MAX_DEVICES),
        ("sm_limit", ctypes.c_uint64 * MAX_DEVICES),
        ("procs", ProcSlot * MAX_PROCESSES),
        ("proc_num", ctypes.c_int),
        ("utilization_switch", ctypes.c_int),
        ("recent_kernel", ctypes.c_int),
        ("priority", ctypes.c_int),
        ("last_kernel_time", ctypes.c_uint64),
        ("sem_postinit", SemT),  # version 1.1: uint64_t unused[4], the same 32 bytes
    ]


@dataclass
class Process:
    pid: int
    used_bytes: list[int]  # per device (device_memory_t.total)
    sm_util: list[int]  # per device, percent


@dataclass
class Region:
    uuids: list[str]
    limits_bytes: list[int]
    sm_limits: list[int]
    processes: list[Process] = field(default_factory=list)
    major: int = 1
    minor: int = 2
    flag: int = MAGIC

    def build(self) -> bytes:
        region = SharedRegionT()
        region.initialized_flag = self.flag
        region.major_version = self.major
        region.minor_version = self.minor
        region.owner_pid = 4242
        region.device_num = len(self.uuids)
        for index, uuid in enumerate(self.uuids):
            region.uuids[index].value = uuid.encode()
            region.limit[index] = self.limits_bytes[index]
            region.sm_limit[index] = self.sm_limits[index]
        for slot, process in enumerate(self.processes):
            region.procs[slot].pid = process.pid
            region.procs[slot].hostpid = process.pid + 100000
            region.procs[slot].status = 1
            for index, used in enumerate(process.used_bytes):
                # what the limiter adds up: context + modules + data = total
                region.procs[slot].used[index].context_size = used // 4
                region.procs[slot].used[index].data_size = used - used // 4
                region.procs[slot].used[index].total = used
                region.procs[slot].monitorused[index] = used
            for index, sm in enumerate(process.sm_util):
                region.procs[slot].device_util[index].sm_util = sm
        region.proc_num = len(self.processes)
        return bytes(region)

    def write_pod_volume(self, pods_dir: Path, pod_uid: str, container: str,
                         volume: str = "kube-vgpu-cache") -> Path:
        """Where kubelet keeps the webhook's cache emptyDir of pod `pod_uid`: `<container>.cache` in it."""
        directory = pods_dir / pod_uid / "volumes" / "kubernetes.io~empty-dir" / volume
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"{container}.cache"
        path.write_bytes(self.build())
        return path

    def write(self, cache_dir: Path, pod_uid: str, container: str) -> Path:
        directory = cache_dir / f"{pod_uid}_{container}"
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / "vgpu.cache"
        path.write_bytes(self.build())
        return path


def offset_of(*path: str) -> int:
    """Byte offset of a field of shared_region_t, e.g. offset_of("proc_num")."""
    structure: type[ctypes.Structure] = SharedRegionT
    total = 0
    for name in path:
        descriptor = getattr(structure, name)
        total += descriptor.offset
    return total
