"""NVIDIA's MIG profile tables: which GPU instance profiles a GPU model offers, their memory and SM counts, and the
memory slots (eighths of the GPU's memory) where each may start. Pure data and arithmetic; shared by the fake NVML
(deviceplugin/fakenvml.py), discovery's profile names, the webhook's admitted profiles and the scheduler config.

Sources: NVIDIA Multi-Instance GPU User Guide, "Supported MIG Profiles" (profiles, instance counts, fractions of
memory and SMs) and the `nvidia-smi mig -lgip` / `-lgipp` output it shows (profile IDs, memory in GiB, SM counts,
placements `{starts}:size`); H200's, read from NVML on a real H200. Memory is what NVML reports for the instance
(`memorySizeMB`, MiB); it differs by a fraction of a percent between driver releases, which no profile name or
placement rule depends on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

#: A MIG-capable GPU's memory is split into 8 slots; a GPU instance takes `memory_slices` consecutive slots.
MIG_MEMORY_SLOTS = 8
#: ... and its compute into 7 slices (the `g` of a profile name).
MIG_COMPUTE_SLICES = 7


@dataclass(frozen=True, slots=True)
class MigProfile:
    name: str  # as in the resource nvidia.com/mig-<name>, e.g. "3g.20gb"
    profile_id: int  # NVML's GPU instance profile ID (the ID column of nvidia-smi mig -lgip)
    compute_slices: int  # the "g": sevenths of the GPU's SMs
    memory_slices: int  # placement size: eighths of the GPU's memory
    memory_mib: int
    multiprocessors: int
    starts: tuple[int, ...]  # legal placement start slots
    max_instances: int  # how many fit on an empty GPU

    def slots(self, start: int) -> range:
        """The memory slots an instance starting at `start` occupies."""
        return range(start, start + self.memory_slices)


@dataclass(frozen=True, slots=True)
class MigModel:
    """One GPU model's MIG profiles. `names` are substrings of NVML's product name that select it, together with
    the total memory (A100 40GB and 80GB share names like "A100-SXM4")."""

    key: str
    names: tuple[str, ...]
    min_memory_mib: int
    max_memory_mib: int
    profiles: tuple[MigProfile, ...]

    def profile(self, name: str) -> MigProfile | None:
        return next((p for p in self.profiles if p.name == name), None)

    def profile_by_id(self, profile_id: int) -> MigProfile | None:
        return next((p for p in self.profiles if p.profile_id == profile_id), None)


# The placements are the same on A100 and H100 (nvidia-smi mig -lgipp): profile ID -> (starts, size).
_ONE_SLICE = (0, 1, 2, 3, 4, 5, 6)  # {0,1,2,3,4,5,6}:1 (slot 7 takes no 1g instance)
_ONE_SLICE_DOUBLE = (0, 2, 4, 6)  # {0,2,4,6}:2
_TWO_SLICE = (0, 2, 4)  # {0,2,4}:2
_THREE_SLICE = (0, 4)  # {0,4}:4
_WHOLE = (0,)


def _profiles(memory_gb: tuple[int, int, int, int], memory_mib: tuple[int, int, int, int],
              sms: tuple[int, int, int, int, int, int]) -> tuple[MigProfile, ...]:
    """The seven profiles of A100/H100: memory_gb/memory_mib per 1g, 1g-double, 3g/4g and 7g sizes (2g shares the
    1g-double size); sms per 1g, 1g-double, 2g, 3g, 4g, 7g."""
    one, double, half, whole = memory_gb
    one_mib, double_mib, half_mib, whole_mib = memory_mib
    sm1, sm1d, sm2, sm3, sm4, sm7 = sms
    return (
        MigProfile(f"1g.{one}gb", 19, 1, 1, one_mib, sm1, _ONE_SLICE, 7),
        MigProfile(f"1g.{one}gb+me", 20, 1, 1, one_mib, sm1, _ONE_SLICE, 1),
        MigProfile(f"1g.{double}gb", 15, 1, 2, double_mib, sm1d, _ONE_SLICE_DOUBLE, 4),
        MigProfile(f"2g.{double}gb", 14, 2, 2, double_mib, sm2, _TWO_SLICE, 3),
        MigProfile(f"3g.{half}gb", 9, 3, 4, half_mib, sm3, _THREE_SLICE, 2),
        MigProfile(f"4g.{half}gb", 5, 4, 4, half_mib, sm4, _WHOLE, 1),
        MigProfile(f"7g.{whole}gb", 0, 7, 8, whole_mib, sm7, _WHOLE, 1),
    )


A100_40GB = MigModel(
    "A100-40GB", ("A100",), 38 * 1024, 48 * 1024,
    _profiles((5, 10, 20, 40), (4864, 9984, 20096, 40448), (14, 14, 28, 42, 56, 98)),
)
A100_80GB = MigModel(
    "A100-80GB", ("A100",), 76 * 1024, 88 * 1024,
    _profiles((10, 20, 40, 80), (9728, 19968, 40192, 80384), (14, 14, 28, 42, 56, 98)),
)
H100_80GB = MigModel(
    "H100-80GB", ("H100",), 76 * 1024, 88 * 1024,
    _profiles((10, 20, 40, 80), (9984, 20096, 40448, 81152), (16, 26, 32, 60, 64, 132)),
)
#: Measured on an NVIDIA H200 (143771 MiB, driver 580.159.04) through NVML: nvmlDeviceGetGpuInstanceProfileInfo and
#: nvmlDeviceGetGpuInstancePossiblePlacements (the placements are H100's).
H200_141GB = MigModel(
    "H200-141GB", ("H200",), 135 * 1024, 150 * 1024,
    _profiles((18, 35, 71, 141), (16384, 33280, 71424, 143360), (16, 26, 32, 60, 64, 132)),
)
MIG_MODELS = (A100_40GB, A100_80GB, H100_80GB, H200_141GB)
#: The MIG profiles kube-vgpu places (nvidia.com/mig-<name>), smallest first (by compute, then memory). "+me"
#: profiles are not among them: NVML reports a media-extension instance like its plain profile, so it is offered
#: under that name. The kube-scheduler configuration names exactly these resources as the extender's
#: (manifests/base/scheduler, checked by a test).
MIG_PROFILE_NAMES: tuple[str, ...] = tuple(sorted(
    {p.name for model in MIG_MODELS for p in model.profiles if not p.name.endswith("+me")},
    key=lambda name: (int(name.split("g.")[0]), int(name.split("g.")[1].removesuffix("gb"))),
))


def mig_model(product_name: str, memory_mib: int) -> MigModel | None:
    """The profile table of a GPU from NVML's product name and total memory; None for a model not tabled here."""
    for model in MIG_MODELS:
        if any(name in product_name for name in model.names) and (
            model.min_memory_mib <= memory_mib <= model.max_memory_mib
        ):
            return model
    return None


def profile_name(compute_slices: int, instance_memory_mib: int, gpu_memory_mib: int) -> str:
    """A MIG device's profile name from what NVML says about it, as NVIDIA's device plugin names its resources
    (go-nvlib): the instance's share of the GPU's memory rounded up to eighths, times the GPU's memory in whole GB
    rounded up. "+me" profiles (media extensions) are not told apart by this: NVML reports them alike."""
    if compute_slices <= 0 or instance_memory_mib <= 0 or gpu_memory_mib <= 0:
        raise ValueError("compute slices and memory must be positive")
    eighths = math.ceil(instance_memory_mib / gpu_memory_mib * MIG_MEMORY_SLOTS - 1e-9)
    gpu_gb = math.ceil(gpu_memory_mib / 1024)
    # halves round up, as Go's math.Round (H200's 3g.71gb is 70.5 GB; Python's round() would say 70)
    return f"{compute_slices}g.{math.floor(eighths * gpu_gb / MIG_MEMORY_SLOTS + 0.5)}gb"


def legal_layout(model: MigModel, instances: list[tuple[str, int]]) -> str | None:
    """Why a set of GPU instances (profile name, start slot) cannot coexist on one GPU of `model`, or None when it
    can: each profile must exist, start on one of its legal slots, appear at most max_instances times (one +me
    instance: the GPU has one set of media engines), and no two instances may share a memory slot."""
    used: dict[int, str] = {}
    counts: dict[str, int] = {}
    for name, start in instances:
        profile = model.profile(name)
        if profile is None:
            known = ", ".join(p.name for p in model.profiles)
            return f"{model.key} has no MIG profile {name!r} (it has {known})"
        counts[name] = counts.get(name, 0) + 1
        if counts[name] > profile.max_instances:
            return f"{model.key} takes at most {profile.max_instances} MIG {name} instance(s)"
        if start not in profile.starts:
            return f"MIG profile {name} cannot start at slot {start} on {model.key} (legal starts: {profile.starts})"
        for slot in profile.slots(start):
            if slot in used:
                return f"MIG profile {name} at slot {start} overlaps {used[slot]} (slot {slot})"
            used[slot] = f"{name}@{start}"
    return None
