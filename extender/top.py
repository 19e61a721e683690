"""`kube-vgpu top nodes|gpus|pods`: what the extender has assigned, as `kubectl top` shows nodes and pods, read from
a running extender's GET /state (stdlib only: no client libraries).

Figures are allocations (what pods were given), not measured use: the device plugin's /metrics has what they use.
A pod's figures count its app containers and native sidecars, which run together (an init container's GPUs are
handed back before the app starts); percentages are of the node's or GPU's capacity.
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kube_vgpu.extender.quota.cli import _table


class StateFormatError(ValueError):
    """The /state document does not have the shape this command reads; the message says where."""


@dataclass(slots=True)
class Gpu:
    node: str
    index: int
    uuid: str
    model: str
    healthy: bool
    memory_mib: int
    used_memory_mib: int
    cores: int
    used_cores: int
    max_shares: int
    used_shares: int
    pods: list[str] = field(default_factory=list)


@dataclass(slots=True)
class Node:
    name: str
    heartbeat_age_s: float | None
    inventory_error: str | None
    gpus: list[Gpu]
    pods: int = 0


@dataclass(slots=True)
class Pod:
    namespace: str
    name: str
    node: str
    state: str  # bound, reserved (a bind in flight), unconfirmed
    vgpus: int
    memory_mib: int
    cores: int
    gpus: list[str]  # "<index>" per vGPU, or the UUID when the node does not list it


def _get(doc: Any, key: str, kind: type | tuple[type, ...], where: str, *, optional: bool = False) -> Any:
    if not isinstance(doc, dict):
        raise StateFormatError(f"{where} is not an object")
    value = doc.get(key)
    if value is None and optional:
        return None
    if isinstance(value, bool) and kind in (int, (int, float)):
        raise StateFormatError(f"{where}.{key} is {value!r}, expected a number")
    if not isinstance(value, kind):
        expected = "a number" if isinstance(kind, tuple) else kind.__name__
        raise StateFormatError(f"{where}.{key} is {value!r}, expected {expected}")
    return value


def parse_state(doc: Any) -> tuple[list[Node], list[Pod]]:
    """Nodes (with their GPUs and which pods hold each) and pods, from GET /state. Raises StateFormatError."""
    nodes: list[Node] = []
    by_uuid: dict[str, Gpu] = {}
    for i, raw in enumerate(_get(doc, "nodes", list, "state")):
        where = f"state.nodes[{i}]"
        name = _get(raw, "name", str, where)
        gpus = []
        for j, g in enumerate(_get(raw, "gpus", list, where)):
            at = f"{where}.gpus[{j}]"
            gpu = Gpu(name, _get(g, "index", int, at), _get(g, "uuid", str, at), _get(g, "model", str, at),
                      _get(g, "healthy", bool, at), _get(g, "memoryMiB", int, at), _get(g, "usedMemoryMiB", int, at),
                      _get(g, "cores", int, at), _get(g, "usedCores", int, at), _get(g, "maxShares", int, at),
                      _get(g, "usedShares", int, at))
            gpus.append(gpu)
            by_uuid[gpu.uuid] = gpu
        age = _get(raw, "heartbeatAgeSeconds", (int, float), where, optional=True)
        nodes.append(Node(name, None if age is None else float(age),
                          _get(raw, "inventoryError", str, where, optional=True), gpus))
    nodes_by_name = {node.name: node for node in nodes}
    pods: list[Pod] = []
    for i, raw in enumerate(_get(doc, "assignments", list, "state")):
        where = f"state.assignments[{i}]"
        namespace, _, name = _get(raw, "pod", str, where).partition("/")
        node_name = _get(raw, "node", str, where)
        containers = _get(raw, "containers", list, where)
        running = [c for c in containers if not _get(c, "init", bool, f"{where}.containers")
                   or _get(c, "sidecar", bool, f"{where}.containers", optional=True)]
        memory = cores = 0
        held: list[str] = []
        for c in running or containers:  # an assignment of init containers only: what they hold
            for k, d in enumerate(_get(c, "devices", list, f"{where}.containers")):
                at = f"{where}.containers.devices[{k}]"
                uuid = _get(d, "uuid", str, at)
                memory += _get(d, "memoryMiB", int, at)
                cores += _get(d, "cores", int, at)
                holding = by_uuid.get(uuid)
                held.append(str(holding.index) if holding is not None and holding.node == node_name else uuid)
                if holding is not None and f"{namespace}/{name}" not in holding.pods:
                    holding.pods.append(f"{namespace}/{name}")
        bound, confirmed = _get(raw, "bound", bool, where), _get(raw, "confirmed", bool, where)
        state = "bound" if bound and confirmed else "binding" if confirmed or bound else "reserved"
        pods.append(Pod(namespace, name, node_name, state, len(held), memory, cores, held))
        if node_name in nodes_by_name:
            nodes_by_name[node_name].pods += 1
    return nodes, pods


def _percent(used: int, total: int) -> str:
    return f"{100 * used // total}%" if total else "-"


def render_nodes(nodes: list[Node], sort_by: str) -> str:
    columns = ("NODE", "GPUS", "UNHEALTHY", "MEMORY(MiB)", "MEMORY%", "CORES%", "VGPUS", "PODS", "HEARTBEAT")
    rows = []
    keyed = []
    for node in nodes:
        memory = sum(g.used_memory_mib for g in node.gpus)
        memory_total = sum(g.memory_mib for g in node.gpus)
        cores = sum(g.used_cores for g in node.gpus)
        cores_total = sum(g.cores for g in node.gpus)
        heartbeat = "-" if node.heartbeat_age_s is None else f"{node.heartbeat_age_s:.0f}s"
        row = (node.name, str(len(node.gpus)), str(sum(not g.healthy for g in node.gpus)),
               f"{memory}/{memory_total}", _percent(memory, memory_total), _percent(cores, cores_total),
               f"{sum(g.used_shares for g in node.gpus)}/{sum(g.max_shares for g in node.gpus)}", str(node.pods),
               heartbeat)
        fraction = {"memory": memory / memory_total if memory_total else 0.0,
                    "cores": cores / cores_total if cores_total else 0.0}.get(sort_by, 0.0)
        keyed.append((-fraction if sort_by != "name" else 0.0, node.name, row))
    rows = [row for *_, row in sorted(keyed)]
    notes = [f"node {n.name}: GPU inventory ignored: {n.inventory_error}" for n in nodes if n.inventory_error]
    return _join(_table(columns, rows, {1, 2, 4, 5, 7, 8}), notes)


def render_gpus(nodes: list[Node], sort_by: str, node_filter: str | None) -> str:
    columns = ("NODE", "GPU", "MODEL", "HEALTH", "MEMORY(MiB)", "MEMORY%", "CORES%", "VGPUS", "PODS")
    keyed = []
    for node in nodes:
        if node_filter is not None and node.name != node_filter:
            continue
        for g in node.gpus:
            row = (node.name, str(g.index), g.model, "ok" if g.healthy else "unhealthy",
                   f"{g.used_memory_mib}/{g.memory_mib}", _percent(g.used_memory_mib, g.memory_mib),
                   _percent(g.used_cores, g.cores), f"{g.used_shares}/{g.max_shares}", ",".join(g.pods) or "-")
            fraction = {"memory": g.used_memory_mib / g.memory_mib if g.memory_mib else 0.0,
                        "cores": g.used_cores / g.cores if g.cores else 0.0}.get(sort_by, 0.0)
            keyed.append((-fraction if sort_by != "name" else 0.0, node.name, g.index, row))
    if not keyed:
        return "no GPUs" + (f" on node {node_filter}" if node_filter is not None else "")
    return _join(_table(columns, [row for *_, row in sorted(keyed)], {1, 5, 6}), [])


def render_pods(pods: list[Pod], sort_by: str, namespace: str | None) -> str:
    columns = ("NAMESPACE", "POD", "NODE", "GPUS", "VGPUS", "MEMORY(MiB)", "CORES", "STATE")
    chosen = [p for p in pods if namespace is None or p.namespace == namespace]
    if not chosen:
        return "no pods hold GPUs" + (f" in namespace {namespace}" if namespace is not None else "")
    key: Callable[[Pod], tuple[Any, ...]] = {
        "memory": lambda p: (-p.memory_mib, p.namespace, p.name),
        "cores": lambda p: (-p.cores, p.namespace, p.name),
    }.get(sort_by, lambda p: (p.namespace, p.name))
    rows = [(p.namespace, p.name, p.node, ",".join(p.gpus), str(p.vgpus), str(p.memory_mib), f"{p.cores}%", p.state)
            for p in sorted(chosen, key=key)]
    return _join(_table(columns, rows, {4, 5, 6}), [])


def _join(lines: Sequence[str], notes: Sequence[str]) -> str:
    return "\n".join([*lines, *(["", *notes] if notes else [])])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="top_command", required=True, metavar="WHAT")
    for name, text in (("nodes", "per node: GPUs, memory and compute assigned, vGPUs, pods, heartbeat age"),
                       ("gpus", "per GPU: memory and compute assigned, vGPUs, health, the pods sharing it"),
                       ("pods", "per pod holding GPUs: which GPUs, vGPUs, memory and compute")):
        command = sub.add_parser(name, help=text, description=text)
        command.add_argument("--extender-url", default="http://127.0.0.1:8888",
                             help="the extender's HTTP address (default http://127.0.0.1:8888; e.g. through "
                                  "`kubectl port-forward`)")
        command.add_argument("--sort-by", choices=("name", "memory", "cores"), default="name",
                             help="order (memory, cores: the most assigned first)")
        command.add_argument("--timeout-seconds", type=float, default=10.0)
        if name == "gpus":
            command.add_argument("--node", help="only this node's GPUs")
        if name == "pods":
            command.add_argument("--namespace", "-n", help="only pods in this namespace")


def fetch_state(url: str, timeout_s: float) -> Any:
    with urllib.request.urlopen(url.rstrip("/") + "/state", timeout=timeout_s) as response:
        return json.loads(response.read())


def run(args: argparse.Namespace) -> int:
    where = f"{args.extender_url.rstrip('/')}/state"
    try:
        doc = fetch_state(args.extender_url, args.timeout_seconds)
        nodes, pods = parse_state(doc)
    except urllib.error.HTTPError as exc:
        body = exc.read().decode(errors="replace")
        print(f"kube-vgpu top: {where} answered {exc.code}: {body}", file=sys.stderr)
        return 1
    except StateFormatError as exc:
        print(f"kube-vgpu top: {where} is not an extender's state: {exc}", file=sys.stderr)
        return 1
    except (urllib.error.URLError, OSError, ValueError) as exc:
        print(f"kube-vgpu top: cannot read {where}: {exc}", file=sys.stderr)
        return 1
    if args.top_command == "nodes":
        print(render_nodes(nodes, args.sort_by))
    elif args.top_command == "gpus":
        print(render_gpus(nodes, args.sort_by, args.node))
    else:
        print(render_pods(pods, args.sort_by, args.namespace))
    if isinstance(doc, dict) and doc.get("synced") is False:
        print("note: the extender has not finished its first sync with the API server", file=sys.stderr)
    return 0
