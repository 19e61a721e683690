"""Plots of the simulator's results (matplotlib, headless): allocated % vs. arrived % per policy, and the churn
protocol's results."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from kube_vgpu.dev.simulator.runner import ChurnSummary, PolicySummary


def plot_curves(summaries: Sequence[PolicySummary], path: str | Path, title: str = "") -> None:
    """Left: the whole curve; right: a zoom on arrived 80..130 % where policies differ. Mean over seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (full, zoom) = plt.subplots(1, 2, figsize=(10, 4), dpi=80)
    ordered = sorted(summaries, key=lambda s: (s.alloc_at_130 or 0.0), reverse=True)
    for summary in ordered:
        xs = [x for x, _ in summary.curve]
        ys = [y for _, y in summary.curve]
        at130 = f"{summary.alloc_at_130:.2f}" if summary.alloc_at_130 is not None else "n/a"
        label = f"{summary.policy} ({at130} % at 130)"
        (line,) = full.plot(xs, ys, linewidth=1.4, label=label)
        tail = [(x, y) for x, y in summary.curve if x >= 80]
        zoom.plot([x for x, _ in tail], [y for _, y in tail], linewidth=1.4, color=line.get_color())
    full.plot([0, 100], [0, 100], color="0.7", linestyle=":", linewidth=1, label="everything placed")
    full.axhline(100, color="0.7", linewidth=0.8)
    for axis in (full, zoom):
        axis.set_xlabel("arrived GPU demand (% of capacity)")
        axis.grid(alpha=0.3)
    full.set_ylabel("allocated GPU (% of capacity)")
    full.set_xlim(0, 132)
    full.set_ylim(0, 102)
    zoom.set_xlim(80, 131)
    zoom.set_title("zoom: arrived 80..130 %", fontsize=10)
    full.legend(fontsize=8, loc="lower right")
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_churn(summaries: Sequence[ChurnSummary], path: str | Path, title: str = "") -> None:
    """The churn protocol: per trace, each policy's allocated % while the cluster is oversubscribed (bars) and
    its GPU tasks never placed (dots, right axis). Means over seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    traces = list(dict.fromkeys(s.trace for s in summaries))
    policies = sorted({s.policy for s in summaries})
    by_key = {(s.trace, s.policy): s for s in summaries}
    fig, axes = plt.subplots(1, len(traces), figsize=(3.2 * len(traces), 3.6), dpi=80, squeeze=False)
    for axis, trace in zip(axes[0], traces, strict=True):
        rows = [by_key[(trace, p)] for p in policies if (trace, p) in by_key]
        rows.sort(key=lambda s: s.alloc_pct_when_full or 0.0, reverse=True)
        names = [s.policy for s in rows]
        values = [s.alloc_pct_when_full or 0.0 for s in rows]
        colors = ["tab:red" if name == "bfgd" else "tab:blue" for name in names]
        axis.bar(range(len(rows)), values, color=colors)
        axis.set_xticks(range(len(rows)), names, rotation=60, fontsize=8)
        axis.set_ylim(min(values) - 3 if values else 0, 100)
        axis.set_title(trace, fontsize=10)
        axis.grid(axis="y", alpha=0.3)
        never = axis.twinx()
        never.plot(range(len(rows)), [s.never_placed_gpu for s in rows], "ko", markersize=3)
        never.tick_params(labelsize=7)
    axes[0][0].set_ylabel("allocated % while oversubscribed")
    if title:
        fig.suptitle(title + "  (dots, right axis: GPU tasks never placed)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
