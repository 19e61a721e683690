"""A gang declared through Kubernetes' own Workload API (1.37: scheduling.k8s.io/v1beta1, feature gate GenericWorkload,
off by default): a Workload, the PodGroup made from its gang template, and GPU pods naming that PodGroup in
spec.schedulingGroup. Our webhook reads the PodGroup (under the manifests' read-only RBAC) and kube-scheduler with
our extender places the pods all or nothing. Its own small cluster: the session's runs without the feature gate, as
clusters do by default."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import orjson
import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException

from kube_vgpu import protocol
from kube_vgpu.dev.devcluster.binaries import KUBERNETES_RELEASE
from kube_vgpu.dev.devcluster.cluster import DevCluster, NodeGroup
from kube_vgpu.dev.devcluster.workload import create_pods, ensure_namespace, gpu_pod, wait_for_pods
from tests.e2e.checks import assert_no_overcommit, settle
from tests.e2e.conftest import private_cluster

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(KUBERNETES_RELEASE.minor < 37, reason="the Workload API's v1beta1 is Kubernetes 1.37's"),
]

WAIT_S = 120.0
WHOLE_MIB = 81920
NAMESPACE = "train"
GROUP_VERSION = f"{protocol.WORKLOAD_API_GROUP}/{protocol.WORKLOAD_API_VERSION}"


@pytest.fixture(scope="module")
def workload_cluster() -> Iterator[DevCluster]:
    with private_cluster("workload-cluster", node_groups=(NodeGroup(count=2, gpus=1, prefix="wl-node"),),
                         workload_api=True) as cluster:
        ensure_namespace(cluster.api, NAMESPACE)
        yield cluster


def create(cluster: DevCluster, plural: str, body: dict[str, Any]) -> None:
    custom: Any = client.CustomObjectsApi(cluster.api)
    custom.create_namespaced_custom_object(protocol.WORKLOAD_API_GROUP, protocol.WORKLOAD_API_VERSION, NAMESPACE,
                                           plural, body)


def member(name: str, group: str) -> dict[str, Any]:
    p = gpu_pod(name, memory_mib=WHOLE_MIB)
    p["spec"]["schedulingGroup"] = {"podGroupName": group}
    return p


def test_a_workload_gang_of_two_is_placed_all_or_nothing(workload_cluster: DevCluster) -> None:
    cluster = workload_cluster
    gang = {"gang": {"minCount": 2}}
    create(cluster, "workloads", {"apiVersion": GROUP_VERSION, "kind": "Workload", "metadata": {"name": "train"},
                                  "spec": {"podGroupTemplates": [{"name": "workers", "schedulingPolicy": gang}]}})
    # the PodGroup a controller (the Job controller, with WorkloadWithJob) would make from the template
    create(cluster, "podgroups", {"apiVersion": GROUP_VERSION, "kind": "PodGroup",
                                  "metadata": {"name": "train-workers"},
                                  "spec": {"schedulingPolicy": gang,
                                           "workloadRef": {"workloadName": "train", "templateName": "workers"}}})
    with pytest.raises(ApiException) as refused:  # a typo refuses the pod, naming the PodGroup
        create_pods(cluster.api, NAMESPACE, [member("typo-0", "train-wrokers")])
    assert f"names PodGroup {NAMESPACE}/train-wrokers (scheduling.k8s.io), which does not exist" in str(
        refused.value.body)
    blocker = gpu_pod("blocker", memory_mib=WHOLE_MIB)
    create_pods(cluster.api, NAMESPACE, [blocker])
    assert wait_for_pods(cluster.api, NAMESPACE, ["blocker"], timeout_s=WAIT_S).bound
    names = ["train-0", "train-1"]  # 2 whole GPUs wanted, 1 free
    create_pods(cluster.api, NAMESPACE, [member(name, "train-workers") for name in names])
    stored = orjson.loads(client.CoreV1Api(cluster.api).read_namespaced_pod("train-0", NAMESPACE,
                                                                            _preload_content=False).data)
    assert stored["spec"]["schedulingGroup"] == {"podGroupName": "train-workers"}  # served: the gate is on
    assert stored["metadata"]["labels"][protocol.LABEL_KUEUE_POD_GROUP_NAME] == "workload_train-workers"
    assert stored["metadata"]["annotations"][protocol.ANNOTATION_KUEUE_POD_GROUP_TOTAL_COUNT] == "2"
    outcome = settle(cluster, NAMESPACE, names, timeout_s=WAIT_S)
    assert outcome.bound == {}, outcome.describe()  # none: nothing half-placed
    assert any("1 of 2 members fit" in outcome.refused[n] for n in names), outcome.describe()
    cluster.core.delete_namespaced_pod("blocker", NAMESPACE, grace_period_seconds=0)  # a 2nd GPU frees
    outcome = wait_for_pods(cluster.api, NAMESPACE, names, timeout_s=WAIT_S)
    assert sorted(outcome.bound.values()) == ["wl-node-0", "wl-node-1"], outcome.describe()
    assert_no_overcommit(cluster)
