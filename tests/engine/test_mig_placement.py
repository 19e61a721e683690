"""Static MIG placement (extender/engine/mig.py) on inventories the device plugin's discovery publishes from the fake
NVML's MIG layouts, and the vGPU engine's rule that a GPU in MIG mode never takes a shared vGPU."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kube_vgpu import protocol
from kube_vgpu.deviceplugin.discovery import discover
from kube_vgpu.deviceplugin.fakenvml import FakeHardware, FakeNvml, layout_hardware, load_profile
from kube_vgpu.deviceplugin.nvml import Nvml
from kube_vgpu.extender.engine.fit import place
from kube_vgpu.extender.engine.mig import mig_slots, place_mig
from kube_vgpu.extender.engine.model import FitFailure, NodeState, Placement, PlacementRequest
from kube_vgpu.extender.engine.policies import make_policy, policy_names
from kube_vgpu.protocol import GpuSelectors, NodeInventory, mig
from tests.helpers import pod


def a100_mig() -> NodeInventory:
    """GPU 0: 3g.20gb@4, 2g.10gb@0, 1g.5gb@2, 1g.5gb@3; GPU 1: seven 1g.5gb; GPUs 2-3 not in MIG mode."""
    return discover(Nvml(FakeNvml(load_profile("a100-mig", "node-m")))).inventory


def test_only_healthy_gpus_in_mig_mode_offer_their_devices_in_order() -> None:
    inventory = a100_mig()
    slots = mig_slots(inventory)
    assert [(s.gpu_index, s.profile, s.device.start) for s in slots] == [
        (0, "2g.10gb", 0), (0, "1g.5gb", 2), (0, "1g.5gb", 3), (0, "3g.20gb", 4),
        *[(1, "1g.5gb", start) for start in range(7)]]
    sick = replace(inventory, gpus=(replace(inventory.gpus[0], healthy=False), *inventory.gpus[1:]))
    assert {s.gpu_index for s in mig_slots(sick)} == {1}
    foreign = replace(inventory, gpus=(inventory.gpus[0], replace(inventory.gpus[1], external_pods=("ns/p",)),
                                       *inventory.gpus[2:]))
    assert {s.gpu_index for s in mig_slots(foreign)} == {0}


def _profiles(chosen: tuple[object, ...] | FitFailure) -> list[tuple[int, str, int]]:
    assert not isinstance(chosen, FitFailure), chosen
    return [(s.gpu_index, s.profile, s.device.start) for s in chosen]  # type: ignore[attr-defined]


def test_best_fit_takes_the_gpu_with_the_fewest_free_devices() -> None:
    slots = mig_slots(a100_mig())
    # GPU 0 has 4 free devices, GPU 1 has 7: a 1g.5gb goes to GPU 0, keeping GPU 1 whole
    assert _profiles(place_mig(slots, set(), "1g.5gb")) == [(0, "1g.5gb", 2)]
    assert _profiles(place_mig(slots, set(), "1g.5gb", count=3)) == [(0, "1g.5gb", 2), (0, "1g.5gb", 3),
                                                                     (1, "1g.5gb", 0)]
    assert _profiles(place_mig(slots, set(), "3g.20gb")) == [(0, "3g.20gb", 4)]


def test_held_devices_are_never_offered() -> None:
    slots = mig_slots(a100_mig())
    three = next(s for s in slots if s.profile == "3g.20gb")
    failure = place_mig(slots, {three.uuid}, "3g.20gb")
    assert failure == FitFailure(
        "needs 1 free MIG 3g.20gb device, 0 free (free MIG devices here: 1g.5gb x9, 2g.10gb x1)", code="mig")
    assert not failure.unresolvable  # the device is back once its pod ends


@pytest.mark.parametrize(("profile", "count", "selectors", "reason"), [
    ("3g.40gb", 1, None, "needs 1 MIG 3g.40gb device, node has 0 (its MIG devices: 1g.5gb x9, 2g.10gb x1, "
                         "3g.20gb x1)"),
    ("3g.20gb", 2, None, "needs 2 MIG 3g.20gb devices, node has 1 (its MIG devices: 1g.5gb x9, 2g.10gb x1, "
                         "3g.20gb x1)"),
    ("1g.5gb", 1, GpuSelectors(use_types=("h100",)), "needs 1 MIG 1g.5gb device, node has 0 (its MIG devices: "
                                                     "none)"),
])  # fmt: skip
def test_a_profile_the_node_cannot_offer_is_unresolvable_and_names_what_it_has(
    profile: str, count: int, selectors: GpuSelectors | None, reason: str
) -> None:
    failure = place_mig(mig_slots(a100_mig()), set(), profile, count, selectors)
    assert failure == FitFailure(reason, unresolvable=True, code="mig")


def test_uuid_selectors_name_the_gpu_or_the_mig_device() -> None:
    inventory = a100_mig()
    slots = mig_slots(inventory)
    gpu1 = inventory.gpus[1].uuid
    assert {s.gpu_index for s in place_mig(slots, set(), "1g.5gb", 2, GpuSelectors(use_uuids=(gpu1,)))} == {1}  # type: ignore[union-attr]
    target = slots[-1].uuid
    chosen = place_mig(slots, set(), "1g.5gb", 1, GpuSelectors(use_uuids=(target,)))
    assert not isinstance(chosen, FitFailure) and chosen[0].uuid == target
    avoided = place_mig(slots, set(), "1g.5gb", 1, GpuSelectors(nouse_uuids=(inventory.gpus[0].uuid,)))
    assert not isinstance(avoided, FitFailure) and avoided[0].gpu_index == 1


def test_a_request_for_no_device_is_a_mistake() -> None:
    with pytest.raises(ValueError, match="at least one device"):
        place_mig(mig_slots(a100_mig()), set(), "1g.5gb", 0)


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
           "H100-80GB": ("NVIDIA H100 80GB HBM3", 81559)}


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
    """Property: any sequence of placements and releases hands out only free devices of the asked profile, so no
    MIG device is ever held by two pods, and a failure means there really were too few free devices."""
    slots = mig_slots(_node(gpus))
    profiles = sorted({slot.profile for slot in slots} | {"7g.80gb"})
    holders: dict[int, tuple[str, ...]] = {}
    for pod_id, (release, pick, count) in enumerate(asks):
        if release and holders:
            holders.pop(sorted(holders)[pick % len(holders)])
            continue
        held = {uuid for uuids in holders.values() for uuid in uuids}
        profile = profiles[pick % len(profiles)]
        chosen = place_mig(slots, held, profile, count)
        free = [s for s in slots if s.profile == profile and s.uuid not in held]
        if isinstance(chosen, FitFailure):
            assert len(free) < count
            continue
        assert len(chosen) == count and len({s.uuid for s in chosen}) == count
        assert all(s.profile == profile and s.uuid not in held for s in chosen)
        holders[pod_id] = tuple(s.uuid for s in chosen)


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
