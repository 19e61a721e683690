"""Table-driven tests of per-GPU fit and GPU choice."""

from __future__ import annotations

from typing import Any

import pytest

from kube_vgpu import protocol
from kube_vgpu.dev.fixtures import synth_inventory
from kube_vgpu.extender.engine.fit import place
from kube_vgpu.extender.engine.model import FitFailure, NodeState, Placement, PlacementRequest, new_placement
from kube_vgpu.extender.engine.policies import make_policy
from tests.helpers import pod

BINPACK = make_policy("binpack")
SPREAD = make_policy("spread")
TOPOLOGY = make_policy("topology")


def node_with(
    used: list[tuple[int, int, int]] | None = None,
    *,
    gpus: int = 2,
    memory_mib: int = 16000,
    model: str = "Tesla-T4",
    healthy: list[bool] | None = None,
) -> NodeState:
    """A node whose GPU i already holds used[i] = (memory MiB, cores, shares)."""
    inventory = synth_inventory("n1", gpus, model, memory_mib, "pcie")
    if healthy is not None:
        inventory = protocol.NodeInventory(
            tuple(
                protocol.GpuInfo(**{**{f: getattr(g, f) for f in g.__slots__}, "healthy": ok})  # type: ignore[arg-type]
                for g, ok in zip(inventory.gpus, healthy, strict=True)
            )
        )
    node = NodeState("n1", inventory)
    for gpu, (memory, cores, shares) in zip(node.gpus, used or [], strict=False):
        gpu.used_memory_mib, gpu.used_cores, gpu.used_vgpus = memory, cores, shares
        gpu.exclusive_holders = 1 if cores >= 100 else 0
    return node


def try_place(node: NodeState, pod_obj: dict[str, Any], policy: Any = BINPACK) -> Placement | FitFailure:
    return place(node, PlacementRequest(protocol.parse_pod_gpu_request(pod_obj)), policy, policy)


CASES = [
    # (id, used per GPU, pod kwargs, expected GPU positions or failure substring)
    ("fits-empty", None, {"memory_mib": 4000, "cores": 30}, [0]),
    ("binpack-prefers-fuller", [(0, 0, 0), (8000, 20, 1)], {"memory_mib": 4000}, [1]),
    (
        "memory-too-big",
        [(10000, 0, 1), (10000, 0, 1)],
        {"memory_mib": 8000},
        "no GPU with 8000 MiB free (largest free 6000 MiB)",
    ),
    (
        "cores-exhausted",
        [(0, 90, 1), (0, 80, 1)],
        {"memory_mib": 100, "cores": 30},
        "no GPU with 30 percent cores free (most free 20 percent)",
    ),
    (
        "exclusive-needs-idle",
        [(100, 10, 1), (100, 10, 1)],
        {"cores": 100, "memory_mib": 100},
        "idle GPU for exclusive use",
    ),
    (
        "exclusive-holder-blocks-sharing",
        [(100, 100, 1), (100, 100, 1)],
        {"memory_mib": 100, "cores": 0},
        "held exclusively",
    ),
    ("shares-exhausted", [(100, 0, 10), (100, 0, 10)], {"memory_mib": 100}, "vGPU slot left"),
    ("whole-memory-default-needs-empty-gpu", [(1, 0, 1), (0, 0, 0)], {}, [1]),
    ("two-gpus-distinct", None, {"gpus": 2, "memory_mib": 1000}, [0, 1]),
    ("three-gpus-on-two-gpu-node", None, {"gpus": 3, "memory_mib": 1000}, "needs 3 GPUs, node has 2"),
    ("bigger-than-any-gpu", None, {"memory_mib": 20000}, "needs 20000 MiB per GPU, largest GPU here has 16000 MiB"),
    ("percentage", [(8001, 0, 1), (0, 0, 0)], {"memory_percent": 50}, [1]),
]


@pytest.mark.parametrize(("used", "kwargs", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_fit_table(used: Any, kwargs: dict[str, int], expected: Any) -> None:
    result = try_place(node_with(used), pod(**kwargs))
    if isinstance(expected, str):
        assert isinstance(result, FitFailure), result
        assert expected in result.reason
    else:
        assert isinstance(result, Placement), result
        assert [d[0] for d in result.containers[0].devices] == expected


@pytest.mark.parametrize(("used", "kwargs", "expected"), [(u, k, e) for _id, u, k, e in CASES if isinstance(e, str)],
                         ids=[c[0] for c in CASES if isinstance(c[3], str)])
def test_no_reason_carries_a_percent_sign(used: Any, kwargs: dict[str, int], expected: str) -> None:
    """kube-scheduler passes an extender's reason to its event recorder as a format string: a '%' would reach
    `kubectl describe` garbled ('30%!c(MISSING)ores')."""
    result = try_place(node_with(used), pod(**kwargs))
    assert isinstance(result, FitFailure) and "%" not in result.reason


def test_unresolvable_classification() -> None:
    assert try_place(node_with(), pod(gpus=3)).unresolvable  # type: ignore[union-attr]
    assert try_place(node_with(), pod(memory_mib=20000)).unresolvable  # type: ignore[union-attr]
    busy = try_place(node_with([(15000, 0, 1), (15000, 0, 1)]), pod(memory_mib=8000))
    assert isinstance(busy, FitFailure) and not busy.unresolvable


def test_unhealthy_gpu_skipped() -> None:
    result = try_place(node_with(healthy=[False, True]), pod(memory_mib=100))
    assert isinstance(result, Placement) and result.containers[0].devices[0][0] == 1
    failure = try_place(node_with(healthy=[False, False]), pod(memory_mib=100))
    assert isinstance(failure, FitFailure) and "unhealthy" in failure.reason and not failure.unresolvable


def test_type_selector() -> None:
    node = node_with()
    assert isinstance(try_place(node, pod(annotations={protocol.ANNOTATION_USE_GPU_TYPE: "t4"})), Placement)
    refused = try_place(node, pod(annotations={protocol.ANNOTATION_USE_GPU_TYPE: "A100"}))
    assert isinstance(refused, FitFailure) and refused.unresolvable and "type a100" in refused.reason
    refused = try_place(node, pod(annotations={protocol.ANNOTATION_NOUSE_GPU_TYPE: "T4"}))
    assert isinstance(refused, FitFailure)


def test_uuid_selector() -> None:
    node = node_with()
    wanted = node.gpus[1].uuid
    result = try_place(node, pod(memory_mib=10, annotations={protocol.ANNOTATION_USE_GPU_UUID: wanted}))
    assert isinstance(result, Placement) and result.containers[0].devices[0][0] == 1
    result = try_place(node, pod(memory_mib=10, annotations={protocol.ANNOTATION_NOUSE_GPU_UUID: node.gpus[0].uuid}))
    assert isinstance(result, Placement) and result.containers[0].devices[0][0] == 1


def test_numa_bind_keeps_vgpus_on_one_numa_node() -> None:
    node = NodeState("n1", synth_inventory("n1", 4, "T4", 16000, "pcie"))  # GPUs 0,1 on NUMA 0; 2,3 on NUMA 1
    node.gpus[0].used_memory_mib, node.gpus[0].used_vgpus = 15000, 1
    result = try_place(node, pod(gpus=2, memory_mib=2000, annotations={protocol.ANNOTATION_NUMA_BIND: "true"}), SPREAD)
    assert isinstance(result, Placement)
    assert {node.gpus[p].numa_node for p, _, _ in result.containers[0].devices} == {1}


def test_spread_prefers_emptier_gpu() -> None:
    result = try_place(node_with([(8000, 20, 1), (0, 0, 0)]), pod(memory_mib=1000), SPREAD)
    assert isinstance(result, Placement) and result.containers[0].devices[0][0] == 1


def test_init_container_peak_not_sum() -> None:
    node = node_with(gpus=1)
    # app uses 10000 MiB, init 12000 MiB: sequential phases need max(10000, 12000) <= 16000
    result = try_place(node, pod(memory_mib=10000, init_gpus=1, init_memory_mib=12000))
    assert isinstance(result, Placement)
    (usage,) = result.usage
    assert usage.memory_mib == 12000 and usage.vgpus == 1


def test_exclusive_usage_recorded_with_full_cores() -> None:
    result = try_place(node_with(), pod(cores=100, memory_mib=1000))
    assert isinstance(result, Placement)
    assert result.usage[0].exclusive and result.usage[0].cores == 100


def test_gpu_with_pods_outside_kube_vgpu_counts_as_fully_used() -> None:
    inventory = synth_inventory("n1", 1, "Tesla-T4", 16000, "pcie")
    (gpu,) = inventory.gpus
    taken = protocol.NodeInventory(
        (protocol.GpuInfo(**{**{f: getattr(gpu, f) for f in gpu.__slots__}, "external_pods": ("ml/rogue",)}),)  # type: ignore[arg-type]
    )
    failure = try_place(NodeState("n1", taken), pod(memory_mib=100))
    assert isinstance(failure, FitFailure) and "outside kube-vgpu (ml/rogue)" in failure.reason


def test_new_placement_is_placement_built_faster() -> None:
    """new_placement (the batch placement's constructor) makes what Placement(...) makes: equal, hashed alike,
    every field set, and as immutable."""
    node = node_with([(4000, 20, 1)])
    built = place(node, PlacementRequest(protocol.parse_pod_gpu_request(pod(memory_mib=2000, cores=10))), BINPACK,
                  BINPACK)
    assert isinstance(built, Placement)
    fast = new_placement(built.node_name, built.containers, built.usage, built.score)
    assert type(fast) is Placement
    assert fast == built and hash(fast) == hash(built)
    assert [getattr(fast, name) for name in Placement._fields] == [
        built.node_name, built.containers, built.usage, built.score]
    with pytest.raises(AttributeError):
        fast.score = 1.0  # type: ignore[misc]
