"""Native sidecars (init containers with restartPolicy Always) on GPUs, as kubelet runs them: each starts in init
order and keeps running, beside every later init container and the app containers."""

from __future__ import annotations

from typing import Any

from kube_vgpu import protocol
from kube_vgpu.dev.synth import synth_inventory
from kube_vgpu.extender.engine.fit import place
from kube_vgpu.extender.engine.model import (
    FitFailure,
    GpuUsage,
    NodeState,
    Placement,
    PlacementRequest,
    assignment_from_placement,
)
from kube_vgpu.extender.engine.policies import make_policy
from kube_vgpu.extender.state import usage_from_assignment

BINPACK = make_policy("binpack")


def gpu_container(name: str, memory_mib: int, *, gpus: int = 1, cores: int | None = None, sidecar: bool = False) -> Any:
    limits = {protocol.RESOURCE_GPU: str(gpus), protocol.RESOURCE_GPU_MEMORY: str(memory_mib)}
    if cores is not None:
        limits[protocol.RESOURCE_GPU_CORES] = str(cores)
    container: dict[str, Any] = {"name": name, "image": "busybox", "resources": {"limits": limits}}
    if sidecar:
        container["restartPolicy"] = "Always"
    return container


def gpu_pod(containers: list[dict[str, Any]], init: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    spec = {"containers": containers, "initContainers": init or []}
    return {"metadata": {"name": "p", "namespace": "default"}, "spec": spec}


def node(gpus: int = 1, memory_mib: int = 81920) -> NodeState:
    return NodeState("n1", synth_inventory("n1", gpus, "NVIDIA-A100-SXM4-80GB", memory_mib, "nvswitch"))


def try_place(target: NodeState, obj: dict[str, Any]) -> Placement | FitFailure:
    return place(target, PlacementRequest(protocol.parse_pod_gpu_request(obj)), BINPACK, BINPACK)


def test_the_request_knows_a_sidecar() -> None:
    request = protocol.parse_pod_gpu_request(
        gpu_pod([gpu_container("app", 1000)], [gpu_container("side", 2000, sidecar=True), gpu_container("warm", 3000)])
    )
    kinds = {c.name: (c.init, c.sidecar) for c in request.containers}
    assert kinds == {"side": (True, True), "warm": (True, False), "app": (False, False)}
    assert [[c.name for c in phase] for phase in request.phases] == [["side", "warm"], ["side", "app"]]


def test_sidecar_and_app_container_both_count_on_the_gpu() -> None:
    """Issue 12: a 40960 MiB sidecar and a 40960 MiB app container on one GPU hold 81920 MiB, not 40960."""
    target = node()
    placement = try_place(target, gpu_pod([gpu_container("app", 40960)], [gpu_container("side", 40960, sidecar=True)]))
    assert isinstance(placement, Placement)
    assert placement.usage == (GpuUsage(0, 81920, 0, 2, False),)
    target.apply_usage(placement.usage)
    third = try_place(target, gpu_pod([gpu_container("app", 40960)]))
    assert isinstance(third, FitFailure) and "no GPU with 40960 MiB free (largest free 0 MiB)" in third.reason


def test_sidecar_and_app_that_cannot_run_together_do_not_fit() -> None:
    # each would fit alone (what an init container needs); together they need 98304 MiB of an 81920 MiB GPU
    result = try_place(node(), gpu_pod([gpu_container("app", 49152)], [gpu_container("side", 49152, sidecar=True)]))
    assert isinstance(result, FitFailure)
    spread = try_place(
        node(gpus=2), gpu_pod([gpu_container("app", 49152)], [gpu_container("side", 49152, sidecar=True)])
    )
    assert isinstance(spread, Placement)
    assert sorted(u.position for u in spread.usage) == [0, 1]


def test_sidecar_runs_beside_a_later_init_container_not_an_earlier_one() -> None:
    side = gpu_container("side", 30000, sidecar=True)
    warm = gpu_container("warm", 60000)
    app = gpu_container("app", 10000)
    assert isinstance(try_place(node(), gpu_pod([app], [side, warm])), FitFailure)  # 90000 at once
    before = try_place(node(), gpu_pod([app], [warm, side]))  # warm-up finishes before the sidecar starts
    assert isinstance(before, Placement)
    assert before.usage == (GpuUsage(0, 60000, 0, 2, False),)  # peak of 60000 alone and 30000 + 10000


def test_an_exclusive_sidecar_keeps_its_gpu_from_the_app() -> None:
    obj = gpu_pod([gpu_container("app", 1000)], [gpu_container("side", 1000, cores=100, sidecar=True)])
    assert isinstance(try_place(node(), obj), FitFailure)
    placement = try_place(node(gpus=2), obj)
    assert isinstance(placement, Placement)
    assert {u.position: u.exclusive for u in placement.usage} == {0: True, 1: False}


def test_sidecar_stays_on_the_same_gpu_in_every_moment() -> None:
    obj = gpu_pod(
        [gpu_container("app", 20000, gpus=2)],
        [gpu_container("side", 10000, sidecar=True), gpu_container("warm", 70000), gpu_container("tail", 75000)],
    )
    placement = try_place(node(gpus=2), obj)
    assert isinstance(placement, Placement)
    devices = {c.request.name: [d[0] for d in c.devices] for c in placement.containers}
    # binpack: the sidecar on GPU 0; warm-up fits beside it (80000), the tail does not (85000) and goes to GPU 1
    assert devices == {"side": [0], "warm": [0], "tail": [1], "app": [0, 1]}
    assert placement.usage == (
        GpuUsage(0, 80000, 0, 2, False),  # sidecar + warm-up; sidecar + app is 30000
        GpuUsage(1, 75000, 0, 1, False),  # the tail alone; the app's second vGPU is 20000
    )
    assert [c.request.name for c in placement.containers] == ["app", "side", "warm", "tail"]  # app first, as before


def test_placement_and_its_assignment_count_the_same() -> None:
    """The state recomputes a pod's usage from its written assignment (after a restart, or on another replica):
    the sidecar flag travels in the assignment, so the phases are the same ones the placement used."""
    target = node(gpus=2)
    obj = gpu_pod(
        [gpu_container("app", 20000), gpu_container("app2", 5000)],
        [gpu_container("warm", 50000), gpu_container("side", 30000, sidecar=True), gpu_container("late", 45000)],
    )
    placement = try_place(target, obj)
    assert isinstance(placement, Placement)
    assignment = assignment_from_placement(target, placement)
    assert [(c.name, c.init, c.sidecar) for c in assignment.containers] == [
        ("app", False, False),
        ("app2", False, False),
        ("warm", True, False),
        ("side", True, True),
        ("late", True, False),
    ]
    decoded = protocol.decode_assignment(protocol.encode_assignment(assignment))
    assert usage_from_assignment(target, decoded) == (placement.usage, [])


def test_a_pod_without_init_containers_counts_the_same_from_its_assignment() -> None:
    # fit's fast path for one moment (no init containers) must agree with the peak the state computes
    target = node(gpus=3)
    obj = gpu_pod([gpu_container("a", 1000, gpus=2, cores=30), gpu_container("b", 2000, cores=100)])
    placement = try_place(target, obj)
    assert isinstance(placement, Placement)
    assert any(u.exclusive for u in placement.usage)
    assignment = assignment_from_placement(target, placement)
    assert usage_from_assignment(target, assignment) == (placement.usage, [])
