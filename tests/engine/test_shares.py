"""GPU shares in milli-GPU for real HAMi requests (memory, percentage memory, compute, whole GPUs) on GPUs of
different sizes, and their agreement with the openb view the simulator's numbers were measured in."""

from __future__ import annotations

from typing import Any

import pytest

from kube_vgpu import protocol
from kube_vgpu.dev.simulator.engine import build_node, build_request
from kube_vgpu.dev.simulator.trace import NodeSpec, Task
from kube_vgpu.extender.engine.fit import place
from kube_vgpu.extender.engine.fragmentation import FragModel, TaskShape, task_shape
from kube_vgpu.extender.engine.model import GpuState, NodeState, Placement, PlacementRequest
from kube_vgpu.extender.engine.policies import make_policy
from kube_vgpu.extender.engine.policies._milli import free_after, free_milli_list
from kube_vgpu.extender.engine.shares import free_share_milli, request_share_milli
from kube_vgpu.protocol import ContainerGpuRequest, GpuInfo
from tests.helpers import pod


def gpu(memory_mib: int = 81920, cores: int = 100, **used: Any) -> GpuState:
    state = GpuState(GpuInfo(uuid="GPU-x", index=0, model="A", memory_mib=memory_mib, cores=cores), 0)
    for name, value in used.items():
        setattr(state, name, value)
    return state


def ask(**kwargs: Any) -> ContainerGpuRequest:
    """The container request the parser makes of a pod built with tests.helpers.pod(**kwargs)."""
    return protocol.parse_pod_gpu_request(pod(**kwargs)).containers[0]


@pytest.mark.parametrize(
    ("case", "request_kwargs", "gpu_memory_mib", "expected_milli"),
    [
        ("memory only, 80 GiB GPU", {"memory_mib": 8192}, 81920, 100),
        ("memory only, 16 GiB GPU", {"memory_mib": 8192}, 16384, 500),
        ("memory only, 24 GiB GPU: rounded up", {"memory_mib": 8192}, 24576, 334),
        ("cores and memory: the larger fraction", {"memory_mib": 8192, "cores": 30}, 81920, 300),
        ("cores only: no memory named takes all of it", {"cores": 30}, 81920, 1000),
        ("nothing but nvidia.com/gpu: whole GPU", {}, 81920, 1000),
        ("gpucores 100: exclusive", {"memory_mib": 1024, "cores": 100}, 81920, 1000),
        ("percentage memory, any GPU size", {"memory_percent": 25}, 16384, 250),
        ("percentage memory below the cores", {"memory_percent": 25, "cores": 50}, 81920, 500),
        ("more memory than the GPU: capped", {"memory_mib": 90000}, 81920, 1000),
    ],
)
def test_request_share(case: str, request_kwargs: dict[str, Any], gpu_memory_mib: int, expected_milli: int) -> None:
    assert request_share_milli(ask(**request_kwargs), gpu(gpu_memory_mib)) == expected_milli, case


@pytest.mark.parametrize(
    ("case", "gpu_kwargs", "expected_milli"),
    [
        ("idle", {}, 1000),
        ("memory binds: 40% memory, 10% cores used", {"used_memory_mib": 32768, "used_cores": 10}, 600),
        ("cores bind: 10% memory, 70% cores used", {"used_memory_mib": 8192, "used_cores": 70}, 300),
        ("memory-only pods leave cores but not memory", {"used_memory_mib": 61440, "used_vgpus": 3}, 250),
        ("held exclusively", {"exclusive_holders": 1}, 0),
        ("unhealthy", {"healthy": False}, 0),
        ("MIG mode", {"mig_mode": True}, 0),
        ("every vGPU slot taken", {"used_vgpus": 10, "used_memory_mib": 100}, 0),
    ],
)
def test_free_share(case: str, gpu_kwargs: dict[str, Any], expected_milli: int) -> None:
    assert free_share_milli(gpu(**gpu_kwargs)) == expected_milli, case


def test_openb_gpus_keep_the_reference_milli_numbers() -> None:
    """cores = 1000, no memory asked: shares are the milli-GPU of the FGD paper's simulator, unchanged."""
    openb = gpu(15109, cores=1000, used_cores=300, used_vgpus=1)
    sharing = ContainerGpuRequest("main", 1, memory_mib=0, cores=250)
    whole = ContainerGpuRequest("main", 2, memory_mib=0, cores=1000)
    assert free_share_milli(openb) == 700
    assert request_share_milli(sharing, openb) == 250
    assert request_share_milli(whole, gpu(15109, cores=1000)) == 1000
    assert task_shape(build_request(Task("t", 4000, 1024, 1, 250))) == TaskShape(4000, 250, 1)
    assert task_shape(build_request(Task("t", 4000, 1024, 2, 1000))) == TaskShape(4000, 1000, 2)
    assert task_shape(build_request(Task("c", 4000, 1024, 0, 0))) == TaskShape(4000, 0, 0)


@pytest.mark.parametrize(
    ("case", "request_kwargs", "shape_fields", "share_by_gpu_memory"),
    [
        ("memory only", {"memory_mib": 8192}, (0, 0, 8192), {81920: 100, 16384: 500, 4096: None}),
        ("percentage memory", {"memory_percent": 30}, (0, 300, 0), {81920: 300, 16384: 300}),
        ("cores and memory", {"memory_mib": 4096, "cores": 25}, (250, 0, 4096), {81920: 250, 8192: 500}),
        ("cores only", {"cores": 25}, (250, 1000, 0), {81920: 1000}),
        ("whole GPU", {}, (0, 1000, 0), {81920: 1000}),
        ("exclusive", {"cores": 100, "memory_mib": 1024}, (1000, 0, 1024), {81920: 1000}),
    ],
)
def test_task_shapes_of_real_pods(
    case: str,
    request_kwargs: dict[str, Any],
    shape_fields: tuple[int, int, int],
    share_by_gpu_memory: dict[int, int | None],
) -> None:
    """What the shape learner records for a real pod (GPU-independent), and its share on each GPU size."""
    shape = task_shape(PlacementRequest(protocol.parse_pod_gpu_request(pod(**request_kwargs)), cpu_milli=1000))
    assert (shape.gpu_milli, shape.gpu_memory_milli, shape.gpu_memory_mib) == shape_fields, case
    assert (shape.cpu_milli, shape.gpu_count) == (1000, 1)
    assert {memory: shape.share_on(memory) for memory in share_by_gpu_memory} == share_by_gpu_memory, case


def test_fragmentation_of_a_memory_only_workload_depends_on_gpu_size() -> None:
    """16 GiB asks: an 80 GiB GPU with 20 GiB free can take one, a 24 GiB GPU with 20% free (4.8 GiB) cannot."""
    shapes = ((TaskShape(1000, 0, 1, (), 16384), 1.0),)
    model = FragModel(shapes)
    big = model.frag("A100", 8000, (1000, 250), 81920)  # 250 milli of 80 GiB = 20 GiB: fits
    small = model.frag("A10", 8000, (1000, 200), 24576)  # 200 milli of 24 GiB = 4.8 GiB: fragmented
    assert big == 0
    assert small == pytest.approx(200)
    assert model.frag("T4", 8000, (1000,), 15360) == pytest.approx(1000)  # never fits a 15 GiB GPU


def real_node(gpus: int = 2, memory_mib: int = 81920, topology: str = "nvswitch") -> NodeState:
    from kube_vgpu.dev.fixtures import synth_inventory

    return NodeState("n", synth_inventory("n", gpus, "A100", memory_mib, topology), cpu_milli_total=64000)


def test_placement_moves_free_shares_by_the_larger_fraction() -> None:
    node = real_node()
    bfgd = make_policy("bfgd")
    request = PlacementRequest(protocol.parse_pod_gpu_request(pod(memory_mib=20480, cores=10)), cpu_milli=1000)
    result = place(node, request, bfgd, bfgd)
    assert isinstance(result, Placement)
    assert free_milli_list(node) == [1000, 1000]
    assert sorted(free_after(node, result)) == [750, 1000]  # memory (25%) binds, not cores (10%)


def test_simulator_nodes_and_requests_are_the_openb_view() -> None:
    node = build_node(NodeSpec("n", 32000, 262144, 2, "T4"))
    fgd = make_policy("fgd", shapes=((TaskShape(1000, 500, 1), 1.0),))
    result = place(node, build_request(Task("t", 1000, 1024, 1, 300)), fgd, fgd, check_host=True)
    assert isinstance(result, Placement)
    assert free_after(node, result) == [700, 1000]
