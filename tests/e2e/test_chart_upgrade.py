"""A real `helm install`, `helm upgrade`, `helm rollback` and `helm uninstall` of charts/kube-vgpu against a real
kube-apiserver: a private control plane of its own (the chart's objects would replace the session cluster's), where
kube-vgpu was first installed the way the dev cluster installs it, from the manifests' RBAC and admission policies.
Helm adopts those objects (the ownership labels and annotations a kustomize-to-Helm migration sets), then the upgrade
changes values and the API server's objects follow, including objects that the new values remove.

No kubelets run here, so nothing is scheduled, and certificates.mode is none: the self-signed mode's Job is a
post-install hook that Helm waits for, and no pod completes here. There is no earlier chart version yet, so the
upgrade is between two sets of values of this version."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kube_vgpu.dev.devcluster.cluster import DevCluster, NodeGroup
from tests.e2e.conftest import private_cluster
from tests.e2e.test_manifests_apply import run_kubectl
from tests.manifests.test_chart import CHART, helm, helm_template

pytestmark = pytest.mark.e2e

RELEASE = "kube-vgpu"
NAMESPACE = "kube-vgpu"
#: no certificate machinery (its Job would be waited for), and the namespace the dev cluster made is adopted
BASE_VALUES = ["--set", "certificates.mode=none"]


@pytest.fixture(scope="module")
def cluster() -> Iterator[DevCluster]:
    with private_cluster("chart-cluster", node_groups=(NodeGroup(count=1, gpus=2),), webhook=False) as started:
        yield started


def run_helm(cluster: DevCluster, tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **{f"HELM_{kind}_HOME": str(tmp_path / f"helm-{kind.lower()}")
                            for kind in ("CACHE", "CONFIG", "DATA")}}
    return subprocess.run([str(helm()), f"--kubeconfig={cluster.kubeconfig}", *args], capture_output=True,
                          text=True, timeout=300, env=env)


def get(cluster: DevCluster, kind: str, name: str, namespace: str = NAMESPACE) -> dict[str, Any] | None:
    result = run_kubectl(cluster, "get", kind, name, "-n", namespace, "-o", "json", "--ignore-not-found")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout) if result.stdout.strip() else None


def adopt_what_exists(cluster: DevCluster) -> list[str]:
    """Give the objects the dev cluster created from the manifests Helm's ownership metadata; returns them."""
    adopted = []
    for obj in helm_template({"certificates": {"mode": "none"}}):
        kind, name = obj["kind"], obj["metadata"]["name"]
        namespace = ["-n", obj["metadata"]["namespace"]] if "namespace" in obj["metadata"] else []
        exists = run_kubectl(cluster, "get", kind, name, *namespace, "--ignore-not-found", "-o", "name")
        if not exists.stdout.strip():
            continue
        for verb, pairs in (("label", ["app.kubernetes.io/managed-by=Helm"]),
                            ("annotate", [f"meta.helm.sh/release-name={RELEASE}",
                                          f"meta.helm.sh/release-namespace={NAMESPACE}"])):
            result = run_kubectl(cluster, verb, "--overwrite", kind, name, *namespace, *pairs)
            assert result.returncode == 0, result.stderr
        adopted.append(f"{kind}/{name}")
    return adopted


def sharing_count(daemonset: dict[str, Any]) -> str:
    args: list[str] = daemonset["spec"]["template"]["spec"]["containers"][0]["args"]
    (flag,) = [a for a in args if a.startswith("--sharing-count=")]
    return flag.split("=", 1)[1]


def test_install_upgrade_rollback_uninstall(cluster: DevCluster, tmp_path: Path) -> None:
    adopted = adopt_what_exists(cluster)
    assert "Namespace/kube-vgpu" in adopted and "ClusterRole/kube-vgpu-extender" in adopted
    assert "ValidatingAdmissionPolicy/kube-vgpu-pod-annotations" in adopted

    install = run_helm(cluster, tmp_path, "install", RELEASE, str(CHART), "-n", NAMESPACE, *BASE_VALUES)
    assert install.returncode == 0, install.stderr
    daemonset = get(cluster, "daemonset", "kube-vgpu-device-plugin")
    assert daemonset is not None and sharing_count(daemonset) == "10"
    assert daemonset["metadata"]["annotations"]["meta.helm.sh/release-name"] == RELEASE
    assert get(cluster, "poddisruptionbudget", "kube-vgpu-scheduler") is not None

    upgrade = run_helm(cluster, tmp_path, "upgrade", RELEASE, str(CHART), "-n", NAMESPACE, *BASE_VALUES,
                       "--set", "devicePlugin.sharingCount=4", "--set", "image.tag=0.2.0",
                       "--set", "scheduler.replicas=1", "--set", "webhook.networkPolicy.enabled=false")
    assert upgrade.returncode == 0, upgrade.stderr
    daemonset = get(cluster, "daemonset", "kube-vgpu-device-plugin")
    assert daemonset is not None and sharing_count(daemonset) == "4"
    assert daemonset["spec"]["template"]["spec"]["containers"][0]["image"] == "ghcr.io/kube-vgpu/kube-vgpu:0.2.0"
    scheduler = get(cluster, "deployment", "kube-vgpu-scheduler")
    assert scheduler is not None and scheduler["spec"]["replicas"] == 1
    # what the new values no longer render is deleted
    assert get(cluster, "poddisruptionbudget", "kube-vgpu-scheduler") is None
    assert get(cluster, "networkpolicy", "kube-vgpu-webhook") is None

    # a value the chart does not know fails the upgrade and changes nothing
    refused = run_helm(cluster, tmp_path, "upgrade", RELEASE, str(CHART), "-n", NAMESPACE, *BASE_VALUES,
                       "--set", "devicePlugin.sharingCount=4", "--set", "devicePlugin.sharingcount=8")
    assert refused.returncode != 0 and "sharingcount" in refused.stderr

    rollback = run_helm(cluster, tmp_path, "rollback", RELEASE, "1", "-n", NAMESPACE)
    assert rollback.returncode == 0, rollback.stderr
    daemonset = get(cluster, "daemonset", "kube-vgpu-device-plugin")
    assert daemonset is not None and sharing_count(daemonset) == "10"
    assert get(cluster, "poddisruptionbudget", "kube-vgpu-scheduler") is not None
    history = run_helm(cluster, tmp_path, "history", RELEASE, "-n", NAMESPACE, "-o", "json")
    assert [entry["revision"] for entry in json.loads(history.stdout)] == [1, 2, 3]

    # uninstall from kube-vgpu's own namespace: the namespace goes too, so keep it by giving Helm's ownership up
    keep = run_kubectl(cluster, "annotate", "namespace", NAMESPACE, "helm.sh/resource-policy=keep")
    assert keep.returncode == 0, keep.stderr
    uninstall = run_helm(cluster, tmp_path, "uninstall", RELEASE, "-n", NAMESPACE)
    assert uninstall.returncode == 0, uninstall.stderr
    assert get(cluster, "daemonset", "kube-vgpu-device-plugin") is None
    assert get(cluster, "clusterrole", "kube-vgpu-extender", namespace="") is None
    assert get(cluster, "namespace", NAMESPACE, namespace="") is not None
