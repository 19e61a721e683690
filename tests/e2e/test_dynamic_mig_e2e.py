"""Dynamic MIG through the real control plane (issue 16 item 2): a static-MIG node (fake NVML `a100-mig`) and a
dynamic-MIG node whose real device plugin process (fake NVML `h100-mig-capable`, `--dynamic-mig=0` with 1g.10gb,
3g.40gb and 7g.80gb allowed) talks to a kubelet stand-in over kubelet's gRPC API. Pods asking for
nvidia.com/mig-1g.10gb and nvidia.com/mig-3g.40gb are bound by our extender to legal slots of the dynamic GPU;
kubelet's Allocate makes the plugin create exactly those instances, which its published inventory then lists; a
HAMi-style pod (nvidia.com/gpu with gpumem 9000 and nvidia.com/vgpu-mode: mig) gets a 1g.10gb instance the same
way; a 7g.80gb pod that cannot fit stays Pending with a reason naming the profile and the free slots; a pod asking the
static node's 1g.5gb gets its existing MIG device; and when the pods are gone the plugin destroys the instances."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from kube_vgpu import protocol
from kube_vgpu.dev.devcluster.cluster import DevCluster, NodeGroup
from kube_vgpu.dev.devcluster.workload import PAUSE_IMAGE, assignment_of, create_pods, wait_for_pods
from kube_vgpu.protocol import mig
from tests.deviceplugin.kubelet import KubeletStandIn
from tests.e2e.conftest import NODE_GROUP_LABEL

pytestmark = pytest.mark.e2e

GPUS, PROFILES = "0", "H100-80GB=1g.10gb,3g.40gb,7g.80gb"


def mig_pod(name: str, resource: str, selector: dict[str, str]) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
            "spec": {"nodeSelector": selector, "terminationGracePeriodSeconds": 0,
                     "containers": [{"name": "main", "image": PAUSE_IMAGE,
                                     "resources": {"limits": {resource: "1"}}}]}}


def hami_mig_pod(name: str, selector: dict[str, str]) -> dict[str, Any]:
    """HAMi's dynamic MIG: nvidia.com/gpu with gpumem and vgpu-mode: mig (here 1g.10gb, the smallest with 9000 MiB)."""
    limits = {protocol.RESOURCE_GPU: "1", protocol.RESOURCE_GPU_MEMORY: "9000"}
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "annotations": {protocol.ANNOTATION_VGPU_MODE: "mig"}},
            "spec": {"nodeSelector": selector, "terminationGracePeriodSeconds": 0,
                     "containers": [{"name": "main", "image": PAUSE_IMAGE, "resources": {"limits": limits}}]}}


def published(dev_cluster: DevCluster, node_name: str) -> protocol.NodeInventory | None:
    node = orjson.loads(dev_cluster.core.read_node(node_name, _preload_content=False).data)
    text = node["metadata"].get("annotations", {}).get(protocol.NODE_INVENTORY_ANNOTATION, "")
    return protocol.decode_inventory(text) if text else None


def wait_for(condition: Any, what: str, timeout_s: float, log: Path) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}:\n{log.read_text()[-3000:]}"
        time.sleep(0.3)


@pytest.fixture
def nodes(dev_cluster: DevCluster, e2e_namespace: str) -> Iterator[tuple[str, str, KubeletStandIn, Path]]:
    label = f"dynmig-{e2e_namespace}"[:63]
    static = dev_cluster.add_nodes(NodeGroup(count=1, prefix=f"smig-{e2e_namespace}"[:40], fake_profile="a100-mig",
                                             labels=((NODE_GROUP_LABEL, label),)))
    dynamic = dev_cluster.add_nodes(NodeGroup(count=1, prefix=f"dmig-{e2e_namespace}"[:40],
                                              fake_profile="h100-mig-capable", dynamic_mig=(GPUS, PROFILES),
                                              labels=((NODE_GROUP_LABEL, label),), kwok=False))
    directory = Path(tempfile.mkdtemp(prefix="kvdm-e2e-", dir="/tmp"))  # unix socket paths must stay short
    kubelet = KubeletStandIn(directory / "device-plugins")
    kubelet.start()
    log_path = directory / "device-plugin.log"
    with log_path.open("wb") as log:
        plugin = subprocess.Popen(
            [sys.executable, "-m", "kube_vgpu.cli", "device-plugin", f"--node-name={dynamic[0]}",
             "--fake-nvml=h100-mig-capable", f"--dynamic-mig={GPUS}", f"--dynamic-mig-profiles={PROFILES}",
             f"--kubelet-dir={kubelet.directory}",
             f"--kubeconfig={dev_cluster.device_plugin_kubeconfig_for(dynamic[0])}", "--probe-address=",
             "--pod-resources-socket=", "--heartbeat-seconds=2"],
            stdout=log, stderr=subprocess.STDOUT,
        )
    try:
        wait_for(lambda: plugin.poll() is None and (inv := published(dev_cluster, dynamic[0])) is not None
                 and inv.gpus[0].dynamic_mig is not None, "the plugin's inventory", 60, log_path)
        yield static[0], dynamic[0], kubelet, log_path
    finally:
        plugin.terminate()
        plugin.wait(10)
        kubelet.stop()
        for name in ("small", "half", "hami", "whole", "static"):
            try:
                dev_cluster.core.delete_namespaced_pod(name, e2e_namespace, grace_period_seconds=0,
                                                       _preload_content=False)
            except Exception:
                pass
        dev_cluster.delete_nodes(static + dynamic)
        shutil.rmtree(directory, ignore_errors=True)


def test_dynamic_and_static_mig_pods_land_on_legal_slices_and_instances_follow_them(
    dev_cluster: DevCluster, e2e_namespace: str, nodes: tuple[str, str, KubeletStandIn, Path]
) -> None:
    static_node, dynamic_node, kubelet, log = nodes
    selector = {NODE_GROUP_LABEL: f"dynmig-{e2e_namespace}"[:63]}
    asks = {"small": "nvidia.com/mig-1g.10gb", "half": "nvidia.com/mig-3g.40gb", "static": "nvidia.com/mig-1g.5gb"}
    pods = [mig_pod(name, resource, selector) for name, resource in asks.items()] + [hami_mig_pod("hami", selector)]
    create_pods(dev_cluster.api, e2e_namespace, pods)
    outcome = wait_for_pods(dev_cluster.api, e2e_namespace, [*asks, "hami"], timeout_s=90)
    assert outcome.bound == {"small": dynamic_node, "half": dynamic_node, "hami": dynamic_node,
                             "static": static_node}, outcome.describe() + dev_cluster.log_tail("extender")
    gpu_uuid = next(g.uuid for g in (published(dev_cluster, dynamic_node) or protocol.NodeInventory(())).gpus
                    if g.index == 0)
    placed: dict[str, protocol.DynamicMigPlacement] = {}
    profiles = {**{n: r.removeprefix(protocol.MIG_RESOURCE_PREFIX) for n, r in asks.items()}, "hami": "1g.10gb"}
    for name in ("small", "half", "hami"):
        assignment = assignment_of(outcome.pods[name])
        assert assignment is not None
        (device,) = assignment.all_devices()
        placement = protocol.parse_dynamic_mig_device(device.uuid)
        assert placement is not None and placement.gpu_uuid == gpu_uuid, device
        assert placement.profile == profiles[name]
        placed[name] = placement
    assert mig.legal_layout(mig.H100_80GB, [(p.profile, p.start) for p in placed.values()]) is None
    (static_assignment,) = [assignment_of(outcome.pods["static"])]
    assert static_assignment is not None and static_assignment.all_devices()[0].uuid.startswith("MIG-")

    # kubelet admits the pods: the plugin creates each instance at its slot and hands over its MIG device (the
    # vgpu-mode: mig pod through nvidia.com/gpu, the resource it asks for)
    plugins = {c.request.resource_name: c for c in (kubelet.plugin(registrations=4), *kubelet.plugins)}
    delivered = {}
    for name in ("small", "half", "hami"):
        resource = asks.get(name, protocol.RESOURCE_GPU)
        kubelet.wait_for_devices(plugins[resource], lambda devices: len(devices) > 0, f"{resource} advertised")
        (response,) = kubelet.admit(plugins[resource], outcome.pods[name], resource)
        delivered[name] = response.envs[protocol.ENV_NVIDIA_VISIBLE_DEVICES]
        assert delivered[name].startswith("MIG-"), response.envs

    def instances() -> list[tuple[str, str, int]]:
        inventory = published(dev_cluster, dynamic_node)
        dynamic = inventory.gpus[0].dynamic_mig if inventory else None
        return sorted((d.uuid, d.profile, d.start) for d in (dynamic.instances if dynamic else ()))

    expected = sorted((delivered[n], placed[n].profile, placed[n].start) for n in placed)
    wait_for(lambda: instances() == expected, f"the published instances {expected}", 30, log)

    # a 7g.80gb needs the whole GPU: it waits, told the profile and the free slots
    create_pods(dev_cluster.api, e2e_namespace, [mig_pod("whole", "nvidia.com/mig-7g.80gb", selector)])
    waiting = wait_for_pods(dev_cluster.api, e2e_namespace, ["whole"], timeout_s=60, expect_refused=["whole"])
    reason = waiting.refused.get("whole", "")
    assert "needs 1 MIG 7g.80gb instance" in reason and "free memory slots: GPU 0: " in reason, waiting.describe()

    # the pods go: the plugin destroys their instances and the GPU leaves MIG mode
    for name in ("small", "half", "hami", "whole"):
        dev_cluster.core.delete_namespaced_pod(name, e2e_namespace, grace_period_seconds=0, _preload_content=False)
    wait_for(lambda: instances() == [] and not (published(dev_cluster, dynamic_node) or
                                               protocol.NodeInventory(())).gpus[0].mig_mode,
             "the instances destroyed", 60, log)
