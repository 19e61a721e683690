"""The manifests against the dev cluster's real kube-apiserver (1.37.2 by default, RBAC on, our webhook registered):

* every object an overlay or the examples render is accepted by a server-side dry-run apply (schema, defaulting,
  validation, admission; the example pods come back mutated by the webhook), except kinds whose CRDs the dev
  cluster does not serve (cert-manager's, Kueue's), which are named in the skip list and nowhere else;
* each ServiceAccount may do what its component needs and not what it must not (access reviews through
  impersonation). The extender and kube-scheduler already run under kube-vgpu-extender's RBAC and the device
  plugin's identity has its own kubeconfig in every e2e run (kube_vgpu/devcluster/cluster.py rbac_documents); the
  reviews add the verbs those runs never exercise (the leader-election Lease, the certificate Job);
* the certificate Job's own steps run against the API server under the Job's ServiceAccount and its RBAC.
"""

from __future__ import annotations

import base64
import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from cryptography import x509
from kubernetes import client as k8s_client
from kubernetes import config as k8s_config

from kube_vgpu.cli import main as kube_vgpu_main
from kube_vgpu.dev.devcluster.cluster import DevCluster
from kube_vgpu.dev.devcluster.pki import kubeconfig_document, write_kubeconfig
from kube_vgpu.dev.devcluster.workload import ensure_namespace
from tests.manifests.render import MANIFESTS, kubectl, render
from tests.manifests.test_workloads import certs_job_module

pytestmark = pytest.mark.e2e

#: API groups of CRDs the dev cluster does not install; their objects cannot be checked here.
NOT_SERVED = {"cert-manager.io", "kueue.x-k8s.io"}
NAMESPACE = "kube-vgpu"


def run_kubectl(cluster: DevCluster, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(kubectl()), f"--kubeconfig={cluster.kubeconfig}", *args], input=stdin,
                          capture_output=True, text=True, timeout=120)


def served(cluster: DevCluster, group: str) -> bool:
    return run_kubectl(cluster, "get", "--raw", f"/apis/{group}").returncode == 0


def server_dry_run(cluster: DevCluster, rendered: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[str]]:
    """A server-side dry-run apply of every rendered object the dev cluster serves: (the objects the API server
    returned, "Kind/name" of those skipped because their CRD is not installed)."""
    objects, skipped = [], []
    for obj in rendered:
        group = obj["apiVersion"].rpartition("/")[0]
        if group in NOT_SERVED and not served(cluster, group):
            skipped.append(f"{obj['kind']}/{obj['metadata']['name']}")
            continue
        if obj["kind"] == "MutatingWebhookConfiguration":
            # the dev cluster registered its webhook under this name by URL; a dry-run merge of ours (by Service)
            # would hold both and be refused, so check ours as the new object it is on a real cluster
            obj["metadata"]["name"] += "-dry-run"
        objects.append(obj)
    result = run_kubectl(cluster, "apply", "--server-side", "--force-conflicts", "--dry-run=server",
                         "--field-manager=kube-vgpu-e2e", "-o", "json", "-f", "-",
                         stdin="\n---\n".join(yaml.safe_dump(o) for o in objects))
    assert result.returncode == 0, result.stderr
    returned = json.loads(result.stdout)
    items: list[dict[str, Any]] = returned["items"] if returned.get("kind") == "List" else [returned]
    assert len(items) == len(objects)
    return items, skipped


#: cert-manager's objects, which the dev cluster cannot check (it does not install cert-manager's CRDs)
CERT_MANAGER_OBJECTS = {"Issuer/kube-vgpu-selfsigned", "Certificate/kube-vgpu-webhook-ca", "Issuer/kube-vgpu-ca",
                        "Certificate/kube-vgpu-webhook"}


@pytest.mark.parametrize("kustomization", ["overlays/self-signed", "overlays/cert-manager", "overlays/dynamic-mig",
                                           "examples"])
def test_the_api_server_accepts_every_rendered_object(dev_cluster: DevCluster, kustomization: str) -> None:
    if kustomization == "examples":
        ensure_namespace(dev_cluster.api, "gpu-examples")  # a dry run creates no namespace for the pods
    items, skipped = server_dry_run(dev_cluster, render(kustomization))
    # only cert-manager's objects cannot be checked here (the examples' Kueue objects are a separate kustomization)
    assert set(skipped) <= (CERT_MANAGER_OBJECTS if kustomization == "overlays/cert-manager" else set())
    if kustomization == "examples":  # the pods went through the real webhook
        pods = [item for item in items if item["kind"] == "Pod"]
        assert pods and all(p["spec"]["schedulerName"] == "kube-vgpu-scheduler" for p in pods)
        for pod in pods:
            env = {e["name"] for c in pod["spec"]["containers"] for e in c.get("env") or []}
            assert {"CUDA_DEVICE_SM_LIMIT", "CUDA_DEVICE_MEMORY_SHARED_CACHE", "LD_PRELOAD"} <= env


# ---------------------------------------------------------------------------------------------
# RBAC: what each identity may and may not do
# ---------------------------------------------------------------------------------------------

EXTENDER = "kube-vgpu-extender"
DEVICE_PLUGIN = "kube-vgpu-device-plugin"
WEBHOOK = "kube-vgpu-webhook"
CERTS = "kube-vgpu-certs"

#: (account, verb, resource[.group][/subresource], namespace, name, allowed?)
ACCESS: list[tuple[str, str, str, str, str, bool]] = [
    # the extender
    *((EXTENDER, verb, "nodes", "", "", True) for verb in ("list", "watch")),
    *((EXTENDER, verb, "pods", "team-a", "", True) for verb in ("get", "list", "watch")),
    (EXTENDER, "patch", "pods", "team-a", "", False),  # its annotations travel in the Binding
    (EXTENDER, "create", "pods/binding", "team-a", "", True),
    # preemption (extender/sources/evictor.py); pods/status patch and pods delete also come with
    # system:kube-scheduler, the Eviction API only with our role
    (EXTENDER, "create", "pods/eviction", "team-a", "", True),
    (EXTENDER, "patch", "pods/status", "team-a", "", True),
    *((EXTENDER, verb, "namespaces", "", "", True) for verb in ("list", "watch")),
    *((EXTENDER, verb, f"{plural}.kueue.x-k8s.io", "team-a" if plural == "localqueues" else "", "", True)
      for plural in ("clusterqueues", "localqueues", "resourceflavors", "cohorts", "workloadpriorityclasses")
      for verb in ("list", "watch")),
    # kube-scheduler in the same Pod: its Lease, delegated authentication, events, volumes
    *((EXTENDER, verb, "leases.coordination.k8s.io", NAMESPACE, "kube-vgpu-scheduler", True)
      for verb in ("get", "update")),
    (EXTENDER, "create", "leases.coordination.k8s.io", NAMESPACE, "", True),
    (EXTENDER, "update", "leases.coordination.k8s.io", NAMESPACE, "somebody-else", False),
    (EXTENDER, "get", "configmaps", "kube-system", "extension-apiserver-authentication", True),
    (EXTENDER, "create", "events.events.k8s.io", "team-a", "", True),
    (EXTENDER, "get", "persistentvolumeclaims", "team-a", "", True),
    (EXTENDER, "get", "secrets", NAMESPACE, "", False),
    (EXTENDER, "patch", "nodes", "", "", False),
    (EXTENDER, "create", "pods", "team-a", "", False),
    # the device plugin
    *((DEVICE_PLUGIN, verb, "pods", "team-a", "", True) for verb in ("list", "patch")),
    *((DEVICE_PLUGIN, verb, "nodes", "", "", True) for verb in ("get", "patch")),
    (DEVICE_PLUGIN, "create", "events", "team-a", "", True),
    *((DEVICE_PLUGIN, verb, "pods", "team-a", "", False) for verb in ("watch", "delete", "create")),
    (DEVICE_PLUGIN, "create", "pods/binding", "team-a", "", False),
    (DEVICE_PLUGIN, "create", "pods/eviction", "team-a", "", False),
    (DEVICE_PLUGIN, "get", "secrets", NAMESPACE, "", False),
    # the webhook: nothing
    *((WEBHOOK, verb, "pods", "team-a", "", False) for verb in ("get", "list")),
    (WEBHOOK, "get", "secrets", NAMESPACE, "", False),
    # the certificate Job
    (CERTS, "create", "secrets", NAMESPACE, "", True),
    *((CERTS, verb, "secrets", NAMESPACE, name, True)
      for name in ("kube-vgpu-webhook-tls", "kube-vgpu-webhook-ca") for verb in ("get", "patch")),
    (CERTS, "get", "secrets", NAMESPACE, "somebody-elses", False),
    (CERTS, "list", "secrets", NAMESPACE, "", False),
    (CERTS, "create", "secrets", "default", "", False),
    *((CERTS, verb, "mutatingwebhookconfigurations.admissionregistration.k8s.io", "", "kube-vgpu-webhook", True)
      for verb in ("get", "patch")),
    (CERTS, "patch", "mutatingwebhookconfigurations.admissionregistration.k8s.io", "", "another-webhook", False),
    (CERTS, "list", "pods", NAMESPACE, "", False),
]


@pytest.fixture(scope="module")
def certs_rbac(dev_cluster: DevCluster) -> Iterator[None]:
    """The self-signed overlay's ServiceAccount and RBAC for the certificate Job, applied for real (the dev
    cluster itself carries the scheduler's and the device plugin's)."""
    path = MANIFESTS / "overlays" / "self-signed" / "rbac.yaml"
    result = run_kubectl(dev_cluster, "apply", "--server-side", "--field-manager=kube-vgpu-e2e", "-f", str(path))
    assert result.returncode == 0, result.stderr
    yield
    run_kubectl(dev_cluster, "delete", "--ignore-not-found", "-f", str(path))


def test_each_identity_may_do_what_it_needs_and_not_more(dev_cluster: DevCluster, certs_rbac: None) -> None:
    authorization: Any = k8s_client.AuthorizationV1Api(dev_cluster.api)
    wrong = []
    for account, verb, resource, namespace, name, allowed in ACCESS:
        plural_group, _, subresource = resource.partition("/")
        plural, _, group = plural_group.partition(".")
        attributes = {"verb": verb, "group": group, "resource": plural, "subresource": subresource,
                      "namespace": namespace, "name": name}
        review = {"apiVersion": "authorization.k8s.io/v1", "kind": "SubjectAccessReview",
                  "spec": {"user": f"system:serviceaccount:{NAMESPACE}:{account}",
                           "groups": ["system:serviceaccounts", f"system:serviceaccounts:{NAMESPACE}",
                                      "system:authenticated"],
                           "resourceAttributes": {k: v for k, v in attributes.items() if v}}}
        response = authorization.create_subject_access_review(review, _preload_content=False)
        answer = bool(json.loads(response.data)["status"].get("allowed"))
        if answer != allowed:
            wrong.append(f"{account} {verb} {resource} {namespace}/{name}: allowed={answer}, expected {allowed}")
    assert not wrong, "\n".join(wrong)


# ---------------------------------------------------------------------------------------------
# The certificate Job's steps under its own identity
# ---------------------------------------------------------------------------------------------


def service_account_client(cluster: DevCluster, account: str, tmp_path: Path) -> Any:
    core: Any = k8s_client.CoreV1Api(cluster.api)
    response = core.create_namespaced_service_account_token(
        account, NAMESPACE,
        {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": {"expirationSeconds": 3600}},
        _preload_content=False,
    )
    token = json.loads(response.data)["status"]["token"]
    assert cluster.pki is not None
    path = write_kubeconfig(tmp_path / f"{account}.kubeconfig", kubeconfig_document(
        cluster.server, cluster.pki.ca_cert, f"system:serviceaccount:{NAMESPACE}:{account}", token=token))
    return k8s_config.new_client_from_config(config_file=str(path))


def test_the_certificate_job_steps_run_under_their_service_account(
    dev_cluster: DevCluster, certs_rbac: None, tmp_path: Path
) -> None:
    job = certs_job_module()
    admin: Any = k8s_client.CoreV1Api(dev_cluster.api)
    admission: Any = k8s_client.AdmissionregistrationV1Api(dev_cluster.api)
    # Seed the Secrets with the dev cluster's own webhook CA, so that the run below keeps the caBundle the dev
    # cluster's registration already holds (other tests rely on it).
    dev_certs = dev_cluster.state_dir / "webhook-certs"
    for name, files in job.SECRET_FILES.items():
        admin.create_namespaced_secret(NAMESPACE, {
            "metadata": {"name": name}, "type": job.SECRET_TYPES[name],
            "data": {f: base64.b64encode((dev_certs / f).read_bytes()).decode() for f in files}},
            _preload_content=False)
    try:
        api = service_account_client(dev_cluster, CERTS, tmp_path)
        core, registration = k8s_client.CoreV1Api(api), k8s_client.AdmissionregistrationV1Api(api)
        work = tmp_path / "certs"
        assert job.main(["fetch", f"--dir={work}"], core=core, admission=registration) == 0
        certs_argv = ["certs", f"--dir={work}", "--service=kube-vgpu-webhook", f"--namespace={NAMESPACE}"]
        assert kube_vgpu_main(certs_argv) == 0
        assert job.main(["publish", f"--dir={work}"], core=core, admission=registration) == 0

        def secret(name: str) -> dict[str, bytes]:
            data = json.loads(admin.read_namespaced_secret(name, NAMESPACE, _preload_content=False).data)["data"]
            return {key: base64.b64decode(value) for key, value in data.items()}

        ca_pem = (dev_certs / "ca.crt").read_bytes()
        assert secret("kube-vgpu-webhook-ca")["ca.crt"] == ca_pem  # the CA was kept
        serving = x509.load_pem_x509_certificate(secret("kube-vgpu-webhook-tls")["tls.crt"])
        serving.verify_directly_issued_by(x509.load_pem_x509_certificate(ca_pem))  # reissued for the Service
        names = serving.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert "kube-vgpu-webhook.kube-vgpu.svc" in names.get_values_for_type(x509.DNSName)
        configuration = json.loads(admission.read_mutating_webhook_configuration(
            "kube-vgpu-webhook", _preload_content=False).data)
        assert all(base64.b64decode(w["clientConfig"]["caBundle"]) == ca_pem for w in configuration["webhooks"])
        # the caBundle patch itself, under the Job's identity, as a server-side dry run (a real one would replace
        # the dev cluster's CA): the API server accepts the JSON Patch and the RBAC allows it
        operations = job.ca_bundle_patch(configuration, b"-----BEGIN CERTIFICATE-----\nother\n")
        assert operations
        registration.patch_mutating_webhook_configuration(
            "kube-vgpu-webhook", operations, dry_run="All", _content_type=job.JSON_PATCH, _preload_content=False)
    finally:
        for name in job.SECRET_FILES:
            admin.delete_namespaced_secret(name, NAMESPACE, _preload_content=False)
