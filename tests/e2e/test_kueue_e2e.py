"""The real Kueue controller beside us (issue 15): Kueue v0.19.2 built from its Go module, its own CRDs, webhooks and
RBAC (kube_vgpu/dev/devcluster/kueue.py), configured as its "Using HAMi" guide says (per-vGPU memory and compute
budgeted as nvidia.com/total-gpumem and total-gpucores). Kueue suspends, admits and resumes Jobs; our extender runs
in quota mode kueue (found on its own: `auto`) and places the pods of admitted Workloads on GPUs.

The same objects and Jobs in the shared cluster, with Kueue's CRDs and no Kueue controller (quota mode enforce),
admit the same number of pods: our gate stands in for Kueue faithfully.

This module starts a dev cluster of its own (the shared one has no Kueue controller, and must not: its extender
enforces quota itself).
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException

from kube_vgpu import protocol
from kube_vgpu.dev.devcluster.cluster import DevCluster, NodeGroup
from kube_vgpu.dev.devcluster.lifecycle import run_seconds_annotation
from kube_vgpu.dev.devcluster.workload import (
    PAUSE_IMAGE,
    assignment_of,
    ensure_namespace,
    list_pods,
    scheduling_failures,
)
from tests.e2e.checks import assert_no_overcommit, wait_until
from tests.e2e.conftest import NODE_GROUP_LABEL, private_cluster

pytestmark = pytest.mark.e2e

GROUP = protocol.KUEUE_API_GROUP
VERSION = "v1beta2"
#: two pods of 2048 MiB each per Job: a 4096 MiB total-gpumem budget holds one Job at a time
POD_MEMORY_MIB = 2048
POD_CORES = 25
BUDGET_MIB = 4096
#: long enough for the checks made while the first Job runs, even on a loaded machine
FIRST_RUN_SECONDS = 30


@pytest.fixture(scope="module")
def kueue_cluster() -> Iterator[DevCluster]:
    with private_cluster(
        "kueue-cluster",
        node_groups=(NodeGroup(count=1, gpus=4, prefix="kueue-a100", labels=((NODE_GROUP_LABEL, "kueue-a100"),)),),
        lifecycle=True, kueue=True,
    ) as cluster:
        yield cluster


def _queues(cluster: DevCluster, namespace: str, *, selector: dict[str, str]) -> None:
    """The ClusterQueue of Kueue's HAMi guide (vGPUs, total-gpumem, total-gpucores), its flavor and a LocalQueue."""
    custom: Any = client.CustomObjectsApi(cluster.api)
    flavor = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "ResourceFlavor", "metadata": {"name": namespace},
              "spec": {"nodeLabels": selector}}
    queue = {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "ClusterQueue", "metadata": {"name": namespace},
        "spec": {
            "namespaceSelector": {"matchLabels": {protocol.LABEL_NAMESPACE_NAME: namespace}},
            "resourceGroups": [{
                "coveredResources": [protocol.RESOURCE_GPU, "nvidia.com/total-gpumem", "nvidia.com/total-gpucores"],
                "flavors": [{"name": namespace, "resources": [
                    {"name": protocol.RESOURCE_GPU, "nominalQuota": 8},
                    {"name": "nvidia.com/total-gpumem", "nominalQuota": BUDGET_MIB},
                    {"name": "nvidia.com/total-gpucores", "nominalQuota": 800}]}],
            }],
        },
    }
    local = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "LocalQueue", "metadata": {"name": "team"},
             "spec": {"clusterQueue": namespace}}
    custom.create_cluster_custom_object(GROUP, VERSION, "resourceflavors", flavor)
    custom.create_cluster_custom_object(GROUP, VERSION, "clusterqueues", queue)
    custom.create_namespaced_custom_object(GROUP, VERSION, namespace, "localqueues", local)


def _delete_queues(cluster: DevCluster, namespace: str) -> None:
    custom: Any = client.CustomObjectsApi(cluster.api)
    with contextlib.suppress(ApiException):
        custom.delete_namespaced_custom_object(GROUP, VERSION, namespace, "localqueues", "team")
    for plural in ("clusterqueues", "resourceflavors"):
        with contextlib.suppress(ApiException):
            custom.delete_cluster_custom_object(GROUP, VERSION, plural, namespace)


def _job(name: str, *, pods: int, run_seconds: float, selector: dict[str, str], memory_mib: int = POD_MEMORY_MIB,
         cores: int = POD_CORES, gang: bool = False) -> dict[str, Any]:
    """A batch/v1 Job as Kueue's examples write it: the queue label on the Job, HAMi's resources per vGPU."""
    annotations = {protocol.ANNOTATION_JOB_GANG: "true"} if gang else {}
    return {
        "apiVersion": "batch/v1", "kind": "Job",
        "metadata": {"name": name, "labels": {protocol.LABEL_KUEUE_QUEUE_NAME: "team"}, "annotations": annotations},
        "spec": {
            "parallelism": pods, "completions": pods,
            "template": {
                "metadata": {"annotations": run_seconds_annotation(run_seconds)},
                "spec": {
                    "restartPolicy": "Never",
                    "terminationGracePeriodSeconds": 0,
                    "nodeSelector": selector,
                    "containers": [{
                        "name": "main", "image": PAUSE_IMAGE,
                        "resources": {"limits": {protocol.RESOURCE_GPU: "1",
                                                 protocol.RESOURCE_GPU_MEMORY: str(memory_mib),
                                                 protocol.RESOURCE_GPU_CORES: str(cores)}},
                    }],
                },
            },
        },
    }


def _create_job(cluster: DevCluster, namespace: str, job: dict[str, Any]) -> None:
    batch: Any = client.BatchV1Api(cluster.api)
    batch.create_namespaced_job(namespace, job, _preload_content=False)


def _read_job(cluster: DevCluster, namespace: str, name: str) -> dict[str, Any]:
    batch: Any = client.BatchV1Api(cluster.api)
    job: dict[str, Any] = orjson.loads(batch.read_namespaced_job(name, namespace, _preload_content=False).data)
    return job


def _workload_of(cluster: DevCluster, namespace: str, job_name: str) -> dict[str, Any] | None:
    custom: Any = client.CustomObjectsApi(cluster.api)
    found = orjson.loads(custom.list_namespaced_custom_object(GROUP, VERSION, namespace, "workloads",
                                                              _preload_content=False).data)
    for workload in found.get("items") or []:
        owners = workload["metadata"].get("ownerReferences") or []
        if any(owner.get("kind") == "Job" and owner.get("name") == job_name for owner in owners):
            return dict(workload)
    return None


def _condition(workload: dict[str, Any] | None, kind: str) -> dict[str, Any]:
    for condition in ((workload or {}).get("status") or {}).get("conditions") or []:
        if condition.get("type") == kind:
            return dict(condition)
    return {}


def _job_pods(cluster: DevCluster, namespace: str, job_name: str) -> list[dict[str, Any]]:
    return list_pods(cluster.api, namespace, label_selector=f"job-name={job_name}")


def _bound(pods: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [pod for pod in pods if pod["spec"].get("nodeName")]


def _describe(cluster: DevCluster, namespace: str) -> str:
    pods = list_pods(cluster.api, namespace)
    lines = [f"{p['metadata']['name']}: node={p['spec'].get('nodeName')} phase={p['status'].get('phase')}"
             for p in pods]
    return "\n".join(lines) + "\n--- kueue ---\n" + cluster.log_tail("kueue", 10) + "\n--- extender ---\n" + \
        cluster.log_tail("extender", 10)


@pytest.fixture
def kueue_namespace(kueue_cluster: DevCluster, request: pytest.FixtureRequest) -> Iterator[str]:
    name = "kq-" + request.node.name.split("[")[0][-40:].replace("_", "-").strip("-").lower()
    ensure_namespace(kueue_cluster.api, name)
    yield name
    batch: Any = client.BatchV1Api(kueue_cluster.api)
    with contextlib.suppress(ApiException):
        batch.delete_collection_namespaced_job(name, propagation_policy="Background", _preload_content=False)
    with contextlib.suppress(ApiException):
        kueue_cluster.core.delete_collection_namespaced_pod(name, grace_period_seconds=0, _preload_content=False)
    _delete_queues(kueue_cluster, name)
    with contextlib.suppress(ApiException):
        kueue_cluster.core.delete_namespace(name, _preload_content=False)


def test_kueue_admits_jobs_in_turn_and_their_pods_land_on_gpus_with_limits(
    kueue_cluster: DevCluster, kueue_namespace: str
) -> None:
    cluster, namespace = kueue_cluster, kueue_namespace
    selector = {NODE_GROUP_LABEL: "kueue-a100"}
    _queues(cluster, namespace, selector=selector)
    quota_mode = httpx.get(f"{cluster.extender_url}/quota", timeout=10).json()
    assert quota_mode["mode"] == "kueue", quota_mode  # `auto` found Kueue's controller

    _create_job(cluster, namespace, _job("first", pods=2, run_seconds=FIRST_RUN_SECONDS, selector=selector))
    first_pods = wait_until("the first Job's 2 pods bound", lambda: len(_bound(_job_pods(cluster, namespace,
                            "first"))) == 2 and _job_pods(cluster, namespace, "first"),
                            lambda: _describe(cluster, namespace))
    for pod in first_pods:
        assignment = assignment_of(pod)
        assert assignment is not None, pod["metadata"]
        (container,) = assignment.containers
        assert [device.memory_mib for device in container.devices] == [POD_MEMORY_MIB]
        env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0].get("env") or []}
        assert env.get(f"{protocol.ENV_MEMORY_LIMIT_PREFIX}0") == f"{POD_MEMORY_MIB}m", env
        assert env.get(protocol.ENV_SM_LIMIT) == str(POD_CORES), env

    # the second Job is over the total-gpumem budget while the first runs: Kueue keeps it suspended, and says why
    _create_job(cluster, namespace, _job("second", pods=2, run_seconds=1, selector=selector))
    waiting = wait_until("Kueue to refuse the second Job quota",
                         lambda: (w := _workload_of(cluster, namespace, "second")) is not None
                         and _condition(w, "QuotaReserved").get("status") == "False"
                         and _condition(w, "QuotaReserved").get("message") and w,
                         lambda: _describe(cluster, namespace))
    message = _condition(waiting, "QuotaReserved")["message"]
    assert "nvidia.com/total-gpumem" in message, message
    assert _read_job(cluster, namespace, "second")["spec"]["suspend"] is True
    assert _job_pods(cluster, namespace, "second") == []

    # /quota: what landed on GPUs beside what Kueue charged (its ClusterQueue status, which it updates a moment
    # after admitting), for the same queue
    def mine() -> dict[str, Any]:
        (queue,) = [q for q in httpx.get(f"{cluster.extender_url}/quota", timeout=10).json()["clusterQueues"]
                    if q["name"] == namespace]
        return dict(queue)

    def charged() -> dict[str, int]:
        return {r["resource"]: r["total"] for f in mine()["kueueCharged"] for r in f["resources"]}

    assert mine()["landed"]["nvidia.com/total-gpumem"] == BUDGET_MIB and mine()["landed"]["pods"] == 2, mine()
    wait_until("Kueue's charge of the first Job in /quota",
               lambda: charged().get("nvidia.com/total-gpumem") == BUDGET_MIB, lambda: str(mine()), timeout_s=30)
    assert charged()[protocol.RESOURCE_GPU] == 2 and charged()["nvidia.com/total-gpucores"] == 2 * POD_CORES

    # the first finishes (KWOK): Kueue admits the second, its pods land
    wait_until("the second Job's pods bound", lambda: len(_bound(_job_pods(cluster, namespace, "second"))) == 2,
               lambda: _describe(cluster, namespace), timeout_s=120)
    assert _condition(_workload_of(cluster, namespace, "first"), "Finished").get("status") == "True"
    assert_no_overcommit(cluster)


def test_a_gang_job_is_placed_whole_after_admission_or_not_at_all(
    kueue_cluster: DevCluster, kueue_namespace: str
) -> None:
    """Kueue admits the 3-pod gang at once (quota is there); 2 exclusive GPUs cannot hold 3 exclusive pods, so the
    extender binds none of them; once a second node comes, all 3."""
    cluster, namespace = kueue_cluster, kueue_namespace
    selector = {NODE_GROUP_LABEL: namespace}
    first = cluster.add_nodes(NodeGroup(count=1, gpus=2, prefix=f"{namespace}-a", labels=((NODE_GROUP_LABEL,
                                                                                            namespace),)))
    added = list(first)
    try:
        _queues(cluster, namespace, selector=selector)
        _create_job(cluster, namespace, _job("train", pods=3, run_seconds=600, selector=selector, memory_mib=1024,
                                             cores=100, gang=True))
        wait_until("Kueue to admit the gang", lambda: _condition(_workload_of(cluster, namespace, "train"),
                   "Admitted").get("status") == "True", lambda: _describe(cluster, namespace))
        wait_until("the gang's 3 pods to be seen by the extender, waiting whole",
                   lambda: any(g["name"].endswith("train") and g["membersSeen"] == 3
                               for g in httpx.get(f"{cluster.extender_url}/state", timeout=10).json()["gangs"]),
                   lambda: _describe(cluster, namespace))
        assert _bound(_job_pods(cluster, namespace, "train")) == [], _describe(cluster, namespace)
        added += cluster.add_nodes(NodeGroup(count=1, gpus=2, prefix=f"{namespace}-b",
                                             labels=((NODE_GROUP_LABEL, namespace),)))
        wait_until("all 3 members bound", lambda: len(_bound(_job_pods(cluster, namespace, "train"))) == 3,
                   lambda: _describe(cluster, namespace), timeout_s=120)
        assert_no_overcommit(cluster)
    finally:
        batch: Any = client.BatchV1Api(cluster.api)
        with contextlib.suppress(ApiException):
            batch.delete_namespaced_job("train", namespace, propagation_policy="Background", _preload_content=False)
        with contextlib.suppress(ApiException):
            cluster.core.delete_collection_namespaced_pod(namespace, grace_period_seconds=0, _preload_content=False)
        cluster.delete_nodes(added)


def test_a_pod_in_a_kueue_queue_without_an_admitted_workload_is_refused_with_the_reason(
    kueue_cluster: DevCluster, kueue_namespace: str
) -> None:
    """Kueue manages Jobs here, not bare pods: a bare pod naming a Kueue queue has no Workload, so the extender does
    not place it (Kueue never admitted it), and says so."""
    cluster, namespace = kueue_cluster, kueue_namespace
    selector = {NODE_GROUP_LABEL: "kueue-a100"}
    _queues(cluster, namespace, selector=selector)
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": "stray", "labels": {protocol.LABEL_KUEUE_QUEUE_NAME: "team"}},
           "spec": {"nodeSelector": selector, "terminationGracePeriodSeconds": 0,
                    "containers": [{"name": "main", "image": PAUSE_IMAGE,
                                    "resources": {"limits": {protocol.RESOURCE_GPU: "1",
                                                             protocol.RESOURCE_GPU_MEMORY: "1024"}}}]}}
    cluster.core.create_namespaced_pod(namespace, pod, _preload_content=False)

    def reason() -> str:
        (found,) = list_pods(cluster.api, namespace)
        for condition in found["status"].get("conditions") or []:
            if condition.get("type") == "PodScheduled" and condition.get("status") == "False":
                return str(condition.get("message") or "")
        return ""

    message = wait_until("the stray pod refused", reason, lambda: _describe(cluster, namespace))
    assert "Kueue has no Workload for it" in message, message
    assert not list_pods(cluster.api, namespace)[0]["spec"].get("nodeName")


def test_enforce_mode_without_kueue_admits_the_same_pods_from_the_same_objects(
    dev_cluster: DevCluster, kueue_crds: None, e2e_namespace: str, gpu_nodes: Any
) -> None:
    """The shared cluster has Kueue's CRDs but no Kueue controller: its extender (auto -> enforce) admits the pods
    itself against the same ClusterQueue. Same Jobs, same budget: the first Job's 2 pods run, the second's wait
    (Pending, our reason, instead of a suspended Job), then run once the first finished."""
    nodes = gpu_nodes(1, gpus=4)
    assert httpx.get(f"{dev_cluster.extender_url}/quota", timeout=10).json().get("mode", "enforce") == "enforce"
    _queues(dev_cluster, e2e_namespace, selector=nodes.selector)
    try:
        wait_until("the extender to see the ClusterQueue",
                   lambda: any(q["name"] == e2e_namespace for q in httpx.get(
                       f"{dev_cluster.extender_url}/quota", timeout=10).json()["clusterQueues"]),
                   lambda: dev_cluster.log_tail("extender"), timeout_s=30)
        _create_job(dev_cluster, e2e_namespace, _job("first", pods=2, run_seconds=FIRST_RUN_SECONDS,
                                                     selector=nodes.selector))
        wait_until("the first Job's 2 pods bound",
                   lambda: len(_bound(_job_pods(dev_cluster, e2e_namespace, "first"))) == 2,
                   lambda: _describe(dev_cluster, e2e_namespace))
        _create_job(dev_cluster, e2e_namespace, _job("second", pods=2, run_seconds=1, selector=nodes.selector))
        refused = wait_until("the second Job's 2 pods refused for quota",
                             lambda: len(r := {name: reason for name, reason in scheduling_failures(
                                 dev_cluster.api, e2e_namespace).items() if name.startswith("second-")}) == 2 and r,
                             lambda: _describe(dev_cluster, e2e_namespace))
        assert all(e2e_namespace in reason and "nvidia.com/total-gpumem" in reason for reason in refused.values()), \
            refused
        # while the first runs, the same 2 pods are admitted as under Kueue
        (mine,) = [q for q in httpx.get(f"{dev_cluster.extender_url}/quota", timeout=10).json()["clusterQueues"]
                   if q["name"] == e2e_namespace]
        assert mine["admittedPods"] == 2 and _bound(_job_pods(dev_cluster, e2e_namespace, "second")) == [], mine
        wait_until("the second Job's pods bound", lambda: len(_bound(_job_pods(dev_cluster, e2e_namespace,
                                                                               "second"))) == 2,
                   lambda: _describe(dev_cluster, e2e_namespace), timeout_s=120)
        assert_no_overcommit(dev_cluster)
    finally:
        _delete_queues(dev_cluster, e2e_namespace)


def test_enforce_mode_beside_kueues_controller_is_refused_unless_forced(kueue_cluster: DevCluster) -> None:
    """Two admission layers with different accounting: the extender will not start that way by mistake (it reads
    the cluster's webhook configurations under its own RBAC to find Kueue's controller)."""
    result = subprocess.run(
        [sys.executable, "-m", "kube_vgpu.cli", "extender", f"--kubeconfig={kueue_cluster.extender_kubeconfig}",
         "--quota-mode=enforce", "--port=0"],
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert "quota mode enforce refused: Kueue's controller is installed" in result.stderr, result.stderr
    assert "kueue-mutating-webhook-configuration" in result.stderr and "--force-quota-mode" in result.stderr
