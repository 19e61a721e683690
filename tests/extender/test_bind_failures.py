"""API failures during bind roll back; concurrent binds never over-commit."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from extender.scheduler import BindError, Scheduler
from extender.sources.snapshot import SnapshotCluster
from extender.state import ClusterState
from kube_vgpu import protocol
from tests.helpers import gpu_node, pod


class FlakyCluster(SnapshotCluster):
    """The snapshot API with injectable failures at each step of a bind."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fail_write = self.fail_bind = self.fail_clear = False

    def write_assignment(self, namespace: str, name: str, uid: str, annotations: dict[str, str]) -> None:
        if self.fail_write:
            raise ConnectionError("apiserver unavailable")
        super().write_assignment(namespace, name, uid, annotations)

    def bind(self, namespace: str, name: str, uid: str, node: str) -> None:
        if self.fail_bind:
            raise ConnectionError("binding refused")
        super().bind(namespace, name, uid, node)

    def clear_assignment(self, namespace: str, name: str, uid: str) -> None:
        if self.fail_clear:
            raise ConnectionError("apiserver unavailable")
        super().clear_assignment(namespace, name, uid)


def setup(**node_kwargs: Any) -> tuple[ClusterState, FlakyCluster, Scheduler]:
    state = ClusterState()
    cluster = FlakyCluster(state, [gpu_node("n1", **node_kwargs)])
    return state, cluster, Scheduler(state, cluster)


def add(cluster: FlakyCluster, **kwargs: Any) -> dict[str, Any]:
    p = pod(**kwargs)
    cluster.add_pod(p)
    return p["metadata"]


def used(state: ClusterState) -> int:
    return sum(g.used_memory_mib for g in state.nodes["n1"].gpus)


def test_failed_annotation_write_rolls_back() -> None:
    state, cluster, scheduler = setup()
    meta = add(cluster, memory_mib=1000)
    cluster.fail_write = True
    with pytest.raises(BindError, match="writing the GPU assignment"):
        scheduler.bind("default", meta["name"], meta["uid"], "n1")
    assert used(state) == 0 and not state.pods


def test_failed_binding_removes_annotation_and_reservation() -> None:
    state, cluster, scheduler = setup()
    meta = add(cluster, memory_mib=1000)
    cluster.fail_bind = True
    with pytest.raises(BindError, match="binding"):
        scheduler.bind("default", meta["name"], meta["uid"], "n1")
    stored = cluster.pods[("default", meta["name"])]
    assert protocol.POD_ASSIGNMENT_ANNOTATION not in stored["metadata"]["annotations"]
    assert used(state) == 0
    cluster.fail_bind = False  # the scheduler retries: it works and counts once
    scheduler.bind("default", meta["name"], meta["uid"], "n1")
    assert used(state) == 1000


def test_unremovable_annotation_stays_counted_until_superseded() -> None:
    state, cluster, scheduler = setup()
    meta = add(cluster, memory_mib=1000)
    cluster.fail_bind = cluster.fail_clear = True
    with pytest.raises(BindError):
        scheduler.bind("default", meta["name"], meta["uid"], "n1")
    assert used(state) == 1000  # the annotation is still on the pod: never count it as free
    cluster.fail_bind = cluster.fail_clear = False
    scheduler.bind("default", meta["name"], meta["uid"], "n1")
    assert used(state) == 1000  # superseded, not doubled


def test_concurrent_binds_race_for_the_last_gpu_memory() -> None:
    state, cluster, scheduler = setup(gpus=2, memory_mib=10000)
    metas = [add(cluster, memory_mib=3000) for _ in range(20)]  # 3 fit per GPU: exactly 6 can win
    results: list[bool] = []
    barrier = threading.Barrier(len(metas))

    def attempt(meta: dict[str, Any]) -> None:
        barrier.wait()
        try:
            scheduler.bind("default", meta["name"], meta["uid"], "n1")
            results.append(True)
        except BindError:
            results.append(False)

    threads = [threading.Thread(target=attempt, args=(m,)) for m in metas]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results.count(True) == 6
    assert all(g.used_memory_mib <= g.memory_mib for g in state.nodes["n1"].gpus)
    assert used(state) == 18000


def test_same_pod_bound_twice_concurrently_counts_once() -> None:
    state, cluster, scheduler = setup()
    meta = add(cluster, memory_mib=1000)
    errors: list[str] = []

    def attempt() -> None:
        try:
            scheduler.bind("default", meta["name"], meta["uid"], "n1")
        except BindError as exc:
            errors.append(str(exc))

    threads = [threading.Thread(target=attempt) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert used(state) == 1000
    assert all("already being bound" in e for e in errors)


def test_uid_mismatch_refused() -> None:
    _, cluster, scheduler = setup()
    meta = add(cluster, memory_mib=1000)
    with pytest.raises(BindError):
        scheduler.bind("default", meta["name"], "another-uid", "n1")
