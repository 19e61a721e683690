"""Preemption wired into filter (issue 14): a pod that fits no node's GPUs evicts the cheapest allowed victims on
one node, is nominated there, and the freed GPUs are held for it until it binds; refusals (a PodDisruptionBudget)
and failures end the nomination and the next filter decides again. Snapshot mode, evictions run inline."""

from __future__ import annotations

from typing import Any

from kube_vgpu import protocol
from kube_vgpu.extender.preemption.evict import EvictionOutcome, EvictionRequest, EvictionResult
from kube_vgpu.extender.scheduler import Scheduler
from kube_vgpu.extender.sources.snapshot import SnapshotCluster
from kube_vgpu.extender.state import ClusterState
from tests.helpers import gpu_node, pod

GPU_MIB = 81920
PDB_REFUSAL = "Cannot evict pod as it would violate the pod's disruption budget."


class Clock:
    def __init__(self) -> None:
        self.now = 1_800_000_000.0

    def __call__(self) -> float:
        return self.now


class MemoryEvictor:
    """Evicts from the snapshot as the Eviction API would: the pod goes, or a PodDisruptionBudget refuses."""

    def __init__(self, cluster: SnapshotCluster) -> None:
        self.cluster = cluster
        self.protected: set[str] = set()
        self.requests: list[EvictionRequest] = []
        #: accept evictions but leave the pods (their deletion not seen yet, as between an eviction and its event)
        self.slow = False

    def evict(self, request: EvictionRequest) -> EvictionResult:
        self.requests.append(request)
        if request.name in self.protected:
            return EvictionResult(EvictionOutcome.BLOCKED, PDB_REFUSAL)
        stored = self.cluster.get_pod(request.namespace, request.name)
        if stored is None or stored["metadata"]["uid"] != request.uid:
            return EvictionResult(EvictionOutcome.GONE)
        if not self.slow:
            self.cluster.delete_pod(request.namespace, request.name)
        return EvictionResult(EvictionOutcome.EVICTED)


class Env:
    def __init__(self, nodes: int = 1) -> None:
        self.clock = Clock()
        self.state = ClusterState(heartbeat_ttl_s=float("inf"), clock=self.clock)
        self.names = [f"n{i}" for i in range(nodes)]
        self.cluster = SnapshotCluster(self.state, [gpu_node(n, gpus=1, memory_mib=GPU_MIB) for n in self.names])
        self.scheduler = Scheduler(self.state, self.cluster)
        self.evictor = MemoryEvictor(self.cluster)
        self.scheduler.enable_preemption(self.evictor, inline=True)

    def make(self, name: str, memory_mib: int, priority: int = 0, **spec: Any) -> dict[str, Any]:
        p = pod(name, memory_mib=memory_mib)
        p["spec"]["priority"] = priority
        p["spec"].update(spec)
        self.cluster.add_pod(p)
        return p

    def run(self, name: str, node: str, memory_mib: int, priority: int = 0,
            labels: dict[str, str] | None = None, annotations: dict[str, str] | None = None) -> dict[str, Any]:
        p = pod(name, memory_mib=memory_mib)
        p["spec"]["priority"] = priority
        p["metadata"]["labels"].update(labels or {})
        p["metadata"]["annotations"].update(annotations or {})
        self.cluster.add_pod(p)
        passed = self.scheduler.filter(p, [node]).passed
        assert passed == [node], self.scheduler.filter(p, [node]).failed
        self.bind(p, node)
        return p

    def filter(self, p: dict[str, Any]) -> tuple[list[str], dict[str, str]]:
        outcome = self.scheduler.filter(p, self.names)
        return outcome.passed, {**outcome.failed, **outcome.unresolvable}

    def bind(self, p: dict[str, Any], node: str) -> None:
        meta = p["metadata"]
        self.scheduler.bind(meta["namespace"], meta["name"], meta["uid"], node)

    def alive(self, *pods: dict[str, Any]) -> list[bool]:
        return [self.cluster.get_pod(p["metadata"]["namespace"], p["metadata"]["name"]) is not None for p in pods]


def test_a_higher_priority_pod_evicts_the_lowest_priority_pods_it_needs_and_lands_there() -> None:
    env = Env()
    low = [env.run(f"low-{i}", "n0", 20480, priority=i) for i in range(3)]  # 60 GiB used, 20 GiB free
    urgent = env.make("urgent", 40960, priority=1000)
    passed, reasons = env.filter(urgent)
    assert passed == []
    assert reasons["n0"].startswith("preempting 1 pod(s) on this node for this pod: priority: 0 is lower than 1000")
    assert env.alive(*low) == [False, True, True]  # only the lowest went: one more 20 GiB was enough
    assert [r.name for r in env.evictor.requests] == ["low-0"]
    assert env.evictor.requests[0].rule == "priority: 0 is lower than 1000"
    passed, _ = env.filter(urgent)
    assert passed == ["n0"]
    env.bind(urgent, "n0")
    assert env.scheduler.nominations.by_preemptor == {}  # bound: its nomination is done


def test_the_freed_gpus_are_held_for_the_preemptor_against_lower_and_equal_priority_pods() -> None:
    env = Env()
    env.run("low", "n0", 61440, priority=0)
    urgent = env.make("urgent", 61440, priority=1000)
    assert env.filter(urgent)[0] == []  # the eviction starts (and, inline, ends)
    # before the preemptor binds, the GPU looks free; others of lower or equal priority may not take it
    for name, priority in (("sneaky", 0), ("peer", 1000)):
        other = env.make(name, 40960, priority=priority)
        passed, reasons = env.filter(other)
        assert passed == [] and reasons["n0"].startswith("GPUs held for default/urgent (priority 1000)")
    small = env.make("small", 20480, priority=0)
    assert env.filter(small)[0] == ["n0"]  # fits beside the preemptor's 60 GiB
    higher = env.make("higher", 40960, priority=2000)
    assert env.filter(higher)[0] == ["n0"]  # not held against a more important pod
    assert env.filter(urgent)[0] == ["n0"]


def test_equal_or_lower_priority_and_preemption_policy_never_preempt_nothing() -> None:
    env = Env()
    running = env.run("running", "n0", 61440, priority=100)
    for name, priority, spec in (("equal", 100, {}), ("lower", 5, {}),
                                 ("polite", 1000, {"preemptionPolicy": "Never"})):
        p = env.make(name, 40960, priority=priority, **spec)
        passed, reasons = env.filter(p)
        assert passed == [] and "preempting" not in reasons["n0"]
    assert env.alive(running) == [True] and env.evictor.requests == []


def test_a_victim_protected_by_a_disruption_budget_is_left_out_and_another_chosen() -> None:
    env = Env()
    cheap = env.run("cheap", "n0", 40960, priority=0)
    dearer = env.run("dearer", "n0", 40960, priority=10)
    env.evictor.protected.add("cheap")
    urgent = env.make("urgent", 40960, priority=1000)
    passed, _ = env.filter(urgent)  # chooses the cheapest: refused by its budget
    assert passed == [] and env.alive(cheap, dearer) == [True, True]
    passed, _ = env.filter(urgent)  # decides again: the protected one is left alone for a while
    assert passed == []
    assert [r.name for r in env.evictor.requests] == ["cheap", "dearer"]
    assert env.alive(cheap, dearer) == [True, False]
    assert env.filter(urgent)[0] == ["n0"]


def test_a_refused_eviction_is_said_in_the_preemptors_reasons_when_nothing_else_can_go() -> None:
    env = Env()
    env.run("only", "n0", 61440, priority=0)
    env.evictor.protected.add("only")
    urgent = env.make("urgent", 40960, priority=1000)
    env.filter(urgent)
    passed, reasons = env.filter(urgent)
    assert passed == []
    assert reasons["n0"].endswith(f"preemption: the eviction of default/only was refused ({PDB_REFUSAL}); other "
                                  "victims are chosen on the next attempt")


def test_a_gang_victim_takes_its_whole_gang_on_every_node() -> None:
    env = Env(nodes=2)
    gang_labels = {protocol.LABEL_KUEUE_POD_GROUP_NAME: "g"}
    gang_annotations = {protocol.ANNOTATION_KUEUE_POD_GROUP_TOTAL_COUNT: "2"}
    members = []
    for index in range(len(env.names)):
        p = pod(f"g-{index}", memory_mib=GPU_MIB)
        p["metadata"]["labels"].update(gang_labels)
        p["metadata"]["annotations"].update(gang_annotations)
        env.cluster.add_pod(p)
        members.append(p)
    for p in members:
        env.filter(p)
    for p, node in zip(members, env.names, strict=True):
        passed = env.scheduler.filter(p, env.names).passed
        env.bind(p, passed[0] if passed else node)
    assert env.alive(*members) == [True, True]
    urgent = env.make("urgent", GPU_MIB, priority=1000)
    passed, _ = env.filter(urgent)
    assert passed == []
    assert env.alive(*members) == [False, False]  # one member was in the way; the gang went whole
    assert env.filter(urgent)[0] == env.names  # both freed; it binds to one


def test_a_nomination_that_is_never_used_expires_and_releases_the_hold() -> None:
    env = Env()
    env.run("low", "n0", 61440, priority=0)
    urgent = env.make("urgent", 61440, priority=1000)
    env.filter(urgent)
    other = env.make("other", 40960, priority=0)
    assert env.filter(other)[0] == []
    env.clock.now += 121  # the preemptor never came back to bind (deleted before its event, rescheduled, ...)
    assert env.filter(other)[0] == ["n0"]
    assert env.scheduler.nominations.last_outcome["" + urgent["metadata"]["uid"]].startswith(
        "its nomination to node n0 expired")


def test_state_view_lists_nominations() -> None:
    env = Env()
    env.run("low", "n0", 61440, priority=0)
    env.evictor.protected.add("low")
    urgent = env.make("urgent", 61440, priority=1000)
    env.scheduler.nominations.expire()
    with env.state.lock:
        assert env.scheduler.nominations.view() == []
    env.evictor.protected.clear()
    env.filter(urgent)
    with env.state.lock:
        assert env.scheduler.nominations.view() == [{
            "preemptor": "default/urgent", "node": "n0", "priority": 1000, "rule": "priority: 0 is lower than 1000",
            "victims": {"default/low": "gone"}}]


def test_after_a_restart_terminating_victims_are_waited_for_never_evicted_twice() -> None:
    env = Env()
    victim = env.run("victim", "n0", 61440, priority=0)
    # evicted by an extender that then died: the pod is terminating, still holding its GPUs
    stored = env.cluster.get_pod("default", "victim")
    assert stored is not None
    terminating = {**stored, "metadata": {**stored["metadata"], "deletionTimestamp": "2027-01-15T08:00:00Z"}}
    env.state.upsert_pod(terminating)
    urgent = env.make("urgent", 61440, priority=1000)
    passed, reasons = env.filter(urgent)
    assert passed == [] and env.evictor.requests == []  # nothing evicted again
    assert reasons["n0"] == ("preempting 0 pod(s) on this node for this pod: waiting for 1 terminating pod(s) to "
                             "leave")
    other = env.make("other", 20480, priority=0)
    assert env.filter(other)[0] == []  # the GPUs it frees are held for the preemptor
    passed, reasons = env.filter(urgent)
    assert reasons["n0"] == ("nominated to this node, its GPUs held for this pod: waiting for 1 terminating pod(s) "
                             "to leave")
    env.cluster.delete_pod("default", victim["metadata"]["name"])
    assert env.filter(urgent)[0] == ["n0"]


def test_metrics_count_evictions_by_rule_and_outcome() -> None:
    from prometheus_client import generate_latest

    from kube_vgpu.extender.server import extender_metrics

    env = Env()
    env.run("cheap", "n0", 40960, priority=0)
    env.run("dearer", "n0", 40960, priority=10)
    env.evictor.protected.add("cheap")
    urgent = env.make("urgent", 40960, priority=1000)
    env.filter(urgent)
    env.filter(urgent)
    text = generate_latest(extender_metrics(env.scheduler).registry).decode()
    assert 'kube_vgpu_preemption_evictions_total{cluster_queue="",outcome="blocked",rule="priority"} 1.0' in text
    assert 'kube_vgpu_preemption_evictions_total{cluster_queue="",outcome="evicted",rule="priority"} 1.0' in text
    assert "kube_vgpu_preemption_nominations 1.0" in text


# --- preemption on quota: Kueue's reclaimWithinCohort ------------------------------------------------------------


def reclaim_env(team_b_preemption: str) -> Any:
    from tests.quota.helpers import FLAVORS, a100_node, gpu_queue, local_queue, make_env

    quota = (FLAVORS + gpu_queue("team-a", {"a100": 4}, cohort="ai")
             + gpu_queue("team-b", {"a100": 4}, cohort="ai", extra=team_b_preemption)
             + local_queue("team-a", "qa", "team-a") + local_queue("team-b", "qb", "team-b"))
    env = make_env(quota, [a100_node("a100-0", gpus=4), a100_node("a100-1", gpus=4)])
    evictor = MemoryEvictor(env.cluster)
    env.scheduler.enable_preemption(evictor, inline=True)
    return env, evictor


def test_a_queue_within_its_nominal_quota_takes_back_what_its_cohort_borrows() -> None:
    from tests.quota.helpers import queued_pod

    env, evictor = reclaim_env("  preemption: {reclaimWithinCohort: Any}\n")
    # team-a borrows the whole cohort: 8 one-vGPU pods (4 of them on team-b's nominal quota)
    team_a = [queued_pod("qa", "team-a", gpus=1, memory_mib=4096, name=f"a-{i}", priority=i % 2,
                         created=f"2027-01-15T08:00:{i:02d}Z") for i in range(8)]
    for p in team_a:
        assert isinstance(env.submit(p), str)
    assert env.used("team-a", "a100") == 8
    # team-b asks for 2 of its own 4: its GPUs fit, its quota does not (the cohort is full)
    team_b = [queued_pod("qb", "team-b", gpus=1, memory_mib=4096, name=f"b-{i}") for i in range(2)]
    for p in team_b:
        outcome = env.submit(p)
        assert not isinstance(outcome, str)
    # reclaimed: team-a's most recent priority-0 pods, two in all; its pods within its nominal 4 stay
    assert sorted(r.name for r in evictor.requests) == ["a-4", "a-6"]
    assert all(r.rule.startswith("reclaimWithinCohort: team-a borrows") for r in evictor.requests)
    assert env.used("team-a", "a100") == 6
    for p in team_b:
        assert isinstance(env.retry(p), str)
    assert env.used("team-b", "a100") == 2
    assert env.gate.holds == {}  # every hold released once its preemptor bound
    counts = env.scheduler.preemptor.executor.counts()  # type: ignore[union-attr]
    assert counts == {("reclaimWithinCohort", "team-b", "evicted"): 2}


def test_the_quota_freed_is_held_for_the_preemptor_not_taken_back_by_the_borrower() -> None:
    from tests.quota.helpers import queued_pod

    env, evictor = reclaim_env("  preemption: {reclaimWithinCohort: Any}\n")
    evictor.protected.update(f"a-{i}" for i in range(8))  # evictions refused: victims stay, quota stays used
    for i in range(8):
        env.submit(queued_pod("qa", "team-a", gpus=1, memory_mib=4096, name=f"a-{i}"))
    evictor.protected.clear()
    b = queued_pod("qb", "team-b", gpus=1, memory_mib=4096, name="b-0")
    assert not isinstance(env.submit(b), str)  # evicts one team-a pod; b is nominated, its quota held
    again = queued_pod("qa", "team-a", gpus=1, memory_mib=4096, name="a-again")
    outcome = env.submit(again)
    assert not isinstance(outcome, str)  # the freed vGPU is b's, not the borrower's
    assert isinstance(env.retry(b), str)


def test_with_kueues_default_preemption_nothing_is_reclaimed() -> None:
    from tests.quota.helpers import queued_pod

    env, evictor = reclaim_env("")
    for i in range(8):
        env.submit(queued_pod("qa", "team-a", gpus=1, memory_mib=4096, name=f"a-{i}"))
    outcome = env.submit(queued_pod("qb", "team-b", gpus=1, memory_mib=4096, name="b-0"))
    assert not isinstance(outcome, str) and evictor.requests == []


def test_after_a_restart_terminating_borrowers_are_waited_for_not_evicted_again() -> None:
    from tests.quota.helpers import queued_pod

    env, evictor = reclaim_env("  preemption: {reclaimWithinCohort: Any}\n")
    team_a = [queued_pod("qa", "team-a", gpus=1, memory_mib=4096, name=f"a-{i}") for i in range(8)]
    for p in team_a:
        env.submit(p)
    stored = env.cluster.get_pod("team-a", "a-7")
    assert stored is not None
    env.state.upsert_pod({**stored, "metadata": {**stored["metadata"], "deletionTimestamp": "2027-01-15T08:00:00Z"}})
    b = queued_pod("qb", "team-b", gpus=1, memory_mib=4096, name="b-0")
    outcome = env.submit(b)
    assert not isinstance(outcome, str) and evictor.requests == []  # the leaving pod is enough
    assert any("waiting for 1 terminating pod(s) to leave" in r for r in outcome.failed.values())
    again = queued_pod("qa", "team-a", gpus=1, memory_mib=4096, name="a-again")
    assert not isinstance(env.submit(again), str)  # b's quota is held
    env.delete(team_a[7])
    assert isinstance(env.retry(b), str)


def test_two_preemptors_deciding_before_any_victim_leaves_choose_different_victims() -> None:
    env = Env()
    env.evictor.slow = True
    low = [env.run(f"low-{i}", "n0", 20480, priority=0) for i in range(4)]
    first, second = env.make("first", 20480, priority=1000), env.make("second", 20480, priority=1000)
    env.filter(first)
    env.filter(second)  # first's victim is still there (its deletion not seen yet): not chosen again
    assert len({r.name for r in env.evictor.requests}) == 2, [r.name for r in env.evictor.requests]
    for request in env.evictor.requests:
        env.cluster.delete_pod(request.namespace, request.name)
    assert env.filter(first)[0] == ["n0"] and env.filter(second)[0] == ["n0"]
    assert len(env.alive(*low)) == 4 and sum(env.alive(*low)) == 2


def test_two_reclaiming_preemptors_take_different_borrowed_pods() -> None:
    from tests.quota.helpers import queued_pod

    env, evictor = reclaim_env("  preemption: {reclaimWithinCohort: Any}\n")
    for i in range(8):
        env.submit(queued_pod("qa", "team-a", gpus=1, memory_mib=4096, name=f"a-{i}"))
    evictor.slow = True
    team_b = [queued_pod("qb", "team-b", gpus=1, memory_mib=4096, name=f"b-{i}") for i in range(2)]
    for p in team_b:
        env.submit(p)
    victims = [r.name for r in evictor.requests]
    assert len(victims) == 2 and len(set(victims)) == 2, victims
    for request in evictor.requests:
        env.cluster.delete_pod(request.namespace, request.name)
    assert all(isinstance(env.retry(p), str) for p in team_b)


def test_a_gang_is_not_planned_on_gpus_held_for_a_preemptor() -> None:
    env = Env(nodes=2)
    env.run("low", "n0", GPU_MIB, priority=0)
    env.run("busy", "n1", GPU_MIB, priority=5000)  # n1 is full and nobody may take it
    urgent = env.make("urgent", GPU_MIB, priority=1000)
    env.evictor.slow = True  # the victim's deletion is not seen yet: n0 still holds it
    env.filter(urgent)
    env.cluster.delete_pod("default", "low")  # now n0's GPU looks free, but it is promised to urgent
    member = pod("g-0", memory_mib=GPU_MIB)
    member["metadata"]["labels"][protocol.LABEL_KUEUE_POD_GROUP_NAME] = "g"
    member["metadata"]["annotations"][protocol.ANNOTATION_KUEUE_POD_GROUP_TOTAL_COUNT] = "1"
    env.cluster.add_pod(member)
    passed, reasons = env.filter(member)
    assert passed == [] and "GPUs held for default/urgent" in reasons["n0"]
    assert env.filter(urgent)[0] == ["n0"]
