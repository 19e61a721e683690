"""Dynamic MIG placement, pure (no I/O): where on a node's dynamic MIG GPUs a new instance of a profile goes.

A dynamic GPU (NodeState.gpus[i].dynamic_mig) is partitioned per pod: the device plugin creates the instance the
extender chose when kubelet admits the pod, and destroys it when the pod is gone. Every legal placement of every
allowed profile is a virtual MIG device of the node (NodeState.dynamic_mig_devices); a pod holding one reserves its
slots from bind on (the cluster state counts it from the assignment, as any device), so two binds never choose
overlapping slots, and an extender restart rebuilds the reservations from the assignments.

A GPU's occupied slots: its existing instances (inventory; an instance whose pod is gone keeps its slots until the
plugin destroyed it) and the placements held by pods or by this pod's earlier containers (scratch). A GPU shared by
vGPU pods takes no instance, and a GPU with an instance held takes no vGPU (model.apply_usage marks it held).

The choice among GPUs and starts is mig_layout's `frag` policy: the placement adding the least MIG fragmentation,
weighing the node's allowed profiles alike (the live extender learns no profile mix: filter and bind must give
the same answer for the same state, and a mix learned from the asks would change between them).
"""

from __future__ import annotations

from functools import cache

from kube_vgpu.extender.engine.mig_layout import FragAware, ProfileMix
from kube_vgpu.extender.engine.model import DynamicGpu, FitFailure, GpuState, NodeState
from kube_vgpu.extender.engine.policies.base import Scratch
from kube_vgpu.protocol import ContainerGpuRequest, GpuSelectors
from kube_vgpu.protocol.mig import MIG_MEMORY_SLOTS, MigModel, MigProfile


@cache
def _policy(model: MigModel, profiles: tuple[str, ...]) -> FragAware:
    """One frag policy per (model, allowlist); it never observes, so its answers depend on the masks alone."""
    return FragAware(ProfileMix(model, profiles))


def smallest_profile(dynamic: DynamicGpu, memory_mib: int) -> MigProfile | None:
    """vgpu-mode: mig: the allowed profile with at least `memory_mib` and the least memory (then compute)."""
    fitting = [p for p in dynamic.profiles if p.memory_mib >= memory_mib]
    return min(fitting, key=lambda p: (p.memory_mib, p.compute_slices)) if fitting else None


def profile_for_memory(node: NodeState, memory_mib: int) -> str | FitFailure:
    """vgpu-mode: mig: the profile a container asking `memory_mib` gets on this node: the smallest fitting one of
    the first dynamic GPU model (in GPU order) that allows one. Profile names differ by model, so the node, not
    the pod, names it."""
    allowed: list[str] = []
    for gpu in node.gpus:
        if gpu.dynamic_mig is None:
            continue
        profile = smallest_profile(gpu.dynamic_mig, memory_mib)
        if profile is not None:
            return profile.name
        allowed += [f"{p.name} ({p.memory_mib} MiB)" for p in gpu.dynamic_mig.profiles if p.name not in allowed]
    if not allowed:
        return FitFailure("vgpu-mode mig: no dynamic MIG GPU on this node", unresolvable=True, code="mig")
    return FitFailure(f"vgpu-mode mig: no allowed MIG profile has {memory_mib} MiB (allowed here: "
                      f"{', '.join(dict.fromkeys(allowed))})", unresolvable=True, code="mig")


def has_dynamic_mig(node: NodeState) -> bool:
    return any(gpu.dynamic_mig is not None for gpu in node.gpus)


def _held(device: GpuState, scratch: Scratch) -> bool:
    return device.used_vgpus > 0 or device.exclusive_holders > 0 or bool(scratch.vgpus[device.position])


def occupied_masks(node: NodeState, scratch: Scratch) -> dict[int, int]:
    """GPU position -> occupied slot mask, for every dynamic GPU."""
    masks = {gpu.position: gpu.dynamic_mig.instance_mask for gpu in node.gpus if gpu.dynamic_mig is not None}
    for device in node.dynamic_mig_devices:
        if _held(device, scratch):
            assert device.mig_parent is not None
            masks[device.mig_parent] |= device.mig_mask
    return masks


def _why_not(node: NodeState, gpu: GpuState, scratch: Scratch, selectors: GpuSelectors) -> str | None:
    """Why a dynamic GPU takes no MIG instance at all now; None when it may."""
    if not gpu.healthy:
        return "unhealthy"
    if gpu.uuid in node.inventory_external:
        return "held by pods outside kube-vgpu"
    if gpu.used_vgpus or scratch.vgpus[gpu.position]:
        return "shared by vGPU pods"
    if not selectors.empty and not (selectors.model_allowed(gpu.model_lower) and selectors.uuid_allowed(gpu.uuid)):
        return "excluded by the pod's GPU selectors"
    return None


def _slots(mask: int) -> str:
    free = [slot for slot in range(MIG_MEMORY_SLOTS) if not mask >> slot & 1]
    return ",".join(map(str, free)) if free else "none"


def choose_dynamic_mig(
    node: NodeState, container: ContainerGpuRequest, selectors: GpuSelectors, scratch: Scratch
) -> list[GpuState] | FitFailure:
    """`container.count` placements of `container.mig_profile` on the node's dynamic GPUs, one at a time (each
    counted before the next is chosen), or why not: the profile and each dynamic GPU's free slots."""
    profile_name, count = container.mig_profile, container.count
    assert profile_name is not None
    masks = occupied_masks(node, scratch)
    notes: list[str] = []
    candidates: list[GpuState] = []
    for gpu in node.gpus:
        dynamic = gpu.dynamic_mig
        if dynamic is None:
            continue
        where = f"GPU {gpu.index} ({dynamic.model.key})"
        if not any(p.name == profile_name for p in dynamic.profiles):
            allowed = ", ".join(p.name for p in dynamic.profiles)
            notes.append(f"{where}: {profile_name} not allowed (allowed: {allowed})")
            continue
        why = _why_not(node, gpu, scratch, selectors)
        if why is not None:
            notes.append(f"{where}: {why}")
            continue
        candidates.append(gpu)
    # the frag policy compares GPUs of one model; on a node of mixed models, the models in GPU order
    groups: dict[str, list[GpuState]] = {}
    for gpu in candidates:
        assert gpu.dynamic_mig is not None
        groups.setdefault(gpu.dynamic_mig.model.key, []).append(gpu)
    chosen: list[GpuState] = []
    taken: dict[int, int] = {}  # slots this container's own earlier choices take
    for _ in range(count):
        best: tuple[GpuState, int] | None = None
        for group in groups.values():
            dynamic = group[0].dynamic_mig
            assert dynamic is not None
            profile = dynamic.model.profile(profile_name)
            assert profile is not None
            policy = _policy(dynamic.model, tuple(p.name for p in dynamic.profiles))
            choice = policy.choose(profile, [masks[g.position] | taken.get(g.position, 0) for g in group])
            if choice is not None:
                best = (group[choice.gpu], choice.start)
                break
        if best is None:
            break
        gpu, start = best
        device = next(d for d in node.dynamic_mig_devices
                      if d.mig_parent == gpu.position and d.mig_profile == profile_name and d.mig_start == start)
        chosen.append(device)
        taken[gpu.position] = taken.get(gpu.position, 0) | device.mig_mask
    if len(chosen) == count:
        return chosen
    allowed_anywhere = any(
        gpu.dynamic_mig is not None and any(p.name == profile_name for p in gpu.dynamic_mig.profiles)
        for gpu in node.gpus)
    free = "; ".join(f"GPU {gpu.index}: {_slots(masks[gpu.position] | taken.get(gpu.position, 0))}"
                     for gpu in candidates) or "no dynamic MIG GPU can take one"
    plural = "instance" if count == 1 else "instances"
    reason = (f"needs {count} MIG {profile_name} {plural}; no free legal placement for {profile_name} on the dynamic "
              f"MIG GPUs (free memory slots: {free}")
    reason += f"; {'; '.join(notes)})" if notes else ")"
    return FitFailure(reason, unresolvable=not allowed_anywhere, code="mig")
