"""The objects the dev cluster derives from Kueue's own module (kube_vgpu/dev/devcluster/kueue.py): read from the real
v0.19.2 source (downloaded through the Go module proxy, a few MiB; nothing is built), checked for what the API server
and Kueue's certificate rotator need."""

from __future__ import annotations

import base64
import datetime as dt
import ipaddress
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.x509.oid import ExtendedKeyUsageOID

from kube_vgpu.dev.devcluster import kueue
from kube_vgpu.dev.devcluster.binaries import kueue_source_dir

BASE_URL = "https://127.0.0.1:9443"


@pytest.fixture(scope="module")
def source() -> Path:
    return kueue_source_dir(progress=lambda _message: None)


def test_the_crds_are_kueues_own_and_the_converted_ones_call_kueue_by_url(source: Path) -> None:
    plain = {crd["spec"]["names"]["plural"]: crd for crd in kueue.crd_documents(source)}
    assert {"clusterqueues", "localqueues", "resourceflavors", "cohorts", "workloads",
            "workloadpriorityclasses"} <= set(plain)
    # no controller: the bases' strategy (None), so the API server serves them without a webhook
    assert all("conversion" not in crd["spec"] for crd in plain.values())
    served = {version["name"] for version in plain["clusterqueues"]["spec"]["versions"] if version["served"]}
    assert served == {"v1beta1", "v1beta2"}
    converted = {crd["spec"]["names"]["plural"]: crd
                 for crd in kueue.crd_documents(source, conversion_url=BASE_URL, ca_pem=b"CA")}
    for plural, crd in converted.items():
        conversion = crd["spec"].get("conversion")
        if plural in kueue.CONVERTED_CRDS:
            assert conversion["strategy"] == "Webhook"
            assert conversion["webhook"]["clientConfig"] == {"url": f"{BASE_URL}/convert",
                                                             "caBundle": base64.b64encode(b"CA").decode()}
        else:
            assert conversion is None, plural


def test_only_the_webhooks_of_kueues_objects_and_jobs_are_registered_by_url(source: Path) -> None:
    configurations = kueue.webhook_configurations(source, BASE_URL, b"CA")
    names = {c["kind"]: c["metadata"]["name"] for c in configurations}
    assert names == {"MutatingWebhookConfiguration": kueue.MUTATING_CONFIGURATION,
                     "ValidatingWebhookConfiguration": kueue.VALIDATING_CONFIGURATION}
    hooks = {webhook["name"]: webhook for c in configurations for webhook in c["webhooks"]}
    assert {"mjob.kb.io", "vjob.kb.io", "mworkload.kb.io", "vworkload.kb.io", "vclusterqueue.kb.io"} <= set(hooks)
    # pods, Deployments, ... are other integrations: not enabled here, their webhooks would intercept everything
    assert not {"mpod.kb.io", "vpod.kb.io", "mdeployment.kb.io"} & set(hooks)
    for webhook in hooks.values():
        assert webhook["clientConfig"]["url"].startswith(f"{BASE_URL}/")
        assert "service" not in webhook["clientConfig"]
    assert hooks["mjob.kb.io"]["clientConfig"]["url"] == f"{BASE_URL}/mutate-batch-v1-job"


def test_the_managers_identity_is_renamed_as_kueues_overlay_renames_it(source: Path) -> None:
    documents = kueue.rbac_documents(source)
    kinds = {(d["kind"], d["metadata"]["name"]) for d in documents}
    assert ("ServiceAccount", kueue.SERVICE_ACCOUNT) in kinds
    assert ("ClusterRole", "kueue-manager-role") in kinds
    binding = next(d for d in documents if d["kind"] == "ClusterRoleBinding")
    assert binding["roleRef"]["name"] == "kueue-manager-role"
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": kueue.SERVICE_ACCOUNT,
                                    "namespace": kueue.KUEUE_NAMESPACE}]
    role = next(d for d in documents if d["metadata"]["name"] == "kueue-manager-role")
    webhook_rules = [r for r in role["rules"] if r.get("resourceNames")
                     and "mutatingwebhookconfigurations" in r.get("resources", [])]
    # the rotator may update exactly the configurations we register
    assert webhook_rules and all(r["resourceNames"] == [kueue.MUTATING_CONFIGURATION] for r in webhook_rules)
    secrets = next(d for d in documents if d["kind"] == "Role")
    assert secrets["metadata"]["namespace"] == kueue.KUEUE_NAMESPACE


def test_the_webhook_secret_is_one_kueues_rotator_keeps() -> None:
    """cert-controller keeps a Secret whose CA verifies as a certificate for kueue-ca, whose CA key is PKCS#1 RSA,
    and whose serving certificate verifies for <service>.<namespace>.svc; ours also names 127.0.0.1 (the API
    server dials it there)."""
    now = dt.datetime(2026, 11, 26, tzinfo=dt.UTC)
    secret, files = kueue.webhook_secret(now)
    assert secret["metadata"] == {"name": kueue.WEBHOOK_SECRET, "namespace": kueue.KUEUE_NAMESPACE}
    assert {name: base64.b64decode(value) for name, value in secret["data"].items()} == files
    assert files["ca.key"].startswith(b"-----BEGIN RSA PRIVATE KEY-----")
    ca = x509.load_pem_x509_certificate(files["ca.crt"])
    assert ca.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
        x509.DNSName) == [kueue.CA_NAME]
    serving = x509.load_pem_x509_certificate(files["tls.crt"])
    names = serving.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert names.get_values_for_type(x509.DNSName) == [f"{kueue.WEBHOOK_SERVICE}.{kueue.KUEUE_NAMESPACE}.svc"]
    assert names.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("127.0.0.1")]
    assert serving.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value == x509.ExtendedKeyUsage(
        [ExtendedKeyUsageOID.SERVER_AUTH])
    public = ca.public_key()
    assert isinstance(public, rsa.RSAPublicKey)
    serving.verify_directly_issued_by(ca)
    # the rotator renews what expires within 90 days
    assert serving.not_valid_after_utc - now > dt.timedelta(days=90)
    assert ca.not_valid_after_utc - now > dt.timedelta(days=90)


def test_the_configuration_enables_jobs_and_the_hami_transformations(tmp_path: Path) -> None:
    config = kueue.configuration(webhook_port=1, health_port=2, metrics_port=3, cert_dir=tmp_path)
    assert config["integrations"] == {"frameworks": ["batch/job"]}
    assert config["webhook"] == {"host": "127.0.0.1", "port": 1, "certDir": str(tmp_path)}
    transformations = {t["input"]: t for t in config["resources"]["transformations"]}
    assert transformations["nvidia.com/gpumem"] == {"input": "nvidia.com/gpumem", "strategy": "Replace",
                                                    "multiplyBy": "nvidia.com/gpu",
                                                    "outputs": {"nvidia.com/total-gpumem": "1"}}
    assert transformations["nvidia.com/gpucores"]["outputs"] == {"nvidia.com/total-gpucores": "1"}
