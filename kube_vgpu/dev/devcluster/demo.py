"""`kube-vgpu demo`: a dev cluster with mixed GPU nodes, a sample workload, and where everything landed.

Starts (building the Kubernetes binaries on the very first run) a dev cluster with 2 x 8 H100 (NVSwitch),
2 x 4 A100 (NVLink pairs) and 2 x 4 T4 (PCIe), creates fractional, multi-GPU and type-selected pods plus one
that cannot fit anywhere, waits until each is bound or refused, and prints: pod -> node -> GPUs, per-GPU
utilisation, and why the unfit pod is Pending (our extender's reason, as kube-scheduler recorded it in the pod's
FailedScheduling event). Then stops the cluster, unless --keep.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kube_vgpu import protocol
from kube_vgpu.dev.devcluster.cluster import (
    ClusterOptions,
    ComponentError,
    DevCluster,
    DevClusterError,
    NodeGroup,
    sigterm_as_interrupt,
    up,
)
from kube_vgpu.dev.devcluster.workload import (
    Outcome,
    create_pods,
    ensure_namespace,
    gpu_pod,
    gpu_usage,
    list_all,
    short_uuid,
    wait_for_pods,
)

NAMESPACE = "demo"
WAIT_S = 120.0

NODE_GROUPS = (
    NodeGroup(count=2, gpus=8, model="NVIDIA H100 80GB HBM3", memory_mib=81559, topology="nvswitch", prefix="h100"),
    NodeGroup(count=2, gpus=4, model="NVIDIA A100 80GB PCIe", memory_mib=81920, topology="nvlink-pairs",
              prefix="a100"),
    NodeGroup(count=2, gpus=4, model="Tesla T4", memory_mib=15360, topology="pcie", prefix="t4"),
)
UNFIT_POD = "too-big"


def workload() -> tuple[list[dict[str, Any]], str]:
    """The sample pods, and the name of the one that cannot fit."""
    use = protocol.ANNOTATION_USE_GPU_TYPE
    pods = [
        # fractional: 10 GiB and a quarter of a GPU each; binpack stacks them on shared GPUs
        *[gpu_pod(f"inference-{i}", memory_mib=10240, cores=25) for i in range(6)],
        # type-selected fractions: half a T4 each
        *[gpu_pod(f"notebook-t4-{i}", memory_percent=50, cores=30, annotations={use: "T4"}) for i in range(3)],
        # multi-GPU, exclusive: 4 whole H100s that must talk over NVSwitch
        *[gpu_pod(f"train-h100x4-{i}", gpus=4, cores=100, annotations={use: "H100"}) for i in range(2)],
        # 2 A100s: the topology policy picks an NVLink pair
        gpu_pod("finetune-a100x2", gpus=2, memory_mib=40960, cores=50, annotations={use: "A100"}),
        # no node has 8 A100s (they have 4): stays Pending with our extender's reason
        gpu_pod(UNFIT_POD, gpus=8, memory_mib=20480, cores=50, annotations={use: "A100"}),
    ]
    return pods, UNFIT_POD


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--keep", action="store_true", help="leave the cluster running (stop it with dev-cluster down)")
    parser.add_argument("--state-dir", type=Path, default=None, help="default: a new temporary directory")


def _progress(message: str) -> None:
    print(f">> {message}", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    start_s = time.monotonic()
    state_dir = args.state_dir or Path(tempfile.mkdtemp(prefix="kube-vgpu-demo-"))
    _progress(
        "starting a dev cluster (etcd, kube-apiserver, kube-scheduler built from the official Go modules on the "
        f"first run only; that build takes a while and reports progress) in {state_dir}"
    )
    options = ClusterOptions(
        state_dir=state_dir, node_groups=NODE_GROUPS, die_with_parent=not args.keep, progress=_progress
    )
    with sigterm_as_interrupt():
        try:
            cluster = up(options)
        except DevClusterError as exc:
            print(f"kube-vgpu demo: the dev cluster did not start: {exc}", file=sys.stderr)
            if isinstance(exc, ComponentError):
                print("(every process it had started was stopped again)", file=sys.stderr)
            return 1
        try:
            ok = _run_workload(cluster)
        finally:
            if args.keep:
                print(f"\nthe cluster keeps running: export KUBECONFIG={cluster.kubeconfig}")
                print(f"stop it with: kube-vgpu dev-cluster down --state-dir {cluster.state_dir}")
            else:
                cluster.stop()
                _progress("dev cluster stopped")
    _progress(f"demo done in {time.monotonic() - start_s:.0f} s")
    return 0 if ok else 1


def _run_workload(cluster: DevCluster) -> bool:
    api = cluster.api
    ensure_namespace(api, NAMESPACE)
    pods, unfit = workload()
    _progress(f"creating {len(pods)} pods in namespace {NAMESPACE} (the webhook routes them to kube-vgpu-scheduler)")
    create_pods(api, NAMESPACE, pods)
    names = [pod["metadata"]["name"] for pod in pods]
    outcome = wait_for_pods(api, NAMESPACE, names, timeout_s=WAIT_S, expect_refused=[unfit])
    nodes = list_all(api, "nodes")
    print()
    print(render(outcome, nodes, names))
    placed = [name for name in names if name != unfit]
    ok = all(name in outcome.bound for name in placed) and unfit in outcome.refused
    if not ok:
        print(f"\nkube-vgpu demo: not every pod reached its expected state within {WAIT_S:g} s: "
              f"{outcome.describe()}", file=sys.stderr)
        print(f"extender log tail:\n{cluster.log_tail('extender')}", file=sys.stderr)
    return ok


def _table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(cell)) for cell in column) for column in zip(headers, *rows, strict=False)]
    lines = ["  ".join(header.ljust(width) for header, width in zip(headers, widths, strict=True))]
    lines += ["  ".join(str(cell).ljust(width) for cell, width in zip(row, widths, strict=True)) for row in rows]
    return "\n".join(line.rstrip() for line in lines)


def _bar(fraction: float, width: int = 10) -> str:
    filled = round(max(0.0, min(1.0, fraction)) * width)
    return "#" * filled + "." * (width - filled)


def render(outcome: Outcome, nodes: list[dict[str, Any]], names: list[str]) -> str:
    gpus = gpu_usage(nodes, outcome.pods.values())
    index_of: dict[str, int] = {}
    for node in nodes:
        text = ((node.get("metadata") or {}).get("annotations") or {}).get(protocol.NODE_INVENTORY_ANNOTATION)
        if text:
            index_of.update({gpu.uuid: gpu.index for gpu in protocol.decode_inventory(text).gpus})

    placement_rows: list[list[str]] = []
    for name in names:
        pod = outcome.pods.get(name)
        if name not in outcome.bound or pod is None:
            placement_rows.append([name, "(pending)", "", "", ""])
            continue
        annotation = (pod["metadata"].get("annotations") or {}).get(protocol.POD_ASSIGNMENT_ANNOTATION)
        if not annotation:
            placement_rows.append([name, outcome.bound[name], "(no assignment annotation!)", "", ""])
            continue
        devices = protocol.decode_assignment(annotation).all_devices()
        for position, device in enumerate(devices):
            gpu = gpus.get(device.uuid)
            model = gpu.model if gpu else "?"
            placement_rows.append(
                [
                    name if position == 0 else "",
                    outcome.bound[name] if position == 0 else "",
                    f"#{index_of.get(device.uuid, '?')} {short_uuid(device.uuid)} {model}",
                    f"{device.memory_mib} MiB",
                    f"{device.cores}%",
                ]
            )
    sections = ["Placements (pod -> node -> GPUs: index, UUID, model, memory, compute)",
                _table(["POD", "NODE", "GPU", "MEMORY", "COMPUTE"], placement_rows)]

    usage_rows = []
    busy_nodes = {use.node for use in gpus.values() if use.vgpus}
    idle_nodes = sorted({use.node for use in gpus.values()} - busy_nodes)
    for use in sorted(gpus.values(), key=lambda g: (g.node, index_of.get(g.uuid, 0))):
        if use.node not in busy_nodes:
            continue
        memory_fraction = use.used_memory_mib / use.memory_mib if use.memory_mib else 0.0
        usage_rows.append(
            [
                use.node,
                f"#{index_of.get(use.uuid, '?')}",
                short_uuid(use.uuid),
                use.model,
                f"{_bar(memory_fraction)} {use.used_memory_mib}/{use.memory_mib} MiB",
                f"{_bar(use.used_cores / use.cores if use.cores else 0.0)} {use.used_cores}%",
                str(use.vgpus),
            ]
        )
    sections += ["", "Per-GPU utilisation (from the pods' kube-vgpu.io/gpu-assignment annotations)",
                 _table(["NODE", "GPU", "UUID", "MODEL", "MEMORY", "COMPUTE", "PODS"], usage_rows)]
    if idle_nodes:
        sections.append(f"(all GPUs idle on {', '.join(idle_nodes)})")

    pending = [name for name in names if name not in outcome.bound]
    if pending:
        sections += ["", "Pending pods (kube-scheduler's FailedScheduling event):"]
        for name in pending:
            sections.append(f"  {name}: {outcome.refused.get(name, '(no FailedScheduling event yet)')}")
    return "\n".join(sections)
