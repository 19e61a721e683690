"""Dynamic MIG placement (extender/engine/dynmig.py): the extender chooses (GPU, profile, start) on GPUs the device
plugin partitions per pod, with mig_layout's frag policy, reserving the slots at bind, never mixing MIG and vGPU
use on one GPU, and saying which profile and which free slots when a pod cannot fit."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kube_vgpu import protocol
from kube_vgpu.dev.fixtures import node_object
from kube_vgpu.deviceplugin.discovery import discover
from kube_vgpu.deviceplugin.dynmig import DynamicMigConfig, mark_dynamic
from kube_vgpu.deviceplugin.fakenvml import FakeNvml, load_profile
from kube_vgpu.deviceplugin.nvml import Nvml
from kube_vgpu.extender.engine.fit import place
from kube_vgpu.extender.engine.model import (
    FitFailure,
    NodeState,
    Placement,
    PlacementRequest,
    assignment_from_placement,
)
from kube_vgpu.extender.engine.policies import make_policy
from kube_vgpu.extender.quota.mig import mig_profiles_by_uuid
from kube_vgpu.extender.quota.usage import assignment_usage, gpu_memory_by_uuid, request_usage_on
from kube_vgpu.extender.scheduler import Scheduler
from kube_vgpu.extender.sources.snapshot import SnapshotCluster
from kube_vgpu.extender.state import ClusterState
from kube_vgpu.protocol import DynamicMigPlacement, MigDevice, NodeInventory, mig
from tests.engine.test_mig_placement import mig_pod
from tests.helpers import pod

BFGD = make_policy("bfgd")
ALLOW = {"H100-80GB": ("1g.10gb", "1g.20gb", "3g.40gb", "7g.80gb")}


def dynamic_inventory(gpus: frozenset[int] | None = None) -> NodeInventory:
    """Two H100 80GB, MIG mode off; dynamic MIG on `gpus` (default: both)."""
    inventory = discover(Nvml(FakeNvml(load_profile("h100-mig-capable", "node-d")))).inventory
    return mark_dynamic(inventory, DynamicMigConfig(ALLOW, gpus), [0, 1])


def with_instances(inventory: NodeInventory, gpu: int, instances: list[tuple[str, int]]) -> NodeInventory:
    """The inventory after the plugin created `instances` (profile, start) on GPU `gpu`."""
    devices = []
    for number, (name, start) in enumerate(instances):
        profile = mig.H100_80GB.profile(name)
        assert profile is not None
        devices.append(MigDevice(f"MIG-{gpu}-{number}", name, number + 1, 0, profile.memory_mib,
                                 profile.multiprocessors, start, profile.memory_slices))
    gpus = list(inventory.gpus)
    dynamic = gpus[gpu].dynamic_mig
    assert dynamic is not None
    gpus[gpu] = dataclasses.replace(gpus[gpu], mig_mode=True,
                                    dynamic_mig=dataclasses.replace(dynamic, instances=tuple(devices)))
    return dataclasses.replace(inventory, gpus=tuple(gpus))


def placements(result: Placement | FitFailure, node: NodeState) -> list[tuple[int, str, int]]:
    assert isinstance(result, Placement), result
    found = []
    for container in result.containers:
        for position, _memory, _cores in container.devices:
            device = node.devices[position]
            parsed = protocol.parse_dynamic_mig_device(device.uuid)
            assert parsed is not None
            found.append((device.index, parsed.profile, parsed.start))
    return found


def _place(node: NodeState, obj: dict[str, Any]) -> Placement | FitFailure:
    return place(node, PlacementRequest(protocol.parse_pod_gpu_request(obj)), BFGD, BFGD)


def test_each_legal_placement_of_each_allowed_profile_is_a_virtual_device() -> None:
    node = NodeState("n", dynamic_inventory())
    per_gpu = sum(len(p.starts) for name in ALLOW["H100-80GB"] if (p := mig.H100_80GB.profile(name)))
    assert len(node.dynamic_mig_devices) == 2 * per_gpu and node.mig_devices == []
    for device in node.dynamic_mig_devices:
        parsed = protocol.parse_dynamic_mig_device(device.uuid)
        assert parsed is not None and parsed.gpu_uuid == node.gpus[device.mig_parent or 0].uuid
        profile = mig.H100_80GB.profile(parsed.profile)
        assert profile is not None and parsed.start in profile.starts  # legal placements only


ASKS = [  # (instances already on GPU 0, asked resource, count, expected (gpu index, profile, start) per instance)
    # at 4, not 0: 3g at 0 would leave slots 4-7, whose slot 7 no 1g.10gb can use (frag); empty GPUs alike: the first
    ([], "mig-3g.40gb", 1, [(0, "3g.40gb", 4)]),
    ([("3g.40gb", 4)], "mig-3g.40gb", 1, [(0, "3g.40gb", 0)]),  # fill the partly used GPU first
    ([("3g.40gb", 4)], "mig-1g.10gb", 2, [(0, "1g.10gb", 0), (0, "1g.10gb", 1)]),  # slots 2-3 stay a 1g.20gb
    # slot 0, not 6: a 1g at 6 would leave slot 7 to no profile (1g.10gb cannot start there)
    ([("7g.80gb", 0)], "mig-1g.10gb", 1, [(1, "1g.10gb", 0)]),
    ([], "mig-7g.80gb", 2, [(0, "7g.80gb", 0), (1, "7g.80gb", 0)]),
]


@pytest.mark.parametrize(("existing", "resource", "count", "expected"), ASKS)
def test_the_frag_policy_chooses_legal_slots(existing: list[tuple[str, int]], resource: str, count: int,
                                              expected: list[tuple[int, str, int]]) -> None:
    inventory = dynamic_inventory()
    if existing:
        inventory = with_instances(inventory, 0, existing)
    node = NodeState("n", inventory)
    result = _place(node, mig_pod(("main", resource, count)))
    assert placements(result, node) == expected


def test_an_unfittable_profile_names_the_profile_and_the_free_slots() -> None:
    node = NodeState("n", with_instances(dynamic_inventory(frozenset({0})), 0, [("3g.40gb", 4), ("1g.10gb", 0)]))
    result = _place(node, mig_pod(("main", "mig-7g.80gb", 1)))
    assert isinstance(result, FitFailure) and not result.unresolvable
    assert result.reason == ("container main: needs 1 MIG 7g.80gb instance; no free legal placement for 7g.80gb on "
                             "the dynamic MIG GPUs (free memory slots: GPU 0: 1,2,3)")
    not_allowed = _place(node, mig_pod(("main", "mig-2g.20gb", 1)))
    assert isinstance(not_allowed, FitFailure) and not_allowed.unresolvable
    assert "2g.20gb not allowed (allowed: 1g.10gb, 1g.20gb, 3g.40gb, 7g.80gb)" in not_allowed.reason


def test_a_gpu_is_either_mig_or_shared() -> None:
    state = ClusterState()
    cluster = SnapshotCluster(state, [node_object("dyn", dynamic_inventory())])
    scheduler = Scheduler(state, cluster)

    def submit(obj: dict[str, Any], name: str) -> bool:
        obj["metadata"].update(name=name, uid=f"uid-{name}")
        cluster.add_pod(obj)
        if not scheduler.filter(obj, ["dyn"]).passed:
            return False
        scheduler.bind("default", name, f"uid-{name}", "dyn")
        return True

    assert submit(pod(gpus=1, memory_mib=1000), "share")  # GPU 0 or 1 becomes a shared GPU
    shared = next(g.index for g in state.nodes["dyn"].gpus if g.used_vgpus)
    assert submit(mig_pod(("main", "mig-1g.10gb", 1)), "slice")
    [device] = protocol.decode_assignment(
        cluster.pods[("default", "slice")]["metadata"]["annotations"][protocol.POD_ASSIGNMENT_ANNOTATION]
    ).all_devices()
    placement = protocol.parse_dynamic_mig_device(device.uuid)
    assert placement is not None and placement.gpu_uuid != state.nodes["dyn"].gpus[shared].uuid
    # both GPUs are taken, one each way: a whole-GPU vGPU and a 7g instance fit nowhere now
    assert not submit(pod(gpus=1, cores=100), "whole")
    assert not submit(mig_pod(("main", "mig-7g.80gb", 1)), "big")
    failed = scheduler.filter(cluster.pods[("default", "big")], ["dyn"]).failed["dyn"]
    assert f"GPU {shared} (H100-80GB): shared by vGPU pods" in failed


def test_bind_reserves_the_slots_and_a_restart_rebuilds_them() -> None:
    inventory = dynamic_inventory(frozenset({0}))
    state = ClusterState()
    cluster = SnapshotCluster(state, [node_object("dyn", inventory)])
    scheduler = Scheduler(state, cluster)
    names = []
    for number in range(3):  # 3g.40gb x2 fill the GPU; the third waits
        obj = mig_pod(("main", "mig-3g.40gb", 1))
        obj["metadata"].update(name=f"p{number}", uid=f"uid-p{number}")
        cluster.add_pod(obj)
        if scheduler.filter(obj, ["dyn"]).passed:
            scheduler.bind("default", f"p{number}", f"uid-p{number}", "dyn")
            names.append(f"p{number}")
    assert names == ["p0", "p1"]
    starts = sorted(protocol.parse_dynamic_mig_device(d.uuid).start  # type: ignore[union-attr]
                    for name in names for d in protocol.decode_assignment(
                        cluster.pods[("default", name)]["metadata"]["annotations"][
                            protocol.POD_ASSIGNMENT_ANNOTATION]).all_devices())
    assert starts == [0, 4]
    failed = scheduler.filter(cluster.pods[("default", "p2")], ["dyn"]).failed["dyn"]
    assert "needs 1 MIG 3g.40gb instance" in failed and "free memory slots: GPU 0: none" in failed
    restarted = ClusterState()
    SnapshotCluster(restarted, [node_object("dyn", inventory), *cluster.pods.values()])
    held = sorted(d.mig_start for d in restarted.nodes["dyn"].dynamic_mig_devices if d.used_vgpus)
    assert held == [0, 4]


@settings(max_examples=60, deadline=None)
@given(ops=st.lists(st.one_of(
    st.tuples(st.just("mig"), st.sampled_from(list(ALLOW["H100-80GB"])), st.integers(1, 2)),
    st.tuples(st.just("share"), st.just(""), st.integers(1, 3)),
    st.tuples(st.just("release"), st.just(""), st.integers(0, 30)),
), max_size=25))
def test_filter_bind_and_release_keep_every_gpu_legal(ops: list[tuple[str, str, int]]) -> None:
    """Property, through filter, bind and pod deletion: the placements live pods' assignments name form a legal
    layout on each GPU (NVIDIA's tables), each of the profile its container asked for, and no GPU holds both a
    MIG instance and a vGPU."""
    inventory = dynamic_inventory()
    state = ClusterState()
    cluster = SnapshotCluster(state, [node_object("dyn", inventory)])
    scheduler = Scheduler(state, cluster)
    bound: list[dict[str, Any]] = []
    for number, (op, profile, amount) in enumerate(ops):
        if op == "release":
            if bound:
                gone = bound.pop(amount % len(bound))
                cluster.delete_pod(gone["metadata"]["namespace"], gone["metadata"]["name"])
            continue
        obj = mig_pod(("main", f"mig-{profile}", amount)) if op == "mig" else pod(gpus=1, memory_mib=1000 * amount)
        obj["metadata"].update(name=f"p{number}", uid=f"uid-p{number}")
        cluster.add_pod(obj)
        if scheduler.filter(obj, ["dyn"]).passed:
            scheduler.bind("default", f"p{number}", f"uid-p{number}", "dyn")
            bound.append(obj)
        layouts: dict[str, list[tuple[str, int]]] = {}
        shared: set[str] = set()
        for stored in cluster.pods.values():
            text = stored["metadata"].get("annotations", {}).get(protocol.POD_ASSIGNMENT_ANNOTATION)
            if not text:
                continue
            asked = protocol.parse_pod_gpu_request(stored).containers[0]
            for device in protocol.decode_assignment(text).all_devices():
                placement = protocol.parse_dynamic_mig_device(device.uuid)
                if placement is None:
                    shared.add(device.uuid)
                else:
                    assert placement.profile == asked.mig_profile
                    layouts.setdefault(placement.gpu_uuid, []).append((placement.profile, placement.start))
        assert not shared & set(layouts)
        for layout in layouts.values():
            assert mig.legal_layout(mig.H100_80GB, layout) is None


@pytest.mark.parametrize(("gpumem", "expected"), [
    ("9000", [(0, "1g.10gb", 0)]),  # the smallest allowed profile with the memory
    ("12000", [(0, "1g.20gb", 6)]),  # at 6: slot 7 takes no smaller profile
    ("30000", [(0, "3g.40gb", 4)]),
    ("90000", "vgpu-mode mig: no allowed MIG profile has 90000 MiB (allowed here: 1g.10gb (9984 MiB), 1g.20gb "
              "(20096 MiB), 3g.40gb (40448 MiB), 7g.80gb (81152 MiB))"),
])  # fmt: skip
def test_vgpu_mode_mig_gets_the_smallest_allowed_profile_with_its_memory(gpumem: str, expected: Any) -> None:
    node = NodeState("n", dynamic_inventory())
    obj = pod(gpus=1, memory_mib=int(gpumem), annotations={protocol.ANNOTATION_VGPU_MODE: "mig"})
    result = _place(node, obj)
    if isinstance(expected, str):
        assert isinstance(result, FitFailure) and result.unresolvable and result.reason.endswith(expected)
    else:
        assert placements(result, node) == expected


def test_placement_device_names_round_trip() -> None:
    placement = DynamicMigPlacement("GPU-1234", "3g.40gb", 4)
    assert protocol.parse_dynamic_mig_device(placement.device) == placement
    assert protocol.parse_dynamic_mig_device("GPU-1234") is None
    assert protocol.parse_dynamic_mig_device("dynmig/GPU-1/3g.40gb@9") is None


@pytest.mark.parametrize(("obj", "profile"), [
    (mig_pod(("main", "mig-3g.40gb", 1)), "3g.40gb"),
    (pod(gpus=1, memory_mib=12000, annotations={protocol.ANNOTATION_VGPU_MODE: "mig"}), "1g.20gb"),
])  # fmt: skip
def test_quota_charges_a_dynamic_instance_its_mig_resource_and_memory_before_and_after_bind(
    obj: dict[str, Any], profile: str
) -> None:
    """The quota gate's charge checked at filter (the request on the node) equals what the written assignment
    counts once bound: the instance's nvidia.com/mig-<profile> and its memory, no vGPU and no cores, whether the
    pod named the profile or HAMi's vgpu-mode: mig let the node pick it."""
    node = NodeState("n", dynamic_inventory())
    result = _place(node, obj)
    assert isinstance(result, Placement)
    assignment = assignment_from_placement(node, result)
    before = request_usage_on(protocol.parse_pod_gpu_request(obj), node)
    after = assignment_usage(assignment, gpu_memory_by_uuid(node), mig_profiles_by_uuid(node))
    memory_mib = mig.H100_80GB.profile(profile).memory_mib  # type: ignore[union-attr]
    expected = {f"nvidia.com/mig-{profile}": 1, "nvidia.com/gpumem": memory_mib, "nvidia.com/total-gpumem": memory_mib}
    assert {r: v for r, v in before.items() if v} == expected
    assert {r: v for r, v in after.items() if v} == expected
