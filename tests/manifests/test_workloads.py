"""Every workload is hardened and wired consistently: probes that hit endpoints the code serves, resources,
non-root read-only containers (the device plugin's root is the one documented exception), flags the real CLI
accepts, the extender where the scheduler configuration calls it, the limiter owned by the webhook only, and one
certificate Secret that every overlay fills and the webhook mounts."""

from __future__ import annotations

import argparse
import importlib.util
import sys
import urllib.request
from types import ModuleType
from typing import Any

import pytest
import yaml

from kube_vgpu.cli import build_parser
from kube_vgpu.extender.scheduler import Scheduler
from kube_vgpu.extender.server import create_app
from kube_vgpu.extender.sources.snapshot import SnapshotCluster
from kube_vgpu.extender.state import ClusterState
from kube_vgpu.protocol import DEFAULT_LIMITER_LIBRARY_PATH
from kube_vgpu.webhook.certs import service_hostnames
from tests.manifests.render import (
    IMAGE_REPOSITORY,
    INSTALLABLE,
    MANIFESTS,
    SCHEDULER_CONFIG,
    containers,
    find,
    one,
    pod_spec,
    render,
    workloads,
)

LONG_RUNNING = ("Deployment", "DaemonSet")
#: The one workload that runs as root: kubelet's device-plugin directory is root-owned (docs/deviceplugin.md).
ROOT_WORKLOADS = {"kube-vgpu-device-plugin"}
TLS_SECRET = "kube-vgpu-webhook-tls"


def parse_ours(container: dict[str, Any]) -> argparse.Namespace:
    """The container's arguments as the image's ENTRYPOINT (kube-vgpu) parses them."""
    assert "command" not in container, f"{container['name']}: overrides the kube-vgpu entrypoint"
    argv = list(container["args"])
    return build_parser(argv).parse_args(argv)


def certs_job_module() -> ModuleType:
    path = MANIFESTS / "overlays" / "self-signed" / "certs_job.py"
    spec = importlib.util.spec_from_file_location("kube_vgpu_certs_job", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def all_workloads() -> list[tuple[str, dict[str, Any]]]:
    seen: dict[tuple[str, str], tuple[str, dict[str, Any]]] = {}
    for overlay in (*INSTALLABLE, "dashboard"):  # and the optional dashboard, hardened the same way
        for workload in workloads(render(overlay)):
            seen.setdefault((workload["kind"], workload["metadata"]["name"]), (overlay, workload))
    return list(seen.values())


WORKLOADS = all_workloads()
IDS = [f"{w['kind']}/{w['metadata']['name']}" for _, w in WORKLOADS]


# ---------------------------------------------------------------------------------------------
# Hardening
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("overlay", "workload"), WORKLOADS, ids=IDS)
def test_every_container_has_resources_and_a_locked_down_security_context(overlay: str, workload: dict) -> None:
    name = workload["metadata"]["name"]
    spec = pod_spec(workload)
    assert not (spec.get("hostNetwork") or spec.get("hostPID") or spec.get("hostIPC")), name
    assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, name
    if name in ROOT_WORKLOADS:
        assert spec["securityContext"].get("runAsNonRoot") is not True
    else:
        assert spec["securityContext"]["runAsNonRoot"] is True, name
        assert spec["securityContext"]["runAsUser"] != 0, name
    for _, container in containers(workload):
        where = f"{name}/{container['name']}"
        requests = container["resources"]["requests"]
        assert requests["cpu"] and requests["memory"], where
        assert container["resources"]["limits"]["memory"], where
        security = container["securityContext"]
        assert security["allowPrivilegeEscalation"] is False, where
        assert security["readOnlyRootFilesystem"] is True, where
        assert security["capabilities"] == {"drop": ["ALL"]}, where
        assert security.get("privileged") is not True, where
        if name in ROOT_WORKLOADS:
            assert security["runAsUser"] == 0, where  # root is explicit, not an accident of the image


@pytest.mark.parametrize(("overlay", "workload"), WORKLOADS, ids=IDS)
def test_long_running_containers_have_liveness_and_readiness_probes(overlay: str, workload: dict) -> None:
    if workload["kind"] not in LONG_RUNNING:
        return
    for kind, container in containers(workload):
        if kind == "init":
            continue
        where = f"{workload['metadata']['name']}/{container['name']}"
        for probe in ("livenessProbe", "readinessProbe"):
            assert probe in container, f"{where} has no {probe}"
            handler = container[probe]
            assert "httpGet" in handler or "exec" in handler, where
            if "httpGet" in handler:  # a named port must exist on the container
                port = handler["httpGet"]["port"]
                assert isinstance(port, int) or port in {p["name"] for p in container.get("ports") or []}, where


def test_only_the_device_plugin_mounts_host_paths_and_only_kubelet_s() -> None:
    for _, workload in WORKLOADS:
        paths = {v["hostPath"]["path"] for v in pod_spec(workload).get("volumes") or [] if "hostPath" in v}
        if workload["metadata"]["name"] == "kube-vgpu-device-plugin":
            assert paths == {"/var/lib/kubelet/device-plugins", "/var/lib/kubelet/pod-resources", "/usr/local/vgpu"}
        else:
            assert not paths, workload["metadata"]["name"]


@pytest.mark.parametrize(("overlay", "workload"), WORKLOADS, ids=IDS)
def test_every_kube_vgpu_container_passes_flags_the_real_cli_accepts(overlay: str, workload: dict) -> None:
    for _, container in containers(workload):
        if not container["image"].startswith(IMAGE_REPOSITORY + ":"):
            continue
        if container.get("command", [None])[0] == "python":  # the certificate Job's API steps
            module = certs_job_module()
            assert container["command"][1] == "/scripts/certs_job.py"
            module.build_parser().parse_args(container["command"][2:])
        else:
            parse_ours(container)


# ---------------------------------------------------------------------------------------------
# The scheduler Pod: kube-scheduler + the extender on loopback
# ---------------------------------------------------------------------------------------------


def scheduler_containers() -> dict[str, dict[str, Any]]:
    deployment = one(render("base"), "Deployment", "kube-vgpu-scheduler")
    return {c["name"]: c for _, c in containers(deployment)}


def test_the_extender_listens_on_loopback_where_the_scheduler_configuration_calls_it() -> None:
    extender = scheduler_containers()["extender"]
    args = parse_ours(extender)
    assert (args.command, args.snapshot, args.kubeconfig) == ("extender", None, None)  # live, in-cluster
    assert args.host == "127.0.0.1"
    [configured] = yaml.safe_load(SCHEDULER_CONFIG.read_text())["extenders"]
    assert configured["urlPrefix"] == f"http://{args.host}:{args.port}"
    assert configured["enableHTTPS"] is False and configured["ignorable"] is False
    # only the probe/metrics listener is exposed; /bind stays on loopback inside the Pod
    assert extender["ports"] == [{"name": "metrics", "containerPort": args.metrics_port}]
    assert args.metrics_port and args.metrics_port != args.port


def test_the_extender_probes_hit_the_probe_listener_which_serves_them() -> None:
    from kube_vgpu.extender.server import serve_probes
    from tests.servers import free_port

    extender = scheduler_containers()["extender"]
    probed = {}
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert extender[probe]["httpGet"]["port"] == "metrics"
        probed[probe] = extender[probe]["httpGet"]["path"]
    assert probed["readinessProbe"] == "/readyz" and probed["livenessProbe"] == "/healthz"
    state = ClusterState()
    app = create_app(Scheduler(state, SnapshotCluster(state, [])))
    port = free_port()
    server = serve_probes(app.state.registry, app.state.scheduler, "127.0.0.1", port)
    try:
        for path in set(probed.values()) | {"/metrics"}:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as reply:
                assert reply.status == 200
    finally:
        server.shutdown()


def test_kube_scheduler_probes_its_secure_port_and_reads_the_mounted_configuration() -> None:
    scheduler = scheduler_containers()["kube-scheduler"]
    assert scheduler["command"][0] == "kube-scheduler"
    assert "--config=/etc/kube-vgpu/scheduler/" + SCHEDULER_CONFIG.name in scheduler["command"]
    assert scheduler["ports"] == [{"name": "https", "containerPort": 10259, "protocol": "TCP"}]
    assert scheduler["livenessProbe"]["httpGet"] == {"path": "/livez", "port": "https", "scheme": "HTTPS"}
    assert scheduler["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "https", "scheme": "HTTPS"}


def test_a_node_is_stale_only_after_several_missed_device_plugin_heartbeats() -> None:
    extender = parse_ours(scheduler_containers()["extender"])
    [plugin] = pod_spec(one(render("base"), "DaemonSet", "kube-vgpu-device-plugin"))["containers"]
    assert extender.heartbeat_ttl_seconds >= 3 * parse_ours(plugin).heartbeat_seconds


# ---------------------------------------------------------------------------------------------
# The limiter: the webhook loads it, the device plugin does not mount it again
# ---------------------------------------------------------------------------------------------


def test_the_device_plugin_mounts_the_limiter_and_no_tenant_pod_gets_a_host_path() -> None:
    """Issue 20 item 7: the library reaches containers through Allocate (read-only), the webhook only sets LD_PRELOAD
    and the cache emptyDir, so GPU namespaces can enforce Pod Security baseline."""
    objects = render("base")
    [plugin] = pod_spec(one(objects, "DaemonSet", "kube-vgpu-device-plugin"))["containers"]
    plugin_args = parse_ours(plugin)
    assert plugin_args.limiter_library == DEFAULT_LIMITER_LIBRARY_PATH
    assert plugin_args.shared_cache_dir == "" and plugin_args.ld_so_preload == ""
    assert plugin_args.require_admission_mark is True
    [limiter_mount] = [m for m in plugin["volumeMounts"] if m["mountPath"].startswith("/usr/local/vgpu")]
    assert limiter_mount == {"name": "limiter", "mountPath": "/usr/local/vgpu", "readOnly": True}
    [webhook] = pod_spec(one(objects, "Deployment", "kube-vgpu-webhook"))["containers"]
    webhook_args = parse_ours(webhook)
    assert webhook_args.limiter_mode == "device-plugin"
    assert webhook_args.limiter_library_path == DEFAULT_LIMITER_LIBRARY_PATH
    assert webhook_args.scheduler_name == yaml.safe_load(SCHEDULER_CONFIG.read_text())["profiles"][0]["schedulerName"]


# ---------------------------------------------------------------------------------------------
# The webhook's certificate
# ---------------------------------------------------------------------------------------------


def webhook_service(objects: list[dict[str, Any]]) -> tuple[str, str]:
    configuration = one(objects, "MutatingWebhookConfiguration", "kube-vgpu-webhook")
    references = {(w["clientConfig"]["service"]["namespace"], w["clientConfig"]["service"]["name"])
                  for w in configuration["webhooks"]}
    [reference] = references
    service = one(objects, "Service", reference[1])
    assert service["metadata"]["namespace"] == reference[0]
    return reference


@pytest.mark.parametrize("overlay", INSTALLABLE)
def test_the_webhook_mounts_the_secret_its_overlay_fills(overlay: str) -> None:
    objects = render(overlay)
    volumes = pod_spec(one(objects, "Deployment", "kube-vgpu-webhook"))["volumes"]
    assert [v["secret"]["secretName"] for v in volumes if "secret" in v] == [TLS_SECRET]
    for configuration in find(objects, "MutatingWebhookConfiguration"):
        for webhook in configuration["webhooks"]:
            assert "caBundle" not in webhook["clientConfig"]  # filled in the cluster, never committed


def test_cert_manager_issues_the_secret_for_the_service_name_the_api_server_dials() -> None:
    objects = render("overlays/cert-manager")
    namespace, service = webhook_service(objects)
    [certificate] = [c for c in find(objects, "Certificate") if c["spec"]["secretName"] == TLS_SECRET]
    assert certificate["metadata"]["namespace"] == namespace
    assert set(certificate["spec"]["dnsNames"]) == set(service_hostnames(service, namespace))
    assert "server auth" in certificate["spec"]["usages"]
    configuration = one(objects, "MutatingWebhookConfiguration", "kube-vgpu-webhook")
    injected = configuration["metadata"]["annotations"]["cert-manager.io/inject-ca-from"]
    assert injected == f"{namespace}/{certificate['metadata']['name']}"
    # the serving certificate comes from the private CA, not from the self-signed root directly
    issuer = one(objects, "Issuer", certificate["spec"]["issuerRef"]["name"])
    ca = [c for c in find(objects, "Certificate") if c["spec"]["secretName"] == issuer["spec"]["ca"]["secretName"]]
    assert len(ca) == 1 and ca[0]["spec"]["isCA"] is True


def test_the_certificate_job_makes_the_secret_for_the_service_the_api_server_dials() -> None:
    objects = render("overlays/self-signed")
    namespace, service = webhook_service(objects)
    job = one(objects, "Job", "kube-vgpu-certs")
    steps = {c["name"]: c for _, c in containers(job)}
    assert list(steps) == ["fetch", "certs", "publish"]
    certs = parse_ours(steps["certs"])
    assert (certs.command, certs.service, certs.namespace) == ("certs", service, namespace)
    module = certs_job_module()
    assert (module.TLS_SECRET, module.NAMESPACE, module.WEBHOOK_CONFIGURATION) == (
        TLS_SECRET, namespace, "kube-vgpu-webhook")
    for step in ("fetch", "publish"):
        parsed = module.build_parser().parse_args(steps[step]["command"][2:])
        assert (parsed.step, str(parsed.dir), parsed.namespace) == (step, str(certs.dir), namespace)
    # one directory shared by the three steps, and the script from the generated ConfigMap
    mounts = {c: {m["name"]: m["mountPath"] for m in steps[c]["volumeMounts"]} for c in steps}
    assert all(m["certs"] == str(certs.dir) and m["scripts"] == "/scripts" for m in mounts.values())
    volumes = {v["name"]: v for v in pod_spec(job)["volumes"]}
    assert volumes["certs"]["emptyDir"]["medium"] == "Memory"
    script = one(objects, "ConfigMap", volumes["scripts"]["configMap"]["name"])
    assert script["data"]["certs_job.py"] == (MANIFESTS / "overlays/self-signed/certs_job.py").read_text()


def test_the_renewal_cronjob_runs_the_same_pod_as_the_job() -> None:
    objects = render("overlays/self-signed")
    job, cron = one(objects, "Job", "kube-vgpu-certs"), one(objects, "CronJob", "kube-vgpu-certs")
    assert job["spec"]["template"] == cron["spec"]["jobTemplate"]["spec"]["template"]
    assert cron["spec"]["concurrencyPolicy"] == "Forbid"
