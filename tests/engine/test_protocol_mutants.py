"""The pod GPU request parser's exact answers, written to kill the mutants that survived mutation testing
(docs/mutation-testing.md): the whole message the webhook denies with (test_protocol.py checks a phrase of it),
and the boundaries (0.0, exactly 80 characters shown, a missing annotation)."""

from __future__ import annotations

from typing import Any

import pytest

from kube_vgpu import kubeapi, protocol
from kube_vgpu.protocol import GpuSelectors, InvalidGpuRequest, parse_count_quantity, parse_pod_gpu_request

WHOLE = "x must be a non-negative whole number, got "
COUNTS: list[tuple[Any, int | str]] = [
    (0, 0),
    (3, 3),
    (0.0, 0),
    (1.0, 1),
    ("1k", 1000),
    (" 2 ", 2),
    (True, "x must be a whole number, got True"),
    (-1, "x must not be negative, got -1"),
    (-1.0, WHOLE + "-1.0"),
    (2.5, WHOLE + "2.5"),
    ("0.5", WHOLE + "'0.5'"),
    ("500m", WHOLE + "'500m'"),
    ("-1", "x must not be negative, got '-1'"),
    ("-x", "x must not be negative, got '-x'"),
    ("a" * 80, WHOLE + repr("a" * 80)),
    ("a" * 81, WHOLE + repr("a" * 80) + "... (81 characters)"),
]


@pytest.mark.parametrize(("value", "expected"), COUNTS)
def test_count_quantity(value: Any, expected: int | str) -> None:
    if isinstance(expected, int):
        assert parse_count_quantity(value, what="x") == expected
    else:
        with pytest.raises(InvalidGpuRequest) as caught:
            parse_count_quantity(value, what="x")
        assert str(caught.value) == expected


def gpu_pod(limits: dict[str, Any], annotations: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"metadata": {"annotations": annotations or {}},
            "spec": {"containers": [{"name": "main", "resources": {"limits": limits}}]}}


PREFIX = "container main: "
LONGEST = "8Gi".rjust(kubeapi.MAX_QUANTITY_TEXT, "0")
REQUESTS: list[tuple[dict[str, Any], str]] = [
    ({protocol.RESOURCE_GPU_MEMORY: "8Gi"},
     PREFIX + "nvidia.com/gpumem counts MiB, so it takes no Ki/Mi/Gi/Ti/Pi/Ei unit, got '8Gi'; for 8Gi write 8192"),
    ({protocol.RESOURCE_GPU_MEMORY: "1Mi"},
     PREFIX + "nvidia.com/gpumem counts MiB, so it takes no Ki/Mi/Gi/Ti/Pi/Ei unit, got '1Mi'; for 1Mi write 1"),
    ({protocol.RESOURCE_GPU_MEMORY: "1Ki"},
     PREFIX + "nvidia.com/gpumem counts MiB, so it takes no Ki/Mi/Gi/Ti/Pi/Ei unit, got '1Ki'"),
    # the longest quantity text there is (kubeapi.MAX_QUANTITY_TEXT) still gets the unit hint
    ({protocol.RESOURCE_GPU_MEMORY: LONGEST},
     PREFIX + f"nvidia.com/gpumem counts MiB, so it takes no Ki/Mi/Gi/Ti/Pi/Ei unit, got {LONGEST!r}; for {LONGEST} "
     "write 8192"),
    ({protocol.RESOURCE_GPU_MEMORY: "0"}, PREFIX + "nvidia.com/gpumem must be greater than 0 MiB, got 0"),
    ({protocol.RESOURCE_GPU_MEMORY: str(protocol.MAX_GPU_MEMORY_MIB + 1)},
     PREFIX + f"nvidia.com/gpumem must be at most {protocol.MAX_GPU_MEMORY_MIB} MiB (more than any GPU has; it "
     f"counts MiB, not bytes), got {protocol.MAX_GPU_MEMORY_MIB + 1}"),
    ({protocol.RESOURCE_GPU_MEMORY_PERCENTAGE: "101"},
     PREFIX + "nvidia.com/gpumem-percentage must be between 1 and 100, got 101"),
    ({protocol.RESOURCE_GPU_MEMORY: "10", protocol.RESOURCE_GPU_MEMORY_PERCENTAGE: "10"},
     PREFIX + "set either nvidia.com/gpumem or nvidia.com/gpumem-percentage, not both"),
    ({protocol.RESOURCE_GPU_CORES: "101"}, PREFIX + "nvidia.com/gpucores must be between 0 and 100, got 101"),
    ({protocol.RESOURCE_GPU: "0", protocol.RESOURCE_GPU_CORES: "0"},
     PREFIX + "nvidia.com/gpu is 0 but GPU memory or cores are requested"),
    ({protocol.RESOURCE_GPU: "0", protocol.RESOURCE_GPU_MEMORY_PERCENTAGE: "5"},
     PREFIX + "nvidia.com/gpu is 0 but GPU memory or cores are requested"),
]


@pytest.mark.parametrize(("limits", "message"), REQUESTS)
def test_invalid_request_messages_are_exact(limits: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidGpuRequest) as caught:
        parse_pod_gpu_request(gpu_pod(limits))
    assert str(caught.value) == message


VALID: list[tuple[dict[str, Any], tuple[int, int | None, int | None, int]]] = [
    # limits -> (count, memory_mib, memory_percent, cores)
    ({protocol.RESOURCE_GPU_MEMORY: "1"}, (1, 1, None, 0)),
    ({protocol.RESOURCE_GPU_MEMORY: str(protocol.MAX_GPU_MEMORY_MIB)}, (1, protocol.MAX_GPU_MEMORY_MIB, None, 0)),
    ({protocol.RESOURCE_GPU_MEMORY_PERCENTAGE: "1", protocol.RESOURCE_GPU: "2"}, (2, None, 1, 0)),
    ({protocol.RESOURCE_GPU_MEMORY_PERCENTAGE: "100"}, (1, None, 100, 0)),
    ({protocol.RESOURCE_GPU_CORES: "100"}, (1, None, None, 100)),
]


@pytest.mark.parametrize(("limits", "expected"), VALID)
def test_valid_boundaries(limits: dict[str, Any], expected: tuple[int, int | None, int | None, int]) -> None:
    (container,) = parse_pod_gpu_request(gpu_pod(limits)).containers
    assert (container.count, container.memory_mib, container.memory_percent, container.cores) == expected


def test_no_annotations_no_selectors() -> None:
    request = parse_pod_gpu_request(gpu_pod({protocol.RESOURCE_GPU: "1"}))
    assert request.selectors == GpuSelectors()
    assert request.selectors.empty
    assert (request.gpu_policy, request.node_policy) == (None, None)


def test_a_non_string_annotation_is_named() -> None:
    with pytest.raises(InvalidGpuRequest) as caught:
        parse_pod_gpu_request(gpu_pod({protocol.RESOURCE_GPU: "1"}, {protocol.ANNOTATION_USE_GPU_TYPE: 3}))
    assert str(caught.value) == "annotation nvidia.com/use-gputype must be a string"


def test_selectors_and_policies_are_read() -> None:
    annotations = {protocol.ANNOTATION_USE_GPU_TYPE: " A100 , ,H100", protocol.ANNOTATION_NOUSE_GPU_TYPE: "T4",
                   protocol.ANNOTATION_USE_GPU_UUID: "GPU-A", protocol.ANNOTATION_NOUSE_GPU_UUID: "GPU-b",
                   protocol.ANNOTATION_NUMA_BIND: "True", protocol.ANNOTATION_GPU_POLICY: "spread",
                   protocol.ANNOTATION_NODE_POLICY: "binpack"}
    request = parse_pod_gpu_request(gpu_pod({protocol.RESOURCE_GPU: "1"}, annotations))
    assert request.selectors == GpuSelectors(("a100", "h100"), ("t4",), ("GPU-A",), ("GPU-b",), True)
    assert (request.gpu_policy, request.node_policy) == ("spread", "binpack")
