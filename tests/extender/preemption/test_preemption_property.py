"""A property of preemption as wired into filter (issue 14): for any cluster of running pods and any stream of
preemptors, no victim has a priority the rules do not allow (strictly lower than its preemptor's), a preemptor
whose victims are gone is placed on its nominated node, and no GPU is ever over-committed."""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tests.extender.preemption.test_preemption_flow import GPU_MIB, Env

RUNNING = st.lists(st.tuples(st.integers(0, 2), st.sampled_from([10240, 20480, 40960]), st.integers(0, 3)),
                   min_size=1, max_size=10)
PREEMPTORS = st.lists(st.tuples(st.sampled_from([20480, 40960, 61440, GPU_MIB]), st.integers(0, 4)),
                      min_size=1, max_size=4)


def no_overcommit(env: Env) -> None:
    for node in env.state.nodes.values():
        for gpu in node.gpus:
            assert 0 <= gpu.used_memory_mib <= gpu.memory_mib, (node.name, gpu.used_memory_mib)


@settings(max_examples=300, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(RUNNING, PREEMPTORS)
# found by this property: a preemptor chose a victim already being evicted for another one, whose deletion then
# cleared only one of the two nominations and the other waited for ever (a victim now maps to every preemptor it
# is evicted for, and new decisions leave claimed victims alone: Nominations.claimed)
@example(running=[(0, 10240, 0)] * 5 + [(0, 40960, 1)], preemptors=[(20480, 0), (20480, 1), (61440, 1), (81920, 1)])
def test_victims_are_lower_priority_and_preemptors_land(running: list[tuple[int, int, int]],
                                                      preemptors: list[tuple[int, int]]) -> None:
    env = Env(nodes=3)
    priority_of: dict[str, int] = {}
    for index, (node, memory_mib, priority) in enumerate(running):
        name = f"run-{index}"
        p = env.make(name, memory_mib, priority=priority)
        outcome = env.scheduler.filter(p, [env.names[node]])
        if outcome.passed:
            env.bind(p, outcome.passed[0])
            priority_of[name] = priority
    no_overcommit(env)
    for index, (memory_mib, priority) in enumerate(preemptors):
        name = f"pre-{index}"
        p: dict[str, Any] = env.make(name, memory_mib, priority=priority)
        before = len(env.evictor.requests)
        passed, _ = env.filter(p)
        for request in env.evictor.requests[before:]:
            assert request.preemptor_name == name
            assert priority_of[request.name] < priority, (request.name, priority_of[request.name], priority)
        nomination = env.scheduler.nominations.by_preemptor.get(p["metadata"]["uid"])
        if not passed and nomination is not None and not nomination.waiting_for():
            passed, reasons = env.filter(p)  # victims gone (evicted inline): it must fit where it was nominated
            assert nomination.node_name in passed, reasons
        if passed:
            env.bind(p, passed[0])
            priority_of[name] = priority
        no_overcommit(env)
