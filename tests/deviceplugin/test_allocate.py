"""Allocate matching against an in-memory API server (a real implementation of the PodSource interface)."""

from __future__ import annotations

import argparse
import threading
from pathlib import Path

import pytest

from kube_vgpu import protocol
from kube_vgpu.dev.fixtures.inmemory_api import InMemoryCluster
from kube_vgpu.deviceplugin.allocate import (
    DEVICE_LIST_CDI,
    DEVICE_LIST_VOLUME_MOUNTS,
    AllocationError,
    Allocator,
    DeliveryConfig,
)
from kube_vgpu.deviceplugin.cli import add_arguments
from kube_vgpu.deviceplugin.discovery import discover
from kube_vgpu.deviceplugin.nvml import open_nvml
from kube_vgpu.deviceplugin.state import DeviceState, device_id
from tests.deviceplugin.builders import NODE, allocation_of, container, gpu_pod

GIB = 1024


@pytest.fixture
def state() -> DeviceState:
    return DeviceState(discover(open_nvml("a100-4-nvlink-pairs", NODE), sharing_count=4).inventory)


@pytest.fixture
def uuids(state: DeviceState) -> list[str]:
    return state.uuids()


@pytest.fixture
def cluster() -> InMemoryCluster:
    return InMemoryCluster()


@pytest.fixture
def allocator(cluster: InMemoryCluster, state: DeviceState, tmp_path: Path) -> Allocator:
    library = tmp_path / "libvgpu.so"
    library.write_bytes(b"\x7fELF")
    delivery = DeliveryConfig(limiter_library_path=str(library), cache_host_dir=str(tmp_path / "cache"))
    return Allocator(NODE, cluster, state, delivery)


def ids(uuid: str, *replicas: int) -> list[str]:
    return [device_id(uuid, r) for r in replicas]


def test_delivers_the_assigned_gpus_in_assignment_order(
    cluster: InMemoryCluster, allocator: Allocator, uuids: list[str], tmp_path: Path
) -> None:
    pod = gpu_pod(
        "train",
        containers=[container("main", 2, memory_mib=10 * GIB)],
        assignment={"main": [(uuids[3], 10 * GIB, 30), (uuids[1], 10 * GIB, 30)]},
        bound_at=1,
    )
    cluster.add_pod(pod)
    # kubelet picked IDs on other GPUs: they only count; the assigned GPUs are delivered
    [delivery] = allocator.allocate([ids(uuids[0], 0, 1)])
    assert delivery.pod == "default/train" and delivery.container == "main"
    assert delivery.envs[protocol.ENV_NVIDIA_VISIBLE_DEVICES] == f"{uuids[3]},{uuids[1]}"
    assert delivery.envs[protocol.ENV_CUDA_VISIBLE_DEVICES] == f"{uuids[3]},{uuids[1]}"
    assert delivery.envs["CUDA_DEVICE_MEMORY_LIMIT_0"] == "10240m"
    assert delivery.envs["CUDA_DEVICE_MEMORY_LIMIT_1"] == "10240m"
    uid = pod["metadata"]["uid"]
    cache = tmp_path / "cache" / f"{uid}_main"
    assert cache.is_dir()
    assert delivery.envs[protocol.ENV_SHARED_CACHE] == "/tmp/vgpu/vgpu.cache"
    assert ("/tmp/vgpu", str(cache), False) in delivery.mounts
    library = str(tmp_path / "libvgpu.so")
    assert (library, library, True) in delivery.mounts
    assert allocation_of(cluster.pod("default", "train")) == {"main": tuple(ids(uuids[0], 0, 1))}


def test_percentage_memory_is_delivered_in_mib(
    cluster: InMemoryCluster, allocator: Allocator, uuids: list[str]
) -> None:
    # gpumem-percentage 25 on an 80 GiB GPU: only the assignment knows the MiB
    cluster.add_pod(
        gpu_pod(
            "pct",
            containers=[container("main", 1, percent=25)],
            assignment={"main": [(uuids[2], 20480, 0)]},
            bound_at=1,
        )
    )
    [delivery] = allocator.allocate([ids(uuids[2], 0)])
    assert delivery.envs["CUDA_DEVICE_MEMORY_LIMIT_0"] == "20480m"


def test_two_pending_pods_of_the_same_shape_are_matched_in_bind_order(
    cluster: InMemoryCluster, allocator: Allocator, uuids: list[str]
) -> None:
    # "late" was created first and sorts first by name; it was bound second: kubelet admits "early" first
    cluster.add_pod(gpu_pod("a-late", assignment={"main": [(uuids[1], 4096, 10)]}, bound_at=20, created_at=0))
    cluster.add_pod(gpu_pod("b-early", assignment={"main": [(uuids[0], 8192, 20)]}, bound_at=10, created_at=5))
    [first] = allocator.allocate([ids(uuids[3], 0)])
    [second] = allocator.allocate([ids(uuids[3], 1)])
    assert (first.pod, first.uuids, first.envs["CUDA_DEVICE_MEMORY_LIMIT_0"]) == (
        "default/b-early",
        (uuids[0],),
        "8192m",
    )
    assert (second.pod, second.uuids, second.envs["CUDA_DEVICE_MEMORY_LIMIT_0"]) == (
        "default/a-late",
        (uuids[1],),
        "4096m",
    )
    with pytest.raises(AllocationError, match="no kube-vgpu assignment"):
        allocator.allocate([ids(uuids[3], 2)])


def test_pods_with_identical_assignments_get_identical_deliveries_whichever_is_claimed(
    cluster: InMemoryCluster, allocator: Allocator, uuids: list[str]
) -> None:
    """The extender writes Bindings of identical assignments concurrently (extender/turns.py), so kubelet may admit
    such pods in another order than their bind times. The plugin then claims the other pod, whose assignment is the
    same: the container kubelet is admitting still runs exactly what its own annotation says."""
    same = {"main": [(uuids[2], 4096, 10)]}
    cluster.add_pod(gpu_pod("first", assignment=same, bound_at=10))
    cluster.add_pod(gpu_pod("second", assignment=same, bound_at=11))
    [one] = allocator.allocate([ids(uuids[0], 0)])
    [two] = allocator.allocate([ids(uuids[0], 1)])
    assert one.uuids == two.uuids == (uuids[2],) and one.envs == two.envs
    assert {allocation_of(cluster.pod("default", n))["main"] for n in ("first", "second")} == {
        tuple(ids(uuids[0], 0)),
        tuple(ids(uuids[0], 1)),
    }


def test_the_request_size_selects_among_pods_of_different_shapes(
    cluster: InMemoryCluster, allocator: Allocator, uuids: list[str]
) -> None:
    cluster.add_pod(gpu_pod("one", assignment={"main": [(uuids[0], 1024, 0)]}, bound_at=1))
    cluster.add_pod(
        gpu_pod(
            "two",
            containers=[container("main", 2)],
            assignment={"main": [(uuids[2], 1024, 0), (uuids[3], 1024, 0)]},
            bound_at=2,
        )
    )
    [delivery] = allocator.allocate([ids(uuids[0], 0, 1)])
    assert delivery.pod == "default/two"


def test_a_pod_part_way_through_allocation_comes_first_and_containers_go_in_kubelet_order(
    cluster: InMemoryCluster, allocator: Allocator, uuids: list[str]
) -> None:
    cluster.add_pod(
        gpu_pod(
            "multi",
            init_containers=[container("setup", 1)],
            containers=[container("sidecar", None), container("app", 1), container("helper", 1)],
            init_assignment={"setup": [(uuids[0], 1024, 0)]},
            assignment={"app": [(uuids[1], 2048, 0)], "helper": [(uuids[2], 3072, 0)]},
            bound_at=5,
        )
    )
    cluster.add_pod(gpu_pod("earlier", assignment={"main": [(uuids[3], 4096, 0)]}, bound_at=1))
    # kubelet admits "earlier" first (bound first) ...
    assert allocator.allocate([ids(uuids[0], 0)])[0].pod == "default/earlier"
    # ... then "multi": init container, then app containers in spec order
    got = [allocator.allocate([ids(uuids[0], r)])[0] for r in (1, 2, 3)]
    assert [(d.container, d.uuids) for d in got] == [
        ("setup", (uuids[0],)),
        ("app", (uuids[1],)),
        ("helper", (uuids[2],)),
    ]

    # with both waiting, the pod already in progress wins even though it was bound later
    cluster.add_pod(
        gpu_pod(
            "pair",
            containers=[container("a", 1), container("b", 1)],
            assignment={"a": [(uuids[0], 1, 0)], "b": [(uuids[1], 1, 0)]},
            bound_at=50,
        )
    )
    assert allocator.allocate([ids(uuids[2], 0)])[0].container == "a"
    cluster.add_pod(gpu_pod("newcomer", assignment={"main": [(uuids[3], 1, 0)]}, bound_at=40))
    assert allocator.allocate([ids(uuids[2], 1)])[0].pod == "default/pair"


def test_a_native_sidecar_gets_its_own_gpus_in_kubelet_order(
    cluster: InMemoryCluster, allocator: Allocator, uuids: list[str]
) -> None:
    """kubelet calls Allocate for a sidecar (an init container with restartPolicy Always) among the init
    containers, in spec order; the assignment names it a sidecar (the extender counted it beside the app), and the
    device plugin finds it by name like any init container."""
    side = {**container("side", 1), "restartPolicy": "Always"}
    obj = gpu_pod("with-sidecar", init_containers=[container("warm", 1), side], containers=[container("app", 1)])
    assignment = protocol.PodAssignment(
        NODE,
        (
            protocol.ContainerAssignment("app", (protocol.DeviceShare(uuids[0], 2048, 0),)),
            protocol.ContainerAssignment("warm", (protocol.DeviceShare(uuids[1], 4096, 0),), init=True),
            protocol.ContainerAssignment("side", (protocol.DeviceShare(uuids[0], 1024, 0),), init=True, sidecar=True),
        ),
    )
    obj["metadata"]["annotations"][protocol.POD_ASSIGNMENT_ANNOTATION] = protocol.encode_assignment(assignment)
    cluster.add_pod(obj)
    got = [allocator.allocate([ids(uuids[3], r)])[0] for r in (0, 1, 2)]
    assert [(d.container, d.uuids) for d in got] == [
        ("warm", (uuids[1],)),
        ("side", (uuids[0],)),
        ("app", (uuids[0],)),
    ]
    assert got[1].envs[f"{protocol.ENV_MEMORY_LIMIT_PREFIX}0"] == "1024m"


def test_concurrent_allocates_never_claim_the_same_container(
    cluster: InMemoryCluster, allocator: Allocator, uuids: list[str]
) -> None:
    cluster.add_pod(gpu_pod("p1", assignment={"main": [(uuids[0], 1024, 0)]}, bound_at=1))
    cluster.add_pod(gpu_pod("p2", assignment={"main": [(uuids[1], 1024, 0)]}, bound_at=2))
    # both callers read the pods before either writes: they pick the same pod, one patch must lose
    both_read = threading.Barrier(2, timeout=20)
    first_patches = iter(range(2))

    def hold_first_two_patches(namespace: str, name: str) -> None:
        if next(first_patches, None) is not None:
            both_read.wait()

    cluster.before_pod_patch = hold_first_two_patches
    results: list[str] = []
    errors: list[BaseException] = []

    def call(replica: int) -> None:
        try:
            results.append(allocator.allocate([ids(uuids[2], replica)])[0].pod)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=call, args=(r,)) for r in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    cluster.before_pod_patch = None
    assert not errors
    assert sorted(results) == ["default/p1", "default/p2"]
    assert allocation_of(cluster.pod("default", "p1")).keys() == {"main"}
    assert allocation_of(cluster.pod("default", "p2")).keys() == {"main"}
    assert cluster.conflicts == 1  # the loser's stale write was refused; it re-read and took the other pod


def test_no_assignment_fails_with_a_reason_naming_the_foreign_pod(
    cluster: InMemoryCluster, allocator: Allocator, uuids: list[str]
) -> None:
    cluster.add_pod(gpu_pod("stray", scheduler="default-scheduler"))
    with pytest.raises(AllocationError) as failure:
        allocator.allocate([ids(uuids[0], 0)])
    message = str(failure.value)
    assert "no kube-vgpu assignment on node gpu-node-a matches a container asking for 1 nvidia.com/gpu" in message
    assert "default/stray (schedulerName default-scheduler)" in message
    assert allocation_of(cluster.pod("default", "stray")) == {}


def test_pods_that_cannot_be_admitted_here_are_never_candidates(
    cluster: InMemoryCluster, allocator: Allocator, uuids: list[str]
) -> None:
    assigned = {"main": [(uuids[0], 1024, 0)]}
    cluster.add_pod(gpu_pod("done", assignment=assigned, bound_at=1, phase="Succeeded"))
    cluster.add_pod(gpu_pod("rejected", assignment=assigned, bound_at=1, phase="Failed"))
    deleting = gpu_pod("deleting", assignment=assigned, bound_at=1)
    deleting["metadata"]["deletionTimestamp"] = "2026-01-31T12:00:00Z"
    cluster.add_pod(deleting)
    elsewhere = gpu_pod("elsewhere", assignment=assigned, bound_at=1)
    elsewhere["spec"]["nodeName"] = "other-node"
    cluster.add_pod(elsewhere)
    running = gpu_pod("running", assignment=assigned, bound_at=1, phase="Running")
    running["status"]["containerStatuses"] = [{"name": "main", "state": {"running": {}}}]
    cluster.add_pod(running)
    mismatched = gpu_pod("mismatched", assignment=assigned, bound_at=1)
    mismatched["metadata"]["annotations"][protocol.POD_ASSIGNMENT_ANNOTATION] = protocol.encode_assignment(
        protocol.PodAssignment(node="other-node", containers=(protocol.ContainerAssignment("main", ()),))
    )
    cluster.add_pod(mismatched)
    with pytest.raises(AllocationError) as failure:
        allocator.allocate([ids(uuids[0], 0)])
    assert "default/mismatched: assigned to node other-node" in str(failure.value)


def test_refuses_gpus_that_are_unhealthy_or_not_here(
    cluster: InMemoryCluster, allocator: Allocator, state: DeviceState, uuids: list[str]
) -> None:
    cluster.add_pod(gpu_pod("sick", assignment={"main": [(uuids[0], 1024, 0)]}, bound_at=1))
    state.mark_unhealthy(uuids[0], "critical XID 79")
    with pytest.raises(AllocationError, match="unhealthy"):
        allocator.allocate([ids(uuids[1], 0)])
    cluster.add_pod(
        gpu_pod("ghost", assignment={"main": [("GPU-00000000-0000-0000-0000-000000000000", 1, 0)]}, bound_at=0)
    )
    with pytest.raises(AllocationError, match="not on node"):
        allocator.allocate([ids(uuids[1], 0)])


def test_without_api_access_nothing_is_handed_out(state: DeviceState, uuids: list[str]) -> None:
    with pytest.raises(AllocationError, match="without API server access"):
        Allocator(NODE, None, state).allocate([ids(uuids[0], 0)])


def test_missing_limiter_blocks_shared_gpus_but_not_whole_ones(
    cluster: InMemoryCluster, state: DeviceState, uuids: list[str], tmp_path: Path
) -> None:
    delivery = DeliveryConfig(limiter_library_path=str(tmp_path / "absent.so"), cache_host_dir="")
    allocator = Allocator(NODE, cluster, state, delivery)
    whole = state.gpu(uuids[1])
    assert whole is not None
    cluster.add_pod(gpu_pod("whole", assignment={"main": [(uuids[1], whole.memory_mib, 100)]}, bound_at=1))
    cluster.add_pod(gpu_pod("slice", assignment={"main": [(uuids[0], 1024, 10)]}, bound_at=2))
    [exclusive] = allocator.allocate([ids(uuids[1], 0)])
    assert exclusive.pod == "default/whole" and exclusive.mounts == ()
    with pytest.raises(AllocationError, match=r"limiter library .*absent\.so is missing"):
        allocator.allocate([ids(uuids[0], 0)])
    # the failed claim was undone: the container is still waiting for its GPUs
    assert allocation_of(cluster.pod("default", "slice")) == {}


def test_device_list_strategies(cluster: InMemoryCluster, state: DeviceState, uuids: list[str]) -> None:
    delivery = DeliveryConfig(
        limiter_library_path="", cache_host_dir="", device_list_strategies=(DEVICE_LIST_VOLUME_MOUNTS, DEVICE_LIST_CDI)
    )
    cluster.add_pod(gpu_pod("p", assignment={"main": [(uuids[2], 1024, 0)]}, bound_at=1))
    [delivery_result] = Allocator(NODE, cluster, state, delivery).allocate([ids(uuids[2], 0)])
    assert delivery_result.envs[protocol.ENV_NVIDIA_VISIBLE_DEVICES] == "/var/run/nvidia-container-devices"
    assert delivery_result.mounts == ((f"/var/run/nvidia-container-devices/{uuids[2]}", "/dev/null", True),)
    assert delivery_result.cdi_devices == (f"nvidia.com/gpu={uuids[2]}",)


def test_preferred_allocation_steers_kubelet_to_the_assigned_gpus(
    cluster: InMemoryCluster, allocator: Allocator, uuids: list[str]
) -> None:
    available = [device_id(u, r) for u in uuids for r in range(4)]
    cluster.add_pod(
        gpu_pod(
            "p",
            containers=[container("main", 2)],
            assignment={"main": [(uuids[3], 1, 0), (uuids[1], 1, 0)]},
            bound_at=1,
        )
    )
    assert allocator.preferred(available, [], 2) == [device_id(uuids[3], 0), device_id(uuids[1], 0)]
    # must-include IDs are kept; nothing pending of size 3: one ID per distinct GPU, most free first
    chosen = allocator.preferred(available[1:], [device_id(uuids[0], 1)], 3)
    assert chosen[0] == device_id(uuids[0], 1)
    assert len({c.split("::")[0] for c in chosen}) == 3
    assert len(allocator.preferred(available[:2], [], 2)) == 2  # fewer GPUs than asked: still the right size


def test_only_containers_kubelet_calls_for_are_matched(
    cluster: InMemoryCluster, allocator: Allocator, uuids: list[str]
) -> None:
    # "meta" asks only for gpumem (no nvidia.com/gpu quantity): kubelet never calls Allocate for it, so the next
    # call for this pod is "worker"'s and must get worker's GPU, not meta's
    cluster.add_pod(
        gpu_pod(
            "mixed",
            containers=[container("meta", None, memory_mib=1024), container("worker", 1)],
            assignment={"meta": [(uuids[0], 1024, 0)], "worker": [(uuids[3], 2048, 0)]},
            bound_at=1,
        )
    )
    [delivery] = allocator.allocate([ids(uuids[1], 0)])
    assert (delivery.container, delivery.uuids) == ("worker", (uuids[3],))


def test_a_container_whose_assignment_does_not_fit_its_request_blocks_only_its_pod(
    cluster: InMemoryCluster, allocator: Allocator, uuids: list[str]
) -> None:
    cluster.add_pod(
        gpu_pod("odd", containers=[container("main", 2)], assignment={"main": [(uuids[0], 1, 0)]}, bound_at=1)
    )
    cluster.add_pod(gpu_pod("fine", assignment={"main": [(uuids[1], 1, 0)]}, bound_at=2))
    assert allocator.allocate([ids(uuids[2], 0)])[0].pod == "default/fine"
    with pytest.raises(AllocationError, match=r"container main asks for 2 nvidia\.com/gpu but was assigned 1"):
        allocator.allocate([ids(uuids[2], 1, 2)])


@pytest.mark.parametrize("mark", [None, "v2"], ids=["absent", "other-value"])
def test_a_pod_that_skipped_the_webhook_gets_no_devices_when_the_mark_is_required(
    cluster: InMemoryCluster, state: DeviceState, uuids: list[str], tmp_path: Path, mark: str | None
) -> None:
    """Issue 20 item 7: an assignment without the webhook's mark (the pod skipped the webhook, so its limiter env and
    mounts were never added) is refused by name; a marked pod of the same shape is served."""
    library = tmp_path / "libvgpu.so"
    library.write_bytes(b"\x7fELF")
    delivery = DeliveryConfig(limiter_library_path=str(library), cache_host_dir=str(tmp_path / "cache"),
                              require_admission_mark=True)
    allocator = Allocator(NODE, cluster, state, delivery)
    stray = gpu_pod("stray", assignment={"main": [(uuids[0], 1024, 0)]}, bound_at=1)
    if mark is not None:
        stray["metadata"]["annotations"][protocol.POD_ADMITTED_ANNOTATION] = mark
    cluster.add_pod(stray)
    with pytest.raises(AllocationError) as failure:
        allocator.allocate([ids(uuids[0], 0)])
    assert "pods refused because they skipped kube-vgpu's webhook (no kube-vgpu.io/admitted annotation, so no GPU " \
           "limits were set up): default/stray" in str(failure.value)
    assert allocation_of(cluster.pod("default", "stray")) == {}
    admitted = gpu_pod("admitted", assignment={"main": [(uuids[1], 1024, 0)]}, bound_at=2)
    admitted["metadata"]["annotations"][protocol.POD_ADMITTED_ANNOTATION] = protocol.ADMISSION_MARK_VALUE
    cluster.add_pod(admitted)
    [served] = allocator.allocate([ids(uuids[1], 0)])
    assert served.pod == "default/admitted"


def test_the_device_plugin_requires_the_mark_by_default() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args([]).require_admission_mark is True
    assert parser.parse_args(["--no-require-admission-mark"]).require_admission_mark is False
