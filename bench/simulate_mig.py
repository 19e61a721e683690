#!/usr/bin/env python3
"""MIG layout placement on the openb traces: our fragmentation-aware slot choice against first-fit and best-fit,
all in the same run on the same arrivals (kube_vgpu/dev/simulator/mig.py describes the workload and protocol).

    python bench/simulate_mig.py --traces ../shared/traces/openb --seeds 42-51 --nodes 32

Prints two Markdown tables: allocated % of compute slices at arrived 100 / 130 (METHOD.md's protocol; every GPU
task, then the sharing tasks that become MIG slices smaller than a whole GPU), and the churn replay (tasks arrive
and leave at their trace times on a cluster of 0.5 and 0.25 x peak demand; traces without times are skipped).
"""

from __future__ import annotations

import argparse
import csv
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from kube_vgpu.dev.simulator.mig import run_mig_churn, run_mig_experiment, smallest_profile
from kube_vgpu.dev.simulator.trace import Task, load_tasks, load_timed_tasks
from kube_vgpu.extender.engine.mig_layout import MIG_LAYOUT_POLICIES
from kube_vgpu.protocol.mig import MIG_COMPUTE_SLICES, MIG_MODELS, MigModel

ROOT = Path(__file__).resolve().parent.parent
TRACES = ("default", "cpu100", "gpushare40", "gpuspec20", "multigpu30")
#: cpu100 and gpuspec20 differ from default in CPU asks and GPU model lists only, which MIG layouts do not see
DEFAULT_TRACES = ("default", "gpushare40", "multigpu30")


def seeds(text: str) -> list[int]:
    if "-" in text:
        low, high = text.split("-", 1)
        return list(range(int(low), int(high) + 1))
    return [int(part) for part in text.split(",")]


def arrivals_table(model: MigModel, traces: Path, names: Sequence[str], seed_list: Sequence[int], nodes: int,
                   workload: str, keep: Callable[[Task], bool]) -> None:
    policies = list(MIG_LAYOUT_POLICIES)
    print(f"\n### {workload}: allocated % of compute slices at arrived 100 / 130 ({model.key}, {nodes} nodes x 8, "
          f"mean of {len(seed_list)} seeds)\n")
    print("| trace | " + " | ".join(policies) + " | frag - best of the others (130) |")
    print("|---|" + "---|" * (len(policies) + 1))
    for name in names:
        tasks = [task for task in load_tasks(traces / f"openb_pod_list_{name}.csv") if keep(task)]
        cells: dict[str, tuple[float, float]] = {}
        for policy in policies:
            runs = [run_mig_experiment(model, tasks, policy, seed, nodes) for seed in seed_list]
            at_100 = sum(run.curve.get(100, 0.0) for run in runs) / len(runs)
            at_130 = sum(run.curve[max(run.curve)] for run in runs) / len(runs)
            cells[policy] = (at_100, at_130)
        gain = cells["frag"][1] - max(v[1] for k, v in cells.items() if k != "frag")
        print(f"| {name} | " + " | ".join(f"{a:.2f} / {b:.2f}" for a, b in cells.values()) + f" | {gain:+.2f} |")
        sys.stdout.flush()


def has_times(path: Path) -> bool:
    with open(path, newline="") as handle:
        return "creation_time" in (next(csv.reader(handle), []))


def churn_table(model: MigModel, traces: Path, names: Sequence[str], fractions: Sequence[float]) -> None:
    policies = list(MIG_LAYOUT_POLICIES)
    print(f"\n### churn ({model.key}): time-averaged allocated % when demand exceeds the cluster, "
          "tasks never placed\n")
    print("| trace | cluster | " + " | ".join(policies) + " |")
    print("|---|---|" + "---|" * len(policies))
    for name in names:
        path = traces / f"openb_pod_list_{name}.csv"
        if not has_times(path):
            continue
        timed = load_timed_tasks(path)
        for fraction in fractions:
            runs = [run_mig_churn(model, timed, policy, fraction) for policy in policies]
            cells = [f"{run.alloc_pct_when_full or 0.0:.2f}, {run.never_placed}" for run in runs]
            print(f"| {name} | {fraction} x peak ({runs[0].gpus} GPUs) | " + " | ".join(cells) + " |")
            sys.stdout.flush()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--traces", type=Path, default=ROOT.parent / "shared" / "traces" / "openb")
    parser.add_argument("--trace", action="append", choices=TRACES, help="default: " + ", ".join(DEFAULT_TRACES))
    parser.add_argument("--seeds", type=seeds, default=seeds("42-51"))
    parser.add_argument("--nodes", type=int, default=32, help="8-GPU nodes (default 32: 256 GPUs)")
    parser.add_argument("--model", default="A100-80GB", choices=[m.key for m in MIG_MODELS])
    parser.add_argument("--churn", default="0.5,0.25", help="cluster sizes as fractions of peak demand; '' = none")
    args = parser.parse_args(argv)
    model = next(m for m in MIG_MODELS if m.key == args.model)
    names = args.trace or list(DEFAULT_TRACES)
    arrivals_table(model, args.traces, names, args.seeds, args.nodes, "every GPU task", lambda task: True)
    arrivals_table(
        model, args.traces, names, args.seeds, args.nodes, "sharing tasks smaller than a whole GPU",
        lambda task: task.gpu_count == 1
        and smallest_profile(model, task.gpu_milli).compute_slices < MIG_COMPUTE_SLICES,
    )
    if args.churn:
        churn_table(model, args.traces, names, [float(part) for part in args.churn.split(",")])
    return 0


if __name__ == "__main__":
    sys.exit(main())
