from __future__ import annotations

import ssl
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kube_vgpu.webhook.certs import CertificatePaths, ensure_ca_and_serving_cert
from kube_vgpu.webhook.config import WebhookConfig
from kube_vgpu.webhook.server import WebhookServer


@pytest.fixture
def certs(tmp_path: Path) -> CertificatePaths:
    return ensure_ca_and_serving_cert(tmp_path / "certs", ["localhost"], ["127.0.0.1"])


def client_context(ca_file: Path) -> ssl.SSLContext:
    """What a careful client does: verify the chain against our CA and the host name."""
    return ssl.create_default_context(cafile=str(ca_file))


@pytest.fixture
def server(certs: CertificatePaths) -> Iterator[WebhookServer]:
    """The real server (uvicorn + TLS + the reloader thread) on a free loopback port."""
    instance = WebhookServer(
        WebhookConfig(),
        cert_file=certs.cert,
        key_file=certs.key,
        host="127.0.0.1",
        port=0,
        reload_interval_s=0.05,
        log_level="warning",
    )
    instance.start_in_thread()
    try:
        yield instance
    finally:
        instance.stop()


@pytest.fixture
def client(server: WebhookServer, certs: CertificatePaths) -> Iterator[httpx.Client]:
    with httpx.Client(
        base_url=f"https://localhost:{server.port}", verify=client_context(certs.ca_cert), timeout=10
    ) as http:
        yield http
