"""A plot of allocated % vs. arrived % per policy (matplotlib, headless)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from kube_vgpu.dev.simulator.runner import PolicySummary


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
