"""Our .proto files carry the official names and field numbers, and the committed modules are what grpcio-tools
generates from them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kube_vgpu.deviceplugin.api import deviceplugin_pb2 as pb
from kube_vgpu.deviceplugin.api import generate
from kube_vgpu.deviceplugin.api import podresources_pb2 as prpb


def test_committed_modules_match_a_fresh_generation(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools")
    produced = generate.generate_into(tmp_path)
    names = sorted(path.name for path in produced)
    assert names == [
        "deviceplugin_pb2.py",
        "deviceplugin_pb2.pyi",
        "deviceplugin_pb2_grpc.py",
        "podresources_pb2.py",
        "podresources_pb2.pyi",
        "podresources_pb2_grpc.py",
    ]
    for path in produced:
        committed = generate.API_DIR / path.name
        assert committed.read_bytes() == path.read_bytes(), (
            f"{path.name} is stale: run python -m kube_vgpu.deviceplugin.api.generate"
        )


def test_services_and_methods_use_the_official_names() -> None:
    services = pb.DESCRIPTOR.services_by_name
    assert services["Registration"].full_name == "v1beta1.Registration"
    assert [m.name for m in services["Registration"].methods] == ["Register"]
    assert services["DevicePlugin"].full_name == "v1beta1.DevicePlugin"
    assert {m.name for m in services["DevicePlugin"].methods} == {
        "GetDevicePluginOptions",
        "ListAndWatch",
        "GetPreferredAllocation",
        "Allocate",
        "PreStartContainer",
    }
    assert services["DevicePlugin"].methods_by_name["ListAndWatch"].server_streaming
    assert prpb.DESCRIPTOR.services_by_name["PodResourcesLister"].full_name == "v1.PodResourcesLister"


@pytest.mark.parametrize(
    ("message", "fields"),
    [
        (pb.DevicePluginOptions, {"pre_start_required": 1, "get_preferred_allocation_available": 2}),
        (pb.RegisterRequest, {"version": 1, "endpoint": 2, "resource_name": 3, "options": 4}),
        (pb.Device, {"ID": 1, "health": 2, "topology": 3}),
        (pb.NUMANode, {"ID": 1}),
        (
            pb.ContainerPreferredAllocationRequest,
            {"available_deviceIDs": 1, "must_include_deviceIDs": 2, "allocation_size": 3},
        ),
        (pb.ContainerPreferredAllocationResponse, {"deviceIDs": 1}),
        (pb.ContainerAllocateRequest, {"devices_ids": 1}),
        (pb.ContainerAllocateResponse, {"envs": 1, "mounts": 2, "devices": 3, "annotations": 4, "cdi_devices": 5}),
        (pb.Mount, {"container_path": 1, "host_path": 2, "read_only": 3}),
        (pb.DeviceSpec, {"container_path": 1, "host_path": 2, "permissions": 3}),
        (pb.PreStartContainerRequest, {"devices_ids": 1}),
        (prpb.PodResources, {"name": 1, "namespace": 2, "containers": 3}),
        (prpb.ContainerResources, {"name": 1, "devices": 2, "cpu_ids": 3, "memory": 4, "dynamic_resources": 5}),
        (prpb.ContainerDevices, {"resource_name": 1, "device_ids": 2, "topology": 3}),
    ],
)
def test_field_numbers_are_the_official_ones(message: Any, fields: dict[str, int]) -> None:
    assert {f.name: f.number for f in message.DESCRIPTOR.fields} == fields
