"""The CA and serving certificate: contents a Go TLS client (the kube-apiserver) accepts, reuse, renewal."""

from __future__ import annotations

import base64
import datetime as dt
import ipaddress
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID

from kube_vgpu.webhook.certs import ensure_ca_and_serving_cert, service_hostnames
from kube_vgpu.webhook.registration import ServiceReference, mutating_webhook_configuration


def _cert(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def test_issues_a_ca_and_a_serving_cert_for_the_names(tmp_path: Path) -> None:
    paths = ensure_ca_and_serving_cert(tmp_path, ["localhost", "webhook.kube-vgpu.svc"], ["127.0.0.1", "::1"])
    assert paths.issued
    ca, serving = _cert(paths.ca_cert), _cert(paths.cert)
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is True
    assert serving.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is False
    serving.verify_directly_issued_by(ca)
    san = serving.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["localhost", "webhook.kube-vgpu.svc"]
    assert san.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("127.0.0.1"), ipaddress.ip_address("::1")]
    eku = serving.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(eku) == [ExtendedKeyUsageOID.SERVER_AUTH]
    assert isinstance(serving.public_key(), ec.EllipticCurvePublicKey)
    assert paths.ca_pem == paths.ca_cert.read_bytes()
    for key in (paths.key, paths.ca_key):
        assert stat.S_IMODE(key.stat().st_mode) == 0o600
    assert {p.name for p in tmp_path.iterdir()} == {"ca.crt", "ca.key", "tls.crt", "tls.key", ".lock"}


def test_reuses_what_is_still_good(tmp_path: Path) -> None:
    first = ensure_ca_and_serving_cert(tmp_path, ["localhost"], ["127.0.0.1"])
    cert_bytes = first.cert.read_bytes()
    again = ensure_ca_and_serving_cert(tmp_path, ["localhost"], ["127.0.0.1"])
    assert not again.issued
    assert again.cert.read_bytes() == cert_bytes and again.ca_pem == first.ca_pem
    subset = ensure_ca_and_serving_cert(tmp_path, ["localhost"], [])  # already covered
    assert not subset.issued


def test_a_new_name_reissues_the_serving_cert_under_the_same_ca(tmp_path: Path) -> None:
    first = ensure_ca_and_serving_cert(tmp_path, ["localhost"], ["127.0.0.1"])
    second = ensure_ca_and_serving_cert(tmp_path, ["localhost", "other.example"], ["127.0.0.1"])
    assert second.issued and second.ca_pem == first.ca_pem
    assert "other.example" in _cert(second.cert).extensions.get_extension_for_class(
        x509.SubjectAlternativeName
    ).value.get_values_for_type(x509.DNSName)


def test_a_cert_near_its_end_is_renewed(tmp_path: Path) -> None:
    long_ago = dt.datetime.now(dt.UTC) - dt.timedelta(days=340)  # 25 of 365 days left: inside the 30-day margin
    old = ensure_ca_and_serving_cert(tmp_path, ["localhost"], [], now=long_ago)
    old_not_after = _cert(old.cert).not_valid_after_utc
    renewed = ensure_ca_and_serving_cert(tmp_path, ["localhost"], [])
    assert renewed.issued and renewed.ca_pem == old.ca_pem
    assert _cert(renewed.cert).not_valid_after_utc > old_not_after


def test_an_expiring_ca_is_replaced_and_the_serving_cert_with_it(tmp_path: Path) -> None:
    long_ago = dt.datetime.now(dt.UTC) - dt.timedelta(days=3650 - 100)  # CA has 100 days, less than a serving cert
    old = ensure_ca_and_serving_cert(tmp_path, ["localhost"], [], now=long_ago)
    fresh = ensure_ca_and_serving_cert(tmp_path, ["localhost"], [])
    assert fresh.issued and fresh.ca_pem != old.ca_pem
    _cert(fresh.cert).verify_directly_issued_by(_cert(fresh.ca_cert))


def test_a_mismatched_or_damaged_pair_is_replaced(tmp_path: Path) -> None:
    paths = ensure_ca_and_serving_cert(tmp_path, ["localhost"], [])
    paths.key.write_bytes(paths.ca_key.read_bytes())  # a valid key, but not the cert's
    assert ensure_ca_and_serving_cert(tmp_path, ["localhost"], []).issued
    paths.cert.write_text("garbage")
    repaired = ensure_ca_and_serving_cert(tmp_path, ["localhost"], [])
    assert repaired.issued
    _cert(repaired.cert).verify_directly_issued_by(_cert(repaired.ca_cert))


def test_service_names_cover_how_the_api_server_dials() -> None:
    assert service_hostnames("kube-vgpu-webhook", "kube-vgpu") == [
        "kube-vgpu-webhook",
        "kube-vgpu-webhook.kube-vgpu",
        "kube-vgpu-webhook.kube-vgpu.svc",
        "kube-vgpu-webhook.kube-vgpu.svc.cluster.local",
    ]


def test_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="at least one hostname or IP"):
        ensure_ca_and_serving_cert(tmp_path, [], [])
    with pytest.raises(TypeError):
        ensure_ca_and_serving_cert(tmp_path, "localhost", [])
    with pytest.raises(ValueError):
        ensure_ca_and_serving_cert(tmp_path, ["localhost"], ["not-an-ip"])


def _certs_cli(*args: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run([sys.executable, "-m", "kube_vgpu.cli", "certs", *args], capture_output=True, timeout=60)


def test_certs_command_prints_the_ca_bundle(tmp_path: Path) -> None:
    result = _certs_cli("--dir", str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert result.stdout == (tmp_path / "ca.crt").read_bytes()
    assert b"issued serving certificate" in result.stderr
    again = _certs_cli("--dir", str(tmp_path), "--ca-bundle-base64")
    assert b"reused serving certificate" in again.stderr
    assert base64.b64decode(again.stdout) == (tmp_path / "ca.crt").read_bytes()


def test_certs_command_writes_the_webhook_configuration_for_a_service(tmp_path: Path) -> None:
    result = _certs_cli(
        "--dir",
        str(tmp_path),
        "--service",
        "kube-vgpu-webhook",
        "--namespace",
        "kube-vgpu",
        "--webhook-config-out",
        "-",
    )
    assert result.returncode == 0, result.stderr
    document = yaml.safe_load(result.stdout)
    ca_pem = (tmp_path / "ca.crt").read_bytes()
    assert document == mutating_webhook_configuration(
        ca_pem, service=ServiceReference("kube-vgpu", "kube-vgpu-webhook")
    )
    san = _cert(tmp_path / "tls.crt").extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "kube-vgpu-webhook.kube-vgpu.svc" in san.get_values_for_type(x509.DNSName)
    assert _certs_cli("--dir", str(tmp_path), "--webhook-config-out", "-").returncode == 2  # needs --service
