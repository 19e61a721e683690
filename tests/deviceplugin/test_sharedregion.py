"""The limiter's shared-region files: parsed from bytes laid out by HAMi-core's C declarations (regionfiles.py),
and every corrupt, foreign, truncated or hostile file is skipped with a reason, never a crash."""

from __future__ import annotations

import ctypes
import os
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kube_vgpu.deviceplugin import sharedregion as sr
from kube_vgpu.deviceplugin.sharedregion import SharedRegionError, parse_shared_region, read_region_file, scan_cache_dir
from tests.deviceplugin.regionfiles import Process, ProcSlot, Region, SharedRegionT, offset_of

GIB = 1024**3
UUID_A = "GPU-6b8d2f1e-0a4c-4e65-9d3b-1c2d3e4f5a6b"
UUID_B = "GPU-0f1e2d3c-4b5a-6978-8a9b-0c1d2e3f4a5b"


def two_gpu_region(**overrides: object) -> Region:
    region = Region(
        uuids=[UUID_A, UUID_B],
        limits_bytes=[8 * GIB, 4 * GIB],
        sm_limits=[30, 0],
        processes=[Process(31, [3 * GIB, 512 * 1024**2], [12, 0]), Process(32, [GIB, 0], [7, 0])],
    )
    for name, value in overrides.items():
        setattr(region, name, value)
    return region


def patched(data: bytes, offset: int, fmt: str, value: int) -> bytes:
    buffer = bytearray(data)
    struct.pack_into(fmt, buffer, offset, value)
    return bytes(buffer)


def test_the_parser_offsets_are_the_c_layout() -> None:
    assert ctypes.sizeof(SharedRegionT) == sr.REGION_BYTES == 2008952
    assert ctypes.sizeof(ProcSlot) == sr.SLOT_BYTES
    assert offset_of("device_num") == sr.OFF_DEVICE_NUM
    assert offset_of("uuids") == sr.OFF_UUIDS
    assert offset_of("limit") == sr.OFF_LIMIT
    assert offset_of("sm_limit") == sr.OFF_SM_LIMIT
    assert offset_of("procs") == sr.OFF_PROCS
    assert offset_of("proc_num") == sr.OFF_PROC_NUM
    assert ProcSlot.used.offset == sr.SLOT_USED and ProcSlot.device_util.offset == sr.SLOT_UTIL


@pytest.mark.parametrize("minor", [1, 2])
def test_a_region_reads_as_limits_and_the_sum_over_processes(minor: int) -> None:
    region = parse_shared_region(two_gpu_region(minor=minor).build())
    assert (region.major, region.minor, region.processes) == (1, minor, 2)
    first, second = region.devices
    assert (first.uuid, first.memory_limit_bytes, first.core_limit_percent) == (UUID_A, 8 * GIB, 30)
    assert (first.memory_used_bytes, first.sm_utilization_percent) == (4 * GIB, 19)
    assert (second.uuid, second.memory_limit_bytes, second.core_limit_percent) == (UUID_B, 4 * GIB, 0)
    assert (second.memory_used_bytes, second.sm_utilization_percent) == (512 * 1024**2, 0)


def test_an_empty_slot_and_slots_past_proc_num_are_not_counted() -> None:
    data = two_gpu_region(processes=[Process(0, [GIB, 0], [50, 0]), Process(9, [2 * GIB, 0], [5, 0])]).build()
    region = parse_shared_region(data)
    assert region.processes == 1 and region.devices[0].memory_used_bytes == 2 * GIB
    # a slot beyond proc_num (left behind when the limiter compacted the table) is stale
    stale = patched(data, offset_of("procs") + 2 * sr.SLOT_BYTES, "<i", 77)
    stale = patched(stale, offset_of("procs") + 2 * sr.SLOT_BYTES + sr.SLOT_USED + sr.DEVICE_MEMORY_TOTAL, "<Q", GIB)
    assert parse_shared_region(stale).devices[0].memory_used_bytes == 2 * GIB


def test_a_container_without_processes_reads_as_zero_use() -> None:
    region = parse_shared_region(two_gpu_region(processes=[]).build())
    assert region.processes == 0
    assert [(d.memory_used_bytes, d.sm_utilization_percent) for d in region.devices] == [(0, 0), (0, 0)]


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (lambda d: d[: sr.REGION_BYTES - 1], "truncated: 2008951 bytes"),
        (lambda d: b"", "truncated: 0 bytes"),
        (lambda d: patched(d, 0, "<i", 0), "not a HAMi-core shared region (initialized_flag 0"),
        (lambda d: patched(d, 0, "<i", 1), "still initialising"),
        (lambda d: patched(d, 4, "<I", 2), "region version 2.2 is not one this reader knows (1.1, 1.2)"),
        (lambda d: patched(d, 8, "<I", 0), "region version 1.0"),
        (lambda d: patched(d, sr.OFF_DEVICE_NUM, "<Q", 17), "device_num 17 is over 16"),
        (lambda d: patched(d, sr.OFF_DEVICE_NUM, "<Q", 2**64 - 1), "device_num 18446744073709551615"),
        (lambda d: patched(d, sr.OFF_PROC_NUM, "<i", 1025), "proc_num 1025 is outside 0..1024"),
        (lambda d: patched(d, sr.OFF_PROC_NUM, "<i", -1), "proc_num -1"),
        (lambda d: patched(d, sr.OFF_SM_LIMIT, "<Q", 101), "sm_limit[0] is 101"),
        (lambda d: d[: sr.OFF_UUIDS] + b"G" * 96 + d[sr.OFF_UUIDS + 96 :], "uuids[0] is not NUL-terminated"),
        (lambda d: d[: sr.OFF_UUIDS + 96] + b"GPU-\xff\n\0" + d[sr.OFF_UUIDS + 103 :], "uuids[1] holds bytes"),
    ],
)
def test_corrupt_and_foreign_regions_are_refused_with_the_reason(damage: Callable[[bytes], bytes], reason: str) -> None:
    data = two_gpu_region().build()
    with pytest.raises(SharedRegionError) as caught:
        parse_shared_region(damage(data))
    assert reason in str(caught.value)


def test_only_the_live_part_of_a_region_is_read() -> None:
    data = two_gpu_region().build()
    asked: list[tuple[int, int]] = []

    def read(offset: int, size: int) -> bytes:
        asked.append((offset, size))
        return data[offset : offset + size]

    assert sr.parse_region(len(data), read).processes == 2
    assert asked == [(0, sr.OFF_PROCS), (sr.OFF_PROC_NUM, 4), (sr.OFF_PROCS, 2 * sr.SLOT_BYTES)]
    assert sum(size for _, size in asked) < 6000  # of a 2 MB region


def test_a_file_that_shrinks_while_read_is_truncated() -> None:
    data = two_gpu_region().build()
    with pytest.raises(SharedRegionError, match=r"truncated: ends inside bytes 1856\.\.5776"):
        sr.parse_region(len(data), lambda offset, size: data[offset : offset + size] if offset != sr.OFF_PROCS else b"")


def test_a_longer_file_is_read_up_to_one_region(tmp_path: Path) -> None:
    path = tmp_path / "vgpu.cache"
    path.write_bytes(two_gpu_region().build() + b"\xff" * 4096)
    assert read_region_file(path).devices[0].uuid == UUID_A


def test_hostile_files_are_skipped_without_following_or_blocking(tmp_path: Path) -> None:
    """A container owns its cache directory: a link to a host file, a FIFO or a directory in place of the file."""
    secret = tmp_path / "host-secret"
    secret.write_bytes(two_gpu_region().build())
    link = tmp_path / "link.cache"
    link.symlink_to(secret)
    with pytest.raises(SharedRegionError, match="symbolic link"):
        read_region_file(link)
    fifo = tmp_path / "fifo.cache"
    os.mkfifo(fifo)
    with pytest.raises(SharedRegionError, match="not a regular file"):
        read_region_file(fifo)  # O_NONBLOCK: opening a FIFO with no writer returns at once
    directory = tmp_path / "dir.cache"
    directory.mkdir()
    with pytest.raises(SharedRegionError, match="not a regular file"):
        read_region_file(directory)
    with pytest.raises(SharedRegionError, match="cannot open"):
        read_region_file(tmp_path / "absent.cache")


def test_scanning_a_cache_directory(tmp_path: Path) -> None:
    cache = tmp_path / "containers"
    two_gpu_region().write(cache, "uid-1", "trainer")
    Region(uuids=[UUID_B], limits_bytes=[GIB], sm_limits=[50]).write(cache, "uid-2", "server")
    (cache / "uid-3_notyet").mkdir()  # CUDA not started yet: no file, not a skip
    broken = cache / "uid-4_broken"
    broken.mkdir()
    (broken / "vgpu.cache").write_bytes(b"\0" * 100)
    (cache / "no-separator").mkdir()
    (cache / "uid-5_linked").symlink_to(cache / "uid-1_trainer")  # a linked directory is not walked into
    found, skipped = scan_cache_dir(cache)
    assert [(u.pod_uid, u.container, len(u.region.devices)) for u in found] == [
        ("uid-1", "trainer", 2),
        ("uid-2", "server", 1),
    ]
    assert [(Path(s.path).relative_to(cache).as_posix(), s.reason.split(":")[0]) for s in skipped] == [
        ("no-separator", "directory name is not <pod uid>_<container>"),
        ("uid-4_broken/vgpu.cache", "truncated"),
    ]
    assert scan_cache_dir(tmp_path / "absent") == ([], [])


def test_scanning_kubelets_pods_directory(tmp_path: Path) -> None:
    """The webhook's layout: `<container>.cache` files in each GPU pod's cache emptyDir."""
    pods = tmp_path / "pods"
    two_gpu_region().write_pod_volume(pods, "uid-a", "trainer")
    Region(uuids=[UUID_B], limits_bytes=[GIB], sm_limits=[0]).write_pod_volume(pods, "uid-a", "sidecar")
    Region(uuids=[UUID_B], limits_bytes=[GIB], sm_limits=[0]).write_pod_volume(pods, "uid-b", "other", "not-ours")
    (pods / "uid-c" / "volumes").mkdir(parents=True)  # a pod without GPUs
    flood = pods / "uid-d" / "volumes" / "kubernetes.io~empty-dir" / "kube-vgpu-cache"
    flood.mkdir(parents=True)
    for number in range(sr.MAX_FILES_PER_POD + 2):  # a pod writing files into its own emptyDir
        (flood / f"c{number:03d}.cache").write_bytes(b"x")
    (flood / "notes.txt").write_bytes(b"ignored: not a region file name")
    found, skipped = sr.scan_kubelet_pods(pods, "kube-vgpu-cache")
    assert [(u.pod_uid, u.container) for u in found] == [("uid-a", "sidecar"), ("uid-a", "trainer")]
    assert len(skipped) == sr.MAX_FILES_PER_POD + 1
    assert skipped[-1] == sr.Skipped(str(flood), f"{sr.MAX_FILES_PER_POD + 2} region files; only the first "
                                     f"{sr.MAX_FILES_PER_POD} (by name) are read")
    assert all("truncated" in s.reason for s in skipped[:-1])
    assert sr.scan_kubelet_pods(tmp_path / "absent", "kube-vgpu-cache") == ([], [])


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=4096))
def test_random_bytes_never_crash_the_parser(data: bytes) -> None:
    with pytest.raises(SharedRegionError):
        parse_shared_region(data)  # shorter than a region: always refused, never anything else


VALID = two_gpu_region().build()
#: the header, the first slots and the tail: where a damaged byte changes what the parser reads
HOT = [*range(0, sr.OFF_PROCS + 3 * sr.SLOT_BYTES), *range(sr.OFF_PROC_NUM, sr.REGION_BYTES)]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from(HOT), st.binary(min_size=1, max_size=8)), max_size=12),
       st.one_of(st.none(), st.integers(min_value=0, max_value=sr.REGION_BYTES)))
def test_damaged_regions_parse_or_are_refused_never_crash(patches: list[tuple[int, bytes]], cut: int | None) -> None:
    buffer = bytearray(VALID)
    for offset, chunk in patches:
        buffer[offset : offset + len(chunk)] = chunk
    data = bytes(buffer[: len(VALID)] if cut is None else buffer[:cut])
    try:
        region = parse_shared_region(data)
    except SharedRegionError as exc:
        assert str(exc)
        return
    assert len(region.devices) <= sr.MAX_DEVICES and 0 <= region.processes <= sr.MAX_PROCESSES
    for device in region.devices:
        assert device.uuid.isprintable() and device.memory_used_bytes >= 0 and 0 <= device.core_limit_percent <= 100
