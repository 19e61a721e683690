"""Hypothesis property (issue 14): for random nodes, running pods, priorities and gangs, the victims found are all
allowed (strictly lower priority under plain rules, gangs whole), evicting them makes the preemptor fit per
engine.fit.place, giving any one victim (or gang) back makes it not fit, a "no" means it cannot fit even with every
allowed pod gone, and the caller's node is never changed."""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kube_vgpu.extender.engine.fit import place
from kube_vgpu.extender.engine.model import NodeState, Placement, PlacementRequest
from kube_vgpu.extender.preemption import (
    Candidate,
    GangMember,
    NoVictims,
    PodFacts,
    QueueSnapshot,
    find_victims,
    may_preempt,
)
from tests.extender.preemption.test_victims import BINPACK, GIB, fingerprint, new_node, request

SHAPES = st.tuples(
    st.integers(1, 2),  # GPUs
    st.sampled_from([5, 10, 20, 40, 80]),  # GiB per GPU
    st.sampled_from([0, 30, 50, 100]),  # cores
)
PODS = st.lists(
    st.tuples(SHAPES, st.integers(0, 3), st.integers(0, 100), st.sampled_from([None, None, "g0", "g1", "b", "b"])),
    min_size=2,
    max_size=16,
)
#: the preemptor asks big enough that it rarely fits without evicting anybody
PREEMPTOR_SHAPES = st.tuples(st.integers(1, 2), st.sampled_from([20, 40, 60, 80]), st.sampled_from([0, 50, 100]))
SCENES = st.tuples(
    st.integers(1, 3),
    st.sampled_from(["pcie", "nvlink-pairs"]),
    PODS,
    PREEMPTOR_SHAPES,
    st.sampled_from([1, 2, 3, 4, 4]),  # the preemptor's priority
    st.dictionaries(st.sampled_from(["g0", "g1"]), st.lists(st.integers(0, 3), max_size=2)),  # members elsewhere
    st.one_of(st.none(), st.integers(0, 3)),  # GPUs queue "b" borrows (None: its pods are not bounded)
)
GPU = ("a100", "nvidia.com/gpu")


def shape_request(shape: tuple[int, int, int]) -> PlacementRequest:
    gpus, gib, cores = shape
    return request(gpus=gpus, memory_mib=gib * GIB, cores=cores)


def fits(node: NodeState, req: PlacementRequest, without: list[Candidate]) -> bool:
    work = node.copy()
    for pod in without:
        work.apply_usage(pod.usage, -1)
    return isinstance(place(work, req, BINPACK, BINPACK), Placement)


@settings(max_examples=400, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(SCENES)
def test_victims_are_allowed_sufficient_and_necessary(scene: tuple[Any, ...]) -> None:
    gpus, topology, pods, preemptor_shape, preemptor_priority, elsewhere_priorities, borrowed = scene
    node = new_node(gpus, topology)
    preemptor = PodFacts("me", preemptor_priority, 1000.0)
    queues = QueueSnapshot()
    candidates: list[Candidate] = []
    for i, (shape, priority, whole_s, tag) in enumerate(pods):
        placed = place(node, shape_request(shape), BINPACK, BINPACK)
        if not isinstance(placed, Placement):
            continue  # the node is full for that shape: the pod runs elsewhere
        node.apply_usage(placed.usage, 1)
        started = whole_s + i / 1000  # distinct: the order of removal is then one order
        allowed = may_preempt(preemptor, PodFacts(f"p{i}", priority, started), queues).allowed
        queue, gang = ("b", None) if tag == "b" else (None, tag)
        charge = ((GPU, len(placed.usage)),) if queue else ()
        candidates.append(Candidate(f"p{i}", priority, started, placed.usage, gang, allowed, queue, charge))
    gangs = {
        gang: [GangMember(f"{gang}-x{j}", p, 0.0, may_preempt(preemptor, PodFacts(f"{gang}-x{j}", p, 0.0),
                                                              queues).allowed)
               for j, p in enumerate(priorities)]
        for gang, priorities in elsewhere_priorities.items()
    }
    req = shape_request(preemptor_shape)
    before = fingerprint(node)
    bound = {"b": {GPU: borrowed}} if borrowed is not None else {}
    found = find_victims(node, req, candidates, BINPACK, BINPACK, gangs=gangs, reclaimable=bound)
    assert fingerprint(node) == before

    def gang_ok(c: Candidate) -> bool:
        if c.gang is None:
            return c.allowed
        return all(o.allowed for o in candidates if o.gang == c.gang) and all(m.allowed for m in gangs.get(c.gang, ()))

    def least_important_first(pods: list[Candidate]) -> list[Candidate]:
        return sorted(pods, key=lambda c: (c.priority, -c.started_s))

    def within_bound(pods: list[Candidate]) -> list[Candidate]:
        """The borrowing queue's pods in removal order, each taken only while the queue still borrows."""
        if borrowed is None:
            return pods
        taken: list[Candidate] = []
        for pod in least_important_first(pods):
            if sum(c.charge[0][1] for c in taken) < borrowed:
                taken.append(pod)
        return taken

    if isinstance(found, NoVictims):
        event("no victims make it fit")
        everyone = [c for c in candidates if gang_ok(c) and c.cluster_queue is None]
        everyone += within_bound([c for c in candidates if c.allowed and c.cluster_queue == "b"])
        assert not fits(node, req, everyone), found.reason
        return
    victims = list(found.victims)
    event(f"victims: {min(len(victims), 3)}{'+' if len(victims) >= 3 else ''}")
    event(f"gang members elsewhere: {bool(found.extra)}")
    for victim in victims:
        assert victim.allowed and victim.priority < preemptor_priority
    for member in found.extra:
        assert member.allowed and member.priority < preemptor_priority
    # gangs whole: every member here, and exactly the members elsewhere of the gangs hit
    hit = {v.gang for v in victims if v.gang is not None}
    assert {c.uid for c in candidates if c.gang in hit} <= {v.uid for v in victims}
    assert sorted(m.uid for m in found.extra) == sorted(m.uid for g in hit for m in gangs.get(g, ()))
    from_b = [v for v in victims if v.cluster_queue == "b"]
    assert within_bound(from_b) == least_important_first(from_b)  # none taken once "b" stopped borrowing
    event(f"victims from the borrowing queue: {min(len(from_b), 2)}{'+' if len(from_b) >= 2 else ''}")
    assert fits(node, req, victims)
    units = [[v] for v in victims if v.gang is None] + [[v for v in victims if v.gang == g] for g in hit]
    for unit in units:  # minimal: giving back any one victim (a gang as one) leaves the preemptor unplaced
        assert not fits(node, req, [v for v in victims if v not in unit]), [v.uid for v in unit]
