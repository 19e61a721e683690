"""Assertions over what the API server holds (the ground truth), shared by the e2e tests."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import orjson
import pytest
from kubernetes.client.rest import ApiException

from kube_vgpu import protocol
from kube_vgpu.dev.devcluster.cluster import DevCluster
from kube_vgpu.dev.devcluster.workload import GpuUse, Outcome, assignment_of, gpu_usage, list_all, pod_outcome


def assert_no_overcommit(cluster: DevCluster) -> dict[str, GpuUse]:
    """Sum every bound pod's assignment annotation per GPU over the whole cluster; no GPU may be over its memory,
    its compute or its vGPU slots, and no pod may hold one GPU twice in one container."""
    nodes = list_all(cluster.api, "nodes")
    pods = list_all(cluster.api, "pods")
    usage = gpu_usage(nodes, pods)
    over = [use for use in usage.values() if use.overcommitted]
    assert not over, "over-committed GPUs:\n" + "\n".join(
        f"{u.node} {u.uuid}: {u.used_memory_mib}/{u.memory_mib} MiB, {u.used_cores}/{u.cores} cores, "
        f"{u.vgpus}/{u.max_vgpus} vGPUs, pods {u.pods}"
        for u in over
    )
    for pod in pods:
        assignment = assignment_of(pod)
        if assignment is None:
            continue
        for container in assignment.containers:
            uuids = [device.uuid for device in container.devices]
            assert len(uuids) == len(set(uuids)), f"{pod['metadata']['name']} holds a GPU twice: {uuids}"
    return usage


def assert_assignments_match(outcome: Outcome) -> None:
    """Every bound pod carries an assignment annotation for the node it is bound to, one device per vGPU asked."""
    for name, node in outcome.bound.items():
        pod = outcome.pods[name]
        assignment = assignment_of(pod)
        assert assignment is not None, f"bound pod {name} (on {node}) has no {protocol.POD_ASSIGNMENT_ANNOTATION}"
        assert assignment.node == node, f"{name}: assignment names {assignment.node}, bound to {node}"
        asked = {
            container["name"]: int((container.get("resources") or {}).get("limits", {}).get(protocol.RESOURCE_GPU, 0))
            for container in pod["spec"]["containers"]
        }
        got = {container.name: len(container.devices) for container in assignment.containers if not container.init}
        assert got == {k: v for k, v in asked.items() if v}, f"{name}: asked {asked} vGPUs, assigned {got}"


def settle(
    cluster: DevCluster, namespace: str, names: Iterable[str], *, timeout_s: float, quiet_s: float = 2.0
) -> Outcome:
    """Wait until every pod is bound or has a FailedScheduling event, and nothing changed for `quiet_s`."""
    wanted = list(names)
    deadline = time.monotonic() + timeout_s
    last: tuple[int, int] | None = None
    stable_since = time.monotonic()
    while True:
        outcome = pod_outcome(cluster.api, namespace, wanted)
        key = (len(outcome.bound), len(outcome.refused))
        if key != last:
            last, stable_since = key, time.monotonic()
        settled = not outcome.pending and time.monotonic() - stable_since >= quiet_s
        if settled or time.monotonic() >= deadline:
            return outcome
        time.sleep(0.2)


def links_between(node: Mapping[str, Any]) -> dict[tuple[str, str], protocol.GpuLink]:
    """(uuid, uuid) -> link, from a Node's inventory annotation."""
    text = node["metadata"]["annotations"][protocol.NODE_INVENTORY_ANNOTATION]
    inventory = protocol.decode_inventory(text)
    by_index = {gpu.index: gpu.uuid for gpu in inventory.gpus}
    return {
        (gpu.uuid, by_index[link.peer_index]): link
        for gpu in inventory.gpus
        for link in gpu.links
        if link.peer_index in by_index
    }


def read_pod(cluster: DevCluster, namespace: str, name: str) -> dict[str, Any] | None:
    """The pod as the API server holds it now; None when it does not exist."""
    try:
        response = cluster.core.read_namespaced_pod(name, namespace, _preload_content=False)
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise
    pod: dict[str, Any] = orjson.loads(response.data)
    return pod


def wait_until(what: str, check: Callable[[], Any], describe: Callable[[], str], timeout_s: float = 90.0) -> Any:
    """Poll `check` until it returns something true (returned), or fail the test saying what did not happen."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() >= deadline:
            pytest.fail(f"{what} not within {timeout_s:g} s: {describe()}", pytrace=False)
        time.sleep(0.2)
