"""Gangs through the real control plane (issue 13): Kueue plain-pod groups routed by our webhook, filtered and bound
by kube-scheduler with our extender; everything checked on what the API server holds."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import pytest

from kube_vgpu import protocol
from kube_vgpu.dev.devcluster.cluster import DevCluster
from kube_vgpu.dev.devcluster.workload import create_pods, gpu_pod, wait_for_pods
from tests.e2e.checks import assert_no_overcommit, settle
from tests.e2e.conftest import NodeSet

pytestmark = pytest.mark.e2e

WAIT_S = 120.0
WHOLE_MIB = 81920


def gang(name: str, size: int, nodes: NodeSet) -> list[dict[str, Any]]:
    pods = []
    for index in range(size):
        p = gpu_pod(f"{name}-{index}", memory_mib=WHOLE_MIB, node_selector=nodes.selector,
                    labels={protocol.LABEL_KUEUE_POD_GROUP_NAME: name},
                    annotations={protocol.ANNOTATION_KUEUE_POD_GROUP_TOTAL_COUNT: str(size)})
        pods.append(p)
    return pods


def names(pods: list[dict[str, Any]]) -> list[str]:
    return [p["metadata"]["name"] for p in pods]


def test_a_gang_binds_no_member_until_all_fit_then_all(
    dev_cluster: DevCluster, e2e_namespace: str, gpu_nodes: Callable[..., NodeSet]
) -> None:
    nodes = gpu_nodes(4, gpus=1)
    blocker = gpu_pod("blocker", memory_mib=WHOLE_MIB, node_selector=nodes.selector)
    create_pods(dev_cluster.api, e2e_namespace, [blocker])
    assert wait_for_pods(dev_cluster.api, e2e_namespace, ["blocker"], timeout_s=WAIT_S).bound
    train = gang("train", 4, nodes)  # 4 whole GPUs wanted, 3 free
    create_pods(dev_cluster.api, e2e_namespace, train)
    outcome = settle(dev_cluster, e2e_namespace, names(train), timeout_s=WAIT_S)
    assert outcome.bound == {}, outcome.describe()  # none: nothing half-placed
    # each member's latest event: waiting for the others to exist, or (once all did) that only 3 fit
    assert all(f"gang {e2e_namespace}/train: " in outcome.refused[n] for n in names(train)), outcome.describe()
    assert any("3 of 4 members fit" in outcome.refused[n] for n in names(train)), outcome.describe()
    # /state says the same
    [view] = [g for g in httpx.get(f"{dev_cluster.extender_url}/state", timeout=30).json()["gangs"]
              if g["name"] == f"{e2e_namespace}/train"]
    assert (view["size"], view["membersSeen"], view["bound"], view["planned"]) == (4, 4, 0, {})
    assert "3 of 4 members fit" in view["waiting"]
    # which member waits, what it asks, and how many nodes refuse it (the count depends on the other tests' nodes)
    assert "waiting for a node for member train-3 (1 x 81920 MiB, gpucores 0): none of " in view["waiting"]
    # /quota too: its pods name no queue, so the gang is listed apart from the ClusterQueues
    quota = httpx.get(f"{dev_cluster.extender_url}/quota", timeout=30).json()
    [listed] = [g for g in quota["unqueuedGangs"] if g["name"] == f"{e2e_namespace}/train"]
    assert (listed["size"], listed["membersSeen"], listed["bound"], listed["planned"]) == (4, 4, 0, 0)
    assert "3 of 4 members fit" in listed["waiting"]
    dev_cluster.core.delete_namespaced_pod("blocker", e2e_namespace, grace_period_seconds=0)  # a 4th GPU frees
    outcome = wait_for_pods(dev_cluster.api, e2e_namespace, names(train), timeout_s=WAIT_S)
    assert sorted(outcome.bound.values()) == sorted(nodes.names), outcome.describe()
    assert_no_overcommit(dev_cluster)


def test_two_gangs_racing_for_six_gpus_end_one_whole_and_one_waiting(
    dev_cluster: DevCluster, e2e_namespace: str, gpu_nodes: Callable[..., NodeSet]
) -> None:
    nodes = gpu_nodes(6, gpus=1)
    a, b = gang("a", 4, nodes), gang("b", 4, nodes)
    create_pods(dev_cluster.api, e2e_namespace, [p for pair in zip(a, b, strict=True) for p in pair])
    everyone = names(a) + names(b)
    outcome = settle(dev_cluster, e2e_namespace, everyone, timeout_s=WAIT_S)
    bound_a = [n for n in names(a) if n in outcome.bound]
    bound_b = [n for n in names(b) if n in outcome.bound]
    assert sorted([len(bound_a), len(bound_b)]) == [0, 4], outcome.describe()
    assert_no_overcommit(dev_cluster)


def test_the_extender_killed_among_a_gangs_binds_leaves_no_half_gang_and_no_overcommit(
    dev_cluster: DevCluster, e2e_namespace: str, gpu_nodes: Callable[..., NodeSet]
) -> None:
    nodes = gpu_nodes(4, gpus=1)
    train = gang("crash", 4, nodes)
    create_pods(dev_cluster.api, e2e_namespace, train)
    # kill it as soon as the first member is bound (or later: whenever the poll notices)
    wait_for_pods(dev_cluster.api, e2e_namespace, names(train)[:1], timeout_s=WAIT_S)
    dev_cluster.restart_extender(crash=True)
    outcome = wait_for_pods(dev_cluster.api, e2e_namespace, names(train), timeout_s=WAIT_S)
    assert sorted(outcome.bound.values()) == sorted(nodes.names), outcome.describe()  # the rest planned again, bound
    assert_no_overcommit(dev_cluster)
