"""The device plugin's live view of its GPUs: the discovered inventory plus what changed since (health, GPUs held
by pods kube-vgpu did not place). ListAndWatch, the publisher and Allocate all read it from here, so the kubelet
and the API server never disagree for longer than one heartbeat.

Each physical GPU is advertised to kubelet as `sharing_count` device IDs "<uuid>::<n>"; kubelet only counts
them (which vGPU lands on which GPU is the extender's decision, delivered in Allocate).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from dataclasses import dataclass

from kube_vgpu.protocol import MIG_RESOURCE_PREFIX, RESOURCE_GPU, GpuInfo, MigDevice, NodeInventory

log = logging.getLogger(__name__)

DEVICE_ID_SEPARATOR = "::"
HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"


def device_id(uuid: str, replica: int) -> str:
    return f"{uuid}{DEVICE_ID_SEPARATOR}{replica}"


def uuid_of_device_id(device: str) -> str:
    """ "GPU-...::3" -> "GPU-..."; an ID without the separator is taken as a bare UUID."""
    return device.split(DEVICE_ID_SEPARATOR, 1)[0]


@dataclass(frozen=True, slots=True)
class AdvertisedDevice:
    id: str
    uuid: str
    healthy: bool
    numa_node: int | None


class DeviceState:
    """Thread-safe; `generation` increases on every change and `wait_for_change` wakes the watchers."""

    def __init__(self, inventory: NodeInventory) -> None:
        self._base = inventory
        #: static MIG: MIG device UUID -> (its GPU, the device), for GPUs in MIG mode
        self._mig: dict[str, tuple[GpuInfo, MigDevice]] = {
            device.uuid: (gpu, device) for gpu in inventory.gpus if gpu.mig_mode for device in gpu.mig_devices
        }
        self._unhealthy: dict[str, str] = {
            gpu.uuid: "unhealthy at discovery" for gpu in inventory.gpus if not gpu.healthy
        }
        self._external: dict[str, tuple[str, ...]] = {}
        self._generation = 0
        self._changed = threading.Condition()

    @property
    def generation(self) -> int:
        with self._changed:
            return self._generation

    def gpus(self) -> tuple[GpuInfo, ...]:
        return self._base.gpus

    def uuids(self) -> list[str]:
        return [gpu.uuid for gpu in self._base.gpus]

    def gpu(self, uuid: str) -> GpuInfo | None:
        for gpu in self._base.gpus:
            if gpu.uuid == uuid:
                return gpu
        return None

    def mig_device(self, uuid: str) -> tuple[GpuInfo, MigDevice] | None:
        """A MIG device by its UUID, with the GPU it lives on."""
        return self._mig.get(uuid)

    def mig_resources(self) -> list[str]:
        """The kubelet resources of the node's MIG devices, nvidia.com/mig-<profile>, sorted."""
        return sorted({MIG_RESOURCE_PREFIX + device.profile for _gpu, device in self._mig.values()})

    def capacity(self, uuid: str) -> tuple[int, int] | None:
        """(MiB, cores) of a GPU or a MIG device (held whole: all of its compute); None when unknown here."""
        gpu = self.gpu(uuid)
        if gpu is not None:
            return gpu.memory_mib, gpu.cores
        mig = self._mig.get(uuid)
        return (mig[1].memory_mib, mig[0].cores) if mig is not None else None

    def is_healthy(self, uuid: str) -> bool:
        """A MIG device is as healthy as its GPU."""
        mig = self._mig.get(uuid)
        with self._changed:
            return (mig[0].uuid if mig is not None else uuid) not in self._unhealthy

    def unhealthy_reasons(self) -> dict[str, str]:
        with self._changed:
            return dict(self._unhealthy)

    def mark_unhealthy(self, uuid: str, reason: str) -> bool:
        """Returns True when this changed anything. Unhealthy is sticky until the plugin restarts (as NVIDIA's
        plugin does): an XID that needs a GPU reset does not heal by itself."""
        with self._changed:
            if uuid in self._unhealthy or self.gpu(uuid) is None:
                return False
            self._unhealthy[uuid] = reason
            self._bump()
        log.error("GPU %s marked unhealthy: %s", uuid, reason)
        return True

    def set_external_pods(self, pods_by_uuid: dict[str, tuple[str, ...]]) -> bool:
        """Pods holding each GPU without a kube-vgpu assignment; True when it changed."""
        cleaned = {uuid: tuple(sorted(set(pods))) for uuid, pods in pods_by_uuid.items() if pods and self.gpu(uuid)}
        with self._changed:
            if cleaned == self._external:
                return False
            self._external = cleaned
            self._bump()
        return True

    def _bump(self) -> None:
        self._generation += 1
        self._changed.notify_all()

    def wait_for_change(self, since: int, timeout_seconds: float, *stops: threading.Event) -> int:
        """Block until generation != since, one of `stops` is set (see wake_all) or the timeout; returns the
        generation."""
        with self._changed:
            self._changed.wait_for(
                lambda: self._generation != since or any(stop.is_set() for stop in stops), timeout=timeout_seconds
            )
            return self._generation

    def wake_all(self) -> None:
        """Wake every waiter so it re-checks its stop event (call after setting it)."""
        with self._changed:
            self._changed.notify_all()

    def inventory(self) -> NodeInventory:
        """The inventory to publish: discovery's, with current health and external holders."""
        with self._changed:
            gpus = tuple(
                dataclasses.replace(
                    gpu,
                    healthy=gpu.uuid not in self._unhealthy,
                    external_pods=self._external.get(gpu.uuid, ()),
                )
                for gpu in self._base.gpus
            )
        return dataclasses.replace(self._base, gpus=gpus)

    def advertised(self, resource: str = RESOURCE_GPU) -> list[AdvertisedDevice]:
        """Device IDs for kubelet, of one resource. nvidia.com/gpu: "<uuid>::<n>" per vGPU slot of each GPU not in
        MIG mode (the limiter cannot share a GPU in MIG mode). nvidia.com/mig-<profile>: one ID per MIG device of
        that profile, its UUID, as healthy as its GPU."""
        with self._changed:
            unhealthy = set(self._unhealthy)
        if resource != RESOURCE_GPU:
            profile = resource.removeprefix(MIG_RESOURCE_PREFIX)
            return [
                AdvertisedDevice(device.uuid, device.uuid, gpu.uuid not in unhealthy, gpu.numa_node)
                for gpu, device in self._mig.values()
                if device.profile == profile
            ]
        return [
            AdvertisedDevice(device_id(gpu.uuid, replica), gpu.uuid, gpu.uuid not in unhealthy, gpu.numa_node)
            for gpu in self._base.gpus
            if not gpu.mig_mode
            for replica in range(gpu.max_vgpus)
        ]
