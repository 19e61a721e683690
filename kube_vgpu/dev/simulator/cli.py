"""`kube-vgpu simulate`: replay an openb-style trace through the placement engine (see docs/simulator.md)."""

from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path

from kube_vgpu.dev.simulator.runner import (
    DEFAULT_SEEDS,
    BoundSummary,
    ChurnJob,
    ChurnSummary,
    Job,
    PolicySummary,
    bound_summary,
    default_workers,
    known_policy_names,
    resolve_policy_name,
    run_churn_jobs,
    run_jobs,
    summarise,
    summarise_churn,
)
from kube_vgpu.dev.simulator.trace import TraceError, trace_name


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--node-csv", required=True, help="cluster: CSV with sn,cpu_milli,memory_mib,gpu,model")
    parser.add_argument(
        "--pod-csv", required=True, help="tasks: CSV with name,cpu_milli,memory_mib,num_gpu,gpu_milli[,gpu_spec]"
    )
    parser.add_argument(
        "--policy",
        default="default",
        help="placement policy, or several separated by commas; 'default' = the extender's default "
        "(known: {known})".format(known=", ".join(["default", *known_policy_names()])),
    )
    parser.add_argument(
        "--seed", type=int, nargs="+", default=list(DEFAULT_SEEDS), help="arrival seeds (default: 42..51)"
    )
    parser.add_argument(
        "--inflate", type=float, default=1.3, help="arrivals stop at this multiple of GPU capacity (default 1.3)"
    )
    parser.add_argument(
        "--tie-break",
        choices=("order", "random"),
        default="order",
        help="among equally scored nodes: the first in a per-seed random node order, as the FGD reference "
        "simulator does (default), or a uniformly random one (stock kube-scheduler)",
    )
    parser.add_argument("--output-json", type=Path, help="write the results (means over seeds) as JSON")
    parser.add_argument("--curve-csv", type=Path, help="write allocated %% vs arrived %% per policy as CSV")
    parser.add_argument("--plot", type=Path, help="write a PNG plot of allocated %% vs arrived %%")
    parser.add_argument(
        "--jobs", type=int, default=default_workers(), help="worker processes (default: min(2, CPUs))"
    )
    parser.add_argument(
        "--bound",
        action="store_true",
        help="also report the ceiling: an upper bound (LP relaxation, HiGHS) on what any policy can allocate "
        "from each seed's arrivals (needs scipy, the sim extra)",
    )
    parser.add_argument(
        "--protocol",
        choices=("arrivals", "churn"),
        default="arrivals",
        help="arrivals: METHOD.md's (shuffled, inflated, no departures; default); churn: tasks arrive at their "
        "creation_time and leave at their deletion_time on a cluster smaller than the peak demand "
        "(docs/simulator.md, 'Churn')",
    )
    parser.add_argument(
        "--capacity-of-peak",
        type=float,
        default=0.5,
        help="churn: the cluster's GPU capacity as a fraction of the trace's peak GPU demand; each seed draws "
        "its nodes in a random order until this is reached (default 0.5)",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bar and no table")


def _fmt(value: float | None, digits: int = 2) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def print_table(summaries: list[PolicySummary], bound: BoundSummary | None = None) -> None:
    print(
        f"{'trace':<12} {'policy':<12} {'seeds':>5} {'alloc@100':>10} {'alloc@130':>10} {'frag@100':>9} {'s/run':>7}"
    )
    for s in summaries:
        print(
            f"{s.trace:<12} {s.policy:<12} {len(s.seeds):>5} {_fmt(s.alloc_at_100):>10} {_fmt(s.alloc_at_130):>10} "
            f"{_fmt(s.frag_at_100):>9} {s.seconds:>7.1f}"
        )
    if bound is not None:
        print(
            f"{bound.trace:<12} {'(bound)':<12} {len(bound.seeds):>5} {_fmt(bound.bound_at_100):>10} "
            f"{_fmt(bound.bound_at_130):>10} {'':>9} {bound.seconds:>7.1f}"
        )


def print_churn_table(summaries: list[ChurnSummary]) -> None:
    print(
        f"{'trace':<12} {'policy':<12} {'seeds':>5} {'GPUs':>6} {'alloc%':>7} {'ceiling%':>8} {'full%':>6} "
        f"{'alloc%@full':>11} {'never(gpu)':>10} {'delayed':>8} {'pending s':>9} {'s/run':>6}"
    )
    for s in summaries:
        print(
            f"{s.trace:<12} {s.policy:<12} {len(s.seeds):>5} {s.capacity_gpus:>6.1f} {s.alloc_pct:>7.2f} "
            f"{s.ceiling_pct:>8.2f} {100 * s.full_fraction:>6.1f} {_fmt(s.alloc_pct_when_full):>11} "
            f"{s.never_placed_gpu:>10.1f} {s.delayed:>8.1f} {s.pending_mean_s:>9.1f} {s.seconds:>6.1f}"
        )


def run_churn(args: argparse.Namespace, policies: list[str]) -> int:
    jobs = [
        ChurnJob(str(args.node_csv), str(args.pod_csv), policy, seed, args.capacity_of_peak, args.tie_break)
        for policy in policies
        for seed in args.seed
    ]
    try:
        results = run_churn_jobs(jobs, max(1, args.jobs))
    except TraceError as error:
        print(f"bad trace: {error}", file=sys.stderr)
        return 2
    summaries = summarise_churn(jobs, results)
    if not args.quiet:
        print_churn_table(summaries)
    if args.output_json:
        documents = [s.to_json() for s in summaries]
        args.output_json.write_text(json.dumps(documents[0] if len(documents) == 1 else documents, indent=1) + "\n")
    return 0


def write_curve_csv(summaries: list[PolicySummary], path: Path) -> None:
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["trace", "policy", "arrived_pct", "alloc_pct_mean", "alloc_pct_min", "alloc_pct_max"])
        for s in summaries:
            for arrived, alloc in s.curve:
                values = [c[arrived] for c in s.per_seed_curves if arrived in c]
                low, high = f"{min(values):.4f}", f"{max(values):.4f}"
                writer.writerow([s.trace, s.policy, arrived, f"{alloc:.4f}", low, high])


def run(args: argparse.Namespace) -> int:
    policies = [name.strip() for name in args.policy.split(",") if name.strip()]
    known = set(known_policy_names())
    unknown = [name for name in policies if resolve_policy_name(name) not in known]
    if unknown or not policies:
        names = ", ".join(unknown) or "(none)"
        print(f"unknown policy {names}; known: default, {', '.join(sorted(known))}", file=sys.stderr)
        return 2
    for path in (args.node_csv, args.pod_csv):
        if not Path(path).is_file():
            print(f"no such file: {path}", file=sys.stderr)
            return 2
    if args.protocol == "churn":
        if args.bound or args.curve_csv or args.plot:
            print("--bound, --curve-csv and --plot belong to the arrivals protocol", file=sys.stderr)
            return 2
        return run_churn(args, policies)
    jobs = [
        Job(str(args.node_csv), str(args.pod_csv), policy, seed, args.inflate, args.tie_break)
        for policy in policies
        for seed in args.seed
    ]
    try:
        results = run_jobs(jobs, max(1, args.jobs), progress=False if args.quiet else None)
    except TraceError as error:
        print(f"bad trace: {error}", file=sys.stderr)
        return 2
    summaries = summarise(results)
    bound = bound_summary(str(args.node_csv), str(args.pod_csv), args.seed, args.inflate) if args.bound else None
    if not args.quiet:
        print_table(summaries, bound)
    if args.output_json:
        documents = [s.to_json() for s in summaries] + ([bound.to_json()] if bound else [])
        args.output_json.write_text(json.dumps(documents[0] if len(documents) == 1 else documents, indent=1) + "\n")
    if args.curve_csv:
        write_curve_csv(summaries, args.curve_csv)
    if args.plot:
        from kube_vgpu.dev.simulator.plot import plot_curves

        title = f"{trace_name(args.pod_csv)}: allocated vs arrived GPU ({len(args.seed)} seeds, mean)"
        plot_curves(summaries, args.plot, title)
    return 0
