"""Static MIG placement, pure (no I/O): which free MIG devices of a node take a container's request for `count`
devices of one profile (NVIDIA's mixed-strategy resources, nvidia.com/mig-<profile>), and a reason a person can act
on when none do.

A MIG device (NodeState.mig_devices, from the MIG devices the device plugin published for a GPU in MIG mode) is
hardware-isolated and held whole: by one container or by none, never shared. Choice (best fit): devices on the GPU
with the fewest free MIG devices first, so GPUs whose instances are all free stay free as long as possible (an
operator can re-partition a GPU only when it is idle); then by GPU index and start slot, so the same state always
gives the same answer (filter and bind must agree).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from kube_vgpu.extender.engine.model import FitFailure, GpuState, NodeState
from kube_vgpu.extender.engine.policies.base import Scratch
from kube_vgpu.protocol import ContainerGpuRequest, GpuSelectors


def _allowed(node: NodeState, device: GpuState, selectors: GpuSelectors) -> bool:
    """The pod's GPU selectors apply to the GPU a MIG device lives on (model, UUID) or to the device's own UUID."""
    if selectors.empty:
        return True
    if not selectors.model_allowed(device.model_lower):
        return False
    assert device.mig_parent is not None
    gpu_uuid = node.gpus[device.mig_parent].uuid
    if selectors.use_uuids and gpu_uuid not in selectors.use_uuids and device.uuid not in selectors.use_uuids:
        return False
    return gpu_uuid not in selectors.nouse_uuids and device.uuid not in selectors.nouse_uuids


def _usable(node: NodeState, device: GpuState) -> bool:
    """Healthy, and its GPU is not held by pods that reached it without kube-vgpu (the device plugin reports them)."""
    assert device.mig_parent is not None
    return device.healthy and node.gpus[device.mig_parent].uuid not in node.inventory_external


def _free(node: NodeState, device: GpuState, scratch: Scratch) -> bool:
    """Usable and held by no pod (exclusive_holders: kube-vgpu's pods and outside ones alike)."""
    return (_usable(node, device) and not device.exclusive_holders and device.used_vgpus == 0
            and not scratch.vgpus[device.position])


def _summary(devices: Iterable[GpuState]) -> str:
    counts = Counter(device.mig_profile for device in devices)
    return ", ".join(f"{profile} x{counts[profile]}" for profile in sorted(p for p in counts if p)) or "none"


def choose_mig_devices(
    node: NodeState, container: ContainerGpuRequest, selectors: GpuSelectors, scratch: Scratch
) -> list[GpuState] | FitFailure:
    """`container.count` free MIG devices of `container.mig_profile` on `node` (beside `scratch`, the pod's own
    containers running at the same moment), or why not. Unresolvable when the node has too few devices of the
    profile at all: waiting for pods to end cannot help."""
    profile, count = container.mig_profile, container.count
    plural = "device" if count == 1 else "devices"
    eligible = [device for device in node.mig_devices if _allowed(node, device, selectors)]
    matching = [device for device in eligible if device.mig_profile == profile]
    if len(matching) < count:
        return FitFailure(f"needs {count} MIG {profile} {plural}, node has {len(matching)} (its MIG devices: "
                          f"{_summary(eligible)})", unresolvable=True, code="mig")
    usable = [device for device in matching if _usable(node, device)]
    if len(usable) < count:
        return FitFailure(f"needs {count} MIG {profile} {plural}, {len(matching) - len(usable)} of {len(matching)} "
                          "unhealthy or held by pods outside kube-vgpu", code="mig")
    free = [device for device in usable if _free(node, device, scratch)]
    if len(free) < count:
        return FitFailure(f"needs {count} free MIG {profile} {plural}, {len(free)} free (free MIG devices here: "
                          f"{_summary(d for d in eligible if _free(node, d, scratch))})", code="mig")
    free_per_gpu = Counter(device.mig_parent for device in node.mig_devices if _free(node, device, scratch))
    free.sort(key=lambda device: (free_per_gpu[device.mig_parent], device.index, device.position))
    return free[:count]
