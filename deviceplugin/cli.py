"""`kube-vgpu device-plugin`: run the device plugin on a GPU node."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from typing import Any

from kube_vgpu import protocol
from kube_vgpu.deviceplugin.allocate import DEVICE_LIST_STRATEGIES, DeliveryConfig
from kube_vgpu.deviceplugin.fakenvml import profile_names
from kube_vgpu.deviceplugin.foreign import DEFAULT_POD_RESOURCES_SOCKET, PodResourcesClient
from kube_vgpu.deviceplugin.health import APPLICATION_XIDS
from kube_vgpu.deviceplugin.limiter_install import DEFAULT_HOST_DIR
from kube_vgpu.deviceplugin.publisher import DEFAULT_HEARTBEAT_SECONDS
from kube_vgpu.deviceplugin.server import DEFAULT_KUBELET_DIR

log = logging.getLogger("deviceplugin")


def _xids(text: str) -> frozenset[int]:
    try:
        return frozenset(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated XID numbers, got {text!r}") from None


def _strategies(text: str) -> tuple[str, ...]:
    chosen = tuple(part.strip() for part in text.split(",") if part.strip())
    bad = [item for item in chosen if item not in DEVICE_LIST_STRATEGIES]
    if bad or not chosen:
        raise argparse.ArgumentTypeError(f"choose from {', '.join(DEVICE_LIST_STRATEGIES)}, got {text!r}")
    return chosen


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--node-name", default=os.environ.get("NODE_NAME"), help="this node's name (default: $NODE_NAME)"
    )
    parser.add_argument(
        "--fake-nvml",
        metavar="PROFILE",
        help=f"use made-up GPUs instead of NVML: {', '.join(profile_names())}",
    )
    parser.add_argument("--kubelet-dir", default=DEFAULT_KUBELET_DIR, help="kubelet's device-plugin directory")
    parser.add_argument("--kubeconfig", help="kubeconfig file (default: in-cluster service account if any)")
    parser.add_argument(
        "--sharing-count",
        type=int,
        default=protocol.DEFAULT_MAX_VGPUS_PER_GPU,
        help="vGPUs each physical GPU may be split into (device IDs advertised per GPU)",
    )
    parser.add_argument(
        "--heartbeat-seconds", type=float, default=DEFAULT_HEARTBEAT_SECONDS, help="heartbeat annotation interval"
    )
    parser.add_argument("--probe-address", default=":8081", help="host:port for /healthz and /readyz ('' = off)")
    parser.add_argument(
        "--metrics-address",
        default=None,
        help="host:port for /metrics: GPU utilisation, memory, temperature, power, ECC and XID counts, and each "
        "container's real use from the limiter's shared cache (default: the probe address, served beside the "
        "probes; '' = off)",
    )
    parser.add_argument(
        "--pod-resources-socket",
        default=DEFAULT_POD_RESOURCES_SOCKET,
        help="kubelet pod-resources socket, to find GPUs held by pods kube-vgpu did not place ('' = off)",
    )
    parser.add_argument(
        "--limiter-library",
        default=protocol.DEFAULT_LIMITER_LIBRARY_PATH,
        help="limiter library on the node, mounted read-only into GPU containers ('' = not mounted)",
    )
    parser.add_argument(
        "--limiter-dir",
        default=str(DEFAULT_HOST_DIR),
        help="where `kube-vgpu limiter install` (the init container) installs the limiter; while the installed "
        "library matches its checksum the node carries --limiter-label ('' = never: the label is removed)",
    )
    parser.add_argument(
        "--limiter-label",
        default=protocol.LABEL_LIMITER,
        help="node label saying the limiter is installed (the webhook's node affinity requires it); '' = the plugin "
        "leaves it alone (e.g. set by hand where the library is installed another way)",
    )
    parser.add_argument(
        "--ld-so-preload", default="", help="node file mounted at /etc/ld.so.preload in GPU containers ('' = off)"
    )
    parser.add_argument(
        "--kubelet-pods-dir",
        default="",
        help="kubelet's pods directory (/var/lib/kubelet/pods), read for the limiter's shared cache in each GPU "
        "pod's cache emptyDir, for per-container usage metrics ('' = off)",
    )
    parser.add_argument(
        "--shared-cache-dir",
        default="/usr/local/vgpu/containers",
        help="host directory for the limiter's per-container shared cache ('' = off)",
    )
    parser.add_argument(
        "--device-list-strategy",
        type=_strategies,
        default=("envvar",),
        help=f"how containers learn their GPUs, comma-separated: {', '.join(DEVICE_LIST_STRATEGIES)}",
    )
    parser.add_argument(
        "--ignored-xids",
        type=_xids,
        default=APPLICATION_XIDS,
        help="application-level XIDs that do not make a GPU unhealthy (default: 13,31,43,45,68,109)",
    )
    parser.add_argument(
        "--require-admission-mark",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Allocate only for pods the webhook admitted (kube-vgpu.io/admitted); a pod that skipped it has no "
        "limiter wiring (default: on)",
    )
    parser.add_argument(
        "--dynamic-mig",
        metavar="all|INDEXES",
        help="dynamic MIG: partition these MIG-capable GPUs (all, or indexes like 0,1) per pod, with the profiles "
        "--dynamic-mig-profiles allows for their model (default: the node's kube-vgpu.io/dynamic-mig label when "
        "--dynamic-mig-profiles is given, else off)",
    )
    parser.add_argument(
        "--dynamic-mig-profiles",
        default="",
        metavar="MODEL=PROFILE,...;...",
        help="dynamic MIG's allowlist per GPU model, e.g. 'A100-40GB=1g.5gb,3g.20gb;H100-80GB=1g.10gb,3g.40gb' "
        "(models and profiles of NVIDIA's tables: A100-40GB, A100-80GB, H100-80GB, H200-141GB)",
    )
    parser.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not args.node_name:
        print("kube-vgpu device-plugin: --node-name (or $NODE_NAME) is required", file=sys.stderr)
        return 2
    if args.sharing_count < 1 or args.heartbeat_seconds <= 0:
        print("kube-vgpu device-plugin: --sharing-count must be >= 1 and --heartbeat-seconds > 0", file=sys.stderr)
        return 2

    from kube_vgpu.deviceplugin.app import Cluster, DevicePluginApp, PluginConfig, split_address

    metrics_address = args.probe_address if args.metrics_address is None else args.metrics_address
    for flag, address in (("--probe-address", args.probe_address), ("--metrics-address", metrics_address)):
        if address:
            try:
                split_address(address)
            except ValueError as exc:
                print(f"kube-vgpu device-plugin: {flag}: {exc}", file=sys.stderr)
                return 2
    from kube_vgpu.deviceplugin.dynmig import DynamicMigConfig, parse_gpus, parse_profiles

    dynamic_mig: DynamicMigConfig | None = None
    if args.dynamic_mig or args.dynamic_mig_profiles:
        # --dynamic-mig-profiles alone: the GPUs come from the node's label kube-vgpu.io/dynamic-mig
        try:
            dynamic_mig = DynamicMigConfig(parse_profiles(args.dynamic_mig_profiles),
                                           parse_gpus(args.dynamic_mig) if args.dynamic_mig else None,
                                           from_node_label=not args.dynamic_mig)
        except ValueError as exc:
            print(f"kube-vgpu device-plugin: --dynamic-mig/--dynamic-mig-profiles: {exc}", file=sys.stderr)
            return 2
        if not dynamic_mig.profiles:
            print("kube-vgpu device-plugin: --dynamic-mig needs --dynamic-mig-profiles", file=sys.stderr)
            return 2
    from kube_vgpu.deviceplugin.kube import KubeClient, load_api_client
    from kube_vgpu.deviceplugin.nvml import open_nvml

    try:
        nvml = open_nvml(args.fake_nvml, args.node_name)
    except ValueError as exc:
        print(f"kube-vgpu device-plugin: {exc}", file=sys.stderr)
        return 2
    cluster: Cluster | None = None
    api_client: Any = load_api_client(args.kubeconfig)
    if api_client is not None:
        cluster = KubeClient(api_client, host=args.node_name)
    holders = PodResourcesClient(args.pod_resources_socket) if args.pod_resources_socket and cluster else None
    config = PluginConfig(
        node_name=args.node_name,
        kubelet_dir=args.kubelet_dir,
        sharing_count=args.sharing_count,
        heartbeat_seconds=args.heartbeat_seconds,
        ignored_xids=args.ignored_xids,
        probe_address=args.probe_address,
        metrics_address=metrics_address,
        kubelet_pods_dir=args.kubelet_pods_dir,
        limiter_label=args.limiter_label,
        limiter_dir=args.limiter_dir,
        limiter_simulated=bool(args.fake_nvml),
        dynamic_mig=dynamic_mig,
        delivery=DeliveryConfig(
            limiter_library_path=args.limiter_library,
            ld_so_preload_path=args.ld_so_preload,
            cache_host_dir=args.shared_cache_dir,
            device_list_strategies=args.device_list_strategy,
            # fake GPUs have no limiter on this machine to check for: deliver the configured paths as they are
            check_host_paths=not args.fake_nvml,
            require_admission_mark=args.require_admission_mark,
        ),
    )
    app = DevicePluginApp(config, nvml, cluster, holders)
    stopped = threading.Event()

    def on_signal(signum: int, _frame: Any) -> None:
        log.info("signal %d: shutting down", signum)
        stopped.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    app.start()
    try:
        while not stopped.wait(1.0):
            if not app.alive():
                log.error("a device plugin loop died; exiting so the DaemonSet restarts the pod")
                app.stop()
                return 1
    finally:
        if not app.stop_event.is_set():
            app.stop()
    return 0
