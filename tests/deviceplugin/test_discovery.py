"""Discovery against every fake profile (exact topology matrices) and the degraded paths."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from kube_vgpu import protocol
from kube_vgpu.dev.fixtures import synth_inventory, synth_uuid
from kube_vgpu.deviceplugin.discovery import discover
from kube_vgpu.deviceplugin.fakenvml import FakeGpu, FakeHardware, FakeNvml, layout_hardware
from kube_vgpu.deviceplugin.nvml import Nvml, open_nvml
from kube_vgpu.protocol import NodeInventory, PcieLevel

NODE = "node-x"
_LEVEL = {
    "B": PcieLevel.SAME_BOARD,
    "S": PcieLevel.SINGLE_SWITCH,
    "M": PcieLevel.MULTI_SWITCH,
    "H": PcieLevel.HOST_BRIDGE,
    "N": PcieLevel.SAME_NUMA,
    "X": PcieLevel.CROSS_NUMA,
}


def matrix(text: str) -> list[list[str]]:
    return [row.split() for row in text.strip().splitlines()]


def pcie_matrix(inventory: NodeInventory) -> list[list[str]]:
    letter = {level: key for key, level in _LEVEL.items()}
    size = len(inventory.gpus)
    rows = []
    for a in range(size):
        row = []
        for b in range(size):
            link = inventory.link(a, b)
            row.append("." if link is None else letter[link.pcie])
        rows.append(row)
    return rows


def nvlink_matrix(inventory: NodeInventory) -> list[list[str]]:
    """'.' self, '0' none, 'n' direct lanes, 'n*' lanes through an NVSwitch."""
    size = len(inventory.gpus)
    rows = []
    for a in range(size):
        row = []
        for b in range(size):
            link = inventory.link(a, b)
            row.append("." if link is None else f"{link.nvlinks}{'*' if link.via_nvswitch else ''}")
        rows.append(row)
    return rows


FOUR_GPU_PCIE = """
.  S  X  X
S  .  X  X
X  X  .  S
X  X  S  .
"""


def profile(name: str, sharing_count: int = 10) -> NodeInventory:
    return discover(open_nvml(name, NODE), sharing_count=sharing_count).inventory


def test_dgx_h100_8_nvswitch() -> None:
    inventory = profile("dgx-h100-8", sharing_count=7)
    assert pcie_matrix(inventory) == matrix("""
        .  S  H  H  X  X  X  X
        S  .  H  H  X  X  X  X
        H  H  .  S  X  X  X  X
        H  H  S  .  X  X  X  X
        X  X  X  X  .  S  H  H
        X  X  X  X  S  .  H  H
        X  X  X  X  H  H  .  S
        X  X  X  X  H  H  S  .
    """)
    assert nvlink_matrix(inventory) == [["." if a == b else "18*" for b in range(8)] for a in range(8)]
    assert [g.numa_node for g in inventory.gpus] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert {(g.model, g.memory_mib, g.max_vgpus, g.healthy, g.mig_mode) for g in inventory.gpus} == {
        ("NVIDIA H100 80GB HBM3", 81559, 7, True, False)
    }
    assert [g.uuid for g in inventory.gpus] == [synth_uuid(NODE, i) for i in range(8)]
    assert [g.pci_bus_id for g in inventory.gpus][:2] == ["00000000:10:00.0", "00000000:20:00.0"]


def test_a100_4_nvlink_pairs() -> None:
    inventory = profile("a100-4-nvlink-pairs")
    assert pcie_matrix(inventory) == matrix(FOUR_GPU_PCIE)
    assert nvlink_matrix(inventory) == matrix("""
        .   12  0   0
        12  .   0   0
        0   0   .   12
        0   0   12  .
    """)
    assert [g.numa_node for g in inventory.gpus] == [0, 0, 1, 1]


def test_t4_4_pcie_has_no_nvlink() -> None:
    inventory = profile("t4-4-pcie")
    assert pcie_matrix(inventory) == matrix(FOUR_GPU_PCIE)
    assert nvlink_matrix(inventory) == matrix("""
        .  0  0  0
        0  .  0  0
        0  0  .  0
        0  0  0  .
    """)
    assert {(g.model, g.memory_mib) for g in inventory.gpus} == {("Tesla T4", 15360)}


def test_a100_mig_marks_mig_gpus_and_full_nvlink_mesh() -> None:
    inventory = profile("a100-mig")
    assert [g.mig_mode for g in inventory.gpus] == [True, True, False, False]
    assert pcie_matrix(inventory) == matrix(FOUR_GPU_PCIE)
    assert nvlink_matrix(inventory) == matrix("""
        .  4  4  4
        4  .  4  4
        4  4  .  4
        4  4  4  .
    """)


@pytest.mark.parametrize(
    ("profile_name", "gpus", "model", "memory_mib", "topology"),
    [
        ("dgx-h100-8", 8, "NVIDIA H100 80GB HBM3", 81559, "nvswitch"),
        ("a100-4-nvlink-pairs", 4, "NVIDIA A100 80GB PCIe", 81920, "nvlink-pairs"),
        ("t4-4-pcie", 4, "Tesla T4", 15360, "pcie"),
    ],
)
def test_cluster_synth_describes_the_same_hardware_identically(
    profile_name: str, gpus: int, model: str, memory_mib: int, topology: str
) -> None:
    assert synth_inventory(NODE, gpus, model, memory_mib, topology) == profile(profile_name)


def test_synth_output_is_unchanged_from_its_direct_construction() -> None:
    # recorded from synth_inventory before it ran discovery on a fake NVML: existing snapshots stay valid
    expected = (
        '{"v":1,"gpus":[{"uuid":"GPU-7f2dfaf7-66d1-fddc-4f3f-b64f6048037b","index":0,"model":"NVIDIA-A100-SXM4-80GB",'
        '"memoryMiB":81920,"cores":100,"maxShares":10,"numa":0,"pciBusId":"00000000:10:00.0","healthy":true,'
        '"mig":false,"links":[[1,0,false,"single-switch"],[2,0,false,"cross-numa"],[3,0,false,"cross-numa"]]},'
        '{"uuid":"GPU-392095e2-745a-2405-7475-b1bd9eccc612","index":1,"model":"NVIDIA-A100-SXM4-80GB",'
        '"memoryMiB":81920,"cores":100,"maxShares":10,"numa":0,"pciBusId":"00000000:20:00.0","healthy":true,'
        '"mig":false,"links":[[0,0,false,"single-switch"],[2,0,false,"cross-numa"],[3,0,false,"cross-numa"]]},'
        '{"uuid":"GPU-6775dbfe-2319-9de5-6841-c6cec4580c56","index":2,"model":"NVIDIA-A100-SXM4-80GB",'
        '"memoryMiB":81920,"cores":100,"maxShares":10,"numa":1,"pciBusId":"00000000:30:00.0","healthy":true,'
        '"mig":false,"links":[[0,0,false,"cross-numa"],[1,0,false,"cross-numa"],[3,0,false,"single-switch"]]},'
        '{"uuid":"GPU-b09b9afa-8c32-ecca-340c-e137aa0f71a6","index":3,"model":"NVIDIA-A100-SXM4-80GB",'
        '"memoryMiB":81920,"cores":100,"maxShares":10,"numa":1,"pciBusId":"00000000:40:00.0","healthy":true,'
        '"mig":false,"links":[[0,0,false,"cross-numa"],[1,0,false,"cross-numa"],[2,0,false,"single-switch"]]}]}'
    )
    assert protocol.encode_inventory(synth_inventory("node-a", 4, "NVIDIA-A100-SXM4-80GB", 81920, "pcie")) == expected


def test_odd_gpu_counts_split_pairs_across_numa_nodes() -> None:
    inventory = synth_inventory(NODE, 5, "X", 1000, "nvlink-pairs")
    # 3 GPUs on NUMA 0, 2 on NUMA 1; GPUs 2 and 3 share a bridge but not a NUMA node
    assert pcie_matrix(inventory) == matrix("""
        .  S  H  X  X
        S  .  H  X  X
        H  H  .  X  X
        X  X  X  .  H
        X  X  X  H  .
    """)
    assert nvlink_matrix(inventory)[2][3] == "12"


def test_from_file_layout_and_explicit_gpus(tmp_path: Path) -> None:
    layout = tmp_path / "layout.json"
    layout.write_text(json.dumps({"layout": {"gpus": 2, "model": "NVIDIA L4", "memoryMiB": 23034, "topology": "pcie"}}))
    assert discover(open_nvml(f"from-file:{layout}", NODE)).inventory == synth_inventory(
        NODE, 2, "NVIDIA L4", 23034, "pcie"
    )
    explicit = tmp_path / "explicit.json"
    explicit.write_text(
        json.dumps(
            {
                "gpus": [
                    {"name": "A", "memoryMiB": 1000, "pciePath": ["numa:0", "hostbridge:0", "switch:0", "switch:1"]},
                    {"name": "A", "memoryMiB": 1000, "pciePath": ["numa:0", "hostbridge:0", "switch:0"]},
                    {"name": "A", "memoryMiB": 1000, "pciePath": ["numa:0", "hostbridge:1"], "nvlinkPeers": {"0": 2}},
                    {"name": "A", "memoryMiB": 1000, "pciePath": ["numa:0", "hostbridge:1", "board:7"]},
                    {"name": "A", "memoryMiB": 1000, "pciePath": ["numa:0", "hostbridge:1", "board:7"]},
                ]
            }
        )
    )
    inventory = discover(open_nvml(f"from-file:{explicit}", NODE)).inventory
    assert pcie_matrix(inventory) == matrix("""
        .  M  N  N  N
        M  .  N  N  N
        N  N  .  H  H
        N  N  H  .  B
        N  N  H  B  .
    """)
    # GPU 2 reports two lanes to GPU 0; GPU 0 describes no lanes of its own (each side reports what it sees)
    assert inventory.link(2, 0).nvlinks == 2  # type: ignore[union-attr]


def test_from_file_rejects_unknown_profiles_errors_and_pcie_kinds(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown fake NVML profile"):
        open_nvml("dgx-a100-9", NODE)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"gpus": [{"name": "A", "memoryMiB": 1, "failing": {"nvmlDeviceGetUUID": "Oops"}}]}))
    with pytest.raises(ValueError, match="unknown error names"):
        open_nvml(f"from-file:{bad}", NODE)
    path = ["numa", "hostbridge:0", "rack:3"]  # no id, then an unknown kind
    bad.write_text(json.dumps({"gpus": [{"name": "A", "memoryMiB": 1, "pciePath": path}]}))
    with pytest.raises(ValueError, match=r"pciePath elements \['numa', 'rack:3'\] are not KIND:ID"):
        open_nvml(f"from-file:{bad}", NODE)


# --- degraded paths --------------------------------------------------------------------------------------------


def _nvml(hardware: FakeHardware) -> Nvml:
    return Nvml(FakeNvml(hardware))


def _four(topology: str = "nvlink-pairs") -> FakeHardware:
    return layout_hardware([synth_uuid(NODE, i) for i in range(4)], "GPU", 1000, topology)


def test_missing_library_gives_an_empty_inventory_with_a_clear_log(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        result = discover(open_nvml("missing-library", NODE))
    assert result.inventory.gpus == ()
    assert not result.nvml_available
    assert "libnvidia-ml.so.1 not found" in caplog.text


def test_numa_falls_back_to_sysfs_when_nvml_lacks_the_function(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    hardware = FakeHardware(gpus=_four().gpus, missing_functions=frozenset({"nvmlDeviceGetNumaNodeId"}))
    for index, numa in ((0, "1"), (1, "0"), (2, "-1")):  # GPU 3: no sysfs entry at all
        device = tmp_path / "bus" / "pci" / "devices" / f"0000:{0x10 + index * 0x10:02x}:00.0"
        device.mkdir(parents=True)
        (device / "numa_node").write_text(numa + "\n")
    with caplog.at_level(logging.WARNING):
        result = discover(_nvml(hardware), sysfs_root=tmp_path)
    assert [g.numa_node for g in result.inventory.gpus] == [1, 0, None, None]
    assert caplog.text.count("cannot report NUMA nodes") == 1  # said once, not per GPU
    assert any("Function Not Found" in line for line in result.problems)


def test_unsupported_topology_query_gives_pessimistic_levels(caplog: pytest.LogCaptureFixture) -> None:
    gpus = tuple(
        FakeGpu(
            **{
                **{f: getattr(g, f) for f in g.__dataclass_fields__},
                "unsupported": frozenset({"nvmlDeviceGetTopologyCommonAncestor"}),
            }
        )
        for g in _four().gpus
    )
    with caplog.at_level(logging.WARNING):
        inventory = discover(_nvml(FakeHardware(gpus=gpus))).inventory
    # never closer than known: same NUMA node, or across
    assert pcie_matrix(inventory) == matrix("""
        .  N  X  X
        N  .  X  X
        X  X  .  N
        X  X  N  .
    """)
    assert "PCIe common ancestors" in caplog.text
    assert nvlink_matrix(inventory)[0][1] == "12"


def test_old_driver_without_remote_device_type_still_finds_nvswitch_and_peers() -> None:
    missing = frozenset({"nvmlDeviceGetNvLinkRemoteDeviceType"})
    for topology, expected in (("nvswitch", "18*"), ("nvlink-pairs", "12")):
        hardware = FakeHardware(gpus=_four(topology).gpus, missing_functions=missing)
        result = discover(_nvml(hardware))
        assert nvlink_matrix(result.inventory)[0][1] == expected
        assert any("remote device types" in line for line in result.problems)


def test_lost_gpus_are_dropped_or_kept_unhealthy(caplog: pytest.LogCaptureFixture) -> None:
    gpus = list(_four().gpus)
    gpus[1] = FakeGpu(**{**{f: getattr(gpus[1], f) for f in gpus[1].__dataclass_fields__}, "lost": True})
    # GPU 3 answers its identity, then is lost: kept, unhealthy
    gpus[3] = FakeGpu(
        **{
            **{f: getattr(gpus[3], f) for f in gpus[3].__dataclass_fields__},
            "failing": (("nvmlDeviceGetPciInfo", "GpuIsLost"),),
        }
    )
    with caplog.at_level(logging.WARNING):
        result = discover(_nvml(FakeHardware(gpus=tuple(gpus))))
    inventory = result.inventory
    assert [g.index for g in inventory.gpus] == [0, 2, 3]
    assert [g.healthy for g in inventory.gpus] == [True, True, False]
    assert "GPU at NVML index 1 cannot be identified (GPU is lost)" in caplog.text
    assert "GPU 3" in caplog.text and "is lost" in caplog.text
    # links to the lost GPU are estimated, not queried; its NUMA node was never read, so: the farthest level
    assert inventory.gpus[2].numa_node is None
    assert inventory.link(2, 3).pcie == PcieLevel.CROSS_NUMA  # type: ignore[union-attr]
    assert set(result.handles) == {g.uuid for g in inventory.gpus}


def test_mig_query_not_supported_means_mig_off() -> None:
    inventory = profile("t4-4-pcie")
    assert not any(g.mig_mode for g in inventory.gpus)


def test_fake_raises_pynvmls_own_exception_classes() -> None:
    import pynvml

    fake = FakeNvml(_four("pcie"))
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        fake.nvmlDeviceGetCount()
    fake.nvmlInit()
    handle = fake.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        fake.nvmlDeviceGetNvLinkState(handle, 0)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        fake.nvmlDeviceGetHandleByIndex(9)
    fake.lose_gpu(0)
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        fake.nvmlDeviceGetUUID(handle)
    with pytest.raises(AttributeError, match="does not implement"):
        fake.nvmlDeviceGetEnforcedPowerLimit  # noqa: B018
    assert fake.NVML_TOPOLOGY_SYSTEM == pynvml.NVML_TOPOLOGY_SYSTEM
