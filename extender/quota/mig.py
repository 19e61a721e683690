"""Static MIG devices as Kueue resources of their own (issue 16): what the quota gate charges a MIG device.

A pod asking `nvidia.com/mig-<profile>: N` is charged, in the resources its ClusterQueue covers:

* N of `nvidia.com/mig-<profile>`: the request as written, as Kueue itself counts it (Kueue knows no MIG: a MIG
  resource is an extended resource like any other to it);
* the devices' memory as `nvidia.com/gpumem` and `nvidia.com/total-gpumem` (MiB), the one budget a queue can spend
  on vGPU shares and MIG devices alike (as a Kueue ResourceTransformation with strategy Retain would add it);
* no `nvidia.com/gpu` and no `nvidia.com/gpucores` / `total-gpucores`: the pod does not request them, so Kueue
  would not charge them, and a queue budgeting whole GPUs in nvidia.com/gpu beside MIG profiles keeps the two
  budgets apart (a 1g.5gb device is not a GPU; charging it one would let seven MIG pods exhaust a GPU budget).

Pure: profile names and memory from the node's published MIG devices or protocol/mig.py's tables.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from kube_vgpu import protocol
from kube_vgpu.protocol import mig as mig_tables

if TYPE_CHECKING:  # read only: objects.py imports this module and stays free of the engine
    from kube_vgpu.extender.engine.model import NodeState

#: the unit a MIG resource is counted in (reports, refusals)
MIG_UNIT = "MIG devices"
#: NVML's MIG device UUIDs start with this (what tells a MIG device in an assignment whose node is not known)
MIG_UUID_PREFIX = "MIG-"


def mig_resource(profile: str) -> str:
    """The Kueue resource of a MIG profile: "3g.20gb" -> "nvidia.com/mig-3g.20gb"."""
    return protocol.MIG_RESOURCE_PREFIX + profile


def is_mig_resource(resource: str) -> bool:
    return resource.startswith(protocol.MIG_RESOURCE_PREFIX)


def uncountable_reason(resource: str) -> str | None:
    """Why the gate can never charge this MIG resource a ClusterQueue names (None: it can, or it is no MIG
    resource). The gate places only protocol/mig.py's profiles, and a media-extension device under its plain
    profile, so quota on any other name would never be used: said rather than silently ignored."""
    if not is_mig_resource(resource):
        return None
    profile = resource[len(protocol.MIG_RESOURCE_PREFIX):]
    if profile in mig_tables.MIG_PROFILE_NAMES:
        return None
    if profile.removesuffix("+me") in mig_tables.MIG_PROFILE_NAMES:
        return (f"media-extension devices are offered and charged as {mig_resource(profile.removesuffix('+me'))} "
                "(NVML reports them like their plain profile)")
    return (f"kube-vgpu places no MIG profile {profile!r} (it places {', '.join(mig_tables.MIG_PROFILE_NAMES)} of "
            "A100 40GB/80GB, H100 80GB and H200 141GB), so no pod is ever charged it")


def mig_profiles_by_uuid(node: NodeState | None) -> dict[str, str] | None:
    """A node's MIG device UUID -> profile, what assignment_usage needs to name a device's resource; None for a
    node not known (assignment_usage then tells MIG devices by their UUID and charges their memory only)."""
    if node is None:
        return None
    return {device.uuid: device.mig_profile for device in node.mig_devices if device.mig_profile is not None}


def profile_memory_mib(profile: str, node: NodeState) -> int:
    """The MiB one `profile` device will hold on `node`: the largest such device the node publishes (what its
    assignment will then hold, read from NVML); failing that, the profile table of the node's GPU models; failing
    that, the largest in any table (an upper bound: what is then counted never exceeds what was checked)."""
    published = [d.memory_mib for d in (*node.mig_devices, *node.dynamic_mig_devices) if d.mig_profile == profile]
    if published:
        return max(published)
    tabled = [p.memory_mib for gpu in node.gpus
              if (model := mig_tables.mig_model(gpu.model, gpu.memory_mib)) is not None
              and (p := model.profile(profile)) is not None]
    return max(tabled) if tabled else max_table_memory_mib(profile)


def max_table_memory_mib(profile: str) -> int:
    """The largest MiB any tabled GPU model gives `profile` (0 for a profile in no table)."""
    return max((p.memory_mib for model in mig_tables.MIG_MODELS if (p := model.profile(profile)) is not None),
               default=0)


def resource_unit(resource: str, units: Mapping[str, str]) -> str:
    """The unit a resource is counted in: `units` (objects.RESOURCE_UNITS), or MIG devices."""
    return units.get(resource) or (MIG_UNIT if is_mig_resource(resource) else "")
