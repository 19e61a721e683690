"""Rendering kube-vgpu's kustomizations with the real kubectl (its built-in kustomize), and looking at the result.

kubectl is the dev cluster's (kube_vgpu.dev.devcluster.binaries: Kubernetes v1.37.2 by default, built from the
official Go modules and cached), so what the tests render is what `kubectl apply -k` applies.
"""

from __future__ import annotations

import functools
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
MANIFESTS = ROOT / "manifests"
#: Every kustomization an operator applies (or that an overlay builds on), relative to manifests/.
KUSTOMIZATIONS = ("base", "overlays/cert-manager", "overlays/self-signed", "overlays/dynamic-mig", "examples",
                  "examples/kueue", "monitoring", "dashboard")
INSTALLABLE = ("overlays/cert-manager", "overlays/self-signed")
NAMESPACE = "kube-vgpu"
IMAGE_REPOSITORY = "ghcr.io/kube-vgpu/kube-vgpu"
SCHEDULER_CONFIG = MANIFESTS / "base" / "scheduler" / "kube-scheduler-config.yaml"

Object = dict[str, Any]


@functools.cache
def kubectl() -> Path:
    from kube_vgpu.dev.devcluster.binaries import ensure_binaries

    return ensure_binaries(progress=lambda line: print(line, file=sys.stderr))["kubectl"]


@functools.cache
def kube_scheduler() -> Path:
    from kube_vgpu.dev.devcluster.binaries import ensure_binaries

    return ensure_binaries(progress=lambda line: print(line, file=sys.stderr))["kube-scheduler"]


@functools.cache
def render_text(kustomization: str) -> str:
    result = subprocess.run(
        [str(kubectl()), "kustomize", str(MANIFESTS / kustomization)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if result.returncode != 0:
        raise AssertionError(f"kubectl kustomize manifests/{kustomization} failed:\n{result.stderr}")
    return result.stdout


def render(kustomization: str) -> list[Object]:
    """The objects `kubectl apply -k manifests/<kustomization>` would send (fresh copies each call)."""
    return [doc for doc in yaml.safe_load_all(render_text(kustomization)) if doc]


def find(objects: list[Object], kind: str, name: str | None = None) -> list[Object]:
    return [o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]


def one(objects: list[Object], kind: str, name: str) -> Object:
    found = find(objects, kind, name)
    assert len(found) == 1, f"expected one {kind} {name}, found {len(found)}"
    return found[0]


WORKLOAD_KINDS = ("Deployment", "DaemonSet", "StatefulSet", "Job", "CronJob")


def pod_spec(workload: Object) -> Object:
    spec = workload["spec"]
    if workload["kind"] == "CronJob":
        spec = spec["jobTemplate"]["spec"]
    template: Object = spec["template"]["spec"]
    return template


def containers(workload: Object) -> Iterator[tuple[str, Object]]:
    """(kind of container, container) for every init and app container of the workload's pod template."""
    spec = pod_spec(workload)
    for container in spec.get("initContainers") or ():
        yield "init", container
    for container in spec["containers"]:
        yield "app", container


def workloads(objects: list[Object]) -> list[Object]:
    return [o for o in objects if o["kind"] in WORKLOAD_KINDS]
