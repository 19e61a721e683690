"""The arrival generator of METHOD.md step 2: shuffle, inflate to the target, shrink when above."""

from __future__ import annotations

from collections import Counter

from kube_vgpu.dev.simulator.trace import Task, arrival_sequence

CAPACITY = 10 * 1000  # ten GPUs


def tasks(count: int, milli: int = 500, gpus: int = 1) -> list[Task]:
    return [Task(f"t{i}", 1000, 1024, gpus, milli) for i in range(count)]


def test_shuffles_the_whole_trace_first():
    trace = [Task(f"t{i}", 1000 + i, 1024, 1, 100) for i in range(50)]  # 5 GPUs asked, target 13
    order = arrival_sequence(trace, CAPACITY, seed=1, inflate=1.3)
    head = order[: len(trace)]
    assert sorted(head, key=lambda t: t.name) == sorted(trace, key=lambda t: t.name)
    assert head != trace  # shuffled
    assert arrival_sequence(trace, CAPACITY, seed=1) == order  # reproducible per seed
    assert arrival_sequence(trace, CAPACITY, seed=2) != order


def test_inflates_to_the_target_with_draws_from_the_whole_trace():
    trace = [*tasks(6, milli=1000), Task("cpu", 4000, 1024, 0, 0)]  # 6 GPUs of 10
    order = arrival_sequence(trace, CAPACITY, seed=3, inflate=1.3)
    total = sum(t.gpu_milli_total for t in order)
    assert 13_000 - 1000 < total <= 13_000
    assert set(order) <= set(trace)
    assert Counter(order)[trace[0]] >= 1


def test_shrinks_when_the_trace_asks_more():
    trace = tasks(40, milli=1000)  # 40 GPUs asked, target 13
    order = arrival_sequence(trace, CAPACITY, seed=4, inflate=1.3)
    assert sum(t.gpu_milli_total for t in order) <= 13_000
    assert len(order) == 13
    assert len(set(order)) == len(order)  # removal, not resampling


def test_cpu_only_trace_is_not_inflated_forever():
    trace = [Task("cpu", 4000, 1024, 0, 0)]
    assert arrival_sequence(trace, CAPACITY, seed=5) == trace
