"""`kube-vgpu limiter install|rollback|status`: the limiter library on a node (deviceplugin/limiter_install.py)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kube_vgpu.deviceplugin.limiter_install import (
    DEFAULT_HOST_DIR,
    DEFAULT_KEEP,
    DEFAULT_SOURCE_DIR,
    InstallError,
    current_name,
    install,
    installed_versions,
    rollback,
    verified_name,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="limiter_command", metavar="ACTION", required=True)
    host_help = "the node directory holding the versions and the link the webhook mounts"
    install_parser = sub.add_parser(
        "install", help="install the image's limiter on the node and make it current (the init container)"
    )
    install_parser.add_argument(
        "--source-dir", type=Path, default=DEFAULT_SOURCE_DIR,
        help="directory with libvgpu.so, libvgpu.so.sha256 (sha256sum format) and VERSION",
    )
    install_parser.add_argument("--host-dir", type=Path, default=DEFAULT_HOST_DIR, help=host_help)
    install_parser.add_argument(
        "--keep", type=int, default=DEFAULT_KEEP,
        help="versions kept besides the current one and those still mounted in a container",
    )
    install_parser.add_argument(
        "--proc-dir", type=Path, default=Path("/proc"),
        help="proc filesystem scanned for containers that mount a version (all of them only with hostPID)",
    )
    rollback_parser = sub.add_parser("rollback", help="make a kept version current again")
    rollback_parser.add_argument("--host-dir", type=Path, default=DEFAULT_HOST_DIR, help=host_help)
    rollback_parser.add_argument("--to", metavar="NAME", help="version directory name (default: the previous one)")
    status_parser = sub.add_parser("status", help="the current and kept versions, as JSON")
    status_parser.add_argument("--host-dir", type=Path, default=DEFAULT_HOST_DIR, help=host_help)


def run(args: argparse.Namespace) -> int:
    try:
        if args.limiter_command == "install":
            result = install(args.source_dir, args.host_dir, keep=args.keep, proc_dir=args.proc_dir)
            print(f"limiter {result.name}: {'copied' if result.copied else 'already installed'}, "
                  f"{'made current' if result.switched else 'already current'}"
                  + (f"; removed {', '.join(result.removed)}" if result.removed else ""))
        elif args.limiter_command == "rollback":
            print(f"limiter {rollback(args.host_dir, args.to)} made current")
        else:
            status = {"current": current_name(args.host_dir), "verified": verified_name(args.host_dir) is not None,
                      "versions": installed_versions(args.host_dir)}
            print(json.dumps(status, indent=2))
    except InstallError as exc:
        print(f"kube-vgpu limiter {args.limiter_command}: {exc}", file=sys.stderr)
        return 1
    return 0
