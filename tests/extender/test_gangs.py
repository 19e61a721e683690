"""Gangs (issue 13 item 3): a Kueue plain-pod group is placed all or nothing. Planned whole at the first filter after
every member exists, reserved (GPUs and quota) so nobody else takes the capacity, each member's filter passing only
its planned node; members bound as planned; a plan not completed within the timeout released."""

from __future__ import annotations

from typing import Any

import pytest

from kube_vgpu import protocol
from kube_vgpu.extender.binding import BindError
from kube_vgpu.extender.scheduler import Scheduler
from kube_vgpu.extender.sources.snapshot import SnapshotCluster
from kube_vgpu.extender.state import ClusterState
from tests.helpers import gpu_node, pod
from tests.quota.helpers import FLAVORS, a100_node, gpu_queue, local_queue, make_env, queued_pod

WHOLE_MIB = 81920
NO_ROOM = "no GPU with 81920 MiB free (largest free 0 MiB)"


class Clock:
    def __init__(self) -> None:
        self.now = 1_800_000_000.0

    def __call__(self) -> float:
        return self.now


def member(gang: str, size: int, index: int, memory_mib: int = WHOLE_MIB, **kwargs: Any) -> dict[str, Any]:
    p = pod(f"{gang}-{index}", memory_mib=memory_mib, **kwargs)
    p["metadata"]["labels"][protocol.LABEL_KUEUE_POD_GROUP_NAME] = gang
    p["metadata"]["annotations"][protocol.ANNOTATION_KUEUE_POD_GROUP_TOTAL_COUNT] = str(size)
    p["metadata"]["creationTimestamp"] = f"2026-11-24T10:00:{index:02d}Z"
    return p


class Env:
    """Nodes of one 80 GB GPU each, a snapshot API, a scheduler; `free` nodes, the rest held by blocker pods."""

    def __init__(self, nodes: int, free: int, *, timeout_s: float = 300.0) -> None:
        self.clock = Clock()
        self.state = ClusterState(heartbeat_ttl_s=float("inf"), clock=self.clock)
        self.names = [f"n{i}" for i in range(nodes)]
        nodes_ = [gpu_node(name, gpus=1, memory_mib=WHOLE_MIB) for name in self.names]
        self.cluster = SnapshotCluster(self.state, nodes_)
        self.scheduler = Scheduler(self.state, self.cluster, gang_timeout_s=timeout_s)
        self.blockers = []
        for name in self.names[free:]:
            blocker = pod(f"blocker-{name}", memory_mib=WHOLE_MIB)
            self.cluster.add_pod(blocker)
            self.bind(blocker, name)
            self.blockers.append(blocker)

    def filter(self, p: dict[str, Any]) -> tuple[list[str], set[str]]:
        outcome = self.scheduler.filter(p, self.names)
        return outcome.passed, set(outcome.failed.values()) | set(outcome.unresolvable.values()) | (
            {outcome.error} if outcome.error else set())

    def bind(self, p: dict[str, Any], node: str) -> None:
        meta = p["metadata"]
        self.scheduler.bind(meta["namespace"], meta["name"], meta["uid"], node)

    def schedule(self, p: dict[str, Any]) -> str | None:
        """What kube-scheduler does with one extender: filter, then bind to the (only) passing node."""
        passed, _ = self.filter(p)
        if not passed:
            return None
        self.bind(p, passed[0])
        return passed[0]

    def used_mib(self) -> dict[str, int]:
        return {name: sum(g.used_memory_mib for g in self.state.nodes[name].gpus) for name in self.names}

    def bound(self, *pods: dict[str, Any]) -> list[str]:
        out = []
        for p in pods:
            stored = self.cluster.get_pod(p["metadata"]["namespace"], p["metadata"]["name"])
            out.append((stored or {}).get("spec", {}).get("nodeName") or "")
        return out


def test_a_gang_that_does_not_fit_reserves_nothing_and_binds_nothing_then_all_at_once() -> None:
    env = Env(nodes=4, free=3)
    gang = [member("train", 4, i) for i in range(4)]
    for p in gang:
        env.cluster.add_pod(p)
    for p in gang:
        passed, reasons = env.filter(p)
        assert passed == []
        assert reasons == {f"gang default/train: 3 of 4 members fit; waiting for a node for member train-3 "
                           f"(1 x 81920 MiB, gpucores 0): none of 4 node(s) fits it: 4 whose GPUs cannot take it "
                           f"(e.g. n3: {NO_ROOM}); the 3 member(s) planned before it count as using their GPUs "
                           "and quota"}
    assert sum(env.used_mib().values()) == WHOLE_MIB  # only the blocker: nothing reserved for the gang
    env.cluster.delete_pod("default", env.blockers[0]["metadata"]["name"])  # a 4th GPU frees
    nodes = [env.schedule(p) for p in gang]
    assert sorted(n for n in nodes if n) == env.names  # every member bound, one per GPU
    assert all(used == WHOLE_MIB for used in env.used_mib().values())


def test_members_wait_until_every_member_exists() -> None:
    env = Env(nodes=4, free=4)
    first, second = member("train", 4, 0), member("train", 4, 1)
    for p in (first, second):
        env.cluster.add_pod(p)
    assert env.filter(first) == ([], {"gang default/train: 2 of 4 members created; waiting for 2 more pod(s) "
                                      "labelled kueue.x-k8s.io/pod-group-name=train in namespace default before "
                                      "placing any (the size is the annotation "
                                      "kueue.x-k8s.io/pod-group-total-count=4)"})
    assert sum(env.used_mib().values()) == 0


def test_two_gangs_racing_for_six_gpus_end_one_whole_and_one_waiting() -> None:
    env = Env(nodes=6, free=6)
    a = [member("a", 4, i) for i in range(4)]
    b = [member("b", 4, i) for i in range(4)]
    for p in a + b:
        env.cluster.add_pod(p)
    # kube-scheduler interleaves the two gangs' pods
    results = {}
    for p in [x for pair in zip(a, b, strict=True) for x in pair]:
        results[p["metadata"]["name"]] = env.schedule(p)
    assert all(results[f"a-{i}"] for i in range(4))
    assert not any(results[f"b-{i}"] for i in range(4))
    passed, reasons = env.filter(b[0])
    assert passed == [] and reasons == {f"gang default/b: 2 of 4 members fit; waiting for a node for member b-2 "
                                        f"(1 x 81920 MiB, gpucores 0): none of 6 node(s) fits it: 6 whose GPUs "
                                        f"cannot take it (e.g. n0: {NO_ROOM}); the 2 member(s) planned before it "
                                        "count as using their GPUs and quota"}
    assert sum(env.used_mib().values()) == 4 * WHOLE_MIB  # gang b holds nothing


def test_a_member_passes_only_its_planned_node_and_cannot_bind_elsewhere() -> None:
    env = Env(nodes=3, free=3)
    gang = [member("g", 2, i) for i in range(2)]
    for p in gang:
        env.cluster.add_pod(p)
    passed, _ = env.filter(gang[0])
    assert len(passed) == 1
    other = next(name for name in env.names if name != passed[0])
    with pytest.raises(BindError, match=f"is reserved on node {passed[0]}, not {other}"):
        env.bind(gang[0], other)
    env.bind(gang[0], passed[0])
    assert env.bound(gang[0]) == [passed[0]]


def test_a_small_gang_shares_one_node_when_it_can() -> None:
    state = ClusterState(heartbeat_ttl_s=float("inf"))
    names = ["m0", "m1"]
    cluster = SnapshotCluster(state, [gpu_node(name, gpus=8, memory_mib=WHOLE_MIB) for name in names])
    scheduler = Scheduler(state, cluster)
    gang = [member("g", 4, i) for i in range(4)]
    for p in gang:
        cluster.add_pod(p)
    nodes = {tuple(scheduler.filter(p, names).passed) for p in gang}
    assert len(nodes) == 1  # fewest nodes: all four on one 8-GPU node


def test_a_failed_member_bind_releases_only_its_reservation_and_is_planned_again() -> None:
    class Flaky(SnapshotCluster):
        fail = True

        def bind(self, namespace: str, name: str, uid: str, node: str, annotations: dict[str, str]) -> None:
            if self.fail and name == "g-1":
                self.fail = False
                raise ConnectionError("connection reset")
            super().bind(namespace, name, uid, node, annotations)

    state = ClusterState(heartbeat_ttl_s=float("inf"))
    names = ["n0", "n1"]
    cluster = Flaky(state, [gpu_node(name, gpus=1, memory_mib=WHOLE_MIB) for name in names])
    scheduler = Scheduler(state, cluster)
    gang = [member("g", 2, i) for i in range(2)]
    for p in gang:
        cluster.add_pod(p)
    placed = {}
    for p in gang:
        (placed[p["metadata"]["name"]],) = scheduler.filter(p, names).passed
    meta = gang[1]["metadata"]
    with pytest.raises(BindError, match="connection reset"):
        scheduler.bind("default", meta["name"], meta["uid"], placed["g-1"])
    assert meta["uid"] not in state.pods  # released
    assert scheduler.filter(gang[1], names).passed == [placed["g-1"]]  # planned again, the same free GPU
    scheduler.bind("default", meta["name"], meta["uid"], placed["g-1"])
    meta0 = gang[0]["metadata"]
    scheduler.bind("default", meta0["name"], meta0["uid"], placed["g-0"])
    assert sorted(placed.values()) == names


def test_a_plan_not_completed_in_time_is_released_and_retried_later() -> None:
    env = Env(nodes=3, free=3, timeout_s=60)
    gang = [member("g", 3, i) for i in range(3)]
    for p in gang:
        env.cluster.add_pod(p)
    passed, _ = env.filter(gang[0])
    env.bind(gang[0], passed[0])
    assert sum(env.used_mib().values()) == 3 * WHOLE_MIB  # one bound, two reserved
    env.clock.now += 61  # the other two were never bound (kube-scheduler refused their planned nodes)
    passed, reasons = env.filter(gang[1])
    assert passed == []
    assert reasons == {"gang default/g: 1 of 3 members were bound within 60 s of the plan; not bound: g-1 on n1, "
                       "g-2 on n2 (see those pods' events for what refused the planned node); their reservations "
                       "were released; next plan in 30 s"}
    assert sum(env.used_mib().values()) == WHOLE_MIB  # the capacity is free for others meanwhile
    env.clock.now += 31
    assert len(env.filter(gang[1])[0]) == 1  # planned again


def test_after_a_restart_the_pending_members_are_planned_on_what_is_free() -> None:
    env = Env(nodes=4, free=4)
    gang = [member("g", 4, i) for i in range(4)]
    for p in gang:
        env.cluster.add_pod(p)
    for p in gang[:2]:
        assert env.schedule(p)
    stored = [env.cluster.get_pod("default", p["metadata"]["name"]) for p in gang]
    state = ClusterState(heartbeat_ttl_s=float("inf"))  # a new extender: the API objects only
    cluster = SnapshotCluster(state, [gpu_node(n, gpus=1, memory_mib=WHOLE_MIB) for n in env.names]
                              + [p for p in stored if p])
    scheduler = Scheduler(state, cluster)
    # its pending members' events came before the scheduler existed: it learns them as kube-scheduler filters them
    # (the bound ones from their assignments), and plans once all are known
    pending = [p for p in stored[2:] if p]
    first_round = [scheduler.filter(p, env.names) for p in pending]
    assert first_round[0].passed == []
    assert set(first_round[0].failed.values()) == {"gang default/g: 3 of 4 members created; waiting for 1 more "
                                                   "pod(s) labelled kueue.x-k8s.io/pod-group-name=g in namespace "
                                                   "default before placing any (the size is the annotation "
                                                   "kueue.x-k8s.io/pod-group-total-count=4)"}
    placed = [scheduler.filter(p, env.names).passed for p in pending]
    bound_nodes = {p["spec"]["nodeName"] for p in stored[:2] if p}
    assert all(len(nodes) == 1 and nodes[0] not in bound_nodes for nodes in placed)
    assert placed[0] != placed[1]


@pytest.mark.parametrize(("annotation", "message"), [
    (None, "no annotation kueue.x-k8s.io/pod-group-total-count"),
    ("four", "must be a whole number from 1 to 4096, got 'four'"),
    ("0", "must be a whole number from 1 to 4096, got '0'"),
])
def test_an_unreadable_gang_declaration_is_an_error(annotation: str | None, message: str) -> None:
    env = Env(nodes=1, free=1)
    p = member("g", 2, 0)
    if annotation is None:
        del p["metadata"]["annotations"][protocol.ANNOTATION_KUEUE_POD_GROUP_TOTAL_COUNT]
    else:
        p["metadata"]["annotations"][protocol.ANNOTATION_KUEUE_POD_GROUP_TOTAL_COUNT] = annotation
    passed, reasons = env.filter(p)
    assert passed == [] and len(reasons) == 1 and message in reasons.pop()


def test_a_gang_over_its_quota_reserves_neither_gpus_nor_quota() -> None:
    quota = FLAVORS + gpu_queue("team-a", {"a100": 3}) + local_queue("team-a", "q", "team-a")
    env = make_env(quota, [a100_node("a100-0", gpus=4)])
    gang = []
    for _ in range(4):
        p = queued_pod("q", gpus=1, memory_mib=1000)
        p["metadata"]["labels"][protocol.LABEL_KUEUE_POD_GROUP_NAME] = "g"
        p["metadata"]["annotations"][protocol.ANNOTATION_KUEUE_POD_GROUP_TOTAL_COUNT] = "4"
        gang.append(p)
        env.cluster.add_pod(p)
    outcome = env.filter(gang[0])
    assert outcome.passed == []
    assert "gang team-a/g: 3 of 4 members fit; waiting for a node for member" in next(iter(outcome.failed.values()))
    assert env.used("team-a", "a100") == 0


def test_a_member_is_planned_only_where_kube_scheduler_would_put_it() -> None:
    """Found by the e2e run: the plan put a member on a free node outside its nodeSelector, so kube-scheduler never
    offered that node and the gang ended three of four bound. Members are planned on nodes their selector and
    affinity admit, and among the nodes kube-scheduler last offered for them."""
    state = ClusterState(heartbeat_ttl_s=float("inf"))
    names = [f"n{i}" for i in range(6)]
    nodes = [gpu_node(name, gpus=1, memory_mib=WHOLE_MIB) for name in names]
    for node in nodes[:4]:
        node["metadata"]["labels"]["group"] = "mine"
    cluster = SnapshotCluster(state, nodes)
    scheduler = Scheduler(state, cluster)
    gang = [member("g", 4, i) for i in range(4)]
    for p in gang:
        p["spec"]["nodeSelector"] = {"group": "mine"}
        cluster.add_pod(p)
    # one of the four selected nodes is taken, two others are free outside the selector: the gang must wait
    blocker = pod("blocker", memory_mib=WHOLE_MIB)
    cluster.add_pod(blocker)
    scheduler.bind("default", "blocker", blocker["metadata"]["uid"], "n0")
    outcome = scheduler.filter(gang[0], names[:4])
    assert outcome.passed == [] and "3 of 4 members fit" in next(iter(outcome.failed.values()))
    # kube-scheduler offers a member fewer nodes (its own plugins refused n1): that member avoids n1
    cluster.delete_pod("default", "blocker")
    offered = ["n0", "n2", "n3"]
    assert scheduler.filter(gang[3], offered).passed  # planned now, and within what was offered
    planned = {p["metadata"]["name"]: scheduler.filter(p, names[:4]).passed for p in gang}
    assert planned["g-3"][0] in offered
    assert sorted(nodes_[0] for nodes_ in planned.values()) == names[:4]


# --- what a waiting gang's FailedScheduling reason says, case by case (issue: reasons a user can act on) ---------


def _not_all_created() -> set[str]:
    env = Env(nodes=2, free=2)
    first = member("t", 3, 0)
    env.cluster.add_pod(first)
    return env.filter(first)[1]


def _no_room() -> set[str]:
    env = Env(nodes=3, free=2)
    gang = [member("t", 3, i) for i in range(3)]
    for p in gang:
        env.cluster.add_pod(p)
    return env.filter(gang[0])[1]


def _no_room_in_cores() -> set[str]:
    env = Env(nodes=2, free=2)
    gang = [member("t", 3, i, memory_mib=1000, cores=60) for i in range(3)]
    for p in gang:
        env.cluster.add_pod(p)
    return env.filter(gang[0])[1]


def _not_offered() -> set[str]:
    env = Env(nodes=3, free=3)
    gang = [member("t", 2, i) for i in range(2)]
    reasons: set[str] = set()
    for p in gang:  # kube-scheduler's own plugins allow each member only on n2 (one GPU: room for one)
        env.cluster.add_pod(p)
        reasons = set(env.scheduler.filter(p, ["n2"]).failed.values())
    return reasons


def _over_quota() -> set[str]:
    quota = FLAVORS + gpu_queue("team-a", {"a100": 2}) + local_queue("team-a", "q", "team-a")
    env = make_env(quota, [a100_node("a100-0", gpus=4)])
    gang = []
    for i in range(3):
        p = queued_pod("q", gpus=1, memory_mib=1000, name=f"t-{i}")
        p["metadata"]["labels"][protocol.LABEL_KUEUE_POD_GROUP_NAME] = "t"
        p["metadata"]["annotations"][protocol.ANNOTATION_KUEUE_POD_GROUP_TOTAL_COUNT] = "3"
        p["metadata"]["creationTimestamp"] = f"2026-11-24T10:00:{i:02d}Z"
        gang.append(p)
        env.cluster.add_pod(p)
    return set(env.filter(gang[0]).failed.values())


def _timed_out(later_s: float) -> set[str]:
    env = Env(nodes=2, free=2, timeout_s=60)
    gang = [member("t", 2, i) for i in range(2)]
    for p in gang:
        env.cluster.add_pod(p)
    passed, _ = env.filter(gang[0])
    env.bind(gang[0], passed[0])
    env.clock.now += 61
    reasons = env.filter(gang[1])[1]
    env.clock.now += later_s
    return reasons if not later_s else env.filter(gang[1])[1]


@pytest.mark.parametrize(("scenario", "expected"), [
    pytest.param(_not_all_created,
                 "gang default/t: 1 of 3 members created; waiting for 2 more pod(s) labelled "
                 "kueue.x-k8s.io/pod-group-name=t in namespace default before placing any (the size is the "
                 "annotation kueue.x-k8s.io/pod-group-total-count=3)", id="members-missing"),
    pytest.param(_no_room,
                 f"gang default/t: 2 of 3 members fit; waiting for a node for member t-2 (1 x 81920 MiB, gpucores "
                 f"0): none of 3 node(s) fits it: 3 whose GPUs cannot take it (e.g. n2: {NO_ROOM}); the 2 "
                 "member(s) planned before it count as using their GPUs and quota", id="no-room"),
    pytest.param(_no_room_in_cores,
                 "gang default/t: 2 of 3 members fit; waiting for a node for member t-2 (1 x 1000 MiB, gpucores "
                 "60): none of 2 node(s) fits it: 2 whose GPUs cannot take it (e.g. n0: no GPU with 60 percent "
                 "cores free (most free 40 percent)); the 2 member(s) planned before it count as using their GPUs "
                 "and quota", id="no-room-cores-no-percent-sign"),
    pytest.param(_not_offered,
                 f"gang default/t: 1 of 2 members fit; waiting for a node for member t-1 (1 x 81920 MiB, gpucores "
                 f"0): none of 3 node(s) fits it: 1 whose GPUs cannot take it (e.g. n2: {NO_ROOM}); 2 not offered "
                 "for it by kube-scheduler (its node selector, affinity, taints or other resources); the 1 "
                 "member(s) planned before it count as using their GPUs and quota", id="not-offered"),
    pytest.param(_over_quota,
                 "gang team-a/t: 2 of 3 members fit; waiting for a node for member t-2 (1 x 1000 MiB, gpucores 0): "
                 "none of 1 node(s) fits it: 1 refused by quota (e.g. a100-0: quota: ClusterQueue team-a "
                 "(LocalQueue team-a/q): flavor a100, nvidia.com/gpu: needs 1, used 2/2 vGPUs (nominal 2), 0 "
                 "available now); the 2 member(s) planned before it count as using their GPUs and quota",
                 id="over-quota"),
    pytest.param(lambda: _timed_out(0),
                 "gang default/t: 1 of 2 members were bound within 60 s of the plan; not bound: t-1 on n1 (see "
                 "those pods' events for what refused the planned node); their reservations were released; next "
                 "plan in 30 s", id="plan-timed-out"),
    pytest.param(lambda: _timed_out(20),
                 "gang default/t: 1 of 2 members were bound within 60 s of the plan; not bound: t-1 on n1 (see "
                 "those pods' events for what refused the planned node); their reservations were released; next "
                 "plan in 10 s", id="retry-back-off"),
])
def test_each_waiting_case_says_what_the_gang_waits_for(scenario: Any, expected: str) -> None:
    reasons = scenario()
    assert reasons == {expected}
    assert "%" not in expected  # kube-scheduler reads an extender's reason as a format string


# --- members beyond the declared size (a coscheduling PodGroup's minMember is "at least", ours is exact) -----------
def test_members_beyond_the_size_do_not_hold_the_gang_back() -> None:
    # minMember 2, three pods, two free GPUs: the first two (in creation order) are placed together
    env = Env(nodes=3, free=2)
    gang = [member("pg", 2, i) for i in range(3)]
    for p in gang:
        env.cluster.add_pod(p)
    extra_passed, extra_reasons = env.filter(gang[2])  # the extra member is filtered first
    assert extra_passed == []
    assert extra_reasons == {"gang default/pg: this member is beyond the gang's 2 members and is placed after them, "
                             "on its own"}
    assert sorted(n for n in (env.schedule(gang[0]), env.schedule(gang[1])) if n) == ["n0", "n1"]
    # the extra member then waits like any pod for a GPU of its own, holding nothing meanwhile
    passed, reasons = env.filter(gang[2])
    assert passed == [] and reasons == {"gang default/pg: 2 of 2 members fit; waiting for a node for member pg-2 "
                                        "(1 x 81920 MiB, gpucores 0): none of 3 node(s) fits it: 3 whose GPUs cannot "
                                        "take it (e.g. n2: no GPU with 81920 MiB free (largest free 0 MiB))"}
    assert sum(env.used_mib().values()) == 3 * WHOLE_MIB  # two members and the blocker
    env.cluster.delete_pod("default", env.blockers[0]["metadata"]["name"])
    assert env.schedule(gang[2]) == "n2"


def test_an_extra_member_is_placed_on_its_own_once_the_gang_is_whole() -> None:
    env = Env(nodes=3, free=3)
    gang = [member("pg", 2, i) for i in range(3)]
    for p in gang[:2]:
        env.cluster.add_pod(p)
    assert all(env.schedule(p) for p in gang[:2])
    env.cluster.add_pod(gang[2])  # created later (a PodGroup's minMember is "at least")
    assert env.schedule(gang[2]) == "n2"


def test_an_extra_members_unbound_plan_is_released_after_the_timeout() -> None:
    env = Env(nodes=3, free=3, timeout_s=60)
    gang = [member("pg", 2, i) for i in range(3)]
    for p in gang:
        env.cluster.add_pod(p)
    assert all(env.schedule(p) for p in gang[:2])
    assert env.filter(gang[2])[0] == ["n2"]  # planned, reserved, never bound (kube-scheduler refused n2)
    assert sum(env.used_mib().values()) == 3 * WHOLE_MIB
    env.clock.now += 61
    env.filter(gang[0])  # any member's filter releases expired plans
    assert sum(env.used_mib().values()) == 2 * WHOLE_MIB
