"""Workloads that really run and finish (ClusterOptions.lifecycle): kube-controller-manager's Job and Deployment
controllers create the pods, our webhook mutates them, our extender places them, KWOK runs them (and finishes the
ones annotated with lifecycle.RUN_SECONDS_ANNOTATION), and the GPUs they held come back."""

from __future__ import annotations

import contextlib
import datetime as dt
import time
from collections.abc import Callable
from typing import Any

import httpx
import orjson
import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException

from kube_vgpu import protocol
from kube_vgpu.dev.devcluster.cluster import DevCluster
from kube_vgpu.dev.devcluster.lifecycle import RUN_SECONDS_ANNOTATION, run_seconds_annotation
from kube_vgpu.dev.devcluster.workload import PAUSE_IMAGE, assignment_of, list_pods
from tests.e2e.checks import wait_until
from tests.e2e.conftest import NodeSet

pytestmark = pytest.mark.e2e

RUN_SECONDS = 5
GPU_MEMORY_MIB = 1024


def _gpu_pod_template(nodes: NodeSet, *, restart_policy: str, annotations: dict[str, str]) -> dict[str, Any]:
    return {
        "metadata": {"annotations": annotations},
        "spec": {
            "restartPolicy": restart_policy,
            "nodeSelector": nodes.selector,
            "terminationGracePeriodSeconds": 0,
            "containers": [
                {
                    "name": "main",
                    "image": PAUSE_IMAGE,
                    "resources": {
                        "limits": {protocol.RESOURCE_GPU: "1", protocol.RESOURCE_GPU_MEMORY: str(GPU_MEMORY_MIB)},
                        "requests": {"cpu": "100m", "memory": "128Mi"},
                    },
                }
            ],
        },
    }


def _used_memory_mib(cluster: DevCluster, node_names: list[str]) -> int:
    state = httpx.get(f"{cluster.extender_url}/state", timeout=10).json()
    return sum(gpu["usedMemoryMiB"] for node in state["nodes"] if node["name"] in node_names for gpu in node["gpus"])


def _wait(what: str, check: Callable[[], Any], timeout_s: float, describe: Callable[[], str]) -> Any:
    return wait_until(what, check, describe, timeout_s)


def _phases(pods: list[dict[str, Any]]) -> dict[str, str]:
    return {pod["metadata"]["name"]: (pod.get("status") or {}).get("phase", "") for pod in pods}


def _logs(cluster: DevCluster) -> str:
    return "\n".join(
        f"--- {name} ---\n{cluster.log_tail(name, 15)}" for name in ("kube-controller-manager", "kwok", "extender")
    )


def _seconds(timestamp: str) -> float:
    return dt.datetime.fromisoformat(timestamp.replace("Z", "+00:00")).timestamp()


def test_job_pods_are_mutated_placed_run_and_succeed_and_free_their_gpu_memory(
    dev_cluster: DevCluster, e2e_namespace: str, gpu_nodes: Callable[..., NodeSet]
) -> None:
    nodes = gpu_nodes(1, gpus=2)
    batch = client.BatchV1Api(dev_cluster.api)
    job = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": "train"},
        "spec": {
            "parallelism": 2,
            "completions": 2,
            "backoffLimit": 0,
            "template": _gpu_pod_template(
                nodes, restart_policy="Never", annotations=run_seconds_annotation(RUN_SECONDS)
            ),
        },
    }
    batch.create_namespaced_job(e2e_namespace, job, _preload_content=False)
    try:
        selector = "batch.kubernetes.io/job-name=train"

        def pods() -> list[dict[str, Any]]:
            return list_pods(dev_cluster.api, e2e_namespace, label_selector=selector)

        # The Job controller creates both pods; the extender binds them (assignment annotation, our node).
        peak_used_mib = 0

        def both_bound() -> bool:
            nonlocal peak_used_mib
            peak_used_mib = max(peak_used_mib, _used_memory_mib(dev_cluster, nodes.names))
            found = pods()
            return len(found) == 2 and all(pod["spec"].get("nodeName") for pod in found)

        _wait("the Job's 2 pods bound", both_bound, 90, lambda: f"{_phases(pods())}\n{_logs(dev_cluster)}")
        for pod in pods():
            annotations = pod["metadata"].get("annotations") or {}
            # mutated by our webhook (its admission mark and the limiter's environment), placed by our extender
            assert annotations.get(protocol.POD_ADMITTED_ANNOTATION), annotations
            env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0].get("env") or []}
            assert env.get("CUDA_DEVICE_MEMORY_LIMIT_0") == f"{GPU_MEMORY_MIB}m", env
            assignment = assignment_of(pod)
            assert assignment is not None and assignment.node == pod["spec"]["nodeName"] in nodes.names
            assert annotations[RUN_SECONDS_ANNOTATION] == str(RUN_SECONDS)
            assert pod["metadata"]["ownerReferences"][0]["kind"] == "Job"

        # KWOK runs them, and finishes them RUN_SECONDS later; the Job controller then completes the Job.
        def job_complete() -> bool:
            nonlocal peak_used_mib
            peak_used_mib = max(peak_used_mib, _used_memory_mib(dev_cluster, nodes.names))
            status = orjson.loads(batch.read_namespaced_job_status("train", e2e_namespace,
                                                                   _preload_content=False).data)["status"]
            conditions = {c["type"]: c["status"] for c in status.get("conditions") or []}
            assert conditions.get("Failed") != "True", status
            return conditions.get("Complete") == "True" and status.get("succeeded") == 2

        _wait("the Job complete", job_complete, 120, lambda: f"{_phases(pods())}\n{_logs(dev_cluster)}")
        assert peak_used_mib == 2 * GPU_MEMORY_MIB, "both pods' GPU memory should have been held while they ran"
        for pod in pods():
            status = pod["status"]
            assert status["phase"] == "Succeeded", status
            terminated = status["containerStatuses"][0]["state"]["terminated"]
            assert terminated["reason"] == "Completed" and terminated["exitCode"] == 0
            ran_s = _seconds(terminated["finishedAt"]) - _seconds(status["startTime"])
            assert ran_s >= RUN_SECONDS - 1, f"{pod['metadata']['name']} ran {ran_s} s, not {RUN_SECONDS}"

        # Finished pods hold nothing: the extender frees their GPU memory.
        _wait("the GPU memory free again", lambda: _used_memory_mib(dev_cluster, nodes.names) == 0, 30,
              lambda: f"{_used_memory_mib(dev_cluster, nodes.names)} MiB still used")
    finally:
        # Background propagation: the garbage collector deletes the Job's pods.
        with contextlib.suppress(ApiException):
            batch.delete_namespaced_job("train", e2e_namespace, propagation_policy="Background",
                                        _preload_content=False)
    _wait("the garbage collector deleting the Job's pods",
          lambda: not list_pods(dev_cluster.api, e2e_namespace, label_selector="batch.kubernetes.io/job-name=train"),
          60, lambda: _logs(dev_cluster))


def test_deployment_pod_is_placed_and_running_and_deleting_the_deployment_frees_its_gpu(
    dev_cluster: DevCluster, e2e_namespace: str, gpu_nodes: Callable[..., NodeSet]
) -> None:
    nodes = gpu_nodes(1, gpus=1)
    apps = client.AppsV1Api(dev_cluster.api)
    labels = {"app": "serve"}
    template = _gpu_pod_template(nodes, restart_policy="Always", annotations={})
    template["metadata"]["labels"] = labels
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "serve"},
        "spec": {"replicas": 1, "selector": {"matchLabels": labels}, "template": template},
    }
    apps.create_namespaced_deployment(e2e_namespace, deployment, _preload_content=False)
    try:
        def running() -> dict[str, Any] | None:
            found = list_pods(dev_cluster.api, e2e_namespace, label_selector="app=serve")
            ready = [pod for pod in found if (pod.get("status") or {}).get("phase") == "Running"]
            return ready[0] if len(found) == 1 and ready else None

        pod = _wait("the Deployment's pod Running", running, 90,
                    lambda: f"{_phases(list_pods(dev_cluster.api, e2e_namespace))}\n{_logs(dev_cluster)}")
        assert pod["status"].get("podIP"), pod["status"]
        assert {c["type"]: c["status"] for c in pod["status"]["conditions"]}.get("Ready") == "True"
        assignment = assignment_of(pod)
        assert assignment is not None and assignment.node == pod["spec"]["nodeName"] == nodes.names[0]
        assert pod["metadata"]["ownerReferences"][0]["kind"] == "ReplicaSet"
        assert _used_memory_mib(dev_cluster, nodes.names) == GPU_MEMORY_MIB
        # no run-seconds annotation (and restartPolicy Always): it keeps running
        time.sleep(2)
        assert running() is not None
    finally:
        with contextlib.suppress(ApiException):
            apps.delete_namespaced_deployment("serve", e2e_namespace, propagation_policy="Background",
                                              _preload_content=False)
    # garbage collector: Deployment -> ReplicaSet -> pod; KWOK completes the pod's deletion (its grace period)
    _wait("the Deployment's pod deleted", lambda: not list_pods(dev_cluster.api, e2e_namespace), 60,
          lambda: _logs(dev_cluster))
    _wait("the GPU memory free again", lambda: _used_memory_mib(dev_cluster, nodes.names) == 0, 30,
          lambda: f"{_used_memory_mib(dev_cluster, nodes.names)} MiB still used")
