"""The dev cluster's stand-in for the device plugins' heartbeat: the nodes have no kubelet and no device plugin,
so this process re-publishes each registered node's heartbeat annotation every interval, through the same client
call the device plugin's publisher makes (deviceplugin.kube.KubeClient.patch_node_metadata), under the device
plugin's ClusterRole (the manifests' RBAC is exercised too). Its account is the dev cluster's own
(kube-vgpu-dev-heartbeat): the device plugin's account may write only to the one node its token names (the
ValidatingAdmissionPolicies of webhook.policies), and this one process stands in for every node's device plugin.

    python -m kube_vgpu.dev.devcluster.heartbeat --kubeconfig F --nodes-file F [--interval-seconds S]

The nodes file (a JSON list of node names) is re-read every round, so nodes added later are kept fresh as well.
Patches are spread over the interval rather than sent in one burst: 1000 nodes every 10 s is a steady 100
patches/s, not a 1000-patch spike in the middle of a benchmark.
"""

from __future__ import annotations

import argparse
import datetime as dt
import logging
import signal
import sys
import threading
import time
from pathlib import Path

import orjson

from kube_vgpu import protocol

log = logging.getLogger("kube_vgpu.dev.devcluster.heartbeat")


def read_nodes(path: Path) -> list[str]:
    try:
        names = orjson.loads(path.read_bytes())
    except (OSError, orjson.JSONDecodeError):
        return []
    return [str(name) for name in names] if isinstance(names, list) else []


class HeartbeatRefused(RuntimeError):
    """The API server refuses our identity (401/403): retrying cannot help."""


def run_heartbeat(
    kubeconfig: str, nodes_file: Path, interval_s: float, stop: threading.Event, ready_file: Path | None = None
) -> None:
    """Patch every node's heartbeat each interval until `stop`. `ready_file` is created once the first patch
    went through (or at once when there are no nodes): the dev cluster waits for it, so a heartbeat that cannot
    write (RBAC, token) fails the start-up instead of letting every node go stale two minutes later."""
    from kube_vgpu.deviceplugin.kube import ApiUnavailable, Conflict, KubeClient, NotFound, load_api_client

    client = KubeClient(load_api_client(kubeconfig))

    def mark_ready() -> None:
        if ready_file is not None and not ready_file.exists():
            ready_file.touch()

    while not stop.is_set():
        round_start_s = time.monotonic()
        names = read_nodes(nodes_file)
        if not names:
            mark_ready()
        spacing_s = interval_s / max(1, len(names))
        for position, name in enumerate(names):
            if stop.wait(max(0.0, round_start_s + position * spacing_s - time.monotonic())):
                return
            beat = protocol.format_heartbeat(dt.datetime.now(dt.UTC))
            try:
                client.patch_node_metadata(name, {protocol.NODE_HEARTBEAT_ANNOTATION: beat}, {})
                mark_ready()
            except NotFound:
                pass  # deleted by a test; dropped from the file by whoever deleted it
            except (ApiUnavailable, Conflict) as exc:
                if "HTTP 401" in str(exc) or "HTTP 403" in str(exc):
                    raise HeartbeatRefused(f"the API server refuses the heartbeat's identity: {exc}") from None
                log.warning("heartbeat of node %s failed: %s", name, exc)
        stop.wait(max(0.0, round_start_s + interval_s - time.monotonic()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kube_vgpu.dev.devcluster.heartbeat")
    parser.add_argument("--kubeconfig", required=True)
    parser.add_argument("--nodes-file", required=True, type=Path)
    parser.add_argument("--interval-seconds", type=float, default=10.0)
    parser.add_argument("--ready-file", type=Path, default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    log.info("heartbeat every %.1f s for the nodes in %s", args.interval_seconds, args.nodes_file)
    try:
        run_heartbeat(args.kubeconfig, args.nodes_file, args.interval_seconds, stop, args.ready_file)
    except HeartbeatRefused as exc:
        log.error("%s", exc)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
