"""docs/install.md followed top to bottom on the shared dev cluster: every shell block marked `test: run` runs as
written, every block marked `test: dry-run` runs as server-side dry runs (tests/install_doc.py plan(): kustomize
and helm template output through tests/e2e/test_manifests_apply.server_dry_run, other kubectl commands with
--dry-run=server), in the page's order, in a scratch directory holding copies of charts/ and manifests/ (the page's
commands run from a checkout, and some write files: my-values.yaml, my-kube-vgpu/).

What the test sets, as a reader does by hand (the page says so): KUBECONFIG (the dev cluster's admin kubeconfig),
PATH (the dev cluster's kubectl, the helm the chart tests build, and this checkout's kube-vgpu), GPU_NODE (a node
this test adds, deleted afterwards, so the page's `kubectl label node` touches no other test's node) and
KUBE_VGPU_EXTENDER (the dev cluster's extender, where a reader port-forwards to the scheduler Deployment).

Nothing is installed for real (the dev cluster already runs kube-vgpu: a second install would replace its webhook
registration); the page's first GPU pod is created for real in the namespace gpu-demo, scheduled through our
webhook, kube-scheduler and extender, and run by KWOK; the page's own last block deletes the namespace (and this
test does, should a block fail before)."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes.client.rest import ApiException

from kube_vgpu.dev.devcluster.cluster import DevCluster
from tests.e2e.checks import wait_until
from tests.e2e.conftest import NodeSet
from tests.e2e.test_manifests_apply import server_dry_run
from tests.install_doc import ROOT, Block, install_blocks, logical_lines, plan
from tests.manifests.render import kubectl
from tests.manifests.test_chart import helm

pytestmark = pytest.mark.e2e

DEMO_NAMESPACE = "gpu-demo"  # the page's
BLOCK_TIMEOUT_S = 420  # the page's `kubectl wait` allows 300 s


def namespace_gone(cluster: DevCluster, name: str) -> bool:
    try:
        cluster.core.read_namespace(name, _preload_content=False)
    except ApiException as exc:
        if exc.status == 404:
            return True
        raise
    return False


def delete_demo_namespace(cluster: DevCluster) -> None:
    with contextlib.suppress(ApiException):
        cluster.core.delete_namespace(DEMO_NAMESPACE, grace_period_seconds=0, _preload_content=False)
    wait_until(f"namespace {DEMO_NAMESPACE} gone", lambda: namespace_gone(cluster, DEMO_NAMESPACE), lambda: "",
               timeout_s=90)


def scratch_checkout(tmp_path: Path) -> Path:
    checkout = tmp_path / "checkout"
    for tree in ("charts", "manifests"):
        shutil.copytree(ROOT / tree, checkout / tree)
    return checkout


def tool_path(tmp_path: Path) -> Path:
    """kubectl, helm and kube-vgpu (this checkout's, through the test's Python) on one directory."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "kubectl").symlink_to(kubectl())
    (bin_dir / "helm").symlink_to(helm())
    wrapper = bin_dir / "kube-vgpu"
    wrapper.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m kube_vgpu.cli "$@"\n')
    wrapper.chmod(0o755)
    return bin_dir


def failure(block: Block, what: str, result: subprocess.CompletedProcess[str]) -> str:
    return (f"{block.describe()}\n--- {what} exited {result.returncode}\n--- stdout:\n{result.stdout}"
            f"\n--- stderr:\n{result.stderr}")


def run_block(block: Block, cwd: Path, env: dict[str, str]) -> str:
    result = subprocess.run(["bash", "-euo", "pipefail", "-c", block.text], cwd=cwd, env=env, capture_output=True,
                            text=True, timeout=BLOCK_TIMEOUT_S)
    assert result.returncode == 0, failure(block, "the block", result)
    return result.stdout


def dry_run_block(cluster: DevCluster, block: Block, cwd: Path, env: dict[str, str]) -> list[dict[str, Any]]:
    """Every command of the block as a server-side dry run; the objects the API server returned."""
    returned: list[dict[str, Any]] = []
    for command in logical_lines(block.text):
        step = plan(command)
        if step.how == "kubectl":
            result = subprocess.run(["kubectl", *step.argv], cwd=cwd, env=env, capture_output=True, text=True,
                                    timeout=120)
            assert result.returncode == 0, failure(block, f"kubectl {' '.join(step.argv)}", result)
            continue
        argv = ["kubectl", "kustomize", *step.argv] if step.how == "kustomize" else ["helm", *step.argv]
        result = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, failure(block, " ".join(argv), result)
        rendered = [doc for doc in yaml.safe_load_all(result.stdout) if doc]
        assert any(o["kind"] == "Deployment" and o["metadata"]["name"] == "kube-vgpu-scheduler" for o in rendered), \
            f"{block.describe()}\n{' '.join(argv)} rendered no scheduler Deployment"
        items, _skipped = server_dry_run(cluster, rendered)  # asserts the API server accepted them all
        returned.extend(items)
    return returned


def test_a_reader_can_follow_install_md_on_the_dev_cluster(
        dev_cluster: DevCluster, gpu_nodes: Callable[..., NodeSet], tmp_path: Path) -> None:
    started = time.monotonic()
    [gpu_node] = gpu_nodes(1, gpus=4, model="Tesla T4", memory_mib=15360, topology="pcie").names
    cwd = scratch_checkout(tmp_path)
    env = {
        **os.environ,
        "KUBECONFIG": str(dev_cluster.kubeconfig),
        "PATH": f"{tool_path(tmp_path)}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": str(ROOT),
        "GPU_NODE": gpu_node,
        "KUBE_VGPU_EXTENDER": dev_cluster.extender_url,
        **{f"HELM_{kind}_HOME": str(tmp_path / f"helm-{kind.lower()}") for kind in ("CACHE", "CONFIG", "DATA")},
    }
    if not namespace_gone(dev_cluster, DEMO_NAMESPACE):
        delete_demo_namespace(dev_cluster)
    outputs: dict[str, str] = {}
    dry_runs: dict[str, list[dict[str, Any]]] = {}
    blocks = install_blocks()
    try:
        for block in blocks:
            if block.mode == "run":
                outputs[block.text] = run_block(block, cwd, env)
            elif block.mode == "dry-run":
                dry_runs[block.text] = dry_run_block(dev_cluster, block, cwd, env)
    finally:
        if not namespace_gone(dev_cluster, DEMO_NAMESPACE):
            delete_demo_namespace(dev_cluster)

    def output_of(needle: str) -> str:
        (found,) = [output for text, output in outputs.items() if needle in text]
        return found

    # what the page says the reader sees
    assert gpu_node in output_of("kubectl get nodes -L kube-vgpu.io/gpu-node")
    assert "kube-vgpu-webhook" in output_of("kubectl get mutatingwebhookconfiguration kube-vgpu-webhook")
    assert "validatingadmissionpolicy" in output_of("validatingadmissionpolicies").lower()
    assert gpu_node in output_of("kube-vgpu top nodes")
    pod = output_of("gpu-assignment").splitlines()
    scheduler_name, node_name = pod[0].split()
    assert scheduler_name == "kube-vgpu-scheduler" and node_name
    assert re.search(r"GPU-[0-9a-f-]+", pod[1]) and "4096" in pod[1], pod[1]
    assert {"CUDA_DEVICE_SM_LIMIT=25", "CUDA_DEVICE_MEMORY_LIMIT_0=4096m"} <= set(pod), pod
    assert any(line.startswith("LD_PRELOAD=") for line in pod), pod
    assert "first-gpu" in output_of("kube-vgpu top pods")
    # the dry runs: the image of the page's values and overlay, the overlay's flag
    helm_install = next(items for text, items in dry_runs.items() if "helm install" in text)
    overlay = next(items for text, items in dry_runs.items() if text.startswith("kubectl apply -k my-kube-vgpu"))
    for items in (helm_install, overlay):
        images = {c["image"] for i in items if i["kind"] in ("Deployment", "DaemonSet")
                  for c in i["spec"]["template"]["spec"]["containers"]}
        assert "registry.example.com/kube-vgpu:0.1.0" in images, images
    [plugin] = [i for i in overlay if i["kind"] == "DaemonSet"]
    assert "--sharing-count=4" in plugin["spec"]["template"]["spec"]["containers"][0]["args"]
    print(f"\n[install-doc] {sum(b.mode == 'run' for b in blocks)} blocks run, "
          f"{sum(b.mode == 'dry-run' for b in blocks)} dry-run, {sum(b.mode == 'not run' for b in blocks)} not run, "
          f"in {time.monotonic() - started:.1f} s", file=sys.stderr)
