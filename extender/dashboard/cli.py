"""`kube-vgpu dashboard --extender URL [--listen HOST:PORT] [--prometheus URL]`."""

from __future__ import annotations

import argparse
import logging
import sys

DEFAULT_LISTEN = "127.0.0.1:8080"


def listen_address(text: str) -> tuple[str, int]:
    """argparse type: HOST:PORT (an IPv6 host in brackets) -> (host, port)."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host.strip("[]") or "0.0.0.0", int(port)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--extender", required=True, metavar="URL",
                        help="the extender's address serving GET /state and /quota: its probes port through a "
                             "Service (http://kube-vgpu-extender.kube-vgpu:8889) or a `kubectl port-forward`")
    parser.add_argument("--listen", type=listen_address, default=listen_address(DEFAULT_LISTEN),
                        metavar="HOST:PORT", help=f"where to serve the page (default {DEFAULT_LISTEN})")
    parser.add_argument("--prometheus", metavar="URL",
                        help="Prometheus with the device plugin's metrics: the pods page then shows measured use")
    parser.add_argument("--interval-seconds", type=float, default=1.0,
                        help="read the extender at most once per this many seconds, however many pages are open")
    parser.add_argument("--timeout-seconds", type=float, default=5.0, help="per upstream request")
    parser.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from kube_vgpu.extender.dashboard.server import Upstream, create_app

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.interval_seconds <= 0 or args.timeout_seconds <= 0:
        print("kube-vgpu dashboard: --interval-seconds and --timeout-seconds must be positive", file=sys.stderr)
        return 2
    upstream = Upstream(args.extender, args.prometheus, interval_s=args.interval_seconds,
                        timeout_s=args.timeout_seconds)
    host, port = args.listen
    logging.getLogger(__name__).info("dashboard on http://%s:%d reading %s", host, port, args.extender)
    uvicorn.run(create_app(upstream), host=host, port=port, log_level="warning", access_log=False)
    return 0
