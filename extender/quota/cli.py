"""`kube-vgpu quota status`: a running extender's GET /quota as a table (stdlib only: no client libraries)."""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import Any

COLUMNS = ("CLUSTERQUEUE", "FLAVOR", "RESOURCE", "NOMINAL", "BORROWED", "LENT", "USED", "LIMIT", "AVAILABLE",
           "PENDING")
#: Kueue's math.MaxInt: a zero-weight queue that borrows (kept here: this module imports no extender code)
INFINITE_SHARE = 2**63 - 1
#: protocol.MIG_RESOURCE_PREFIX (kept here for the same reason)
MIG_RESOURCE_PREFIX = "nvidia.com/mig-"
GANG_COLUMNS = ("GANG", "SIZE", "SEEN", "BOUND", "PLANNED", "WAITING")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="quota_command", required=True, metavar="COMMAND")
    status = sub.add_parser("status", help="per ClusterQueue and flavor: nominal, borrowed, lent, used, pending pods; "
                                           "then each queue's gangs")
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


def _table(columns: tuple[str, ...], rows: Sequence[tuple[str, ...]], numeric: set[int]) -> list[str]:
    """Fixed-width lines: numbers right-aligned, text left-aligned, trailing blanks cut."""
    widths = [max(len(row[i]) for row in [columns, *rows]) for i in range(len(columns))]
    lines = []
    for row in [columns, *rows]:
        cells = [cell.rjust(widths[i]) if i in numeric else cell.ljust(widths[i]) for i, cell in enumerate(row)]
        lines.append("  ".join(cells).rstrip())
    return lines


def _gang_table(title: str, gangs: list[dict[str, Any]]) -> list[str]:
    """One queue's gangs: members seen, bound and planned, and why the gang waits (empty when it does not)."""
    rows = [(g["name"], _cell(g["size"]), _cell(g["membersSeen"]), _cell(g["bound"]), _cell(g["planned"]),
             g.get("waiting") or "-") for g in gangs]
    return ["", title, *_table(GANG_COLUMNS, rows, {1, 2, 3, 4})]


def _share(queue: dict[str, Any]) -> str:
    """SHARE: the weighted share, with the weight when it is not 1 ("inf" for a zero-weight queue that borrows)."""
    fair = queue.get("fairSharing") or {}
    value = fair.get("weightedShare")
    if value is None:
        return "-"
    text = "inf" if value >= INFINITE_SHARE else str(value)
    return text if fair.get("weight") in (None, "1") else f"{text} (w{fair['weight']})"


KUEUE_MODE_COLUMNS = ("CLUSTERQUEUE", "RESOURCE", "LANDED", "KUEUE CHARGED", "ADMITTED WL", "PENDING WL")
#: the landed resources shown, in Kueue's names for them under the HAMi guide's transformation
LANDED_SHOWN = ("nvidia.com/gpu", "nvidia.com/total-gpumem", "nvidia.com/total-gpucores", "pods")


def render_kueue_mode(doc: dict[str, Any]) -> str:
    """Quota mode kueue: per ClusterQueue, what landed on GPUs beside what Kueue's controller charged."""
    rows: list[tuple[str, ...]] = []
    for queue in doc.get("clusterQueues", []):
        charged: dict[str, int] = {}
        for flavor in queue.get("kueueCharged", []):
            for usage in flavor.get("resources", []):
                charged[usage["resource"]] = charged.get(usage["resource"], 0) + usage["total"]
        # what Kueue charged beside what landed, and the MIG resources that landed even where Kueue charged none
        landed_mig = {r for r in queue["landed"] if r.startswith(MIG_RESOURCE_PREFIX)}
        resources = [*LANDED_SHOWN, *sorted((set(charged) | landed_mig) - set(LANDED_SHOWN))]
        for index, resource in enumerate(resources):
            first = index == 0
            rows.append((queue["name"] if first else "", resource, _cell(queue["landed"].get(resource)),
                         _cell(charged.get(resource)), _cell(queue["admittedWorkloads"]) if first else "",
                         _cell(queue["pendingWorkloads"]) if first else ""))
    lines = ["quota mode kueue: Kueue's controller admits; LANDED is what kube-vgpu placed on GPUs", "",
             *_table(KUEUE_MODE_COLUMNS, rows, {2, 3, 4, 5})]
    outside = doc.get("landedOutsideQueues") or {}
    if outside.get("pods"):
        lines += ["", f"{outside['pods']} GPU pod(s) in no ClusterQueue hold {outside.get('nvidia.com/gpu', 0)} "
                      f"vGPU(s), {outside.get('nvidia.com/gpumem', 0)} MiB"]
    if not doc.get("synced", True):
        lines += ["", "Kueue's Workloads not listed from the cluster yet: nothing is placed"]
    lines.extend(f"warning: {warning}" for warning in doc.get("warnings", []))
    return "\n".join(lines)


def render(doc: dict[str, Any]) -> str:
    """The /quota document as a fixed-width table, a table of gangs per queue that has any, then notes (inactive
    queues, invalid objects). A SHARE column (Kueue's weighted share) when the extender runs with --fair-sharing."""
    if doc.get("mode") == "kueue":
        return render_kueue_mode(doc)
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
                    _share(queue) if first else "",
                ))
                first = False
        if first:  # a queue without resource groups still gets a line
            rows.append((queue["name"], "-", "-", "-", "-", "-", "-", "-", "-", _cell(queue["pendingPods"]),
                         _share(queue)))
        if queue.get("inactiveReason"):
            notes.append(f"ClusterQueue {queue['name']} is inactive: {queue['inactiveReason']}")
        if queue.get("waitingForQuota"):
            notes.append(f"ClusterQueue {queue['name']}: {queue['waitingForQuota']} pod(s) waiting for quota")
        for item in queue.get("uncountedPods", []):
            notes.append(f"ClusterQueue {queue['name']}: pod {item['pod']} not counted: {item['problem']}")
    if doc.get("fairSharing"):
        lines = _table((*COLUMNS, "SHARE"), rows, {3, 4, 5, 6, 7, 8, 9, 10})
    else:  # the table as before: no column that would say nothing
        lines = _table(COLUMNS, [row[:-1] for row in rows], {3, 4, 5, 6, 7, 8, 9})
    # gangs after the queues' table, one table per queue that has any: nothing at all when there are none
    for queue in doc.get("clusterQueues", []):
        if queue.get("gangs"):
            lines.extend(_gang_table(f"Gangs in ClusterQueue {queue['name']}:", queue["gangs"]))
    if doc.get("unqueuedGangs"):
        lines.extend(_gang_table("Gangs in no ClusterQueue:", doc["unqueuedGangs"]))
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
