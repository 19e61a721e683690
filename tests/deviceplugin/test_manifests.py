"""The DaemonSet: GPU nodes only, kubelet's directory by hostPath, NODE_NAME from the downward API, probes that
exist in the binary, least privilege."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from kube_vgpu.deviceplugin.cli import add_arguments

BASE = Path(__file__).resolve().parents[2] / "manifests" / "base" / "deviceplugin"


def documents() -> list[dict[str, Any]]:
    kustomization = yaml.safe_load((BASE / "kustomization.yaml").read_text())
    docs: list[dict[str, Any]] = []
    for name in kustomization["resources"]:
        docs.extend(doc for doc in yaml.safe_load_all((BASE / name).read_text()) if doc)
    return docs


def daemonset() -> dict[str, Any]:
    [ds] = [d for d in documents() if d["kind"] == "DaemonSet"]
    return ds


def test_runs_only_on_gpu_nodes_and_tolerates_their_taint() -> None:
    spec = daemonset()["spec"]["template"]["spec"]
    terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    keys = {expr["key"] for term in terms for expr in term["matchExpressions"]}
    assert keys == {"nvidia.com/gpu.present", "feature.node.kubernetes.io/pci-10de.present", "kube-vgpu.io/gpu-node"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]


def test_kubelet_directory_node_name_and_probes() -> None:
    spec = daemonset()["spec"]["template"]["spec"]
    [plugin] = spec["containers"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["name"]: m for m in plugin["volumeMounts"]}
    assert volumes["device-plugins"]["hostPath"]["path"] == "/var/lib/kubelet/device-plugins"
    assert mounts["device-plugins"]["mountPath"] == "/var/lib/kubelet/device-plugins"
    assert mounts["pod-resources"]["readOnly"] is True
    env = {e["name"]: e for e in plugin["env"]}
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert plugin["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert plugin["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert "--probe-address=:8081" in plugin["args"]
    # every flag in the manifest exists in the CLI
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    parsed = parser.parse_args(plugin["args"][1:])
    assert parsed.kubelet_dir == "/var/lib/kubelet/device-plugins"


def test_least_privilege() -> None:
    template = daemonset()["spec"]["template"]["spec"]
    security = template["containers"][0]["securityContext"]
    assert security["privileged"] is False
    assert security["allowPrivilegeEscalation"] is False
    assert security["readOnlyRootFilesystem"] is True
    assert security["capabilities"] == {"drop": ["ALL"]}
    assert not template.get("hostNetwork") and not template.get("hostPID")
    [role] = [d for d in documents() if d["kind"] == "ClusterRole"]
    verbs = {(tuple(r["resources"]), tuple(r["verbs"])) for r in role["rules"]}
    assert verbs == {(("pods",), ("list", "patch")), (("nodes",), ("get", "patch")), (("events",), ("create",))}
    [account] = [d for d in documents() if d["kind"] == "ServiceAccount"]
    # the webhook's pod-UPDATE guard trusts exactly this identity
    assert (account["metadata"]["namespace"], account["metadata"]["name"]) == ("kube-vgpu", "kube-vgpu-device-plugin")


def test_the_limiter_install_init_container() -> None:
    """From the same image, into the directory the plugin (and the webhook's default path) reads, with the image's
    contract paths; root for the root-owned host directory, nothing more."""
    import argparse

    from kube_vgpu.deviceplugin import limiter_cli, limiter_install
    from kube_vgpu.protocol import DEFAULT_LIMITER_LIBRARY_PATH

    template = daemonset()["spec"]["template"]["spec"]
    [install] = template["initContainers"]
    [plugin] = template["containers"]
    assert install["image"] == plugin["image"]
    parser = argparse.ArgumentParser()
    limiter_cli.add_arguments(parser)
    parsed = parser.parse_args(install["args"][1:])
    assert (install["args"][0], parsed.limiter_command) == ("limiter", "install")
    assert parsed.source_dir == limiter_install.DEFAULT_SOURCE_DIR
    assert str(parsed.host_dir) == str(Path(DEFAULT_LIMITER_LIBRARY_PATH).parent) == "/usr/local/vgpu"
    volumes = {v["name"]: v for v in template["volumes"]}
    [mount] = install["volumeMounts"]
    assert volumes[mount["name"]]["hostPath"] == {"path": str(parsed.host_dir), "type": "DirectoryOrCreate"}
    assert mount["mountPath"] == str(parsed.host_dir) and not mount.get("readOnly")  # written; same path as the node
    plugin_parser = argparse.ArgumentParser()
    add_arguments(plugin_parser)
    plugin_args = plugin_parser.parse_args(plugin["args"][1:])
    assert plugin_args.limiter_dir == str(parsed.host_dir) and plugin_args.limiter_label == "kube-vgpu.io/limiter"
    assert {m["name"]: m for m in plugin["volumeMounts"]}[mount["name"]]["readOnly"] is True
    security = install["securityContext"]
    assert security == {"runAsUser": 0, "runAsGroup": 0, "privileged": False, "allowPrivilegeEscalation": False,
                        "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]}}
    assert install["resources"]["limits"]["memory"]
