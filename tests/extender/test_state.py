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
            (g.uuid, g.used_memory_mib, g.used_cores, g.used_vgpus, g.exclusive_holders)
            for g in state.nodes[name].gpus
        ]
        after = [
            (g.uuid, g.used_memory_mib, g.used_cores, g.used_vgpus, g.exclusive_holders)
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


# --- issue 20 item 3: a bad object costs only itself ----------------------------------------------------------


def _bad_link_node(name: str) -> dict:
    """The reported probe: one malformed link entry (a non-integer peer) in one node's inventory."""
    import orjson

    node = gpu_node(name)
    doc = orjson.loads(node["metadata"]["annotations"][protocol.NODE_INVENTORY_ANNOTATION])
    doc["gpus"][0]["links"][0][0] = "x"
    node["metadata"]["annotations"][protocol.NODE_INVENTORY_ANNOTATION] = orjson.dumps(doc).decode()
    return node


def test_a_malformed_inventory_costs_only_its_node() -> None:
    state = ClusterState()
    cluster = SnapshotCluster(state, [gpu_node("good-1"), _bad_link_node("bad"), gpu_node("good-2")])
    assert state.synced.is_set() and state.unready_reason() is None
    assert [len(state.nodes[n].gpus) for n in ("good-1", "bad", "good-2")] == [4, 0, 4]
    view = {node["name"]: node for node in state.snapshot()["nodes"]}
    assert "field 'peer' must be an integer" in view["bad"]["inventoryError"]
    assert view["good-1"]["inventoryError"] is None
    outcome = Scheduler(state, cluster).filter(pod(memory_mib=100), ["good-1", "bad", "good-2"])
    assert outcome.passed == ["good-1", "good-2"]
    assert "invalid GPU inventory (inventory gpus[0] links[0]: field 'peer'" in outcome.unresolvable["bad"]
    # the device plugin publishes a readable inventory: the node is usable again and the reason is gone
    state.upsert_node(gpu_node("bad"))
    assert len(state.nodes["bad"].gpus) == 4 and "bad" not in state.inventory_errors


def test_a_node_object_that_raises_anywhere_is_made_unusable_and_the_others_sync() -> None:
    state = ClusterState()
    state.upsert_node(gpu_node("n1"))
    stored = bound_pod(*_cluster_and_scheduler(state), "n1", memory_mib=3000)
    broken = gpu_node("n1")
    broken["status"] = "not an object"  # raises far from the inventory codec (reading allocatable CPU)
    state.replace_all([broken, gpu_node("n2")], [stored])
    assert state.nodes["n1"].gpus == [] and len(state.nodes["n2"].gpus) == 4
    assert "node object could not be applied" in state.inventory_errors["n1"]
    assert state.ingest_errors == {"nodes": 1}
    # the pod's GPUs are counted again as soon as the node reads cleanly
    state.upsert_node(gpu_node("n1"))
    assert used_memory(state, "n1") == 3000 and "n1" not in state.inventory_errors


def test_a_pod_that_cannot_be_applied_is_skipped_and_the_others_are_counted() -> None:
    state = ClusterState()
    cluster, scheduler = _cluster_and_scheduler(state, nodes=[gpu_node("n1")])
    good = copy.deepcopy(bound_pod(cluster, scheduler, "n1", memory_mib=2000))
    bad = copy.deepcopy(bound_pod(cluster, scheduler, "n1", memory_mib=1000))
    bad["metadata"]["labels"] = ["not", "a", "map"]
    fresh = ClusterState()
    fresh.upsert_node(gpu_node("n1"))
    fresh.replace_pods([bad, good])
    assert used_memory(fresh, "n1") == 2000
    assert fresh.ingest_errors == {"pods": 1}


def test_readiness_names_the_first_failing_check_once_synced() -> None:
    state = ClusterState()
    problems: list[str | None] = [None]
    state.readiness_checks.append(lambda: problems[0])
    assert state.unready_reason() == "initial sync with the API server not finished"
    state.mark_synced()
    assert state.unready_reason() is None
    problems[0] = "the nodes watch has delivered nothing for 95 s"
    assert state.unready_reason() == "the nodes watch has delivered nothing for 95 s"


def _cluster_and_scheduler(state: ClusterState, nodes: list | None = None) -> tuple[SnapshotCluster, Scheduler]:
    cluster = SnapshotCluster(state, nodes if nodes is not None else [copy.deepcopy(gpu_node("n1"))])
    return cluster, Scheduler(state, cluster)
