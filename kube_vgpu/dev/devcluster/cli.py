"""`kube-vgpu dev-cluster up|down`: a local control plane with simulated GPU nodes.

    kube-vgpu dev-cluster up [--nodes N] [--gpus-per-node G] [--gpu-model NAME] [--gpu-memory-mib M]
                             [--topology nvswitch|nvlink-pairs|pcie] [--no-lifecycle] [--kueue] [--prometheus]
                             [--state-dir DIR]
    kube-vgpu dev-cluster down [--state-dir DIR]

`up` starts everything detached (each process in its own session), prints the kubeconfig path and an
`export KUBECONFIG=...` line on stdout (progress goes to stderr) and returns. `down` stops exactly the processes
`up` recorded in the state dir; files stay (logs in <state-dir>/logs).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kube_vgpu.dev.devcluster.cluster import (
    DEFAULT_HEARTBEAT_INTERVAL_S,
    ClusterOptions,
    ComponentError,
    DevClusterError,
    NodeGroup,
    default_state_dir,
    down,
    sigterm_as_interrupt,
    up,
)
from kube_vgpu.dev.fixtures import TOPOLOGIES


def _progress(message: str) -> None:
    print(f">> {message}", file=sys.stderr, flush=True)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="dev_cluster_command", required=True, metavar="{up,down}")
    start = sub.add_parser("up", help="start a dev cluster and return (processes keep running)")
    start.add_argument("--nodes", type=int, default=4, help="GPU nodes to register (default: %(default)s)")
    start.add_argument("--gpus-per-node", type=int, default=8, help="default: %(default)s")
    start.add_argument("--gpu-model", default="NVIDIA A100-SXM4-80GB", help="default: %(default)s")
    start.add_argument("--gpu-memory-mib", type=int, default=81920, help="default: %(default)s")
    start.add_argument("--topology", choices=TOPOLOGIES, default="nvswitch", help="default: %(default)s")
    start.add_argument("--no-webhook", action="store_true", help="do not run or register the admission webhook")
    start.add_argument(
        "--no-lifecycle", action="store_true",
        help="run neither kube-controller-manager nor KWOK: no controller creates pods, bound pods stay Pending",
    )
    start.add_argument(
        "--kueue", action="store_true",
        help="also run the real Kueue controller (built from its Go module the first time, about 8 min), with its "
             "own CRDs and webhooks; the extender then leaves admission to it (quota mode kueue, docs/quota.md)",
    )
    start.add_argument(
        "--prometheus", action="store_true",
        help="also run a real Prometheus (built from its Go module the first time, a few minutes) scraping the "
             "extender, the webhook and kube-scheduler as manifests/monitoring's monitors say, with its alert rules; "
             "its HTTP API's address is printed (docs/operations.md, Monitoring)",
    )
    start.add_argument(
        "--heartbeat-seconds", type=float, default=DEFAULT_HEARTBEAT_INTERVAL_S, help="default: %(default)s"
    )
    start.add_argument("--extender-arg", action="append", default=[], metavar="ARG",
                       help="extra argument for `kube-vgpu extender` (repeatable), e.g. --extender-arg=--policy=spread")
    stop = sub.add_parser("down", help="stop the dev cluster started from the state dir")
    for command in (start, stop):
        command.add_argument(
            "--state-dir", type=Path, default=None, help=f"default: {default_state_dir()}"
        )


def run(args: argparse.Namespace) -> int:
    state_dir = (args.state_dir or default_state_dir()).resolve()
    if args.dev_cluster_command == "down":
        stopped = down(state_dir)
        if stopped:
            print(f"stopped {', '.join(stopped)} (state and logs kept in {state_dir})")
        else:
            print(f"nothing was running from {state_dir}")
        return 0
    if args.kueue and args.no_lifecycle:
        print("kube-vgpu dev-cluster up: --kueue needs the pod lifecycle (drop --no-lifecycle)", file=sys.stderr)
        return 2
    if args.nodes < 0 or args.gpus_per_node < 1 or args.gpu_memory_mib < 1:
        print("kube-vgpu dev-cluster up: --nodes must be >= 0, --gpus-per-node and --gpu-memory-mib >= 1",
              file=sys.stderr)
        return 2
    group = NodeGroup(
        count=args.nodes,
        gpus=args.gpus_per_node,
        model=args.gpu_model,
        memory_mib=args.gpu_memory_mib,
        topology=args.topology,
    )
    options = ClusterOptions(
        state_dir=state_dir,
        node_groups=(group,),
        webhook=not args.no_webhook,
        lifecycle=not args.no_lifecycle,
        kueue=args.kueue,
        prometheus=args.prometheus,
        extender_args=tuple(args.extender_arg),
        heartbeat_interval_s=args.heartbeat_seconds,
        progress=_progress,
    )
    try:
        with sigterm_as_interrupt():
            cluster = up(options)
    except KeyboardInterrupt:
        print("kube-vgpu dev-cluster up: interrupted; everything it had started was stopped again", file=sys.stderr)
        return 130
    except DevClusterError as exc:
        print(f"kube-vgpu dev-cluster up failed: {exc}", file=sys.stderr)
        if isinstance(exc, ComponentError):
            print("(every process this start-up had started was stopped again)", file=sys.stderr)
        return 1
    print(f"kubeconfig: {cluster.kubeconfig}")
    print(f"extender: {cluster.extender_url}   logs: {cluster.log_dir}")
    if cluster.prometheus_url is not None:
        print(f"prometheus: {cluster.prometheus_url} (HTTP API; e.g. kube-vgpu usage --prometheus-url "
              f"{cluster.prometheus_url} --start ...)")
    print(f"stop it with: kube-vgpu dev-cluster down --state-dir {state_dir}")
    print(f"export KUBECONFIG={cluster.kubeconfig}")
    return 0
