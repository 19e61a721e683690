"""GPU scheduling through the real API: kube-apiserver admits (our webhook routes), kube-scheduler calls our
extender, the extender annotates and binds. Everything is checked on what the API server holds."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable

import pytest

from kube_vgpu import protocol
from kube_vgpu.dev.devcluster.cluster import DevCluster
from kube_vgpu.dev.devcluster.workload import (
    Outcome,
    assignment_of,
    create_pods,
    gpu_pod,
    list_all,
    pod_outcome,
    wait_for_pods,
)
from kube_vgpu.dev.synth import synth_uuid
from tests.e2e.checks import assert_assignments_match, assert_no_overcommit, links_between, settle
from tests.e2e.conftest import NodeSet

pytestmark = pytest.mark.e2e

WAIT_S = 120.0


def _failure_context(cluster: DevCluster) -> str:
    return f"\n--- extender log ---\n{cluster.log_tail('extender')}\n--- kube-scheduler log ---\n" + cluster.log_tail(
        "kube-scheduler"
    )


def test_webhook_routes_gpu_pods_and_every_bound_pod_is_annotated(
    dev_cluster: DevCluster, e2e_namespace: str, gpu_nodes: Callable[..., NodeSet]
) -> None:
    nodes = gpu_nodes(2, gpus=4)
    pods = [
        gpu_pod("whole", node_selector=nodes.selector),
        gpu_pod("fraction-mib", memory_mib=4096, cores=10, node_selector=nodes.selector),
        gpu_pod("fraction-percent", memory_percent=25, cores=20, node_selector=nodes.selector),
        gpu_pod("two-vgpus", gpus=2, memory_mib=8192, node_selector=nodes.selector),
        gpu_pod("two-containers", gpus=1, memory_mib=2048, containers=2, node_selector=nodes.selector),
    ]
    create_pods(dev_cluster.api, e2e_namespace, pods)
    names = [pod["metadata"]["name"] for pod in pods]
    outcome = wait_for_pods(dev_cluster.api, e2e_namespace, names, timeout_s=WAIT_S)
    assert sorted(outcome.bound) == sorted(names), outcome.describe() + _failure_context(dev_cluster)
    for name in names:
        # users never name the scheduler: the webhook routed every GPU pod to ours
        assert outcome.pods[name]["spec"]["schedulerName"] == protocol.DEFAULT_SCHEDULER_NAME
        assert set(outcome.bound[name] for name in names) <= set(nodes.names)
    assert_assignments_match(outcome)
    assert_no_overcommit(dev_cluster)


def test_fractional_pods_share_gpus_without_overcommit(
    dev_cluster: DevCluster, e2e_namespace: str, gpu_nodes: Callable[..., NodeSet]
) -> None:
    # 2 GPUs of 80 GiB; 20 GiB and 20% compute per pod: 4 fit per GPU by memory, so exactly 8 of 10 fit
    nodes = gpu_nodes(1, gpus=2, memory_mib=81920)
    pods = [gpu_pod(f"frac-{i}", memory_mib=20480, cores=20, node_selector=nodes.selector) for i in range(10)]
    create_pods(dev_cluster.api, e2e_namespace, pods)
    outcome = settle(dev_cluster, e2e_namespace, [p["metadata"]["name"] for p in pods], timeout_s=WAIT_S)
    assert len(outcome.bound) == 8, outcome.describe() + _failure_context(dev_cluster)
    assert len(outcome.refused) == 2, outcome.describe()
    usage = assert_no_overcommit(dev_cluster)
    mine = [use for use in usage.values() if use.node in nodes.names]
    assert sorted(use.shares for use in mine) == [4, 4], [(u.uuid, u.pods) for u in mine]
    assert all(use.used_memory_mib == 81920 for use in mine)
    assert_assignments_match(outcome)
    for message in outcome.refused.values():
        assert "20480 MiB" in message, message  # our extender's reason, as kube-scheduler recorded it


def _assert_nvlink_connected(cluster: DevCluster, outcome: Outcome, pod_name: str, count: int) -> None:
    node = next(n for n in list_all(cluster.api, "nodes") if n["metadata"]["name"] == outcome.bound[pod_name])
    links = links_between(node)
    assignment = assignment_of(outcome.pods[pod_name])
    assert assignment is not None
    uuids = [device.uuid for device in assignment.all_devices()]
    assert len(uuids) == count
    for a, b in itertools.combinations(uuids, 2):
        link = links.get((a, b))
        assert link is not None and (link.nvlinks > 0 or link.via_nvswitch), (
            f"{pod_name}: {a} and {b} are not NVLink-connected ({link})"
        )


def test_multi_gpu_pods_get_nvlink_connected_gpus(
    dev_cluster: DevCluster, e2e_namespace: str, gpu_nodes: Callable[..., NodeSet]
) -> None:
    switch = gpu_nodes(1, gpus=8, topology="nvswitch")
    pairs = gpu_nodes(1, gpus=8, topology="nvlink-pairs")
    # GPU 1 of the pairs node is taken first, so the lowest free indexes (0, 2) are NOT a bridged pair: only a
    # topology-aware choice gets 2 GPUs that talk over NVLink there.
    blocker = gpu_pod("blocker", cores=100, node_selector=pairs.selector,
                      annotations={protocol.ANNOTATION_USE_GPU_UUID: synth_uuid(pairs.names[0], 1)})
    create_pods(dev_cluster.api, e2e_namespace, [blocker])
    assert "blocker" in wait_for_pods(dev_cluster.api, e2e_namespace, ["blocker"], timeout_s=WAIT_S).bound
    pods = [
        gpu_pod("four-on-nvswitch", gpus=4, cores=100, node_selector=switch.selector),
        gpu_pod("two-on-pairs", gpus=2, cores=100, node_selector=pairs.selector),
    ]
    create_pods(dev_cluster.api, e2e_namespace, pods)
    outcome = wait_for_pods(dev_cluster.api, e2e_namespace, ["four-on-nvswitch", "two-on-pairs"], timeout_s=WAIT_S)
    assert len(outcome.bound) == 2, outcome.describe() + _failure_context(dev_cluster)
    _assert_nvlink_connected(dev_cluster, outcome, "four-on-nvswitch", 4)
    _assert_nvlink_connected(dev_cluster, outcome, "two-on-pairs", 2)


def test_four_gpu_pod_chooses_the_nvswitch_node_over_a_pcie_node(
    dev_cluster: DevCluster, e2e_namespace: str, gpu_nodes: Callable[..., NodeSet]
) -> None:
    fast = gpu_nodes(1, gpus=8, topology="nvswitch")
    slow = gpu_nodes(1, gpus=8, topology="pcie")
    key = next(iter(fast.selector))
    pods = []
    for i in range(2):  # two pods: the second must not fall back to PCIe while NVSwitch GPUs are free
        pod = gpu_pod(f"train-{i}", gpus=4, cores=100)  # default policies: no hint from the pod
        pod["spec"]["affinity"] = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{"matchExpressions": [
                {"key": key, "operator": "In", "values": [fast.label_value, slow.label_value]}]}]}}}
        pods.append(pod)
    for pod in pods:  # one after the other: the second sees the first's GPUs taken
        create_pods(dev_cluster.api, e2e_namespace, [pod])
        name = pod["metadata"]["name"]
        outcome = wait_for_pods(dev_cluster.api, e2e_namespace, [name], timeout_s=WAIT_S)
        assert outcome.bound.get(name) == fast.names[0], (
            f"{name} landed on {outcome.bound.get(name)}, not on the NVSwitch node {fast.names[0]}"
        )
        _assert_nvlink_connected(dev_cluster, outcome, name, 4)


def test_pod_larger_than_any_node_stays_pending_with_our_reason(
    dev_cluster: DevCluster, e2e_namespace: str
) -> None:
    # no GPU anywhere has 1 TiB; the extender's filter refuses every node and says why
    create_pods(dev_cluster.api, e2e_namespace, [gpu_pod("huge", memory_mib=1_048_576)])
    outcome = wait_for_pods(dev_cluster.api, e2e_namespace, ["huge"], timeout_s=WAIT_S, expect_refused=["huge"])
    assert "huge" not in outcome.bound, "a pod asking 1 TiB of GPU memory was bound"
    message = outcome.refused.get("huge", "")
    assert "needs 1048576 MiB per GPU" in message, f"FailedScheduling message: {message!r}"
    # still Pending and unannotated
    again = pod_outcome(dev_cluster.api, e2e_namespace, ["huge"])
    assert "huge" not in again.bound
    assert assignment_of(again.pods["huge"]) is None


def test_deleting_pods_frees_gpus_for_the_next_pods(
    dev_cluster: DevCluster, e2e_namespace: str, gpu_nodes: Callable[..., NodeSet]
) -> None:
    nodes = gpu_nodes(1, gpus=2)
    first = [gpu_pod(f"first-{i}", cores=100, node_selector=nodes.selector) for i in range(2)]
    create_pods(dev_cluster.api, e2e_namespace, first)
    outcome = wait_for_pods(dev_cluster.api, e2e_namespace, ["first-0", "first-1"], timeout_s=WAIT_S)
    assert len(outcome.bound) == 2, outcome.describe() + _failure_context(dev_cluster)
    held = {device.uuid for name in outcome.bound for device in assignment_of(outcome.pods[name]).all_devices()}  # type: ignore[union-attr]

    create_pods(dev_cluster.api, e2e_namespace, [gpu_pod("next", cores=100, node_selector=nodes.selector)])
    waiting = wait_for_pods(dev_cluster.api, e2e_namespace, ["next"], timeout_s=WAIT_S, expect_refused=["next"])
    assert "next" in waiting.refused, f"both GPUs are held exclusively, yet: {waiting.describe()}"

    dev_cluster.core.delete_namespaced_pod("first-0", e2e_namespace, grace_period_seconds=0, _preload_content=False)
    freed = {device.uuid for device in assignment_of(outcome.pods["first-0"]).all_devices()}  # type: ignore[union-attr]
    after = wait_for_pods(dev_cluster.api, e2e_namespace, ["next"], timeout_s=WAIT_S)
    assert "next" in after.bound, after.describe() + _failure_context(dev_cluster)
    got = {device.uuid for device in assignment_of(after.pods["next"]).all_devices()}  # type: ignore[union-attr]
    assert got == freed and got <= held
    assert_no_overcommit(dev_cluster)


def test_extender_crash_in_the_middle_of_a_burst_loses_and_overcommits_nothing(
    dev_cluster: DevCluster, e2e_namespace: str, gpu_nodes: Callable[..., NodeSet]
) -> None:
    # 3 nodes x 8 GPUs x 10 vGPU slots = 240 slots, 8 GiB of 80 GiB and 10% compute each: 200 pods fit, with
    # every GPU shared by ~8 pods, so any double booking shows up in the per-GPU sums.
    nodes = gpu_nodes(3, gpus=8, memory_mib=81920)
    count = 200
    pods = [gpu_pod(f"burst-{i:03d}", memory_mib=8192, cores=10, node_selector=nodes.selector) for i in range(count)]
    names = [pod["metadata"]["name"] for pod in pods]
    creator = threading.Thread(target=create_pods, args=(dev_cluster.api_client(), e2e_namespace, pods, 8))
    creator.start()
    bound_at_crash: list[int] = []
    try:
        # crash it (SIGKILL: no graceful shutdown) twice while pods are still arriving and binds are in flight
        for threshold in (40, 120):
            partial = wait_for_pods(dev_cluster.api, e2e_namespace, names[:threshold], timeout_s=WAIT_S,
                                    interval_s=0.05)
            assert len(partial.bound) == threshold, partial.describe() + _failure_context(dev_cluster)
            bound_at_crash.append(len(pod_outcome(dev_cluster.api, e2e_namespace, names).bound))
            dev_cluster.restart_extender(crash=True)
    finally:
        creator.join()
    print(f"extender crashed and restarted with {bound_at_crash} of {count} pods bound")
    assert bound_at_crash[0] < count, "the burst was over before the crash; the test proved nothing"
    outcome = wait_for_pods(dev_cluster.api, e2e_namespace, names, timeout_s=3 * WAIT_S)
    assert len(outcome.bound) == count, outcome.describe() + _failure_context(dev_cluster)
    assert_assignments_match(outcome)
    usage = assert_no_overcommit(dev_cluster)
    mine = [use for use in usage.values() if use.node in nodes.names]
    assert sum(use.shares for use in mine) == count
    assert all(use.used_memory_mib <= use.memory_mib for use in mine)


def test_a_native_sidecars_gpu_share_counts_beside_the_app_container(
    dev_cluster: DevCluster, e2e_namespace: str, gpu_nodes: Callable[..., NodeSet]
) -> None:
    """Issue 12 through the real control plane: a 40960 MiB native sidecar (init container with restartPolicy
    Always) and a 40960 MiB app container fill an 81920 MiB GPU, so a third 40960 MiB pod is refused there rather
    than over-committing the GPU to 122880 MiB."""
    nodes = gpu_nodes(1, gpus=1, memory_mib=81920)
    with_sidecar = gpu_pod("with-sidecar", memory_mib=40960, node_selector=nodes.selector)
    app = with_sidecar["spec"]["containers"][0]
    with_sidecar["spec"]["initContainers"] = [{**app, "name": "sidecar", "restartPolicy": "Always"}]
    create_pods(dev_cluster.api, e2e_namespace, [with_sidecar])
    outcome = wait_for_pods(dev_cluster.api, e2e_namespace, ["with-sidecar"], timeout_s=WAIT_S)
    assert "with-sidecar" in outcome.bound, outcome.describe() + _failure_context(dev_cluster)
    assignment = assignment_of(outcome.pods["with-sidecar"])
    assert assignment is not None
    assert [(c.name, c.init, c.sidecar) for c in assignment.containers] == [
        ("main", False, False),
        ("sidecar", True, True),
    ]

    create_pods(dev_cluster.api, e2e_namespace, [gpu_pod("neighbour", memory_mib=40960, node_selector=nodes.selector)])
    waiting = wait_for_pods(
        dev_cluster.api, e2e_namespace, ["neighbour"], timeout_s=WAIT_S, expect_refused=["neighbour"]
    )
    assert "neighbour" not in waiting.bound, waiting.describe() + _failure_context(dev_cluster)
    assert "no GPU with 40960 MiB free (largest free 0 MiB)" in waiting.refused.get("neighbour", ""), waiting.describe()
    usage = assert_no_overcommit(dev_cluster)
    assert [use.used_memory_mib for use in usage.values() if use.node in nodes.names] == [81920]
