"""Synthetic clusters: `kube-vgpu cluster synth` writes a snapshot (`kind: List` of Nodes and Pods)
whose Node annotations are what the device plugin publishes for the same hardware.

The nodes and pods come from kube_vgpu.dev.fixtures, which the dev cluster, demo, tests and benchmarks use too.
"""

from __future__ import annotations

import argparse
import datetime as dt
import random
import sys
from typing import Any

import orjson

from kube_vgpu import protocol
from kube_vgpu.dev.fixtures import TOPOLOGIES, gpu_pod_object, node_object, synth_inventory
from kube_vgpu.extender.engine.fit import place
from kube_vgpu.extender.engine.model import NodeState, Placement, PlacementRequest, assignment_from_placement
from kube_vgpu.extender.engine.policies import make_policy


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
