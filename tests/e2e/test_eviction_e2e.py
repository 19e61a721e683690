"""LiveEvictor against the real API server, with the extender's own credentials (so the shipped RBAC is what is
exercised): a PodDisruptionBudget refuses (BLOCKED, the pod stays), without one the victim is marked, evicted
and KWOK finishes it, with both events recorded; a victim that lingers terminating carries our condition; a stale UID
evicts nothing (GONE)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import orjson
import pytest
from kubernetes import client, watch
from kubernetes.client.rest import ApiException

from kube_vgpu.dev.devcluster.cluster import DevCluster
from kube_vgpu.dev.devcluster.workload import gpu_pod
from kube_vgpu.extender.preemption.evict import (
    DISRUPTION_TARGET,
    PREEMPTION_BY_SCHEDULER,
    EvictionOutcome,
    EvictionRequest,
)
from kube_vgpu.extender.sources.apiclient import make_api_client
from kube_vgpu.extender.sources.evictor import LiveEvictor
from tests.e2e.checks import read_pod, wait_until
from tests.e2e.conftest import NodeSet

pytestmark = pytest.mark.e2e

RULE = "priority 1000 > 0"
TIMEOUT_S = 60.0


@pytest.fixture
def evictor(dev_cluster: DevCluster) -> Iterator[LiveEvictor]:
    api_client = make_api_client(str(dev_cluster.extender_kubeconfig))
    try:
        yield LiveEvictor(api_client, reporting_instance="kube-vgpu-extender-e2e")
    finally:
        api_client.close()


def _running_pod(cluster: DevCluster, namespace: str, name: str, nodes: NodeSet) -> dict[str, Any]:
    body = gpu_pod(name, memory_mib=1024, labels={"app": name}, node_selector=nodes.selector)
    cluster.core.create_namespaced_pod(namespace, body, _preload_content=False)

    def running() -> dict[str, Any] | None:
        pod = read_pod(cluster, namespace, name)
        return pod if pod and (pod.get("status") or {}).get("phase") == "Running" else None

    pod: dict[str, Any] = wait_until(f"pod {name} Running", running, lambda: str(read_pod(cluster, namespace, name)))
    return pod


def _request(victim: dict[str, Any], preemptor: dict[str, Any], *, uid: str | None = None) -> EvictionRequest:
    return EvictionRequest(
        namespace=victim["metadata"]["namespace"],
        name=victim["metadata"]["name"],
        uid=uid or victim["metadata"]["uid"],
        preemptor_namespace=preemptor["metadata"]["namespace"],
        preemptor_name=preemptor["metadata"]["name"],
        preemptor_uid=preemptor["metadata"]["uid"],
        rule=RULE,
        node_name=victim["spec"]["nodeName"],
    )


def _disruption_target(pod: dict[str, Any] | None) -> dict[str, Any] | None:
    for condition in ((pod or {}).get("status") or {}).get("conditions") or []:
        if condition.get("type") == DISRUPTION_TARGET:
            found: dict[str, Any] = condition
            return found
    return None


def _events(cluster: DevCluster, namespace: str) -> list[dict[str, Any]]:
    response = client.EventsV1Api(cluster.api).list_namespaced_event(namespace, _preload_content=False)
    items: list[dict[str, Any]] = orjson.loads(response.data).get("items") or []
    return items


def test_a_pod_disruption_budget_blocks_the_eviction_and_the_pod_stays(
    dev_cluster: DevCluster, e2e_namespace: str, gpu_nodes: Callable[..., NodeSet], evictor: LiveEvictor
) -> None:
    nodes = gpu_nodes(1, gpus=2)
    victim = _running_pod(dev_cluster, e2e_namespace, "victim", nodes)
    preemptor = _running_pod(dev_cluster, e2e_namespace, "preemptor", nodes)
    policy = client.PolicyV1Api(dev_cluster.api)
    pdb = {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {"name": "keep-victim"},
        "spec": {"minAvailable": 1, "selector": {"matchLabels": {"app": "victim"}}},
    }
    policy.create_namespaced_pod_disruption_budget(e2e_namespace, pdb, _preload_content=False)

    def pdb_counted() -> bool:
        # the disruption controller has counted the pod: a 429 now is the budget's, not "not yet observed"
        document = orjson.loads(
            policy.read_namespaced_pod_disruption_budget("keep-victim", e2e_namespace, _preload_content=False).data
        )
        status = document.get("status") or {}
        return bool(
            status.get("observedGeneration") == document["metadata"].get("generation")
            and status.get("currentHealthy") == 1
            and status.get("disruptionsAllowed") == 0
        )

    wait_until("the PodDisruptionBudget's status", pdb_counted,
               lambda: dev_cluster.log_tail("kube-controller-manager", 15))

    result = evictor.evict(_request(victim, preemptor))

    assert result.outcome is EvictionOutcome.BLOCKED, result
    # the API server's words, and which budget refused (the cause the Eviction API adds)
    assert "disruption budget" in result.detail and "keep-victim" in result.detail, result.detail
    after = read_pod(dev_cluster, e2e_namespace, "victim")
    assert after is not None and after["metadata"]["uid"] == victim["metadata"]["uid"]
    assert not after["metadata"].get("deletionTimestamp"), "a refused eviction deleted the pod"
    # marked before the eviction was asked for, as kube-scheduler does (the disruption controller clears a
    # DisruptionTarget that no deletion follows, after its timeout)
    condition = _disruption_target(after)
    assert condition is not None and condition["reason"] == PREEMPTION_BY_SCHEDULER, after["status"]
    assert not [e for e in _events(dev_cluster, e2e_namespace) if e.get("reason") in ("Preempted", "Preempting")]


def test_without_a_budget_the_victim_is_marked_evicted_and_both_events_are_recorded(
    dev_cluster: DevCluster, e2e_namespace: str, gpu_nodes: Callable[..., NodeSet], evictor: LiveEvictor
) -> None:
    nodes = gpu_nodes(1, gpus=2)
    victim = _running_pod(dev_cluster, e2e_namespace, "victim", nodes)
    preemptor = _running_pod(dev_cluster, e2e_namespace, "preemptor", nodes)

    result = evictor.evict(_request(victim, preemptor))
    assert result.outcome is EvictionOutcome.EVICTED, result

    # every change of the victim since it was read, to its deletion: the condition may live only milliseconds
    conditions: list[dict[str, Any]] = []
    deleted = False
    stream = watch.Watch().stream(
        dev_cluster.core.list_namespaced_pod,
        e2e_namespace,
        field_selector="metadata.name=victim",
        resource_version=victim["metadata"]["resourceVersion"],
        timeout_seconds=int(TIMEOUT_S),
        _request_timeout=TIMEOUT_S + 10,
    )
    for event in stream:
        pod = dev_cluster.api.sanitize_for_serialization(event["object"])
        condition = _disruption_target(pod)
        if condition is not None:
            conditions.append(condition)
        if event["type"] == "DELETED":
            deleted = True
            break
    assert deleted, f"the victim was not deleted: {read_pod(dev_cluster, e2e_namespace, 'victim')}"
    assert conditions, "the victim never had the DisruptionTarget condition"
    first = conditions[0]
    assert first["status"] == "True" and first["reason"] == PREEMPTION_BY_SCHEDULER, conditions
    assert first["message"] == (
        f"kube-vgpu-scheduler: preempting to accommodate a higher priority pod {e2e_namespace}/preemptor ({RULE})"
    )
    assert read_pod(dev_cluster, e2e_namespace, "preemptor") is not None

    node = victim["spec"]["nodeName"]
    events = {(e["reason"], e["regarding"]["name"]): e for e in _events(dev_cluster, e2e_namespace)
              if e.get("reportingController") == "kube-vgpu-extender"}
    preempted = events.get(("Preempted", "victim"))
    preempting = events.get(("Preempting", "preemptor"))
    assert preempted is not None and preempting is not None, sorted(events)
    assert preempted["note"] == f"Preempted by {e2e_namespace}/preemptor on node {node}: {RULE}"
    assert preempted["type"] == "Normal" and preempted["regarding"]["uid"] == victim["metadata"]["uid"]
    assert preempted["related"]["name"] == "preemptor"
    assert preempting["note"] == f"Preempting {e2e_namespace}/victim on node {node}: {RULE}"
    assert preempting["regarding"]["uid"] == preemptor["metadata"]["uid"]


def test_a_stale_uid_or_a_missing_pod_evicts_nothing(
    dev_cluster: DevCluster, e2e_namespace: str, gpu_nodes: Callable[..., NodeSet], evictor: LiveEvictor
) -> None:
    nodes = gpu_nodes(1, gpus=2)
    victim = _running_pod(dev_cluster, e2e_namespace, "victim", nodes)
    preemptor = _running_pod(dev_cluster, e2e_namespace, "preemptor", nodes)

    stale = evictor.evict(_request(victim, preemptor, uid="00000000-0000-0000-0000-000000000000"))
    assert stale.outcome is EvictionOutcome.GONE, stale
    after = read_pod(dev_cluster, e2e_namespace, "victim")
    assert after is not None and not after["metadata"].get("deletionTimestamp")
    assert _disruption_target(after) is None, "a pod of another UID was marked"

    missing = dict(victim, metadata={**victim["metadata"], "name": "no-such-pod"})
    gone = evictor.evict(_request(missing, preemptor))
    assert gone.outcome is EvictionOutcome.GONE, gone
    assert not [e for e in _events(dev_cluster, e2e_namespace) if e.get("reason") in ("Preempted", "Preempting")]


def test_an_evicted_pod_that_lingers_says_it_was_preempted(
    dev_cluster: DevCluster, e2e_namespace: str, gpu_nodes: Callable[..., NodeSet], evictor: LiveEvictor
) -> None:
    """The Eviction API writes its own DisruptionTarget (EvictionByEvictionAPI) over ours before it deletes; a pod
    that stays terminating for a while (here: held by a finalizer, elsewhere: its grace period) ends up with ours."""
    nodes = gpu_nodes(1, gpus=2)
    hold = "e2e.kube-vgpu.io/hold"
    body = gpu_pod("victim", memory_mib=1024, labels={"app": "victim"}, node_selector=nodes.selector)
    body["metadata"]["finalizers"] = [hold]
    dev_cluster.core.create_namespaced_pod(e2e_namespace, body, _preload_content=False)
    try:
        victim = wait_until(
            "pod victim Running",
            lambda: (p := read_pod(dev_cluster, e2e_namespace, "victim"))
            and p["status"].get("phase") == "Running" and p,
            lambda: str(read_pod(dev_cluster, e2e_namespace, "victim")),
        )
        preemptor = _running_pod(dev_cluster, e2e_namespace, "preemptor", nodes)

        result = evictor.evict(_request(victim, preemptor))

        assert result.outcome is EvictionOutcome.EVICTED, result
        after = read_pod(dev_cluster, e2e_namespace, "victim")
        assert after is not None and after["metadata"].get("deletionTimestamp"), after
        condition = _disruption_target(after)
        assert condition is not None and condition["reason"] == PREEMPTION_BY_SCHEDULER, after["status"]
    finally:
        patch = {"metadata": {"finalizers": None}}
        with contextlib.suppress(ApiException):
            dev_cluster.core.patch_namespaced_pod("victim", e2e_namespace, patch, _preload_content=False)
