"""The device plugin in the real control plane: it publishes its node's inventory (fake NVML: the one allowed
stand-in), the extender places two pods there, and kubelet's Allocate (the real gRPC protocol, from a kubelet
stand-in) gives each pod exactly the GPUs the extender assigned it, claimed through the real API server."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from kube_vgpu import protocol
from kube_vgpu.dev.devcluster.cluster import DevCluster
from kube_vgpu.dev.devcluster.workload import assignment_of, create_pods, gpu_pod, wait_for_pods
from tests.deviceplugin.kubelet import KubeletStandIn

pytestmark = pytest.mark.e2e


@pytest.fixture
def plugin_node(dev_cluster: DevCluster, gpu_nodes: Any) -> Iterator[tuple[Any, KubeletStandIn]]:
    # the kubelet stand-in below is this node's kubelet (Allocate runs for pods still Pending): not KWOK
    nodes = gpu_nodes(1, gpus=4, model="Tesla T4", memory_mib=15360, topology="pcie", kwok=False)
    (node_name,) = nodes.names
    directory = Path(tempfile.mkdtemp(prefix="kvdp-e2e-", dir="/tmp"))  # unix socket paths must stay short
    kubelet = KubeletStandIn(directory / "device-plugins")
    kubelet.start()
    log_path = directory / "device-plugin.log"
    with log_path.open("wb") as log:
        plugin = subprocess.Popen(
            [sys.executable, "-m", "kube_vgpu.cli", "device-plugin", f"--node-name={node_name}",
             "--fake-nvml=t4-4-pcie", f"--kubelet-dir={kubelet.directory}",
             # a token bound to its node, as a DaemonSet pod's projected token: the admission policies hold the
             # device plugin to the node its token names
             f"--kubeconfig={dev_cluster.device_plugin_kubeconfig_for(node_name)}", "--probe-address=",
             "--pod-resources-socket=", "--heartbeat-seconds=5"],
            stdout=log, stderr=subprocess.STDOUT,
        )
    try:
        # the plugin's own inventory (fake NVML UUIDs) replaces the one the node was registered with
        deadline = time.monotonic() + 60
        while True:
            node = orjson.loads(dev_cluster.core.read_node(node_name, _preload_content=False).data)
            text = node["metadata"]["annotations"].get(protocol.NODE_INVENTORY_ANNOTATION, "")
            state = httpx.get(f"{dev_cluster.extender_url}/state").json()
            known = {g["uuid"] for n in state["nodes"] if n["name"] == node_name for g in n["gpus"]}
            published = {g.uuid for g in protocol.decode_inventory(text).gpus} if text else set()
            if published and published == known and "Tesla" in text:
                break
            assert plugin.poll() is None and time.monotonic() < deadline, log_path.read_text()[-3000:]
            time.sleep(0.3)
        yield nodes, kubelet
    finally:
        plugin.terminate()
        plugin.wait(10)
        kubelet.stop()
        shutil.rmtree(directory, ignore_errors=True)


def test_allocate_gives_each_pending_pod_its_own_assignment(
    dev_cluster: DevCluster, e2e_namespace: str, plugin_node: tuple[Any, KubeletStandIn]
) -> None:
    nodes, kubelet = plugin_node
    pods = [gpu_pod(f"share-{mib}", memory_mib=mib, cores=30, node_selector=nodes.selector) for mib in (3000, 5000)]
    create_pods(dev_cluster.api, e2e_namespace, pods)
    outcome = wait_for_pods(dev_cluster.api, e2e_namespace, [p["metadata"]["name"] for p in pods], timeout_s=60)
    assert len(outcome.bound) == 2, outcome.describe()
    plugin = kubelet.plugin()
    kubelet.wait_for_devices(plugin, lambda devices: len(devices) == 40, "4 GPUs x 10 vGPU slots advertised")
    # kubelet admits both pods, which are pending on the node at the same time, in bind order
    by_bind_time = sorted(outcome.pods.values(), key=lambda p: protocol.parse_bind_time(
        p["metadata"]["annotations"][protocol.POD_BIND_TIME_ANNOTATION]))
    for pod in by_bind_time:
        assignment = assignment_of(pod)
        assert assignment is not None
        (device,) = assignment.all_devices()
        (response,) = kubelet.admit(plugin, pod)
        envs = dict(response.envs)
        assert envs[protocol.ENV_NVIDIA_VISIBLE_DEVICES] == device.uuid, (pod["metadata"]["name"], envs)
    claimed = [
        orjson.loads(dev_cluster.core.read_namespaced_pod(p["metadata"]["name"], e2e_namespace,
                                                          _preload_content=False).data)
        for p in pods
    ]
    for pod in claimed:  # the claim went through the API server (resourceVersion-guarded patch)
        assert protocol.decode_allocation(pod["metadata"]["annotations"][protocol.POD_ALLOCATION_ANNOTATION])
