"""The real HTTPS server: uvicorn on a loopback port with a certificate from our own CA, called with httpx verifying
that CA; certificate hot-reload observed through real TLS handshakes; the CLI as a subprocess."""

from __future__ import annotations

import os
import re
import signal
import socket
import ssl
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from cryptography import x509

from kube_vgpu.webhook.certs import CertificatePaths, issue_serving_cert, load_ca
from kube_vgpu.webhook.config import WebhookConfig
from kube_vgpu.webhook.server import MAX_BODY_BYTES, WebhookServer
from tests.servers import free_port
from tests.webhook.builders import admission_review, apply_response, gpu_container, pod
from tests.webhook.conftest import client_context
from tests.webhook.test_denials import ROWS, Row

WAIT_S = 20.0  # an upper bound for things that happen "soon"; never asserted as a duration


def post_review(client: httpx.Client, obj: dict[str, Any], **kwargs: Any) -> httpx.Response:
    return client.post("/mutate", content=orjson.dumps(admission_review(obj, **kwargs)),
                       headers={"Content-Type": "application/json"})  # fmt: skip


def test_healthz_and_readyz(client: httpx.Client) -> None:
    assert client.get("/healthz").text == "ok"
    assert client.get("/readyz").status_code == 200


def test_gpu_pod_is_mutated_over_https(client: httpx.Client) -> None:
    sent = pod(gpu_container(gpu="1", gpumem="2048", gpucores="50"))
    reply = post_review(client, sent)
    assert reply.status_code == 200
    assert reply.headers["content-type"] == "application/json"
    response = reply.json()["response"]
    mutated = apply_response(sent, response)
    assert mutated["spec"]["schedulerName"] == "kube-vgpu-scheduler"
    assert {"name": "CUDA_DEVICE_MEMORY_LIMIT_0", "value": "2048m"} in mutated["spec"]["containers"][0]["env"]


def test_cpu_pod_passes_untouched_over_https(client: httpx.Client) -> None:
    reply = post_review(client, pod())
    assert reply.status_code == 200
    assert set(reply.json()["response"]) == {"uid", "allowed"}


@pytest.mark.parametrize("row", [row for row in ROWS if row.config == WebhookConfig()], ids=lambda row: row.id)
def test_denial_matrix_over_https(row: Row, client: httpx.Client) -> None:
    reply = post_review(client, row.pod, operation=row.operation, old=row.old)
    assert reply.status_code == 200
    response = reply.json()["response"]
    assert response["allowed"] is False
    assert (response["status"]["code"], response["status"]["message"]) == (row.code, row.message)


def test_malformed_bodies_get_400_and_the_server_keeps_serving(client: httpx.Client) -> None:
    for body in (b"", b"{", b"[1,2]", b'{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview"}', b"\xff\xfe"):
        reply = client.post("/mutate", content=body)
        assert reply.status_code == 400, body
        assert reply.json()["message"].startswith("malformed AdmissionReview: ")
    assert client.get("/mutate").status_code == 405
    assert client.get("/nope").status_code == 404
    assert post_review(client, pod(gpu_container(gpu="1"))).json()["response"]["allowed"] is True


def test_oversized_body_is_refused_without_reading_it_all(client: httpx.Client) -> None:
    reply = client.post("/mutate", content=b" " * (MAX_BODY_BYTES + 1))
    assert reply.status_code == 413
    assert client.get("/healthz").status_code == 200


def test_plain_http_is_not_served(server: WebhookServer) -> None:
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://127.0.0.1:{server.port}/healthz", timeout=5)


def test_metrics_count_admissions_by_result(client: httpx.Client) -> None:
    post_review(client, pod(gpu_container(gpu="1")))
    post_review(client, pod())
    post_review(client, pod(gpu_container(gpu="1", gpucores="101")))
    client.post("/mutate", content=b"nope")
    text = client.get("/metrics").text
    for line in (
        'kube_vgpu_webhook_admissions_total{operation="CREATE",result="mutated"} 1.0',
        'kube_vgpu_webhook_admissions_total{operation="CREATE",result="allowed"} 1.0',
        'kube_vgpu_webhook_admissions_total{operation="CREATE",result="denied"} 1.0',
        'kube_vgpu_webhook_admissions_total{operation="unknown",result="malformed"} 1.0',
        'kube_vgpu_webhook_admission_duration_seconds_count{result="mutated"} 1.0',
        'kube_vgpu_webhook_certificate_reloads_total{result="success"} 1.0',
    ):
        assert line in text, line
    assert re.search(r"^kube_vgpu_webhook_certificate_expiry_timestamp_seconds \d\.\d+e\+09$", text, re.M)


# ---------------------------------------------------------------------------------------------
# Certificate hot-reload
# ---------------------------------------------------------------------------------------------


def served_serial(port: int, ca_file: Path) -> int:
    """The serial number of the certificate a fresh TLS handshake gets (verified against the CA)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
        with client_context(ca_file).wrap_socket(raw, server_hostname="localhost") as tls:
            der = tls.getpeercert(binary_form=True)
    assert der is not None
    return x509.load_der_x509_certificate(der).serial_number


def rotate(certs: CertificatePaths, hostnames: list[str]) -> int:
    ca_cert, ca_key = load_ca(certs)
    cert_pem, key_pem = issue_serving_cert(ca_cert, ca_key, hostnames, ["127.0.0.1"])
    # as a Secret volume or cert-manager would: each file replaced whole
    for path, data in ((certs.key, key_pem), (certs.cert, cert_pem)):
        tmp = path.with_suffix(".new")
        tmp.write_bytes(data)
        os.replace(tmp, path)
    return x509.load_pem_x509_certificate(cert_pem).serial_number


def wait_for_serial(port: int, ca_file: Path, serial: int) -> int:
    deadline = time.monotonic() + WAIT_S
    seen = served_serial(port, ca_file)
    while seen != serial and time.monotonic() < deadline:
        time.sleep(0.02)
        seen = served_serial(port, ca_file)
    return seen


def test_rewritten_certificate_is_served_without_restart(
    server: WebhookServer, certs: CertificatePaths, client: httpx.Client
) -> None:
    first = served_serial(server.port, certs.ca_cert)
    assert client.get("/healthz").status_code == 200  # a keep-alive connection opened on the old certificate
    second = rotate(certs, ["localhost", "webhook.example"])
    assert second != first
    assert wait_for_serial(server.port, certs.ca_cert, second) == second
    assert client.get("/healthz").status_code == 200  # the old connection is not dropped
    with httpx.Client(verify=client_context(certs.ca_cert)) as fresh:  # and new clients verify the new cert
        assert fresh.get(f"https://localhost:{server.port}/healthz").status_code == 200
    assert 'kube_vgpu_webhook_certificate_reloads_total{result="success"} 2.0' in client.get("/metrics").text


def test_a_broken_pair_is_refused_and_the_old_certificate_kept(
    server: WebhookServer, certs: CertificatePaths, client: httpx.Client
) -> None:
    before = served_serial(server.port, certs.ca_cert)
    ca_cert, ca_key = load_ca(certs)
    _, other_key = issue_serving_cert(ca_cert, ca_key, ["localhost"])
    certs.key.write_bytes(other_key)  # the key no longer matches the cert: half a rotation
    assert server.certificate.check() is False
    assert served_serial(server.port, certs.ca_cert) == before
    metrics = client.get("/metrics").text
    assert 'kube_vgpu_webhook_certificate_reloads_total{result="failure"} 1.0' in metrics
    # the rotation completes: the new pair is picked up
    serial = rotate(certs, ["localhost"])
    assert wait_for_serial(server.port, certs.ca_cert, serial) == serial


def test_missing_files_at_start_fail_clearly(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        WebhookServer(WebhookConfig(), cert_file=tmp_path / "no.crt", key_file=tmp_path / "no.key", port=0)


# ---------------------------------------------------------------------------------------------
# The CLI, as the dev cluster will start it
# ---------------------------------------------------------------------------------------------


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "kube_vgpu.cli", *args]


def _wait_healthy(process: subprocess.Popen[bytes], url: str, ca_file: Path) -> None:
    deadline = time.monotonic() + WAIT_S * 3
    while True:
        assert process.poll() is None, process.communicate()
        try:
            if httpx.get(url, verify=client_context(ca_file), timeout=2).status_code == 200:
                return
        except (httpx.HTTPError, ssl.SSLError, OSError):
            pass
        assert time.monotonic() < deadline, "the webhook did not become healthy"
        time.sleep(0.05)


def test_self_signed_subprocess_prints_ca_serves_and_stops_on_sigterm(tmp_path: Path) -> None:
    directory = tmp_path / "self-signed"
    cas = []
    for _ in range(2):  # the second start reuses the CA (clients configured with it keep working)
        port = free_port()
        process = subprocess.Popen(
            _cli("webhook", "--host", "127.0.0.1", "--port", str(port), "--self-signed-dir", str(directory),
                 "--log-level", "warning"),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )  # fmt: skip
        try:
            _wait_healthy(process, f"https://localhost:{port}/healthz", directory / "ca.crt")
            _wait_healthy(process, f"https://127.0.0.1:{port}/healthz", directory / "ca.crt")
            reply = httpx.post(
                f"https://localhost:{port}/mutate",
                content=orjson.dumps(admission_review(pod(gpu_container(gpu="1")))),
                verify=client_context(directory / "ca.crt"),
            )
            assert reply.json()["response"]["patchType"] == "JSONPatch"
        finally:
            process.send_signal(signal.SIGTERM)
            stdout, stderr = process.communicate(timeout=WAIT_S)
        assert process.returncode in (0, -signal.SIGTERM), stderr
        assert stdout == (directory / "ca.crt").read_bytes()
        cas.append(stdout)
    assert cas[0] == cas[1]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((), "HTTPS only: give --tls-cert-file and --tls-key-file, or --self-signed-dir DIR"),
        (("--tls-cert-file", "a", "--self-signed-dir", "d"), "give either --self-signed-dir or --tls-cert-file"),
        (("--tls-cert-file", "/nonexistent.crt", "--tls-key-file", "/nonexistent.key"), "cannot serve: "),
        (("--self-signed-dir", "d", "--max-gpus-per-pod", "0"), "max_gpus_per_pod must be at least 1, got 0"),
    ],
    ids=["no-tls", "both", "missing-files", "bad-policy"],
)
def test_cli_refuses_bad_arguments(args: tuple[str, ...], message: str, tmp_path: Path) -> None:
    result = subprocess.run(_cli("webhook", "--port", "0", *args), capture_output=True, cwd=tmp_path, timeout=60)
    assert result.returncode in (1, 2)
    assert message in result.stderr.decode()


def test_accepted_connections_get_tcp_nodelay(server: WebhookServer) -> None:
    """asyncio sets TCP_NODELAY on accepted sockets only when the listening socket says IPPROTO_TCP; without it
    every response (headers and body written apart) waits on a delayed ACK."""
    assert server._socket.proto == socket.IPPROTO_TCP


def test_drain_fails_readiness_but_keeps_answering(certs: CertificatePaths) -> None:
    server = WebhookServer(
        WebhookConfig(), cert_file=certs.cert, key_file=certs.key, host="127.0.0.1", port=0, shutdown_delay_s=600
    )
    server.start_in_thread()
    try:
        with httpx.Client(base_url=f"https://localhost:{server.port}", verify=client_context(certs.ca_cert)) as http:
            assert http.get("/readyz").status_code == 200
            server.drain()
            assert (http.get("/readyz").status_code, http.get("/readyz").text) == (503, "draining")
            assert http.get("/healthz").status_code == 200  # alive: no restart by the liveness probe
            assert post_review(http, pod(gpu_container(gpu="1"))).json()["response"]["allowed"] is True
    finally:
        server.stop()


def test_sigterm_drains_and_a_second_sigterm_stops(tmp_path: Path) -> None:
    directory = tmp_path / "certs"
    port = free_port()
    process = subprocess.Popen(
        _cli("webhook", "--host", "127.0.0.1", "--port", str(port), "--self-signed-dir", str(directory),
             "--shutdown-delay-seconds", "600", "--log-level", "info"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        _wait_healthy(process, f"https://localhost:{port}/readyz", directory / "ca.crt")
        process.send_signal(signal.SIGTERM)
        with httpx.Client(base_url=f"https://localhost:{port}", verify=client_context(directory / "ca.crt")) as http:
            deadline = time.monotonic() + WAIT_S
            while http.get("/readyz").status_code != 503:
                assert time.monotonic() < deadline, "SIGTERM did not start draining"
                time.sleep(0.02)
            assert post_review(http, pod(gpu_container(gpu="1"))).json()["response"]["allowed"] is True
    finally:
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=WAIT_S * 3)
    assert process.returncode in (0, -signal.SIGTERM)
    assert b"draining: stopping in 600.0 s" in stderr
