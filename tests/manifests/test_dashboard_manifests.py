"""manifests/dashboard (optional, applied after an overlay): the dashboard reaches the extender's probes port
through a Service that selects the scheduler Pods and names a port they have, and needs no API access at all.
(Hardening, probes and flags are checked with every other workload: tests/manifests/test_workloads.py.)"""

from __future__ import annotations

from urllib.parse import urlsplit

from tests.manifests.render import NAMESPACE, containers, find, one, pod_spec, render
from tests.manifests.test_workloads import parse_ours


def test_the_dashboard_reads_the_extenders_probe_port_through_a_service() -> None:
    objects = render("dashboard")
    service = one(objects, "Service", "kube-vgpu-extender")
    scheduler = one(render("overlays/self-signed"), "Deployment", "kube-vgpu-scheduler")
    labels = scheduler["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    (port,) = service["spec"]["ports"]
    extender = {c["name"]: c for _, c in containers(scheduler)}["extender"]
    ports = {p["name"]: p["containerPort"] for p in extender["ports"]}
    assert port["targetPort"] in ports
    probes_port = parse_ours(extender).metrics_port
    assert ports[port["targetPort"]] == probes_port

    dashboard = one(objects, "Deployment", "kube-vgpu-dashboard")
    (container,) = [c for _, c in containers(dashboard)]
    args = parse_ours(container)
    target = urlsplit(args.extender)
    assert target.hostname == f"kube-vgpu-extender.{NAMESPACE}.svc" and target.port == port["port"]
    assert args.listen == ("0.0.0.0", container["ports"][0]["containerPort"])
    front = one(objects, "Service", "kube-vgpu-dashboard")
    assert front["spec"]["selector"].items() <= dashboard["spec"]["template"]["metadata"]["labels"].items()
    assert front["spec"]["ports"][0]["targetPort"] == container["ports"][0]["name"]


def test_the_dashboard_needs_no_api_access() -> None:
    objects = render("dashboard")
    assert pod_spec(one(objects, "Deployment", "kube-vgpu-dashboard"))["automountServiceAccountToken"] is False
    for kind in ("ServiceAccount", "Role", "ClusterRole", "RoleBinding", "ClusterRoleBinding"):
        assert find(objects, kind) == [], kind
    assert sorted((o["kind"], o["metadata"]["name"]) for o in objects) == [
        ("Deployment", "kube-vgpu-dashboard"), ("Service", "kube-vgpu-dashboard"), ("Service", "kube-vgpu-extender")]
