"""The device plugin against a kubelet stand-in speaking the real device-plugin gRPC protocol over unix sockets."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from kube_vgpu import protocol
from kube_vgpu.dev.fixtures.inmemory_api import InMemoryCluster
from kube_vgpu.deviceplugin.allocate import DeliveryConfig
from kube_vgpu.deviceplugin.api import deviceplugin_pb2 as pb
from kube_vgpu.deviceplugin.app import DevicePluginApp, PluginConfig
from kube_vgpu.deviceplugin.fakenvml import FakeNvml, load_profile
from kube_vgpu.deviceplugin.nvml import Nvml
from kube_vgpu.deviceplugin.server import DEFAULT_SOCKET_NAME
from tests.deviceplugin.builders import NODE, allocation_of, container, gpu_pod, wait_until
from tests.deviceplugin.kubelet import KubeletStandIn

SHARES = 3


class Running:
    def __init__(self, app: DevicePluginApp, fake: FakeNvml, cluster: InMemoryCluster) -> None:
        self.app = app
        self.fake = fake
        self.cluster = cluster
        self.uuids = app.state.uuids()


@pytest.fixture
def plugin(kubelet: KubeletStandIn) -> Iterator[Running]:
    fake = FakeNvml(load_profile("t4-4-pcie", NODE))
    cluster = InMemoryCluster()
    cluster.add_node({"metadata": {"name": NODE}})
    config = PluginConfig(
        node_name=NODE,
        kubelet_dir=str(kubelet.directory),
        sharing_count=SHARES,
        heartbeat_seconds=3600,  # anything published sooner was caused by a change, not the heartbeat
        kubelet_poll_seconds=0.05,
        health_poll_seconds=0.05,
        health_event_wait_ms=50,
        delivery=DeliveryConfig(limiter_library_path="", cache_host_dir=""),
    )
    app = DevicePluginApp(config, Nvml(fake), cluster)
    app.start()
    yield Running(app, fake, cluster)
    app.stop()


def test_registers_and_streams_every_shared_device_with_its_numa_node(kubelet: KubeletStandIn, plugin: Running) -> None:
    connection = kubelet.plugin()
    request = kubelet.registrations[0]
    assert (request.version, request.endpoint, request.resource_name) == (
        "v1beta1",
        DEFAULT_SOCKET_NAME,
        "nvidia.com/gpu",
    )
    assert request.options.get_preferred_allocation_available and not request.options.pre_start_required
    devices = kubelet.wait_for_devices(connection, lambda d: len(d) == 4 * SHARES, "the device list")
    assert sorted(d.ID for d in devices) == sorted(f"{u}::{r}" for u in plugin.uuids for r in range(SHARES))
    assert {d.health for d in devices} == {"Healthy"}
    numa = {d.ID.split("::")[0]: [n.ID for n in d.topology.nodes] for d in devices}
    assert [numa[u] for u in plugin.uuids] == [[0], [0], [1], [1]]
    assert connection.options is not None and connection.options.get_preferred_allocation_available
    assert plugin.app.ready() or wait_until(plugin.app.ready, "readiness")
    stub = connection.stub
    assert stub.PreStartContainer(pb.PreStartContainerRequest(devices_ids=[devices[0].ID]), timeout=10) is not None


def test_a_critical_xid_reaches_kubelet_and_the_inventory(kubelet: KubeletStandIn, plugin: Running) -> None:
    connection = kubelet.plugin()
    kubelet.wait_for_devices(connection, lambda d: len(d) == 4 * SHARES, "the device list")
    wait_until(plugin.app.health.ready.is_set, "XID event registration")
    plugin.fake.inject_xid(1, 31)  # application fault: nothing happens
    plugin.fake.inject_xid(1, 79)
    sick = plugin.uuids[1]

    def sick_is_unhealthy(devices: list[pb.Device]) -> bool:
        return {d.health for d in devices if d.ID.startswith(sick)} == {"Unhealthy"}

    devices = kubelet.wait_for_devices(connection, sick_is_unhealthy, "GPU 1's devices Unhealthy in ListAndWatch")
    assert {d.health for d in devices if not d.ID.startswith(sick)} == {"Healthy"}

    def published() -> bool:
        annotations = plugin.cluster.get_node(NODE)["metadata"].get("annotations") or {}
        text = annotations.get(protocol.NODE_INVENTORY_ANNOTATION)
        return text is not None and [g.healthy for g in protocol.decode_inventory(text).gpus] == [
            True,
            False,
            True,
            True,
        ]

    wait_until(published, "GPU 1 unhealthy in the node's inventory annotation")


def test_a_lost_gpu_reaches_kubelet(kubelet: KubeletStandIn, plugin: Running) -> None:
    connection = kubelet.plugin()
    kubelet.wait_for_devices(connection, lambda d: len(d) == 4 * SHARES, "the device list")
    plugin.fake.lose_gpu(3)
    lost = plugin.uuids[3]
    kubelet.wait_for_devices(
        connection,
        lambda d: {x.health for x in d if x.ID.startswith(lost)} == {"Unhealthy"},
        "GPU 3's devices Unhealthy after it was lost",
    )


def test_re_registers_after_a_kubelet_restart(kubelet: KubeletStandIn, plugin: Running) -> None:
    first = kubelet.plugin()
    kubelet.wait_for_devices(first, lambda d: len(d) == 4 * SHARES, "the device list")
    kubelet.restart()  # removes every socket, ours included, and serves a new kubelet.sock
    second = kubelet.plugin(registrations=2)
    devices = kubelet.wait_for_devices(second, lambda d: len(d) == 4 * SHARES, "the device list after the restart")
    assert {d.health for d in devices} == {"Healthy"}
    assert (Path(kubelet.directory) / DEFAULT_SOCKET_NAME).is_socket()
    wait_until(lambda: first.stream_error is not None, "the old kubelet's stream to end")
    # a second restart works the same way
    kubelet.restart()
    third = kubelet.plugin(registrations=3)
    kubelet.wait_for_devices(third, lambda d: len(d) == 4 * SHARES, "the device list after a second restart")


def test_allocate_for_two_pods_pending_on_the_node_at_once(kubelet: KubeletStandIn, plugin: Running) -> None:
    connection = kubelet.plugin()
    kubelet.wait_for_devices(connection, lambda d: len(d) == 4 * SHARES, "the device list")
    u = plugin.uuids
    # both bound before kubelet admits either; same shape, different GPUs and sizes: matching must not swap them
    first = gpu_pod(
        "first", containers=[container("main", 1, memory_mib=2048)], assignment={"main": [(u[2], 2048, 25)]}, bound_at=1
    )
    second = gpu_pod(
        "second",
        containers=[container("main", 1, memory_mib=6144)],
        assignment={"main": [(u[0], 6144, 50)]},
        bound_at=2,
    )
    plugin.cluster.add_pod(second)
    plugin.cluster.add_pod(first)
    [response_first] = kubelet.admit(connection, first)
    [response_second] = kubelet.admit(connection, second)
    assert response_first.envs[protocol.ENV_NVIDIA_VISIBLE_DEVICES] == u[2]
    assert response_first.envs["CUDA_DEVICE_MEMORY_LIMIT_0"] == "2048m"
    assert response_second.envs[protocol.ENV_NVIDIA_VISIBLE_DEVICES] == u[0]
    assert response_second.envs["CUDA_DEVICE_MEMORY_LIMIT_0"] == "6144m"
    # GetPreferredAllocation steered kubelet's own bookkeeping onto the assigned GPUs
    assert allocation_of(plugin.cluster.pod("default", "first"))["main"][0].startswith(u[2])
    assert allocation_of(plugin.cluster.pod("default", "second"))["main"][0].startswith(u[0])


def test_concurrent_allocate_calls_each_get_a_different_pod(kubelet: KubeletStandIn, plugin: Running) -> None:
    connection = kubelet.plugin()
    kubelet.wait_for_devices(connection, lambda d: len(d) == 4 * SHARES, "the device list")
    u = plugin.uuids
    for index in range(4):
        plugin.cluster.add_pod(
            gpu_pod(f"p{index}", assignment={"main": [(u[index], 1024 * (index + 1), 10)]}, bound_at=index)
        )
    answers: list[str] = []
    lock = threading.Lock()

    def allocate(replica: int) -> None:
        response = connection.stub.Allocate(
            pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=[f"{u[replica]}::1"])]),
            timeout=20,
        )
        with lock:
            answers.append(response.container_responses[0].envs[protocol.ENV_NVIDIA_VISIBLE_DEVICES])

    threads = [threading.Thread(target=allocate, args=(r,)) for r in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert sorted(answers) == sorted(u)  # every pod's own GPU exactly once
    for index in range(4):
        assert allocation_of(plugin.cluster.pod("default", f"p{index}")).keys() == {"main"}


def test_allocate_refuses_unassigned_and_unknown_devices(kubelet: KubeletStandIn, plugin: Running) -> None:
    connection = kubelet.plugin()
    kubelet.wait_for_devices(connection, lambda d: len(d) == 4 * SHARES, "the device list")
    plugin.cluster.add_pod(gpu_pod("stray", scheduler="default-scheduler"))
    with pytest.raises(grpc.RpcError) as refused:
        kubelet.admit(connection, plugin.cluster.pod("default", "stray"))
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "default/stray (schedulerName default-scheduler)" in (refused.value.details() or "")
    with pytest.raises(grpc.RpcError) as unknown:
        connection.stub.Allocate(
            pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=["GPU-nope::0"])]),
            timeout=10,
        )
    assert unknown.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_probes_report_liveness_and_readiness(kubelet: KubeletStandIn) -> None:
    import urllib.error
    import urllib.request

    cluster = InMemoryCluster()
    cluster.add_node({"metadata": {"name": NODE}})
    config = PluginConfig(
        node_name=NODE,
        kubelet_dir=str(kubelet.directory),
        kubelet_poll_seconds=0.05,
        heartbeat_seconds=3600,
        probe_address="127.0.0.1:0",
        delivery=DeliveryConfig(limiter_library_path="", cache_host_dir=""),
    )
    app = DevicePluginApp(config, Nvml(FakeNvml(load_profile("a100-mig", NODE))), cluster)
    app.start()
    try:
        assert app._probe_server is not None
        port = app._probe_server.server_address[1]

        def status(path: str) -> int:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as response:
                    return int(response.status)
            except urllib.error.HTTPError as exc:
                return exc.code

        assert status("/healthz") == 200
        wait_until(lambda: status("/readyz") == 200, "/readyz to answer 200 once registered and published")
        assert status("/nope") == 404
        # MIG-enabled GPUs 0 and 1 are in the inventory but not advertised to kubelet as nvidia.com/gpu (their MIG
        # devices are, by one plugin per MIG profile, registered in any order: tests/deviceplugin/test_mig_kubelet.py)
        kubelet.plugin(registrations=4)
        connection = next(c for c in kubelet.plugins if c.request.resource_name == protocol.RESOURCE_GPU)
        devices = kubelet.wait_for_devices(connection, lambda d: len(d) == 2 * 10, "the non-MIG GPUs' devices")
        mig = {g.uuid for g in app.state.gpus() if g.mig_mode}
        assert len(mig) == 2 and not any(d.ID.split("::")[0] in mig for d in devices)
    finally:
        app.stop()
