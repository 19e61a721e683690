"""Dynamic MIG (issue 16 item 2) in the device plugin: the fake NVML's MIG calls under NVIDIA's placement rules
(property-tested against protocol.mig's tables), creation before Allocate answers with failures rolled back, and
the reconcile that destroys instances whose pods are gone, through kubelet's gRPC API over unix sockets."""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import grpc
import pynvml
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kube_vgpu import protocol
from kube_vgpu.dev.fixtures.inmemory_api import InMemoryCluster
from kube_vgpu.deviceplugin.allocate import AllocationError, DeliveryConfig
from kube_vgpu.deviceplugin.app import DevicePluginApp, PluginConfig
from kube_vgpu.deviceplugin.discovery import discover
from kube_vgpu.deviceplugin.dynmig import (
    DynamicMig,
    DynamicMigConfig,
    DynamicMigError,
    live_placements,
    mark_dynamic,
    parse_gpus,
    parse_profiles,
)
from kube_vgpu.deviceplugin.fakenvml import (
    COMPUTE_PROFILE_BY_SLICES,
    FakeHardware,
    FakeNvml,
    layout_hardware,
    load_profile,
)
from kube_vgpu.deviceplugin.nvml import Nvml
from kube_vgpu.protocol import DynamicMigPlacement, mig
from tests.deviceplugin.builders import NODE, allocation_of, gpu_pod
from tests.deviceplugin.kubelet import KubeletStandIn

PRODUCTS = {"A100-40GB": ("NVIDIA A100-SXM4-40GB", 40960), "A100-80GB": ("NVIDIA A100-SXM4-80GB", 81920),
            "H100-80GB": ("NVIDIA H100 80GB HBM3", 81559)}


def hardware(model: str = "H100-80GB", count: int = 1) -> FakeHardware:
    name, memory = PRODUCTS[model]
    base = layout_hardware([f"GPU-{model}-{i}" for i in range(count)], name, memory, "pcie")
    return replace(base, gpus=tuple(replace(gpu, mig_capable=True) for gpu in base.gpus))


def started(model: str = "H100-80GB", *, mig_on: bool = True) -> tuple[FakeNvml, Nvml, Any]:
    fake = FakeNvml(hardware(model))
    nvml = Nvml(fake)
    nvml.init()
    handle = nvml.handle(0)
    if mig_on:
        assert nvml.set_mig_mode(handle, True)
    return fake, nvml, handle


# -- the fake NVML's MIG calls ---------------------------------------------------------------------------------


@pytest.mark.parametrize("model", PRODUCTS)
def test_possible_placements_are_the_tables(model: str) -> None:
    _fake, nvml, handle = started(model, mig_on=False)  # NVML answers whatever the MIG mode
    table = next(m for m in mig.MIG_MODELS if m.key == model)
    for profile in table.profiles:
        assert nvml.possible_placements(handle, profile.profile_id) == [(s, profile.memory_slices)
                                                                        for s in profile.starts]


CREATE_CASES = [  # (existing (profile, start), new profile, start, size or None for the profile's, error or None)
    ([], "3g.40gb", 4, None, None),
    ([], "3g.40gb", 2, None, pynvml.NVMLError_InvalidArgument),  # 3g starts at 0 or 4 only
    ([], "1g.10gb", 7, None, pynvml.NVMLError_InvalidArgument),  # slot 7 takes no 1g instance
    ([], "1g.20gb", 0, 1, pynvml.NVMLError_InvalidArgument),  # size must be the profile's
    ([], "4g.40gb", 4, None, pynvml.NVMLError_InvalidArgument),  # 4g only at 0
    ([("1g.10gb", 6)], "3g.40gb", 4, None, pynvml.NVMLError_InsufficientResources),  # overlaps slot 6
    ([("1g.10gb", 6)], "3g.40gb", 0, None, None),
    ([("1g.10gb", 0)], "4g.40gb", 0, None, pynvml.NVMLError_InsufficientResources),
    ([("7g.80gb", 0)], "1g.10gb", 6, None, pynvml.NVMLError_InsufficientResources),
    ([("1g.10gb+me", 0)], "1g.10gb+me", 1, None, pynvml.NVMLError_InsufficientResources),  # one set of media engines
]


@pytest.mark.parametrize(("existing", "name", "start", "size", "error"), CREATE_CASES)
def test_create_gpu_instance_follows_nvidias_placement_rules(
    existing: list[tuple[str, int]], name: str, start: int, size: int | None, error: type[Exception] | None
) -> None:
    fake, nvml, handle = started()
    table = mig.H100_80GB
    for other, other_start in existing:
        profile = table.profile(other)
        assert profile is not None
        nvml.create_gpu_instance(handle, profile.profile_id, other_start, profile.memory_slices)
    profile = table.profile(name)
    assert profile is not None
    before = fake.mig_instances(0)
    if error is None:
        nvml.create_gpu_instance(handle, profile.profile_id, start, size or profile.memory_slices)
        assert (name, start, False) in fake.mig_instances(0)
    else:
        with pytest.raises(error):
            nvml.create_gpu_instance(handle, profile.profile_id, start, size or profile.memory_slices)
        assert fake.mig_instances(0) == before


def test_mig_calls_need_mig_mode_and_destroy_in_order() -> None:
    fake, nvml, handle = started(mig_on=False)
    profile = mig.H100_80GB.profile("3g.40gb")
    assert profile is not None
    with pytest.raises(pynvml.NVMLError_InvalidArgument):  # MIG mode off
        nvml.create_gpu_instance(handle, profile.profile_id, 0, 4)
    assert nvml.set_mig_mode(handle, True)
    gi = nvml.create_gpu_instance(handle, profile.profile_id, 0, 4)
    ci = nvml.create_compute_instance(gi, COMPUTE_PROFILE_BY_SLICES[3])
    with pytest.raises(pynvml.NVMLError_InUse):  # compute instances first
        nvml.destroy_gpu_instance(gi)
    with pytest.raises(pynvml.NVMLError_InUse):  # instances first
        nvml.set_mig_mode(handle, False)
    uuid = nvml.uuid(nvml.mig_device(handle, 0))
    assert uuid.startswith("MIG-")
    nvml.destroy_compute_instance(ci)
    nvml.destroy_gpu_instance(gi)
    assert fake.mig_instances(0) == [] and nvml.set_mig_mode(handle, False)


slot_ops = st.lists(st.tuples(st.sampled_from([p.name for p in mig.A100_80GB.profiles]), st.integers(0, 7),
                              st.booleans()), max_size=25)


@settings(max_examples=150, deadline=None)
@given(model=st.sampled_from(list(PRODUCTS)), ops=slot_ops)
def test_the_fake_accepts_exactly_the_legal_layouts(model: str, ops: list[tuple[str, int, bool]]) -> None:
    """Property: against the profile tables, a creation succeeds exactly when the layout it makes is legal
    (legal_layout), a destroy frees the slots, and the GPU's layout is always legal."""
    fake, nvml, handle = started(model)
    table = next(m for m in mig.MIG_MODELS if m.key == model)
    live: dict[tuple[str, int], Any] = {}
    for position, (index_name, start, destroy) in enumerate(ops):
        profile = table.profiles[[p.name for p in mig.A100_80GB.profiles].index(index_name)]
        if destroy and live:
            key = sorted(live)[position % len(live)]
            nvml.destroy_gpu_instance(live.pop(key))
        else:
            legal = mig.legal_layout(table, [*live, (profile.name, start)]) is None
            try:
                gi = nvml.create_gpu_instance(handle, profile.profile_id, start, profile.memory_slices)
            except (pynvml.NVMLError_InvalidArgument, pynvml.NVMLError_InsufficientResources):
                assert not legal
            else:
                assert legal
                live[(profile.name, start)] = gi
        layout = [(name, slot) for name, slot, _ci in fake.mig_instances(0)]
        assert sorted(layout) == sorted(live) and mig.legal_layout(table, layout) is None


# -- flags -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "expected"), [
    ("H100-80GB=1g.10gb,3g.40gb", {"H100-80GB": ("1g.10gb", "3g.40gb")}),
    ("A100-40GB=1g.5gb; H100-80GB=7g.80gb", {"A100-40GB": ("1g.5gb",), "H100-80GB": ("7g.80gb",)}),
    ("H100-80GB=3g.20gb", ValueError),  # A100-40GB's name, not H100's
    ("H100-80GB=1g.10gb+me", ValueError),
    ("T4=1g.5gb", ValueError),
])  # fmt: skip
def test_profile_allowlist_flag(text: str, expected: Any) -> None:
    if expected is ValueError:
        with pytest.raises(ValueError):
            parse_profiles(text)
    else:
        assert parse_profiles(text) == expected


def test_gpus_flag() -> None:
    assert parse_gpus("all") is None and parse_gpus("0,2") == frozenset({0, 2}) == parse_gpus("0.2")


# -- the plugin: inventory, kubelet, Allocate, reconcile ------------------------------------------------------

MIG_1G = "nvidia.com/mig-1g.10gb"
MIG_3G = "nvidia.com/mig-3g.40gb"
ALLOW = {"H100-80GB": ("1g.10gb", "3g.40gb")}


def dynamic_app(tmp_path: Any, kubelet_dir: str | None = None) -> tuple[DevicePluginApp, FakeNvml, InMemoryCluster]:
    fake = FakeNvml(load_profile("h100-mig-capable", NODE))
    cluster = InMemoryCluster()
    cluster.add_node({"metadata": {"name": NODE}})
    config = PluginConfig(node_name=NODE, kubelet_dir=kubelet_dir or str(tmp_path), heartbeat_seconds=3600,
                          kubelet_poll_seconds=0.05, health_poll_seconds=0.05, health_event_wait_ms=50,
                          dynamic_mig=DynamicMigConfig(ALLOW, parse_gpus("0"), grace_seconds=0),
                          delivery=DeliveryConfig(limiter_library_path="", cache_host_dir=""))
    return DevicePluginApp(config, Nvml(fake), cluster), fake, cluster


@pytest.mark.parametrize(("labels", "dynamic"), [
    ({protocol.LABEL_DYNAMIC_MIG: "all"}, [True, True]),
    ({protocol.LABEL_DYNAMIC_MIG: "1"}, [False, True]),
    ({}, [False, False]),  # no label: off
    ({protocol.LABEL_DYNAMIC_MIG: "some"}, [False, False]),  # unreadable: off, with a warning
])  # fmt: skip
def test_the_node_label_picks_the_dynamic_gpus_when_the_flags_name_only_profiles(
    tmp_path: Any, labels: dict[str, str], dynamic: list[bool]
) -> None:
    cluster = InMemoryCluster()
    cluster.add_node({"metadata": {"name": NODE, "labels": labels}})
    config = PluginConfig(node_name=NODE, kubelet_dir=str(tmp_path), heartbeat_seconds=3600,
                          dynamic_mig=DynamicMigConfig(ALLOW, from_node_label=True),
                          delivery=DeliveryConfig(limiter_library_path="", cache_host_dir=""))
    app = DevicePluginApp(config, Nvml(FakeNvml(load_profile("h100-mig-capable", NODE))), cluster)
    assert [gpu.dynamic_mig is not None for gpu in app.state.inventory().gpus] == dynamic
    assert (app.dynamic_mig is not None) == any(dynamic)


@pytest.mark.parametrize(("gpus", "allow", "warning"), [
    ("5", ALLOW, "this node has no GPU 5 (its GPUs: [0, 1])"),
    ("0", {"A100-80GB": ("1g.10gb",)}, "GPU 0 (NVIDIA H100 80GB HBM3) is of no model in --dynamic-mig-profiles "
                                       "(A100-80GB)"),
])  # fmt: skip
def test_gpus_named_for_dynamic_mig_that_cannot_take_it_are_warned_about(
    tmp_path: Any, caplog: pytest.LogCaptureFixture, gpus: str, allow: dict[str, tuple[str, ...]], warning: str
) -> None:
    cluster = InMemoryCluster()
    cluster.add_node({"metadata": {"name": NODE}})
    config = PluginConfig(node_name=NODE, kubelet_dir=str(tmp_path), heartbeat_seconds=3600,
                          dynamic_mig=DynamicMigConfig(allow, parse_gpus(gpus)),
                          delivery=DeliveryConfig(limiter_library_path="", cache_host_dir=""))
    with caplog.at_level("WARNING"):
        app = DevicePluginApp(config, Nvml(FakeNvml(load_profile("h100-mig-capable", NODE))), cluster)
    assert all(gpu.dynamic_mig is None for gpu in app.state.inventory().gpus)
    assert f"dynamic MIG: {warning}" in caplog.text


def mig_pod(name: str, resource: str, devices: list[str], *, bound_at: float = 1.0, phase: str = "Pending"
            ) -> dict[str, Any]:
    limits = {"cpu": "1", resource: str(len(devices))}
    main = {"name": "main", "image": "cuda", "resources": {"limits": limits, "requests": dict(limits)}}
    memory = 40448 if "3g" in resource else 9984
    return gpu_pod(name, containers=[main], assignment={"main": [(d, memory, 100) for d in devices]},
                   bound_at=bound_at, phase=phase)


def test_inventory_marks_the_dynamic_gpu_and_kubelet_gets_one_id_per_placement(tmp_path: Any) -> None:
    app, _fake, _cluster = dynamic_app(tmp_path)
    dynamic, plain = app.state.inventory().gpus
    assert dynamic.dynamic_mig == protocol.DynamicMig("H100-80GB", ("1g.10gb", "3g.40gb"), ())
    assert plain.dynamic_mig is None and not dynamic.mig_mode
    text = protocol.encode_inventory(app.state.inventory())
    assert protocol.decode_inventory(text) == app.state.inventory()
    assert app.state.mig_resources() == [MIG_1G, MIG_3G]
    ids = [d.id for d in app.state.advertised(MIG_3G)]
    assert ids == [DynamicMigPlacement(dynamic.uuid, "3g.40gb", s).device for s in (0, 4)]
    assert len(app.state.advertised(MIG_1G)) == 7
    # MIG mode off: the dynamic GPU is shared like any other until a MIG instance is made
    assert len(app.state.advertised(protocol.RESOURCE_GPU)) == 2 * protocol.DEFAULT_MAX_VGPUS_PER_GPU


def test_allocate_creates_the_instance_at_the_assigned_slot_and_reconcile_destroys_it(tmp_path: Any) -> None:
    app, fake, cluster = dynamic_app(tmp_path)
    gpu = app.state.gpus()[0].uuid
    name = DynamicMigPlacement(gpu, "3g.40gb", 4).device
    cluster.add_pod(mig_pod("mig-job", MIG_3G, [name]))
    [delivery] = app.allocator.allocate([[DynamicMigPlacement(gpu, "3g.40gb", 0).device]], MIG_3G)
    assert fake.mig_instances(0) == [("3g.40gb", 4, True)]
    [instance] = app.state.inventory().gpus[0].dynamic_mig.instances  # type: ignore[union-attr]
    assert delivery.uuids == (instance.uuid,) and instance.start == 4 and instance.profile == "3g.40gb"
    assert delivery.envs[protocol.ENV_NVIDIA_VISIBLE_DEVICES] == instance.uuid and delivery.mounts == ()
    assert app.state.inventory().gpus[0].mig_mode
    # kubelet keeps counting the dynamic GPU's vGPU slots (vgpu-mode: mig pods ask nvidia.com/gpu for instances)
    assert len(app.state.advertised(protocol.RESOURCE_GPU)) == 2 * protocol.DEFAULT_MAX_VGPUS_PER_GPU
    assert allocation_of(cluster.pod("default", "mig-job"))["main"]
    app.reconcile_dynamic_mig()  # the pod still lives: its instance stays
    assert fake.mig_instances(0) == [("3g.40gb", 4, True)]
    cluster.update_pod("default", "mig-job", lambda pod: pod.setdefault("status", {}).update(phase="Succeeded"))
    app.reconcile_dynamic_mig()
    assert fake.mig_instances(0) == []
    assert not app.state.inventory().gpus[0].mig_mode  # back to a shareable GPU


@pytest.mark.parametrize("failing", ["nvmlDeviceSetMigMode", "nvmlDeviceCreateGpuInstanceWithPlacement",
                                     "nvmlGpuInstanceCreateComputeInstance"])
def test_a_failed_creation_leaves_no_half_instance_and_no_claim(tmp_path: Any, failing: str) -> None:
    app, fake, cluster = dynamic_app(tmp_path)
    gpu = app.state.gpus()[0].uuid
    name = DynamicMigPlacement(gpu, "1g.10gb", 6).device
    cluster.add_pod(mig_pod("mig-job", MIG_1G, [name]))
    fake.fail_next(failing, code=pynvml.NVML_ERROR_UNKNOWN)
    with pytest.raises(AllocationError) as caught:
        app.allocator.allocate([[name]], MIG_1G)
    assert str(caught.value).startswith(
        f"pod default/mig-job container main: creating its MIG instance failed: MIG 1g.10gb at slot 6 on GPU 0 "
        f"({gpu})")
    assert "rolled back" in str(caught.value) or "pending" in str(caught.value)
    assert fake.mig_instances(0) == [] and not app.state.inventory().gpus[0].mig_mode
    assert allocation_of(cluster.pod("default", "mig-job")) == {}  # the claim was released: the pod holds nothing
    # kubelet's retry (or the pod made anew) succeeds once NVML does
    [delivery] = app.allocator.allocate([[name]], MIG_1G)
    assert fake.mig_instances(0) == [("1g.10gb", 6, True)] and delivery.uuids[0].startswith("MIG-")


def test_a_mig_mode_waiting_for_a_gpu_reset_fails_the_creation_and_is_switched_back(tmp_path: Any) -> None:
    fake = FakeNvml(replace(hardware(), gpus=tuple(replace(g, mig_mode_needs_reset=True) for g in hardware().gpus)))
    nvml = Nvml(fake)
    nvml.init()
    handle = nvml.handle(0)
    gpu = discover(nvml).inventory
    marked = mark_dynamic(gpu, DynamicMigConfig(ALLOW), [0])
    changes: list[tuple[str, bool, Any]] = []
    manager = DynamicMig(nvml, {marked.gpus[0].uuid: handle}, marked.gpus, lambda *c: changes.append(c))
    with pytest.raises(DynamicMigError, match="MIG mode is pending a GPU reset"):
        manager.ensure(DynamicMigPlacement(marked.gpus[0].uuid, "1g.10gb", 0))
    assert fake.nvmlDeviceGetMigMode(handle) == [pynvml.NVML_DEVICE_MIG_DISABLE] * 2  # nothing left pending
    assert fake.mig_instances(0) == [] and changes[-1][1:] == (False, ())


def test_a_container_of_two_instances_gets_both_or_neither(tmp_path: Any) -> None:
    app, fake, cluster = dynamic_app(tmp_path)
    gpu = app.state.gpus()[0].uuid
    names = [DynamicMigPlacement(gpu, "1g.10gb", start).device for start in (0, 1)]
    cluster.add_pod(mig_pod("pair", MIG_1G, names))
    # the first instance is made, the second fails: the first is destroyed again
    original = fake.nvmlDeviceCreateGpuInstanceWithPlacement
    calls = []

    def second_fails(device: Any, profile_id: int, placement: Any) -> Any:
        calls.append(profile_id)
        if len(calls) == 2:
            fake.fail_next("nvmlDeviceCreateGpuInstanceWithPlacement", code=pynvml.NVML_ERROR_UNKNOWN)
        return original(device, profile_id, placement)

    fake.nvmlDeviceCreateGpuInstanceWithPlacement = second_fails  # type: ignore[method-assign]
    with pytest.raises(AllocationError, match="slot 1"):
        app.allocator.allocate([names], MIG_1G)
    assert fake.mig_instances(0) == [] and not app.state.inventory().gpus[0].mig_mode
    assert allocation_of(cluster.pod("default", "pair")) == {}


def test_a_second_allocate_for_the_same_placement_reuses_the_instance(tmp_path: Any) -> None:
    app, fake, _cluster = dynamic_app(tmp_path)
    gpu = app.state.gpus()[0].uuid
    placement = DynamicMigPlacement(gpu, "1g.10gb", 2)
    assert app.dynamic_mig is not None
    first = app.dynamic_mig.ensure(placement)
    assert app.dynamic_mig.ensure(placement) == first and len(fake.mig_instances(0)) == 1


def test_a_placement_on_a_gpu_that_is_not_dynamic_or_of_a_profile_not_allowed_is_refused(tmp_path: Any) -> None:
    app, fake, cluster = dynamic_app(tmp_path)
    static_gpu, = [g.uuid for g in app.state.gpus() if g.dynamic_mig is None]
    name = DynamicMigPlacement(static_gpu, "1g.10gb", 0).device
    cluster.add_pod(mig_pod("elsewhere", MIG_1G, [name]))
    with pytest.raises(AllocationError, match="not on node"):
        app.allocator.allocate([[name]], MIG_1G)
    assert fake.mig_instances(1) == []


def test_nvidia_gpu_hands_a_vgpu_mode_mig_pod_its_new_instance(tmp_path: Any) -> None:
    app, fake, cluster = dynamic_app(tmp_path)
    gpu = app.state.gpus()[0].uuid
    name = DynamicMigPlacement(gpu, "1g.10gb", 0).device
    cluster.add_pod(gpu_pod("hami-mig", assignment={"main": [(name, 9984, 100)]}, bound_at=1.0))
    [delivery] = app.allocator.allocate([[f"{gpu}::0"]])
    assert fake.mig_instances(0) == [("1g.10gb", 0, True)] and delivery.uuids[0].startswith("MIG-")
    assert delivery.mounts == ()  # hardware-isolated: no limiter


def test_live_placements_ignore_finished_pods() -> None:
    running = mig_pod("a", MIG_1G, [DynamicMigPlacement("GPU-x", "1g.10gb", 0).device])
    done = mig_pod("b", MIG_1G, [DynamicMigPlacement("GPU-x", "1g.10gb", 1).device], phase="Succeeded")
    assert live_placements([running, done], NODE) == {DynamicMigPlacement("GPU-x", "1g.10gb", 0)}


# -- over kubelet's gRPC API ---------------------------------------------------------------------------------


@pytest.fixture
def running(kubelet: KubeletStandIn, tmp_path: Any) -> Iterator[tuple[DevicePluginApp, FakeNvml, InMemoryCluster]]:
    app, fake, cluster = dynamic_app(tmp_path, str(kubelet.directory))
    app.start()
    yield app, fake, cluster
    app.stop()


def test_grpc_allocate_creates_the_instance_or_fails_with_the_reason(
    kubelet: KubeletStandIn, running: tuple[DevicePluginApp, FakeNvml, InMemoryCluster]
) -> None:
    app, fake, cluster = running
    kubelet.plugin(registrations=3)
    plugins = {connection.request.resource_name: connection for connection in kubelet.plugins}
    assert sorted(plugins) == [protocol.RESOURCE_GPU, MIG_1G, MIG_3G]
    kubelet.wait_for_devices(plugins[MIG_1G], lambda d: len(d) == 7, "seven 1g.10gb placements")
    gpu = app.state.gpus()[0].uuid
    failing = mig_pod("unlucky", MIG_1G, [DynamicMigPlacement(gpu, "1g.10gb", 3).device])
    cluster.add_pod(failing)
    fake.fail_next("nvmlGpuInstanceCreateComputeInstance")
    with pytest.raises(grpc.RpcError) as caught:
        kubelet.admit(plugins[MIG_1G], failing, MIG_1G)
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "creating its MIG instance failed" in (caught.value.details() or "")
    assert fake.mig_instances(0) == []
    cluster.delete_pod("default", "unlucky")
    pod = mig_pod("lucky", MIG_3G, [DynamicMigPlacement(gpu, "3g.40gb", 0).device], bound_at=2.0)
    cluster.add_pod(pod)
    [response] = kubelet.admit(plugins[MIG_3G], pod, MIG_3G)
    [(profile, start, has_compute)] = fake.mig_instances(0)
    assert (profile, start, has_compute) == ("3g.40gb", 0, True)
    assert response.envs[protocol.ENV_NVIDIA_VISIBLE_DEVICES].startswith("MIG-")


def test_fake_placements_buffer_is_checked() -> None:
    _fake, nvml, handle = started()
    count = ctypes.c_uint(1)
    small = (pynvml.c_nvmlGpuInstancePlacement_t * 1)()
    with pytest.raises(pynvml.NVMLError_InsufficientSize):
        nvml.lib.nvmlDeviceGetGpuInstancePossiblePlacements(handle, 19, small, ctypes.byref(count))
