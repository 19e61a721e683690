"""The simulator end to end on tiny clusters, and the `kube-vgpu simulate` command."""

from __future__ import annotations

import json

import pytest

from kube_vgpu.cli import main
from kube_vgpu.dev.simulator.engine import simulate
from kube_vgpu.dev.simulator.metrics import curve
from kube_vgpu.dev.simulator.trace import NodeSpec, Task
from kube_vgpu.extender.engine.policies import make_policy

NODES = [NodeSpec("a", 16000, 65536, 2, "T4"), NodeSpec("b", 16000, 65536, 1, "P100")]


def test_places_until_full_and_drops_what_does_not_fit():
    arrivals = [Task(f"t{i}", 1000, 1024, 1, 1000) for i in range(4)]
    result = simulate(NODES, arrivals, make_policy("bestfit"), seed=1)
    assert (result.placed, result.failed) == (3, 1)
    assert result.arrived_milli == [1000, 2000, 3000, 4000]
    assert result.allocated_milli == [1000, 2000, 3000, 3000]


def test_host_cpu_and_gpu_model_are_filters():
    arrivals = [
        Task("too much cpu", 20000, 1024, 1, 500),
        Task("only P100", 1000, 1024, 1, 500, ("P100",)),
        Task("only P100 again", 1000, 1024, 1, 600, ("P100",)),  # 500 left on the P100
        Task("V100", 1000, 1024, 1, 100, ("V100M16",)),
    ]
    result = simulate(NODES, arrivals, make_policy("fgd"), seed=1)
    assert result.allocated_milli == [0, 500, 500, 500]


def test_sharing_tasks_share_a_gpu():
    arrivals = [Task(f"s{i}", 1000, 1024, 1, 250) for i in range(12)]
    result = simulate(NODES, arrivals, make_policy("packing"), seed=1)
    assert result.placed == 12  # 3 GPUs x 4 quarters


def test_curve_buckets_by_rounded_arrived_percent():
    points = curve([40, 60, 1000], [40, 0, 900], capacity_milli=1000)
    assert points == {4: pytest.approx(4.0), 6: pytest.approx(0.0), 100: pytest.approx(90.0)}


def test_command_writes_json_curve_and_plot(tmp_path):
    nodes = tmp_path / "nodes.csv"
    nodes.write_text("sn,cpu_milli,memory_mib,gpu,model\nn1,32000,131072,4,T4\nn2,32000,131072,2,P100\n")
    pods = tmp_path / "pods.csv"
    rows = ["name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec"]
    rows += [f"p{i},2000,4096,1,{250 * (1 + i % 4)}," for i in range(12)]
    rows += ["m,4000,8192,2,1000,P100", "c,4000,8192,0,0,"]
    pods.write_text("\n".join(rows) + "\n")
    out = tmp_path / "out.json"
    code = main([
        "simulate", "--node-csv", str(nodes), "--pod-csv", str(pods), "--policy", "fgd", "--seed", "1", "2",
        "--jobs", "1", "--quiet", "--output-json", str(out), "--curve-csv", str(tmp_path / "c.csv"),
        "--plot", str(tmp_path / "p.png"),
    ])
    assert code == 0
    doc = json.loads(out.read_text())
    for key in ("policy", "trace", "seeds", "alloc_at_100", "alloc_at_130", "alloc_at_130_per_seed", "frag_at_100",
                "curve", "seconds"):
        assert key in doc
    assert doc["policy"] == "fgd" and doc["seeds"] == [1, 2] and len(doc["alloc_at_130_per_seed"]) == 2
    assert all(0 <= alloc <= 100 for _, alloc in doc["curve"])
    assert (tmp_path / "p.png").stat().st_size > 0
    assert (tmp_path / "c.csv").read_text().startswith("trace,policy,arrived_pct")


def test_command_rejects_unknown_policy(tmp_path, capsys):
    nodes = tmp_path / "n.csv"
    nodes.write_text("sn,cpu_milli,memory_mib,gpu,model\nn1,1000,1000,1,T4\n")
    code = main(["simulate", "--node-csv", str(nodes), "--pod-csv", str(nodes), "--policy", "nope", "--quiet"])
    assert code == 2
    assert "unknown policy" in capsys.readouterr().err
