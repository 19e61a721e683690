"""The webhook through the real kube-apiserver: mutation applied, bad pods refused with our message, and what a
webhook outage does (GPU pods refused: they must not escape their limits; other pods unaffected)."""

from __future__ import annotations

import ssl
import time
import urllib.request
from typing import Any

import orjson
import pytest
from kubernetes.client.rest import ApiException

from kube_vgpu import protocol
from kube_vgpu.dev.devcluster.cluster import DevCluster
from kube_vgpu.dev.devcluster.workload import gpu_pod

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
