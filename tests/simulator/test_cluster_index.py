"""The simulator's indexed choice of node (per-shape boards, no-fit prefilter, GPU-state memo) against the plain
pass over every state: same node, same placement, same random draws, for every policy and both tie-breaks, with
departures (the churn protocol's release) in between. `audit=True` also asks the engine about every state the
prefilter rules out and every answer the GPU-state memo reuses."""

from __future__ import annotations

import random

import pytest

from kube_vgpu.dev.simulator.engine import Cluster
from kube_vgpu.dev.simulator.runner import build_policy, known_policy_names
from kube_vgpu.dev.simulator.trace import NodeSpec, Task
from kube_vgpu.extender.engine.fragmentation import typical_shapes

HARDWARE = [
    (32000, 131072, 4, "T4"),
    (96000, 393216, 8, "V100M32"),
    (16000, 65536, 2, "P100"),
    (64000, 262144, 1, "A10"),
]


def _cluster_and_tasks(seed: int) -> tuple[list[NodeSpec], list[Task]]:
    rng = random.Random(seed)
    nodes = [NodeSpec(f"n{i}", *HARDWARE[rng.randrange(len(HARDWARE))]) for i in range(40)]
    pool = []
    for i in range(60):
        kind = rng.random()
        cpu, memory = rng.choice([1000, 2000, 4000, 8000, 16000]), rng.choice([1024, 4096, 16384])
        spec = rng.choice([(), (), (), ("T4",), ("V100M32", "P100")])
        if kind < 0.2:
            pool.append(Task(f"c{i}", cpu, memory, 0, 0))
        elif kind < 0.65:
            pool.append(Task(f"s{i}", cpu, memory, 1, rng.choice([100, 250, 300, 500, 810]), spec))
        else:
            pool.append(Task(f"w{i}", cpu, memory, rng.choice([1, 1, 2, 4, 8]), 1000, spec))
    return nodes, [rng.choice(pool) for _ in range(220)]


@pytest.mark.parametrize("tie_break", ["order", "random"])
# mutex is a GPU policy only (no node score): it cannot choose nodes, so there is nothing to compare
@pytest.mark.parametrize("name", [name for name in known_policy_names() if name != "mutex"])
def test_indexed_choice_is_the_plain_scan(name: str, tie_break: str) -> None:
    nodes, tasks = _cluster_and_tasks(7)
    shapes = typical_shapes(task.shape for task in tasks)
    plain = Cluster(nodes, build_policy(name, shapes), seed=3, tie_break=tie_break, scan=True)
    indexed = Cluster(nodes, build_policy(name, shapes), seed=3, tie_break=tie_break, audit=True)
    departures = random.Random(5)
    live: list[tuple[int, Task, object]] = []
    for number, task in enumerate(tasks):
        expected, got = plain.place(task), indexed.place(task)
        if expected is None or got is None:
            assert expected is got is None, f"task {number}"
            continue
        assert got[0] == expected[0], f"task {number}: node {got[0]}, the scan chose {expected[0]}"
        assert (got[1].usage, got[1].score) == (expected[1].usage, expected[1].score)
        live.append((expected[0], task, expected[1]))
        if departures.random() < 0.25:
            index, gone, placement = live.pop(departures.randrange(len(live)))
            plain.release(index, gone, placement)  # type: ignore[arg-type]
            indexed.release(index, gone, placement)  # type: ignore[arg-type]
    assert plain.calls >= indexed.calls
