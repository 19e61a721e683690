"""The device plugin's API client (deviceplugin/kube.py: raw JSON requests through the kubernetes client's
ApiClient, no generated API class) against the real kube-apiserver, as the device plugin's own ServiceAccount with
a token bound to its node (what a DaemonSet pod has, and what the admission policies hold it to): every call of its
two interfaces, and the answers it maps to Conflict and NotFound."""

from __future__ import annotations

import time
from typing import Any

import orjson
import pytest

from kube_vgpu import protocol
from kube_vgpu.dev.devcluster.cluster import DevCluster
from kube_vgpu.deviceplugin.kube import Conflict, KubeClient, NotFound, load_api_client

pytestmark = pytest.mark.e2e


def read(dev_cluster: DevCluster, method: str, *args: Any) -> dict[str, Any]:
    """An object as the admin reads it."""
    doc: dict[str, Any] = orjson.loads(getattr(dev_cluster.core, method)(*args, _preload_content=False).data)
    return doc


def test_every_call_of_the_device_plugins_client_against_the_real_api_server(
    dev_cluster: DevCluster, e2e_namespace: str, gpu_nodes: Any
) -> None:
    (node,) = gpu_nodes(1, gpus=4, model="Tesla T4", memory_mib=15360, topology="pcie", kwok=False).names
    kube = KubeClient(load_api_client(str(dev_cluster.device_plugin_kubeconfig_for(node))), host=node)

    # the node: read; a label set and removed (merge patch); a node that does not exist is NotFound
    assert kube.get_node(node)["metadata"]["name"] == node
    with pytest.raises(NotFound):
        kube.get_node(f"{node}-gone")
    kube.patch_node_metadata(node, {}, {protocol.LABEL_LIMITER: "e2e-probe"})
    assert read(dev_cluster, "read_node", node)["metadata"]["labels"][protocol.LABEL_LIMITER] == "e2e-probe"
    kube.patch_node_metadata(node, {}, {protocol.LABEL_LIMITER: None})
    assert protocol.LABEL_LIMITER not in read(dev_cluster, "read_node", node)["metadata"]["labels"]

    # a pod on the node: listed; its allocation written under its resourceVersion, refused under a stale one
    name = "dp-client-probe"
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": e2e_namespace},
           "spec": {"nodeName": node, "containers": [{"name": "main", "image": "registry.k8s.io/pause:3.10"}]}}
    dev_cluster.core.create_namespaced_pod(e2e_namespace, pod, _preload_content=False)
    (listed,) = [p for p in kube.list_node_pods(node) if p["metadata"]["name"] == name]
    stale = listed["metadata"]["resourceVersion"]
    allocation = protocol.encode_allocation({"main": ["probe-device"]})
    patched = kube.patch_pod_annotations(e2e_namespace, name, stale, {protocol.POD_ALLOCATION_ANNOTATION: allocation})
    assert patched["metadata"]["annotations"][protocol.POD_ALLOCATION_ANNOTATION] == allocation
    assert read(dev_cluster, "read_namespaced_pod", name, e2e_namespace)["metadata"]["annotations"][
        protocol.POD_ALLOCATION_ANNOTATION] == allocation
    with pytest.raises(Conflict):
        kube.patch_pod_annotations(e2e_namespace, name, stale, {protocol.POD_ALLOCATION_ANNOTATION: None})

    # an event about the pod, as the device plugin reports a pod that reached the node without kube-vgpu
    kube.record_event(patched, "E2eProbe", "a probe of the device plugin's event", warning=True)
    deadline = time.monotonic() + 30
    while True:
        events = read(dev_cluster, "list_namespaced_event", e2e_namespace)["items"]
        found = [e for e in events if e.get("reason") == "E2eProbe"]
        if found or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    (event,) = found
    assert event["type"] == "Warning" and event["message"] == "a probe of the device plugin's event"
    assert event["involvedObject"]["name"] == name and event["involvedObject"]["uid"] == patched["metadata"]["uid"]
    assert event["source"] == {"component": "kube-vgpu-device-plugin", "host": node}
    assert event["count"] == 1 and event["firstTimestamp"] and event["lastTimestamp"]
