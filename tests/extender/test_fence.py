"""Issue 20 item 2: fencing between scheduler replicas (extender/fence.py).

The table pins the fence's decision for each Lease state; the failover scenario reproduces the defect (a deposed
leader's queued bind, written after the new leader's extender placed another pod on the same capacity, over-commits a
GPU) and shows that the fence refuses that write, whether or not the old replica ever saw the handover.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import pytest

from kube_vgpu import protocol
from kube_vgpu.extender.binding import BindError
from kube_vgpu.extender.fence import LeaderFence, LeaseTerm, parse_lease
from kube_vgpu.extender.scheduler import Scheduler
from kube_vgpu.extender.state import ClusterState
from tests.helpers import gpu_node, pod

T0 = 1_800_000_000.0
WINDOW_S, MARGIN_S, DURATION_S = 10.0, 1.0, 15


def lease(holder: str | None, *, renewed_at: float = T0, transitions: int = 0,
          duration_s: Any = DURATION_S) -> dict[str, Any]:
    spec: dict[str, Any] = {"leaseDurationSeconds": duration_s, "leaseTransitions": transitions,
                            "renewTime": dt.datetime.fromtimestamp(renewed_at, dt.UTC).strftime(
                                "%Y-%m-%dT%H:%M:%S.%fZ")}
    if holder is not None:
        spec["holderIdentity"] = holder
    return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
            "metadata": {"namespace": "kube-vgpu", "name": "kube-vgpu-scheduler"}, "spec": spec}


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> float:
        return self.now


def fence_for(prefix: str, clock: Clock, relists: list[str] | None = None) -> LeaderFence:
    fence = LeaderFence(prefix, write_window_s=WINDOW_S, margin_s=MARGIN_S, clock=clock)

    def relist(done: Any) -> None:
        if relists is not None:
            relists.append(prefix)
        done()

    fence.request_relist = relist
    return fence


# --- the decision table --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    id: str
    observed: list[dict[str, Any] | None] | None  # None: nothing observed yet
    elapsed_s: float
    refusal: str | None  # a part of the reason, or None for "may bind"


ROWS = [
    Row("nothing-read-yet", None, 0, "has not been read yet"),
    Row("ours-fresh", [lease("sched-a_1")], 0, None),
    Row("ours-3.9s-after-renewal", [lease("sched-a_1")], 3.9, None),
    Row("ours-renewal-late", [lease("sched-a_1")], 4.0, "the leader Lease ends in 11.0 s"),
    Row("ours-expired", [lease("sched-a_1")], 30, "ends in -15.0 s"),
    Row("another-replica", [lease("sched-b_2")], 0, "held by sched-b_2"),
    Row("prefix-must-match-from-the-start", [lease("x-sched-a_1")], 0, "held by x-sched-a_1"),
    Row("released", [lease(None)], 0, "held by nobody"),
    Row("deleted", [lease("sched-a_1"), None], 0, "held by nobody"),
    Row("unreadable-duration", [lease("sched-a_1", duration_s="15")], 0, "leaseDurationSeconds must be a positive"),
    Row("unreadable-after-good", [lease("sched-a_1"), {"spec": []}], 0, "spec must be an object"),
]


@pytest.mark.parametrize("row", ROWS, ids=[row.id for row in ROWS])
def test_the_fence_decides_from_the_lease(row: Row) -> None:
    clock = Clock()
    fence = fence_for("sched-a_", clock)
    for observed in row.observed or ():
        fence.observe(observed)
    clock.now += row.elapsed_s
    reason = fence.refusal()
    if row.refusal is None:
        assert reason is None
    else:
        assert reason is not None and row.refusal in reason, reason


def test_a_new_term_of_ours_waits_for_its_relist() -> None:
    clock, pending = Clock(), []
    fence = LeaderFence("sched-a_", write_window_s=WINDOW_S, margin_s=MARGIN_S, clock=clock)
    fence.request_relist = pending.append  # the relist is under way until the test calls it done
    fence.observe(lease("sched-a_1", transitions=3))
    assert "relisting pods" in (fence.refusal() or "")
    fence.observe(lease("sched-a_1", transitions=3, renewed_at=T0 + 2))  # renewals do not ask again
    assert len(pending) == 1
    pending.pop()()
    assert fence.refusal() is None
    # lost and won back: a new term (transitions moved), so a new relist before binding again
    fence.observe(lease("sched-b_9", transitions=4))
    fence.observe(lease("sched-a_1", transitions=5))
    assert "relisting pods" in (fence.refusal() or "") and len(pending) == 1


def test_parse_lease_reads_the_fields_the_fence_uses() -> None:
    assert parse_lease(lease("a_1", transitions=2)) == LeaseTerm("a_1", 2, T0, 15.0)
    assert parse_lease(lease(None)) is None
    with pytest.raises(ValueError, match="renewTime"):
        parse_lease({"spec": {"holderIdentity": "a_1", "leaseDurationSeconds": 15, "renewTime": "yesterday"}})


# --- failover through two extenders over one API store ------------------------------------------------------------


class ApiStore:
    """The API server's pods, as two extenders see them: a Binding sets nodeName and the annotations, and is refused
    for a pod already bound (as the real API server does)."""

    def __init__(self) -> None:
        self.pods: dict[tuple[str, str], dict[str, Any]] = {}

    def add(self, p: dict[str, Any]) -> dict[str, Any]:
        self.pods[(p["metadata"]["namespace"], p["metadata"]["name"])] = p
        return p

    def get_pod(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self.pods.get((namespace, name))

    def remember_pod(self, p: Mapping[str, Any]) -> None:
        """The store already has it."""

    def bind(self, namespace: str, name: str, uid: str, node: str, annotations: dict[str, str]) -> None:
        p = self.pods[(namespace, name)]
        if p["spec"].get("nodeName"):
            raise RuntimeError(f"409: pod {name} is already assigned to node {p['spec']['nodeName']}")
        p["spec"]["nodeName"] = node
        p["metadata"].setdefault("annotations", {}).update(annotations)

    def assigned_mib(self, gpu_uuid: str) -> int:
        total = 0
        for p in self.pods.values():
            text = (p["metadata"].get("annotations") or {}).get(protocol.POD_ASSIGNMENT_ANNOTATION)
            if text and p["spec"].get("nodeName"):
                for container in protocol.decode_assignment(text).containers:
                    total += sum(d.memory_mib for d in container.devices if d.uuid == gpu_uuid)
        return total


NODE = gpu_node("n1", gpus=1, memory_mib=81920)
GPU_UUID = protocol.decode_inventory(NODE["metadata"]["annotations"][protocol.NODE_INVENTORY_ANNOTATION]).gpus[0].uuid


def extender(store: ApiStore, fence: LeaderFence | None) -> Scheduler:
    state = ClusterState(heartbeat_ttl_s=float("inf"))
    state.upsert_node(NODE)
    state.replace_pods(list(store.pods.values()))
    state.mark_synced()
    if fence is not None:
        fence.request_relist = lambda done: (state.replace_pods(list(store.pods.values())), done())  # type: ignore[func-returns-value]
    return Scheduler(state, store, fence=fence)


def bind_fully(scheduler: Scheduler, p: dict[str, Any]) -> None:
    meta = p["metadata"]
    assert scheduler.filter(p, ["n1"]).passed == ["n1"]
    scheduler.bind(meta["namespace"], meta["name"], meta["uid"], "n1")


@pytest.mark.parametrize("old_leader_sees_the_handover", [True, False], ids=["handover-seen", "old-watch-dead"])
def test_a_deposed_leaders_queued_bind_is_never_written(old_leader_sees_the_handover: bool) -> None:
    store, clock = ApiStore(), Clock()
    fence_a, fence_b = fence_for("sched-a_", clock), fence_for("sched-b_", clock)
    a, b = extender(store, fence_a), extender(store, fence_b)
    for fence in (fence_a, fence_b):
        fence.observe(lease("sched-a_1", transitions=0))
    late = store.add(pod(memory_mib=81920))
    meta = late["metadata"]
    assert a.filter(late, ["n1"]).passed == ["n1"]
    queued = a.prepare_bind(meta["namespace"], meta["name"], meta["uid"], "n1")  # waits for the node's turn...
    assert queued is not None
    # ...while sched-a's kube-scheduler stops renewing (a partition, a long GC pause) and sched-b takes over after a
    # whole lease duration without renewals
    clock.now += DURATION_S + 1
    handover = lease("sched-b_2", transitions=1, renewed_at=clock.now)
    fence_b.observe(handover)
    if old_leader_sees_the_handover:
        fence_a.observe(handover)
    winner = store.add(pod(memory_mib=81920))
    bind_fully(b, winner)
    assert store.assigned_mib(GPU_UUID) == 81920
    with pytest.raises(BindError, match="not binding"):
        a.commit_bind(queued)
    assert store.assigned_mib(GPU_UUID) == 81920  # never 163840 on an 81920 MiB GPU
    assert store.get_pod(meta["namespace"], meta["name"])["spec"].get("nodeName") is None  # type: ignore[index]
    assert meta["uid"] not in a.state.pods  # its reservation was released, nothing leaks


def test_without_the_fence_the_same_failover_over_commits() -> None:
    """The defect, reproduced: what the fence prevents."""
    store = ApiStore()
    a, b = extender(store, None), extender(store, None)
    late = store.add(pod(memory_mib=81920))
    meta = late["metadata"]
    assert a.filter(late, ["n1"]).passed == ["n1"]
    queued = a.prepare_bind(meta["namespace"], meta["name"], meta["uid"], "n1")
    assert queued is not None
    bind_fully(b, store.add(pod(memory_mib=81920)))
    a.commit_bind(queued)
    assert store.assigned_mib(GPU_UUID) == 2 * 81920


def test_the_new_leader_binds_only_after_relisting_what_the_old_one_wrote() -> None:
    store, clock = ApiStore(), Clock()
    fence_a, fence_b = fence_for("sched-a_", clock), fence_for("sched-b_", clock)
    a = extender(store, fence_a)
    b_relists: list[str] = []
    b = extender(store, None)  # built before sched-a's last write: its state lacks it
    fence_b = fence_for("sched-b_", clock, b_relists)
    fence_b.request_relist = lambda done: (b_relists.append("b"), b.state.replace_pods(list(store.pods.values())),  # type: ignore[func-returns-value]
                                           done())
    b.fence = fence_b
    fence_a.observe(lease("sched-a_1"))
    bind_fully(a, store.add(pod(memory_mib=81920)))  # written by the old leader, unseen by b's state so far
    clock.now += DURATION_S + 1
    fence_b.observe(lease("sched-b_2", transitions=1, renewed_at=clock.now))
    assert b_relists == ["b"]
    follower = store.add(pod(memory_mib=81920))
    assert b.filter(follower, ["n1"]).passed == []  # the relist showed the GPU full
    assert store.assigned_mib(GPU_UUID) == 81920
