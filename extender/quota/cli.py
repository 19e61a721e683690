"""`kube-vgpu quota status`: a running extender's GET /quota as a table (stdlib only: no client libraries)."""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request
from typing import Any

COLUMNS = ("CLUSTERQUEUE", "FLAVOR", "RESOURCE", "NOMINAL", "BORROWED", "LENT", "USED", "LIMIT", "AVAILABLE",
           "PENDING")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="quota_command", required=True, metavar="COMMAND")
    status = sub.add_parser("status", help="per ClusterQueue and flavor: nominal, borrowed, lent, used, pending pods")
    status.add_argument("--extender-url", default="http://127.0.0.1:8888",
                        help="the extender's HTTP address (default http://127.0.0.1:8888; e.g. through "
                             "`kubectl port-forward`)")
    status.add_argument("--output", "-o", choices=("table", "json"), default="table")
    status.add_argument("--timeout-seconds", type=float, default=10.0)


def fetch(url: str, timeout_s: float) -> dict[str, Any]:
    with urllib.request.urlopen(url.rstrip("/") + "/quota", timeout=timeout_s) as response:
        doc: dict[str, Any] = json.loads(response.read())
        return doc


def _cell(value: Any) -> str:
    return "-" if value is None else str(value)


def render(doc: dict[str, Any]) -> str:
    """The /quota document as a fixed-width table plus notes (inactive queues, invalid objects)."""
    rows: list[tuple[str, ...]] = []
    notes: list[str] = []
    for queue in doc.get("clusterQueues", []):
        first = True
        for flavor in queue.get("flavors", []):
            for res in flavor.get("resources", []):
                unit = f" ({res['unit']})" if res.get("unit") else ""
                rows.append((
                    queue["name"] if first else "",
                    flavor["flavor"],
                    res["resource"] + unit,
                    _cell(res["nominal"]),
                    _cell(res["borrowed"]),
                    _cell(res["lent"]),
                    _cell(res["used"]),
                    _cell(res["limit"]),
                    _cell(res["available"]),
                    _cell(queue["pendingPods"]) if first else "",
                ))
                first = False
        if first:  # a queue without resource groups still gets a line
            rows.append((queue["name"], "-", "-", "-", "-", "-", "-", "-", "-", _cell(queue["pendingPods"])))
        if queue.get("inactiveReason"):
            notes.append(f"ClusterQueue {queue['name']} is inactive: {queue['inactiveReason']}")
        if queue.get("waitingForQuota"):
            notes.append(f"ClusterQueue {queue['name']}: {queue['waitingForQuota']} pod(s) waiting for quota")
        for item in queue.get("uncountedPods", []):
            notes.append(f"ClusterQueue {queue['name']}: pod {item['pod']} not counted: {item['problem']}")
    widths = [max(len(row[i]) for row in [COLUMNS, *rows]) for i in range(len(COLUMNS))]
    numeric = {3, 4, 5, 6, 7, 8, 9}
    lines = []
    for row in [COLUMNS, *rows]:
        cells = [cell.rjust(widths[i]) if i in numeric else cell.ljust(widths[i]) for i, cell in enumerate(row)]
        lines.append("  ".join(cells).rstrip())
    if not doc.get("synced", True):
        notes.insert(0, "Kueue objects not listed from the cluster yet: nothing is admitted")
    notes.extend(f"invalid (left out): {error}" for error in doc.get("errors", []))
    notes.extend(f"warning: {warning}" for warning in doc.get("warnings", []))
    if not doc.get("clusterQueues"):
        notes.insert(0, "no ClusterQueue configured: quota is not enforced")
    return "\n".join(lines + (["", *notes] if notes else []))


def run(args: argparse.Namespace) -> int:
    try:
        doc = fetch(args.extender_url, args.timeout_seconds)
    except urllib.error.HTTPError as exc:
        body = exc.read().decode(errors="replace")
        print(f"kube-vgpu quota status: {args.extender_url}/quota answered {exc.code}: {body}", file=sys.stderr)
        return 1
    except (urllib.error.URLError, OSError, ValueError) as exc:
        print(f"kube-vgpu quota status: cannot read {args.extender_url}/quota: {exc}", file=sys.stderr)
        return 1
    if args.output == "json":
        print(json.dumps(doc, indent=2))
    else:
        print(render(doc))
    return 0
