"""The device plugin's limiter label: set while the installed library is intact, removed when it is missing or
corrupt; the simulated nodes (fake NVML) carry it as installed."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

from kube_vgpu import protocol
from kube_vgpu.dev.fixtures.inmemory_api import InMemoryCluster
from kube_vgpu.deviceplugin.app import PluginConfig, _limiter_state
from kube_vgpu.deviceplugin.discovery import discover
from kube_vgpu.deviceplugin.limiter_install import LIBRARY_NAME, VERSIONS_DIR, install
from kube_vgpu.deviceplugin.nvml import open_nvml
from kube_vgpu.deviceplugin.publisher import Publisher
from kube_vgpu.deviceplugin.state import DeviceState
from tests.deviceplugin.test_limiter_install import make_source, name_of

MOMENT = dt.datetime(2026, 1, 31, 12, 0, 0, tzinfo=dt.UTC)


def _publisher(cluster: InMemoryCluster, config: PluginConfig) -> Publisher:
    state = DeviceState(discover(open_nvml("t4-4-pcie", "n1")).inventory)
    return Publisher("n1", cluster, state, clock=lambda: MOMENT, limiter_label=config.limiter_label,
                     limiter_state=_limiter_state(config))


def _labels(cluster: InMemoryCluster) -> dict[str, str]:
    return dict(cluster.get_node("n1")["metadata"].get("labels") or {})


def test_the_label_follows_the_installed_library(tmp_path: Path) -> None:
    host, proc = tmp_path / "vgpu", tmp_path / "proc"
    proc.mkdir()
    cluster = InMemoryCluster()
    cluster.add_node({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "n1", "labels": {}}})
    publisher = _publisher(cluster, PluginConfig("n1", limiter_label=protocol.LABEL_LIMITER, limiter_dir=str(host)))
    publisher.publish_once()
    assert protocol.LABEL_LIMITER not in _labels(cluster)  # nothing installed yet
    install(make_source(tmp_path / "s1", "v1", b"one"), host, proc_dir=proc)
    publisher.publish_once()
    assert _labels(cluster)[protocol.LABEL_LIMITER] == name_of("v1", b"one")
    patches = len(cluster.node_patches)
    publisher.publish_once()
    assert cluster.node_patches[patches:][0][2] == {}  # unchanged: the heartbeat alone
    install(make_source(tmp_path / "s2", "v2", b"two"), host, proc_dir=proc)
    publisher.publish_once()
    assert _labels(cluster)[protocol.LABEL_LIMITER] == name_of("v2", b"two")
    (host / VERSIONS_DIR / name_of("v2", b"two") / LIBRARY_NAME).write_bytes(b"damaged")
    publisher.publish_once()
    assert protocol.LABEL_LIMITER not in _labels(cluster)  # corrupt: new pods go elsewhere
    install(make_source(tmp_path / "s2", "v2", b"two"), host, proc_dir=proc)  # repaired (a restart of the pod)
    publisher.publish_once()
    assert _labels(cluster)[protocol.LABEL_LIMITER] == name_of("v2", b"two")
    (host / LIBRARY_NAME).unlink()
    publisher.publish_once()
    assert protocol.LABEL_LIMITER not in _labels(cluster)
    assert _labels(cluster)[protocol.LABEL_GPU_COUNT] == "4"  # the GPU labels stay


def test_simulated_nodes_carry_the_label_and_an_unmanaged_label_is_left_alone(tmp_path: Path) -> None:
    cluster = InMemoryCluster()
    cluster.add_node({"apiVersion": "v1", "kind": "Node",
                      "metadata": {"name": "n1", "labels": {protocol.LABEL_LIMITER: "by-hand"}}})
    _publisher(cluster, PluginConfig("n1", limiter_label="")).publish_once()
    assert _labels(cluster)[protocol.LABEL_LIMITER] == "by-hand"
    simulated = PluginConfig("n1", limiter_label=protocol.LABEL_LIMITER, limiter_simulated=True)
    _publisher(cluster, simulated).publish_once()
    assert _labels(cluster)[protocol.LABEL_LIMITER] == protocol.LIMITER_LABEL_SIMULATED
