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

from kube_vgpu.protocol import (
    MIG_RESOURCE_PREFIX,
    RESOURCE_GPU,
    DynamicMigPlacement,
    GpuInfo,
    MigDevice,
    NodeInventory,
    mig,
    parse_dynamic_mig_device,
)

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
        #: dynamic MIG: GPU UUID -> the GPU as it is now (MIG mode and instances change as pods come and go)
        self._dynamic: dict[str, GpuInfo] = {gpu.uuid: gpu for gpu in inventory.gpus if gpu.dynamic_mig is not None}
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
        """A MIG device by its UUID, with the GPU it lives on; for a dynamic MIG device name (an instance the
        extender placed, maybe not created yet), the device it stands for, named so, when its GPU is a dynamic GPU
        of this node that allows its profile."""
        static = self._mig.get(uuid)
        if static is not None:
            return static
        placement = parse_dynamic_mig_device(uuid)
        return self._dynamic_device(placement) if placement is not None else None

    def _dynamic_device(self, placement: DynamicMigPlacement) -> tuple[GpuInfo, MigDevice] | None:
        with self._changed:
            gpu = self._dynamic.get(placement.gpu_uuid)
        if gpu is None or gpu.dynamic_mig is None or placement.profile not in gpu.dynamic_mig.profiles:
            return None
        model = next((m for m in mig.MIG_MODELS if m.key == gpu.dynamic_mig.model), None)
        profile = model.profile(placement.profile) if model else None
        if profile is None or placement.start not in profile.starts:
            return None
        return gpu, MigDevice(placement.device, profile.name, 0, 0, profile.memory_mib, profile.multiprocessors,
                              placement.start, profile.memory_slices)

    def dynamic_gpus(self) -> list[GpuInfo]:
        with self._changed:
            return list(self._dynamic.values())

    def set_dynamic_instances(self, uuid: str, mig_mode: bool, instances: tuple[MigDevice, ...]) -> bool:
        """A dynamic GPU's MIG mode and instances now (after a creation or a reconcile); True when it changed."""
        with self._changed:
            gpu = self._dynamic.get(uuid)
            if gpu is None or gpu.dynamic_mig is None:
                return False
            if gpu.mig_mode == mig_mode and gpu.dynamic_mig.instances == instances:
                return False
            self._dynamic[uuid] = dataclasses.replace(
                gpu, mig_mode=mig_mode, dynamic_mig=dataclasses.replace(gpu.dynamic_mig, instances=instances))
            self._bump()
        return True

    def mig_resources(self) -> list[str]:
        """The kubelet resources of the node's MIG devices, nvidia.com/mig-<profile>, sorted: the static devices'
        profiles and every profile a dynamic GPU allows."""
        profiles = {device.profile for _gpu, device in self._mig.values()}
        profiles.update(p for gpu in self._dynamic.values() if gpu.dynamic_mig for p in gpu.dynamic_mig.profiles)
        return sorted(MIG_RESOURCE_PREFIX + profile for profile in profiles)

    def capacity(self, uuid: str) -> tuple[int, int] | None:
        """(MiB, cores) of a GPU or a MIG device (held whole: all of its compute); None when unknown here."""
        gpu = self.gpu(uuid)
        if gpu is not None:
            return gpu.memory_mib, gpu.cores
        mig_device = self.mig_device(uuid)
        return (mig_device[1].memory_mib, mig_device[0].cores) if mig_device is not None else None

    def is_healthy(self, uuid: str) -> bool:
        """A MIG device is as healthy as its GPU."""
        mig_device = self.mig_device(uuid)
        with self._changed:
            return (mig_device[0].uuid if mig_device is not None else uuid) not in self._unhealthy

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
                    self._dynamic.get(gpu.uuid, gpu),
                    healthy=gpu.uuid not in self._unhealthy,
                    external_pods=self._external.get(gpu.uuid, ()),
                )
                for gpu in self._base.gpus
            )
        return dataclasses.replace(self._base, gpus=gpus)

    def advertised(self, resource: str = RESOURCE_GPU) -> list[AdvertisedDevice]:
        """Device IDs for kubelet, of one resource. nvidia.com/gpu: "<uuid>::<n>" per vGPU slot of each GPU not in
        MIG mode (the limiter cannot share a GPU in MIG mode) and of each dynamic MIG GPU. nvidia.com/mig-<profile>:
        one ID per MIG device of that profile, its UUID, as healthy as its GPU, and one per legal placement of the
        profile on each dynamic GPU allowing it."""
        with self._changed:
            unhealthy = set(self._unhealthy)
            current = [self._dynamic.get(gpu.uuid, gpu) for gpu in self._base.gpus]
        if resource != RESOURCE_GPU:
            profile = resource.removeprefix(MIG_RESOURCE_PREFIX)
            static = [
                AdvertisedDevice(device.uuid, device.uuid, gpu.uuid not in unhealthy, gpu.numa_node)
                for gpu, device in self._mig.values()
                if device.profile == profile
            ]
            # dynamic MIG: one ID per legal placement of the profile on each GPU allowing it, so kubelet can count
            # as many of the profile as could ever run there (which one a pod gets is the extender's choice)
            dynamic = []
            for gpu in current:
                if gpu.dynamic_mig is None or profile not in gpu.dynamic_mig.profiles:
                    continue
                model = next((m for m in mig.MIG_MODELS if m.key == gpu.dynamic_mig.model), None)
                table = model.profile(profile) if model else None
                for start in table.starts if table else ():
                    name = DynamicMigPlacement(gpu.uuid, profile, start).device
                    dynamic.append(AdvertisedDevice(name, name, gpu.uuid not in unhealthy, gpu.numa_node))
            return static + dynamic
        # a dynamic GPU keeps its vGPU slots in MIG mode too: vgpu-mode: mig pods ask nvidia.com/gpu for their
        # instances, and kubelet only counts (the extender decides what each pod gets)
        return [
            AdvertisedDevice(device_id(gpu.uuid, replica), gpu.uuid, gpu.uuid not in unhealthy, gpu.numa_node)
            for gpu in current
            if not gpu.mig_mode or gpu.dynamic_mig is not None
            for replica in range(gpu.max_vgpus)
        ]
