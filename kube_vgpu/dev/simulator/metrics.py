"""The headline metric of METHOD.md step 3: allocated % vs. arrived % of cluster GPU capacity."""

from __future__ import annotations

import math
from collections.abc import Sequence


def bucket(arrived_milli: int, capacity_milli: int) -> int:
    """The integer arrived % an event counts for (rounded half up)."""
    return math.floor(arrived_milli * (100.0 / capacity_milli) + 0.5)


def curve(arrived_milli: Sequence[int], allocated_milli: Sequence[int], capacity_milli: int) -> dict[int, float]:
    """{arrived % (integer): mean allocated % of the events whose arrived % rounds (half up) to it}."""
    sums: dict[int, float] = {}
    counts: dict[int, int] = {}
    scale = 100.0 / capacity_milli
    for arrived, allocated in zip(arrived_milli, allocated_milli, strict=True):
        point = bucket(arrived, capacity_milli)
        sums[point] = sums.get(point, 0.0) + allocated * scale
        counts[point] = counts.get(point, 0) + 1
    return {point: sums[point] / counts[point] for point in sorted(sums)}


def mean_curve(curves: Sequence[dict[int, float]]) -> dict[int, float]:
    """Point-wise mean over seeds, at the arrived % every seed reached."""
    if not curves:
        return {}
    common = set(curves[0]).intersection(*curves[1:])
    return {bucket: sum(c[bucket] for c in curves) / len(curves) for bucket in sorted(common)}
