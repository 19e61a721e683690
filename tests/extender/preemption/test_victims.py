"""Victim search on one node (kube-scheduler's selectVictimsOnNode on GPU shares) and the choice among nodes."""

from __future__ import annotations

from dataclasses import replace
from functools import cache
from typing import Any

import pytest

from kube_vgpu import protocol
from kube_vgpu.dev.fixtures import synth_inventory
from kube_vgpu.extender.engine.fit import place
from kube_vgpu.extender.engine.model import GpuUsage, NodeState, Placement, PlacementRequest
from kube_vgpu.extender.engine.policies import make_policy
from kube_vgpu.extender.preemption import (
    Candidate,
    GangMember,
    NoVictims,
    PodFacts,
    QueueSnapshot,
    Victims,
    find_victims,
    may_preempt,
    pick_node,
    reclaimable,
)
from kube_vgpu.extender.quota.objects import Preemption
from tests.helpers import pod

BINPACK = make_policy("binpack")
GIB = 1024
A100_MIB = 80 * GIB


@cache
def inventory(gpus: int, topology: str) -> protocol.NodeInventory:
    return synth_inventory("n1", gpus, "NVIDIA A100 80GB PCIe", A100_MIB, topology)


def new_node(gpus: int = 1, topology: str = "pcie") -> NodeState:
    return NodeState("n1", inventory(gpus, topology))


def hold(node: NodeState, uid: str, priority: int, started_s: float, devices: list[tuple[int, int, int]],
         gang: str | None = None, allowed: bool = True) -> Candidate:
    """A running pod holding (GPU position, MiB, cores) per vGPU; its usage is applied to the node."""
    usage = tuple(GpuUsage(p, mib, cores, 1, cores >= 100) for p, mib, cores in devices)
    node.apply_usage(usage, 1)
    return Candidate(uid, priority, started_s, usage, gang, allowed)


def request(**kwargs: Any) -> PlacementRequest:
    return PlacementRequest(protocol.parse_pod_gpu_request(pod(**kwargs)))


def search(node: NodeState, req: PlacementRequest, candidates: list[Candidate],
           gangs: dict[str, list[GangMember]] | None = None) -> Victims | NoVictims:
    return find_victims(node, req, candidates, BINPACK, BINPACK, gangs=gangs)


def uids(found: Victims | NoVictims) -> list[str]:
    assert isinstance(found, Victims), found
    return [v.uid for v in found.victims]


def three_20gib_pods(node: NodeState) -> list[Candidate]:
    return [hold(node, f"p{priority}", priority, 100.0 * priority, [(0, 20 * GIB, 0)]) for priority in (1, 2, 3)]


@pytest.mark.parametrize(
    ("preemptor_gib", "expected"),
    [
        (20, []),  # 20 GiB are free: nobody goes
        (40, ["p1"]),  # 20 free + the lowest pod's 20
        (60, ["p1", "p2"]),  # the two lowest, least important first
        (80, ["p1", "p2", "p3"]),
    ],
)
def test_memory_contention_evicts_lowest_priorities(preemptor_gib: int, expected: list[str]) -> None:
    node = new_node()
    found = search(node, request(memory_mib=preemptor_gib * GIB), three_20gib_pods(node))
    assert uids(found) == expected
    assert isinstance(found, Victims) and found.placement.containers[0].devices[0][0] == 0


def test_equal_start_priority_tie_evicts_most_recently_started() -> None:
    node = new_node()
    old = hold(node, "old", 1, 10.0, [(0, 40 * GIB, 0)])
    new = hold(node, "new", 1, 20.0, [(0, 40 * GIB, 0)])
    assert uids(search(node, request(memory_mib=40 * GIB), [old, new])) == ["new"]


def test_exclusive_preemptor_needs_an_idle_gpu() -> None:
    node = new_node(gpus=2)
    low = [hold(node, "a", 1, 1.0, [(0, 1 * GIB, 10)]), hold(node, "b", 2, 2.0, [(0, 1 * GIB, 10)])]
    high = hold(node, "vip", 9, 3.0, [(1, 1 * GIB, 10)], allowed=False)
    found = search(node, request(cores=100, memory_mib=10 * GIB), [*low, high])
    assert sorted(uids(found)) == ["a", "b"]  # both, or GPU 0 is not idle; the protected GPU 1 is never touched
    assert isinstance(found, Victims) and found.placement.usage[0].exclusive and found.placement.usage[0].position == 0


def test_exclusive_holder_blocks_sharing_until_evicted() -> None:
    node = new_node()
    whole = hold(node, "whole", 1, 1.0, [(0, 10 * GIB, 100)])
    assert uids(search(node, request(memory_mib=GIB, cores=10), [whole])) == ["whole"]


def test_multi_gpu_preemptor_respects_numa_pairs() -> None:
    """4 GPUs, NVLink pairs (0,1) and (2,3), one NUMA node per pair; the preemptor wants 2 whole GPUs on one NUMA
    node. Evicting the lowest-priority pod (GPU 0) would free GPUs 0 and 3 on different NUMA nodes: not enough."""
    node = new_node(gpus=4, topology="nvlink-pairs")
    lowest = hold(node, "lowest", 1, 1.0, [(0, A100_MIB, 100)])
    protected = hold(node, "protected", 9, 1.0, [(1, A100_MIB, 100)], allowed=False)
    middle = hold(node, "middle", 2, 1.0, [(2, A100_MIB, 100)])
    req = request(gpus=2, cores=100, annotations={protocol.ANNOTATION_NUMA_BIND: "true"})
    found = search(node, req, [lowest, protected, middle])
    assert uids(found) == ["middle"]
    assert isinstance(found, Victims)
    assert sorted(d[0] for d in found.placement.containers[0].devices) == [2, 3]


def test_vgpu_slots_count() -> None:
    node = new_node()
    slots = node.gpus[0].max_vgpus
    pods = [hold(node, f"s{i}", i, float(i), [(0, 100, 0)]) for i in range(slots)]
    assert uids(search(node, request(memory_mib=100), pods)) == ["s0"]


@pytest.mark.parametrize(("preemptor_priority", "expected"), [(1, None), (2, ["low"])])
def test_equal_priority_never_evicted_by_plain_priority(preemptor_priority: int, expected: list[str] | None) -> None:
    node = new_node()
    preemptor = PodFacts("me", preemptor_priority, 50.0)
    queues = QueueSnapshot()
    candidates = []
    for uid, devices in (("low", [(0, 40 * GIB, 0)]), ("also-low", [(0, 40 * GIB, 0)])):
        facts = PodFacts(uid, 1, 10.0)
        candidates.append(hold(node, uid, 1, 10.0 if uid == "low" else 5.0, devices,
                               allowed=may_preempt(preemptor, facts, queues).allowed))
    found = search(node, request(memory_mib=40 * GIB), candidates)
    if expected is None:
        assert isinstance(found, NoVictims) and "2 pod(s) here may not be preempted" in found.reason
    else:
        assert uids(found) == expected  # equal priority and start order: the later started goes


def test_a_victim_that_does_not_help_is_not_chosen() -> None:
    node = new_node(gpus=2)
    big = hold(node, "big", 5, 1.0, [(0, 70 * GIB, 0)], allowed=False)
    useless = hold(node, "useless", 1, 2.0, [(0, 5 * GIB, 0)])  # lowest priority, but GPU 0 stays too full
    helpful = hold(node, "helpful", 2, 3.0, [(1, 60 * GIB, 0)])
    assert uids(search(node, request(memory_mib=40 * GIB), [big, useless, helpful])) == ["helpful"]


def test_gang_victim_brings_its_gang() -> None:
    node = new_node()
    member = hold(node, "g-0", 1, 1.0, [(0, 40 * GIB, 0)], gang="team/g")
    single = hold(node, "single", 2, 2.0, [(0, 40 * GIB, 0)])
    elsewhere = [GangMember("g-1", 1, 1.0), GangMember("g-2", 1, 1.0)]
    found = search(node, request(memory_mib=40 * GIB), [member, single], {"team/g": elsewhere})
    assert isinstance(found, Victims)
    assert uids(found) == ["g-0"] and [m.uid for m in found.extra] == ["g-1", "g-2"] and found.count == 3


def test_gang_with_a_protected_member_is_not_a_victim() -> None:
    node = new_node()
    member = hold(node, "g-0", 1, 1.0, [(0, 40 * GIB, 0)], gang="team/g")
    single = hold(node, "single", 2, 2.0, [(0, 40 * GIB, 0)])
    found = search(node, request(memory_mib=40 * GIB), [member, single],
                   {"team/g": [GangMember("g-1", 7, 1.0, allowed=False)]})
    assert uids(found) == ["single"]
    assert isinstance(found, Victims) and found.extra == ()


def test_gang_members_on_one_node_go_together() -> None:
    node = new_node()
    a = hold(node, "g-0", 1, 1.0, [(0, 20 * GIB, 0)], gang="g")
    b = hold(node, "g-1", 1, 1.0, [(0, 20 * GIB, 0)], gang="g")
    other = hold(node, "other", 1, 5.0, [(0, 40 * GIB, 0)])
    # 40 GiB: "other" alone (one pod) costs less than the gang, and it started later
    assert uids(search(node, request(memory_mib=40 * GIB), [a, b, other])) == ["other"]
    assert sorted(uids(search(node, request(memory_mib=60 * GIB), [a, b, other]))) == ["g-0", "g-1", "other"]


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        ({"memory_mib": 100 * GIB}, "needs 102400 MiB per GPU"),
        ({"gpus": 2, "memory_mib": GIB}, "needs 2 GPUs"),
        ({"memory_mib": 80 * GIB}, "1 pod(s) here may not be preempted"),
    ],
)
def test_no_fit_returns_the_reason(kwargs: dict[str, Any], reason: str) -> None:
    node = new_node()
    candidates = [hold(node, "low", 1, 1.0, [(0, 10 * GIB, 0)]), hold(node, "kept", 9, 1.0, [(0, 10 * GIB, 0)],
                                                                      allowed=False)]
    found = search(node, request(**kwargs), candidates)
    assert isinstance(found, NoVictims) and found.node_name == "n1"
    assert reason in found.reason, found.reason


def fingerprint(node: NodeState) -> tuple[Any, ...]:
    return (node.version, dict(node.pod_kinds), dict(node.fit_cache), node.free_milli_cache,
            [(g.used_memory_mib, g.used_cores, g.used_vgpus, g.exclusive_holders) for g in node.gpus])


def test_caller_state_is_not_mutated() -> None:
    node = new_node(gpus=2)
    candidates = [*three_20gib_pods(node), hold(node, "x", 1, 1.0, [(1, 80 * GIB, 100)])]
    req = request(memory_mib=60 * GIB)
    node.fit_cache["key"] = place(node, req, BINPACK, BINPACK)  # a cached result must survive
    before = fingerprint(node)
    assert isinstance(search(node, req, candidates), Victims)
    assert isinstance(search(node, request(memory_mib=100 * GIB), candidates), NoVictims)
    assert fingerprint(node) == before


def found_on(name: str, victims: list[tuple[int, float]], extra: tuple[tuple[int, float], ...] = ()) -> Victims:
    placement = Placement(name, (), ())
    return Victims(
        name,
        tuple(Candidate(f"{name}-{i}", p, s, ()) for i, (p, s) in enumerate(victims)),
        tuple(GangMember(f"{name}-x{i}", p, s) for i, (p, s) in enumerate(extra)),
        placement,
    )


@pytest.mark.parametrize(
    ("nodes", "expected"),
    [
        ([("a", [(1, 0.0)]), ("b", [])], "b"),  # no victims at all wins
        ([("a", [(5, 0.0)]), ("b", [(1, 0.0), (1, 0.0), (1, 0.0)])], "b"),  # lowest highest priority first
        ([("a", [(3, 0.0), (3, 0.0)]), ("b", [(3, 0.0), (1, 0.0)])], "b"),  # then lowest sum
        ([("a", [(-5, 0.0), (-5, 0.0)]), ("b", [(-5, 0.0)])], "b"),  # negative priorities sum sensibly
        ([("a", [(2, 0.0), (0, 0.0)]), ("b", [(2, 0.0)])], "b"),  # each victim adds 2^31 to the sum: fewer wins
        ([("a", [(2, 10.0)]), ("b", [(2, 20.0)])], "b"),  # then the latest started (least work lost)
        ([("a", [(2, 20.0)]), ("b", [(2, 20.0)])], "a"),  # full tie: the first
    ],
)
def test_pick_node(nodes: list[tuple[str, list[tuple[int, float]]]], expected: str) -> None:
    best = pick_node(found_on(name, victims) for name, victims in nodes)
    assert best is not None and best.node_name == expected


def test_pick_node_counts_gang_members_elsewhere() -> None:
    gang = found_on("a", [(1, 0.0)], ((1, 0.0), (1, 0.0)))
    assert pick_node([gang, found_on("b", [(1, 0.0), (1, 0.0)])]).node_name == "b"  # type: ignore[union-attr]
    assert pick_node([]) is None


GPU = ("a100", "nvidia.com/gpu")


@pytest.mark.parametrize(("gpus", "expected"), [(1, ["b3"]), (2, ["b3", "b2"]), (3, None)])
def test_reclaim_takes_only_what_the_queue_borrows(gpus: int, expected: list[str] | None) -> None:
    """team-b has a nominal quota of 2 GPUs and runs 4 here (borrowing 2); team-a, within its nominal quota,
    reclaims: at most the 2 borrowed GPUs, the most recently started first. b's pods within its quota stay."""
    node = new_node(gpus=4)
    preemptor = PodFacts("me", 0, 100.0, "team-a")
    queues = QueueSnapshot(preemption={"team-a": Preemption(reclaim_within_cohort="Any")},
                           cohort_root={"team-a": "ai", "team-b": "ai"}, borrowed={"team-b": {GPU: 2}},
                           needs={GPU: gpus})
    candidates = []
    for i in range(4):
        allowed = may_preempt(preemptor, PodFacts(f"b{i}", 0, float(i), "team-b"), queues).allowed
        candidate = hold(node, f"b{i}", 0, float(i), [(i, A100_MIB, 100)], allowed=allowed)
        candidates.append(replace(candidate, cluster_queue="team-b", charge=((GPU, 1),)))
    found = find_victims(node, request(gpus=gpus, cores=100), candidates, BINPACK, BINPACK,
                         reclaimable=reclaimable(preemptor, queues))
    if expected is None:
        assert isinstance(found, NoVictims)
        assert "2 kept as their queue would no longer borrow" in found.reason, found.reason
    else:
        assert uids(found) == expected


def test_a_borrowing_gang_is_taken_whole_while_its_queue_borrows() -> None:
    node = new_node()
    member = replace(hold(node, "g-0", 0, 1.0, [(0, A100_MIB, 100)], gang="g"), cluster_queue="team-b",
                     charge=((GPU, 1),))
    elsewhere = [GangMember("g-1", 0, 1.0, cluster_queue="team-b", charge=((GPU, 1),))]
    found = find_victims(node, request(cores=100), [member], BINPACK, BINPACK, gangs={"g": elsewhere},
                         reclaimable={"team-b": {GPU: 1}})
    assert isinstance(found, Victims) and found.count == 2  # Kueue takes a whole workload while its queue borrows
    spent = find_victims(node, request(cores=100), [member], BINPACK, BINPACK, gangs={"g": elsewhere},
                         reclaimable={"team-b": {GPU: 0}})
    assert isinstance(spent, NoVictims)


def test_reclaimable_lists_only_cohort_queues_and_needed_resources() -> None:
    queues = QueueSnapshot(cohort_root={"a": "ai", "b": "ai", "c": "other", "d": None},
                           borrowed={"a": {GPU: 1}, "b": {GPU: 2, ("a100", "cpu"): 5}, "c": {GPU: 3}},
                           needs={GPU: 1})
    assert reclaimable(PodFacts("p", 0, 0.0, "a"), queues) == {"b": {GPU: 2}}
    assert reclaimable(PodFacts("p", 0, 0.0, None), queues) == {}
    assert reclaimable(PodFacts("p", 0, 0.0, "d"), queues) == {}
