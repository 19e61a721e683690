"""Pods that bypassed kube-vgpu: reported once, and the GPUs they hold (per kubelet's pod-resources API, over
real gRPC) published as fully used."""

from __future__ import annotations

from pathlib import Path

import pytest

from kube_vgpu import protocol
from kube_vgpu.dev.fixtures import synth_inventory
from kube_vgpu.dev.fixtures.inmemory_api import InMemoryCluster
from kube_vgpu.deviceplugin.foreign import EVENT_REASON, ForeignPodMonitor, PodResourcesClient, uuids_in_device_ids
from kube_vgpu.deviceplugin.kube import ApiUnavailable
from kube_vgpu.deviceplugin.state import DeviceState
from tests.deviceplugin.builders import NODE, gpu_pod
from tests.deviceplugin.kubelet import PodResourcesStandIn


def test_device_ids_of_any_nvidia_plugin_name_their_gpus() -> None:
    uuid = "GPU-fef8089b-4820-abfc-e83e-94318197576e"
    assert uuids_in_device_ids([uuid, f"{uuid}::3", f"{uuid}-7", "nvidia0"]) == {uuid}


def test_foreign_pods_are_reported_once_and_their_gpus_marked_used(short_dir: Path) -> None:
    state = DeviceState(synth_inventory(NODE, 4, "X", 1000, "pcie"))
    uuids = state.uuids()
    cluster = InMemoryCluster()
    running = gpu_pod("legacy", scheduler="default-scheduler", phase="Running", namespace="team")
    cluster.add_pod(running)
    cluster.add_pod(gpu_pod("waiting", scheduler="default-scheduler"))
    cluster.add_pod(gpu_pod("ours", assignment={"main": [(uuids[0], 10, 0)]}, bound_at=1, phase="Running"))
    kubelet_api = PodResourcesStandIn(short_dir / "pod-resources" / "kubelet.sock")
    try:
        # "legacy" got whole GPUs 2 and 3 from the NVIDIA plugin that ran here before kube-vgpu
        kubelet_api.pods.append(("team", "legacy", "main", "nvidia.com/gpu", [uuids[2], uuids[3]]))
        kubelet_api.pods.append(("default", "ours", "main", "nvidia.com/gpu", [f"{uuids[0]}::0"]))
        monitor = ForeignPodMonitor(NODE, cluster, state, PodResourcesClient(str(kubelet_api.socket_path)))
        monitor.scan()
        monitor.scan()
    finally:
        kubelet_api.stop()
    assert [g.external_pods for g in state.inventory().gpus] == [(), (), ("team/legacy",), ("team/legacy",)]
    reported = sorted((e.namespace, e.name, e.reason) for e in cluster.events)
    assert reported == [("default", "waiting", EVENT_REASON), ("team", "legacy", EVENT_REASON)]
    legacy_event = next(e for e in cluster.events if e.name == "legacy")
    assert "schedulerName default-scheduler" in legacy_event.message
    assert f"holds {', '.join(sorted(uuids[2:]))}, now published as fully used" in legacy_event.message
    assert protocol.DEFAULT_SCHEDULER_NAME in legacy_event.message

    # the pod ends: its GPUs are free again
    cluster.update_pod("team", "legacy", lambda pod: pod["status"].update(phase="Succeeded"))
    monitor.holders = None
    monitor.scan()
    assert all(g.external_pods == () for g in state.inventory().gpus)


def test_an_unreachable_pod_resources_api_is_an_api_error(short_dir: Path) -> None:
    with pytest.raises(ApiUnavailable, match="pod-resources"):
        PodResourcesClient(str(short_dir / "absent.sock"), timeout_seconds=1).gpu_holders()
