"""Issue 20, item 1: a late or duplicate bind of a pod already bound elsewhere is refused and changes nothing (it
used to drop the pod's confirmed record, so the GPU showed its memory as free and the next pod over-committed it).
"""

from __future__ import annotations

import threading
from typing import Any

import pytest

from kube_vgpu.extender.scheduler import BindError, Scheduler
from kube_vgpu.extender.sources.snapshot import SnapshotCluster
from kube_vgpu.extender.state import ClusterState
from tests.helpers import gpu_node, pod


class SilentCluster(SnapshotCluster):
    """The snapshot API whose Binding does not feed the state at once: the extender learns the bound pod only when
    the test delivers the watch event, as in live mode."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.events: list[dict[str, Any]] = []

    def bind(self, namespace: str, name: str, uid: str, node: str, annotations: dict[str, str]) -> None:
        real_upsert = self.state.upsert_pod
        self.state.upsert_pod = self.events.append  # type: ignore[method-assign]
        try:
            super().bind(namespace, name, uid, node, annotations)
        finally:
            self.state.upsert_pod = real_upsert  # type: ignore[method-assign]

    def deliver(self) -> None:
        for event in self.events:
            self.state.upsert_pod(event)
        self.events.clear()


def used_mib(state: ClusterState, node: str) -> int:
    return sum(g.used_memory_mib for g in state.nodes[node].gpus)


def two_nodes(cluster_cls: type[SnapshotCluster] = SnapshotCluster) -> tuple[ClusterState, Any, Scheduler]:
    state = ClusterState()
    cluster = cluster_cls(state, [gpu_node("n1", gpus=1, memory_mib=81920), gpu_node("n2", gpus=1, memory_mib=81920)])
    return state, cluster, Scheduler(state, cluster)


@pytest.mark.parametrize("cluster_cls", [SnapshotCluster, SilentCluster], ids=["event-seen", "event-not-yet-seen"])
def test_a_late_bind_to_another_node_is_refused_and_the_pods_usage_stays(cluster_cls: type[SnapshotCluster]) -> None:
    state, cluster, scheduler = two_nodes(cluster_cls)
    first = pod(memory_mib=81920)
    cluster.add_pod(first)
    meta = first["metadata"]
    scheduler.bind("default", meta["name"], meta["uid"], "n1")
    assert used_mib(state, "n1") == 81920
    with pytest.raises(BindError, match="already bound to node n1"):
        scheduler.bind("default", meta["name"], meta["uid"], "n2")  # kube-scheduler's retry after its timeout
    assert used_mib(state, "n1") == 81920 and used_mib(state, "n2") == 0
    assert state.pods[meta["uid"]].node_name == "n1"
    # the next pod does not get the memory the first still holds
    second = pod(memory_mib=8192)
    cluster.add_pod(second)
    assert scheduler.filter(second, ["n1"]).passed == []
    if isinstance(cluster, SilentCluster):
        cluster.deliver()  # the watch catches up: still counted once, on n1
        assert used_mib(state, "n1") == 81920 and state.pods[meta["uid"]].confirmed


def test_four_racing_binds_of_one_pod_keep_exactly_one_placement() -> None:
    state, cluster, scheduler = two_nodes(SilentCluster)
    only = pod(memory_mib=40960)
    cluster.add_pod(only)
    meta = only["metadata"]
    barrier = threading.Barrier(4)
    outcomes: list[str] = []
    lock = threading.Lock()

    def attempt(node: str) -> None:
        barrier.wait()
        try:
            scheduler.bind("default", meta["name"], meta["uid"], node)
            result = f"bound:{node}"
        except BindError as exc:
            result = f"refused:{exc}"
        with lock:
            outcomes.append(result)

    threads = [threading.Thread(target=attempt, args=(node,)) for node in ("n1", "n2", "n1", "n2")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    stored = cluster.pods[("default", meta["name"])]["spec"]["nodeName"]
    assert [o for o in outcomes if o.startswith("bound:") and o != f"bound:{stored}"] == []
    assert used_mib(state, stored) == 40960 and sum(used_mib(state, n) for n in ("n1", "n2")) == 40960
    cluster.deliver()
    assert used_mib(state, stored) == 40960 and sum(used_mib(state, n) for n in ("n1", "n2")) == 40960
    assert state.pods[meta["uid"]].node_name == stored
