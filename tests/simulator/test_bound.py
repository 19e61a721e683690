"""The ceiling: an upper bound on allocated GPU that no placement can beat (kube_vgpu.dev.simulator.bound)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from fractions import Fraction

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kube_vgpu.cli import main
from kube_vgpu.dev.simulator.bound import (
    cpu_rich_first,
    dff,
    node_classes,
    offline_order,
    offline_packing,
    prefix_through,
    upper_bound,
)
from kube_vgpu.dev.simulator.engine import simulate
from kube_vgpu.dev.simulator.metrics import curve
from kube_vgpu.dev.simulator.trace import NodeSpec, Task
from kube_vgpu.extender.engine.policies import make_policy, policy_names

MODELS = ("T4", "P100")


def brute_force(nodes: Sequence[NodeSpec], tasks: Sequence[Task]) -> int:
    """The best packing of any subset of `tasks` (METHOD.md's fit rules), by exhaustive search."""
    cpu = [n.cpu_milli for n in nodes]
    mem = [n.memory_mib for n in nodes]
    gpus = [[1000] * n.gpu_count for n in nodes]
    best = 0

    def search(index: int, allocated: int) -> None:
        nonlocal best
        best = max(best, allocated)
        remaining = sum(t.gpu_milli_total for t in tasks[index:])
        if index == len(tasks) or allocated + remaining <= best:
            return
        task = tasks[index]
        for n, spec in enumerate(nodes):
            if cpu[n] < task.cpu_milli or mem[n] < task.memory_mib:
                continue
            if task.gpu_spec and spec.model not in task.gpu_spec:
                continue
            cpu[n] -= task.cpu_milli
            mem[n] -= task.memory_mib
            if task.gpu_count == 0:
                search(index + 1, allocated)
            elif task.gpu_milli < 1000:
                for g, free in enumerate(gpus[n]):
                    if free >= task.gpu_milli:
                        gpus[n][g] -= task.gpu_milli
                        search(index + 1, allocated + task.gpu_milli)
                        gpus[n][g] += task.gpu_milli
            else:
                idle = [g for g, free in enumerate(gpus[n]) if free == 1000]
                if len(idle) >= task.gpu_count:  # idle GPUs of a node are interchangeable
                    taken = idle[: task.gpu_count]
                    for g in taken:
                        gpus[n][g] = 0
                    search(index + 1, allocated + task.gpu_milli_total)
                    for g in taken:
                        gpus[n][g] = 1000
            cpu[n] += task.cpu_milli
            mem[n] += task.memory_mib
        search(index + 1, allocated)  # or drop it

    search(0, 0)
    return best


def task(cpu: int, gpus: int, milli: int, spec: tuple[str, ...] = (), mem: int = 1024) -> Task:
    return Task(f"t{cpu}-{gpus}-{milli}", cpu, mem, gpus, milli if gpus else 0, spec)


@pytest.mark.parametrize(
    ("nodes", "tasks", "optimum"),
    [
        # three 600s on two GPUs: two fit; the per-GPU packing row (a share > 500 takes a GPU) says so exactly
        ([NodeSpec("a", 32000, 65536, 2, "T4")], [task(1000, 1, 600)] * 3, 1200),
        # 700 + 300 on one GPU, a 400 left over that fits nowhere
        ([NodeSpec("a", 32000, 65536, 1, "T4")], [task(1000, 1, 700), task(1000, 1, 400), task(1000, 1, 300)], 1000),
        # a 2-GPU task only on the 2-GPU node; the model constraint keeps the P100-only task off the T4s
        (
            [NodeSpec("a", 32000, 65536, 2, "T4"), NodeSpec("b", 32000, 65536, 1, "P100")],
            [task(1000, 2, 1000), task(1000, 1, 1000, ("P100",)), task(1000, 1, 1000, ("P100",))],
            3000,
        ),
        # memory: each task needs the whole node's memory
        ([NodeSpec("a", 32000, 4096, 2, "T4")], [task(1000, 1, 1000, mem=4096)] * 2, 1000),
        # a task larger than any node, and CPU-only tasks, add nothing
        ([NodeSpec("a", 8000, 65536, 2, "T4")], [task(9000, 1, 1000), task(1000, 0, 0)], 0),
    ],
)
def test_bound_equals_the_optimum_on_hand_made_clusters(nodes, tasks, optimum):
    assert brute_force(nodes, tasks) == optimum
    assert upper_bound(nodes, tasks).bound_milli == optimum


def test_bound_is_above_the_optimum_where_the_relaxation_splits_a_task():
    # two whole-GPU tasks of 6 cores on an 8-core node: one fits; the LP takes 8/6 of a task
    nodes = [NodeSpec("a", 8000, 65536, 2, "T4")]
    tasks = [task(6000, 1, 1000)] * 2
    assert brute_force(nodes, tasks) == 1000
    bound = upper_bound(nodes, tasks)
    assert bound.bound_milli == Fraction(4000, 3)
    assert bound.pct == pytest.approx(66.666667, abs=1e-6) and bound.pct >= float(Fraction(400, 6))


def test_offline_packing_goes_largest_first_and_beats_the_arrival_order():
    # in arrival order the 300s spread and block the 800s; largest first packs 800 + 200 twice
    nodes = [NodeSpec("a", 32000, 65536, 2, "T4")]
    tasks = [task(1000, 1, 300), task(1000, 1, 300), task(1000, 1, 800), task(1000, 1, 800), task(1000, 1, 200),
             task(1000, 1, 200), task(1000, 0, 0)]
    assert [t.gpu_milli for t in offline_order(tasks)] == [800, 800, 300, 300, 200, 200]
    assert simulate(nodes, tasks, make_policy("spread"), seed=0).allocated_milli[-1] == 1000  # 300+200 twice
    assert offline_packing(nodes, tasks, lambda: make_policy("bestfit")) == 2000 == brute_force(nodes, tasks)
    assert upper_bound(nodes, tasks).bound_milli == 2000


def test_cpu_rich_first_sends_cpu_hungry_tasks_to_cpu_rich_nodes():
    # an 8-core and a 32-core node of one GPU each: if the 4-core task took the big node, the 30-core one would
    # fit nowhere; CPU-rich first places the 30-core task first, on the big node, and the 4-core one on the small
    nodes = [NodeSpec("small", 8000, 65536, 1, "T4"), NodeSpec("big", 32000, 65536, 1, "T4")]
    tasks = [task(4000, 1, 1000), task(30000, 1, 1000)]
    assert cpu_rich_first(nodes, tasks, lambda: make_policy("bestfit")) == 2000 == brute_force(nodes, tasks)


def test_dual_feasible_functions_sum_to_at_most_one_gpu():
    # every way to fill one GPU with shares: f_e sums to <= 1000 for each threshold
    for threshold in (500, 334, 250, 200):
        for shares in ([600, 400], [501, 499], [500, 500], [334, 333, 333], [250] * 4, [200] * 5, [999, 1]):
            assert sum(dff(s, threshold) for s in shares) <= 1000, (threshold, shares)


def test_node_classes_group_identical_nodes():
    nodes = [NodeSpec(f"n{i}", 8000, 1024, 2, "T4") for i in range(3)] + [NodeSpec("p", 8000, 1024, 2, "P100")]
    classes = node_classes(nodes)
    assert sorted((c.model, c.count) for c in classes) == [("P100", 1), ("T4", 3)]


def test_prefix_through_ends_at_the_last_event_of_the_bucket():
    # capacity 2000: arrived 50, 100, 100 (a CPU-only task), 150, 200 %
    tasks = [task(1000, 1, 1000), task(1000, 1, 1000), task(1000, 0, 0), task(1000, 1, 1000), task(1000, 1, 1000)]
    assert prefix_through(tasks, 2000, 100) == tasks[:3]
    assert prefix_through(tasks, 2000, 149) is None  # no event rounds to 149
    assert prefix_through(tasks, 2000, 150) == tasks[:4]
    assert prefix_through(tasks, 2000, 250) is None


nodes_strategy = st.lists(
    st.builds(
        lambda i, cpu, mem, gpus, model: NodeSpec(f"n{i}", cpu, mem, gpus, model),
        st.integers(0, 99),
        st.sampled_from([4000, 8000, 16000]),
        st.sampled_from([8192, 16384]),
        st.integers(1, 3),
        st.sampled_from(MODELS),
    ),
    min_size=1,
    max_size=2,
)
task_strategy = st.one_of(
    st.builds(lambda cpu, milli, spec: task(cpu, 1, milli, spec), st.sampled_from([1000, 2000, 4000, 6000]),
              st.sampled_from([100, 250, 300, 500, 600, 700, 1000]), st.sampled_from([(), ("T4",), ("P100",)])),
    st.builds(lambda cpu, count: task(cpu, count, 1000), st.sampled_from([1000, 4000]), st.integers(2, 3)),
    st.builds(lambda cpu, mem: task(cpu, 0, 0, mem=mem), st.sampled_from([1000, 4000]), st.sampled_from([1024, 8192])),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(nodes=nodes_strategy, tasks=st.lists(task_strategy, max_size=6))
def test_the_optimum_lies_between_the_offline_packing_and_the_bound(nodes, tasks):
    nodes = [NodeSpec(f"n{i}", n.cpu_milli, n.memory_mib, n.gpu_count, n.model) for i, n in enumerate(nodes)]
    optimum = brute_force(nodes, tasks)
    assert offline_packing(nodes, tasks, lambda: make_policy("bfgd")) <= optimum
    assert optimum <= upper_bound(nodes, tasks).bound_milli


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(nodes=nodes_strategy, tasks=st.lists(task_strategy, min_size=1, max_size=12), seed=st.integers(0, 3))
def test_no_policy_allocates_more_than_the_bound(nodes, tasks, seed):
    nodes = [NodeSpec(f"n{i}", n.cpu_milli, n.memory_mib, n.gpu_count, n.model) for i, n in enumerate(nodes)]
    bound = upper_bound(nodes, tasks)
    capacity = bound.capacity_milli
    for name in policy_names():
        result = simulate(nodes, tasks, make_policy(name), seed=seed)
        assert result.allocated_milli[-1] <= bound.bound_milli, name
        # and the metric, every bucket of the curve, is below the bound of its prefix
        for point, alloc_pct in curve(result.arrived_milli, result.allocated_milli, capacity).items():
            prefix = prefix_through(tasks, capacity, point)
            assert prefix is not None
            assert alloc_pct <= upper_bound(nodes, prefix).pct, (name, point)


def test_simulate_command_reports_the_bound_beside_the_policies(tmp_path, capsys):
    nodes = tmp_path / "nodes.csv"
    nodes.write_text("sn,cpu_milli,memory_mib,gpu,model\nn1,32000,131072,4,T4\nn2,8000,131072,2,P100\n")
    pods = tmp_path / "pods.csv"
    rows = ["name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec"]
    rows += [f"p{i},3000,4096,1,{150 * (1 + i % 6)}," for i in range(12)]
    rows += ["m,4000,8192,2,1000,P100", "c,4000,8192,0,0,"]
    pods.write_text("\n".join(rows) + "\n")
    out = tmp_path / "out.json"
    code = main([
        "simulate", "--node-csv", str(nodes), "--pod-csv", str(pods), "--policy", "fgd,bfgd", "--seed", "1", "2",
        "--jobs", "1", "--output-json", str(out), "--bound",
    ])
    assert code == 0
    assert "(bound)" in capsys.readouterr().out
    documents = {doc["policy"]: doc for doc in json.loads(out.read_text())}
    bound = documents["bound"]
    assert bound["seeds"] == [1, 2] and len(bound["alloc_at_100_per_seed"]) == 2
    for policy in ("fgd", "bfgd"):
        for key in ("alloc_at_100_per_seed", "alloc_at_130_per_seed"):
            for ours, ceiling in zip(documents[policy][key], bound[key], strict=True):
                # a seed whose arrivals stop short of a bucket has no value there, for the policies or the bound
                assert (ours is None) == (ceiling is None)
                assert ours is None or 0 < ours <= ceiling
