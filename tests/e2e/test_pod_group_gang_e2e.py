"""A gang declared by a coscheduling PodGroup, through the real control plane: the PodGroup CRD installed in the real
API server, our webhook reads the PodGroup under the manifests' read-only RBAC and stamps the Kueue pod-group label and
count, and kube-scheduler with our extender places the pods all or nothing. A PodGroup that does not exist refuses
the pod."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

import orjson
import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException

from kube_vgpu import protocol
from kube_vgpu.dev.devcluster.cluster import DevCluster
from kube_vgpu.dev.devcluster.workload import create_pods, gpu_pod, wait_for_pods
from tests.e2e.checks import assert_no_overcommit, settle
from tests.e2e.conftest import NodeSet

pytestmark = pytest.mark.e2e

WAIT_S = 120.0
WHOLE_MIB = 81920

#: A minimal copy of scheduler-plugins' CRD (config/crd/bases/scheduling.x-k8s.io_podgroups.yaml, v1alpha1): the
#: same group, names, scope and spec fields (minMember, minResources, scheduleTimeoutSeconds); status left open.
POD_GROUP_CRD: dict[str, Any] = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": f"{protocol.COSCHEDULING_POD_GROUPS}.{protocol.COSCHEDULING_API_GROUP}"},
    "spec": {
        "group": protocol.COSCHEDULING_API_GROUP,
        "names": {"kind": "PodGroup", "listKind": "PodGroupList", "plural": protocol.COSCHEDULING_POD_GROUPS,
                  "singular": "podgroup", "shortNames": ["pg", "pgs"]},
        "scope": "Namespaced",
        "versions": [{
            "name": protocol.COSCHEDULING_API_VERSION, "served": True, "storage": True,
            "subresources": {"status": {}},
            "schema": {"openAPIV3Schema": {"type": "object", "properties": {
                "spec": {"type": "object", "properties": {
                    "minMember": {"type": "integer", "format": "int32"},
                    "minResources": {"type": "object", "additionalProperties": {
                        "anyOf": [{"type": "integer"}, {"type": "string"}], "x-kubernetes-int-or-string": True}},
                    "scheduleTimeoutSeconds": {"type": "integer", "format": "int32"},
                }},
                "status": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
            }}},
        }],
    },
}


def create_pod_group(cluster: DevCluster, namespace: str, name: str, min_member: int) -> None:
    extensions: Any = client.ApiextensionsV1Api(cluster.api)
    with contextlib.suppress(ApiException):  # already there (another test of the session)
        extensions.create_custom_resource_definition(POD_GROUP_CRD, _preload_content=False)
    custom: Any = client.CustomObjectsApi(cluster.api)
    body = {"apiVersion": f"{protocol.COSCHEDULING_API_GROUP}/{protocol.COSCHEDULING_API_VERSION}",
            "kind": "PodGroup", "metadata": {"name": name}, "spec": {"minMember": min_member}}
    deadline = time.monotonic() + 60
    while True:  # until the CRD is established
        try:
            custom.create_namespaced_custom_object(protocol.COSCHEDULING_API_GROUP, protocol.COSCHEDULING_API_VERSION,
                                                   namespace, protocol.COSCHEDULING_POD_GROUPS, body)
            return
        except ApiException:
            assert time.monotonic() < deadline, "PodGroup CRD never served"
            time.sleep(0.2)


def member(name: str, group: str, nodes: NodeSet) -> dict[str, Any]:
    return gpu_pod(name, memory_mib=WHOLE_MIB, node_selector=nodes.selector,
                   labels={protocol.LABEL_COSCHEDULING_POD_GROUP: group})


def test_a_pod_group_of_two_is_placed_all_or_nothing(
    dev_cluster: DevCluster, e2e_namespace: str, gpu_nodes: Callable[..., NodeSet]
) -> None:
    nodes = gpu_nodes(2, gpus=1)
    create_pod_group(dev_cluster, e2e_namespace, "train", 2)
    # a typo in the label refuses the pod, naming the PodGroup (no silent pods-one-by-one)
    with pytest.raises(ApiException) as refused:
        create_pods(dev_cluster.api, e2e_namespace, [member("typo-0", "trian", nodes)])
    assert (f"names PodGroup {e2e_namespace}/trian, which does not exist" in str(refused.value.body))
    blocker = gpu_pod("blocker", memory_mib=WHOLE_MIB, node_selector=nodes.selector)
    create_pods(dev_cluster.api, e2e_namespace, [blocker])
    assert wait_for_pods(dev_cluster.api, e2e_namespace, ["blocker"], timeout_s=WAIT_S).bound
    train = [member(f"train-{i}", "train", nodes) for i in range(2)]  # 2 whole GPUs wanted, 1 free
    create_pods(dev_cluster.api, e2e_namespace, train)
    stored = client.CoreV1Api(dev_cluster.api).read_namespaced_pod("train-0", e2e_namespace, _preload_content=False)
    metadata = orjson.loads(stored.data)["metadata"]
    assert metadata["labels"][protocol.LABEL_KUEUE_POD_GROUP_NAME] == "podgroup_train"
    assert metadata["annotations"][protocol.ANNOTATION_KUEUE_POD_GROUP_TOTAL_COUNT] == "2"
    names = ["train-0", "train-1"]
    outcome = settle(dev_cluster, e2e_namespace, names, timeout_s=WAIT_S)
    assert outcome.bound == {}, outcome.describe()  # none: nothing half-placed
    assert any("1 of 2 members fit" in outcome.refused[n] for n in names), outcome.describe()
    dev_cluster.core.delete_namespaced_pod("blocker", e2e_namespace, grace_period_seconds=0)  # a 2nd GPU frees
    outcome = wait_for_pods(dev_cluster.api, e2e_namespace, names, timeout_s=WAIT_S)
    assert sorted(outcome.bound.values()) == sorted(nodes.names), outcome.describe()
    assert_no_overcommit(dev_cluster)
