"""Preemption on GPU shares through the real control plane (issue 14): kube-scheduler's own preemption cannot help
(it ignores nvidia.com/gpumem), so our extender decides, evicts through the Eviction API with its own RBAC, KWOK
finishes the victims, and the preemptor lands on the GPUs they held; a PodDisruptionBudget turns the choice to
another victim."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import orjson
import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException

from kube_vgpu.dev.devcluster.cluster import DevCluster
from kube_vgpu.dev.devcluster.workload import gpu_pod
from kube_vgpu.extender.preemption.evict import DISRUPTION_TARGET
from tests.e2e.checks import assert_no_overcommit, read_pod, wait_until
from tests.e2e.conftest import NodeSet

pytestmark = pytest.mark.e2e


@pytest.fixture
def priorities(dev_cluster: DevCluster, e2e_namespace: str) -> Iterator[Callable[[int], str]]:
    """PriorityClasses of this test (cluster-scoped: named after the namespace), deleted afterwards."""
    api = client.SchedulingV1Api(dev_cluster.api)
    made: list[str] = []

    def make(value: int) -> str:
        name = f"{e2e_namespace}-p{value}"
        api.create_priority_class({"apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass",
                                   "metadata": {"name": name}, "value": value}, _preload_content=False)
        made.append(name)
        return name

    yield make
    for name in made:
        with contextlib.suppress(ApiException):
            api.delete_priority_class(name, _preload_content=False)


def _create(cluster: DevCluster, namespace: str, name: str, memory_mib: int, nodes: NodeSet, priority_class: str,
            labels: dict[str, str] | None = None) -> None:
    body = gpu_pod(name, memory_mib=memory_mib, labels={"app": name, **(labels or {})}, node_selector=nodes.selector)
    body["spec"]["priorityClassName"] = priority_class
    cluster.core.create_namespaced_pod(namespace, body, _preload_content=False)


def _running_on(cluster: DevCluster, namespace: str, name: str) -> str:
    def running() -> str | None:
        pod = read_pod(cluster, namespace, name)
        status = (pod or {}).get("status") or {}
        return str(pod["spec"]["nodeName"]) if pod and status.get("phase") == "Running" else None

    node: str = wait_until(f"pod {name} Running", running, lambda: _describe(cluster, namespace, name))
    return node


def _gone(cluster: DevCluster, namespace: str, name: str) -> None:
    wait_until(f"pod {name} gone", lambda: read_pod(cluster, namespace, name) is None,
          lambda: _describe(cluster, namespace, name))


def _describe(cluster: DevCluster, namespace: str, name: str) -> str:
    pod = read_pod(cluster, namespace, name)
    conditions = ((pod or {}).get("status") or {}).get("conditions")
    return f"{name}: {conditions}\n--- extender ---\n{cluster.log_tail('extender', 20)}"


def _event_reasons(cluster: DevCluster, namespace: str) -> list[tuple[str, str, str]]:
    response = client.EventsV1Api(cluster.api).list_namespaced_event(namespace, _preload_content=False)
    items = orjson.loads(response.data).get("items") or []
    return [(e["reason"], e["regarding"]["name"], e.get("note", "")) for e in items
            if e.get("reportingController") == "kube-vgpu-extender"]


def test_a_high_priority_pod_evicts_a_low_priority_one_sharing_the_gpu_and_lands_there(
    dev_cluster: DevCluster, e2e_namespace: str, gpu_nodes: Callable[..., NodeSet],
    priorities: Callable[[int], str],
) -> None:
    nodes = gpu_nodes(1, gpus=1)
    low, high = priorities(0), priorities(1000)
    _create(dev_cluster, e2e_namespace, "notebook", 61440, nodes, low)
    node = _running_on(dev_cluster, e2e_namespace, "notebook")
    _create(dev_cluster, e2e_namespace, "inference", 40960, nodes, high)
    assert _running_on(dev_cluster, e2e_namespace, "inference") == node
    _gone(dev_cluster, e2e_namespace, "notebook")
    reasons = _event_reasons(dev_cluster, e2e_namespace)
    assert any(r[0] == "Preempted" and r[1] == "notebook" and "inference" in r[2] for r in reasons), reasons
    assert any(r[0] == "Preempting" and r[1] == "inference" for r in reasons), reasons
    assert_no_overcommit(dev_cluster)


def test_a_victim_protected_by_a_disruption_budget_stays_and_another_is_evicted(
    dev_cluster: DevCluster, e2e_namespace: str, gpu_nodes: Callable[..., NodeSet],
    priorities: Callable[[int], str],
) -> None:
    nodes = gpu_nodes(1, gpus=1)
    lowest, low, high = priorities(0), priorities(10), priorities(1000)
    _create(dev_cluster, e2e_namespace, "protected", 40960, nodes, lowest)
    _create(dev_cluster, e2e_namespace, "other", 40960, nodes, low)
    _running_on(dev_cluster, e2e_namespace, "protected")
    _running_on(dev_cluster, e2e_namespace, "other")
    policy = client.PolicyV1Api(dev_cluster.api)
    policy.create_namespaced_pod_disruption_budget(e2e_namespace, {
        "apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": {"name": "keep"},
        "spec": {"minAvailable": 1, "selector": {"matchLabels": {"app": "protected"}}}}, _preload_content=False)

    def budget_counted() -> bool:
        response = policy.read_namespaced_pod_disruption_budget("keep", e2e_namespace, _preload_content=False)
        status = orjson.loads(response.data).get("status") or {}
        return bool(status.get("currentHealthy") == 1 and status.get("observedGeneration"))

    wait_until("the disruption controller counting the budget", budget_counted, lambda: "")
    _create(dev_cluster, e2e_namespace, "urgent", 40960, nodes, high)
    _running_on(dev_cluster, e2e_namespace, "urgent")
    _gone(dev_cluster, e2e_namespace, "other")
    kept = read_pod(dev_cluster, e2e_namespace, "protected")
    assert kept is not None and not kept["metadata"].get("deletionTimestamp")
    assert_no_overcommit(dev_cluster)


def test_equal_priority_evicts_nothing(
    dev_cluster: DevCluster, e2e_namespace: str, gpu_nodes: Callable[..., NodeSet],
    priorities: Callable[[int], str],
) -> None:
    nodes = gpu_nodes(1, gpus=1)
    same = priorities(100)
    _create(dev_cluster, e2e_namespace, "first", 61440, nodes, same)
    _running_on(dev_cluster, e2e_namespace, "first")
    _create(dev_cluster, e2e_namespace, "second", 40960, nodes, same)

    def refused_with_our_reason() -> bool:
        pod = read_pod(dev_cluster, e2e_namespace, "second")
        for condition in ((pod or {}).get("status") or {}).get("conditions") or []:
            if condition.get("type") == "PodScheduled" and "no GPU with 40960 MiB free" in condition.get("message", ""):
                return True
        return False

    wait_until("the second pod refused for GPU memory", refused_with_our_reason,
          lambda: _describe(dev_cluster, e2e_namespace, "second"))
    first = read_pod(dev_cluster, e2e_namespace, "first")
    assert first is not None and not first["metadata"].get("deletionTimestamp")
    conditions = (first.get("status") or {}).get("conditions") or []
    assert all(c.get("type") != DISRUPTION_TARGET for c in conditions)


def test_an_extender_killed_between_eviction_and_bind_neither_evicts_twice_nor_loses_the_preemptor(
    dev_cluster: DevCluster, e2e_namespace: str, gpu_nodes: Callable[..., NodeSet],
    priorities: Callable[[int], str],
) -> None:
    """The victim lingers terminating (a finalizer holds it, as a long grace period would); the extender dies and
    comes back knowing nothing of its preemption. It must not evict the other candidate, and the preemptor lands
    once the victim is gone."""
    nodes = gpu_nodes(1, gpus=1)
    low, lower, high = priorities(10), priorities(0), priorities(1000)
    hold = "e2e.kube-vgpu.io/hold"
    body = gpu_pod("victim", memory_mib=40960, labels={"app": "victim"}, node_selector=nodes.selector)
    body["spec"]["priorityClassName"] = lower
    body["metadata"]["finalizers"] = [hold]
    dev_cluster.core.create_namespaced_pod(e2e_namespace, body, _preload_content=False)
    _running_on(dev_cluster, e2e_namespace, "victim")
    _create(dev_cluster, e2e_namespace, "bystander", 40960, nodes, low)
    _running_on(dev_cluster, e2e_namespace, "bystander")
    _create(dev_cluster, e2e_namespace, "urgent", 40960, nodes, high)

    def victim_terminating() -> bool:
        pod = read_pod(dev_cluster, e2e_namespace, "victim")
        return bool(pod and pod["metadata"].get("deletionTimestamp"))

    wait_until("the victim evicted (terminating, held by its finalizer)", victim_terminating,
          lambda: _describe(dev_cluster, e2e_namespace, "urgent"))
    dev_cluster.restart_extender(crash=True)
    try:
        # the restarted extender sees the victim leaving: it waits for it and evicts nobody else
        def nominated_again() -> bool:
            pod = read_pod(dev_cluster, e2e_namespace, "urgent")
            for condition in ((pod or {}).get("status") or {}).get("conditions") or []:
                if condition.get("type") == "PodScheduled" and "terminating pod(s) to leave" in condition.get(
                        "message", ""):
                    return True
            return False

        wait_until("the preemptor waiting for the terminating victim after the restart", nominated_again,
              lambda: _describe(dev_cluster, e2e_namespace, "urgent"))
        bystander = read_pod(dev_cluster, e2e_namespace, "bystander")
        assert bystander is not None and not bystander["metadata"].get("deletionTimestamp")
    finally:
        dev_cluster.core.patch_namespaced_pod("victim", e2e_namespace, {"metadata": {"finalizers": None}},
                                              _preload_content=False)
    _gone(dev_cluster, e2e_namespace, "victim")
    assert _running_on(dev_cluster, e2e_namespace, "urgent") == nodes.names[0]
    bystander = read_pod(dev_cluster, e2e_namespace, "bystander")
    assert bystander is not None and not bystander["metadata"].get("deletionTimestamp")
    assert_no_overcommit(dev_cluster)


def test_a_gang_victim_is_evicted_whole(
    dev_cluster: DevCluster, e2e_namespace: str, gpu_nodes: Callable[..., NodeSet],
    priorities: Callable[[int], str],
) -> None:
    from kube_vgpu import protocol

    nodes = gpu_nodes(2, gpus=1)
    low, high = priorities(0), priorities(1000)
    for index in range(2):
        body = gpu_pod(f"member-{index}", memory_mib=81920, labels={protocol.LABEL_KUEUE_POD_GROUP_NAME: "train"},
                       annotations={protocol.ANNOTATION_KUEUE_POD_GROUP_TOTAL_COUNT: "2"},
                       node_selector=nodes.selector)
        body["spec"]["priorityClassName"] = low
        dev_cluster.core.create_namespaced_pod(e2e_namespace, body, _preload_content=False)
    placed = {_running_on(dev_cluster, e2e_namespace, f"member-{index}") for index in range(2)}
    assert placed == set(nodes.names)
    _create(dev_cluster, e2e_namespace, "urgent", 81920, nodes, high)
    _running_on(dev_cluster, e2e_namespace, "urgent")
    for index in range(2):  # one member was in the way; both went
        _gone(dev_cluster, e2e_namespace, f"member-{index}")
    assert_no_overcommit(dev_cluster)
