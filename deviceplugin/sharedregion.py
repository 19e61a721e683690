"""Read what a container really uses from the limiter's shared cache region (HAMi-core's `shared_region_t`).

The limiter (HAMi-core's libvgpu.so) keeps, per container, a file it maps into every CUDA process of the container
(`CUDA_DEVICE_MEMORY_SHARED_CACHE`). Two layouts on the node: the webhook's (the manifests' default), a cache
emptyDir per pod holding `<container>.cache`, read through kubelet's pods directory (`scan_kubelet_pods`); and the
device plugin's own (`--shared-cache-dir`), `<dir>/<pod uid>_<container>/vgpu.cache` (allocate.py,
`scan_cache_dir`). The file is the C struct `shared_region_t` of HAMi-core's
src/multiprocess/multiprocess_memory_limit.h, laid out for LP64 Linux (x86_64 and arm64, glibc's 32-byte sem_t):

    offset   field                                   offset in a process slot (shrreg_proc_slot_t, 1960 bytes)
    0        int32  initialized_flag (19920718)      0     int32 pid
    4        uint32 major_version (1)                4     int32 hostpid
    8        uint32 minor_version (1 or 2)           8     device_memory_t used[16]  (64 bytes each: context_size,
    12       int32  sm_init_flag                                                     module_size, data_size, offset,
    16       size_t owner_pid                                                        total, 3 unused; bytes)
    24       sem_t  sem (32 bytes)                   1032  uint64 monitorused[16]
    56       uint64 device_num                       1160  device_util_t device_util[16] (48 bytes each: dec_util,
    64       char   uuids[16][96]                                                   enc_util, sm_util, 3 unused; %)
    1600     uint64 limit[16]     (bytes)            1928  int32 status
    1728     uint64 sm_limit[16]  (percent, 0: none) 1936  v1.1: unused[3]; v1.2: seqlock, unused[2]
    1856     shrreg_proc_slot_t procs[1024]
    2008896  int32 proc_num, utilization_switch, recent_kernel, priority; uint64 last_kernel_time;
             32 bytes (v1.1: unused[4]; v1.2: sem_postinit)         -> 2008952 bytes in all

Versions 1.1 and 1.2 share every offset read here. A container controls its own cache file, so the file is
untrusted input: it is opened without following links and without blocking (a FIFO must not hang a scrape), only
a regular file is read, and of it only the header, the process count and the slots in use (a few KB, not the
2 MB region), and every count and value is checked against the layout. A file
that is truncated, not initialised, of another version or out of range is skipped with a reason (logged by the
caller), never a crash. Values are read without the limiter's lock (it is a live mapping): one scrape may see a
process mid-update, which the next scrape corrects.
"""

from __future__ import annotations

import errno
import os
import stat
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

MAGIC = 19920718
INIT_IN_PROGRESS = 1
SUPPORTED_VERSIONS = frozenset({(1, 1), (1, 2)})
MAX_DEVICES = 16
MAX_PROCESSES = 1024
UUID_BYTES = 96

OFF_INITIALIZED = 0
OFF_MAJOR = 4
OFF_MINOR = 8
OFF_DEVICE_NUM = 56
OFF_UUIDS = 64
OFF_LIMIT = OFF_UUIDS + MAX_DEVICES * UUID_BYTES  # 1600
OFF_SM_LIMIT = OFF_LIMIT + MAX_DEVICES * 8  # 1728
OFF_PROCS = OFF_SM_LIMIT + MAX_DEVICES * 8  # 1856

DEVICE_MEMORY_BYTES = 64  # device_memory_t: 8 uint64
DEVICE_MEMORY_TOTAL = 32  # .total: the 5th uint64
DEVICE_UTIL_BYTES = 48  # device_util_t: 6 uint64
DEVICE_UTIL_SM = 16  # .sm_util: the 3rd uint64
SLOT_PID = 0
SLOT_USED = 8
SLOT_MONITOR = SLOT_USED + MAX_DEVICES * DEVICE_MEMORY_BYTES  # 1032
SLOT_UTIL = SLOT_MONITOR + MAX_DEVICES * 8  # 1160
SLOT_BYTES = 1960

OFF_PROC_NUM = OFF_PROCS + MAX_PROCESSES * SLOT_BYTES  # 2008896
REGION_BYTES = OFF_PROC_NUM + 4 * 4 + 8 + 32  # 2008952

#: the file the limiter writes in each container's cache directory (allocate.py sets CUDA_DEVICE_MEMORY_SHARED_CACHE)
CACHE_FILE_NAME = "vgpu.cache"
#: the webhook's layout: one `<container>.cache` per GPU container in the pod's cache emptyDir
CACHE_SUFFIX = ".cache"
EMPTY_DIR_PLUGIN = "kubernetes.io~empty-dir"
#: region files read per pod at most: a pod can create any number of files in its own emptyDir
MAX_FILES_PER_POD = 64


class SharedRegionError(ValueError):
    """The file is not a shared region this parser understands; the message says why."""


@dataclass(frozen=True, slots=True)
class DeviceUsage:
    """One GPU of a container: its limits and what its processes use now."""

    index: int  # CUDA device index inside the container
    uuid: str
    memory_limit_bytes: int  # 0: no limit
    core_limit_percent: int  # 0: no limit
    memory_used_bytes: int  # sum over the container's processes
    sm_utilization_percent: int  # sum over the container's processes (the limiter's own sampling)


@dataclass(frozen=True, slots=True)
class SharedRegion:
    major: int
    minor: int
    processes: int  # live process slots (pid != 0)
    devices: tuple[DeviceUsage, ...]


def _u32(data: bytes, offset: int) -> int:
    value: int = struct.unpack_from("<I", data, offset)[0]
    return value


def _i32(data: bytes, offset: int) -> int:
    value: int = struct.unpack_from("<i", data, offset)[0]
    return value


def _u64(data: bytes, offset: int) -> int:
    value: int = struct.unpack_from("<Q", data, offset)[0]
    return value


def _uuid(data: bytes, index: int) -> str:
    raw = data[OFF_UUIDS + index * UUID_BYTES : OFF_UUIDS + (index + 1) * UUID_BYTES]
    end = raw.find(b"\0")
    if end < 0:
        raise SharedRegionError(f"uuids[{index}] is not NUL-terminated within {UUID_BYTES} bytes")
    text = raw[:end]
    if not all(0x21 <= byte < 0x7F for byte in text):
        raise SharedRegionError(f"uuids[{index}] holds bytes that are not printable ASCII")
    return text.decode("ascii")


#: read(offset, size) -> at most `size` bytes of the region from `offset` (fewer only at its end)
Reader = Callable[[int, int], bytes]


def _exactly(read: Reader, offset: int, size: int) -> bytes:
    data = read(offset, size)
    if len(data) != size:
        raise SharedRegionError(f"truncated: ends inside bytes {offset}..{offset + size} of the region")
    return data


def parse_shared_region(data: bytes) -> SharedRegion:
    """The region in `data` (a file's bytes; beyond REGION_BYTES ignored). Raises SharedRegionError, nothing else."""
    return parse_region(len(data), lambda offset, size: data[offset : offset + size])


def parse_region(size: int, read: Reader) -> SharedRegion:
    """The region of `size` bytes that `read` reads: only the header, the process-count tail and the `proc_num`
    slots in use are read (a region is 2 MB, its live part a few KB). Raises SharedRegionError, nothing else."""
    if size < REGION_BYTES:
        raise SharedRegionError(f"truncated: {size} bytes, a version 1 region has {REGION_BYTES}")
    head = _exactly(read, 0, OFF_PROCS)
    flag = _i32(head, OFF_INITIALIZED)
    if flag == INIT_IN_PROGRESS:
        raise SharedRegionError("the limiter is still initialising the region")
    if flag != MAGIC:
        raise SharedRegionError(f"not a HAMi-core shared region (initialized_flag {flag}, expected {MAGIC})")
    major, minor = _u32(head, OFF_MAJOR), _u32(head, OFF_MINOR)
    if (major, minor) not in SUPPORTED_VERSIONS:
        supported = ", ".join(f"{a}.{b}" for a, b in sorted(SUPPORTED_VERSIONS))
        raise SharedRegionError(f"region version {major}.{minor} is not one this reader knows ({supported})")
    device_num = _u64(head, OFF_DEVICE_NUM)
    if device_num > MAX_DEVICES:
        raise SharedRegionError(f"device_num {device_num} is over {MAX_DEVICES}")
    proc_num = _i32(_exactly(read, OFF_PROC_NUM, 4), 0)
    if not 0 <= proc_num <= MAX_PROCESSES:
        raise SharedRegionError(f"proc_num {proc_num} is outside 0..{MAX_PROCESSES}")
    slots = _exactly(read, OFF_PROCS, proc_num * SLOT_BYTES)
    live = [base for base in range(0, len(slots), SLOT_BYTES) if _i32(slots, base + SLOT_PID) != 0]
    devices = []
    for index in range(device_num):
        sm_limit = _u64(head, OFF_SM_LIMIT + index * 8)
        if sm_limit > 100:
            raise SharedRegionError(f"sm_limit[{index}] is {sm_limit}, over 100 percent")
        used = 0
        utilization = 0
        for base in live:
            used += _u64(slots, base + SLOT_USED + index * DEVICE_MEMORY_BYTES + DEVICE_MEMORY_TOTAL)
            utilization += _u64(slots, base + SLOT_UTIL + index * DEVICE_UTIL_BYTES + DEVICE_UTIL_SM)
        devices.append(
            DeviceUsage(
                index=index,
                uuid=_uuid(head, index),
                memory_limit_bytes=_u64(head, OFF_LIMIT + index * 8),
                core_limit_percent=sm_limit,
                memory_used_bytes=used,
                sm_utilization_percent=utilization,
            )
        )
    return SharedRegion(major=major, minor=minor, processes=len(live), devices=tuple(devices))


def read_region_file(path: Path) -> SharedRegion:
    """Parse the region file at `path`, which a container may have replaced by anything: links are not followed,
    a FIFO or device does not block, only a regular file is read, and only the parts of the region in use.
    Raises SharedRegionError (OSError is turned into one too)."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise SharedRegionError("is a symbolic link; not followed") from None
        raise SharedRegionError(f"cannot open: {exc.strerror or exc}") from None

    def read(offset: int, size: int) -> bytes:
        chunks = []
        while size > 0:
            chunk = os.pread(fd, size, offset)
            if not chunk:  # the file shrank since fstat: _exactly says truncated
                break
            chunks.append(chunk)
            offset += len(chunk)
            size -= len(chunk)
        return b"".join(chunks)

    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise SharedRegionError("is not a regular file")
        return parse_region(info.st_size, read)
    except OSError as exc:
        raise SharedRegionError(f"cannot read: {exc.strerror or exc}") from None
    finally:
        os.close(fd)


@dataclass(frozen=True, slots=True)
class ContainerUsage:
    pod_uid: str
    container: str
    region: SharedRegion


@dataclass(frozen=True, slots=True)
class Skipped:
    path: str
    reason: str


def _directories(root: Path) -> list[os.DirEntry[str]]:
    """Real directories (not links to one) under `root`, by name; FileNotFoundError/OSError propagate."""
    entries = []
    for entry in sorted(os.scandir(root), key=lambda entry: entry.name):
        try:
            if entry.is_dir(follow_symlinks=False):
                entries.append(entry)
        except OSError:
            continue
    return entries


def scan_kubelet_pods(pods_dir: Path, volume: str) -> tuple[list[ContainerUsage], list[Skipped]]:
    """The webhook's layout, read from kubelet's pods directory: each pod's cache emptyDir `volume` at
    `<pods_dir>/<pod uid>/volumes/kubernetes.io~empty-dir/<volume>/`, one `<container>.cache` per GPU container.
    At most MAX_FILES_PER_POD files are read per pod; the rest are skipped with a reason."""
    found: list[ContainerUsage] = []
    skipped: list[Skipped] = []
    try:
        pods = _directories(pods_dir)
    except FileNotFoundError:
        return found, skipped
    except OSError as exc:
        return found, [Skipped(str(pods_dir), f"cannot list: {exc.strerror or exc}")]
    for pod in pods:
        cache = Path(pod.path) / "volumes" / EMPTY_DIR_PLUGIN / volume
        try:
            if not cache.is_dir() or cache.is_symlink():
                continue
            names = sorted(entry.name for entry in os.scandir(cache) if entry.name.endswith(CACHE_SUFFIX))
        except OSError as exc:
            skipped.append(Skipped(str(cache), f"cannot list: {exc.strerror or exc}"))
            continue
        for name in names[:MAX_FILES_PER_POD]:
            path = cache / name
            try:
                found.append(ContainerUsage(pod.name, name[: -len(CACHE_SUFFIX)], read_region_file(path)))
            except SharedRegionError as exc:
                skipped.append(Skipped(str(path), str(exc)))
        if len(names) > MAX_FILES_PER_POD:
            skipped.append(Skipped(str(cache), f"{len(names)} region files; only the first {MAX_FILES_PER_POD} "
                                   "(by name) are read"))
    return found, skipped


def scan_cache_dir(root: Path) -> tuple[list[ContainerUsage], list[Skipped]]:
    """Every container directory `<pod uid>_<container>` under `root` holding a region file: the parsed regions
    and the files skipped, with why. A container that has not started CUDA yet has no file: not a skip."""
    found: list[ContainerUsage] = []
    skipped: list[Skipped] = []
    try:
        entries = _directories(root)
    except FileNotFoundError:
        return found, skipped
    except OSError as exc:
        return found, [Skipped(str(root), f"cannot list: {exc.strerror or exc}")]
    for entry in entries:
        pod_uid, separator, container = entry.name.partition("_")
        path = Path(entry.path) / CACHE_FILE_NAME
        if not separator or not pod_uid or not container:
            skipped.append(Skipped(entry.path, "directory name is not <pod uid>_<container>"))
            continue
        if not os.path.lexists(path):
            continue
        try:
            found.append(ContainerUsage(pod_uid, container, read_region_file(path)))
        except SharedRegionError as exc:
            skipped.append(Skipped(str(path), str(exc)))
    return found, skipped
