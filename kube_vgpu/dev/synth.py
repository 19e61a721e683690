"""Synthetic clusters: `kube-vgpu cluster synth` writes a snapshot (`kind: List` of Nodes and Pods)
whose Node annotations are what the device plugin publishes for the same hardware.

`node_object` is also what the dev cluster registers, so demo, tests and benchmarks all see nodes
built by one code path.
"""

from __future__ import annotations

import argparse
import datetime as dt
import random
import sys
from typing import Any

import orjson

from kube_vgpu import protocol
from kube_vgpu.deviceplugin.discovery import discover
from kube_vgpu.deviceplugin.fakenvml import FakeNvml, layout_hardware, profile_uuid
from kube_vgpu.deviceplugin.nvml import Nvml
from kube_vgpu.deviceplugin.publisher import inventory_annotations, node_labels
from kube_vgpu.extender.engine.fit import place
from kube_vgpu.extender.engine.model import NodeState, Placement, PlacementRequest, assignment_from_placement
from kube_vgpu.extender.engine.policies import make_policy
from kube_vgpu.protocol import NodeInventory

TOPOLOGIES = ("nvswitch", "nvlink-pairs", "pcie")


def synth_inventory(
    node_name: str,
    gpus: int,
    model: str,
    memory_mib: int,
    topology: str = "nvswitch",
    max_shares: int = protocol.DEFAULT_MAX_SHARES,
) -> NodeInventory:
    """Hardware description of a synthetic node: half the GPUs on each of two NUMA nodes, two GPUs per
    PCIe switch, NVLink per `topology`.

    One code path with the device plugin: this builds fake NVML hardware with that layout and runs the device
    plugin's own discovery on it, so a synthetic node carries exactly the inventory a real node with that
    hardware publishes (deviceplugin.fakenvml.layout_hardware, deviceplugin.discovery.discover)."""
    if topology not in TOPOLOGIES:
        raise ValueError(f"unknown topology {topology!r}; choose one of {', '.join(TOPOLOGIES)}")
    # imported here: the device plugin package imports this module (UUID derivation), not the other way round

    hardware = layout_hardware([synth_uuid(node_name, index) for index in range(gpus)], model, memory_mib, topology)
    return discover(Nvml(FakeNvml(hardware)), sharing_count=max_shares).inventory


def synth_uuid(node_name: str, index: int) -> str:
    """Stable, unique-looking GPU UUID derived from node name and index (the fake NVML's derivation)."""
    return profile_uuid(node_name, index)


def node_object(
    name: str,
    inventory: NodeInventory,
    *,
    heartbeat: dt.datetime | None = None,
    cpu_milli: int = 64000,
    memory_mib: int = 512 * 1024,
    pods: int = 110,
    extra_labels: dict[str, str] | None = None,
) -> dict[str, Any]:
    """A Node API object carrying the inventory annotations exactly as the device plugin writes them
    (the device plugin's publisher functions encode both)."""

    moment = heartbeat or dt.datetime.now(dt.UTC)
    resources = {
        "cpu": f"{cpu_milli}m",
        "memory": f"{memory_mib}Mi",
        "pods": str(pods),
        protocol.RESOURCE_GPU: str(sum(g.max_shares for g in inventory.gpus)),
    }
    labels = {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux", **node_labels(inventory)}
    labels.update(extra_labels or {})
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": labels,
            "annotations": inventory_annotations(inventory, moment),
        },
        "spec": {},
        "status": {
            "capacity": dict(resources),
            "allocatable": dict(resources),
            "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady"}],
        },
    }


def gpu_pod_object(
    name: str,
    *,
    namespace: str = "default",
    gpus: int = 1,
    memory_mib: int | None = None,
    cores: int | None = None,
    node_name: str | None = None,
    assignment: protocol.PodAssignment | None = None,
    uid: str | None = None,
) -> dict[str, Any]:
    limits: dict[str, str] = {protocol.RESOURCE_GPU: str(gpus)}
    if memory_mib is not None:
        limits[protocol.RESOURCE_GPU_MEMORY] = str(memory_mib)
    if cores is not None:
        limits[protocol.RESOURCE_GPU_CORES] = str(cores)
    pod: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "uid": uid or f"uid-{namespace}-{name}", "annotations": {}},
        "spec": {
            "schedulerName": protocol.DEFAULT_SCHEDULER_NAME,
            "containers": [
                {"name": "main", "image": "busybox", "resources": {"limits": limits, "requests": dict(limits)}}
            ],
        },
        "status": {"phase": "Pending"},
    }
    if node_name:
        pod["spec"]["nodeName"] = node_name
        pod["status"]["phase"] = "Running"
    if assignment is not None:
        pod["metadata"]["annotations"][protocol.POD_ASSIGNMENT_ANNOTATION] = protocol.encode_assignment(assignment)
    return pod


def synth_cluster(
    nodes: int,
    gpus_per_node: int,
    gpu_model: str,
    gpu_memory_mib: int,
    topology: str = "nvswitch",
    pods_per_node: int = 0,
    seed: int = 1,
) -> dict[str, Any]:
    """A snapshot List. With pods_per_node > 0, each node gets that many bound fractional pods,
    placed by the engine's binpack policy so their assignments are valid."""

    rng = random.Random(seed)
    moment = dt.datetime.now(dt.UTC)
    items: list[dict[str, Any]] = []
    policy = make_policy("binpack")
    for node_number in range(nodes):
        name = f"gpu-node-{node_number:05d}"
        inventory = synth_inventory(name, gpus_per_node, gpu_model, gpu_memory_mib, topology)
        items.append(node_object(name, inventory, heartbeat=moment))
        if not pods_per_node:
            continue
        state = NodeState(name, inventory)
        for pod_number in range(pods_per_node):
            memory = rng.choice((1024, 2048, 4096, 8192))
            cores = rng.choice((5, 10, 20))
            pod_name = f"{name}-pod-{pod_number}"
            pod = gpu_pod_object(pod_name, memory_mib=memory, cores=cores)
            placement = place(state, PlacementRequest(protocol.parse_pod_gpu_request(pod)), policy, policy)
            if not isinstance(placement, Placement):
                break
            state.apply_usage(placement.usage)
            assignment = assignment_from_placement(state, placement)
            items.append(
                gpu_pod_object(pod_name, memory_mib=memory, cores=cores, node_name=name, assignment=assignment)
            )
    return {"apiVersion": "v1", "kind": "List", "items": items}


# --- CLI: kube-vgpu cluster synth ---------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="cluster_command", required=True)
    synth = sub.add_parser("synth", help="write a synthetic snapshot (kind: List of Nodes and Pods)")
    synth.add_argument("--nodes", type=int, required=True)
    synth.add_argument("--gpus-per-node", type=int, default=8)
    synth.add_argument("--gpu-model", default="NVIDIA-A100-SXM4-80GB")
    synth.add_argument("--gpu-memory-mib", type=int, default=81920)
    synth.add_argument("--topology", choices=TOPOLOGIES, default="nvswitch")
    synth.add_argument("--pods-per-node", type=int, default=0)
    synth.add_argument("--seed", type=int, default=1)
    synth.add_argument("-o", "--output", default="-", help="file to write (JSON; .yaml/.yml writes YAML); - = stdout")


def run(args: argparse.Namespace) -> int:
    if args.nodes < 0 or args.gpus_per_node < 1 or args.gpu_memory_mib < 1:
        print(
            "kube-vgpu cluster synth: --nodes must be >= 0, --gpus-per-node and --gpu-memory-mib >= 1", file=sys.stderr
        )
        return 2
    snapshot = synth_cluster(
        args.nodes,
        args.gpus_per_node,
        args.gpu_model,
        args.gpu_memory_mib,
        args.topology,
        args.pods_per_node,
        args.seed,
    )
    if args.output.endswith((".yaml", ".yml")):
        import yaml

        data = yaml.safe_dump(snapshot, sort_keys=False).encode()
    else:
        data = orjson.dumps(snapshot, option=orjson.OPT_INDENT_2)
    if args.output == "-":
        sys.stdout.buffer.write(data)
    else:
        with open(args.output, "wb") as handle:
            handle.write(data)
        print(f"wrote {args.output}: {args.nodes} nodes", file=sys.stderr)
    return 0
