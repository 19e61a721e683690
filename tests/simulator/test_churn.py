"""The churn protocol (kube_vgpu.dev.simulator.churn): arrivals at creation_time, departures at deletion_time."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kube_vgpu.cli import main
from kube_vgpu.dev.simulator.churn import peak_gpu_demand, replay, size_cluster
from kube_vgpu.dev.simulator.plot import plot_churn
from kube_vgpu.dev.simulator.runner import ChurnJob, run_churn_jobs, summarise_churn
from kube_vgpu.dev.simulator.trace import NodeSpec, Task, TimedTask, load_timed_tasks
from kube_vgpu.extender.engine.policies import make_policy, policy_names

ONE_GPU = [NodeSpec("a", 16000, 65536, 1, "T4")]


def timed(name: str, created: int, deleted: int, gpus: int = 1, milli: int = 1000, cpu: int = 1000) -> TimedTask:
    return TimedTask(Task(name, cpu, 1024, gpus, milli if gpus else 0), created, deleted)


def test_hand_computed_replay_on_one_gpu():
    trace = [
        timed("A", 0, 10),  # runs 0..10
        timed("B", 5, 20),  # waits 5..10 for A's GPU, runs 10..20
        timed("C", 12, 15, milli=500),  # B holds the whole GPU: waits all its life, never placed
        timed("D", 0, 20, gpus=0),  # CPU-only, placed at once
        timed("E", 25, 30, milli=500),  # alone on the GPU
        timed("Z", 7, 7),  # no lifetime: skipped
    ]
    result = replay(ONE_GPU, trace, make_policy("bfgd"), seed=1)
    assert result.skipped == 1 and result.tasks == 5
    assert result.placed_at == [0, 10, None, 0, 25]
    assert (result.placed_on_arrival, result.delayed, result.never_placed, result.never_placed_gpu) == (3, 1, 1, 1)
    # pending: A 0, B 5, C 3 (its whole life), D 0, E 0
    assert result.pending_mean_s == pytest.approx(8 / 5)
    # allocated: 1000 on [0, 20), 0 on [20, 25), 500 on [25, 30) over a span of 30 s on 1000 milli
    assert result.span_s == 30
    assert result.alloc_pct == pytest.approx(100 * (20 * 1000 + 5 * 500) / (30 * 1000))
    # live tasks ask 1000, 2000, 1000, 1500, 1000, 0, 500 on [0,5) [5,10) [10,12) [12,15) [15,20) [20,25) [25,30)
    assert result.ceiling_pct == pytest.approx(result.alloc_pct)
    assert result.full_fraction == pytest.approx(8 / 30)  # [5, 10) and [12, 15)
    assert result.alloc_pct_when_full == pytest.approx(100.0)
    assert result.allocation == [(0, 1000), (5, 1000), (10, 1000), (12, 1000), (15, 1000), (20, 0), (25, 500),
                                 (30, 0)]
    assert result.final_usage == (0, 0, 0, 0)


def test_a_departure_frees_exactly_what_the_arrival_took_and_the_oldest_waiter_goes_first():
    # two 600s cannot share the GPU; when the first leaves, the older waiter takes the freed room, the younger
    # waits on (no head-of-line blocking: the 400 behind them fits beside the 600 at once)
    trace = [
        timed("first", 0, 10, milli=600),
        timed("older", 1, 30, milli=600),
        timed("younger", 2, 30, milli=600),
        timed("small", 3, 30, milli=400),
    ]
    result = replay(ONE_GPU, trace, make_policy("fgd"), seed=1)
    assert result.placed_at == [0, 10, None, 3]
    assert result.final_usage == (0, 0, 0, 0)


def test_cpu_is_freed_too():
    # the GPU is idle but CPU-only tasks hold all 16 cores until t = 10
    trace = [timed("cpu", 0, 10, gpus=0, cpu=16000), timed("gpu", 1, 20, cpu=1000)]
    result = replay(ONE_GPU, trace, make_policy("bestfit"), seed=1)
    assert result.placed_at == [0, 10]
    assert result.pending_mean_s == pytest.approx(9 / 2)


def test_peak_demand_counts_departures_first_and_size_cluster_stops_at_the_fraction():
    trace = [timed("a", 0, 10, gpus=2), timed("b", 10, 20, gpus=2), timed("c", 5, 15, milli=500)]
    assert peak_gpu_demand(trace) == 2500  # b starts when a ends
    nodes = [NodeSpec(f"n{i}", 8000, 8192, 1, "T4") for i in range(4)] + [NodeSpec("cpu", 8000, 8192, 0, "")]
    chosen = size_cluster(nodes, trace, 0.5, seed=3)
    assert len(chosen) == 2 and all(spec.gpu_count for spec in chosen)  # 2 GPUs >= 0.5 x 2.5
    assert size_cluster(nodes, trace, 0.5, seed=3) == chosen  # the seed decides


timed_strategy = st.builds(
    lambda created, life, gpus, milli, cpu: timed(f"t{created}-{life}", created, created + life, gpus, milli, cpu),
    st.integers(0, 40),
    st.integers(0, 15),
    st.integers(0, 2),
    st.sampled_from([200, 300, 500, 700, 1000]),
    st.sampled_from([1000, 3000, 6000]),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trace=st.lists(timed_strategy, min_size=1, max_size=25), seed=st.integers(0, 3))
def test_every_policy_ends_empty_and_never_exceeds_capacity_or_the_live_demand(trace, seed):
    nodes = [NodeSpec("a", 8000, 65536, 2, "T4"), NodeSpec("b", 8000, 65536, 1, "P100")]
    live = [item for item in trace if item.deleted > item.created]
    for name in policy_names():
        result = replay(nodes, trace, make_policy(name), seed=seed)
        assert result.final_usage == (0, 0, 0, 0), name
        for moment, allocated in result.allocation:
            # what is allocated is exactly the GPU of the tasks placed and not yet gone
            running = sum(
                item.task.gpu_milli_total
                for item, at in zip(live, result.placed_at, strict=True)
                if at is not None and at <= moment < item.deleted
            )
            assert allocated == running <= result.capacity_milli, (name, moment)
        assert result.alloc_pct <= result.ceiling_pct + 1e-9, name
        assert result.placed_on_arrival + result.delayed + result.never_placed == len(live)


def test_load_timed_tasks_and_the_churn_command(tmp_path, capsys):
    nodes = tmp_path / "nodes.csv"
    nodes.write_text("sn,cpu_milli,memory_mib,gpu,model\nn1,32000,131072,1,T4\nn2,32000,131072,1,T4\n")
    pods = tmp_path / "pods.csv"
    pods.write_text(
        "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,creation_time,deletion_time\n"
        "a,1000,1024,1,1000,,0,10\nb,1000,1024,1,1000,,0,10\nc,1000,1024,1,1000,,5,20\n"
    )
    assert [(t.created, t.deleted) for t in load_timed_tasks(pods)] == [(0, 10), (0, 10), (5, 20)]
    out = tmp_path / "out.json"
    # peak 3 GPUs, fraction 0.3: one node of one GPU; a runs, b waits its whole life, c waits 5..10
    code = main([
        "simulate", "--protocol", "churn", "--capacity-of-peak", "0.3", "--node-csv", str(nodes), "--pod-csv",
        str(pods), "--policy", "bfgd", "--seed", "1", "--jobs", "1", "--output-json", str(out),
    ])
    assert code == 0
    assert "alloc%" in capsys.readouterr().out
    doc = json.loads(out.read_text())
    assert doc["protocol"] == "churn" and doc["capacity_gpus"] == 1.0
    assert doc["alloc_pct"] == pytest.approx(100.0) and doc["never_placed_gpu"] == 1
    assert doc["pending_mean_s"] == pytest.approx((0 + 10 + 5) / 3)


def test_churn_summary_and_plot(tmp_path):
    nodes = tmp_path / "nodes.csv"
    nodes.write_text("sn,cpu_milli,memory_mib,gpu,model\nn1,32000,131072,2,T4\n")
    pods = tmp_path / "pods.csv"
    pods.write_text(
        "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,creation_time,deletion_time\n"
        "a,1000,1024,1,1000,,0,10\nb,1000,1024,1,600,,0,10\nc,1000,1024,1,600,,5,20\n"
    )
    jobs = [ChurnJob(str(nodes), str(pods), policy, seed, 1.0) for policy in ("bfgd", "spread") for seed in (1, 2)]
    summaries = summarise_churn(jobs, run_churn_jobs(jobs, 1))
    assert [(s.policy, s.seeds) for s in summaries] == [("bfgd", [1, 2]), ("spread", [1, 2])]
    # a, b on their own GPUs; c (600) fits beside neither until b leaves at 10: 1600 on [0, 10), 600 on [10, 20)
    assert all(s.alloc_pct == pytest.approx(100 * (16000 + 6000) / (2000 * 20)) for s in summaries)
    assert all(s.delayed == 1 and s.never_placed_gpu == 0 and s.capacity_gpus == 2 for s in summaries)
    plot_churn(summaries, tmp_path / "churn.png", "test")
    assert (tmp_path / "churn.png").stat().st_size > 0
