"""Static MIG (issue 16): NVIDIA's profile tables (protocol.mig), the fake NVML's MIG calls built on them, discovery
of MIG devices and their publication in the inventory annotation (an optional, additive field of schema v1)."""

from __future__ import annotations

import logging
from dataclasses import replace

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kube_vgpu import protocol
from kube_vgpu.deviceplugin.discovery import discover
from kube_vgpu.deviceplugin.fakenvml import (
    A100_MIG_LAYOUTS,
    FakeGpu,
    FakeHardware,
    FakeNvml,
    layout_hardware,
    load_profile,
    mig_device_uuid,
)
from kube_vgpu.deviceplugin.nvml import NotFound, Nvml
from kube_vgpu.protocol import MigDevice, ProtocolError, mig

NODE = "node-m"

# -- the tables ------------------------------------------------------------------------------------------------

# Written out from NVIDIA's MIG user guide (Supported MIG Profiles; nvidia-smi mig -lgip/-lgipp), not from the code.
EXPECTED = {
    "A100-40GB": [("1g.5gb", 19, 14, 7), ("1g.5gb+me", 20, 14, 1), ("1g.10gb", 15, 14, 4), ("2g.10gb", 14, 28, 3),
                  ("3g.20gb", 9, 42, 2), ("4g.20gb", 5, 56, 1), ("7g.40gb", 0, 98, 1)],
    "A100-80GB": [("1g.10gb", 19, 14, 7), ("1g.10gb+me", 20, 14, 1), ("1g.20gb", 15, 14, 4), ("2g.20gb", 14, 28, 3),
                  ("3g.40gb", 9, 42, 2), ("4g.40gb", 5, 56, 1), ("7g.80gb", 0, 98, 1)],
    "H100-80GB": [("1g.10gb", 19, 16, 7), ("1g.10gb+me", 20, 16, 1), ("1g.20gb", 15, 26, 4), ("2g.20gb", 14, 32, 3),
                  ("3g.40gb", 9, 60, 2), ("4g.40gb", 5, 64, 1), ("7g.80gb", 0, 132, 1)],
    # read through NVML from a real NVIDIA H200 (143771 MiB, driver 580.159.04), the placements included
    "H200-141GB": [("1g.18gb", 19, 16, 7), ("1g.18gb+me", 20, 16, 1), ("1g.35gb", 15, 26, 4), ("2g.35gb", 14, 32, 3),
                   ("3g.71gb", 9, 60, 2), ("4g.71gb", 5, 64, 1), ("7g.141gb", 0, 132, 1)],
}
#: memorySizeMB per profile ID on that H200
H200_MEMORY_MIB = {19: 16384, 20: 16384, 15: 33280, 14: 33280, 9: 71424, 5: 71424, 0: 143360}
PLACEMENTS = {19: ((0, 1, 2, 3, 4, 5, 6), 1), 20: ((0, 1, 2, 3, 4, 5, 6), 1), 15: ((0, 2, 4, 6), 2),
              14: ((0, 2, 4), 2), 9: ((0, 4), 4), 5: ((0,), 4), 0: ((0,), 8)}
GPU_MEMORY_MIB = {"A100-40GB": 40960, "A100-80GB": 81920, "H100-80GB": 81559, "H200-141GB": 143771}
PRODUCT = {"A100-40GB": "NVIDIA A100-SXM4-40GB", "A100-80GB": "NVIDIA A100-SXM4-80GB",
           "H100-80GB": "NVIDIA H100 80GB HBM3", "H200-141GB": "NVIDIA H200"}


@pytest.mark.parametrize("model", mig.MIG_MODELS, ids=lambda m: m.key)
def test_profile_tables_are_nvidias(model: mig.MigModel) -> None:
    assert [(p.name, p.profile_id, p.multiprocessors, p.max_instances) for p in model.profiles] == EXPECTED[model.key]
    for profile in model.profiles:
        assert (profile.starts, profile.memory_slices) == PLACEMENTS[profile.profile_id]
        assert profile.name.startswith(f"{profile.compute_slices}g.")
        # the name NVIDIA's device plugin derives from NVML's numbers is the table's (+me is not told apart)
        assert mig.profile_name(profile.compute_slices, profile.memory_mib, GPU_MEMORY_MIB[model.key]) == (
            profile.name.removesuffix("+me"))
        if model.key == "H200-141GB":
            assert profile.memory_mib == H200_MEMORY_MIB[profile.profile_id]
        # as many instances fit on an empty GPU as there are legal placements (one media-extension instance)
        assert profile.max_instances == (1 if profile.name.endswith("+me") else len(profile.starts))


@pytest.mark.parametrize(("product", "memory_mib", "key"), [
    ("NVIDIA A100-SXM4-40GB", 40960, "A100-40GB"), ("NVIDIA A100-PCIE-40GB", 40960, "A100-40GB"),
    ("NVIDIA A100-SXM4-80GB", 81920, "A100-80GB"), ("NVIDIA A100 80GB PCIe", 81920, "A100-80GB"),
    ("NVIDIA H100 80GB HBM3", 81559, "H100-80GB"), ("NVIDIA H200", 143771, "H200-141GB"),
    ("Tesla T4", 15360, None), ("NVIDIA H100 NVL", 95830, None),
])  # fmt: skip
def test_models_are_found_by_name_and_memory(product: str, memory_mib: int, key: str | None) -> None:
    model = mig.mig_model(product, memory_mib)
    assert (model.key if model else None) == key


@pytest.mark.parametrize(("layout", "problem"), [
    ([("3g.20gb", 0), ("3g.20gb", 4)], None),
    ([("4g.20gb", 0), ("2g.10gb", 4), ("1g.5gb", 6)], None),
    ([("2g.10gb", 1)], "MIG profile 2g.10gb cannot start at slot 1 on A100-40GB (legal starts: (0, 2, 4))"),
    ([("4g.20gb", 4)], "MIG profile 4g.20gb cannot start at slot 4 on A100-40GB (legal starts: (0,))"),
    ([("3g.20gb", 0), ("1g.5gb", 3)], "MIG profile 1g.5gb at slot 3 overlaps 3g.20gb@0 (slot 3)"),
    ([("1g.5gb+me", 0), ("1g.5gb+me", 1)], "A100-40GB takes at most 1 MIG 1g.5gb+me instance(s)"),
    ([("3g.40gb", 0)], "A100-40GB has no MIG profile '3g.40gb' (it has 1g.5gb, 1g.5gb+me, 1g.10gb, 2g.10gb, "
                       "3g.20gb, 4g.20gb, 7g.40gb)"),
])  # fmt: skip
def test_legal_layouts(layout: list[tuple[str, int]], problem: str | None) -> None:
    assert mig.legal_layout(mig.A100_40GB, layout) == problem


@settings(max_examples=300, deadline=None)
@given(model=st.sampled_from(mig.MIG_MODELS), data=st.data())
def test_every_legal_layout_fits_the_hardware(model: mig.MigModel, data: st.DataObject) -> None:
    """Property: a layout the rules accept never uses more than the GPU's 7 compute slices, 8 memory slots, or more
    instances of a profile than the table allows."""
    placements = [(p.name, start) for p in model.profiles for start in p.starts]
    layout = data.draw(st.lists(st.sampled_from(placements), max_size=8))
    if mig.legal_layout(model, layout) is not None:
        return
    profiles = [model.profile(name) for name, _start in layout]
    assert all(profiles)
    assert sum(p.compute_slices for p in profiles if p) <= mig.MIG_COMPUTE_SLICES
    assert sum(p.memory_slices for p in profiles if p) <= mig.MIG_MEMORY_SLOTS
    for profile in model.profiles:
        assert sum(1 for name, _start in layout if name == profile.name) <= profile.max_instances


# -- the fake NVML -----------------------------------------------------------------------------------------------


def _mig_gpu(key: str, layout: tuple[tuple[str, int], ...], index: int = 0) -> FakeGpu:
    base = layout_hardware([f"GPU-{key}-{index}"], PRODUCT[key], GPU_MEMORY_MIB[key], "pcie").gpus[0]
    return replace(base, mig_capable=True, mig_enabled=True, mig_layout=layout)


def test_fake_refuses_a_layout_the_model_forbids() -> None:
    with pytest.raises(ValueError, match=r"MIG profile 2g.20gb cannot start at slot 6 on H100-80GB"):
        FakeNvml(FakeHardware(gpus=(_mig_gpu("H100-80GB", (("2g.20gb", 6),)),)))
    off = replace(_mig_gpu("A100-40GB", (("1g.5gb", 0),)), mig_enabled=False)
    with pytest.raises(ValueError, match=r"needs a MIG-capable model of protocol\.mig in MIG mode"):
        FakeNvml(FakeHardware(gpus=(off,)))


def test_fake_answers_mig_calls_as_nvml_does() -> None:
    fake = FakeNvml(load_profile("a100-mig", NODE))
    fake.nvmlInit()
    gpu = fake.nvmlDeviceGetHandleByIndex(0)
    assert fake.nvmlDeviceGetMaxMigDeviceCount(gpu) == 7
    device = fake.nvmlDeviceGetMigDeviceHandleByIndex(gpu, 0)
    assert fake.nvmlDeviceIsMigDeviceHandle(device) and not fake.nvmlDeviceIsMigDeviceHandle(gpu)
    assert fake.nvmlDeviceGetUUID(device).startswith("MIG-")
    assert fake.nvmlDeviceGetMemoryInfo(device).total == 20096 * 1024 * 1024  # 3g.20gb
    info = fake.nvmlGpuInstanceGetInfo(fake.nvmlDeviceGetGpuInstanceById(gpu, fake.nvmlDeviceGetGpuInstanceId(device)))
    assert (info.profileId, info.placement.start, info.placement.size) == (9, 4, 4)
    with pytest.raises(NotFound):
        fake.nvmlDeviceGetMigDeviceHandleByIndex(gpu, 4)  # four instances on GPU 0
    with pytest.raises(fake.NVMLError_InvalidArgument):
        fake.nvmlDeviceGetMigDeviceHandleByIndex(gpu, 7)
    # MIG-capable, MIG off: as a real H200 answers (driver 580): count 0, every index and GPU instance NotFound
    plain = fake.nvmlDeviceGetHandleByIndex(2)
    assert fake.nvmlDeviceGetMaxMigDeviceCount(plain) == 0
    for index in (0, 7):
        with pytest.raises(NotFound):
            fake.nvmlDeviceGetMigDeviceHandleByIndex(plain, index)
    with pytest.raises(NotFound):
        fake.nvmlDeviceGetGpuInstanceById(plain, 1)
    with pytest.raises(fake.NVMLError_NotSupported):
        fake.nvmlDeviceGetAttributes(plain)
    with pytest.raises(fake.NVMLError_InvalidArgument):
        fake.nvmlDeviceGetGpuInstanceId(plain)  # not a MIG device


# -- discovery and the inventory ---------------------------------------------------------------------------------


def test_discovery_publishes_each_mig_device_with_profile_placement_and_uuid() -> None:
    inventory = discover(Nvml(FakeNvml(load_profile("a100-mig", NODE)))).inventory
    first, second, third, _fourth = inventory.gpus
    assert [(d.profile, d.start, d.size, d.memory_mib, d.multiprocessors) for d in first.mig_devices] == [
        ("3g.20gb", 4, 4, 20096, 42), ("2g.10gb", 0, 2, 9984, 28), ("1g.5gb", 2, 1, 4864, 14),
        ("1g.5gb", 3, 1, 4864, 14)]
    assert [d.uuid for d in first.mig_devices] == [mig_device_uuid(first.uuid, gi) for gi in (1, 2, 3, 4)]
    assert [(d.gpu_instance, d.compute_instance) for d in first.mig_devices] == [(1, 0), (2, 0), (3, 0), (4, 0)]
    assert [(d.profile, d.start) for d in second.mig_devices] == list(A100_MIG_LAYOUTS[1])
    assert third.mig_devices == () and not third.mig_mode
    # published and read back unchanged
    assert protocol.decode_inventory(protocol.encode_inventory(inventory)) == inventory


@pytest.mark.parametrize(("key", "layout"), [
    ("A100-80GB", (("3g.40gb", 0), ("2g.20gb", 4), ("1g.10gb", 6))),
    ("H100-80GB", (("3g.40gb", 0), ("2g.20gb", 4), ("1g.10gb", 6))),
    ("H200-141GB", (("3g.71gb", 4), ("1g.35gb", 0), ("1g.18gb", 2), ("1g.18gb", 3))),
])  # fmt: skip
def test_discovery_names_the_profiles_of_each_model(key: str, layout: tuple[tuple[str, int], ...]) -> None:
    model = next(m for m in mig.MIG_MODELS if m.key == key)
    (gpu,) = discover(Nvml(FakeNvml(FakeHardware(gpus=(_mig_gpu(key, layout),))))).inventory.gpus
    assert [(d.profile, d.start, d.memory_mib) for d in gpu.mig_devices] == [
        (name, start, p.memory_mib) for name, start in layout if (p := model.profile(name))]


def test_a_failing_mig_query_publishes_no_mig_device_and_says_why(caplog: pytest.LogCaptureFixture) -> None:
    failing = replace(_mig_gpu("A100-40GB", (("7g.40gb", 0),)), failing=(("nvmlDeviceGetAttributes", "Unknown"),))
    with caplog.at_level(logging.WARNING):
        found = discover(Nvml(FakeNvml(FakeHardware(gpus=(failing,)))))
    (gpu,) = found.inventory.gpus
    assert gpu.mig_mode and gpu.mig_devices == ()
    assert any("its MIG devices cannot be listed" in line and "none are offered" in line for line in found.problems)


def test_a_lost_mig_gpu_is_published_unhealthy() -> None:
    lost = replace(_mig_gpu("A100-40GB", (("7g.40gb", 0),)),
                   failing=(("nvmlDeviceGetMigDeviceHandleByIndex", "GpuIsLost"),))
    (gpu,) = discover(Nvml(FakeNvml(FakeHardware(gpus=(lost,))))).inventory.gpus
    assert not gpu.healthy and gpu.mig_devices == ()


def test_inventories_without_mig_devices_are_encoded_as_before() -> None:
    inventory = discover(Nvml(FakeNvml(load_profile("t4-4-pcie", NODE)))).inventory
    text = protocol.encode_inventory(inventory)
    assert "migDevices" not in text and orjson.loads(text)["v"] == 1


def test_an_inventory_from_before_mig_devices_reads_as_having_none() -> None:
    inventory = discover(Nvml(FakeNvml(load_profile("a100-mig", NODE)))).inventory
    doc = orjson.loads(protocol.encode_inventory(inventory))
    for gpu in doc["gpus"]:
        gpu.pop("migDevices", None)  # what a device plugin before issue 16 wrote
    read = protocol.decode_inventory(orjson.dumps(doc).decode())
    assert [g.mig_mode for g in read.gpus] == [True, True, False, False]
    assert all(g.mig_devices == () for g in read.gpus)


def _with_mig(devices: list[object], *, mig_mode: bool = True) -> str:
    gpu = {"uuid": "GPU-a", "index": 0, "model": "NVIDIA A100-SXM4-40GB", "memoryMiB": 40960, "cores": 100,
           "maxShares": 10, "numa": None, "pciBusId": "", "healthy": True, "mig": mig_mode, "links": [],
           "migDevices": devices}
    return orjson.dumps({"v": 1, "gpus": [gpu]}).decode()


GOOD = ["MIG-1", "3g.20gb", 1, 0, 20096, 42, 4, 4]


@pytest.mark.parametrize(("devices", "mig_mode", "message"), [
    ([GOOD], False, "inventory gpus[0]: lists MIG devices but is not in MIG mode ('mig' is false)"),
    ([GOOD[:7]], True, "inventory gpus[0] migDevices[0]: must be [uuid, profile, gpuInstance, computeInstance, "
                       "memoryMiB, multiprocessors, start, size]"),
    ([GOOD, ["MIG-2", "1g.5gb", 2, 0, 4864, 14, 6, 1]], True,
     "inventory gpus[0] migDevices[1]: memory slot 6 is also used by MIG-1"),
    ([GOOD, ["MIG-1", "1g.5gb", 2, 0, 4864, 14, 0, 1]], True, "inventory gpus[0] migDevices[1]: duplicate UUID MIG-1"),
    ([["GPU-a", "1g.5gb", 2, 0, 4864, 14, 0, 1]], True, "inventory gpus[0] migDevices[0]: duplicate UUID GPU-a"),
    ([GOOD, ["MIG-2", "1g.5gb", 1, 0, 4864, 14, 0, 1]], True,
     "inventory gpus[0] migDevices[1]: GPU instance 1 compute instance 0 is described twice"),
    ([["MIG-1", "big", 1, 0, 20096, 42, 4, 4]], True,
     "inventory gpus[0] migDevices[0]: profile 'big' is not a MIG profile name like 3g.20gb"),
    ([["MIG-1", "3g.20gb", 1, 0, 20096, 42, 6, 4]], True,
     "inventory gpus[0] migDevices[0]: field 'size' must be between 1 and 2, got 4"),
    ([["MIG-1", "3g.20gb", 1, 0, 99999, 42, 4, 4]], True,
     "inventory gpus[0] migDevices[0]: field 'memoryMiB' must be between 1 and 40960, got 99999"),
    ("x", True, "inventory gpus[0]: field 'migDevices' must be a list"),
])  # fmt: skip
def test_bad_mig_devices_are_refused_naming_the_field(devices: object, mig_mode: bool, message: str) -> None:
    with pytest.raises(ProtocolError) as caught:
        protocol.decode_inventory(_with_mig(devices if isinstance(devices, str) else list(devices),
                                            mig_mode=mig_mode))
    assert str(caught.value) == message


def test_a_good_mig_device_decodes() -> None:
    (gpu,) = protocol.decode_inventory(_with_mig([GOOD])).gpus
    assert gpu.mig_devices == (MigDevice("MIG-1", "3g.20gb", 1, 0, 20096, 42, 4, 4),)
