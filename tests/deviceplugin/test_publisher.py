"""Inventory publisher: writes only on change, heartbeats, GFD labels; byte-identical to `cluster synth`."""

from __future__ import annotations

import datetime as dt
import threading

import orjson

from kube_vgpu import protocol
from kube_vgpu.cli import main as kube_vgpu_main
from kube_vgpu.dev.fixtures import node_object, synth_inventory
from kube_vgpu.dev.fixtures.inmemory_api import InMemoryCluster
from kube_vgpu.deviceplugin.discovery import discover
from kube_vgpu.deviceplugin.nvml import open_nvml
from kube_vgpu.deviceplugin.publisher import Publisher
from kube_vgpu.deviceplugin.state import DeviceState
from tests.deviceplugin.builders import wait_until

MOMENT = dt.datetime(2026, 1, 31, 12, 0, 0, tzinfo=dt.UTC)


def bare_node(name: str) -> dict:
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": {"kubernetes.io/os": "linux"}}}


def publisher_for(cluster: InMemoryCluster, node: str, profile: str, **kwargs: object) -> Publisher:
    state = DeviceState(discover(open_nvml(profile, node)).inventory)
    return Publisher(node, cluster, state, clock=lambda: MOMENT, **kwargs)  # type: ignore[arg-type]


def test_writes_inventory_labels_and_heartbeat_then_only_heartbeats() -> None:
    cluster = InMemoryCluster()
    cluster.add_node(bare_node("n1"))
    publisher = publisher_for(cluster, "n1", "t4-4-pcie")
    assert publisher.publish_once() is True
    assert publisher.publish_once() is False
    first, second = cluster.node_patches
    assert set(first[1]) == {protocol.NODE_INVENTORY_ANNOTATION, protocol.NODE_HEARTBEAT_ANNOTATION}
    assert first[2] == {
        "nvidia.com/gpu.product": "Tesla-T4",
        "nvidia.com/gpu.count": "4",
        "nvidia.com/gpu.memory": "15360",
    }
    assert second == ("n1", {protocol.NODE_HEARTBEAT_ANNOTATION: "2026-01-31T12:00:00Z"}, {})
    node = cluster.get_node("n1")
    assert node["metadata"]["labels"]["kubernetes.io/os"] == "linux"  # other labels untouched
    inventory = protocol.decode_inventory(node["metadata"]["annotations"][protocol.NODE_INVENTORY_ANNOTATION])
    assert len(inventory.gpus) == 4


def test_a_health_change_is_published_and_rewrites_the_inventory() -> None:
    cluster = InMemoryCluster()
    cluster.add_node(bare_node("n1"))
    publisher = publisher_for(cluster, "n1", "t4-4-pcie")
    publisher.publish_once()
    bad = publisher.state.uuids()[2]
    publisher.state.mark_unhealthy(bad, "critical XID 79")
    assert publisher.publish_once() is True
    text = cluster.get_node("n1")["metadata"]["annotations"][protocol.NODE_INVENTORY_ANNOTATION]
    assert [g.healthy for g in protocol.decode_inventory(text).gpus] == [True, True, False, True]
    assert publisher.inventory_writes == 2


def test_the_running_publisher_wakes_on_health_changes_well_before_its_heartbeat() -> None:
    cluster = InMemoryCluster()
    cluster.add_node(bare_node("n1"))
    # an hour between heartbeats: only the state change can explain a second inventory write
    publisher = publisher_for(cluster, "n1", "a100-4-nvlink-pairs", heartbeat_seconds=3600)
    stop = threading.Event()
    thread = threading.Thread(target=publisher.run, args=(stop,), daemon=True)
    thread.start()
    try:
        wait_until(publisher.published.is_set, "the first publish")
        publisher.state.mark_unhealthy(publisher.state.uuids()[0], "GPU is lost (NVML)")

        def published_unhealthy() -> bool:
            text = cluster.get_node("n1")["metadata"]["annotations"][protocol.NODE_INVENTORY_ANNOTATION]
            return not protocol.decode_inventory(text).gpus[0].healthy

        wait_until(published_unhealthy, "the unhealthy GPU in the node's inventory annotation")
    finally:
        stop.set()
        publisher.state.wake_all()
        thread.join(10)
    assert not thread.is_alive()


def test_labels_are_removed_when_the_gpus_are_gone() -> None:
    cluster = InMemoryCluster()
    node = bare_node("n1")
    node["metadata"]["labels"].update({protocol.LABEL_GPU_COUNT: "4", protocol.LABEL_GPU_PRODUCT: "Tesla-T4"})
    cluster.add_node(node)
    publisher_for(cluster, "n1", "missing-library").publish_once()
    stored = cluster.get_node("n1")["metadata"]
    assert protocol.LABEL_GPU_COUNT not in stored["labels"]
    assert protocol.decode_inventory(stored["annotations"][protocol.NODE_INVENTORY_ANNOTATION]).gpus == ()


def test_golden_publisher_and_cluster_synth_write_byte_identical_annotations() -> None:
    node = "gpu-node-00000"
    # the publisher, running on fake NVML for an 8-GPU NVSwitch H100 node
    cluster = InMemoryCluster()
    cluster.add_node(bare_node(node))
    publisher_for(cluster, node, "dgx-h100-8").publish_once()
    published = cluster.get_node(node)["metadata"]
    # `kube-vgpu cluster synth` for the same hardware, through the real CLI
    import contextlib
    import io

    out = io.BytesIO()
    with contextlib.redirect_stdout(io.TextIOWrapper(out, write_through=True)) as wrapper:
        code = kube_vgpu_main(
            [
                "cluster",
                "synth",
                "--nodes",
                "1",
                "--gpus-per-node",
                "8",
                "--gpu-model",
                "NVIDIA H100 80GB HBM3",
                "--gpu-memory-mib",
                "81559",
                "--topology",
                "nvswitch",
            ]
        )
        wrapper.flush()
    assert code == 0
    synth_node = orjson.loads(out.getvalue())["items"][0]
    key = protocol.NODE_INVENTORY_ANNOTATION
    assert published["annotations"][key].encode() == synth_node["metadata"]["annotations"][key].encode()
    for label in (protocol.LABEL_GPU_PRODUCT, protocol.LABEL_GPU_COUNT, protocol.LABEL_GPU_MEMORY_MIB):
        assert published["labels"][label] == synth_node["metadata"]["labels"][label]


def test_a_node_registered_by_synth_is_not_rewritten_by_the_publisher() -> None:
    # the dev cluster registers nodes with node_object(synth_inventory(...)); a plugin starting on such a node
    # finds its inventory already there and only heartbeats
    cluster = InMemoryCluster()
    inventory = synth_inventory("n1", 4, "Tesla T4", 15360, "pcie")
    cluster.add_node(node_object("n1", inventory, heartbeat=MOMENT))
    publisher = publisher_for(cluster, "n1", "t4-4-pcie")
    assert publisher.publish_once() is False
    assert cluster.node_patches == [("n1", {protocol.NODE_HEARTBEAT_ANNOTATION: "2026-01-31T12:00:00Z"}, {})]


def test_external_pods_round_trip_and_keep_old_encodings_unchanged() -> None:
    state = DeviceState(synth_inventory("n1", 2, "X", 1000, "pcie"))
    plain = protocol.encode_inventory(state.inventory())
    assert '"external"' not in plain
    uuid = state.uuids()[1]
    assert state.set_external_pods({uuid: ("ns/b", "ns/a")}) is True
    assert state.set_external_pods({uuid: ("ns/a", "ns/b")}) is False  # same set: no change
    text = protocol.encode_inventory(state.inventory())
    decoded = protocol.decode_inventory(text)
    assert [g.external_pods for g in decoded.gpus] == [(), ("ns/a", "ns/b")]
    assert protocol.encode_inventory(decoded) == text
