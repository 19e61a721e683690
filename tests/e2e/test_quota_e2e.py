"""The quota gate in the real control plane (quota mode enforce): Kueue objects served by the API server with Kueue's
own CRDs (the `kueue_crds` fixture, no Kueue controller), watched by the extender under its own RBAC; a team beyond
its budget stays Pending with our reason and is scheduled once its earlier pods are deleted."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from kubernetes import client

from kube_vgpu import protocol
from kube_vgpu.dev.devcluster.cluster import DevCluster, NodeGroup
from kube_vgpu.dev.devcluster.lifecycle import run_seconds_annotation
from kube_vgpu.dev.devcluster.workload import PAUSE_IMAGE, create_pods, gpu_pod, list_pods, wait_for_pods
from tests.e2e.checks import assert_no_overcommit
from tests.e2e.conftest import NODE_GROUP_LABEL

pytestmark = pytest.mark.e2e

GROUP = protocol.KUEUE_API_GROUP
@pytest.fixture
def team_budget(dev_cluster: DevCluster, kueue_crds: None, e2e_namespace: str, gpu_nodes: Any) -> Iterator[Any]:
    nodes = gpu_nodes(1, gpus=4)
    custom: Any = client.CustomObjectsApi(dev_cluster.api)
    name = e2e_namespace
    flavor = {"apiVersion": f"{GROUP}/v1beta2", "kind": "ResourceFlavor", "metadata": {"name": name},
              "spec": {"nodeLabels": nodes.selector}}
    queue = {
        "apiVersion": f"{GROUP}/v1beta2", "kind": "ClusterQueue", "metadata": {"name": name},
        "spec": {
            "namespaceSelector": {"matchLabels": {protocol.LABEL_NAMESPACE_NAME: e2e_namespace}},
            # Kueue's default (BlockUndeclared): a queue must cover every GPU resource its pods ask for
            "resourceGroups": [{
                "coveredResources": [protocol.RESOURCE_GPU, protocol.RESOURCE_GPU_MEMORY],
                "flavors": [{"name": name, "resources": [{"name": protocol.RESOURCE_GPU, "nominalQuota": 2},
                                                         {"name": protocol.RESOURCE_GPU_MEMORY,
                                                          "nominalQuota": 1_000_000}]}],
            }],
        },
    }
    local = {"apiVersion": f"{GROUP}/v1beta2", "kind": "LocalQueue", "metadata": {"name": "team"},
             "spec": {"clusterQueue": name}}
    custom.create_cluster_custom_object(GROUP, "v1beta2", "resourceflavors", flavor)
    custom.create_cluster_custom_object(GROUP, "v1beta2", "clusterqueues", queue)
    custom.create_namespaced_custom_object(GROUP, "v1beta2", e2e_namespace, "localqueues", local)
    deadline = time.monotonic() + 30
    while not any(q["name"] == name for q in httpx.get(f"{dev_cluster.extender_url}/quota").json()["clusterQueues"]):
        assert time.monotonic() < deadline, "the extender never saw the ClusterQueue:\n" + dev_cluster.log_tail(
            "extender")
        time.sleep(0.2)
    yield nodes
    custom.delete_namespaced_custom_object(GROUP, "v1beta2", e2e_namespace, "localqueues", "team")
    custom.delete_cluster_custom_object(GROUP, "v1beta2", "clusterqueues", name)
    custom.delete_cluster_custom_object(GROUP, "v1beta2", "resourceflavors", name)


def test_team_beyond_budget_waits_with_our_reason_then_runs(
    dev_cluster: DevCluster, e2e_namespace: str, team_budget: Any
) -> None:
    labels = {protocol.LABEL_KUEUE_QUEUE_NAME: "team"}
    pods = [gpu_pod(f"job-{i}", memory_mib=1000, labels=labels, node_selector=team_budget.selector) for i in range(3)]
    create_pods(dev_cluster.api, e2e_namespace, pods[:2])
    first = wait_for_pods(dev_cluster.api, e2e_namespace, ["job-0", "job-1"], timeout_s=60)
    assert set(first.bound) == {"job-0", "job-1"}, first.describe()
    create_pods(dev_cluster.api, e2e_namespace, pods[2:])
    waiting = wait_for_pods(dev_cluster.api, e2e_namespace, ["job-2"], timeout_s=60, expect_refused=["job-2"])
    reason = waiting.refused.get("job-2", "")
    assert e2e_namespace in reason and protocol.RESOURCE_GPU in reason, waiting.describe()
    quota = httpx.get(f"{dev_cluster.extender_url}/quota").json()
    (mine,) = [q for q in quota["clusterQueues"] if q["name"] == e2e_namespace]
    used = {r["resource"]: r["used"] for f in mine["flavors"] for r in f["resources"]}
    assert used[protocol.RESOURCE_GPU] == 2 and mine["admittedPods"] == 2
    dev_cluster.core.delete_namespaced_pod("job-0", e2e_namespace, grace_period_seconds=0, _preload_content=False)
    after = wait_for_pods(dev_cluster.api, e2e_namespace, ["job-2"], timeout_s=90)
    assert "job-2" in after.bound, after.describe()
    assert_no_overcommit(dev_cluster)


def test_a_jobs_queue_label_counts_its_pods_and_finished_pods_give_the_quota_back(
    dev_cluster: DevCluster, e2e_namespace: str, team_budget: Any
) -> None:
    """Issue 13: the queue label on the Job (as every Kueue example writes it), not on its pods. The Job controller
    creates the pods, the webhook gives them the Job's queue, the extender admits 2 of the 3 against the 2-GPU budget
    (the third waits with our reason), KWOK runs them, and when the first two succeed their quota comes back and the
    third is placed."""
    batch = client.BatchV1Api(dev_cluster.api)
    container = gpu_pod("x", memory_mib=1000, node_selector=team_budget.selector)["spec"]
    job = {"apiVersion": "batch/v1", "kind": "Job",
           "metadata": {"name": "train", "labels": {protocol.LABEL_KUEUE_QUEUE_NAME: "team"}},
           "spec": {"parallelism": 3, "completions": 3, "backoffLimit": 0,
                    "template": {"metadata": {"annotations": run_seconds_annotation(20)},
                                 "spec": {**container, "restartPolicy": "Never"}}}}
    batch.create_namespaced_job(e2e_namespace, job, _preload_content=False)
    selector = "batch.kubernetes.io/job-name=train"

    def pods() -> list[dict[str, Any]]:
        return list_pods(dev_cluster.api, e2e_namespace, label_selector=selector)

    deadline = time.monotonic() + 90
    while len([p for p in pods() if p["spec"].get("nodeName")]) < 2 or len(pods()) < 3:
        assert time.monotonic() < deadline, [p["spec"].get("nodeName") for p in pods()]
        time.sleep(0.25)
    assert all(p["metadata"]["labels"][protocol.LABEL_KUEUE_QUEUE_NAME] == "team" for p in pods())
    (waiting,) = [p["metadata"]["name"] for p in pods() if not p["spec"].get("nodeName")]
    refused = wait_for_pods(dev_cluster.api, e2e_namespace, [waiting], timeout_s=60, expect_refused=[waiting])
    assert e2e_namespace in refused.refused.get(waiting, "") or waiting in refused.bound, refused.describe()
    # the first two succeed after 20 s (KWOK): their quota comes back and the third is placed
    placed = wait_for_pods(dev_cluster.api, e2e_namespace, [waiting], timeout_s=120)
    assert waiting in placed.bound, placed.describe() + dev_cluster.log_tail("extender")
    assert_no_overcommit(dev_cluster)


@pytest.fixture
def cohort_of_two(dev_cluster: DevCluster, kueue_crds: None, e2e_namespace: str, gpu_nodes: Any) -> Iterator[Any]:
    """Two ClusterQueues of 2 vGPUs each in one cohort, on one 4-GPU node; team-b takes back what team-a borrows
    (reclaimWithinCohort: Any). LocalQueues qa and qb in the test's namespace."""
    nodes = gpu_nodes(1, gpus=4)
    custom: Any = client.CustomObjectsApi(dev_cluster.api)
    name = e2e_namespace
    flavor = {"apiVersion": f"{GROUP}/v1beta2", "kind": "ResourceFlavor", "metadata": {"name": name},
              "spec": {"nodeLabels": nodes.selector}}
    custom.create_cluster_custom_object(GROUP, "v1beta2", "resourceflavors", flavor)
    for team, preemption in (("a", {}), ("b", {"reclaimWithinCohort": "Any"})):
        queue = {
            "apiVersion": f"{GROUP}/v1beta2", "kind": "ClusterQueue", "metadata": {"name": f"{name}-{team}"},
            "spec": {
                "cohortName": f"{name}-cohort", "preemption": preemption,
                "namespaceSelector": {"matchLabels": {protocol.LABEL_NAMESPACE_NAME: e2e_namespace}},
                "resourceGroups": [{
                    "coveredResources": [protocol.RESOURCE_GPU, protocol.RESOURCE_GPU_MEMORY],
                    "flavors": [{"name": name, "resources": [
                        {"name": protocol.RESOURCE_GPU, "nominalQuota": 2},
                        {"name": protocol.RESOURCE_GPU_MEMORY, "nominalQuota": 1_000_000}]}],
                }],
            },
        }
        custom.create_cluster_custom_object(GROUP, "v1beta2", "clusterqueues", queue)
        local = {"apiVersion": f"{GROUP}/v1beta2", "kind": "LocalQueue", "metadata": {"name": f"q{team}"},
                 "spec": {"clusterQueue": f"{name}-{team}"}}
        custom.create_namespaced_custom_object(GROUP, "v1beta2", e2e_namespace, "localqueues", local)
    deadline = time.monotonic() + 30
    while sum(q["name"].startswith(name) for q in httpx.get(f"{dev_cluster.extender_url}/quota").json()[
            "clusterQueues"]) < 2:
        assert time.monotonic() < deadline, "the extender never saw the ClusterQueues:\n" + dev_cluster.log_tail(
            "extender")
        time.sleep(0.2)
    yield nodes
    for team in ("a", "b"):
        custom.delete_namespaced_custom_object(GROUP, "v1beta2", e2e_namespace, "localqueues", f"q{team}")
        custom.delete_cluster_custom_object(GROUP, "v1beta2", "clusterqueues", f"{name}-{team}")
    custom.delete_cluster_custom_object(GROUP, "v1beta2", "resourceflavors", name)


def test_a_team_within_its_nominal_quota_takes_back_what_another_borrows(
    dev_cluster: DevCluster, e2e_namespace: str, cohort_of_two: Any
) -> None:
    """Issue 14: team-a borrows the whole cohort (4 pods of 1 vGPU on 2 + 2); team-b's 2 pods, within its nominal
    quota, evict 2 of team-a's (as much as it borrows, newest first), and team-a keeps its own nominal 2."""
    def team(letter: str, count: int) -> list[dict[str, Any]]:
        return [gpu_pod(f"{letter}-{i}", memory_mib=1000, labels={protocol.LABEL_KUEUE_QUEUE_NAME: f"q{letter}"},
                        node_selector=cohort_of_two.selector) for i in range(count)]

    for pod in team("a", 4):  # one at a time: creation order decides who is newest
        create_pods(dev_cluster.api, e2e_namespace, [pod])
        placed = wait_for_pods(dev_cluster.api, e2e_namespace, [pod["metadata"]["name"]], timeout_s=60)
        assert pod["metadata"]["name"] in placed.bound, placed.describe()
    create_pods(dev_cluster.api, e2e_namespace, team("b", 2))
    placed = wait_for_pods(dev_cluster.api, e2e_namespace, ["b-0", "b-1"], timeout_s=120)
    assert set(placed.bound) >= {"b-0", "b-1"}, placed.describe() + dev_cluster.log_tail("extender")
    names = {p["metadata"]["name"] for p in list_pods(dev_cluster.api, e2e_namespace)
             if not p["metadata"].get("deletionTimestamp")}
    # which two of team-a's go is Kueue's order (lowest priority, newest): created within a second or two, their
    # timestamps (second resolution) may tie; that exactly two stay is what reclaim promises
    assert len({"a-0", "a-1", "a-2", "a-3"} & names) == 2, names
    quota = httpx.get(f"{dev_cluster.extender_url}/quota").json()
    used = {q["name"]: sum(r["used"] for f in q["flavors"] for r in f["resources"]
                           if r["resource"] == protocol.RESOURCE_GPU)
            for q in quota["clusterQueues"] if q["name"].startswith(e2e_namespace)}
    assert used == {f"{e2e_namespace}-a": 2, f"{e2e_namespace}-b": 2}, used
    assert_no_overcommit(dev_cluster)


MIG_RESOURCE = "nvidia.com/mig-1g.5gb"


def test_a_queues_mig_quota_admits_one_mig_pod_and_refuses_the_next_with_the_reason(
    dev_cluster: DevCluster, kueue_crds: None, e2e_namespace: str
) -> None:
    """Issue 16: a ClusterQueue with a quota of 1 nvidia.com/mig-1g.5gb on a node of nine such devices (the fake
    NVML's a100-mig profile): the first MIG pod is placed and charged the MIG resource, the second stays Pending with
    our reason naming the resource and the queue (quota refuses it, not the node), until the first is deleted."""
    label = f"migq-{e2e_namespace}"[:63]
    names = dev_cluster.add_nodes(NodeGroup(count=1, prefix=f"migq-{e2e_namespace}"[:40], fake_profile="a100-mig",
                                            labels=((NODE_GROUP_LABEL, label),)))
    selector = {NODE_GROUP_LABEL: label}
    custom: Any = client.CustomObjectsApi(dev_cluster.api)
    name = f"{e2e_namespace}-mig"
    flavor = {"apiVersion": f"{GROUP}/v1beta2", "kind": "ResourceFlavor", "metadata": {"name": name},
              "spec": {"nodeLabels": selector}}
    queue = {"apiVersion": f"{GROUP}/v1beta2", "kind": "ClusterQueue", "metadata": {"name": name},
             "spec": {"namespaceSelector": {"matchLabels": {protocol.LABEL_NAMESPACE_NAME: e2e_namespace}},
                      "resourceGroups": [{"coveredResources": [MIG_RESOURCE], "flavors": [
                          {"name": name, "resources": [{"name": MIG_RESOURCE, "nominalQuota": 1}]}]}]}}
    local = {"apiVersion": f"{GROUP}/v1beta2", "kind": "LocalQueue", "metadata": {"name": "mig"},
             "spec": {"clusterQueue": name}}

    def mig_pod(pod_name: str) -> dict[str, Any]:
        return {"apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": pod_name, "labels": {protocol.LABEL_KUEUE_QUEUE_NAME: "mig"}},
                "spec": {"nodeSelector": selector, "terminationGracePeriodSeconds": 0,
                         "containers": [{"name": "main", "image": PAUSE_IMAGE,
                                         "resources": {"limits": {MIG_RESOURCE: "1"}}}]}}

    try:
        custom.create_cluster_custom_object(GROUP, "v1beta2", "resourceflavors", flavor)
        custom.create_cluster_custom_object(GROUP, "v1beta2", "clusterqueues", queue)
        custom.create_namespaced_custom_object(GROUP, "v1beta2", e2e_namespace, "localqueues", local)
        deadline = time.monotonic() + 30
        while not any(q["name"] == name and q["flavors"]
                      for q in httpx.get(f"{dev_cluster.extender_url}/quota").json()["clusterQueues"]):
            assert time.monotonic() < deadline, "the extender never saw the ClusterQueue:\n" + dev_cluster.log_tail(
                "extender")
            time.sleep(0.2)
        create_pods(dev_cluster.api, e2e_namespace, [mig_pod("first")])
        first = wait_for_pods(dev_cluster.api, e2e_namespace, ["first"], timeout_s=60)
        assert first.bound == {"first": names[0]}, first.describe() + dev_cluster.log_tail("extender")
        create_pods(dev_cluster.api, e2e_namespace, [mig_pod("second")])
        waiting = wait_for_pods(dev_cluster.api, e2e_namespace, ["second"], timeout_s=60, expect_refused=["second"])
        reason = waiting.refused.get("second", "")
        assert f"ClusterQueue {name}" in reason and f"{MIG_RESOURCE}: needs 1, used 1/1" in reason, waiting.describe()
        quota = httpx.get(f"{dev_cluster.extender_url}/quota").json()
        (mine,) = [q for q in quota["clusterQueues"] if q["name"] == name]
        used = {r["resource"]: (r["used"], r["unit"]) for f in mine["flavors"] for r in f["resources"]}
        assert used == {MIG_RESOURCE: (1, "MIG devices")} and mine["admittedPods"] == 1, mine
        dev_cluster.core.delete_namespaced_pod("first", e2e_namespace, grace_period_seconds=0, _preload_content=False)
        after = wait_for_pods(dev_cluster.api, e2e_namespace, ["second"], timeout_s=90)
        assert after.bound == {"second": names[0]}, after.describe() + dev_cluster.log_tail("extender")
    finally:
        for pod_name in ("first", "second"):
            with contextlib.suppress(Exception):
                dev_cluster.core.delete_namespaced_pod(pod_name, e2e_namespace, grace_period_seconds=0,
                                                       _preload_content=False)
        with contextlib.suppress(Exception):
            custom.delete_namespaced_custom_object(GROUP, "v1beta2", e2e_namespace, "localqueues", "mig")
        with contextlib.suppress(Exception):
            custom.delete_cluster_custom_object(GROUP, "v1beta2", "clusterqueues", name)
        with contextlib.suppress(Exception):
            custom.delete_cluster_custom_object(GROUP, "v1beta2", "resourceflavors", name)
        dev_cluster.delete_nodes(names)
