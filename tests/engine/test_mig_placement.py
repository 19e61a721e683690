"""Static MIG placement (extender/engine/mig.py) on inventories the device plugin's discovery publishes from the fake
NVML's MIG layouts, and the vGPU engine's rule that a GPU in MIG mode never takes a shared vGPU."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kube_vgpu import protocol
from kube_vgpu.dev.fixtures import node_object
from kube_vgpu.deviceplugin.discovery import discover
from kube_vgpu.deviceplugin.fakenvml import FakeHardware, FakeNvml, layout_hardware, load_profile
from kube_vgpu.deviceplugin.nvml import Nvml
from kube_vgpu.extender.engine.fit import place
from kube_vgpu.extender.engine.model import (
    FitFailure,
    NodeState,
    Placement,
    PlacementRequest,
    assignment_from_placement,
)
from kube_vgpu.extender.engine.policies import make_policy, policy_names
from kube_vgpu.extender.quota.mig import mig_profiles_by_uuid
from kube_vgpu.extender.quota.usage import (
    TOTAL_GPU_CORES,
    TOTAL_GPU_MEMORY,
    assignment_usage,
    named_gpu_resources,
    request_usage_on,
)
from kube_vgpu.extender.scheduler import BindError, Scheduler
from kube_vgpu.extender.sources.snapshot import SnapshotCluster
from kube_vgpu.extender.state import ClusterState, usage_from_assignment
from kube_vgpu.protocol import NodeInventory, mig
from tests.helpers import gpu_node, pod

BFGD = make_policy("bfgd")


def a100_mig() -> NodeInventory:
    """GPU 0: 3g.20gb@4, 2g.10gb@0, 1g.5gb@2, 1g.5gb@3; GPU 1: seven 1g.5gb; GPUs 2-3 not in MIG mode."""
    return discover(Nvml(FakeNvml(load_profile("a100-mig", "node-m")))).inventory


def mig_pod(*containers: tuple[str, str, int], init: tuple[tuple[str, str, int], ...] = (),
            annotations: dict[str, str] | None = None) -> dict[str, Any]:
    """A pod whose containers ask (name, resource, count): "mig-<profile>" for MIG devices, "gpu" for whole vGPUs."""
    obj = pod(gpus=None, annotations=annotations)
    template = obj["spec"]["containers"][0]

    def build(name: str, resource: str, count: int) -> dict[str, Any]:
        limits = {f"nvidia.com/{resource}": str(count)}
        return {**template, "name": name, "resources": {"limits": limits, "requests": dict(limits)}}

    obj["spec"]["containers"] = [build(*c) for c in containers]
    obj["spec"]["initContainers"] = [build(*c) for c in init]
    return obj


def _place(node: NodeState, obj: dict[str, Any]) -> Placement | FitFailure:
    return place(node, PlacementRequest(protocol.parse_pod_gpu_request(obj)), BFGD, BFGD)


def _devices(node: NodeState, result: Placement | FitFailure) -> list[tuple[str, int, str | None, int]]:
    """(container, GPU index, profile, start-ordered rank on its GPU) per device of a placement."""
    assert isinstance(result, Placement), result
    found = []
    for container in result.containers:
        for position, _memory, _cores in container.devices:
            device = node.devices[position]
            rank = [d.position for d in node.mig_devices if d.mig_parent == device.mig_parent].index(position) \
                if device.mig_profile else -1
            found.append((container.request.name, device.index, device.mig_profile, rank))
    return found


def test_mig_devices_follow_the_gpus_and_leave_the_gpu_totals_alone() -> None:
    inventory = a100_mig()
    node = NodeState("n", inventory)
    assert len(node.gpus) == 4 and len(node.mig_devices) == 11
    assert [d.position for d in node.mig_devices] == list(range(4, 15))
    assert [(d.index, d.mig_profile, d.memory_mib) for d in node.mig_devices[:4]] == [
        (0, "2g.10gb", 9984), (0, "1g.5gb", 4864), (0, "1g.5gb", 4864), (0, "3g.20gb", 20096)]  # by start slot
    assert all(node.gpu_by_uuid[d.uuid] is d and d.mig_mode and not d.schedulable for d in node.mig_devices)
    assert node.total_memory_mib == 4 * 40960  # the GPUs alone
    twin = node.copy()
    twin.apply_usage(_usage(twin, "mig-1g.5gb"))
    assert sum(d.used_vgpus for d in twin.mig_devices) == 1 and not any(d.used_vgpus for d in node.mig_devices)
    assert twin.pod_kinds == {}  # a MIG pod is no GPU-share kind for the clustering policy


def _usage(node: NodeState, resource: str, count: int = 1) -> tuple[Any, ...]:
    result = _place(node, mig_pod(("main", resource, count)))
    assert isinstance(result, Placement), result
    return result.usage


def test_best_fit_takes_the_gpu_with_the_fewest_free_devices() -> None:
    node = NodeState("n", a100_mig())
    # GPU 0 has 4 free devices, GPU 1 has 7: 1g.5gb devices go to GPU 0 first, keeping GPU 1 whole
    assert _devices(node, _place(node, mig_pod(("main", "mig-1g.5gb", 1)))) == [("main", 0, "1g.5gb", 1)]
    assert _devices(node, _place(node, mig_pod(("main", "mig-1g.5gb", 3)))) == [
        ("main", 0, "1g.5gb", 1), ("main", 0, "1g.5gb", 2), ("main", 1, "1g.5gb", 0)]
    assert _devices(node, _place(node, mig_pod(("main", "mig-3g.20gb", 1)))) == [("main", 0, "3g.20gb", 3)]


def test_the_assignment_names_the_mig_device_and_reads_back_to_the_same_usage() -> None:
    node = NodeState("n", a100_mig())
    result = _place(node, mig_pod(("main", "mig-3g.20gb", 1), ("side", "gpu", 1)))
    assert isinstance(result, Placement)
    assignment = assignment_from_placement(node, result)
    three = next(d for d in node.mig_devices if d.mig_profile == "3g.20gb")
    main, side = assignment.containers
    assert main.devices == (protocol.DeviceShare(three.uuid, 20096, 100),)
    assert node.gpu_by_uuid[side.devices[0].uuid] in node.gpus[2:]  # the vGPU on a GPU outside MIG mode
    usage, missing = usage_from_assignment(node, protocol.decode_assignment(protocol.encode_assignment(assignment)))
    assert missing == [] and usage == result.usage


def test_held_devices_are_never_offered_and_the_reason_lists_the_free_ones() -> None:
    node = NodeState("n", a100_mig())
    node.apply_usage(_usage(node, "mig-3g.20gb"))
    failure = _place(node, mig_pod(("main", "mig-3g.20gb", 1)))
    assert failure == FitFailure("container main: needs 1 free MIG 3g.20gb device, 0 free (free MIG devices here: "
                                 "1g.5gb x9, 2g.10gb x1)", code="mig")
    assert not failure.unresolvable and "%" not in failure.reason  # the device is back once its pod ends


@pytest.mark.parametrize(("resource", "count", "annotations", "reason"), [
    ("mig-3g.40gb", 1, None, "container main: needs 1 MIG 3g.40gb device, node has 0 (its MIG devices: 1g.5gb x9, "
                             "2g.10gb x1, 3g.20gb x1)"),
    ("mig-3g.20gb", 2, None, "container main: needs 2 MIG 3g.20gb devices, node has 1 (its MIG devices: 1g.5gb x9, "
                             "2g.10gb x1, 3g.20gb x1)"),
    ("mig-1g.5gb", 1, {protocol.ANNOTATION_USE_GPU_TYPE: "h100"},
     "container main: needs 1 MIG 1g.5gb device, node has 0 (its MIG devices: none)"),
])  # fmt: skip
def test_a_profile_the_node_cannot_offer_is_unresolvable_and_names_what_it_has(
    resource: str, count: int, annotations: dict[str, str] | None, reason: str
) -> None:
    failure = _place(NodeState("n", a100_mig()), mig_pod(("main", resource, count), annotations=annotations))
    assert failure == FitFailure(reason, unresolvable=True, code="mig")


def test_unhealthy_or_foreign_held_gpus_offer_no_mig_device() -> None:
    inventory = a100_mig()
    sick = replace(inventory, gpus=(replace(inventory.gpus[0], healthy=False), *inventory.gpus[1:]))
    failure = _place(NodeState("n", sick), mig_pod(("main", "mig-3g.20gb", 1)))
    assert failure == FitFailure("container main: needs 1 MIG 3g.20gb device, 1 of 1 unhealthy or held by pods "
                                 "outside kube-vgpu", code="mig")
    foreign = replace(inventory, gpus=(inventory.gpus[0], replace(inventory.gpus[1], external_pods=("ns/p",)),
                                       *inventory.gpus[2:]))
    node = NodeState("n", foreign)
    assert {index for _c, index, _p, _r in _devices(node, _place(node, mig_pod(("main", "mig-1g.5gb", 2))))} == {0}


def test_uuid_selectors_name_the_gpu_or_the_mig_device() -> None:
    inventory = a100_mig()
    node = NodeState("n", inventory)
    on_gpu1 = mig_pod(("main", "mig-1g.5gb", 2), annotations={protocol.ANNOTATION_USE_GPU_UUID: inventory.gpus[1].uuid})
    assert {index for _c, index, _p, _r in _devices(node, _place(node, on_gpu1))} == {1}
    target = node.mig_devices[-1]
    exact = mig_pod(("main", "mig-1g.5gb", 1), annotations={protocol.ANNOTATION_USE_GPU_UUID: target.uuid})
    result = _place(node, exact)
    assert isinstance(result, Placement) and result.containers[0].devices[0][0] == target.position
    avoid = mig_pod(("main", "mig-1g.5gb", 1), annotations={protocol.ANNOTATION_NOUSE_GPU_UUID: inventory.gpus[0].uuid})
    assert _devices(node, _place(node, avoid))[0][1] == 1


def test_containers_running_at_once_never_share_a_device_and_an_init_container_hands_its_own_on() -> None:
    node = NodeState("n", NodeInventory((a100_mig().gpus[0],)))  # one 3g.20gb on the node
    assert isinstance(_place(node, mig_pod(("a", "mig-3g.20gb", 1), ("b", "mig-3g.20gb", 1))), FitFailure)
    result = _place(node, mig_pod(("app", "mig-3g.20gb", 1), init=(("warmup", "mig-3g.20gb", 1),)))
    assert isinstance(result, Placement)
    assert [u.vgpus for u in result.usage] == [1]  # the init container's device is the app's afterwards


# -- properties --------------------------------------------------------------------------------------------------

# Random legal layouts of every tabled model: (model, [(profile, start)]) built by adding placements that keep the
# layout legal.
@st.composite
def layouts(draw: st.DrawFn) -> tuple[mig.MigModel, list[tuple[str, int]]]:
    model = draw(st.sampled_from(mig.MIG_MODELS))
    candidates = [(p.name, start) for p in model.profiles for start in p.starts]
    layout: list[tuple[str, int]] = []
    for placement in draw(st.lists(st.sampled_from(candidates), max_size=10)):
        if mig.legal_layout(model, [*layout, placement]) is None:
            layout.append(placement)
    return model, layout


PRODUCT = {"A100-40GB": ("NVIDIA A100-SXM4-40GB", 40960), "A100-80GB": ("NVIDIA A100-SXM4-80GB", 81920),
           "H100-80GB": ("NVIDIA H100 80GB HBM3", 81559), "H200-141GB": ("NVIDIA H200", 143771)}


def _node(gpus: list[tuple[mig.MigModel, list[tuple[str, int]]]]) -> NodeInventory:
    hardware = []
    for index, (model, layout) in enumerate(gpus):
        name, memory_mib = PRODUCT[model.key]
        base = layout_hardware([f"GPU-{index}"], name, memory_mib, "pcie").gpus[0]
        hardware.append(replace(base, bus_id=f"00000000:{0x10 + index:02X}:00.0", mig_capable=True,
                                mig_enabled=bool(layout), mig_layout=tuple(layout)))
    return discover(Nvml(FakeNvml(FakeHardware(gpus=tuple(hardware))))).inventory


@settings(max_examples=150, deadline=None)
@given(gpus=st.lists(layouts(), min_size=1, max_size=3),
       asks=st.lists(st.tuples(st.booleans(), st.integers(0, 20), st.integers(1, 3)), max_size=25))
def test_no_two_pods_ever_hold_one_mig_device(
    gpus: list[tuple[mig.MigModel, list[tuple[str, int]]]], asks: list[tuple[bool, int, int]]
) -> None:
    """Property: any sequence of MIG placements and releases hands out only free devices of the asked profile, so
    no MIG device is ever held by two pods; a failure means there really were too few free ones."""
    node = NodeState("n", _node(gpus))
    profiles = sorted({d.mig_profile for d in node.mig_devices if d.mig_profile} | {"7g.80gb"})
    holders: dict[int, tuple[Any, ...]] = {}
    for pod_id, (release, pick, count) in enumerate(asks):
        if release and holders:
            node.apply_usage(holders.pop(sorted(holders)[pick % len(holders)]), -1)
            continue
        profile = profiles[pick % len(profiles)]
        result = _place(node, mig_pod(("main", f"mig-{profile}", count)))
        free = [d for d in node.mig_devices if d.mig_profile == profile and d.used_vgpus == 0]
        if isinstance(result, FitFailure):
            assert len(free) < count
            continue
        chosen = [node.devices[u.position] for u in result.usage]
        assert len(chosen) == count and all(d in free for d in chosen)
        node.apply_usage(result.usage)
        holders[pod_id] = result.usage
        assert all(d.used_vgpus <= 1 for d in node.mig_devices)
        assert not any(g.used_vgpus for g in node.gpus)  # nothing spills onto the GPUs themselves


@settings(max_examples=100, deadline=None)
@given(gpus=st.lists(layouts(), min_size=1, max_size=3), policy=st.sampled_from(policy_names()),
       memory_mib=st.one_of(st.none(), st.integers(1, 40000)), cores=st.sampled_from([0, 30, 100]),
       count=st.integers(1, 3))
def test_a_gpu_in_mig_mode_never_gets_a_shared_vgpu(
    gpus: list[tuple[mig.MigModel, list[tuple[str, int]]]], policy: str, memory_mib: int | None, cores: int,
    count: int,
) -> None:
    """Property: whatever the policy and the vGPU request, the vGPU engine places nothing on a GPU in MIG mode."""
    inventory = _node(gpus)
    node = NodeState("n", inventory)
    request = PlacementRequest(protocol.parse_pod_gpu_request(pod(gpus=count, memory_mib=memory_mib, cores=cores)))
    chosen = make_policy(policy)
    result = place(node, request, chosen, chosen)
    mig_positions = {gpu.position for gpu in node.gpus if gpu.mig_mode}
    if isinstance(result, Placement):
        assert not {position for c in result.containers for position, _m, _c in c.devices} & mig_positions
    else:
        # and it fails only where the GPUs outside MIG mode alone could not take it either
        plain = replace(inventory, gpus=tuple(replace(gpu, links=()) for gpu in inventory.gpus if not gpu.mig_mode))
        assert isinstance(place(NodeState("n", plain), request, chosen, chosen), FitFailure)


# -- quota and the extender's filter / prioritize / bind ---------------------------------------------------------


def test_quota_counts_a_mig_device_as_its_mig_resource_with_its_memory() -> None:
    """No nvidia.com/gpu and no cores: quota/mig.py (tests/quota/test_mig_quota.py has the cases)."""
    node = NodeState("n", a100_mig())
    request = protocol.parse_pod_gpu_request(mig_pod(("main", "mig-3g.20gb", 1), ("side", "mig-1g.5gb", 2)))
    result = place(node, PlacementRequest(request), BFGD, BFGD)
    assert isinstance(result, Placement)
    counted = assignment_usage(assignment_from_placement(node, result), None, mig_profiles_by_uuid(node))
    assert request_usage_on(request, node) == counted == {
        protocol.RESOURCE_GPU: 0, protocol.RESOURCE_GPU_MEMORY: 20096 + 2 * 4864,
        TOTAL_GPU_MEMORY: 20096 + 2 * 4864, protocol.RESOURCE_GPU_CORES: 0, TOTAL_GPU_CORES: 0,
        "nvidia.com/mig-3g.20gb": 1, "nvidia.com/mig-1g.5gb": 2}
    assert named_gpu_resources(request) == ["nvidia.com/mig-1g.5gb", "nvidia.com/mig-3g.20gb"]


def test_a_mig_nodes_capacity_counts_mig_devices_per_profile_as_kubelet_reports_them() -> None:
    capacity = node_object("mig-node", a100_mig())["status"]["capacity"]
    assert {k: v for k, v in capacity.items() if k.startswith("nvidia.com/")} == {
        "nvidia.com/gpu": "20",  # GPUs 2 and 3, ten vGPU slots each; GPUs in MIG mode are not nvidia.com/gpu
        "nvidia.com/mig-1g.5gb": "9", "nvidia.com/mig-2g.10gb": "1", "nvidia.com/mig-3g.20gb": "1"}


def test_filter_prioritize_and_bind_put_the_mig_device_in_the_assignment() -> None:
    inventory = a100_mig()
    state = ClusterState()
    cluster = SnapshotCluster(state, [node_object("mig-node", inventory), gpu_node("plain", gpus=2)])
    scheduler = Scheduler(state, cluster)
    first = mig_pod(("main", "mig-3g.20gb", 1))
    cluster.add_pod(first)
    outcome = scheduler.filter(first, ["mig-node", "plain"])
    assert outcome.passed == ["mig-node"]
    assert outcome.unresolvable == {"plain": "container main: needs 1 MIG 3g.20gb device, node has 0 (its MIG "
                                             "devices: none)"}
    assert [name for name, _score in scheduler.prioritize(first, ["mig-node"])] == ["mig-node"]
    meta = first["metadata"]
    scheduler.bind(meta["namespace"], meta["name"], meta["uid"], "mig-node")
    stored = cluster.pods[(meta["namespace"], meta["name"])]
    assignment = protocol.decode_assignment(stored["metadata"]["annotations"][protocol.POD_ASSIGNMENT_ANNOTATION])
    three = next(d for d in inventory.gpus[0].mig_devices if d.profile == "3g.20gb")
    assert assignment.containers[0].devices == (protocol.DeviceShare(three.uuid, three.memory_mib, 100),)
    # the device is held now: a second pod asking for it is told which devices are free
    second = mig_pod(("main", "mig-3g.20gb", 1))
    cluster.add_pod(second)
    outcome = scheduler.filter(second, ["mig-node"])
    assert outcome.passed == [] and "needs 1 free MIG 3g.20gb device, 0 free" in outcome.failed["mig-node"]
    with pytest.raises(BindError):
        scheduler.bind(second["metadata"]["namespace"], second["metadata"]["name"], second["metadata"]["uid"],
                       "mig-node")
    # /state shows each MIG device and whether it is held
    (node_view,) = [n for n in state.snapshot()["nodes"] if n["name"] == "mig-node"]
    held = {d["profile"]: d["held"] for d in node_view["migDevices"] if d["profile"] != "1g.5gb"}
    assert held == {"3g.20gb": True, "2g.10gb": False} and len(node_view["migDevices"]) == 11
    assert "migDevices" not in next(n for n in state.snapshot()["nodes"] if n["name"] == "plain")
    # a restarted extender reads the same from the API server's objects
    restarted = ClusterState()
    SnapshotCluster(restarted, [node_object("mig-node", inventory), *cluster.pods.values()])
    held = restarted.nodes["mig-node"].gpu_by_uuid[three.uuid]
    assert (held.used_vgpus, held.used_memory_mib) == (1, three.memory_mib)


def test_a_higher_priority_mig_pod_preempts_the_holder_of_the_only_device_of_its_profile() -> None:
    from tests.extender.preemption.test_preemption_flow import MemoryEvictor

    state = ClusterState(heartbeat_ttl_s=float("inf"))
    cluster = SnapshotCluster(state, [node_object("mig-node", a100_mig())])
    scheduler = Scheduler(state, cluster)
    evictor = MemoryEvictor(cluster)
    scheduler.enable_preemption(evictor, inline=True)

    def submit(name: str, priority: int) -> dict[str, Any]:
        obj = mig_pod(("main", "mig-3g.20gb", 1))
        obj["metadata"].update(name=name, uid=f"uid-{name}")
        obj["spec"]["priority"] = priority
        cluster.add_pod(obj)
        return obj

    low = submit("low", 0)
    assert scheduler.filter(low, ["mig-node"]).passed == ["mig-node"]
    scheduler.bind("default", "low", "uid-low", "mig-node")
    urgent = submit("urgent", 1000)
    first = scheduler.filter(urgent, ["mig-node"])
    assert first.passed == [] and first.failed["mig-node"].startswith("preempting 1 pod(s) on this node for this pod")
    assert [r.name for r in evictor.requests] == ["low"] and cluster.get_pod("default", "low") is None
    assert scheduler.filter(urgent, ["mig-node"]).passed == ["mig-node"]
    scheduler.bind("default", "urgent", "uid-urgent", "mig-node")
    stored = cluster.get_pod("default", "urgent")
    assert stored is not None
    three = next(d for d in a100_mig().gpus[0].mig_devices if d.profile == "3g.20gb")
    assignment = protocol.decode_assignment(stored["metadata"]["annotations"][protocol.POD_ASSIGNMENT_ANNOTATION])
    assert assignment.containers[0].devices[0].uuid == three.uuid


@settings(max_examples=60, deadline=None)
@given(ops=st.lists(st.one_of(
    st.tuples(st.just("mig"), st.sampled_from(["1g.5gb", "2g.10gb", "3g.20gb", "1g.10gb"]), st.integers(1, 2)),
    st.tuples(st.just("share"), st.just(""), st.integers(1, 3)),
    st.tuples(st.just("release"), st.just(""), st.integers(0, 30)),
), max_size=25))
def test_filter_bind_and_release_never_double_book_a_mig_device(ops: list[tuple[str, str, int]]) -> None:
    """Property, through the extender (filter, bind, pod deletion): from the assignments alone, no MIG device is held
    by two pods, each holds the profile its container asked for, no vGPU lands on a GPU in MIG mode, and the
    extender's counts equal what the assignments say (so a restart rebuilds the same)."""
    inventory = a100_mig()
    state = ClusterState()
    cluster = SnapshotCluster(state, [node_object("mig-node", inventory)])
    scheduler = Scheduler(state, cluster)
    profile_of = {d.uuid: d.profile for g in inventory.gpus for d in g.mig_devices}
    mig_gpus = {g.uuid for g in inventory.gpus if g.mig_mode}
    bound: list[dict[str, Any]] = []
    for number, (op, profile, amount) in enumerate(ops):
        if op == "release":
            if bound:
                gone = bound.pop(amount % len(bound))
                cluster.delete_pod(gone["metadata"]["namespace"], gone["metadata"]["name"])
        else:
            obj = mig_pod(("main", f"mig-{profile}", amount)) if op == "mig" else pod(gpus=1, memory_mib=1000 * amount)
            obj["metadata"].update(name=f"p{number}", uid=f"uid-p{number}")
            cluster.add_pod(obj)
            if scheduler.filter(obj, ["mig-node"]).passed:
                scheduler.bind("default", f"p{number}", f"uid-p{number}", "mig-node")
                bound.append(obj)
        holders: dict[str, int] = {}
        for stored in cluster.pods.values():
            text = stored["metadata"].get("annotations", {}).get(protocol.POD_ASSIGNMENT_ANNOTATION)
            if not text:
                continue
            asked = protocol.parse_pod_gpu_request(stored).containers[0]
            for device in protocol.decode_assignment(text).all_devices():
                assert device.uuid not in mig_gpus  # never a shared vGPU on a GPU in MIG mode
                if asked.mig_profile is not None:
                    assert profile_of[device.uuid] == asked.mig_profile
                    holders[device.uuid] = holders.get(device.uuid, 0) + 1
                else:
                    assert device.uuid not in profile_of
        assert all(count == 1 for count in holders.values())
        node = state.nodes["mig-node"]
        assert {d.uuid for d in node.mig_devices if d.used_vgpus} == set(holders)
