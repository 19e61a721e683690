"""Every kustomization renders with the real kubectl, holds what an install needs, and agrees with itself: one
namespace, one image, consistent labels, and the scheduler's ConfigMap byte-identical to THE
KubeSchedulerConfiguration file, which the real kube-scheduler accepts."""

from __future__ import annotations

import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml

from kube_vgpu.dev.devcluster.binaries import KUBERNETES_VERSION
from kube_vgpu.webhook.policies import POLICY_NAMES
from tests.manifests.render import (
    IMAGE_REPOSITORY,
    INSTALLABLE,
    KUSTOMIZATIONS,
    MANIFESTS,
    NAMESPACE,
    ROOT,
    SCHEDULER_CONFIG,
    containers,
    find,
    kube_scheduler,
    one,
    pod_spec,
    render,
    workloads,
)

CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "MutatingWebhookConfiguration",
                  "ValidatingWebhookConfiguration", "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding",
                  "PriorityClass",
                  # Kueue's cluster-scoped objects (examples/kueue)
                  "ResourceFlavor", "ClusterQueue", "Cohort", "WorkloadPriorityClass"}
PROJECT_VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_every_kustomization_renders(kustomization: str) -> None:
    objects = render(kustomization)
    assert objects
    for obj in objects:
        assert obj["apiVersion"] and obj["kind"] and obj["metadata"]["name"], obj
    names = [(o["apiVersion"].split("/")[0], o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"])
             for o in objects]
    assert len(names) == len(set(names)), "an object is defined twice"


@pytest.mark.parametrize("directory", ["base", "base/scheduler", "base/webhook", "base/deviceplugin",
                                       "base/admission", "overlays/cert-manager", "overlays/self-signed", "examples",
                                       "monitoring", "dashboard"])
def test_no_manifest_file_is_left_out_of_its_kustomization(directory: str) -> None:
    folder = MANIFESTS / directory
    kustomization = yaml.safe_load((folder / "kustomization.yaml").read_text())
    used = set(kustomization.get("resources") or [])
    used |= {patch["path"] for patch in kustomization.get("patches") or [] if "path" in patch}
    used |= {name for generator in kustomization.get("configMapGenerator") or [] for name in generator["files"]}
    files = {path.name for path in folder.iterdir() if path.suffix in (".yaml", ".py")} - {"kustomization.yaml"}
    assert files <= used, f"files in manifests/{directory} that nothing applies: {sorted(files - used)}"
    for entry in used:
        assert (folder / entry).exists(), f"manifests/{directory}/kustomization.yaml names {entry}, which is missing"


@pytest.mark.parametrize("overlay", INSTALLABLE)
def test_an_installable_overlay_holds_every_component(overlay: str) -> None:
    objects = render(overlay)
    one(objects, "Namespace", NAMESPACE)
    one(objects, "Deployment", "kube-vgpu-scheduler")
    one(objects, "Deployment", "kube-vgpu-webhook")
    one(objects, "DaemonSet", "kube-vgpu-device-plugin")
    one(objects, "MutatingWebhookConfiguration", "kube-vgpu-webhook")
    for name in POLICY_NAMES:
        one(objects, "ValidatingAdmissionPolicy", name)
        one(objects, "ValidatingAdmissionPolicyBinding", name)
    configmaps = [c["metadata"]["name"] for c in find(objects, "ConfigMap")]
    assert len([name for name in configmaps if name.startswith("kube-vgpu-scheduler-config-")]) == 1
    for kind in ("PodDisruptionBudget",):
        assert {o["metadata"]["name"] for o in find(objects, kind)} == {"kube-vgpu-scheduler", "kube-vgpu-webhook"}
    # something makes the webhook's serving certificate Secret
    makers = [o for o in find(objects, "Certificate") if o["spec"]["secretName"] == "kube-vgpu-webhook-tls"]
    makers += find(objects, "Job", "kube-vgpu-certs")
    assert len(makers) == 1


@pytest.mark.parametrize("overlay", INSTALLABLE)
def test_everything_namespaced_lives_in_the_kube_vgpu_namespace(overlay: str) -> None:
    for obj in render(overlay):
        namespace = obj["metadata"].get("namespace")
        if obj["kind"] in CLUSTER_SCOPED:
            assert namespace is None, f"{obj['kind']} {obj['metadata']['name']} is cluster-scoped"
        elif obj["metadata"]["name"] == "kube-vgpu-scheduler-authentication-reader":
            assert namespace == "kube-system"  # the Role it binds lives there
        else:
            assert namespace == NAMESPACE, f"{obj['kind']} {obj['metadata']['name']} is in {namespace!r}"


@pytest.mark.parametrize("overlay", INSTALLABLE)
def test_labels_name_the_project_and_component_and_selectors_match_templates(overlay: str) -> None:
    for obj in render(overlay):
        labels = obj["metadata"].get("labels") or {}
        assert labels.get("app.kubernetes.io/name") == "kube-vgpu", f"{obj['kind']} {obj['metadata']['name']}"
        assert labels.get("app.kubernetes.io/component"), f"{obj['kind']} {obj['metadata']['name']}"
    objects = render(overlay)
    for workload in workloads(objects):
        spec = workload["spec"]["jobTemplate"]["spec"] if workload["kind"] == "CronJob" else workload["spec"]
        template_labels = spec["template"]["metadata"]["labels"]
        assert template_labels["app.kubernetes.io/component"] == workload["metadata"]["labels"][
            "app.kubernetes.io/component"]
        if "selector" in spec:
            assert spec["selector"]["matchLabels"].items() <= template_labels.items()
    for budget in find(objects, "PodDisruptionBudget"):
        target = one(objects, "Deployment", budget["metadata"]["name"])
        assert budget["spec"]["selector"] == target["spec"]["selector"]
        assert budget["spec"]["minAvailable"] < target["spec"]["replicas"]


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_images_are_pinned_and_ours_is_one_image_at_the_project_version(kustomization: str) -> None:
    ours = f"{IMAGE_REPOSITORY}:{PROJECT_VERSION}"
    for workload in workloads(render(kustomization)):
        for _, container in containers(workload):
            image = container["image"]
            repository, _, tag = image.rpartition(":")
            assert repository and "/" not in tag and tag != "latest", f"{image} is not pinned to a version"
            if repository == IMAGE_REPOSITORY:
                assert image == ours, f"{workload['metadata']['name']}/{container['name']}: {image}, expected {ours}"


def test_kube_scheduler_is_the_official_image_at_the_dev_cluster_version() -> None:
    deployment = one(render("base"), "Deployment", "kube-vgpu-scheduler")
    images = {c["name"]: c["image"] for _, c in containers(deployment)}
    assert images == {
        "kube-scheduler": f"registry.k8s.io/kube-scheduler:{KUBERNETES_VERSION}",
        "extender": f"{IMAGE_REPOSITORY}:{PROJECT_VERSION}",
    }


# ---------------------------------------------------------------------------------------------
# The KubeSchedulerConfiguration: one file, mounted as is, accepted by kube-scheduler
# ---------------------------------------------------------------------------------------------


def scheduler_configmap_and_mount(overlay: str) -> tuple[dict, str]:
    objects = render(overlay)
    deployment = one(objects, "Deployment", "kube-vgpu-scheduler")
    spec = pod_spec(deployment)
    scheduler = next(c for c in spec["containers"] if c["name"] == "kube-scheduler")
    [config_flag] = [a for a in scheduler["command"] if a.startswith("--config=")]
    config_path = Path(config_flag.removeprefix("--config="))
    [mount] = [m for m in scheduler["volumeMounts"] if Path(m["mountPath"]) == config_path.parent]
    [volume] = [v for v in spec["volumes"] if v["name"] == mount["name"]]
    configmap = one(objects, "ConfigMap", volume["configMap"]["name"])  # the hashed name kustomize wrote
    return configmap, config_path.name


@pytest.mark.parametrize("overlay", ["base", *INSTALLABLE])
def test_the_scheduler_configmap_is_the_configuration_file_byte_for_byte(overlay: str) -> None:
    configmap, file_name = scheduler_configmap_and_mount(overlay)
    assert file_name == SCHEDULER_CONFIG.name
    assert configmap["data"] == {SCHEDULER_CONFIG.name: SCHEDULER_CONFIG.read_text()}
    assert configmap["metadata"]["name"].startswith("kube-vgpu-scheduler-config-")  # hashed: edits roll pods


def test_the_real_kube_scheduler_accepts_the_mounted_configuration(tmp_path: Path) -> None:
    configmap, file_name = scheduler_configmap_and_mount("base")
    config = tmp_path / file_name
    config.write_text(configmap["data"][file_name])
    written = tmp_path / "effective.yaml"
    # --write-config-to: decode strictly, default, validate, write the result and exit; --master is never dialled
    result = subprocess.run(
        [str(kube_scheduler()), f"--config={config}", "--master=https://127.0.0.1:1", f"--write-config-to={written}"],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 0, result.stderr
    effective = yaml.safe_load(written.read_text())
    [profile] = effective["profiles"]
    assert profile["schedulerName"] == "kube-vgpu-scheduler"
    [extender] = effective["extenders"]
    assert (extender["urlPrefix"], extender["bindVerb"], extender["nodeCacheCapable"]) == (
        "http://127.0.0.1:8888", "bind", True)
    assert effective["leaderElection"]["resourceNamespace"] == NAMESPACE
    # the check is strict: an unknown field fails the same command
    config.write_text(configmap["data"][file_name] + "bogusField: 1\n")
    result = subprocess.run(
        [str(kube_scheduler()), f"--config={config}", "--master=https://127.0.0.1:1", f"--write-config-to={written}"],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode != 0 and "strict decoding error" in result.stderr and "bogusField" in result.stderr
