"""A private CA and a serving certificate for the webhook (and the dev cluster), made with `cryptography`.

`ensure_ca_and_serving_cert(directory, hostnames, ips)` reuses what is already in the directory when it is still
good (the CA signed the serving cert, the keys match, nothing expires within the renewal margin, the serving cert
names every requested host) and otherwise issues what is missing. Files use the names of a kubernetes.io/tls
Secret (tls.crt, tls.key, ca.crt) so the same directory can be mounted from one. Keys are ECDSA P-256: small, fast
handshakes, and accepted by the Go TLS stack of the kube-apiserver.

Also the `kube-vgpu certs` subcommand (`add_arguments` / `run`).
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import datetime as dt
import fcntl
import ipaddress
import os
import sys
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

CA_CERT_FILE = "ca.crt"
CA_KEY_FILE = "ca.key"
CERT_FILE = "tls.crt"
KEY_FILE = "tls.key"

CA_VALIDITY_DAYS = 3650
SERVING_VALIDITY_DAYS = 365
#: A serving cert is reissued when it has less than this left, so a restart well before expiry renews it.
RENEW_BEFORE_DAYS = 30
#: Backdating covers clocks a little behind ours (the API server checks notBefore too).
CLOCK_SKEW = dt.timedelta(minutes=5)

DEFAULT_HOSTNAMES = ("localhost",)
DEFAULT_IPS = ("127.0.0.1", "::1")

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


@dataclass(frozen=True, slots=True)
class CertificatePaths:
    directory: Path
    ca_cert: Path
    ca_key: Path
    cert: Path
    key: Path
    ca_pem: bytes  # the CA bundle for clients (a MutatingWebhookConfiguration's caBundle, base64-encoded)
    issued: bool  # True when this call wrote a new serving certificate

    @property
    def ca_bundle_base64(self) -> str:
        return base64.b64encode(self.ca_pem).decode()


class CertificateError(RuntimeError):
    """Certificate files that cannot be used; the message names the file."""


def service_hostnames(name: str, namespace: str) -> list[str]:
    """Every name the API server may use to reach a Service (it dials <name>.<namespace>.svc)."""
    return [name, f"{name}.{namespace}", f"{name}.{namespace}.svc", f"{name}.{namespace}.svc.cluster.local"]


def ensure_ca_and_serving_cert(
    directory: str | os.PathLike[str],
    hostnames: Iterable[str] = DEFAULT_HOSTNAMES,
    ips: Iterable[str] = DEFAULT_IPS,
    *,
    now: dt.datetime | None = None,
    serving_validity_days: int = SERVING_VALIDITY_DAYS,
    renew_before_days: int = RENEW_BEFORE_DAYS,
) -> CertificatePaths:
    """Create (or reuse) a CA and a serving certificate for `hostnames` and `ips` in `directory`.

    Safe to call from several processes at once (a lock file serialises them). `now` is for tests."""
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    if isinstance(hostnames, str) or isinstance(ips, str):
        raise TypeError("hostnames and ips are lists of strings, not one string")
    names = list(dict.fromkeys(hostnames))
    addresses = list(dict.fromkeys(ipaddress.ip_address(ip) for ip in ips))
    if not names and not addresses:
        raise ValueError("a serving certificate needs at least one hostname or IP address")
    moment = now or dt.datetime.now(dt.UTC)
    renew_margin = dt.timedelta(days=renew_before_days)
    paths = {name: root / name for name in (CA_CERT_FILE, CA_KEY_FILE, CERT_FILE, KEY_FILE)}
    with _locked(root / ".lock"):
        ca = _load_pair(paths[CA_CERT_FILE], paths[CA_KEY_FILE])
        # The CA must outlive any serving cert issued now, or clients would stop trusting it first.
        if ca is None or not _is_ca(ca[0]) or not _valid_for(ca[0], moment, dt.timedelta(days=serving_validity_days)):
            ca = _new_ca(moment)
            _write(paths[CA_KEY_FILE], _key_pem(ca[1]), private=True)
            _write(paths[CA_CERT_FILE], ca[0].public_bytes(serialization.Encoding.PEM))
        ca_cert, ca_key = ca
        serving = _load_pair(paths[CERT_FILE], paths[KEY_FILE])
        issued = serving is None or not _serving_cert_fits(serving[0], ca_cert, names, addresses, moment, renew_margin)
        if issued:
            cert, key = _new_serving_cert(ca_cert, ca_key, names, addresses, moment, serving_validity_days)
            # Key first, then cert: a hot-reloading server that reads in between sees a mismatched pair, refuses it
            # and keeps serving the old one until the next check.
            _write(paths[KEY_FILE], _key_pem(key), private=True)
            _write(paths[CERT_FILE], cert.public_bytes(serialization.Encoding.PEM))
    return CertificatePaths(
        directory=root,
        ca_cert=paths[CA_CERT_FILE],
        ca_key=paths[CA_KEY_FILE],
        cert=paths[CERT_FILE],
        key=paths[KEY_FILE],
        ca_pem=ca_cert.public_bytes(serialization.Encoding.PEM),
        issued=issued,
    )


def issue_serving_cert(
    ca_cert: x509.Certificate,
    ca_key: ec.EllipticCurvePrivateKey,
    hostnames: Sequence[str],
    ips: Sequence[str] = (),
    *,
    now: dt.datetime | None = None,
    validity_days: int = SERVING_VALIDITY_DAYS,
) -> tuple[bytes, bytes]:
    """A fresh serving cert signed by the CA: (cert PEM, key PEM). For callers that rotate files themselves."""
    moment = now or dt.datetime.now(dt.UTC)
    cert, key = _new_serving_cert(
        ca_cert, ca_key, list(hostnames), [ipaddress.ip_address(ip) for ip in ips], moment, validity_days
    )
    return cert.public_bytes(serialization.Encoding.PEM), _key_pem(key)


def load_ca(paths: CertificatePaths) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    pair = _load_pair(paths.ca_cert, paths.ca_key)
    if pair is None:
        raise CertificateError(f"no usable CA in {paths.directory}")
    return pair


# ---------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _write(path: Path, data: bytes, *, private: bool = False) -> None:
    """Atomic replace (readers never see half a file); private files are created 0600 from the start."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        os.fchmod(fd, 0o600 if private else 0o644)
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _load_pair(cert_path: Path, key_path: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey] | None:
    """The cert and its key, or None when either is missing, unreadable, not ECDSA, or they do not match."""
    try:
        cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
        key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
    except (OSError, ValueError, TypeError):
        return None
    if not isinstance(key, ec.EllipticCurvePrivateKey) or cert.public_key() != key.public_key():
        return None
    return cert, key


def _is_ca(cert: x509.Certificate) -> bool:
    try:
        return bool(cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca)
    except x509.ExtensionNotFound:
        return False


def _valid_for(cert: x509.Certificate, moment: dt.datetime, margin: dt.timedelta) -> bool:
    return cert.not_valid_before_utc <= moment and cert.not_valid_after_utc - margin > moment


def _serving_cert_fits(
    cert: x509.Certificate,
    ca_cert: x509.Certificate,
    names: list[str],
    addresses: list[IPAddress],
    moment: dt.datetime,
    renew_margin: dt.timedelta,
) -> bool:
    try:
        cert.verify_directly_issued_by(ca_cert)
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except (InvalidSignature, ValueError, TypeError, x509.ExtensionNotFound):
        return False
    covers = set(names) <= set(san.get_values_for_type(x509.DNSName)) and set(addresses) <= set(
        san.get_values_for_type(x509.IPAddress)
    )
    return covers and _valid_for(cert, moment, renew_margin)


def _new_ca(moment: dt.datetime) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kube-vgpu CA")])
    public = key.public_key()
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(public)
        .serial_number(x509.random_serial_number())
        .not_valid_before(moment - CLOCK_SKEW)
        .not_valid_after(moment + dt.timedelta(days=CA_VALIDITY_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
        .sign(key, hashes.SHA256())
    )
    return cert, key


def _new_serving_cert(
    ca_cert: x509.Certificate,
    ca_key: ec.EllipticCurvePrivateKey,
    names: list[str],
    addresses: list[IPAddress],
    moment: dt.datetime,
    validity_days: int,
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    public = key.public_key()
    common_name = names[0] if names else str(addresses[0])
    general_names: list[x509.GeneralName] = [x509.DNSName(name) for name in names]
    general_names += [x509.IPAddress(address) for address in addresses]
    not_after = min(moment + dt.timedelta(days=validity_days), ca_cert.not_valid_after_utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name[:64])]))
        .issuer_name(ca_cert.subject)
        .public_key(public)
        .serial_number(x509.random_serial_number())
        .not_valid_before(moment - CLOCK_SKEW)
        .not_valid_after(not_after)
        # Go (the API server) ignores the CN: only the SANs name the server.
        .add_extension(x509.SubjectAlternativeName(general_names), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=False,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_cert.public_key()),  # type: ignore[arg-type]
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    return cert, key


# ---------------------------------------------------------------------------------------------
# `kube-vgpu certs`
# ---------------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dir", required=True, type=Path, help="directory for ca.crt, ca.key, tls.crt, tls.key")
    parser.add_argument("--hostname", action="append", default=[], help="DNS name for the serving cert (repeatable)")
    parser.add_argument("--ip", action="append", default=[], help="IP address for the serving cert (repeatable)")
    parser.add_argument("--service", help="Service name: adds <svc>, <svc>.<ns>, <svc>.<ns>.svc, ...cluster.local")
    parser.add_argument("--namespace", default="kube-vgpu", help="namespace of --service (default: %(default)s)")
    parser.add_argument(
        "--webhook-config-out",
        help="also write the MutatingWebhookConfiguration (YAML) pointing at --service with this CA to FILE ('-' "
        "for stdout)",
    )
    parser.add_argument("--ca-bundle-base64", action="store_true", help="print the CA bundle base64-encoded")


def run(args: argparse.Namespace) -> int:
    hostnames = list(args.hostname)
    if args.service:
        hostnames += service_hostnames(args.service, args.namespace)
    ips = list(args.ip)
    if not hostnames and not ips:
        hostnames, ips = list(DEFAULT_HOSTNAMES), list(DEFAULT_IPS)
    try:
        paths = ensure_ca_and_serving_cert(args.dir, hostnames, ips)
    except (OSError, ValueError) as exc:
        print(f"kube-vgpu certs: {exc}", file=sys.stderr)
        return 1
    verb = "issued" if paths.issued else "reused"
    print(f"{verb} serving certificate {paths.cert} (key {paths.key}); CA {paths.ca_cert}", file=sys.stderr)
    if args.webhook_config_out:
        if not args.service:
            print("kube-vgpu certs: --webhook-config-out needs --service", file=sys.stderr)
            return 2
        import yaml

        from kube_vgpu.webhook.registration import ServiceReference, mutating_webhook_configuration

        document = mutating_webhook_configuration(
            paths.ca_pem, service=ServiceReference(namespace=args.namespace, name=args.service)
        )
        text = yaml.safe_dump(document, sort_keys=False)
        if args.webhook_config_out == "-":
            sys.stdout.write(text)
            return 0
        Path(args.webhook_config_out).write_text(text)
    sys.stdout.write(paths.ca_bundle_base64 + "\n" if args.ca_bundle_base64 else paths.ca_pem.decode())
    return 0
