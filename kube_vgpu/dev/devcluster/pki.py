"""Certificates, keys and kubeconfigs of the dev cluster.

One CA (webhook.certs.ensure_ca_and_serving_cert, the same code the webhook's self-signed mode uses) signs:

* the serving certificate of kube-apiserver and etcd (localhost, 127.0.0.1);
* client certificates: the admin (group system:masters), kube-apiserver's client of etcd, and
  kube-controller-manager (user system:kube-controller-manager, which the API server's default RBAC knows).

The service-account signing key pair (ECDSA P-256, ES256 tokens) lets the API server issue ServiceAccount tokens
(TokenRequest), so kube-scheduler, the extender and the heartbeat authenticate as the kube-vgpu ServiceAccounts
the manifests deploy them as, and are authorised by RBAC exactly as in a cluster.
"""

from __future__ import annotations

import base64
import datetime as dt
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from kube_vgpu.webhook.certs import CertificatePaths, ensure_ca_and_serving_cert, load_ca

CLIENT_VALIDITY_DAYS = 365
CLOCK_SKEW = dt.timedelta(minutes=5)
SERVING_HOSTNAMES = ("localhost",)
SERVING_IPS = ("127.0.0.1",)

ADMIN_USER = "kube-vgpu-dev-admin"
ADMIN_GROUP = "system:masters"
ETCD_CLIENT_USER = "kube-apiserver-etcd-client"
#: The user the API server's bootstrap RBAC binds to the system:kube-controller-manager ClusterRole.
CONTROLLER_MANAGER_USER = "system:kube-controller-manager"
CLUSTER_NAME = "kube-vgpu-dev"


@dataclass(frozen=True)
class ClientCert:
    cert: Path
    key: Path


@dataclass(frozen=True)
class Pki:
    directory: Path
    serving: CertificatePaths  # ca.crt/ca.key and the loopback serving cert (tls.crt/tls.key)
    admin: ClientCert
    etcd_client: ClientCert
    etcd_serving: ClientCert  # server and client usage, for 127.0.0.1 and localhost
    service_account_key: Path  # private (the API server signs tokens with it)
    service_account_public_key: Path  # public (the API server verifies tokens with it)
    controller_manager: ClientCert  # system:kube-controller-manager, no groups

    @property
    def ca_cert(self) -> Path:
        return self.serving.ca_cert


def ensure_pki(directory: Path) -> Pki:
    """Create (or reuse, when still valid) everything in `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    serving = ensure_ca_and_serving_cert(directory, SERVING_HOSTNAMES, SERVING_IPS)
    ca_cert, ca_key = load_ca(serving)
    # Reissued on every call: cheap (ECDSA), and a CA that was just replaced invalidates old client certs.
    admin = _issue_client_cert(directory, "admin", ca_cert, ca_key, ADMIN_USER, (ADMIN_GROUP,))
    etcd_client = _issue_client_cert(directory, "etcd-client", ca_cert, ca_key, ETCD_CLIENT_USER, ())
    # etcd's own gRPC gateway dials etcd with the serving cert as a client cert: it needs both usages.
    etcd_serving = _issue_client_cert(directory, "etcd-server", ca_cert, ca_key, "etcd", (), serving=True)
    sa_key, sa_pub = _ensure_service_account_keys(directory)
    controller_manager = _issue_client_cert(
        directory, "kube-controller-manager", ca_cert, ca_key, CONTROLLER_MANAGER_USER, ()
    )
    return Pki(directory, serving, admin, etcd_client, etcd_serving, sa_key, sa_pub, controller_manager)


def _issue_client_cert(
    directory: Path,
    stem: str,
    ca_cert: x509.Certificate,
    ca_key: ec.EllipticCurvePrivateKey,
    user: str,
    groups: tuple[str, ...],
    *,
    serving: bool = False,
) -> ClientCert:
    """A client certificate: the API server reads the user from the CN and the groups from the O attributes.
    With `serving`, also a serving certificate for the loopback names."""
    now = dt.datetime.now(dt.UTC)
    key = ec.generate_private_key(ec.SECP256R1())
    subject = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, group) for group in groups]
    subject.append(x509.NameAttribute(NameOID.COMMON_NAME, user))
    usages = [ExtendedKeyUsageOID.CLIENT_AUTH, *([ExtendedKeyUsageOID.SERVER_AUTH] if serving else [])]
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name(subject))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - CLOCK_SKEW)
        .not_valid_after(min(now + dt.timedelta(days=CLIENT_VALIDITY_DAYS), ca_cert.not_valid_after_utc))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
    )
    if serving:
        names: list[x509.GeneralName] = [x509.DNSName(name) for name in SERVING_HOSTNAMES]
        names += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in SERVING_IPS]
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    cert = builder.sign(ca_key, hashes.SHA256())
    paths = ClientCert(directory / f"{stem}.crt", directory / f"{stem}.key")
    _write(paths.key, _private_pem(key), private=True)
    _write(paths.cert, cert.public_bytes(serialization.Encoding.PEM))
    return paths


def _ensure_service_account_keys(directory: Path) -> tuple[Path, Path]:
    private_path, public_path = directory / "sa.key", directory / "sa.pub"
    try:
        key = serialization.load_pem_private_key(private_path.read_bytes(), password=None)
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise ValueError("not an ECDSA key")
    except (OSError, ValueError, TypeError):
        key = ec.generate_private_key(ec.SECP256R1())
        _write(private_path, _private_pem(key), private=True)
    public = key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    _write(public_path, public)
    return private_path, public_path


def _private_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _write(path: Path, data: bytes, *, private: bool = False) -> None:
    """Atomic replace; private files are created 0600."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)
    os.replace(tmp, path)


# ---------------------------------------------------------------------------------------------------------------
# kubeconfigs
# ---------------------------------------------------------------------------------------------------------------


def kubeconfig_document(
    server: str, ca_cert: Path, user: str, *, client: ClientCert | None = None, token: str | None = None
) -> dict[str, Any]:
    """A self-contained kubeconfig (certificates embedded), authenticating with a client cert or a bearer token."""
    if (client is None) == (token is None):
        raise ValueError("give exactly one of client or token")
    credentials: dict[str, str]
    if client is not None:
        credentials = {
            "client-certificate-data": _b64(client.cert.read_bytes()),
            "client-key-data": _b64(client.key.read_bytes()),
        }
    else:
        assert token is not None
        credentials = {"token": token}
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": CLUSTER_NAME,
                "cluster": {"server": server, "certificate-authority-data": _b64(ca_cert.read_bytes())},
            }
        ],
        "users": [{"name": user, "user": credentials}],
        "contexts": [{"name": CLUSTER_NAME, "context": {"cluster": CLUSTER_NAME, "user": user}}],
        "current-context": CLUSTER_NAME,
        "preferences": {},
    }


def write_kubeconfig(path: Path, document: dict[str, Any]) -> Path:
    # private: it holds a key or a token
    _write(path, yaml.safe_dump(document, sort_keys=False).encode(), private=True)
    return path


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()
