"""API failures during bind roll back; concurrent binds never over-commit."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from kube_vgpu import protocol
from kube_vgpu.extender.scheduler import BindError, PreparedBind, Scheduler
from kube_vgpu.extender.sources.snapshot import SnapshotCluster
from kube_vgpu.extender.state import ClusterState
from tests.helpers import gpu_node, pod


class FlakyCluster(SnapshotCluster):
    """The snapshot API with injectable failures of the Binding call (the only write a bind makes)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fail_bind = False  # refused before anything is written
        self.lose_reply = False  # written, but the caller gets an error (timeout, dropped connection)
        self.fail_reads = False
        self.reads_fail_after_bind = False  # and the API server then becomes unreachable

    def bind(self, namespace: str, name: str, uid: str, node: str, annotations: dict[str, str]) -> None:
        if self.fail_bind:
            raise ConnectionError("binding refused")
        super().bind(namespace, name, uid, node, annotations)
        if self.reads_fail_after_bind:
            self.fail_reads = True
        if self.lose_reply:
            raise TimeoutError("no reply from the API server")

    def get_pod(self, namespace: str, name: str) -> dict[str, Any] | None:
        if self.fail_reads:
            raise ConnectionError("apiserver unavailable")
        return super().get_pod(namespace, name)


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


def test_refused_binding_rolls_back_and_leaves_no_annotation() -> None:
    state, cluster, scheduler = setup()
    meta = add(cluster, memory_mib=1000)
    cluster.fail_bind = True
    with pytest.raises(BindError, match="binding"):
        scheduler.bind("default", meta["name"], meta["uid"], "n1")
    stored = cluster.pods[("default", meta["name"])]
    assert protocol.POD_ASSIGNMENT_ANNOTATION not in stored["metadata"]["annotations"]
    assert used(state) == 0 and not state.pods
    cluster.fail_bind = False  # kube-scheduler retries: it works and counts once
    scheduler.bind("default", meta["name"], meta["uid"], "n1")
    assert used(state) == 1000


def test_binding_committed_but_reply_lost_is_a_success_counted_once() -> None:
    state, cluster, scheduler = setup()
    meta = add(cluster, memory_mib=1000)
    cluster.lose_reply = True
    scheduler.bind("default", meta["name"], meta["uid"], "n1")  # verified by reading the pod back
    assert used(state) == 1000
    scheduler.bind("default", meta["name"], meta["uid"], "n1")  # kube-scheduler's retry: idempotent
    assert used(state) == 1000


def test_unverifiable_failure_keeps_gpus_counted_if_the_annotation_arrives() -> None:
    state, cluster, scheduler = setup()
    meta = add(cluster, memory_mib=1000)
    cluster.lose_reply = cluster.reads_fail_after_bind = True
    with pytest.raises(BindError):
        scheduler.bind("default", meta["name"], meta["uid"], "n1")
    # the Binding did take effect: its pod event (as a watch would deliver it) counts the GPUs again
    state.upsert_pod(cluster.pods[("default", meta["name"])])
    assert used(state) == 1000


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


class GatedCluster(FlakyCluster):
    """Binding calls wait until the test opens the gate: a bind stays in flight while others arrive. Reads of a pod
    wait for `read_gate` the same way once a test clears it (open by default)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.gate = threading.Event()
        self.in_flight = threading.Event()
        self.order: list[str] = []
        self.read_gate = threading.Event()
        self.read_gate.set()
        self.reading = threading.Event()

    def bind(self, namespace: str, name: str, uid: str, node: str, annotations: dict[str, str]) -> None:
        self.in_flight.set()
        assert self.gate.wait(10)
        self.order.append(name)
        super().bind(namespace, name, uid, node, annotations)

    def get_pod(self, namespace: str, name: str) -> dict[str, Any] | None:
        self.reading.set()
        assert self.read_gate.wait(10)
        return super().get_pod(namespace, name)


def test_a_waiting_bind_is_reserved_at_once_so_filter_sees_it() -> None:
    """kube-scheduler binds asynchronously: while one bind to a node is being written, the next pods are filtered.
    A bind waiting for its turn must already hold its GPUs, or filter offers them again and the bind fails."""
    state = ClusterState()
    cluster = GatedCluster(state, [gpu_node("n1", gpus=1, memory_mib=10000)])
    scheduler = Scheduler(state, cluster)
    first, second, third = add(cluster, memory_mib=4000), add(cluster, memory_mib=3000), add(cluster, memory_mib=4000)
    writer = threading.Thread(target=scheduler.bind, args=("default", first["name"], first["uid"], "n1"))
    writer.start()
    assert cluster.in_flight.wait(10)  # the first bind's Binding is being written
    prepared = scheduler.prepare_bind("default", second["name"], second["uid"], "n1")
    assert prepared is not None and used(state) == 7000  # reserved before its turn
    outcome = scheduler.filter(cluster.pods[("default", third["name"])], ["n1"])
    assert outcome.passed == [] and "n1" in outcome.failed  # 3000 MiB left: not enough for the third pod
    turn = threading.Event()
    assert not scheduler.ordering.request_turn(prepared, turn.set)  # another assignment is being written: wait
    cluster.gate.set()
    writer.join(10)
    assert turn.wait(10)  # the first bind's end handed the turn on
    scheduler.commit_bind(prepared)
    scheduler.ordering.finish_turn(prepared)
    assert cluster.order == [first["name"], second["name"]]
    annotations = [cluster.pods[("default", m["name"])]["metadata"]["annotations"] for m in (first, second)]
    bind_times = [protocol.parse_bind_time(a[protocol.POD_BIND_TIME_ANNOTATION]) for a in annotations]
    assert bind_times[0] <= bind_times[1]  # bind times follow the order of the writes (the device plugin's order)
    assert used(state) == 7000


class ConcurrencyCluster(FlakyCluster):
    """Records, for every Binding, which assignments were being written at the same moment."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.lock = threading.Lock()
        self.writing: list[str] = []
        self.overlaps: list[tuple[str, ...]] = []

    def bind(self, namespace: str, name: str, uid: str, node: str, annotations: dict[str, str]) -> None:
        assignment = annotations[protocol.POD_ASSIGNMENT_ANNOTATION]
        with self.lock:
            self.writing.append(assignment)
            self.overlaps.append(tuple(self.writing))
        time.sleep(0.002)  # long enough for the other threads to pile up behind this write
        super().bind(namespace, name, uid, node, annotations)
        with self.lock:
            self.writing.remove(assignment)


def test_binds_to_one_node_overlap_only_with_identical_assignments() -> None:
    """Different assignments are written one at a time (their order is the device plugin's order); identical ones
    may be written together, which is what keeps a burst of identical pods onto one GPU fast."""
    state = ClusterState()
    cluster = ConcurrencyCluster(state, [gpu_node("n1", gpus=2, memory_mib=81920)])
    scheduler = Scheduler(state, cluster, node_policy="binpack", gpu_policy="binpack")
    metas = [add(cluster, memory_mib=4096, cores=10) for _ in range(12)] + [
        add(cluster, memory_mib=8192, cores=10) for _ in range(6)
    ]
    barrier = threading.Barrier(len(metas))

    def attempt(meta: dict[str, Any]) -> None:
        barrier.wait()
        scheduler.bind("default", meta["name"], meta["uid"], "n1")

    threads = [threading.Thread(target=attempt, args=(m,)) for m in metas]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(cluster.overlaps) == len(metas)
    assert all(len(set(seen)) == 1 for seen in cluster.overlaps)  # never two different assignments at once
    assert max(len(seen) for seen in cluster.overlaps) > 1  # identical ones did overlap
    assert not scheduler.ordering.busy_nodes() and not scheduler._binding  # nothing left behind
    gpus = state.nodes["n1"].gpus
    assert sum(g.used_memory_mib for g in gpus) == 12 * 4096 + 6 * 8192
    assert all(g.used_cores <= g.cores for g in gpus)


def prepared_bind() -> tuple[ClusterState, FlakyCluster, Scheduler, dict[str, Any], PreparedBind]:
    """A 4000 MiB pod whose bind is decided and reserved on a 10000 MiB GPU, not yet written."""
    state, cluster, scheduler = setup(gpus=1, memory_mib=10000)
    meta = add(cluster, memory_mib=4000)
    prepared = scheduler.prepare_bind("default", meta["name"], meta["uid"], "n1")
    assert prepared is not None and used(state) == 4000
    return state, cluster, scheduler, meta, prepared


def test_a_pod_deleted_while_its_bind_waits_is_not_bound_and_frees_its_reservation() -> None:
    state, cluster, scheduler, meta, prepared = prepared_bind()
    state.delete_pod(meta["uid"])  # the watch delivers the pod's deletion before its turn comes
    with pytest.raises(BindError, match="went away"):
        scheduler.commit_bind(prepared)
    assert used(state) == 0
    assert not cluster.pods[("default", meta["name"])]["spec"].get("nodeName")  # no Binding was written
    # nothing is left marked as being bound: a new pod of the same UID could be bound again
    scheduler.bind("default", meta["name"], meta["uid"], "n1")
    assert used(state) == 4000


def test_an_abandoned_bind_gives_its_reservation_back() -> None:
    state, _, scheduler, meta, prepared = prepared_bind()
    scheduler.abandon_bind(prepared)
    assert used(state) == 0 and not state.pods
    scheduler.bind("default", meta["name"], meta["uid"], "n1")
    assert used(state) == 4000
