"""HAMi's `mutex` GPU policy: a container's vGPUs only on GPUs no other vGPU holds at that moment, chosen among them
as `topology` chooses; refused where too few GPUs are idle, with a reason that says so."""

from __future__ import annotations

from typing import Any

import pytest

from kube_vgpu import protocol
from kube_vgpu.extender.engine.fit import place
from kube_vgpu.extender.engine.model import FitFailure, NodeState, Placement, PlacementRequest
from kube_vgpu.extender.engine.policies import make_policy
from tests.engine.test_fit import node_with
from tests.helpers import pod

MUTEX = make_policy("mutex")
BINPACK = make_policy("binpack")


def _positions(result: Placement | FitFailure) -> list[list[int]]:
    assert isinstance(result, Placement), result
    return [[position for position, _memory, _cores in c.devices] for c in result.containers]


def _place(node: NodeState, pod_obj: dict[str, Any], gpu_policy: Any = MUTEX) -> Placement | FitFailure:
    return place(node, PlacementRequest(protocol.parse_pod_gpu_request(pod_obj)), gpu_policy, BINPACK)


@pytest.mark.parametrize(("used", "gpus", "expected"), [
    ([(0, 0, 0), (4000, 10, 1), (0, 0, 0)], 1, [[0]]),  # binpack alone would take the shared GPU 1
    ([(4000, 10, 1), (0, 0, 0), (0, 0, 0)], 2, [[1, 2]]),
    ([(4000, 10, 1), (4000, 10, 1), (0, 0, 0)], 1, [[2]]),
])  # fmt: skip
def test_only_idle_gpus_are_taken(used: list[tuple[int, int, int]], gpus: int, expected: list[list[int]]) -> None:
    node = node_with(used, gpus=3)
    assert _positions(_place(node, pod(gpus=gpus, memory_mib=1000))) == expected


def test_binpack_would_share_where_mutex_does_not() -> None:
    node = node_with([(0, 0, 0), (4000, 10, 1), (0, 0, 0)], gpus=3)
    assert _positions(_place(node, pod(gpus=1, memory_mib=1000), BINPACK)) == [[1]]


def test_too_few_idle_gpus_is_a_reason_that_says_so() -> None:
    node = node_with([(4000, 10, 1), (0, 0, 0)], gpus=2)
    failure = _place(node, pod(gpus=2, memory_mib=1000))
    assert failure == FitFailure(
        "container main: needs 2 idle GPUs (GPU policy mutex takes no GPU another vGPU uses), 1 idle with room for it",
        code="exclusive",
    )
    assert not failure.unresolvable and "%" not in failure.reason


def test_a_pods_own_containers_do_not_share_a_gpu_under_mutex() -> None:
    two = pod(gpus=1, memory_mib=1000)
    two["spec"]["containers"].append({"name": "second", "resources": {"limits": {
        protocol.RESOURCE_GPU: "1", protocol.RESOURCE_GPU_MEMORY: "1000"}}})
    node = node_with(None, gpus=2)
    assert sorted(p for c in _positions(_place(node, two)) for p in c) == [0, 1]
    assert isinstance(_place(node_with(None, gpus=1), two), FitFailure)
