from __future__ import annotations

import re

import pytest

from kube_vgpu import protocol
from kube_vgpu.dev.fixtures import synth_inventory
from kube_vgpu.protocol import InvalidGpuRequest, parse_pod_gpu_request
from tests.helpers import pod


def test_inventory_round_trip_and_deterministic() -> None:
    inventory = synth_inventory("n1", 8, "NVIDIA-H100-80GB-HBM3", 81559, "nvswitch")
    text = protocol.encode_inventory(inventory)
    assert protocol.decode_inventory(text) == inventory
    assert protocol.encode_inventory(protocol.decode_inventory(text)) == text


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("not json", "not valid JSON"),
        ("[]", "must be a JSON object"),
        ('{"v": 2, "gpus": []}', "schema version 2"),
        ('{"v": 1}', "missing field 'gpus'"),
        ('{"v": 1, "gpus": [{"uuid": "g", "index": 0}]}', "missing field"),
    ],
)
def test_inventory_errors_name_the_field(text: str, message: str) -> None:
    with pytest.raises(protocol.ProtocolError, match=re.escape(message)):
        protocol.decode_inventory(text)


def test_assignment_round_trip() -> None:
    assignment = protocol.PodAssignment(
        node="n1",
        containers=(
            protocol.ContainerAssignment("init", (protocol.DeviceShare("GPU-a", 1000, 10),), init=True),
            protocol.ContainerAssignment(
                "main", (protocol.DeviceShare("GPU-a", 2000, 20), protocol.DeviceShare("GPU-b", 2000, 20))
            ),
        ),
    )
    assert protocol.decode_assignment(protocol.encode_assignment(assignment)) == assignment


def test_defaults_whole_gpu_memory_and_no_core_reservation() -> None:
    request = parse_pod_gpu_request(pod(gpus=2))
    (container,) = request.containers
    assert container.count == 2 and container.memory_mib is None and container.memory_percent is None
    assert container.memory_on(16384) == 16384 and container.cores == 0 and not container.exclusive


def test_gpucores_100_is_exclusive_and_percentage_resolves_per_gpu() -> None:
    request = parse_pod_gpu_request(pod(memory_percent=25, cores=100))
    (container,) = request.containers
    assert container.exclusive and container.memory_on(40000) == 10000


def test_only_gpumem_implies_one_gpu() -> None:
    request = parse_pod_gpu_request(pod(gpus=None, memory_mib=3000))
    assert request.containers[0].count == 1


def test_init_containers_count_at_peak_app_containers_add_up() -> None:
    spec_pod = pod(gpus=2, init_gpus=3)
    spec_pod["spec"]["containers"].append({"name": "sidecar", "resources": {"limits": {protocol.RESOURCE_GPU: "1"}}})
    request = parse_pod_gpu_request(spec_pod)
    assert request.total_vgpus == 3
    spec_pod["spec"]["initContainers"][0]["resources"]["limits"][protocol.RESOURCE_GPU] = "1"
    assert parse_pod_gpu_request(spec_pod).total_vgpus == 3  # 2 + 1 app containers


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"cores": 150}, "container main: nvidia.com/gpucores must be between 0 and 100, got 150"),
        ({"memory_mib": 0}, "container main: nvidia.com/gpumem must be greater than 0 MiB, got 0"),
        ({"memory_percent": 101}, "nvidia.com/gpumem-percentage must be between 1 and 100, got 101"),
        ({"memory_mib": 100, "memory_percent": 10}, "set either nvidia.com/gpumem or nvidia.com/gpumem-percentage"),
    ],
)
def test_invalid_requests_have_actionable_messages(kwargs: dict[str, int], message: str) -> None:
    with pytest.raises(InvalidGpuRequest) as caught:
        parse_pod_gpu_request(pod(**kwargs))  # type: ignore[arg-type]
    assert message in str(caught.value)


@pytest.mark.parametrize("value", ["0.5", "-1", "500m", "abc", "1.5"])
def test_non_integer_or_negative_quantities_rejected(value: str) -> None:
    bad = pod()
    bad["spec"]["containers"][0]["resources"]["limits"][protocol.RESOURCE_GPU] = value
    with pytest.raises(InvalidGpuRequest, match=r"container main: nvidia\.com/gpu"):
        parse_pod_gpu_request(bad)


def test_selectors_parsed_case_insensitively() -> None:
    request = parse_pod_gpu_request(
        pod(annotations={protocol.ANNOTATION_USE_GPU_TYPE: "A100, H100", protocol.ANNOTATION_NOUSE_GPU_UUID: "GPU-x"})
    )
    assert request.selectors.use_types == ("a100", "h100")
    assert request.selectors.model_allowed("nvidia-a100-sxm4-80gb")
    assert not request.selectors.model_allowed("tesla-t4")
    assert not request.selectors.uuid_allowed("GPU-x")


def test_pod_asks_for_gpu() -> None:
    assert protocol.pod_asks_for_gpu(pod())
    assert not protocol.pod_asks_for_gpu(pod(gpus=None))
