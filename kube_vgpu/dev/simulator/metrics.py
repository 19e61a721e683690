"""The headline metric of METHOD.md step 3: allocated % vs. arrived % of cluster GPU capacity."""

from __future__ import annotations

import math
from collections.abc import Sequence


def curve(arrived_milli: Sequence[int], allocated_milli: Sequence[int], capacity_milli: int) -> dict[int, float]:
    """{arrived % (integer): mean allocated % of the events whose arrived % rounds (half up) to it}."""
    sums: dict[int, float] = {}
    counts: dict[int, int] = {}
    scale = 100.0 / capacity_milli
    for arrived, allocated in zip(arrived_milli, allocated_milli, strict=True):
        bucket = math.floor(arrived * scale + 0.5)
        sums[bucket] = sums.get(bucket, 0.0) + allocated * scale
        counts[bucket] = counts.get(bucket, 0) + 1
    return {bucket: sums[bucket] / counts[bucket] for bucket in sorted(sums)}


def mean_curve(curves: Sequence[dict[int, float]]) -> dict[int, float]:
    """Point-wise mean over seeds, at the arrived % every seed reached."""
    if not curves:
        return {}
    common = set(curves[0]).intersection(*curves[1:])
    return {bucket: sum(c[bucket] for c in curves) / len(curves) for bucket in sorted(common)}
