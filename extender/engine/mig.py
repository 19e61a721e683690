"""Static MIG placement, pure (no I/O): which free MIG device of a node takes a request for `count` devices of one
profile (NVIDIA's mixed-strategy resources, nvidia.com/mig-<profile>), and a reason a person can act on when none
does.

A MIG device is hardware-isolated and held whole: it takes one container's request or nothing, never a share. Only
the MIG devices the device plugin published for a healthy GPU in MIG mode (protocol.GpuInfo.mig_devices) are
offered. Choice (best fit): devices on the GPU with the fewest free MIG devices first, so GPUs whose instances are
all free stay free as long as possible (an operator can re-partition a GPU only when it is idle); then by GPU index
and start slot, so the same state always gives the same answer (filter and bind must agree).

Not yet wired into filter/bind or the device plugin's Allocate: the webhook refuses MIG requests until it is.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Iterable
from dataclasses import dataclass

from kube_vgpu.extender.engine.model import FitFailure
from kube_vgpu.protocol import GpuSelectors, MigDevice, NodeInventory


@dataclass(frozen=True, slots=True)
class MigSlot:
    """One MIG device of a node, with the GPU it lives on."""

    gpu_uuid: str
    gpu_index: int
    gpu_model: str
    device: MigDevice

    @property
    def uuid(self) -> str:
        return self.device.uuid

    @property
    def profile(self) -> str:
        return self.device.profile


def mig_slots(inventory: NodeInventory) -> tuple[MigSlot, ...]:
    """Every MIG device of the node's healthy GPUs in MIG mode, by GPU index then start slot."""
    slots = [
        MigSlot(gpu.uuid, gpu.index, gpu.model, device)
        for gpu in inventory.gpus
        if gpu.healthy and gpu.mig_mode and not gpu.external_pods
        for device in gpu.mig_devices
    ]
    return tuple(sorted(slots, key=lambda slot: (slot.gpu_index, slot.device.start)))


def _allowed(slot: MigSlot, selectors: GpuSelectors) -> bool:
    """The pod's GPU selectors apply to the GPU a MIG device lives on (model) and to either UUID."""
    if selectors.empty:
        return True
    if not selectors.model_allowed(slot.gpu_model.lower()):
        return False
    if selectors.use_uuids and slot.gpu_uuid not in selectors.use_uuids and slot.uuid not in selectors.use_uuids:
        return False
    return slot.gpu_uuid not in selectors.nouse_uuids and slot.uuid not in selectors.nouse_uuids


def _summary(slots: Iterable[MigSlot]) -> str:
    counts = Counter(slot.profile for slot in slots)
    return ", ".join(f"{profile} x{counts[profile]}" for profile in sorted(counts)) or "none"


def place_mig(
    slots: tuple[MigSlot, ...],
    held: Collection[str],
    profile: str,
    count: int = 1,
    selectors: GpuSelectors | None = None,
) -> tuple[MigSlot, ...] | FitFailure:
    """`count` free MIG devices of `profile` among `slots` (`held`: UUIDs of MIG devices pods hold), or why not.
    Unresolvable when the node has too few such devices at all (waiting for pods to end cannot help)."""
    if count < 1:
        raise ValueError(f"a MIG request takes at least one device, got {count}")
    chosen_selectors = selectors or GpuSelectors()
    eligible = [slot for slot in slots if _allowed(slot, chosen_selectors)]
    matching = [slot for slot in eligible if slot.profile == profile]
    if len(matching) < count:
        return FitFailure(
            f"needs {count} MIG {profile} device{'s' if count > 1 else ''}, node has {len(matching)} "
            f"(its MIG devices: {_summary(eligible)})",
            unresolvable=True,
            code="mig",
        )
    free = [slot for slot in matching if slot.uuid not in held]
    if len(free) < count:
        free_any = [slot for slot in eligible if slot.uuid not in held]
        return FitFailure(
            f"needs {count} free MIG {profile} device{'s' if count > 1 else ''}, {len(free)} free "
            f"(free MIG devices here: {_summary(free_any)})",
            code="mig",
        )
    free_per_gpu = Counter(slot.gpu_uuid for slot in slots if slot.uuid not in held)
    ranked = sorted(free, key=lambda slot: (free_per_gpu[slot.gpu_uuid], slot.gpu_index, slot.device.start))
    return tuple(ranked[:count])
