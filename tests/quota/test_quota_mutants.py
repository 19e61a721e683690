"""The quota arithmetic's edges, written to kill the mutants that survived mutation testing
(docs/mutation-testing.md): what a pod is charged when its object is odd, the usage of several containers at
once, the boundaries of Kueue's formulas (need 0, need = limit, lending everything), and the tree's structure
queries (root, cycle above a queue, a clone)."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import pytest

from kube_vgpu import protocol
from kube_vgpu.extender.engine.model import NodeState
from kube_vgpu.extender.quota.accounting import CQ, QuotaTree, Shortfall
from kube_vgpu.extender.quota.objects import TOTAL_GPU_CORES, TOTAL_GPU_MEMORY, ResourceQuota, parse_tolerations
from kube_vgpu.extender.quota.usage import (
    Charge,
    PendingPod,
    PodInfo,
    assignment_usage,
    pod_info,
    request_usage_fixed,
    request_usage_on,
)
from kube_vgpu.protocol import ContainerAssignment, ContainerGpuRequest, DeviceShare, GpuInfo, PodAssignment
from tests.quota.test_accounting import FR, GPU, LENDING, cohort, cq

GPUMEM, GPUCORES = protocol.RESOURCE_GPU_MEMORY, protocol.RESOURCE_GPU_CORES
TOLERATIONS = [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}]


def pod_object(spec: dict[str, Any] | None = None, metadata: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"metadata": {"namespace": "ml", "name": "train", **(metadata or {})},
            "spec": {"containers": [{"name": "c", "resources": {"limits": {"cpu": "2", "memory": "1Ki"}}}],
                     **(spec or {})}}


PRIORITIES = [({"priority": 7}, 7), ({"priority": True}, 0), ({"priority": "7"}, 0), ({}, 0)]


@pytest.mark.parametrize(("spec", "expected"), PRIORITIES)
def test_spec_priority_only_from_an_integer(spec: dict[str, Any], expected: int) -> None:
    assert pod_info(pod_object(spec), 0.0).spec_priority == expected


CREATED = [("2026-11-21T10:00:00+00:00", 1795255200.0), ("", 5.0), (None, 5.0), (1795255200, 5.0), ("yesterday", 5.0)]


@pytest.mark.parametrize(("stamp", "expected"), CREATED)
def test_creation_time_or_now(stamp: Any, expected: float) -> None:
    assert pod_info(pod_object(metadata={"creationTimestamp": stamp}), 5.0).created_s == expected


def test_pod_info_reads_the_spec() -> None:
    info = pod_info(pod_object({"tolerations": TOLERATIONS}, {"labels": {protocol.LABEL_KUEUE_PRIORITY_CLASS: "hi"}}),
                    0.0)
    assert info == PodInfo(0, "hi", 0.0, parse_tolerations(TOLERATIONS, "t"), 2000, 1024)
    assert info.tolerations  # the fixture's toleration is really read
    with pytest.raises(dataclasses.FrozenInstanceError):
        info.cpu_milli = 1  # type: ignore[misc]


def test_unreadable_tolerations_are_none() -> None:
    assert pod_info(pod_object({"tolerations": "everything"}), 0.0).tolerations == ()


def test_no_host_requests_charge_nothing() -> None:
    info = pod_info({"metadata": {}, "spec": {"containers": [{"name": "c"}]}}, 0.0)
    assert (info.cpu_milli, info.memory_bytes) == (0, 0)


def test_an_unreadable_quantity_is_charged_0_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    pod = pod_object()
    pod["spec"]["containers"][0]["resources"]["limits"]["cpu"] = "two"
    with caplog.at_level(logging.WARNING, logger="kube_vgpu.extender.quota.usage"):
        info = pod_info(pod, 0.0)
    assert (info.cpu_milli, info.memory_bytes) == (0, 0)
    [record] = caplog.records
    assert record.getMessage().startswith("pod ml/train: unreadable CPU or memory request (")
    assert record.getMessage().endswith("); charged 0")


def test_an_empty_assignment_holds_nothing() -> None:
    nothing = {GPU: 0, GPUMEM: 0, GPUCORES: 0, TOTAL_GPU_MEMORY: 0, TOTAL_GPU_CORES: 0}
    assert assignment_usage(PodAssignment("n", ())) == nothing
    assert request_usage_fixed(protocol.PodGpuRequest(())) == nothing


def test_assignment_usage_adds_a_phases_devices() -> None:
    both = (DeviceShare("GPU-0", 1000, 10), DeviceShare("GPU-1", 2000, 20))
    one = (DeviceShare("GPU-0", 500, 5),)
    assignment = PodAssignment("n", (ContainerAssignment("a", both), ContainerAssignment("b", one)))
    assert assignment_usage(assignment) == {GPU: 3, GPUMEM: 3500, GPUCORES: 35, TOTAL_GPU_MEMORY: 3500,
                                            TOTAL_GPU_CORES: 35}


def node_of(*gpus: GpuInfo) -> NodeState:
    return NodeState("n", protocol.NodeInventory(gpus))


def a_gpu(index: int, memory_mib: int, **fields: Any) -> GpuInfo:
    return GpuInfo(uuid=f"GPU-{index}", index=index, model="T4", memory_mib=memory_mib, **fields)


def test_request_usage_on_adds_containers_and_skips_unschedulable_gpus() -> None:
    # the unhealthy 80000 MiB GPU is not where the pod can go: 50% is of the 16000 MiB one
    node = node_of(a_gpu(0, 16000), a_gpu(1, 80000, healthy=False))
    request = protocol.PodGpuRequest((ContainerGpuRequest("a", 2, memory_percent=50, cores=30),
                                      ContainerGpuRequest("b", 1, memory_mib=1000, cores=100)))
    assert request_usage_on(request, node) == {GPU: 3, GPUMEM: 2 * 8000 + 1000, GPUCORES: 2 * 30 + 100,
                                               TOTAL_GPU_MEMORY: 2 * 8000 + 1000, TOTAL_GPU_CORES: 2 * 30 + 100}
    # no eligible GPU: a percentage is of nothing
    assert request_usage_on(protocol.PodGpuRequest((ContainerGpuRequest("a", 1, memory_percent=50),)),
                            node_of()) == {GPU: 1, GPUMEM: 0, GPUCORES: 0, TOTAL_GPU_MEMORY: 0, TOTAL_GPU_CORES: 0}
    assert request_usage_on(protocol.PodGpuRequest(()), node) == {GPU: 0, GPUMEM: 0, GPUCORES: 0,
                                                                  TOTAL_GPU_MEMORY: 0, TOTAL_GPU_CORES: 0}


def test_records_start_empty() -> None:
    first, second = Charge("u", "ns", "p", "cq", "n", {}), Charge("v", "ns", "q", "cq", "n", {})
    assert (first.amounts, first.priority, first.created_s, first.counted, first.problem) == ({}, 0, 0.0, False, "")
    first.amounts[FR] = 1
    assert second.amounts == {}
    pending = PendingPod("u", "ns", "p", "cq", 0, 0.0, 0.0)
    assert (pending.waiting_for_quota, pending.reason) == (False, "")


def test_a_need_equal_to_the_potential_can_fit_some_day() -> None:
    short = Shortfall("a100", GPU, 6, 0, 0, 6, ResourceQuota(6))
    assert not short.never_fits
    assert Shortfall("a100", GPU, 7, 0, 0, 6, ResourceQuota(6)).never_fits
    with pytest.raises(dataclasses.FrozenInstanceError):
        short.need = 1  # type: ignore[misc]


def test_shortfalls_skip_zero_needs_and_check_every_resource() -> None:
    tree = QuotaTree([cq("a", 4)])
    tree.add("a", {FR: 5})  # over-admitted: available -1
    assert tree.shortfalls("a", {FR: 0}) == []
    other = ("a100", "nvidia.com/gpumem")
    assert [s.resource for s in tree.shortfalls("a", {other: 0, FR: 1})] == [GPU]


def test_a_resource_the_queue_does_not_cover() -> None:
    tree = QuotaTree([cq("a", 4)])
    other = ("v100", GPU)
    assert tree.subtree_quota((CQ, "a"), other) == 0
    assert tree.available((CQ, "a"), other) == 0
    status = tree.status("a", other)
    assert (status.flavor, status.resource, status.nominal, status.lent, status.available) == ("v100", GPU, 0, 0, 0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        status.used = 1  # type: ignore[misc]


def test_lending_everything_guarantees_nothing() -> None:
    tree = QuotaTree([cq("a", 4, cohort="c"), cq("b", 6, lending=6, cohort="c")])
    assert tree.guaranteed((CQ, "b"), FR) == 0
    assert tree.available((CQ, "b"), FR) == 10


def test_borrowing_limit_with_a_lending_limit() -> None:
    # a: nominal 4, lends 1 (keeps 3), may borrow 2; b: 6. subtree(c) = 1 + 6 = 7
    tree = QuotaTree([cq("a", 4, borrowing=2, lending=1, cohort="c"), cq("b", 6, cohort="c")])
    assert tree.available((CQ, "a"), FR) == 6  # 3 kept + min(7, 1 stored - 0 used + 2)
    tree.add("a", {FR: 5})  # 3 kept + 2 in the cohort
    assert tree.available((CQ, "a"), FR) == 1  # min(7 - 2, 1 - 2 + 2)


@pytest.mark.parametrize(("used_a", "used_b", "lent"), [(4, 5, 0), (6, 5, 1), (6, 0, 2)])
def test_status_lent(used_a: int, used_b: int, lent: int) -> None:
    # b keeps 4, lends at most 2; a borrows past its 4
    tree = QuotaTree(LENDING)
    tree.add("a", {FR: used_a})
    tree.add("b", {FR: used_b})
    assert tree.status("b", FR).lent == lent


def test_structure_queries() -> None:
    queues = [cq("a", 1, cohort="leaf"), cq("solo", 1)]
    tree = QuotaTree(queues, [cohort("leaf", parent="mid"), cohort("mid", parent="top"), cohort("top")])
    assert (tree.has("a"), tree.has("solo"), tree.has("leaf"), tree.has("nobody")) == (True, True, False, False)
    assert (tree.root_of("a"), tree.root_of("solo"), tree.root_of("nobody")) == ("top", None, None)


def test_a_cycle_above_the_queues_cohort_and_in_a_clone() -> None:
    tree = QuotaTree([cq("a", 2, cohort="leaf")], [cohort("leaf", parent="x"), cohort("x", parent="y"),
                                                   cohort("y", parent="x")])
    assert tree.cyclic == {"x", "y"}
    assert tree.in_cycle("a") in {"x", "y"}
    assert tree.clone().in_cycle("a") == tree.in_cycle("a")


def test_a_cycle_with_no_queue_under_it() -> None:
    tree = QuotaTree([cq("a", 2)], [cohort("x", parent="y"), cohort("y", parent="x")])
    assert tree.cyclic == {"x", "y"}
    assert tree.in_cycle("a") is None
