"""The real Kueue controller in the dev cluster (ClusterOptions.kueue): its objects, built from Kueue's own module.

Everything here is read from the Kueue module the binary was built from (binaries.kueue_source_dir()): the CRDs
(config/components/crd/bases), the webhook configurations (config/components/webhook/manifests.yaml) and the
manager's RBAC (config/components/rbac), renamed the way Kueue's kustomize overlay renames them (namespace
`system` -> kueue-system, names prefixed `kueue-`). Only what differs from a Deployment in a real cluster is ours:

* Kueue's webhook server runs on this machine, so the API server reaches it by URL (https://127.0.0.1:<port>)
  instead of through the kueue-webhook-service Service (there is no kube-proxy here).
* Kueue's internal certificate management stays on, as in its default install: it rotates the serving certificate
  kept in the kueue-webhook-server-cert Secret and injects its CA into the webhook configurations and the CRDs'
  conversion webhooks. We create that Secret first, with a CA it accepts (Kueue's CA name, kueue-ca, an RSA key in
  PKCS#1 as its own) and a serving certificate that names both the Service (which the rotator checks) and 127.0.0.1
  (which the API server dials), so the rotator keeps it instead of issuing one for the Service name only; and we
  write its files into Kueue's certDir, where its Deployment mounts the Secret. (With internal certificates off, Kueue
  v0.19 reads its metrics certificate from the fixed path /etc/kueue/metrics/certs, which a dev cluster cannot own.)
* Only the batch/job integration is enabled, and only the webhooks of Kueue's own objects and of batch/v1 Jobs are
  registered: the others (pods, Deployments, ...) would intercept objects whose integrations are off here.
* Resources: the transformation of Kueue's "Using HAMi" guide (HAMI_TRANSFORMATIONS), so per-vGPU memory and
  compute are budgeted as nvidia.com/total-gpumem and nvidia.com/total-gpucores.
"""

from __future__ import annotations

import base64
import copy
import datetime as dt
import ipaddress
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

KUEUE_NAMESPACE = "kueue-system"
NAME_PREFIX = "kueue-"
SERVICE_ACCOUNT = "kueue-controller-manager"
WEBHOOK_SERVICE = "kueue-webhook-service"
WEBHOOK_SECRET = "kueue-webhook-server-cert"
#: The CA name Kueue's certificate rotator checks the Secret's CA against (pkg/util/cert: caName).
CA_NAME = "kueue-ca"
MUTATING_CONFIGURATION = "kueue-mutating-webhook-configuration"
VALIDATING_CONFIGURATION = "kueue-validating-webhook-configuration"
#: CRDs whose versions Kueue converts with its webhook (config/components/crd/kustomization.yaml's patches).
CONVERTED_CRDS = ("localqueues", "clusterqueues", "cohorts", "workloads", "multikueueclusters")
#: Kueue integrations enabled in the dev cluster (only batch/v1 Jobs exist here).
INTEGRATIONS = ("batch/job",)
#: API groups whose webhooks are registered: Kueue's own objects and batch/v1 Jobs.
WEBHOOK_GROUPS = frozenset({"kueue.x-k8s.io", "batch"})
#: Kueue's "Using HAMi" guide: per-vGPU memory and compute, times the vGPU count, replace the per-vGPU inputs.
HAMI_TRANSFORMATIONS: tuple[dict[str, Any], ...] = (
    {"input": "nvidia.com/gpucores", "strategy": "Replace", "multiplyBy": "nvidia.com/gpu",
     "outputs": {"nvidia.com/total-gpucores": "1"}},
    {"input": "nvidia.com/gpumem", "strategy": "Replace", "multiplyBy": "nvidia.com/gpu",
     "outputs": {"nvidia.com/total-gpumem": "1"}},
)
#: Kueue's feature gates we turn off: the visibility API server would need an APIService and a port of its own.
FEATURE_GATES = "VisibilityOnDemand=false"
#: The rotator renews a certificate that expires within 90 days: ours last well beyond that.
CA_VALIDITY_DAYS = 3650
SERVING_VALIDITY_DAYS = 365


def _documents(path: Path) -> list[dict[str, Any]]:
    with path.open() as stream:
        return [doc for doc in yaml.safe_load_all(stream) if isinstance(doc, dict)]


def _crd_dir(source: Path) -> Path:
    return source / "config" / "components" / "crd" / "bases"


def crd_documents(source: Path, *, conversion_url: str | None = None, ca_pem: bytes | None = None
                  ) -> list[dict[str, Any]]:
    """Kueue's CRDs as its release ships them. With `conversion_url` (Kueue's controller running), the CRDs Kueue
    converts call its /convert; without (only the CRDs, no controller), they keep the bases' `None` strategy."""
    documents = []
    for path in sorted(_crd_dir(source).glob("*.yaml")):
        for crd in _documents(path):
            plural = str(crd["spec"]["names"]["plural"])
            if conversion_url is not None and plural in CONVERTED_CRDS:
                client_config: dict[str, Any] = {"url": f"{conversion_url}/convert"}
                if ca_pem is not None:
                    client_config["caBundle"] = base64.b64encode(ca_pem).decode()
                crd["spec"]["conversion"] = {
                    "strategy": "Webhook",
                    "webhook": {"clientConfig": client_config, "conversionReviewVersions": ["v1"]},
                }
            documents.append(crd)
    if not documents:
        raise FileNotFoundError(f"no CRDs in {_crd_dir(source)}")
    return documents


def crd_names(source: Path) -> list[str]:
    return [str(crd["metadata"]["name"]) for crd in crd_documents(source)]


def webhook_configurations(source: Path, base_url: str, ca_pem: bytes) -> list[dict[str, Any]]:
    """Kueue's mutating and validating webhook configurations, reduced to WEBHOOK_GROUPS, pointing at base_url."""
    path = source / "config" / "components" / "webhook" / "manifests.yaml"
    configurations = []
    for document in _documents(path):
        kind = document["kind"]
        name = MUTATING_CONFIGURATION if kind == "MutatingWebhookConfiguration" else VALIDATING_CONFIGURATION
        webhooks = []
        for webhook in document.get("webhooks") or []:
            groups = {group for rule in webhook.get("rules") or [] for group in rule.get("apiGroups") or []}
            if not groups or not groups <= WEBHOOK_GROUPS:
                continue
            webhook = copy.deepcopy(webhook)
            webhook_path = webhook["clientConfig"]["service"]["path"]
            webhook["clientConfig"] = {"url": f"{base_url}{webhook_path}",
                                       "caBundle": base64.b64encode(ca_pem).decode()}
            webhooks.append(webhook)
        configurations.append({"apiVersion": document["apiVersion"], "kind": kind, "metadata": {"name": name},
                               "webhooks": webhooks})
    return configurations


def _prefixed(document: dict[str, Any]) -> dict[str, Any]:
    """Kueue's kustomize overlay: namespace `system` -> kueue-system, every name prefixed `kueue-` (the webhook
    configurations' resourceNames in its rules too, as its name references do)."""
    document = copy.deepcopy(document)
    metadata = document.setdefault("metadata", {})
    metadata["name"] = NAME_PREFIX + str(metadata["name"])
    if "namespace" in metadata:
        metadata["namespace"] = KUEUE_NAMESPACE
    if "roleRef" in document:
        document["roleRef"]["name"] = NAME_PREFIX + str(document["roleRef"]["name"])
    for subject in document.get("subjects") or []:
        subject["name"] = NAME_PREFIX + str(subject["name"])
        subject["namespace"] = KUEUE_NAMESPACE
    for rule in document.get("rules") or []:
        names = rule.get("resourceNames")
        if names and set(rule.get("resources") or ()) & {"mutatingwebhookconfigurations",
                                                          "validatingwebhookconfigurations"}:
            rule["resourceNames"] = [NAME_PREFIX + str(name) for name in names]
    return document


#: The manager's own identity from config/components/rbac: its account, its ClusterRole and the Role on the
#: certificate Secret (no leader election: one replica here).
RBAC_FILES = ("service_account.yaml", "role.yaml", "role_binding.yaml", "manager_secrets_role.yaml",
              "manager_secrets_role_binding.yaml")


def rbac_documents(source: Path) -> list[dict[str, Any]]:
    directory = source / "config" / "components" / "rbac"
    return [_prefixed(document) for name in RBAC_FILES for document in _documents(directory / name)]


def configuration(*, webhook_port: int, health_port: int, metrics_port: int, cert_dir: Path,
                  transformations: Iterable[Mapping[str, Any]] = HAMI_TRANSFORMATIONS) -> dict[str, Any]:
    """Kueue's Configuration (config.kueue.x-k8s.io/v1beta2) for the dev cluster."""
    return {
        "apiVersion": "config.kueue.x-k8s.io/v1beta2",
        "kind": "Configuration",
        "namespace": KUEUE_NAMESPACE,
        "health": {"healthProbeBindAddress": f"127.0.0.1:{health_port}"},
        "metrics": {"bindAddress": f"127.0.0.1:{metrics_port}"},
        "webhook": {"host": "127.0.0.1", "port": webhook_port, "certDir": str(cert_dir)},
        "leaderElection": {"leaderElect": False},
        "internalCertManagement": {"enable": True, "webhookServiceName": WEBHOOK_SERVICE,
                                   "webhookSecretName": WEBHOOK_SECRET},
        "clientConnection": {"qps": 300, "burst": 500},
        "integrations": {"frameworks": list(INTEGRATIONS)},
        "resources": {"transformations": [dict(t) for t in transformations]},
    }


def webhook_secret(now: dt.datetime | None = None) -> tuple[dict[str, Any], dict[str, bytes]]:
    """The kueue-webhook-server-cert Secret Kueue's rotator will keep, and its files (ca.crt, ca.key, tls.crt,
    tls.key): Kueue's Deployment mounts the Secret at its certDir, so the dev cluster writes them there."""
    moment = now or dt.datetime.now(dt.UTC)
    # RSA keys in PKCS#1: the rotator parses the CA key with x509.ParsePKCS1PrivateKey, as its own keys are made
    ca_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, CA_NAME),
                         x509.NameAttribute(NameOID.ORGANIZATION_NAME, "kueue")])
    ca_cert = (
        x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(moment - dt.timedelta(minutes=5))
        .not_valid_after(moment + dt.timedelta(days=CA_VALIDITY_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                     data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                     crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
        # the rotator verifies the CA as a certificate for the name kueue-ca
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(CA_NAME)]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    service_name = f"{WEBHOOK_SERVICE}.{KUEUE_NAMESPACE}.svc"
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, service_name)]))
        .issuer_name(ca_cert.subject).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(moment - dt.timedelta(minutes=5))
        .not_valid_after(moment + dt.timedelta(days=SERVING_VALIDITY_DAYS))
        .add_extension(x509.SubjectAlternativeName([
            x509.DNSName(service_name), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )

    def pem_key(private: rsa.RSAPrivateKey) -> bytes:
        return private.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.TraditionalOpenSSL,
                                     serialization.NoEncryption())

    data = {"ca.crt": ca_cert.public_bytes(serialization.Encoding.PEM), "ca.key": pem_key(ca_key),
            "tls.crt": cert.public_bytes(serialization.Encoding.PEM), "tls.key": pem_key(key)}
    secret = {"apiVersion": "v1", "kind": "Secret",
              "metadata": {"name": WEBHOOK_SECRET, "namespace": KUEUE_NAMESPACE},
              "data": {name: base64.b64encode(value).decode() for name, value in data.items()}}
    return secret, data
