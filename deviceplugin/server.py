"""kubelet device-plugin API v1beta1 over gRPC: the DevicePlugin service on our socket, registration with
kubelet, and re-registration when kubelet restarts.

kubelet restart: on start kubelet removes every socket in the device-plugin directory (ours included) and
creates a new kubelet.sock. The plugin polls both (no inotify dependency): when its own socket is gone or
kubelet.sock is a different file than the one it registered with, it serves a fresh socket and registers again.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc

from kube_vgpu import protocol
from kube_vgpu.deviceplugin.allocate import AllocationError, Allocator, ContainerDelivery
from kube_vgpu.deviceplugin.api import deviceplugin_pb2 as pb
from kube_vgpu.deviceplugin.api import deviceplugin_pb2_grpc as pb_grpc
from kube_vgpu.deviceplugin.state import HEALTHY, UNHEALTHY, DeviceState

log = logging.getLogger(__name__)

API_VERSION = "v1beta1"
KUBELET_SOCKET = "kubelet.sock"
DEFAULT_KUBELET_DIR = "/var/lib/kubelet/device-plugins"
DEFAULT_SOCKET_NAME = "kube-vgpu-nvidia-gpu.sock"


def mig_socket_name(resource: str) -> str:
    """The socket of a MIG resource's plugin: nvidia.com/mig-3g.20gb -> kube-vgpu-nvidia-mig-3g.20gb.sock ('+'
    of a +me profile spelled 'me')."""
    return "kube-vgpu-nvidia-" + resource.removeprefix("nvidia.com/").replace("+", "-") + ".sock"
#: bounded calls to kubelet's Registration service
REGISTER_TIMEOUT_SECONDS = 10.0
#: worker threads: each ListAndWatch stream holds one while it is open
MAX_WORKERS = 16


def devices_message(state: DeviceState, resource: str = protocol.RESOURCE_GPU) -> pb.ListAndWatchResponse:
    devices = []
    for device in state.advertised(resource):
        topology = None
        if device.numa_node is not None:
            topology = pb.TopologyInfo(nodes=[pb.NUMANode(ID=device.numa_node)])
        devices.append(pb.Device(ID=device.id, health=HEALTHY if device.healthy else UNHEALTHY, topology=topology))
    return pb.ListAndWatchResponse(devices=devices)


def allocate_response(deliveries: list[ContainerDelivery]) -> pb.AllocateResponse:
    return pb.AllocateResponse(
        container_responses=[
            pb.ContainerAllocateResponse(
                envs=delivery.envs,
                mounts=[
                    pb.Mount(container_path=container, host_path=host, read_only=read_only)
                    for container, host, read_only in delivery.mounts
                ],
                cdi_devices=[pb.CDIDevice(name=name) for name in delivery.cdi_devices],
            )
            for delivery in deliveries
        ]
    )


class DevicePluginServicer(pb_grpc.DevicePluginServicer):
    """The DevicePlugin service of one kubelet resource: nvidia.com/gpu (vGPU slots), or a MIG resource
    nvidia.com/mig-<profile> (one device per MIG device of that profile; static MIG)."""

    def __init__(self, state: DeviceState, allocator: Allocator, stop: threading.Event,
                 resource: str = protocol.RESOURCE_GPU) -> None:
        self.state = state
        self.allocator = allocator
        self.stop = stop
        self.resource = resource

    def GetDevicePluginOptions(self, request: pb.Empty, context: Any) -> pb.DevicePluginOptions:
        return pb.DevicePluginOptions(pre_start_required=False, get_preferred_allocation_available=True)

    def ListAndWatch(self, request: pb.Empty, context: Any) -> Iterator[pb.ListAndWatchResponse]:
        done = threading.Event()

        def closed() -> None:
            done.set()
            self.state.wake_all()

        if not context.add_callback(closed):
            return  # the RPC already ended
        generation = self.state.generation
        yield devices_message(self.state, self.resource)
        while not (done.is_set() or self.stop.is_set()):
            current = self.state.wait_for_change(generation, 60.0, done, self.stop)
            if done.is_set() or self.stop.is_set():
                break
            if current != generation:
                generation = current
                yield devices_message(self.state, self.resource)

    def GetPreferredAllocation(
        self, request: pb.PreferredAllocationRequest, context: Any
    ) -> pb.PreferredAllocationResponse:
        responses = []
        for container in request.container_requests:
            chosen = self.allocator.preferred(
                list(container.available_deviceIDs), list(container.must_include_deviceIDs), container.allocation_size,
                self.resource,
            )
            responses.append(pb.ContainerPreferredAllocationResponse(deviceIDs=chosen))
        return pb.PreferredAllocationResponse(container_responses=responses)

    def Allocate(self, request: pb.AllocateRequest, context: Any) -> pb.AllocateResponse:
        requests = [list(container.devices_ids) for container in request.container_requests]
        known = {device.id for device in self.state.advertised(self.resource)}
        unknown = sorted({device for ids in requests for device in ids if device not in known})
        if unknown:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"unknown device IDs: {', '.join(unknown[:5])}")
        try:
            deliveries = self.allocator.allocate(requests, self.resource)
        except AllocationError as exc:
            log.warning("Allocate refused: %s", exc)
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        return allocate_response(deliveries)

    def PreStartContainer(self, request: pb.PreStartContainerRequest, context: Any) -> pb.PreStartContainerResponse:
        # not requested in our options; answered anyway (harmless) in case a kubelet calls it
        return pb.PreStartContainerResponse()


def _file_identity(path: Path) -> tuple[int, int, int] | None:
    try:
        stat = path.stat()
    except OSError:
        return None
    return (stat.st_dev, stat.st_ino, stat.st_ctime_ns)


class PluginServer:
    """Serves the DevicePlugin service on <kubelet_dir>/<socket_name> and keeps it registered with kubelet."""

    def __init__(
        self,
        kubelet_dir: str | Path,
        servicer: DevicePluginServicer,
        *,
        socket_name: str = DEFAULT_SOCKET_NAME,
        resource_name: str = protocol.RESOURCE_GPU,
        poll_seconds: float = 1.0,
    ) -> None:
        self.kubelet_dir = Path(kubelet_dir)
        self.servicer = servicer
        self.socket_name = socket_name
        self.resource_name = resource_name
        self.poll_seconds = poll_seconds
        self.socket_path = self.kubelet_dir / socket_name
        self.kubelet_socket = self.kubelet_dir / KUBELET_SOCKET
        self._server: grpc.Server | None = None
        self._registered_with: tuple[int, int, int] | None = None
        self._serving_identity: tuple[int, int, int] | None = None
        self.registrations = 0
        #: set while registered with a live kubelet (readiness)
        self.registered = threading.Event()

    # -- serving ------------------------------------------------------------------------------------------------

    def _serve(self) -> None:
        self._stop_server()
        self.kubelet_dir.mkdir(parents=True, exist_ok=True)
        try:
            self.socket_path.unlink()
        except FileNotFoundError:
            pass
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=MAX_WORKERS, thread_name_prefix="device-plugin"))
        pb_grpc.add_DevicePluginServicer_to_server(self.servicer, server)
        server.add_insecure_port(f"unix://{self.socket_path}")
        server.start()
        self._server = server
        self._serving_identity = _file_identity(self.socket_path)
        log.info("serving the device plugin API on %s", self.socket_path)

    def _stop_server(self) -> None:
        if self._server is not None:
            # cancels open ListAndWatch streams; their callbacks wake the waiting generators
            self._server.stop(grace=1.0).wait(5.0)
            self._server = None

    def _register(self) -> bool:
        identity = _file_identity(self.kubelet_socket)
        if identity is None:
            return False
        request = pb.RegisterRequest(
            version=API_VERSION,
            endpoint=self.socket_name,
            resource_name=self.resource_name,
            options=pb.DevicePluginOptions(pre_start_required=False, get_preferred_allocation_available=True),
        )
        try:
            with grpc.insecure_channel(f"unix://{self.kubelet_socket}") as channel:
                pb_grpc.RegistrationStub(channel).Register(request, timeout=REGISTER_TIMEOUT_SECONDS)
        except grpc.RpcError as exc:
            log.warning("registering %s with kubelet failed: %s %s", self.resource_name, exc.code().name, exc.details())
            return False
        self._registered_with = identity
        self.registrations += 1
        self.registered.set()
        log.info("registered %s with kubelet (%s) as %s", self.resource_name, self.kubelet_socket, self.socket_name)
        return True

    def _needs_restart(self) -> str | None:
        if _file_identity(self.socket_path) != self._serving_identity or not os.path.exists(self.socket_path):
            return f"our socket {self.socket_path} was removed (kubelet restarted?)"
        kubelet = _file_identity(self.kubelet_socket)
        if self._registered_with is not None and kubelet != self._registered_with:
            return "kubelet.sock was re-created (kubelet restarted)"
        return None

    def run(self, stop: threading.Event) -> None:
        """Serve and stay registered until `stop` is set."""
        self._serve()
        try:
            while not stop.is_set():
                if self._registered_with is None:
                    if not self._register():
                        stop.wait(self.poll_seconds)
                    continue
                reason = self._needs_restart()
                if reason:
                    log.info("%s: serving a new socket and registering again", reason)
                    self.registered.clear()
                    self._registered_with = None
                    self._serve()
                    continue
                stop.wait(self.poll_seconds)
        finally:
            self.registered.clear()
            self._stop_server()
            try:
                self.socket_path.unlink()
            except FileNotFoundError:
                pass
