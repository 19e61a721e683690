"""Pods that reached this node without kube-vgpu: they ask for nvidia.com/gpu but carry no assignment
(another scheduler, a hand-set spec.nodeName, or pods admitted before kube-vgpu took over the node).

kube-vgpu refuses their Allocate (nobody assigned them GPUs). Those already running hold GPUs anyway (from an
earlier device plugin, e.g. NVIDIA's or HAMi's). kubelet's pod-resources API says which device IDs each of
their containers got; the UUIDs in those IDs are published in the inventory as `external_pods`, which the
extender counts as fully used, so nobody places work next to them. Each such pod is reported once: a log line
and a Warning event on the pod.
"""

from __future__ import annotations

import logging
import re
from typing import Any, Protocol

from kube_vgpu import protocol
from kube_vgpu.deviceplugin.allocate import read_node_pods
from kube_vgpu.deviceplugin.kube import ApiUnavailable, PodSource
from kube_vgpu.deviceplugin.state import DeviceState

log = logging.getLogger(__name__)

DEFAULT_POD_RESOURCES_SOCKET = "/var/lib/kubelet/pod-resources/kubelet.sock"
EVENT_REASON = "GPUPodBypassedKubeVgpu"
#: GPU and MIG UUIDs inside device IDs of any NVIDIA plugin ("GPU-<uuid>", "GPU-<uuid>::3", "GPU-<uuid>-3")
_UUID = re.compile(r"(?:GPU|MIG)-[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}")


def uuids_in_device_ids(device_ids: list[str]) -> set[str]:
    found = set()
    for device in device_ids:
        match = _UUID.search(device)
        if match:
            found.add(match.group(0))
    return found


class DeviceHolders(Protocol):
    def gpu_holders(self) -> dict[tuple[str, str], set[str]]:
        """(namespace, pod name) -> GPU UUIDs kubelet assigned to its containers (NVIDIA resources)."""
        ...


class PodResourcesClient:
    """kubelet's pod-resources API v1 (List) over its unix socket."""

    def __init__(self, socket_path: str = DEFAULT_POD_RESOURCES_SOCKET, *, timeout_seconds: float = 5.0) -> None:
        self.socket_path = socket_path
        self.timeout_seconds = timeout_seconds

    def gpu_holders(self) -> dict[tuple[str, str], set[str]]:
        import grpc

        from kube_vgpu.deviceplugin.api import podresources_pb2, podresources_pb2_grpc

        with grpc.insecure_channel(f"unix://{self.socket_path}") as channel:
            stub = podresources_pb2_grpc.PodResourcesListerStub(channel)
            try:
                response = stub.List(podresources_pb2.ListPodResourcesRequest(), timeout=self.timeout_seconds)
            except grpc.RpcError as exc:
                raise ApiUnavailable(f"kubelet pod-resources API at {self.socket_path}: {exc.code().name}") from None
        holders: dict[tuple[str, str], set[str]] = {}
        for pod in response.pod_resources:
            uuids: set[str] = set()
            for container in pod.containers:
                for devices in container.devices:
                    if devices.resource_name.startswith("nvidia.com/"):
                        uuids |= uuids_in_device_ids(list(devices.device_ids))
            if uuids:
                holders[(pod.namespace, pod.name)] = uuids
        return holders


class ForeignPodMonitor:
    def __init__(
        self, node_name: str, pods: PodSource, state: DeviceState, holders: DeviceHolders | None = None
    ) -> None:
        self.node_name = node_name
        self.pods = pods
        self.state = state
        self.holders = holders
        self._reported: set[str] = set()  # pod UIDs already reported
        self._unattributed: set[str] = set()

    def scan(self) -> None:
        """One pass (the publisher runs it every heartbeat). API errors are logged; the previous view stays."""
        try:
            foreign = read_node_pods(self.pods.list_node_pods(self.node_name), self.node_name).foreign
        except ApiUnavailable as exc:
            log.warning("foreign GPU pod scan skipped: %s", exc)
            return
        holders: dict[tuple[str, str], set[str]] | None = None
        if foreign and self.holders is not None:
            try:
                holders = self.holders.gpu_holders()
            except ApiUnavailable as exc:
                log.warning("cannot tell which GPUs foreign pods hold: %s", exc)
        external: dict[str, list[str]] = {}
        for pod in foreign:
            metadata = pod.get("metadata") or {}
            namespace, name = metadata.get("namespace", ""), metadata.get("name", "")
            ref = f"{namespace}/{name}"
            uuids = holders.get((namespace, name), set()) if holders is not None else set()
            for uuid in sorted(uuids):
                external.setdefault(uuid, []).append(ref)
            self._report(pod, ref, uuids)
            if not uuids and (pod.get("status") or {}).get("phase") == "Running" and ref not in self._unattributed:
                self._unattributed.add(ref)
                log.warning(
                    "pod %s runs with %s but kubelet's pod-resources API does not say which GPUs it holds; "
                    "they cannot be marked as used",
                    ref,
                    protocol.RESOURCE_GPU,
                )
        if self.state.set_external_pods({uuid: tuple(refs) for uuid, refs in external.items()}):
            log.info("GPUs held outside kube-vgpu: %s", {uuid: refs for uuid, refs in external.items()} or "none")

    def _report(self, pod: dict[str, Any], ref: str, uuids: set[str]) -> None:
        uid = (pod.get("metadata") or {}).get("uid") or ref
        if uid in self._reported:
            return
        self._reported.add(uid)
        scheduler = (pod.get("spec") or {}).get("schedulerName", "default-scheduler")
        held = f"; it holds {', '.join(sorted(uuids))}, now published as fully used" if uuids else ""
        message = (
            f"pod asks for {protocol.RESOURCE_GPU} but was not placed by kube-vgpu (schedulerName {scheduler}, "
            f"no {protocol.POD_ASSIGNMENT_ANNOTATION} annotation): kube-vgpu refuses to allocate GPUs to it{held}. "
            f"Use schedulerName {protocol.DEFAULT_SCHEDULER_NAME}."
        )
        log.warning("node %s: pod %s: %s", self.node_name, ref, message)
        self.pods.record_event(pod, EVENT_REASON, message)
