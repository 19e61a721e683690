"""The `kube-vgpu` command. Each subcommand lives in the module that owns it and exposes
`add_arguments(parser)` and `run(args) -> int`; modules are imported only when their subcommand runs,
so `kube-vgpu webhook` never pays for the Kubernetes client and `--help` stays fast."""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> (module, one-line help). A module may itself add nested subcommands.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "extender": ("kube_vgpu.extender.cli", "run the scheduler extender (filter / prioritize / bind)"),
    "webhook": ("kube_vgpu.webhook.cli", "run the mutating admission webhook"),
    "device-plugin": ("kube_vgpu.deviceplugin.cli", "run the device plugin on a GPU node"),
    "limiter": ("kube_vgpu.deviceplugin.limiter_cli", "the limiter library on a node: install, rollback"),
    "cluster": ("kube_vgpu.dev.synth", "synthetic clusters (cluster synth)"),
    "dev-cluster": ("kube_vgpu.dev.devcluster.cli", "a local control plane with simulated GPU nodes"),
    "demo": ("kube_vgpu.dev.devcluster.demo", "dev cluster + sample workload + placement table"),
    "simulate": ("kube_vgpu.dev.simulator.cli", "trace-driven placement simulator (openb traces)"),
    "quota": ("kube_vgpu.extender.quota.cli", "quota status"),
    "top": ("kube_vgpu.extender.top", "GPUs assigned per node, GPU and pod (top nodes|gpus|pods)"),
    "dashboard": ("kube_vgpu.extender.dashboard.cli", "web dashboard over the extender's live state (read-only)"),
    "usage": ("kube_vgpu.extender.usage_report", "GPU-hours per namespace or ClusterQueue for a period (Prometheus)"),
    "certs": ("kube_vgpu.webhook.certs", "create a CA and serving certificate"),
}


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kube-vgpu", description="Share NVIDIA GPUs safely on Kubernetes.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    wanted = argv[0] if argv else None
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        sub_parser = sub.add_parser(name, help=help_text, description=help_text)
        if name == wanted:
            module = importlib.import_module(module_name)
            module.add_arguments(sub_parser)
            sub_parser.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
