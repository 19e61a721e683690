"""The webhook through the real kube-apiserver: mutation applied, bad pods refused with our message, and what a
webhook outage does (GPU pods refused: they must not escape their limits; other pods unaffected)."""

from __future__ import annotations

import ssl
import time
import urllib.request
from typing import Any

import orjson
import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException

from kube_vgpu import protocol
from kube_vgpu.dev.devcluster.cluster import DevCluster
from kube_vgpu.dev.devcluster.workload import gpu_pod, wait_for_pods

pytestmark = pytest.mark.e2e


def create(cluster: DevCluster, namespace: str, pod: dict[str, Any]) -> dict[str, Any]:
    response = cluster.core.create_namespaced_pod(namespace, pod, _preload_content=False)
    created: dict[str, Any] = orjson.loads(response.data)
    return created


def env_of(pod: dict[str, Any], container: int = 0) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in pod["spec"]["containers"][container].get("env") or []}


def test_created_gpu_pod_comes_back_mutated(dev_cluster: DevCluster, e2e_namespace: str) -> None:
    pod = gpu_pod("mutated", gpus=2, memory_mib=3000, cores=25)
    pod["spec"]["containers"][0]["env"] = [{"name": "CUDA_DEVICE_SM_LIMIT", "value": "100"}]  # must not stick
    created = create(dev_cluster, e2e_namespace, pod)
    assert created["spec"]["schedulerName"] == protocol.DEFAULT_SCHEDULER_NAME
    env = env_of(created)
    assert env["CUDA_DEVICE_MEMORY_LIMIT_0"] == "3000m" and env["CUDA_DEVICE_MEMORY_LIMIT_1"] == "3000m"
    assert env["CUDA_DEVICE_SM_LIMIT"] == "25"
    limits = created["spec"]["containers"][0]["resources"]
    assert limits["requests"][protocol.RESOURCE_GPU] == limits["limits"][protocol.RESOURCE_GPU] == "2"


def _suspended_job(cluster: DevCluster, namespace: str, name: str, labels: dict[str, str]) -> dict[str, Any]:
    job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": name, "labels": labels},
           "spec": {"suspend": True,  # no controller acts on it: the test creates the pods the Job would
                    "template": {"spec": {"restartPolicy": "Never",
                                          "containers": [{"name": "main", "image": "registry.k8s.io/pause:3.10"}]}}}}
    created: dict[str, Any] = orjson.loads(
        client.BatchV1Api(cluster.api).create_namespaced_job(namespace, job, _preload_content=False).data)
    return created


def _pod_of(job: dict[str, Any], name: str) -> dict[str, Any]:
    pod = gpu_pod(name, memory_mib=1024)
    pod["metadata"]["ownerReferences"] = [{"apiVersion": "batch/v1", "kind": "Job", "name": job["metadata"]["name"],
                                           "uid": job["metadata"]["uid"], "controller": True}]
    return pod


def _local_queue(cluster: DevCluster, namespace: str, name: str) -> None:
    """A LocalQueue of this name (Kueue's CRDs are served: the kueue_crds fixture)."""
    custom: Any = client.CustomObjectsApi(cluster.api)
    local = {"apiVersion": f"{protocol.KUEUE_API_GROUP}/v1beta2", "kind": "LocalQueue", "metadata": {"name": name},
             "spec": {"clusterQueue": "any"}}
    custom.create_namespaced_custom_object(protocol.KUEUE_API_GROUP, "v1beta2", namespace, "localqueues", local)


def test_a_jobs_gpu_pods_get_the_jobs_queue_and_a_missing_queue_is_refused(
    dev_cluster: DevCluster, e2e_namespace: str, kueue_crds: None
) -> None:
    """Issue 13 item 2 through the real API server: the webhook reads the owner Job (under the manifests' read-only
    RBAC) and stamps its kueue.x-k8s.io/queue-name and priority-class on a pod that lacks them; the admission mark
    too, so the extender takes it. A Job naming a LocalQueue that does not exist has its pods refused."""
    _local_queue(dev_cluster, e2e_namespace, "team-q")
    missing = _suspended_job(dev_cluster, e2e_namespace, "typo", {protocol.LABEL_KUEUE_QUEUE_NAME: "team-qq"})
    with pytest.raises(ApiException) as refused:
        create(dev_cluster, e2e_namespace, _pod_of(missing, "typo-0"))
    assert (f"the pod's owner Job {e2e_namespace}/typo names LocalQueue {e2e_namespace}/team-qq "
            "(label kueue.x-k8s.io/queue-name), which does not exist") in str(refused.value.body)
    batch = client.BatchV1Api(dev_cluster.api)
    job = {"apiVersion": "batch/v1", "kind": "Job",
           "metadata": {"name": "train", "labels": {protocol.LABEL_KUEUE_QUEUE_NAME: "team-q",
                                                     protocol.LABEL_KUEUE_PRIORITY_CLASS: "high"}},
           "spec": {"suspend": True,  # no controller acts on it: the test creates the pod the Job would
                    "template": {"spec": {"restartPolicy": "Never",
                                          "containers": [{"name": "main", "image": "registry.k8s.io/pause:3.10"}]}}}}
    created_job = orjson.loads(batch.create_namespaced_job(e2e_namespace, job, _preload_content=False).data)
    pod = gpu_pod("train-0", memory_mib=1024)
    pod["metadata"]["ownerReferences"] = [{"apiVersion": "batch/v1", "kind": "Job", "name": "train",
                                           "uid": created_job["metadata"]["uid"], "controller": True}]
    created = create(dev_cluster, e2e_namespace, pod)
    labels = created["metadata"]["labels"]
    assert labels[protocol.LABEL_KUEUE_QUEUE_NAME] == "team-q"
    assert labels[protocol.LABEL_KUEUE_PRIORITY_CLASS] == "high"
    assert created["metadata"]["annotations"][protocol.POD_ADMITTED_ANNOTATION] == protocol.ADMISSION_MARK_VALUE


def test_invalid_gpu_pod_refused_with_our_message(dev_cluster: DevCluster, e2e_namespace: str) -> None:
    with pytest.raises(ApiException) as refused:
        create(dev_cluster, e2e_namespace, gpu_pod("too-many-cores", cores=150))
    assert refused.value.status in (400, 403)
    assert "container main: nvidia.com/gpucores must be between 0 and 100, got 150" in str(refused.value.body)


def test_users_cannot_set_internal_annotations(dev_cluster: DevCluster, e2e_namespace: str) -> None:
    forged = {protocol.POD_ASSIGNMENT_ANNOTATION: '{"v":1,"node":"x","containers":[]}'}
    plain = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "forger", "annotations": forged},
             "spec": {"containers": [{"name": "main", "image": "registry.k8s.io/pause:3.10"}]}}
    with pytest.raises(ApiException) as refused:
        create(dev_cluster, e2e_namespace, plain)
    assert protocol.POD_ASSIGNMENT_ANNOTATION in str(refused.value.body)


def _restart_webhook(cluster: DevCluster) -> None:
    # the dev cluster records each component's command line; run the webhook again with it and wait for health
    cluster._spawn("webhook", cluster._argv["webhook"], env=cluster._python_env())
    context = ssl.create_default_context(cadata=cluster.webhook_ca_pem.decode())
    health = cluster.webhook_url.replace("/mutate", "/healthz")  # type: ignore[union-attr]
    deadline = time.monotonic() + 60
    while True:
        try:
            with urllib.request.urlopen(health, context=context, timeout=2):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise AssertionError("webhook did not come back:\n" + cluster.log_tail("webhook")) from None
            time.sleep(0.2)


def test_webhook_down_refuses_gpu_pods_and_nothing_else(dev_cluster: DevCluster, e2e_namespace: str) -> None:
    dev_cluster.stop_component("webhook", crash=True)
    try:
        with pytest.raises(ApiException) as refused:
            create(dev_cluster, e2e_namespace, gpu_pod("while-down"))
        assert "failed calling webhook" in str(refused.value.body)
        plain = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "cpu-only"},
                 "spec": {"containers": [{"name": "main", "image": "registry.k8s.io/pause:3.10"}],
                          "terminationGracePeriodSeconds": 0}}
        create(dev_cluster, e2e_namespace, plain)  # not a GPU pod: the CEL matchCondition never sends it to us
        create(dev_cluster, "kube-system", {**plain, "metadata": {"name": f"cpu-only-{e2e_namespace}"}})
        dev_cluster.core.delete_namespaced_pod(f"cpu-only-{e2e_namespace}", "kube-system", grace_period_seconds=0,
                                               _preload_content=False)
    finally:
        _restart_webhook(dev_cluster)
    create(dev_cluster, e2e_namespace, gpu_pod("after-recovery"))


def _patch(cluster: DevCluster, namespace: str, name: str, patch: dict[str, Any]) -> dict[str, Any]:
    response = cluster.core.patch_namespaced_pod(name, namespace, patch, _preload_content=False)
    patched: dict[str, Any] = orjson.loads(response.data)
    return patched


def _bound_gpu_pod(cluster: DevCluster, namespace: str, name: str) -> dict[str, Any]:
    """A GPU pod placed by kube-vgpu: it carries the internal assignment annotation that the Binding wrote."""
    create(cluster, namespace, gpu_pod(name, memory_mib=1000))
    outcome = wait_for_pods(cluster.api, namespace, [name], timeout_s=60)
    assert name in outcome.bound, outcome.describe() + "\n" + cluster.log_tail("extender")
    pod = outcome.pods[name]
    assert protocol.POD_ASSIGNMENT_ANNOTATION in pod["metadata"]["annotations"]
    return pod


def test_updates_that_leave_internal_annotations_alone_never_wait_on_the_webhook(
    dev_cluster: DevCluster, e2e_namespace: str
) -> None:
    """Issue 20, item 5: the UPDATE guard's matchCondition sends only updates touching kube-vgpu.io/ annotations,
    so a webhook outage cannot block a label change, a finalizer removal or a gate removal anywhere."""
    _bound_gpu_pod(dev_cluster, e2e_namespace, "guarded")
    dev_cluster.stop_component("webhook", crash=True)
    try:
        # a GPU pod that carries internal annotations: a label, an ordinary annotation, a finalizer come and go
        labelled = _patch(dev_cluster, e2e_namespace, "guarded", {"metadata": {"labels": {"team": "a"}}})
        assert labelled["metadata"]["labels"]["team"] == "a"
        _patch(dev_cluster, e2e_namespace, "guarded", {"metadata": {"annotations": {"note": "x"},
                                                                    "finalizers": ["e2e.kube-vgpu.io/hold"]}})
        released = _patch(dev_cluster, e2e_namespace, "guarded", {"metadata": {"finalizers": None}})
        assert not released["metadata"].get("finalizers")
        # ... but touching an internal annotation still needs the webhook (failurePolicy Fail: refused while down)
        with pytest.raises(ApiException) as refused:
            _patch(dev_cluster, e2e_namespace, "guarded",
                   {"metadata": {"annotations": {protocol.POD_BIND_TIME_ANNOTATION: "2026-01-01T00:00:00Z"}}})
        assert "failed calling webhook" in str(refused.value.body)
        with pytest.raises(ApiException) as refused:  # removing one is a change too
            _patch(dev_cluster, e2e_namespace, "guarded",
                   {"metadata": {"annotations": {protocol.POD_ASSIGNMENT_ANNOTATION: None}}})
        assert "failed calling webhook" in str(refused.value.body)
    finally:
        _restart_webhook(dev_cluster)
    # with the webhook back, the same change is refused with the webhook's own message
    with pytest.raises(ApiException) as refused:
        _patch(dev_cluster, e2e_namespace, "guarded",
               {"metadata": {"annotations": {protocol.POD_BIND_TIME_ANNOTATION: "2026-01-01T00:00:00Z"}}})
    assert refused.value.status == 403
    assert (f"annotation {protocol.POD_BIND_TIME_ANNOTATION} is written only by kube-vgpu and cannot be added, "
            "changed or removed") in str(refused.value.body)
    # and with the webhook up, an update that leaves them alone passes as before
    unchanged = _patch(dev_cluster, e2e_namespace, "guarded", {"metadata": {"labels": {"team": "b"}}})
    assert unchanged["metadata"]["labels"]["team"] == "b"
