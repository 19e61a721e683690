"""The cluster state: incremental updates, restarts, in-flight reservations, stale inventory."""

from __future__ import annotations

import copy
import datetime as dt

from kube_vgpu import protocol
from kube_vgpu.extender.scheduler import Scheduler
from kube_vgpu.extender.sources.snapshot import SnapshotCluster
from kube_vgpu.extender.state import ClusterState
from tests.helpers import gpu_node, pod


def bound_pod(cluster: SnapshotCluster, scheduler: Scheduler, node: str, **kwargs: int) -> dict:
    p = pod(**kwargs)  # type: ignore[arg-type]
    cluster.add_pod(p)
    meta = p["metadata"]
    scheduler.bind(meta["namespace"], meta["name"], meta["uid"], node)
    return cluster.pods[(meta["namespace"], meta["name"])]


def used_memory(state: ClusterState, node: str) -> int:
    return sum(g.used_memory_mib for g in state.nodes[node].gpus)


def test_restart_rebuilds_identical_usage_from_annotations() -> None:
    state = ClusterState()
    cluster = SnapshotCluster(state, [gpu_node("n1"), gpu_node("n2")])
    scheduler = Scheduler(state, cluster)
    for _ in range(5):
        bound_pod(cluster, scheduler, "n1", memory_mib=7000, cores=10)
    bound_pod(cluster, scheduler, "n2", gpus=2, cores=100)
    objects = [copy.deepcopy(o) for o in [*cluster.nodes.values(), *cluster.pods.values()]]
    restarted = ClusterState()
    SnapshotCluster(restarted, objects)
    for name in ("n1", "n2"):
        before = [
            (g.uuid, g.used_memory_mib, g.used_cores, g.used_shares, g.exclusive_holders)
            for g in state.nodes[name].gpus
        ]
        after = [
            (g.uuid, g.used_memory_mib, g.used_cores, g.used_shares, g.exclusive_holders)
            for g in restarted.nodes[name].gpus
        ]
        assert before == after


def test_pods_listed_before_their_node_are_counted_when_it_arrives() -> None:
    state = ClusterState()
    cluster = SnapshotCluster(state, [gpu_node("n1")])
    scheduler = Scheduler(state, cluster)
    stored = bound_pod(cluster, scheduler, "n1", memory_mib=5000)
    fresh = ClusterState()
    fresh.upsert_pod(copy.deepcopy(stored))
    assert "n1" not in fresh.nodes
    fresh.upsert_node(cluster.nodes["n1"])
    assert used_memory(fresh, "n1") == 5000


def test_finished_and_deleted_pods_release() -> None:
    state = ClusterState()
    cluster = SnapshotCluster(state, [gpu_node("n1")])
    scheduler = Scheduler(state, cluster)
    done = bound_pod(cluster, scheduler, "n1", memory_mib=1000)
    gone = bound_pod(cluster, scheduler, "n1", memory_mib=2000)
    assert used_memory(state, "n1") == 3000
    finished = copy.deepcopy(done)
    finished["status"]["phase"] = "Succeeded"
    state.upsert_pod(finished)
    assert used_memory(state, "n1") == 2000
    state.delete_pod(gone["metadata"]["uid"])
    assert used_memory(state, "n1") == 0 and not state.pods


def test_inflight_reservation_survives_events_without_annotation() -> None:
    state = ClusterState()
    state.upsert_node(gpu_node("n1"))
    p = pod(memory_mib=4000)
    assignment = protocol.PodAssignment(
        "n1", (protocol.ContainerAssignment("main", (protocol.DeviceShare(state.nodes["n1"].gpus[0].uuid, 4000, 0),)),)
    )
    state.reserve(p["metadata"]["uid"], "default", p["metadata"]["name"], assignment)
    state.upsert_pod(p)  # a watch event from before the annotation was written
    assert used_memory(state, "n1") == 4000
    state.replace_pods([p])  # a relist racing the bind keeps it too
    assert used_memory(state, "n1") == 4000


def test_inventory_change_reapplies_usage_by_uuid_and_health() -> None:
    state = ClusterState()
    cluster = SnapshotCluster(state, [gpu_node("n1", gpus=4)])
    scheduler = Scheduler(state, cluster)
    bound_pod(cluster, scheduler, "n1", memory_mib=3000)
    node = copy.deepcopy(cluster.nodes["n1"])
    inventory = protocol.decode_inventory(node["metadata"]["annotations"][protocol.NODE_INVENTORY_ANNOTATION])
    sick = protocol.NodeInventory(
        tuple(
            protocol.GpuInfo(**{**{f: getattr(g, f) for f in g.__slots__}, "healthy": g.index != 0})  # type: ignore[arg-type]
            for g in inventory.gpus
        )
    )
    node["metadata"]["annotations"][protocol.NODE_INVENTORY_ANNOTATION] = protocol.encode_inventory(sick)
    state.upsert_node(node)
    assert used_memory(state, "n1") == 3000
    assert not state.nodes["n1"].gpus[0].healthy


def test_stale_heartbeat_makes_node_unschedulable_with_reason() -> None:
    now = dt.datetime(2026, 11, 21, 12, 0, 0, tzinfo=dt.UTC)
    state = ClusterState(heartbeat_ttl_s=60, clock=lambda: now.timestamp())
    cluster = SnapshotCluster(
        state,
        [
            gpu_node("fresh", heartbeat=now - dt.timedelta(seconds=10)),
            gpu_node("stale", heartbeat=now - dt.timedelta(seconds=95)),
        ],
    )
    outcome = Scheduler(state, cluster).filter(pod(memory_mib=100), ["fresh", "stale"])
    assert outcome.passed == ["fresh"]
    assert outcome.failed == {"stale": "GPU inventory stale (last heartbeat 95 s ago)"}


def test_invalid_inventory_reported_not_guessed() -> None:
    state = ClusterState()
    node = gpu_node("bad")
    node["metadata"]["annotations"][protocol.NODE_INVENTORY_ANNOTATION] = '{"v": 1, "gpus": [{"uuid": 1}]}'
    state.upsert_node(node)
    outcome = Scheduler(state, SnapshotCluster(ClusterState(), [])).filter(pod(), ["bad"])
    assert outcome.passed == []
    state2 = ClusterState()
    cluster = SnapshotCluster(state2, [node])
    outcome = Scheduler(state2, cluster).filter(pod(), ["bad"])
    assert "invalid GPU inventory" in outcome.unresolvable["bad"]


def test_learning_policies_observe_each_pod_once_in_arrival_order() -> None:
    from kube_vgpu.extender.engine.policies import REGISTRY
    from kube_vgpu.extender.engine.policies.binpack import Binpack

    seen: list[int] = []

    class Recording(Binpack):
        name = "test-recording"

        def observe(self, request: object) -> None:
            seen.append(request.gpu.containers[0].memory_mib)  # type: ignore[attr-defined]

    state = ClusterState()
    cluster = SnapshotCluster(state, [gpu_node("n1")])
    scheduler = Scheduler(state, cluster, node_policy="test-recording",
                          policies={**REGISTRY, Recording.name: Recording})
    first, second = pod(memory_mib=100), pod(memory_mib=200)
    for p in (first, first, second, first):  # kube-scheduler retries re-filter the same pod
        scheduler.filter(p, ["n1"])
    assert seen == [100, 200]


def test_filter_and_bind_refuse_until_the_first_sync() -> None:
    state = ClusterState()
    state.upsert_node(gpu_node("n1"))  # nodes are in, but the pod list is not: GPUs may look free that are not
    scheduler = Scheduler(state, SnapshotCluster(ClusterState(), []))
    p = pod(memory_mib=100)
    outcome = scheduler.filter(p, ["n1"])
    assert outcome.passed == [] and "initial sync" in outcome.error
    import pytest

    from kube_vgpu.extender.scheduler import BindError

    with pytest.raises(BindError, match="initial sync"):
        scheduler.bind("default", p["metadata"]["name"], p["metadata"]["uid"], "n1")
    state.mark_synced()
    assert scheduler.filter(p, ["n1"]).passed == ["n1"]


def test_default_policies_put_a_multi_gpu_pod_on_the_best_connected_node() -> None:
    state = ClusterState()
    cluster = SnapshotCluster(state, [gpu_node("pcie", gpus=8, topology="pcie"),
                                      gpu_node("nvswitch", gpus=8, topology="nvswitch")])
    scores = dict(Scheduler(state, cluster).prioritize(pod(gpus=4, cores=100), ["pcie", "nvswitch"]))
    assert scores["nvswitch"] > scores["pcie"]
