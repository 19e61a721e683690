"""`kube-vgpu usage`: GPU-hours per namespace or ClusterQueue for a period, from Prometheus' HTTP API (the extender's
per-pod accounting counters, extender/usage_metrics.py). Stdlib only.

For each of the three counters it asks `query_range` for

    sum by (TEAM) (max by (namespace, pod, cluster_queue) (increase(COUNTER[STEP])))

at every step end from START + STEP to END, and adds the steps up: consecutive windows of STEP that cover the period
exactly. `max by` the pod first: every extender replica exports the same per-pod series (the standby's state equals
the leader's), which a plain sum would count once per replica.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import re
import sys
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kube_vgpu.extender.quota.cli import _table

#: column -> (counter, divisor turning its unit-seconds into the column's unit-hours)
COUNTERS: dict[str, tuple[str, float]] = {
    "VGPU-HOURS": ("kube_vgpu_pod_vgpu_seconds_total", 3600.0),
    "GPU-HOURS": ("kube_vgpu_pod_gpu_core_percent_seconds_total", 100 * 3600.0),  # compute: 100 % = one GPU
    "MEMORY-GIB-HOURS": ("kube_vgpu_pod_gpu_memory_mib_seconds_total", 1024 * 3600.0),
}
TEAMS = {"namespace": "NAMESPACE", "cluster_queue": "CLUSTERQUEUE"}
#: Prometheus refuses a range query of more points than this per series
MAX_POINTS = 11000
_DURATION = re.compile(r"^(\d+)([smhdw])$")
_UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


class UsageError(Exception):
    """A bad argument or a Prometheus answer that cannot be used; the message says which."""


def parse_duration(text: str) -> int:
    """"90s", "15m", "1h", "1d", "1w" -> seconds."""
    found = _DURATION.match(text.strip())
    if not found or int(found.group(1)) == 0:
        raise UsageError(f"expected a duration like 1h, 30m, 1d, got {text!r}")
    return int(found.group(1)) * _UNIT_SECONDS[found.group(2)]


def parse_moment(text: str) -> dt.datetime:
    """A date (2026-11-01, midnight UTC) or an ISO 8601 time (UTC when it names no offset)."""
    try:
        moment = dt.datetime.fromisoformat(text.strip())
    except ValueError:
        raise UsageError(
            f"expected a date (2026-11-01) or an ISO 8601 time (2026-11-01T12:00:00Z), got {text!r}") from None
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=dt.UTC)


@dataclass(frozen=True, slots=True)
class Period:
    start: dt.datetime
    end: dt.datetime
    step_s: int

    def check(self) -> None:
        span = (self.end - self.start).total_seconds()
        if span <= 0:
            raise UsageError(f"--end ({self.end.isoformat()}) must be after --start ({self.start.isoformat()})")
        if span % self.step_s:
            raise UsageError(f"the period ({span:.0f} s) must be a whole number of steps ({self.step_s} s)")
        if span / self.step_s > MAX_POINTS:
            raise UsageError(f"{span / self.step_s:.0f} steps: Prometheus answers at most {MAX_POINTS} per series; "
                             "use a longer --step")


def build_query(counter: str, team: str, step_s: int) -> str:
    return (f"sum by ({team}) (max by (namespace, pod, cluster_queue) "
            f"(increase({counter}[{step_s}s])))")


def query_range(base_url: str, query: str, period: Period, timeout_s: float) -> list[dict[str, Any]]:
    """Prometheus' /api/v1/query_range result (a matrix). Raises UsageError with Prometheus' own error text."""
    params = urllib.parse.urlencode({
        "query": query,
        "start": f"{period.start.timestamp() + period.step_s:.3f}",
        "end": f"{period.end.timestamp():.3f}",
        "step": f"{period.step_s}s",
    })
    url = f"{base_url.rstrip('/')}/api/v1/query_range"
    request = urllib.request.Request(url, data=params.encode(), method="POST",
                                     headers={"Content-Type": "application/x-www-form-urlencoded"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            body = response.read()
    except urllib.error.HTTPError as exc:
        body = exc.read()
        detail = _error_text(body) or body[:200].decode(errors="replace")
        raise UsageError(f"{url} answered {exc.code}: {detail}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise UsageError(f"cannot reach {url}: {exc}") from None
    try:
        doc = json.loads(body)
    except ValueError:
        raise UsageError(f"{url} did not answer JSON: {body[:80]!r}") from None
    return _matrix(doc, url)


def _error_text(body: bytes) -> str | None:
    try:
        doc = json.loads(body)
    except ValueError:
        return None
    if isinstance(doc, dict) and isinstance(doc.get("error"), str):
        return f"{doc.get('errorType', 'error')}: {doc['error']}"
    return None


def _matrix(doc: Any, url: str) -> list[dict[str, Any]]:
    if not isinstance(doc, dict) or doc.get("status") != "success":
        error = doc.get("error") if isinstance(doc, dict) else None
        raise UsageError(f"{url}: query failed: {error or 'no status success in the answer'}")
    data = doc.get("data")
    if not isinstance(data, dict) or data.get("resultType") != "matrix" or not isinstance(data.get("result"), list):
        raise UsageError(f"{url}: expected data.resultType matrix with a result list")
    result: list[dict[str, Any]] = data["result"]
    return result


def total_by_team(result: list[dict[str, Any]], team: str) -> dict[str, float]:
    """Each series' values summed (one value per step), by the series' `team` label ("" when absent). NaN and
    infinite values are refused: they would make a bill say nothing."""
    totals: dict[str, float] = {}
    for index, series in enumerate(result):
        where = f"result[{index}]"
        metric = series.get("metric") if isinstance(series, dict) else None
        values = series.get("values") if isinstance(series, dict) else None
        if not isinstance(metric, dict) or not isinstance(values, list):
            raise UsageError(f"{where}: a series needs a metric object and a values list")
        name = metric.get(team, "")
        if not isinstance(name, str):
            raise UsageError(f"{where}: label {team} is not a string")
        total = 0.0
        for point in values:
            if not isinstance(point, list) or len(point) != 2 or not isinstance(point[1], str):
                raise UsageError(f"{where}: a value must be [timestamp, \"number\"], got {point!r}")
            try:
                value = float(point[1])
            except ValueError:
                raise UsageError(f"{where}: {point[1]!r} is not a number") from None
            if not math.isfinite(value):
                raise UsageError(f"{where}: value {point[1]} at {point[0]} is not finite")
            total += value
        totals[name] = totals.get(name, 0.0) + total
    return totals


def report(base_url: str, period: Period, team: str, timeout_s: float) -> dict[str, dict[str, float]]:
    """team name -> column -> hours."""
    period.check()
    rows: dict[str, dict[str, float]] = {}
    for column, (counter, divisor) in COUNTERS.items():
        result = query_range(base_url, build_query(counter, team, period.step_s), period, timeout_s)
        for name, total in total_by_team(result, team).items():
            rows.setdefault(name, dict.fromkeys(COUNTERS, 0.0))[column] = total / divisor
    return rows


def render(rows: Mapping[str, Mapping[str, float]], team: str, period: Period) -> str:
    columns = (TEAMS[team], *COUNTERS)
    ordered = sorted(rows.items(), key=lambda item: (-item[1]["GPU-HOURS"], item[0]))
    lines = [(name or "(none)", *(f"{values[c]:.2f}" for c in COUNTERS)) for name, values in ordered]
    totals = ("TOTAL", *(f"{sum(v[c] for v in rows.values()):.2f}" for c in COUNTERS))
    title = f"GPU use from {period.start.isoformat()} to {period.end.isoformat()} (steps of {period.step_s} s)"
    if not rows:
        return f"{title}\nno GPU use recorded in this period"
    return "\n".join([title, *_table(columns, [*lines, totals], {1, 2, 3})])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prometheus-url", required=True, help="Prometheus' HTTP address (e.g. http://prometheus:9090)")
    parser.add_argument("--start", required=True, help="start of the period: a date (UTC midnight) or ISO 8601 time")
    parser.add_argument("--end", help="end of the period (default: the last whole --step before now)")
    parser.add_argument("--step", default="1h", help="window the counters' increase is taken over (default 1h); "
                                                     "the period must be a whole number of them")
    parser.add_argument("--by", choices=tuple(TEAMS), default="namespace", help="team: namespace or ClusterQueue")
    parser.add_argument("--output", "-o", choices=("table", "json"), default="table")
    parser.add_argument("--timeout-seconds", type=float, default=30.0)


def run(args: argparse.Namespace) -> int:
    try:
        start = parse_moment(args.start)
        step_s = parse_duration(args.step)
        if args.end:
            end = parse_moment(args.end)
        else:  # the last whole step before now
            whole = (dt.datetime.now(dt.UTC) - start).total_seconds() // step_s
            end = start + dt.timedelta(seconds=whole * step_s)
        period = Period(start, end, step_s)
        rows = report(args.prometheus_url, period, args.by, args.timeout_seconds)
    except UsageError as exc:
        print(f"kube-vgpu usage: {exc}", file=sys.stderr)
        return 1
    if args.output == "json":
        print(json.dumps({"start": period.start.isoformat(), "end": period.end.isoformat(), "by": args.by,
                          "teams": rows}, indent=2, sort_keys=True))
    else:
        print(render(rows, args.by, period))
    return 0
