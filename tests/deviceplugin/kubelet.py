"""A kubelet stand-in speaking the real device-plugin gRPC protocol (v1beta1) over unix sockets.

Like kubelet it serves Registration on <dir>/kubelet.sock, and on Register it connects back to the plugin's
socket, asks for its options and keeps a ListAndWatch stream open, recording every device list it receives.
`admit` does what kubelet's device manager does at pod admission, container by container (init containers
first): pick free healthy device IDs (asking GetPreferredAllocation when offered), then call Allocate.
`restart` behaves like a kubelet restart: the server goes away, every socket in the directory is removed, and
a new kubelet.sock appears. It also serves the pod-resources API (List) on its own socket.
"""

from __future__ import annotations

import os
import threading
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc

from kube_vgpu import protocol
from kube_vgpu.deviceplugin.api import deviceplugin_pb2 as pb
from kube_vgpu.deviceplugin.api import deviceplugin_pb2_grpc as pb_grpc
from kube_vgpu.deviceplugin.api import podresources_pb2 as prpb
from kube_vgpu.deviceplugin.api import podresources_pb2_grpc as prpb_grpc
from tests.deviceplugin.builders import wait_until


class _Registration(pb_grpc.RegistrationServicer):
    def __init__(self, kubelet: KubeletStandIn) -> None:
        self.kubelet = kubelet

    def Register(self, request: pb.RegisterRequest, context: Any) -> pb.Empty:
        if request.version != "v1beta1":
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"unsupported version {request.version}")
        self.kubelet.on_register(request)
        return pb.Empty()


class PluginConnection:
    """kubelet's client side of one registered plugin."""

    def __init__(self, socket_path: Path, request: pb.RegisterRequest) -> None:
        self.request = request
        self.channel = grpc.insecure_channel(f"unix://{socket_path}")
        self.stub = pb_grpc.DevicePluginStub(self.channel)
        self.options: pb.DevicePluginOptions | None = None
        self.updates: list[list[pb.Device]] = []
        self.stream_error: str | None = None
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        try:
            self.options = self.stub.GetDevicePluginOptions(pb.Empty(), timeout=10)
            for response in self.stub.ListAndWatch(pb.Empty()):
                with self._changed:
                    self.updates.append(list(response.devices))
                    self._changed.notify_all()
        except grpc.RpcError as exc:
            self.stream_error = exc.code().name

    def latest(self) -> list[pb.Device]:
        with self._changed:
            return list(self.updates[-1]) if self.updates else []

    def close(self) -> None:
        self.channel.close()


class KubeletStandIn:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.socket_path = directory / "kubelet.sock"
        self.registrations: list[pb.RegisterRequest] = []
        self.plugins: list[PluginConnection] = []
        self.in_use: set[str] = set()
        self._server: grpc.Server | None = None
        self._lock = threading.Lock()

    def start(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        pb_grpc.add_RegistrationServicer_to_server(_Registration(self), server)
        server.add_insecure_port(f"unix://{self.socket_path}")
        server.start()
        self._server = server

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop(grace=None).wait(5)
            self._server = None
        for plugin in self.plugins:
            plugin.close()

    def restart(self) -> None:
        """What a kubelet restart looks like from the device-plugin directory."""
        self.stop()
        for entry in self.directory.iterdir():
            if entry.is_socket():
                entry.unlink()
        self.start()

    def on_register(self, request: pb.RegisterRequest) -> None:
        with self._lock:
            self.registrations.append(request)
            # kubelet dials the plugin after answering Register
            self.plugins.append(PluginConnection(self.directory / request.endpoint, request))

    # -- helpers for tests --------------------------------------------------------------------------------------

    def plugin(self, registrations: int = 1) -> PluginConnection:
        wait_until(lambda: len(self.plugins) >= registrations, f"{registrations} registration(s) with kubelet")
        return self.plugins[registrations - 1]

    def wait_for_devices(self, plugin: PluginConnection, predicate: Any, what: str) -> list[pb.Device]:
        return wait_until(lambda: (devices := plugin.latest()) and predicate(devices) and devices, what)

    def admit(self, plugin: PluginConnection, pod: dict[str, Any],
              resource: str = protocol.RESOURCE_GPU) -> list[pb.ContainerAllocateResponse]:
        """Allocate every container of `pod` asking for `resource` (the plugin's), in kubelet's order; raises
        grpc.RpcError on refusal."""
        spec = pod["spec"]
        responses = []
        for entry in [*(spec.get("initContainers") or ()), *spec["containers"]]:
            count = int(((entry.get("resources") or {}).get("limits") or {}).get(resource, 0))
            if count == 0:
                continue
            with self._lock:
                available = [d.ID for d in plugin.latest() if d.health == "Healthy" and d.ID not in self.in_use]
            chosen = available[:count]
            if plugin.options is not None and plugin.options.get_preferred_allocation_available:
                preferred = plugin.stub.GetPreferredAllocation(
                    pb.PreferredAllocationRequest(
                        container_requests=[
                            pb.ContainerPreferredAllocationRequest(available_deviceIDs=available, allocation_size=count)
                        ]
                    ),
                    timeout=10,
                )
                chosen = list(preferred.container_responses[0].deviceIDs)
            response = plugin.stub.Allocate(
                pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=chosen)]), timeout=10
            )
            with self._lock:
                self.in_use.update(chosen)
            responses.append(response.container_responses[0])
        return responses


class _PodResources(prpb_grpc.PodResourcesListerServicer):
    def __init__(self, pods: list[tuple[str, str, str, str, list[str]]]) -> None:
        self.pods = pods

    def List(self, request: prpb.ListPodResourcesRequest, context: Any) -> prpb.ListPodResourcesResponse:
        result = []
        for namespace, name, container, resource, ids in self.pods:
            result.append(
                prpb.PodResources(
                    name=name,
                    namespace=namespace,
                    containers=[
                        prpb.ContainerResources(
                            name=container, devices=[prpb.ContainerDevices(resource_name=resource, device_ids=ids)]
                        )
                    ],
                )
            )
        return prpb.ListPodResourcesResponse(pod_resources=result)


class PodResourcesStandIn:
    """kubelet's pod-resources API: (namespace, pod, container, resource, device IDs) entries."""

    def __init__(self, socket_path: Path) -> None:
        self.socket_path = socket_path
        self.pods: list[tuple[str, str, str, str, list[str]]] = []
        socket_path.parent.mkdir(parents=True, exist_ok=True)
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        prpb_grpc.add_PodResourcesListerServicer_to_server(_PodResources(self.pods), self._server)
        self._server.add_insecure_port(f"unix://{socket_path}")
        self._server.start()

    def stop(self) -> None:
        self._server.stop(grace=None).wait(5)
        if os.path.exists(self.socket_path):
            os.unlink(self.socket_path)
