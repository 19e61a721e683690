"""The Helm chart charts/kube-vgpu with the real helm (v3.22.0, built from its Go module and cached like kubectl):

* it is what kube_vgpu/dev/chart.py generates from the kustomize manifests (one source of truth);
* `helm lint --strict` is clean in every certificate mode;
* `helm template` with default values renders exactly the objects `kubectl kustomize` renders (each certificate
  mode its kustomization; the one difference, the certificate Job's Helm hook, is named and checked);
* every value changes what the table below says and nothing else, and the kube-vgpu containers' flags still parse
  with the real CLI when every value is set;
* values the chart does not know, or out of range, are refused by values.schema.json, never silently ignored.
"""

from __future__ import annotations

import copy
import functools
import json
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from kube_vgpu.dev import chart
from tests.manifests.render import IMAGE_REPOSITORY, ROOT, find, kubectl, one, pod_spec, render, workloads
from tests.manifests.test_workloads import parse_ours

CHART = ROOT / "charts" / "kube-vgpu"
Object = dict[str, Any]
Change = Callable[[list[Object]], list[Object]]


@functools.cache
def helm() -> Path:
    from kube_vgpu.dev.devcluster.binaries import ensure_binaries

    return ensure_binaries(progress=lambda line: print(line, file=sys.stderr), names=("helm",))["helm"]


def run_helm(*args: str, values: dict[str, Any] | None = None, flags: tuple[str, ...] = ()
             ) -> subprocess.CompletedProcess[str]:
    with tempfile.NamedTemporaryFile("w", suffix=".json", prefix="values-") as values_file:
        json.dump(values or {}, values_file)
        values_file.flush()
        return subprocess.run([str(helm()), *args, str(CHART), "--values", values_file.name, *flags],
                              capture_output=True, text=True, timeout=120)


@functools.cache
def _template_text(values_json: str) -> str:
    result = run_helm("template", "kube-vgpu", values=json.loads(values_json))
    assert result.returncode == 0, result.stderr
    return result.stdout


def helm_template(values: dict[str, Any] | None = None) -> list[Object]:
    """The objects `helm template` renders with these values (fresh copies each call)."""
    return [doc for doc in yaml.safe_load_all(_template_text(json.dumps(values or {}, sort_keys=True))) if doc]


def key(obj: Object) -> tuple[str, str, str]:
    return obj["kind"], obj["metadata"].get("namespace", ""), obj["metadata"]["name"]


def assert_same_objects(actual: list[Object], expected: list[Object]) -> None:
    by_key = {key(o): o for o in actual}
    expected_by_key = {key(o): o for o in expected}
    assert len(by_key) == len(actual) and len(expected_by_key) == len(expected), "duplicate objects"
    assert sorted(by_key) == sorted(expected_by_key)
    differing = [k for k in by_key if by_key[k] != expected_by_key[k]]
    assert not differing, "\n".join(
        f"{k}:\n  chart:     {json.dumps(by_key[k], sort_keys=True)}\n  expected:  "
        f"{json.dumps(expected_by_key[k], sort_keys=True)}" for k in differing)


def without_hook(objects: list[Object]) -> list[Object]:
    """The chart's objects less the Helm hook on the certificate Job (checked present first): kustomize's objects."""
    jobs = find(objects, "Job")
    for job in jobs:
        annotations = job["metadata"]["annotations"]
        for name, value in chart.CERTS_JOB_HOOK_ANNOTATIONS.items():
            assert annotations.pop(name) == value
        if not annotations:
            del job["metadata"]["annotations"]
    return objects


# ---------------------------------------------------------------------------------------------
# One source of truth
# ---------------------------------------------------------------------------------------------


def test_the_chart_is_what_the_manifests_generate() -> None:
    stale = chart.check(kubectl())
    assert not stale, f"run `python -m kube_vgpu.dev.chart`: {stale} differ from what manifests/ generates"


@pytest.mark.parametrize("mode", list(chart.CERTIFICATE_MODES))
def test_helm_lint_is_clean(mode: str) -> None:
    result = run_helm("lint", "--strict", values={"certificates": {"mode": mode}})
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 chart(s) linted, 0 chart(s) failed" in result.stdout
    assert "[WARNING]" not in result.stdout and "[ERROR]" not in result.stdout


@pytest.mark.parametrize(("mode", "kustomization"), list(chart.CERTIFICATE_MODES.items()))
def test_default_values_render_what_kustomize_renders(mode: str, kustomization: str) -> None:
    objects = helm_template({"certificates": {"mode": mode}})
    if mode == "self-signed":
        assert_same_objects(helm_template(), objects)  # the default mode
        assert len(find(objects, "Job")) == 1
    assert_same_objects(without_hook(objects), render(kustomization))


# ---------------------------------------------------------------------------------------------
# Every value: what it changes, and nothing else
# ---------------------------------------------------------------------------------------------


def container(objects: list[Object], kind: str, name: str, container_name: str) -> Object:
    pod = pod_spec(one(objects, kind, name))
    found: list[Object] = [c for c in pod.get("initContainers", []) + pod["containers"] if c["name"] == container_name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} containers named {container_name}"
    return found[0]


def set_flag(objects: list[Object], kind: str, name: str, container_name: str, flag: str, value: str) -> None:
    args = container(objects, kind, name, container_name)["args"]
    (index,) = [i for i, arg in enumerate(args) if arg.startswith(flag + "=")]
    args[index] = f"{flag}={value}"


def kube_vgpu_containers(objects: list[Object], repository: str = IMAGE_REPOSITORY) -> list[Object]:
    found = []
    for workload in workloads(objects):
        pod = pod_spec(workload)
        found += [c for c in pod.get("initContainers", []) + pod["containers"]
                  if c["image"].startswith(repository + ":")]
    assert len(found) >= 9  # scheduler's extender, webhook, device plugin, the Job's and CronJob's three steps
    return found


def each(objects: list[Object], change: Callable[[Object], None], items: Callable[[list[Object]], list[Object]]
         ) -> list[Object]:
    for item in items(objects):
        change(item)
    return objects


def scheduler_container(objects: list[Object]) -> Object:
    return container(objects, "Deployment", "kube-vgpu-scheduler", "kube-scheduler")


def device_plugin(objects: list[Object]) -> Object:
    return pod_spec(one(objects, "DaemonSet", "kube-vgpu-device-plugin"))


def removed(kind: str, name: str) -> Change:
    def change(objects: list[Object]) -> list[Object]:
        one(objects, kind, name)
        return [o for o in objects if (o["kind"], o["metadata"]["name"]) != (kind, name)]
    return change


def replicas(name: str, count: int) -> Change:
    def change(objects: list[Object]) -> list[Object]:
        one(objects, "Deployment", name)["spec"]["replicas"] = count
        return objects
    return change


def dynamic_mig_profiles() -> str:
    """The allowlist manifests/components/dynamic-mig passes (read from its patch, without rendering)."""
    component = yaml.safe_load((ROOT / "manifests" / "components" / "dynamic-mig" / "kustomization.yaml").read_text())
    (patch,) = component["patches"]
    (arg,) = [op["value"] for op in yaml.safe_load(patch["patch"]) if op["path"].endswith("/args/-")]
    return str(arg).removeprefix("--dynamic-mig-profiles=")


def flag(kind: str, name: str, container_name: str, flag_name: str, value: str) -> Change:
    def change(objects: list[Object]) -> list[Object]:
        set_flag(objects, kind, name, container_name, flag_name, value)
        return objects
    return change


def both(*changes: Change) -> Change:
    def change(objects: list[Object]) -> list[Object]:
        for one_change in changes:
            objects = one_change(objects)
        return objects
    return change


def ip_block_except(cidr: str, cidrs: list[str]) -> Change:
    def change(objects: list[Object]) -> list[Object]:
        policy = one(objects, "NetworkPolicy", "kube-vgpu-webhook")
        (block,) = [s["ipBlock"] for r in policy["spec"]["ingress"] for s in r["from"] if s["ipBlock"]["cidr"] == cidr]
        if cidrs:
            block["except"] = cidrs
        else:
            del block["except"]
        return objects
    return change


def pod_field(name: str, value: Any) -> Change:
    def change(objects: list[Object]) -> list[Object]:
        if value is None:
            del device_plugin(objects)[name]
        else:
            device_plugin(objects)[name] = value
        return objects
    return change


def library_path(path: str) -> Change:
    def change(objects: list[Object]) -> list[Object]:
        set_flag(objects, "Deployment", "kube-vgpu-webhook", "webhook", "--limiter-library-path", path)
        set_flag(objects, "DaemonSet", "kube-vgpu-device-plugin", "device-plugin", "--limiter-library", path)
        pod = device_plugin(objects)
        (volume,) = [v for v in pod["volumes"] if v["name"] == "limiter"]
        (mount,) = [m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "limiter"]
        volume["hostPath"]["path"] = mount["mountPath"] = path.rpartition("/")[0]
        # the init container installs the library there, and the plugin labels the node from there
        (install_mount,) = [m for m in pod["initContainers"][0]["volumeMounts"] if m["name"] == "limiter"]
        directory = install_mount["mountPath"] = path.rpartition("/")[0]
        set_flag(objects, "DaemonSet", "kube-vgpu-device-plugin", "limiter-install", "--host-dir", directory)
        set_flag(objects, "DaemonSet", "kube-vgpu-device-plugin", "device-plugin", "--limiter-dir", directory)
        return objects
    return change


def limiter_mode(mode: str) -> Change:
    return both(flag("Deployment", "kube-vgpu-webhook", "webhook", "--limiter-mode", mode),
                flag("DaemonSet", "kube-vgpu-device-plugin", "device-plugin", "--limiter-library", ""))


def retagged(repository: str, tag: str) -> Change:
    return lambda objects: each(objects, lambda c: c.update(image=f"{repository}:{tag}"), kube_vgpu_containers)


def with_pull_secrets(objects: list[Object]) -> list[Object]:
    for workload in workloads(objects):
        pod_spec(workload)["imagePullSecrets"] = [{"name": "regcred"}]
    return objects



def kube_scheduler_pull_policy(objects: list[Object]) -> list[Object]:
    scheduler_container(objects)["imagePullPolicy"] = "IfNotPresent"
    return objects


#: (value path, value, what the default objects become). certificates.mode is also checked value by value above.
CHANGES: list[tuple[str, Any, Change]] = [
    ("image.repository", "registry.example.com/kube-vgpu", retagged("registry.example.com/kube-vgpu", "0.1.0")),
    ("image.tag", "0.2.0", retagged(IMAGE_REPOSITORY, "0.2.0")),
    ("image.pullPolicy", "Always",
     lambda objects: each(objects, lambda c: c.update(imagePullPolicy="Always"), kube_vgpu_containers)),
    ("imagePullSecrets", [{"name": "regcred"}], with_pull_secrets),
    ("kubeScheduler.image.repository", "registry.example.com/kube-scheduler",
     lambda objects: each(objects, lambda c: c.update(image="registry.example.com/kube-scheduler:v1.37.2"),
                          lambda objects: [scheduler_container(objects)])),
    ("kubeScheduler.image.tag", "v1.36.3",
     lambda objects: each(objects, lambda c: c.update(image="registry.k8s.io/kube-scheduler:v1.36.3"),
                          lambda objects: [scheduler_container(objects)])),
    ("kubeScheduler.image.pullPolicy", "IfNotPresent", kube_scheduler_pull_policy),
    ("namespace.create", False, removed("Namespace", "kube-vgpu")),
    ("scheduler.replicas", 3, replicas("kube-vgpu-scheduler", 3)),
    ("scheduler.replicas", 1, both(replicas("kube-vgpu-scheduler", 1),
                                   removed("PodDisruptionBudget", "kube-vgpu-scheduler"))),
    ("scheduler.nodePolicy", "spread", flag("Deployment", "kube-vgpu-scheduler", "extender", "--policy", "spread")),
    ("scheduler.gpuPolicy", "binpack",
     flag("Deployment", "kube-vgpu-scheduler", "extender", "--gpu-policy", "binpack")),
    ("scheduler.quotaMode", "kueue", flag("Deployment", "kube-vgpu-scheduler", "extender", "--quota-mode", "kueue")),
    ("scheduler.quotaMode", "off", flag("Deployment", "kube-vgpu-scheduler", "extender", "--quota-mode", "off")),
    ("webhook.replicas", 3, replicas("kube-vgpu-webhook", 3)),
    ("webhook.replicas", 1, both(replicas("kube-vgpu-webhook", 1),
                                 removed("PodDisruptionBudget", "kube-vgpu-webhook"))),
    ("webhook.networkPolicy.enabled", False, removed("NetworkPolicy", "kube-vgpu-webhook")),
    ("webhook.networkPolicy.podCIDRs.ipv4", ["10.0.0.0/8", "172.16.0.0/12"],
     ip_block_except("0.0.0.0/0", ["10.0.0.0/8", "172.16.0.0/12"])),
    ("webhook.networkPolicy.podCIDRs.ipv6", [], ip_block_except("::/0", [])),
    ("limiter.mode", "ld-preload", limiter_mode("ld-preload")),
    ("limiter.mode", "none", limiter_mode("none")),
    ("limiter.libraryPath", "/opt/hami/lib/libvgpu.so", library_path("/opt/hami/lib/libvgpu.so")),
    ("limiter.keep", 1, flag("DaemonSet", "kube-vgpu-device-plugin", "limiter-install", "--keep", "1")),
    ("devicePlugin.sharingCount", 4,
     flag("DaemonSet", "kube-vgpu-device-plugin", "device-plugin", "--sharing-count", "4")),
    # what manifests/components/dynamic-mig does, with its allowlist
    ("devicePlugin.dynamicMigProfiles",
     dynamic_mig_profiles(), lambda _objects: render("overlays/dynamic-mig")),
    ("devicePlugin.runtimeClassName", "nvidia", pod_field("runtimeClassName", "nvidia")),
    ("devicePlugin.nodeSelector", {"example.com/gpu": "yes"}, pod_field("nodeSelector", {"example.com/gpu": "yes"})),
    ("devicePlugin.tolerations", [{"operator": "Exists"}], pod_field("tolerations", [{"operator": "Exists"}])),
    ("devicePlugin.tolerations", [], pod_field("tolerations", None)),
    # Helm merges a map value into the default map: null, not {}, removes it
    ("devicePlugin.affinity", None, pod_field("affinity", None)),
    ("devicePlugin.affinity", {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": []}},
     lambda objects: pod_field("affinity", {**device_plugin(objects)["affinity"], "podAntiAffinity": {
         "requiredDuringSchedulingIgnoredDuringExecution": []}})(objects)),
    ("certificates.mode", "cert-manager", lambda _objects: render("overlays/cert-manager")),
    ("certificates.mode", "none", lambda _objects: render("base")),
]


def nested(path: str, value: Any) -> dict[str, Any]:
    *parents, leaf = path.split(".")
    values: dict[str, Any] = {leaf: value}
    for parent in reversed(parents):
        values = {parent: values}
    return values


@pytest.mark.parametrize(("path", "value", "change"), CHANGES, ids=[f"{p}={json.dumps(v)}" for p, v, _ in CHANGES])
def test_each_value_changes_what_it_should_and_nothing_else(path: str, value: Any, change: Change) -> None:
    defaults = without_hook(helm_template())
    expected = change(copy.deepcopy(defaults))
    assert expected != defaults, "the table's change changes nothing"
    actual = helm_template(nested(path, value))
    if path != "certificates.mode" or value == "self-signed":
        actual = without_hook(actual)
    assert_same_objects(actual, expected)


def test_every_value_of_the_chart_is_in_the_table() -> None:
    documented = {value.path for value in chart._values()}
    assert documented == {path for path, _, _ in CHANGES}
    assert set(documented) == set(_leaves(yaml.safe_load((CHART / "values.yaml").read_text())))


def _leaves(values: dict[str, Any], prefix: str = "") -> list[str]:
    paths = []
    for name, value in values.items():
        path = prefix + name
        # a mapping whose keys the chart does not name (nodeSelector, affinity) is one value
        if isinstance(value, dict) and value and path not in {"devicePlugin.affinity"}:
            paths += _leaves(value, path + ".")
        else:
            paths.append(path)
    return paths


def every_value_changed() -> dict[str, Any]:
    """Values that change every value of the table at once (the last of a path's rows wins)."""
    values: dict[str, Any] = {}
    for path, value, _ in CHANGES:
        if path not in ("limiter.mode", "certificates.mode", "scheduler.quotaMode"):
            values = _merge(values, nested(path, value))
    return _merge(values, {"limiter": {"mode": "ld-so-preload"}, "scheduler": {"quotaMode": "enforce"}})


def test_with_every_value_set_the_flags_still_parse_with_the_real_cli() -> None:
    objects = helm_template(every_value_changed())
    for c in kube_vgpu_containers(objects, "registry.example.com/kube-vgpu"):
        if c.get("command", [None])[0] != "python":  # the certificate Job's API steps: not the kube-vgpu CLI
            parse_ours(c)
    plugin = parse_ours(container(objects, "DaemonSet", "kube-vgpu-device-plugin", "device-plugin"))
    assert (plugin.sharing_count, plugin.limiter_library) == (4, "")
    extender = parse_ours(container(objects, "Deployment", "kube-vgpu-scheduler", "extender"))
    assert (extender.policy, extender.gpu_policy, extender.quota_mode) == ("spread", "binpack", "enforce")


def _merge(left: dict[str, Any], right: dict[str, Any]) -> dict[str, Any]:
    merged = dict(left)
    for name, value in right.items():
        if isinstance(value, dict) and value and isinstance(merged.get(name), dict):
            merged[name] = _merge(merged[name], value)
        else:
            merged[name] = value
    return merged


# ---------------------------------------------------------------------------------------------
# What the chart does not support is refused
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("values", "named"), [
    # no component has a flag for them (HAMi's pod API: nvidia.com/gpu, gpumem, ...): no value either
    ({"resourceNames": {"gpu": "example.com/vgpu"}}, "resourceNames"),
    ({"webhook": {"replica": 3}}, "replica"),  # a typo
    ({"devicePlugin": {"resources": {"limits": {"memory": "1Gi"}}}}, "resources"),
    ({"scheduler": {"quotaMode": "sometimes"}}, "quotaMode"),
    ({"scheduler": {"nodePolicy": "first-fit"}}, "nodePolicy"),
    ({"limiter": {"mode": "ld-preload-please"}}, "mode"),
    ({"limiter": {"libraryPath": "libvgpu.so"}}, "libraryPath"),
    # the installer's link is named libvgpu.so (deviceplugin/limiter_install.py)
    ({"limiter": {"libraryPath": "/opt/hami/lib/libvgpu-custom.so"}}, "libraryPath"),
    ({"limiter": {"keep": -1}}, "keep"),
    ({"devicePlugin": {"sharingCount": 0}}, "sharingCount"),
    ({"webhook": {"replicas": "two"}}, "replicas"),
    ({"certificates": {"mode": "letsencrypt"}}, "mode"),
    ({"image": {"pullPolicy": "Sometimes"}}, "pullPolicy"),
    ({"webhook": {"networkPolicy": {"podCIDRs": {"ipv4": ["my pods"]}}}}, "ipv4"),
])
def test_values_the_chart_does_not_support_are_refused(values: dict[str, Any], named: str) -> None:
    result = run_helm("template", "kube-vgpu", values=values)
    assert result.returncode != 0
    assert "values don't meet the specifications of the schema" in result.stderr
    assert named in result.stderr


def test_kubernetes_releases_without_the_admission_policies_are_refused() -> None:
    # ValidatingAdmissionPolicy v1 and the node-name claim of ServiceAccount tokens: 1.30 (docs/install.md)
    old = run_helm("template", "kube-vgpu", flags=("--kube-version", "1.29.9"))
    assert old.returncode != 0 and "kubeVersion" in old.stderr and ">=1.30.0-0" in old.stderr
    assert run_helm("template", "kube-vgpu", flags=("--kube-version", "1.30.0")).returncode == 0


# ---------------------------------------------------------------------------------------------
# The generator fails loudly when the manifests no longer have what an edit expects
# ---------------------------------------------------------------------------------------------


def test_an_edit_whose_flag_is_gone_from_the_manifests_stops_the_generator() -> None:
    daemonset = copy.deepcopy(one(render("base"), "DaemonSet", "kube-vgpu-device-plugin"))
    args = pod_spec(daemonset)["containers"][0]["args"]
    args[:] = [a for a in args if not a.startswith("--sharing-count=")]
    templater = chart.Templater()
    templater.value("limiter.libraryPath", "/usr/local/vgpu/libvgpu.so")
    templater.value("limiter.mode", "device-plugin")
    with pytest.raises(chart.ChartError, match=r"expected one --sharing-count=\.\.\., found 0"):
        chart.EDITS[("DaemonSet", "kube-vgpu-device-plugin")](templater, daemonset)


def test_an_overlay_that_changes_more_than_annotations_stops_the_generator() -> None:
    rendered = {name: render(name) for name in set(chart.CERTIFICATE_MODES.values())}
    one(rendered["overlays/cert-manager"], "Deployment", "kube-vgpu-webhook")["spec"]["replicas"] = 3
    with pytest.raises(chart.ChartError, match="beyond adding annotations"):
        chart._certificate_modes(rendered)
    extras, annotations = chart._certificate_modes({name: render(name) for name in rendered})
    assert annotations == {("MutatingWebhookConfiguration", "", "kube-vgpu-webhook"): (
        "cert-manager", {"cert-manager.io/inject-ca-from": "kube-vgpu/kube-vgpu-webhook"})}
    assert {(mode, obj["kind"]) for mode, obj in extras} >= {("self-signed", "Job"), ("cert-manager", "Certificate")}
