"""Static MIG through kubelet's device-plugin gRPC API (the kubelet stand-in over unix sockets): one plugin per MIG
profile found, its devices the MIG devices of that profile, and Allocate handing the container exactly the MIG
device the extender assigned."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from kube_vgpu import protocol
from kube_vgpu.dev.fixtures.inmemory_api import InMemoryCluster
from kube_vgpu.deviceplugin.allocate import AllocationError, DeliveryConfig
from kube_vgpu.deviceplugin.app import DevicePluginApp, PluginConfig
from kube_vgpu.deviceplugin.fakenvml import FakeNvml, load_profile
from kube_vgpu.deviceplugin.nvml import Nvml
from kube_vgpu.deviceplugin.server import DEFAULT_SOCKET_NAME
from tests.deviceplugin.builders import NODE, allocation_of, gpu_pod, wait_until
from tests.deviceplugin.kubelet import KubeletStandIn, PluginConnection

MIG_3G = "nvidia.com/mig-3g.20gb"
MIG_1G = "nvidia.com/mig-1g.5gb"


class Running:
    def __init__(self, app: DevicePluginApp, fake: FakeNvml, cluster: InMemoryCluster) -> None:
        self.app, self.fake, self.cluster = app, fake, cluster


@pytest.fixture
def plugin(kubelet: KubeletStandIn) -> Iterator[Running]:
    fake = FakeNvml(load_profile("a100-mig", NODE))
    cluster = InMemoryCluster()
    cluster.add_node({"metadata": {"name": NODE}})
    config = PluginConfig(node_name=NODE, kubelet_dir=str(kubelet.directory), heartbeat_seconds=3600,
                          kubelet_poll_seconds=0.05, health_poll_seconds=0.05, health_event_wait_ms=50,
                          delivery=DeliveryConfig(limiter_library_path="", cache_host_dir=""))
    app = DevicePluginApp(config, Nvml(fake), cluster)
    app.start()
    yield Running(app, fake, cluster)
    app.stop()


def connections(kubelet: KubeletStandIn) -> dict[str, PluginConnection]:
    kubelet.plugin(registrations=4)
    return {connection.request.resource_name: connection for connection in kubelet.plugins}


def mig_uuids(app: DevicePluginApp, gpu: int, profile: str) -> list[str]:
    return [d.uuid for d in app.state.gpus()[gpu].mig_devices if d.profile == profile]


def mig_pod(name: str, resource: str, assigned: list[tuple[str, int, int]]) -> dict[str, Any]:
    limits = {"cpu": "1", resource: str(len(assigned))}
    main = {"name": "main", "image": "cuda", "resources": {"limits": limits, "requests": dict(limits)}}
    return gpu_pod(name, containers=[main], assignment={"main": assigned}, bound_at=1.0)


def test_one_plugin_per_mig_profile_lists_its_mig_devices(kubelet: KubeletStandIn, plugin: Running) -> None:
    plugins = connections(kubelet)
    assert sorted(plugins) == [protocol.RESOURCE_GPU, "nvidia.com/mig-1g.5gb", "nvidia.com/mig-2g.10gb", MIG_3G]
    assert plugins[protocol.RESOURCE_GPU].request.endpoint == DEFAULT_SOCKET_NAME
    assert plugins[MIG_3G].request.endpoint == "kube-vgpu-nvidia-mig-3g.20gb.sock"
    devices = kubelet.wait_for_devices(plugins[MIG_1G], lambda d: len(d) == 9, "the nine 1g.5gb devices")
    app = plugin.app
    assert sorted(d.ID for d in devices) == sorted(mig_uuids(app, 0, "1g.5gb") + mig_uuids(app, 1, "1g.5gb"))
    assert all(d.health == "Healthy" and d.topology.nodes[0].ID == 0 for d in devices)
    three = kubelet.wait_for_devices(plugins[MIG_3G], lambda d: len(d) == 1, "the 3g.20gb device")
    assert [d.ID for d in three] == mig_uuids(app, 0, "3g.20gb")
    wait_until(plugin.app.ready, "registered for every resource and published")


def test_allocate_hands_the_container_exactly_its_assigned_mig_device(
    kubelet: KubeletStandIn, plugin: Running
) -> None:
    plugins = connections(kubelet)
    kubelet.wait_for_devices(plugins[MIG_1G], lambda d: len(d) == 9, "the 1g.5gb devices")
    target = mig_uuids(plugin.app, 1, "1g.5gb")[4]  # not the first one kubelet would pick by itself
    pod = mig_pod("mig-job", MIG_1G, [(target, 4864, 100)])
    plugin.cluster.add_pod(pod)
    [response] = kubelet.admit(plugins[MIG_1G], pod, MIG_1G)
    assert response.envs[protocol.ENV_NVIDIA_VISIBLE_DEVICES] == target
    assert response.envs[protocol.ENV_CUDA_VISIBLE_DEVICES] == target
    assert not any(name.startswith(protocol.ENV_MEMORY_LIMIT_PREFIX) for name in response.envs)  # hardware-isolated
    assert allocation_of(plugin.cluster.pod("default", "mig-job"))["main"] == (target,)  # kubelet chose by preference


def test_a_mig_device_of_another_profile_or_a_shared_gpu_is_never_handed_over(
    kubelet: KubeletStandIn, plugin: Running
) -> None:
    plugins = connections(kubelet)
    kubelet.wait_for_devices(plugins[MIG_3G], lambda d: len(d) == 1, "the 3g.20gb device")
    misassigned = mig_pod("wrong-profile", MIG_3G, [(mig_uuids(plugin.app, 1, "1g.5gb")[0], 4864, 100)])
    plugin.cluster.add_pod(misassigned)
    with pytest.raises(grpc.RpcError) as caught:
        kubelet.admit(plugins[MIG_3G], misassigned, MIG_3G)
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    wrong = mig_uuids(plugin.app, 1, "1g.5gb")[0]
    assert caught.value.details() == (
        f"pod default/wrong-profile container main was assigned GPUs that are not MIG devices of profile 3g.20gb: "
        f"{wrong}; the pod must be rescheduled")
    assert allocation_of(plugin.cluster.pod("default", "wrong-profile")) == {}


def test_a_lost_gpu_makes_its_mig_devices_unhealthy(kubelet: KubeletStandIn, plugin: Running) -> None:
    plugins = connections(kubelet)
    kubelet.wait_for_devices(plugins[MIG_1G], lambda d: len(d) == 9, "the 1g.5gb devices")
    plugin.fake.lose_gpu(1)
    lost = set(mig_uuids(plugin.app, 1, "1g.5gb"))
    devices = kubelet.wait_for_devices(
        plugins[MIG_1G], lambda d: {x.ID for x in d if x.health == "Unhealthy"} == lost, "GPU 1's devices unhealthy")
    assert {d.ID for d in devices if d.health == "Healthy"} == set(mig_uuids(plugin.app, 0, "1g.5gb"))


def test_no_limiter_is_mounted_for_a_mig_device(tmp_path: Any) -> None:
    """The limiter library and /etc/ld.so.preload go to shared vGPUs only: a MIG device is isolated by the hardware."""
    library = tmp_path / "libvgpu.so"
    library.write_text("")
    fake = FakeNvml(load_profile("a100-mig", NODE))
    cluster = InMemoryCluster()
    cluster.add_node({"metadata": {"name": NODE}})
    app = DevicePluginApp(PluginConfig(node_name=NODE, kubelet_dir=str(tmp_path / "kubelet"), delivery=DeliveryConfig(
        limiter_library_path=str(library), ld_so_preload_path=str(tmp_path / "ld.so.preload"), cache_host_dir="")),
        Nvml(fake), cluster)
    target = mig_uuids(app, 0, "3g.20gb")[0]
    cluster.add_pod(mig_pod("mig-job", MIG_3G, [(target, 20096, 100)]))
    [delivery] = app.allocator.allocate([[target]], MIG_3G)
    assert delivery.uuids == (target,) and delivery.mounts == ()
    share = app.state.gpus()[2].uuid  # a GPU outside MIG mode, shared
    cluster.add_pod(gpu_pod("share-job", assignment={"main": [(share, 1000, 10)]}, bound_at=2.0))
    [shared] = app.allocator.allocate([[f"{share}::0"]])
    assert {container for container, _host, _ro in shared.mounts} == {str(library), "/etc/ld.so.preload"}


def test_nvidia_gpu_never_hands_over_a_mig_device(tmp_path: Any) -> None:
    cluster = InMemoryCluster()
    cluster.add_node({"metadata": {"name": NODE}})
    app = DevicePluginApp(PluginConfig(node_name=NODE, kubelet_dir=str(tmp_path), delivery=DeliveryConfig(
        limiter_library_path="", cache_host_dir="")), Nvml(FakeNvml(load_profile("a100-mig", NODE))), cluster)
    target = mig_uuids(app, 0, "3g.20gb")[0]
    cluster.add_pod(gpu_pod("sneaky", assignment={"main": [(target, 20096, 100)]}, bound_at=1.0))
    share = app.state.gpus()[2].uuid
    with pytest.raises(AllocationError) as caught:
        app.allocator.allocate([[f"{share}::0"]])
    assert str(caught.value) == (f"pod default/sneaky container main was assigned GPUs that are not shareable GPUs "
                                 f"(nvidia.com/gpu): {target}; the pod must be rescheduled")
