"""Dynamic MIG (issue 16 item 2): the device plugin partitions the GPUs an operator marked for it.

The extender chooses, per pod, a profile and a start slot on one GPU and writes it into the pod's assignment as
a device name (protocol.DynamicMigPlacement: "dynmig/<GPU UUID>/<profile>@<start>"). When kubelet calls Allocate
for that pod, `DynamicMig.ensure` creates the GPU instance at exactly that placement and its compute instance, and
Allocate answers with the new MIG device's UUID. Creation is all or nothing: when any step fails, the steps done
are undone (compute instance, GPU instance, MIG mode) before the error is returned, so no half instance is left
and the pod is refused by kubelet (it fails with the reason; a Job's controller makes a new pod, which the
extender places again).

`reconcile` destroys the instances no live pod's assignment names (the pod finished or was deleted) and turns MIG
mode off on a GPU left without instances, so vGPU pods can share it again: a GPU is either MIG or shared, never
both (the extender keeps that rule; the plugin follows the placements). The placements of live pods come from the
API server, the one source of truth, so a restarted plugin destroys nothing a running pod uses.

Ensure and reconcile hold one lock: reconcile reads the pods after any creation in progress finished, and a pod
is bound before kubelet ever calls Allocate for it, so an instance being created is always named by a pod
reconcile sees. An instance younger than `grace_seconds` is never destroyed either (belt and braces against a pod
list read from a lagging cache).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Literal

from kube_vgpu import protocol
from kube_vgpu.deviceplugin import nvml as nvml_errors
from kube_vgpu.deviceplugin.nvml import Nvml
from kube_vgpu.protocol import DynamicMig as DynamicMigInfo
from kube_vgpu.protocol import DynamicMigPlacement, GpuInfo, MigDevice, NodeInventory, mig

log = logging.getLogger(__name__)

#: The compute instance profile that spans a GPU instance of n compute slices (NVML_COMPUTE_INSTANCE_PROFILE_*).
COMPUTE_PROFILE_BY_SLICES = {1: 0, 2: 1, 3: 2, 4: 3, 7: 4}


class DynamicMigError(Exception):
    """Creating a MIG instance failed and was rolled back; the message says what failed and where."""


def parse_profiles(text: str) -> dict[str, tuple[str, ...]]:
    """--dynamic-mig-profiles "A100-40GB=1g.5gb,3g.20gb;H100-80GB=1g.10gb,3g.40gb" -> {model key: profiles}.
    Model keys and profile names are protocol.mig's; "+me" profiles are refused (kube-vgpu does not place them)."""
    allow: dict[str, tuple[str, ...]] = {}
    for part in filter(None, (p.strip() for p in text.split(";"))):
        key, sep, names = part.partition("=")
        model = next((m for m in mig.MIG_MODELS if m.key == key.strip()), None)
        if not sep or model is None:
            raise ValueError(f"{part!r}: expected MODEL=profile,profile with MODEL one of "
                             f"{', '.join(m.key for m in mig.MIG_MODELS)}")
        profiles = tuple(dict.fromkeys(n.strip() for n in names.split(",") if n.strip()))
        for name in profiles:
            if model.profile(name) is None or name.endswith("+me"):
                known = ", ".join(p.name for p in model.profiles if not p.name.endswith("+me"))
                raise ValueError(f"{model.key} has no placeable MIG profile {name!r} (it has {known})")
        if not profiles:
            raise ValueError(f"{part!r}: no profiles")
        allow[model.key] = profiles
    return allow


def parse_gpus(text: str) -> frozenset[int] | None:
    """--dynamic-mig "all" (None: every MIG-capable GPU of an allowlisted model) or GPU indexes "0,1" (the node
    label's "0.1" too)."""
    if text.strip() == "all":
        return None
    try:
        return frozenset(int(part) for part in text.replace(".", ",").split(",") if part.strip())
    except ValueError:
        raise ValueError(f"dynamic MIG GPUs: {text!r} is neither 'all' nor GPU indexes like 0,1") from None


def gpus_from_node_label(node: Mapping[str, Any]) -> frozenset[int] | Literal[False] | None:
    """The dynamic GPUs the node's LABEL_DYNAMIC_MIG names; False when the label is absent (dynamic MIG off)."""
    value = ((node.get("metadata") or {}).get("labels") or {}).get(protocol.LABEL_DYNAMIC_MIG)
    if value is None:
        return False
    return parse_gpus(str(value))


@dataclasses.dataclass(frozen=True, slots=True)
class DynamicMigConfig:
    profiles: Mapping[str, tuple[str, ...]]  # model key -> allowlist
    gpus: frozenset[int] | None = None  # GPU indexes; None = all of an allowlisted model
    grace_seconds: float = 10.0
    #: the GPUs come from the node's LABEL_DYNAMIC_MIG, read at start (`gpus` is then ignored)
    from_node_label: bool = False


def mark_dynamic(inventory: NodeInventory, config: DynamicMigConfig, mig_capable: Iterable[int]) -> NodeInventory:
    """Discovery's inventory with the dynamic GPUs marked: each MIG-capable GPU of an allowlisted model (among
    config.gpus) gets its DynamicMig, and its current MIG devices (left by an earlier run of the plugin) move
    there from mig_devices, so nothing offers them as static MIG devices."""
    capable = set(mig_capable)
    gpus = []
    for gpu in inventory.gpus:
        model = mig.mig_model(gpu.model, gpu.memory_mib)
        if (model is None or model.key not in config.profiles or gpu.index not in capable
                or (config.gpus is not None and gpu.index not in config.gpus)):
            gpus.append(gpu)
            continue
        dynamic = DynamicMigInfo(model.key, config.profiles[model.key], gpu.mig_devices)
        gpus.append(dataclasses.replace(gpu, mig_devices=(), dynamic_mig=dynamic))
    _warn_unused(inventory, config, capable)
    return dataclasses.replace(inventory, gpus=tuple(gpus))


def _warn_unused(inventory: NodeInventory, config: DynamicMigConfig, capable: set[int]) -> None:
    """GPUs named for dynamic MIG (flag or node label) that cannot take it are said in the log, not skipped
    silently: an index the node does not have, a GPU that is not MIG-capable, or a model not in the allowlist."""
    by_index = {gpu.index: gpu for gpu in inventory.gpus}
    for index in sorted(config.gpus or ()):
        gpu = by_index.get(index)
        if gpu is None:
            log.warning("dynamic MIG: this node has no GPU %d (its GPUs: %s)", index, sorted(by_index) or "none")
        elif index not in capable:
            log.warning("dynamic MIG: GPU %d (%s) is not MIG-capable; it stays as it is", index, gpu.model)
        elif (model := mig.mig_model(gpu.model, gpu.memory_mib)) is None or model.key not in config.profiles:
            log.warning("dynamic MIG: GPU %d (%s) is of no model in --dynamic-mig-profiles (%s); it stays as it is",
                        index, gpu.model, ", ".join(config.profiles) or "none")


def live_placements(pods: Iterable[Mapping[str, Any]], node_name: str) -> set[DynamicMigPlacement]:
    """The dynamic MIG placements named by the assignments of this node's pods that may still run: every pod not
    Succeeded or Failed, deleting ones included (their containers may still be stopping)."""
    live: set[DynamicMigPlacement] = set()
    for pod in pods:
        if ((pod.get("status") or {}).get("phase")) in ("Succeeded", "Failed"):
            continue
        annotations = (pod.get("metadata") or {}).get("annotations") or {}
        text = annotations.get(protocol.POD_ASSIGNMENT_ANNOTATION)
        if not text:
            continue
        try:
            assignment = protocol.decode_assignment(text)
        except protocol.ProtocolError:
            continue
        if assignment.node != node_name:
            continue
        for device in assignment.all_devices():
            placement = protocol.parse_dynamic_mig_device(device.uuid)
            if placement is not None:
                live.add(placement)
    return live


class DynamicMig:
    """Creates and destroys MIG instances on the dynamic GPUs through NVML; tells `on_change` the GPU's new
    (MIG mode, instances) after every change, so the published inventory follows."""

    def __init__(self, nvml: Nvml, handles: Mapping[str, Any], gpus: Iterable[GpuInfo],
                 on_change: Callable[[str, bool, tuple[MigDevice, ...]], object], grace_seconds: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.nvml = nvml
        self.handles = dict(handles)  # GPU UUID -> NVML handle
        self.gpus = {gpu.uuid: gpu for gpu in gpus if gpu.dynamic_mig is not None}
        self.on_change = on_change
        self.grace_seconds = grace_seconds
        self.clock = clock
        self._lock = threading.Lock()
        self._created_at: dict[str, float] = {}  # MIG device UUID -> when this process created it

    # -- reading the hardware -----------------------------------------------------------------------------------

    def _instances(self, gpu: GpuInfo) -> tuple[MigDevice, ...]:
        """The MIG devices on a dynamic GPU now, read from NVML (as discovery reads them)."""
        handle = self.handles[gpu.uuid]
        if not self.nvml.mig_enabled(handle):
            return ()
        devices = []
        for index in range(self.nvml.max_mig_devices(handle)):
            try:
                device = self.nvml.mig_device(handle, index)
            except nvml_errors.NotFound:
                continue
            gpu_instance = self.nvml.gpu_instance_id(device)
            _profile_id, start, size = self.nvml.gpu_instance_placement(handle, gpu_instance)
            multiprocessors, gi_slices, _ci_slices, memory_mib = self.nvml.mig_attributes(device)
            devices.append(MigDevice(self.nvml.uuid(device), mig.profile_name(gi_slices, memory_mib, gpu.memory_mib),
                                     gpu_instance, self.nvml.compute_instance_id(device), memory_mib, multiprocessors,
                                     start, size))
        return tuple(sorted(devices, key=lambda d: d.start))

    def _publish(self, gpu: GpuInfo) -> tuple[MigDevice, ...]:
        instances = self._instances(gpu)
        self.on_change(gpu.uuid, self.nvml.mig_enabled(self.handles[gpu.uuid]), instances)
        return instances

    # -- create -------------------------------------------------------------------------------------------------

    def ensure(self, placement: DynamicMigPlacement) -> str:
        """The UUID of the MIG device at `placement`, created now unless it exists already (a retried Allocate, or
        a plugin restarted after creating it); raises DynamicMigError after undoing any partial change."""
        with self._lock:
            gpu = self.gpus.get(placement.gpu_uuid)
            if gpu is None or gpu.dynamic_mig is None:
                raise DynamicMigError(f"GPU {placement.gpu_uuid} is not a dynamic MIG GPU of this node")
            model = next((m for m in mig.MIG_MODELS if m.key == gpu.dynamic_mig.model), None)
            profile = model.profile(placement.profile) if model else None
            if model is None or profile is None or placement.profile not in gpu.dynamic_mig.profiles:
                raise DynamicMigError(f"MIG profile {placement.profile} is not allowed on GPU {gpu.uuid} "
                                      f"(allowed: {', '.join(gpu.dynamic_mig.profiles)})")
            try:
                return self._ensure(gpu, profile, placement)
            finally:
                try:
                    self._publish(gpu)
                except nvml_errors.NVMLError as exc:  # the inventory follows at the next reconcile
                    log.warning("cannot read the MIG devices of GPU %s: %s", gpu.uuid, exc)

    def _ensure(self, gpu: GpuInfo, profile: mig.MigProfile, placement: DynamicMigPlacement) -> str:
        where = f"MIG {profile.name} at slot {placement.start} on GPU {gpu.index} ({gpu.uuid})"
        try:
            existing = self._instances(gpu)
        except nvml_errors.NVMLError as exc:
            raise DynamicMigError(f"cannot read the MIG devices for {where}: {exc}") from None
        for device in existing:
            if device.start == placement.start and device.profile == profile.name:
                return device.uuid  # created by an earlier try; the extender gives a placement to one pod only
        handle = self.handles[gpu.uuid]
        undo: list[tuple[str, Callable[[], Any]]] = []  # most recent last
        try:
            if not self.nvml.mig_enabled(handle):
                if not self.nvml.set_mig_mode(handle, True):
                    undo.append(("MIG mode", lambda: self.nvml.set_mig_mode(handle, False)))
                    raise DynamicMigError(f"{where}: MIG mode is pending a GPU reset")
                undo.append(("MIG mode", lambda: self.nvml.set_mig_mode(handle, False)))
            gpu_instance = self.nvml.create_gpu_instance(handle, profile.profile_id, placement.start,
                                                         profile.memory_slices)
            undo.append(("GPU instance", lambda: self.nvml.destroy_gpu_instance(gpu_instance)))
            compute = self.nvml.create_compute_instance(gpu_instance, COMPUTE_PROFILE_BY_SLICES[profile.compute_slices])
            undo.append(("compute instance", lambda: self.nvml.destroy_compute_instance(compute)))
            gi_id = self.nvml.gpu_instance_id_of(gpu_instance)
            created = next((d for d in self._instances(gpu) if d.gpu_instance == gi_id), None)
            if created is None:
                raise DynamicMigError(f"{where}: created GPU instance {gi_id}, but NVML lists no MIG device for it")
        except (nvml_errors.NVMLError, DynamicMigError) as exc:
            self._undo(undo, where)
            if isinstance(exc, DynamicMigError):
                raise
            raise DynamicMigError(f"{where}: NVML refused: {exc}; rolled back") from None
        self._created_at[created.uuid] = self.clock()
        log.info("dynamic MIG: created %s -> %s", where, created.uuid)
        return created.uuid

    def _undo(self, undo: list[tuple[str, Callable[[], Any]]], where: str) -> None:
        for what, step in reversed(undo):
            try:
                step()
            except nvml_errors.NVMLError as exc:
                # left for reconcile, which destroys whatever no live pod names
                log.error("dynamic MIG: could not undo the %s of %s: %s", what, where, exc)

    # -- destroy ------------------------------------------------------------------------------------------------

    def destroy(self, placement: DynamicMigPlacement) -> bool:
        """Destroy the instance at `placement` now, if there is one (an Allocate whose later device failed undoes
        its earlier ones); True when one was destroyed. Failures are left to reconcile."""
        with self._lock:
            gpu = self.gpus.get(placement.gpu_uuid)
            if gpu is None:
                return False
            handle = self.handles[gpu.uuid]
            try:
                for device in self._instances(gpu):
                    if (device.profile, device.start) != (placement.profile, placement.start):
                        continue
                    gpu_instance = self.nvml.gpu_instance(handle, device.gpu_instance)
                    self.nvml.destroy_compute_instance(self.nvml.compute_instance(gpu_instance,
                                                                                  device.compute_instance))
                    self.nvml.destroy_gpu_instance(gpu_instance)
                    self._created_at.pop(device.uuid, None)
                    if not self._instances(gpu):
                        self.nvml.set_mig_mode(handle, False)
                    self._publish(gpu)
                    return True
            except nvml_errors.NVMLError as exc:
                log.error("dynamic MIG: could not destroy %s: %s", placement.device, exc)
        return False


    def reconcile(self, list_pods: Callable[[], Iterable[Mapping[str, Any]]], node_name: str) -> list[str]:
        """Destroy the instances no live pod names and switch MIG mode off on GPUs left without any; returns the
        destroyed MIG device UUIDs. `list_pods` is called under the lock (see the module's comment)."""
        destroyed: list[str] = []
        with self._lock:
            live = live_placements(list_pods(), node_name)
            now = self.clock()
            for gpu in self.gpus.values():
                handle = self.handles[gpu.uuid]
                try:
                    instances = self._instances(gpu)
                    for device in instances:
                        named = DynamicMigPlacement(gpu.uuid, device.profile, device.start) in live
                        young = now - self._created_at.get(device.uuid, -float("inf")) < self.grace_seconds
                        if named or young:
                            continue
                        gpu_instance = self.nvml.gpu_instance(handle, device.gpu_instance)
                        try:
                            self.nvml.destroy_compute_instance(
                                self.nvml.compute_instance(gpu_instance, device.compute_instance))
                        except nvml_errors.NotFound:
                            pass
                        self.nvml.destroy_gpu_instance(gpu_instance)
                        self._created_at.pop(device.uuid, None)
                        destroyed.append(device.uuid)
                        log.info("dynamic MIG: destroyed %s (%s at slot %d on GPU %s): no live pod uses it",
                                 device.uuid, device.profile, device.start, gpu.uuid)
                    if self.nvml.mig_enabled(handle) and not self._instances(gpu):
                        self.nvml.set_mig_mode(handle, False)
                except nvml_errors.NVMLError as exc:
                    log.error("dynamic MIG: reconcile of GPU %s failed: %s", gpu.uuid, exc)
                try:
                    self._publish(gpu)
                except nvml_errors.NVMLError as exc:
                    log.warning("cannot read the MIG devices of GPU %s: %s", gpu.uuid, exc)
        return destroyed
