"""prioritize prepared after filter (issue 19, live cost): the answer the server computes once a filter's reply is
sent, and brings up to date when kube-scheduler asks, is exactly the answer computed when asked, whatever happens in
between (binds of other pods, deletions, heartbeats fresh and expired, host CPU, time, the learned model's
refreshes); it is reused rather than recomputed; and the server's encoded reply equals the HostPriorityList it
stands for."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kube_vgpu.dev.fixtures import gpu_node
from kube_vgpu.extender import scheduler as scheduler_module
from kube_vgpu.extender.cli import Extender, build, parse_args
from kube_vgpu.extender.scheduler import (
    PREPARED_CHANGES_MAX,
    ZERO_SCORES_KEPT_SHARE,
    FilterOutcome,
    Scheduler,
    _Scaling,
)
from kube_vgpu.extender.server import ScoreReplies
from tests.extender.test_node_equivalence import (
    ASKS,
    HARDWARE,
    START_S,
    TTL_S,
    Clock,
    Twin,
    cpu_only_pod,
    hardware_node,
    node_items,
    nodes_strategy,
)
from tests.extender.test_node_equivalence import OpenGate as AnyGate
from tests.helpers import placed_nodes, pod
from tests.servers import serve

changes_strategy = st.lists(
    st.one_of(
        st.tuples(st.just("bind"), st.integers(0, len(ASKS) - 1)),  # another pod's bind (kube-scheduler's async binds)
        st.tuples(st.just("heartbeat"), st.integers(0, 11), st.sampled_from([0.0, 100.0])),
        st.tuples(st.just("time"), st.sampled_from([30.0, 130.0])),
        st.tuples(st.just("delete"), st.integers(0, 200)),
        st.tuples(st.just("cpu"), st.integers(0, 11), st.sampled_from(["1", "3", "20"])),
    ),
    max_size=12,
)
steps_strategy = st.lists(
    # (ask, its CPU, changes, how many of them come between the filter and the preparing: the server prepares after
    # sending the filter's reply, and a bind may be applied in between)
    st.tuples(st.integers(0, len(ASKS) - 1), st.sampled_from(["", "2", "30"]), changes_strategy, st.integers(0, 3)),
    min_size=1, max_size=12,
)


def as_map(answer: tuple[list[str], list[int]]) -> dict[str, int]:
    """A HostPriorityList as kube-scheduler reads it: each host's score, in no order (a prepared answer carried
    over keeps the previous pod's order of the nodes). The hosts are distinct."""
    hosts, scores = answer
    assert len(set(hosts)) == len(hosts)
    return dict(zip(hosts, scores, strict=True))


def place_and_bind(twin: Twin, pending: dict[str, Any], asked: list[str]) -> str | None:
    outcome = twin.scheduler.filter(pending, asked)
    scores = twin.scheduler.prioritize(pending, outcome.passed)
    best = max(scores, key=lambda pair: pair[1])[0] if scores else None
    if best is not None:
        meta = pending["metadata"]
        twin.scheduler.bind(meta["namespace"], meta["name"], meta["uid"], best)
    return best


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(nodes=nodes_strategy, steps=steps_strategy, rotate=st.booleans(), batch=st.booleans())
def test_a_prepared_answer_is_the_answer_computed_when_asked(
    nodes: list[tuple[int, list[int]]], steps: list[tuple[int, str, list[tuple[Any, ...]], int]], rotate: bool,
    batch: bool,
) -> None:
    """One extender: each pod filtered, its answer prepared (after some of the changes, or before all), the changes,
    then prioritize; its answer must be what prioritize computes at that moment with nothing prepared (as
    kube-scheduler reads it: each host's score, in no order). The nodes are asked in the same order every time or
    in another (kube-scheduler's parallel filter plugins): either way the previous pod's prepared answer is carried
    over to the next pod of its shape where the same nodes pass. (Not a twin
    that never prepares: preparing evaluates the shape at another moment, and a node's kept result of an older
    learned model is refreshed a few at a time by filters only, so two such extenders may rightly hold different
    results for a node. The comparison is within one history.)"""
    clock = Clock()
    names = [f"n{index}" for index in range(len(nodes))]
    items: list[dict[str, Any]] = []
    for name, (hardware, running) in zip(names, nodes, strict=True):
        items.extend(node_items(name, hardware, running, START_S))
    extender = Twin(clock, items, True, batch=batch)  # batch: new shapes and outdated models in bfgd's batches
    scheduler = extender.scheduler
    bound: list[str] = []
    for step, (ask, cpu, changes, early) in enumerate(steps):
        count, memory, cores = ASKS[ask]
        pending = pod(f"p{step}", gpus=count, memory_mib=memory, cores=cores)
        if cpu:
            pending["spec"]["containers"][0]["resources"]["requests"]["cpu"] = cpu
        asked = names[step % len(names):] + names[:step % len(names)] if rotate else list(names)
        outcome = scheduler.filter(pending, asked)
        for number, change in enumerate(changes):
            if number == min(early, len(changes)):
                scheduler.prepare_scores(pending, outcome.passed)
            kind = change[0]
            if kind == "bind":
                count, memory, cores = ASKS[change[1]]
                other = pod(f"p{step}-{number}", gpus=count, memory_mib=memory, cores=cores)
                if place_and_bind(extender, other, names) is not None:
                    bound.append(other["metadata"]["uid"])
            elif kind == "heartbeat" and change[1] < len(names):
                extender.state.upsert_node(hardware_node(names[change[1]], nodes[change[1]][0], clock.now - change[2]))
            elif kind == "time":
                clock.now += change[1]
            elif kind == "cpu" and change[1] < len(names):
                extender.state.upsert_pod(cpu_only_pod(f"c{step}-{number}", names[change[1]], change[2]))
            elif kind == "delete" and bound:
                extender.state.delete_pod(bound.pop(change[1] % len(bound)))
        if early >= len(changes):
            scheduler.prepare_scores(pending, outcome.passed)
        answer = scheduler.scaled_scores(pending, outcome.passed)
        scheduler._prepared = None
        assert as_map(answer) == as_map(scheduler.scaled_scores(pending, outcome.passed)), f"step {step}: {changes}"
        if place_and_bind(extender, pending, asked) is not None:
            bound.append(pending["metadata"]["uid"])


@pytest.fixture()
def twin() -> Twin:
    items: list[dict[str, Any]] = []
    for index in range(20):
        items.extend(node_items(f"n{index}", index % len(HARDWARE), [index % 4] * (index % 3), START_S))
    return Twin(Clock(), items, True)


def filtered_and_prepared(twin: Twin, name: str, names: list[str]) -> tuple[dict[str, Any], FilterOutcome,
                                                                             tuple[list[str], list[int]]]:
    """A 1-GPU pod filtered over names and its prioritize answer prepared (which must be)."""
    pending = pod(name, gpus=1, memory_mib=8192, cores=20)
    outcome = twin.scheduler.filter(pending, names)
    made = twin.scheduler.prepare_scores(pending, outcome.passed)
    assert made is not None
    return pending, outcome, made


def count_evaluations(scheduler: Scheduler, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The node count of every _evaluate from now on."""
    sizes: list[int] = []
    evaluate = scheduler._evaluate

    def counting(pod: Any, names: Any, refresh_budget: int = 0) -> Any:
        sizes.append(len(names))
        return evaluate(pod, names, refresh_budget)

    monkeypatch.setattr(scheduler, "_evaluate", counting)
    return sizes


def test_an_unchanged_prepared_answer_is_returned_as_it_is(twin: Twin, monkeypatch: pytest.MonkeyPatch) -> None:
    names = list(twin.state.nodes)
    pending = pod("p", gpus=1, memory_mib=8192, cores=20)
    outcome = twin.scheduler.filter(pending, names)
    assert len(outcome.passed) >= 2
    made = twin.scheduler.prepare_scores(pending, outcome.passed)
    assert made is not None
    evaluations = count_evaluations(twin.scheduler, monkeypatch)
    hosts, scores = twin.scheduler.scaled_scores(pending, list(outcome.passed))  # an equal list, as decoded
    assert hosts is made[0] and scores is made[1]
    assert evaluations == []


def test_a_node_changed_since_is_judged_again_alone(twin: Twin, monkeypatch: pytest.MonkeyPatch) -> None:
    names = list(twin.state.nodes)
    pending, outcome, made = filtered_and_prepared(twin, "p", names)
    # another pod binds onto the best node (kube-scheduler's binding cycle runs beside the next pod's)
    other = pod("other", gpus=1, memory_mib=40000, cores=50)
    best = place_and_bind(twin, other, names)
    assert best in outcome.passed
    evaluations = count_evaluations(twin.scheduler, monkeypatch)
    answer = twin.scheduler.scaled_scores(pending, outcome.passed)
    assert evaluations == [1]  # the changed node, not all of them
    assert answer[1] is not made[1]
    twin.scheduler._prepared = None
    assert as_map(answer) == as_map(twin.scheduler.scaled_scores(pending, outcome.passed))


@pytest.mark.parametrize("shuffled", [False, True])
def test_the_next_pod_of_a_shape_starts_from_the_previous_pods_answer(monkeypatch: pytest.MonkeyPatch,
                                                                      shuffled: bool) -> None:
    """Consecutive pods of one shape asked over the same nodes, in one order or in a new one every pod (as
    kube-scheduler's parallel filter plugins hand them over): each pod's prepared answer is the previous pod's
    with the nodes changed since read again (the previous pod's bind, and the nodes of an older learned model the
    filter re-placed), and equals the scores computed from the shape's answer at that moment. One pod of another
    shape first, then the learned model changes as the pods of this shape double its count (at 2, 4, 8, 16 pods
    seen), and 40 nodes take the filters three turns to re-place."""
    items: list[dict[str, Any]] = []
    for index in range(40):
        items.extend(node_items(f"n{index:02d}", index % len(HARDWARE), [index % 4] * (index % 3), START_S))
    twin = Twin(Clock(), items, True)
    scheduler = twin.scheduler
    names = [f"n{index:02d}" for index in range(40)]
    carried: list[int] = []  # per pod carried over: the refreshed nodes read again
    carry = scheduler._scores_carried_over

    def recording(previous: Any, pending: Any, edit: Any = None) -> Any:
        answered_by = scheduler._answered_by
        result = carry(previous, pending, edit)
        if result is not None and previous is not None and answered_by is not None:
            carried.append(len(answered_by[2].refreshed) - previous.refreshed_position)
        return result

    monkeypatch.setattr(scheduler, "_scores_carried_over", recording)
    epochs = set()
    for number in range(24):
        count, memory, cores = ASKS[5] if number == 0 else ASKS[0]
        pending = pod(f"p{number}", gpus=count, memory_mib=memory, cores=cores)
        asked = random.Random(number).sample(names, len(names)) if shuffled else names
        outcome = scheduler.filter(pending, asked)
        made = scheduler.prepare_scores(pending, outcome.passed)
        assert made is not None
        with scheduler.state.lock:
            passed, raw = scheduler._raw_scores(pending, outcome.passed)
        assert as_map(made) == as_map(_Scaling.of(passed, raw).answer), f"pod {number}"
        epochs.add(scheduler._prepared.epochs if scheduler._prepared else None)
        best = made[0][made[1].index(max(made[1]))] if made[0] else outcome.passed[0]
        meta = pending["metadata"]
        scheduler.bind(meta["namespace"], meta["name"], meta["uid"], best)
    assert len(epochs) >= 3  # the model did change
    assert len(carried) >= 12 and any(carried)  # carried over, refreshed nodes among the changes


def test_other_nodes_as_many_or_a_node_named_twice_are_not_carried_over(twin: Twin) -> None:
    names = sorted(twin.state.nodes)
    first = pod("p", gpus=1, memory_mib=8192, cores=20)
    outcome = twin.scheduler.filter(first, names[:10])
    assert twin.scheduler.prepare_scores(first, outcome.passed) is not None
    second = pod("q", gpus=1, memory_mib=8192, cores=20)
    other = twin.scheduler.filter(second, names[10:])  # as many nodes, others
    assert len(other.passed) == len(outcome.passed)
    made = twin.scheduler.prepare_scores(second, other.passed)
    assert made is not None and set(made[0]) <= set(other.passed)
    with twin.state.lock:
        assert as_map(made) == as_map(_Scaling.of(*twin.scheduler._raw_scores(second, other.passed)).answer)
    third = pod("r", gpus=1, memory_mib=8192, cores=20)
    twice = [*other.passed[:-1], other.passed[0]]  # as many names, one of them twice
    twin.scheduler.filter(third, twice)
    assert twin.scheduler.prepare_scores(third, twice) is None


def test_an_answer_carried_over_in_another_order_is_brought_up_to_date_in_its_own(twin: Twin) -> None:
    """The next pod asks the same nodes in another order (kube-scheduler's parallel filter plugins): its answer
    keeps the previous pod's order, and a change between its filter and its prioritize that scales every node
    again (the node of the highest score alone taken) scales them in that order."""
    names = sorted(twin.state.nodes)
    _, outcome, made = filtered_and_prepared(twin, "p", names)
    second = pod("q", gpus=1, memory_mib=8192, cores=20)
    reordered = list(reversed(names))
    assert twin.scheduler.filter(second, reordered).passed == outcome.passed  # a repeated filter: in its order
    twin.scheduler._last_filters.clear()  # not repeated (as where other nodes changed): the reply in the order asked
    passed = twin.scheduler.filter(second, reordered).passed
    carried = twin.scheduler.prepare_scores(second, passed)
    assert carried is not None and carried[0] == made[0] and passed != outcome.passed  # the first pod's order
    best = carried[0][carried[1].index(max(carried[1]))]
    filler = pod("filler", gpus=1, memory_mib=1024, cores=1)
    twin.scheduler.filter(filler, [best])
    meta = filler["metadata"]
    twin.scheduler.bind(meta["namespace"], meta["name"], meta["uid"], best)
    answer = twin.scheduler.scaled_scores(second, passed)
    twin.scheduler._prepared = None
    assert as_map(answer) == as_map(twin.scheduler.scaled_scores(second, passed))


def test_many_changes_a_new_model_or_a_gate_and_it_is_computed_afresh(twin: Twin,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    names = list(twin.state.nodes)
    pending = pod("p", gpus=1, memory_mib=8192, cores=20)
    outcome = twin.scheduler.filter(pending, names)

    twin.scheduler.prepare_scores(pending, outcome.passed)
    for index in range(PREPARED_CHANGES_MAX + 1):
        twin.state.upsert_pod(cpu_only_pod(f"c{index}", names[index], "1"))
    evaluations = count_evaluations(twin.scheduler, monkeypatch)
    twin.scheduler.scaled_scores(pending, outcome.passed)
    assert evaluations == [len(outcome.passed)]
    assert twin.scheduler._prepared is None

    twin.scheduler.prepare_scores(pending, outcome.passed)
    node_policy = twin.scheduler._prepared.policies[0] if twin.scheduler._prepared else None
    assert node_policy is not None
    monkeypatch.setattr(node_policy, "epoch", lambda: -1)  # the learned model was refreshed
    evaluations.clear()
    twin.scheduler.scaled_scores(pending, outcome.passed)
    assert evaluations == [len(outcome.passed)]

    twin.scheduler.gates = [AnyGate()]
    assert twin.scheduler.prepare_scores(pending, outcome.passed) is None  # its verdicts depend on more than nodes


def test_another_pod_or_other_nodes_are_not_answered_from_it(twin: Twin) -> None:
    names = list(twin.state.nodes)
    pending, outcome, made = filtered_and_prepared(twin, "p", names)
    assert twin.scheduler.scaled_scores(pending, outcome.passed[1:])[1] is not made[1]
    other = pod("q", gpus=1, memory_mib=8192, cores=20)
    twin.scheduler.filter(other, names)
    assert twin.scheduler.scaled_scores(other, outcome.passed)[1] is not made[1]
    assert twin.scheduler.prepare_scores(pending, outcome.passed[:1]) is None  # one node: kube-scheduler scores none
    assert twin.scheduler.prepare_scores(pending, outcome.passed[:2] * 2) is None  # a node named twice


carried_steps_strategy = st.lists(
    # (ask, its CPU, the order's seed, which nodes are asked, the changes before the pod's bind): few shapes, so
    # that consecutive pods often share one and the filter answers from the carried answer's nodes
    st.tuples(st.integers(0, 2), st.sampled_from(["", "2"]), st.integers(0, 1 << 16),
              st.sampled_from(["all", "all", "all", "fewer", "twice"]), changes_strategy),
    min_size=1, max_size=14,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(nodes=nodes_strategy, steps=carried_steps_strategy)
def test_a_filter_over_the_carried_answers_nodes_decides_as_every_node_on_its_own(
    nodes: list[tuple[int, list[int]]], steps: list[tuple[int, str, int, str, list[tuple[Any, ...]]]]
) -> None:
    """A filter over the nodes of the last prepared answer, in another order (kube-scheduler's parallel filter
    plugins), reads only the nodes changed since and replies in that answer's order: it must pass, fail and explain
    exactly the nodes an extender judging every node on its own does, whatever happened in between (binds,
    deletions, heartbeats fresh and expired, host CPU, time, the learned model's refreshes)."""
    clock = Clock()
    names = [f"n{index}" for index in range(len(nodes))]
    items: list[dict[str, Any]] = []
    for name, (hardware, running) in zip(names, nodes, strict=True):
        items.extend(node_items(name, hardware, running, START_S))
    prepared, alone = Twin(clock, items, True), Twin(clock, items, False)
    rejections: tuple[Counter[str], Counter[str]] = (Counter(), Counter())
    for twin, counted in zip((prepared, alone), rejections, strict=True):
        twin.scheduler.on_rejection = counting_into(counted)
    bound: list[str] = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(scheduler_module, "CARRIED_MIN_NODES", 2)  # the few nodes here are a carried answer too
        for step, (ask, cpu, seed, which, changes) in enumerate(steps):
            count, memory, cores = ASKS[ask]
            pending = pod(f"p{step}", gpus=count, memory_mib=memory, cores=cores)
            if cpu:
                pending["spec"]["containers"][0]["resources"]["requests"]["cpu"] = cpu
            asked = random.Random(seed).sample(names, len(names))
            if which == "fewer":
                asked = asked[1:]
            elif which == "twice":
                asked = [*asked[:-1], asked[0]]
            outcome, expected = prepared.scheduler.filter(pending, asked), alone.scheduler.filter(pending, asked)
            assert sorted(outcome.passed) == sorted(expected.passed), f"step {step}"
            assert (outcome.failed, outcome.unresolvable, outcome.error) == (
                expected.failed, expected.unresolvable, expected.error), f"step {step}"
            assert rejections[0] == rejections[1], f"step {step}"  # every node refused counted, by reason
            prepared.scheduler.prepare_scores(pending, outcome.passed)
            for number, change in enumerate(changes):
                apply_on_both(prepared, alone, change, f"{step}-{number}", nodes, bound)
            if bind_on_both(prepared, alone, pending, asked) is not None:
                bound.append(pending["metadata"]["uid"])


def counting_into(counted: Counter[str]) -> Callable[[str, int], None]:
    """An on_rejection hook adding each filter's rejections to counted."""

    def count(code: str, how_many: int) -> None:
        counted[code] += how_many

    return count


def apply_on_both(prepared: Twin, alone: Twin, change: tuple[Any, ...], name: str,
                  nodes: list[tuple[int, list[int]]], bound: list[str]) -> None:
    """One of changes_strategy's changes, on both extenders alike (their clock is one)."""
    kind, names, clock = change[0], list(alone.state.node_order.rank), alone.state.clock
    assert isinstance(clock, Clock)
    if kind == "bind":
        count, memory, cores = ASKS[change[1]]
        other = pod(f"p{name}", gpus=count, memory_mib=memory, cores=cores)
        if bind_on_both(prepared, alone, other, names) is not None:
            bound.append(other["metadata"]["uid"])
    elif kind == "time":
        clock.now += change[1]
    elif kind == "delete" and bound:
        uid = bound.pop(change[1] % len(bound))
        for twin in (prepared, alone):
            twin.state.delete_pod(uid)
    elif kind in ("heartbeat", "cpu") and change[1] < len(names):
        for twin in (prepared, alone):
            if kind == "heartbeat":
                twin.state.upsert_node(hardware_node(f"n{change[1]}", nodes[change[1]][0], clock.now - change[2]))
            else:
                twin.state.upsert_pod(cpu_only_pod(f"c{name}", f"n{change[1]}", change[2]))


def bind_on_both(prepared: Twin, alone: Twin, pending: dict[str, Any], asked: list[str]) -> str | None:
    """The pod filtered on both extenders and bound on both to the node the one judging alone scores best (the
    highest score, then the first name: one choice whatever order each replies in)."""
    passed = prepared.scheduler.filter(pending, asked).passed
    expected = alone.scheduler.filter(pending, asked).passed
    assert sorted(passed) == sorted(expected)
    scores = alone.scheduler.prioritize(pending, expected)
    if not scores:
        return None
    best = min(scores, key=lambda pair: (-pair[1], pair[0]))[0]
    meta = pending["metadata"]
    for twin in (prepared, alone):
        twin.scheduler.bind(meta["namespace"], meta["name"], meta["uid"], best)
    return best


def test_a_new_shape_is_walked_and_answered_in_the_states_order_of_its_nodes() -> None:
    """kube-scheduler names the nodes in a new order every pod: a new request shape's nodes are judged, and passed,
    in the order the state holds them (NodeOrder), whatever the order asked; the next pod of the shape is answered
    in the same order; a few nodes, or the nodes of a shape already answered, stay as asked."""
    items: list[dict[str, Any]] = []
    names = [f"n{index:02d}" for index in range(40)]
    for index, name in enumerate(names):
        items.extend(node_items(name, index % len(HARDWARE), [index % 4] * (index % 3), START_S))
    twin = Twin(Clock(), items, True)
    in_state = list(twin.state.node_order.rank)
    assert sorted(in_state) == names
    asked = random.Random(7).sample(names, len(names))
    first = pod("p", gpus=1, memory_mib=8192, cores=20)
    outcome = twin.scheduler.filter(first, asked)
    assert len(outcome.passed) >= 2 and outcome.passed == [name for name in in_state if name in outcome.passed]
    assert twin.scheduler.prepare_scores(first, outcome.passed) is not None
    second = pod("q", gpus=1, memory_mib=8192, cores=20)
    assert twin.scheduler.filter(second, random.Random(8).sample(names, len(names))).passed == outcome.passed
    few = asked[:5]
    other = pod("r", gpus=1, memory_mib=1024, cores=1)  # a new shape over a few nodes
    passed = twin.scheduler.filter(other, few).passed
    assert passed and passed == [name for name in few if name in passed]


def test_a_filter_over_the_carried_answers_nodes_reads_only_those_changed(twin: Twin,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The next pod of a shape asks the same nodes in another order: the filter replies in the prepared answer's
    order, judging again only the node a bind changed; a node the binds filled is left out of it, and the nodes
    asked twice are judged as asked."""
    monkeypatch.setattr(scheduler_module, "CARRIED_MIN_NODES", 2)  # the fixture's 20 nodes are a carried answer
    names = sorted(twin.state.nodes)
    _, outcome, made = filtered_and_prepared(twin, "p", names)
    assert twin.scheduler._carry is not None and twin.scheduler._carry.order == outcome.passed
    order = outcome.passed
    placed = placed_nodes(monkeypatch)
    best = made[0][made[1].index(max(made[1]))]
    filler = pod("filler", gpus=1, memory_mib=1024, cores=1)  # a small pod: the node still fits the shape
    twin.scheduler.filter(filler, [best])
    twin.scheduler.bind("default", filler["metadata"]["name"], filler["metadata"]["uid"], best)
    placed.clear()
    second = pod("q", gpus=1, memory_mib=8192, cores=20)
    passed = twin.scheduler.filter(second, list(reversed(names))).passed
    assert passed == order and passed is not order  # the carried order, in a list of its own
    assert placed == [best]
    assert twin.scheduler.prepare_scores(second, passed) is not None

    full = order[len(order) // 2]
    for number in range(64):  # pods of the shape onto one node until it takes no more
        hog = pod(f"hog{number}", gpus=1, memory_mib=8192, cores=20)
        if not twin.scheduler.filter(hog, [full]).passed:
            break
        twin.scheduler.bind("default", hog["metadata"]["name"], hog["metadata"]["uid"], full)
    third = pod("r", gpus=1, memory_mib=8192, cores=20)
    refused = twin.scheduler.filter(third, random.Random(3).sample(names, len(names)))
    assert refused.passed == [name for name in order if name != full] and full in refused.failed

    fourth = pod("s", gpus=1, memory_mib=8192, cores=20)
    assert twin.scheduler.prepare_scores(third, refused.passed) is not None
    twice = [*reversed(refused.passed[1:]), refused.passed[1]]  # as many names as the answer's, one twice
    assert twin.scheduler.filter(fourth, twice).passed == twice  # as asked


@pytest.mark.parametrize("hosts", [[], ["n0"], ["node-1", "node-2", "node-3"], ['odd"name\\', "ünïcode"]])
def test_the_encoded_reply_is_the_host_priority_list(hosts: list[str]) -> None:
    replies = ScoreReplies()
    scores = [(7 * index) % 11 for index in range(len(hosts))]
    for _ in range(2):  # encoded heads, then kept ones
        body = replies.encode(hosts, scores, known_nodes=len(hosts))
        assert orjson.loads(body) == [{"Host": host, "Score": score} for host, score in zip(hosts, scores,
                                                                                               strict=True)]


@settings(max_examples=200, deadline=None)
@given(hosts=st.lists(st.sampled_from(["n1", "n10", "n100", 'odd"n1', "ünï", "n2", "x"]), max_size=12),
       first=st.lists(st.integers(0, 10), min_size=12, max_size=12),
       changes=st.lists(st.tuples(st.integers(0, 11), st.integers(0, 10)), max_size=12),
       same_list=st.booleans(), appended=st.sampled_from(["", "n1", "new"]), renamed=st.sampled_from(["", "n1", "o"]))
def test_a_reply_from_the_kept_layout_is_the_host_priority_list(
    hosts: list[str], first: list[int], changes: list[tuple[int, int]], same_list: bool, appended: str, renamed: str
) -> None:
    """A reply for the same hosts (the list itself, or an equal one as decoded) with other scores is the kept
    layout with those scores written in; hosts changed in place or another list get a layout of their own. Names
    that are prefixes of others, escaped names, hosts named twice, scores of one and two digits."""
    replies = ScoreReplies()
    scores = first[: len(hosts)]
    replies.encode(hosts, scores, known_nodes=len(hosts))
    changed = scores.copy()
    for position, score in changes:
        if position < len(changed):
            changed[position] = score
    asked = hosts if same_list else list(hosts)
    if renamed and asked:
        asked[0] = renamed  # in place, where it is the same list
    if appended:
        asked.append(appended)  # in place, where it is the same list
        changed.append(3)
    body = replies.encode(asked, changed, known_nodes=len(asked))
    assert orjson.loads(body) == [{"Host": host, "Score": score} for host, score in zip(asked, changed, strict=True)]
    assert body == ScoreReplies().encode(asked, changed, known_nodes=len(asked))


@pytest.mark.parametrize("score", [-1, 11])
def test_a_score_kube_scheduler_does_not_accept_is_refused(score: int) -> None:
    with pytest.raises(ValueError, match="0-10"):
        ScoreReplies().encode(["n0", "n1"], [5, score], known_nodes=2)


def test_the_kept_heads_stay_about_as_many_as_the_nodes() -> None:
    replies = ScoreReplies()
    for batch in range(10):
        hosts = [f"gone-{batch}-{index}" for index in range(1000)]
        replies.encode(hosts, [1] * len(hosts), known_nodes=100)
    assert len(replies._heads) <= 2 * 100 + 1024 + 1000


@pytest.fixture()
def extender(tmp_path: Path) -> Extender:
    nodes = [gpu_node(f"node-{index}", gpus=2 + 2 * (index % 3), memory_mib=40960 * (1 + index % 2),
                      topology="nvswitch") for index in range(6)]
    path = tmp_path / "snapshot.json"
    path.write_bytes(orjson.dumps({"apiVersion": "v1", "kind": "List", "items": nodes}))
    return build(parse_args(["--snapshot", str(path)]))


@pytest.fixture()
def client(extender: Extender) -> Iterator[httpx.Client]:
    with serve(extender.app) as url, httpx.Client(base_url=url, timeout=10) as http:
        yield http


def test_over_http_prioritize_answers_from_what_the_filter_prepared(
    client: httpx.Client, extender: Extender, monkeypatch: pytest.MonkeyPatch
) -> None:
    """kube-scheduler's order: pod n's filter, pod n-1's bind (its binding cycle runs beside the next pod's
    scheduling cycle), pod n's prioritize. The reply is what prioritize computes when asked, every time."""
    names = [f"node-{index}" for index in range(6)]
    scheduler = extender.scheduler
    prepared: list[Any] = []
    prepare = scheduler.prepare_scores

    def recording(pod: Any, passed: list[str]) -> Any:
        made = prepare(pod, passed)
        prepared.append(made)
        return made

    monkeypatch.setattr(scheduler, "prepare_scores", recording)
    to_bind: tuple[dict[str, Any], str] | None = None
    for number in range(6):
        pending = pod(f"p{number}", gpus=1, memory_mib=10000 * (1 + number % 3), cores=10)
        passed = client.post("/filter", json={"Pod": pending, "NodeNames": names}).json()["NodeNames"]
        if to_bind is not None:
            meta = to_bind[0]["metadata"]
            assert client.post("/bind", json={"PodName": meta["name"], "PodNamespace": meta["namespace"],
                                              "PodUID": meta["uid"], "Node": to_bind[1]}).json() == {"Error": ""}
        reply = client.post("/prioritize", json={"Pod": pending, "NodeNames": passed}).json()
        scheduler._prepared = None
        assert {entry["Host"]: entry["Score"] for entry in reply} == dict(scheduler.nonzero_scores(pending, passed))
        assert len(reply) == len({entry["Host"] for entry in reply})
        to_bind = (pending, max(reply, key=lambda entry: entry["Score"])["Host"] if reply else passed[0])
    # nothing is prepared until kube-scheduler is seen asking prioritize at all; then every filter prepares
    assert len(prepared) == 5 and all(made is not None for made in prepared)


@pytest.mark.parametrize(("raw", "expected"), [
    # a quarter of the nodes at 0, or fewer: every node (a 0 adds what a missing node adds to kube-scheduler)
    ([0.0, 0.0, 50.0, 60.0, 70.0, 80.0, 90.0, 100.0], [0, 0, 5, 6, 7, 8, 9, 10]),
    # more: left out (a burst onto an empty cluster: most nodes at 0, a reply of a few)
    ([10.0, 50.0, 100.0], [None, 4, 10]),
    ([0.0, 0.0, 0.0, 60.0, 70.0, 80.0, 90.0, 100.0], [None, None, None, 6, 7, 8, 9, 10]),
    ([5.0] * 8, [None] * 8),  # all equal: nothing to prefer
])
def test_the_nodes_at_0_are_kept_while_few(raw: list[float], expected: list[int | None]) -> None:
    assert ZERO_SCORES_KEPT_SHARE == 0.25  # the cases' shares: 2 of 8 kept; 1 of 3 and 3 of 8 left out
    names = [f"n{index}" for index in range(len(raw))]
    hosts, scores = _Scaling.of(names, np.array(raw)).answer
    assert dict(zip(hosts, scores, strict=True)) == {
        name: score for name, score in zip(names, expected, strict=True) if score is not None}


@settings(max_examples=400, deadline=None)
@given(raw=st.lists(st.sampled_from([0.0, 12.5, 40.0, 50.0, 50.25, 61.0, 99.5, 100.0]), min_size=1, max_size=8),
       changes=st.lists(st.tuples(st.integers(0, 7), st.one_of(st.sampled_from([0.0, 2.0, 4.0, 12.5, 50.0]),
                                                              st.floats(-10.0, 110.0, allow_nan=False))),
                        max_size=6))
def test_one_node_rescored_is_all_scaled_again(raw: list[float], changes: list[tuple[int, float]]) -> None:
    """_Scaling.rescore, where it changes one node's scaled score alone, gives what scaling every node again gives
    (nodes falling to 0 or rising from it while the zeros are few enough to be kept among the hosts); where it
    cannot (the lowest or highest moves, a node joins or leaves the hosts), it says so."""
    names = [f"n{index}" for index in range(len(raw))]
    values = np.array(raw)
    scaling = _Scaling.of(names, values)
    hosts = scaling.answer[0]
    for position, new in changes:
        if position >= len(names):
            continue
        old, values[position] = float(values[position]), new
        if old == new:
            continue
        if not scaling.rescore(values, position, old):
            scaling = _Scaling.of(names, values)
            hosts = scaling.answer[0]
            continue
        assert scaling.answer == _Scaling.of(names, values).answer
        assert scaling.answer[0] is hosts  # the hosts list kept (a reply for it keeps its layout: ScoreReplies)


def test_a_filter_of_no_node_leaves_the_shapes_last_filter_to_repeat(twin: Twin,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """kube-scheduler never asks an extender about no node, but a client may (the bench's baseline asks with the
    same pod before each filter; learning callers observe pods so): such a filter says nothing of the nodes the last
    one asked, and the next filter of the shape still repeats that one's outcome, judging no node."""
    names = [*sorted(twin.state.nodes), "ghost"]

    def four_gpus(name: str) -> dict[str, Any]:
        return pod(name, gpus=4, memory_mib=10240, cores=10)

    first = twin.scheduler.filter(four_gpus("p"), names)
    assert first.passed and first.failed
    placed = placed_nodes(monkeypatch)
    empty = twin.scheduler.filter(four_gpus("q"), [])
    assert empty.passed == [] and empty.failed == {} and not empty.error
    second = twin.scheduler.filter(four_gpus("q"), random.Random(2).sample(names, len(names)))
    assert placed == [] and second.passed is first.passed and second.failed == first.failed


def test_a_repeated_filter_judges_again_only_the_nodes_changed_since(twin: Twin,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The next pod of a shape asks the nodes the last filter asked, in another order, some of which cannot take
    it: the filter repeats the last outcome, its passing list itself and every refusal with its reason, counted
    again, judging no node; a node a bind fills moves from the passing list to the refused, and back once freed,
    judged alone each time; a node whose heartbeat is stale is judged every time (its reason tells the age), and a
    node the extender does not know stays refused."""
    names = [*sorted(twin.state.nodes), "ghost"]
    counted: Counter[str] = Counter()
    twin.scheduler.on_rejection = counting_into(counted)
    clock = twin.state.clock
    assert isinstance(clock, Clock)
    stale = "n5"
    twin.state.upsert_node(hardware_node(stale, 5 % len(HARDWARE), clock.now - TTL_S - 10))

    def four_gpus(name: str) -> dict[str, Any]:
        return pod(name, gpus=4, memory_mib=10240, cores=10)

    first = twin.scheduler.filter(four_gpus("p"), names)
    assert first.passed and first.unresolvable and len(first.failed) >= 2
    assert first.failed["ghost"].startswith("not known") and first.failed[stale].endswith("(last heartbeat 130 s ago)")
    once = counted.copy()
    assert once["stale"] == 1 and sum(once.values()) == len(first.failed) + len(first.unresolvable) - 1  # not ghost

    placed = placed_nodes(monkeypatch)
    clock.now += 5
    second = twin.scheduler.filter(four_gpus("q"), random.Random(1).sample(names, len(names)))
    assert placed == [] and second.passed is first.passed
    assert second.unresolvable == first.unresolvable
    assert second.failed == {**first.failed, stale: "GPU inventory stale (last heartbeat 135 s ago)"}
    assert counted == once + once

    filled = first.passed[0]
    hogs: list[str] = []
    for number in range(8):  # 4-GPU pods of another shape onto one node until it takes no more
        hog = pod(f"hog{number}", gpus=4, memory_mib=20480, cores=10)
        if not twin.scheduler.filter(hog, [filled]).passed:
            break
        twin.scheduler.bind("default", hog["metadata"]["name"], hog["metadata"]["uid"], filled)
        hogs.append(hog["metadata"]["uid"])
    placed.clear()
    third = twin.scheduler.filter(four_gpus("r"), list(reversed(names)))
    assert placed == [filled] and third.passed == first.passed[1:] and filled in third.failed
    assert {name: third.failed[name] for name in first.failed} == second.failed

    assert hogs
    for uid in hogs:
        twin.state.delete_pod(uid)
    placed.clear()
    fourth = twin.scheduler.filter(four_gpus("s"), names)
    # (judged alone: as its state is again the one placed first, its node-equivalence class's result answers)
    assert set(placed) <= {filled} and fourth.passed == [*first.passed[1:], filled]
    assert fourth.failed == {**second.failed, stale: "GPU inventory stale (last heartbeat 135 s ago)"}


@pytest.mark.parametrize("shuffled", [False, True])
def test_an_answer_is_carried_over_when_a_few_nodes_leave_or_join_the_passing_ones(monkeypatch: pytest.MonkeyPatch,
                                                                                   shuffled: bool) -> None:
    """Whole-GPU pods onto 2-GPU nodes: every second bind fills a node, which then leaves the passing nodes, and a
    deleted pod brings its node back. The next pod's prepared answer is the previous one less the node gone, plus
    the node back (_PassesEdit): not looked up afresh over every node, and every time equal to the scores computed
    from the shape's answer at that moment; the server's reply for it is its layout edited, equal to one laid out
    afresh."""
    items: list[dict[str, Any]] = []
    for index in range(40):
        items.extend(node_items(f"n{index:02d}", 0, [], START_S))  # HARDWARE[0]: 2 GPUs
    twin = Twin(Clock(), items, True)
    scheduler = twin.scheduler
    names = [f"n{index:02d}" for index in range(40)]
    afresh: list[int] = []
    filtered_scores = scheduler._filtered_scores

    def counting(pending: Any, passed: Any) -> Any:
        afresh.append(len(passed))
        return filtered_scores(pending, passed)

    monkeypatch.setattr(scheduler, "_filtered_scores", counting)
    replies = ScoreReplies()
    laid_out: list[int] = []
    lay_out = replies._lay_out

    def counting_layouts(hosts: list[str], known_nodes: int) -> Any:
        laid_out.append(len(hosts))
        return lay_out(hosts, known_nodes)

    monkeypatch.setattr(replies, "_lay_out", counting_layouts)
    changes: list[tuple[set[str], list[str]]] = []
    bound: list[str] = []
    for number in range(30):
        if number % 5 == 4:  # a pod leaves: its node passes again
            twin.state.delete_pod(bound.pop(number % len(bound)))
        pending = pod(f"p{number}", gpus=1, memory_mib=81920, cores=100)
        asked = random.Random(number).sample(names, len(names)) if shuffled else names
        outcome = scheduler.filter(pending, asked)
        afresh.clear()
        laid_out.clear()
        made = scheduler.prepare_scores(pending, outcome.passed)
        assert made is not None
        with scheduler.state.lock:
            passed, raw = scheduler._raw_scores(pending, outcome.passed)
        assert as_map(made) == as_map(_Scaling.of(passed, raw).answer), f"pod {number}"
        body = replies.encode(*made, known_nodes=40, change=scheduler.prepared_change)
        assert body == ScoreReplies().encode(*made, known_nodes=40)
        if scheduler.prepared_change is not None:
            changes.append(scheduler.prepared_change)
            assert afresh == [] and laid_out == [], f"pod {number}"
        assert scheduler.scaled_scores(pending, outcome.passed) == made  # prioritize: the prepared answer
        best = made[0][made[1].index(max(made[1]))] if made[0] else outcome.passed[0]
        meta = pending["metadata"]
        scheduler.bind(meta["namespace"], meta["name"], meta["uid"], best)
        bound.append(meta["uid"])
    assert any(gone for gone, _ in changes) and any(new for _, new in changes)
    assert len(changes) >= 10


@settings(max_examples=300, deadline=None)
@given(hosts=st.lists(st.sampled_from(["n1", "n10", "n100", 'odd"n1', "ünï", "n2", "x", "y", "z"]), min_size=1,
                      max_size=9, unique=True),
       scores=st.lists(st.integers(0, 10), min_size=12, max_size=12),
       removed=st.sets(st.integers(0, 8), max_size=4),
       added=st.lists(st.sampled_from(["a", "n1", "new", "ünï2", 'q"']), max_size=3, unique=True),
       hint=st.sampled_from(["right", "more", "fewer", "none"]))
def test_a_layout_edited_for_hosts_left_out_and_added_is_the_one_laid_out_afresh(
    hosts: list[str], scores: list[int], removed: set[int], added: list[str], hint: str
) -> None:
    """The hosts of the last reply less some (first, middle, last, all), then some added at the end: the reply
    edited from the kept layout is byte for byte the one laid out afresh, with the right hint (the layout edited) or
    a wrong one (a host not left out, one more or fewer: laid out afresh); hosts named twice included."""
    replies = ScoreReplies()
    replies.encode(hosts, scores[: len(hosts)], known_nodes=12)
    gone = {hosts[position] for position in removed if position < len(hosts)}
    asked = [host for host in hosts if host not in gone] + added
    if not asked:
        return
    change: tuple[set[str], list[str]] | None = (gone, added)
    if hint == "more":
        change = (gone | {hosts[0]}, added)
    elif hint == "fewer":
        change = (set(list(gone)[1:]), added)
    elif hint == "none":
        change = None
    new_scores = scores[-len(asked):]
    body = replies.encode(asked, new_scores, known_nodes=12, change=change)
    assert body == ScoreReplies().encode(asked, new_scores, known_nodes=12)
    assert orjson.loads(body) == [{"Host": host, "Score": score}
                                  for host, score in zip(asked, new_scores, strict=True)]
    again = [*asked[1:], asked[0]] if len(asked) > 1 else asked  # another order: the kept layout is laid out anew
    assert replies.encode(again, new_scores, known_nodes=12) == ScoreReplies().encode(again, new_scores,
                                                                                      known_nodes=12)
