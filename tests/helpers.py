"""The tests' builders are kube_vgpu.dev.fixtures (shared with the benchmarks and the demo); `pod` is the GPU pod as
kube-scheduler sends it to an extender."""

from __future__ import annotations

from typing import Any

import pytest

from kube_vgpu.dev.fixtures import gpu_node
from kube_vgpu.dev.fixtures import scheduled_pod as pod
from kube_vgpu.extender.engine.model import FitFailure, NodeState, Placement

__all__ = ["assert_same_exposition", "gpu_node", "pod"]


def assert_same_exposition(rendered: bytes, reference: bytes) -> None:
    """/metrics as render_registry writes it is generate_latest's text line for line, except that the GPU-seconds
    counters' values are written as whole numbers (`30` where generate_latest writes `30.0`, `29491200` for
    `2.94912e+07`): the same numbers, for Prometheus and any parser."""
    if rendered == reference:
        return
    ours, theirs = rendered.split(b"\n"), reference.split(b"\n")
    assert len(ours) == len(theirs), "not the same lines"
    for mine, reference_line in zip(ours, theirs, strict=True):
        if mine == reference_line:
            continue
        series, _, value = mine.rpartition(b" ")
        reference_series, _, reference_value = reference_line.rpartition(b" ")
        assert series == reference_series and b"_seconds_total{" in series, (mine, reference_line)
        assert value.isdigit() and float(value) == float(reference_value), (mine, reference_line)


def placed_nodes(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The node of every placement the scheduler makes from now on (its calls of fit.place), in order."""
    from kube_vgpu.extender import scheduler as scheduler_module

    placed: list[str] = []
    real_place = scheduler_module.place

    def counting_place(node: NodeState, *args: Any, **kwargs: Any) -> Placement | FitFailure:
        placed.append(node.name)
        return real_place(node, *args, **kwargs)

    monkeypatch.setattr(scheduler_module, "place", counting_place)
    return placed
