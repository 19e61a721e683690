"""The self-signed overlay's certificate Job, run step by step with the exact command lines of the rendered Job
against an in-memory API (Secrets and the MutatingWebhookConfiguration, JSON Patch applied as the API server
does): the first run creates both Secrets and sets every caBundle; a second run changes nothing; a serving
certificate close to expiry is renewed under the same CA, so the caBundle stays valid throughout."""

from __future__ import annotations

import base64
import datetime as dt
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import jsonpatch
import pytest
from cryptography import x509
from kubernetes.client.rest import ApiException

from kube_vgpu.cli import main as kube_vgpu_main
from kube_vgpu.webhook.certs import issue_serving_cert, load_ca
from tests.manifests.render import containers, one, render
from tests.manifests.test_workloads import certs_job_module

JOB = certs_job_module()


class FakeApi:
    """The few calls certs_job.py makes, with the API server's semantics for them."""

    def __init__(self, configuration: dict[str, Any] | None) -> None:
        self.secrets: dict[tuple[str, str], dict[str, Any]] = {}
        self.configuration = configuration
        self.writes: list[str] = []

    @staticmethod
    def _response(obj: dict[str, Any]) -> SimpleNamespace:
        return SimpleNamespace(data=json.dumps(obj).encode())

    # CoreV1Api
    def read_namespaced_secret(self, name: str, namespace: str, **_: Any) -> SimpleNamespace:
        if (namespace, name) not in self.secrets:
            raise ApiException(status=404, reason="Not Found")
        return self._response(self.secrets[(namespace, name)])

    def create_namespaced_secret(self, namespace: str, body: dict[str, Any], **_: Any) -> SimpleNamespace:
        key = (namespace, body["metadata"]["name"])
        if key in self.secrets:
            raise ApiException(status=409, reason="AlreadyExists")
        assert body["metadata"]["namespace"] == namespace
        self.secrets[key] = json.loads(json.dumps(body))
        self.writes.append(f"create secret {key[1]}")
        return self._response(body)

    def patch_namespaced_secret(self, name: str, namespace: str, body: dict[str, Any], *, _content_type: str,
                                **_: Any) -> SimpleNamespace:
        assert _content_type == "application/merge-patch+json"
        secret = self.secrets[(namespace, name)]
        secret["data"] = dict(body["data"])  # a merge patch of data replaces the keys it names; all are named
        self.writes.append(f"patch secret {name}")
        return self._response(secret)

    # AdmissionregistrationV1Api
    def read_mutating_webhook_configuration(self, name: str, **_: Any) -> SimpleNamespace:
        if self.configuration is None or self.configuration["metadata"]["name"] != name:
            raise ApiException(status=404, reason="Not Found")
        return self._response(self.configuration)

    def patch_mutating_webhook_configuration(self, name: str, body: list[dict[str, Any]], *, _content_type: str,
                                             **_: Any) -> SimpleNamespace:
        assert _content_type == "application/json-patch+json"
        assert self.configuration is not None
        self.configuration = jsonpatch.apply_patch(self.configuration, body)  # raises if a "test" op fails
        self.writes.append(f"patch mutatingwebhookconfiguration {name}")
        return self._response(self.configuration)


def rendered_steps() -> dict[str, list[str]]:
    job = one(render("overlays/self-signed"), "Job", "kube-vgpu-certs")
    return {c["name"]: list(c.get("command") or ["kube-vgpu"]) + list(c.get("args") or []) for _, c in containers(job)}


def run_job(api: FakeApi, directory: Path) -> None:
    """The Job's three containers in order, with /certs replaced by a fresh directory (each run is a new pod)."""
    for name, argv in rendered_steps().items():
        argv = [arg.replace("=/certs", f"={directory}") for arg in argv]
        if argv[0] == "kube-vgpu":
            code = kube_vgpu_main(argv[1:])
        else:
            assert argv[:2] == ["python", "/scripts/certs_job.py"]
            code = JOB.main(argv[2:], core=api, admission=api)
        assert code == 0, f"step {name} failed"


@pytest.fixture
def api() -> FakeApi:
    return FakeApi(one(render("overlays/self-signed"), "MutatingWebhookConfiguration", "kube-vgpu-webhook"))


def secret_file(api: FakeApi, secret: str, key: str) -> bytes:
    return base64.b64decode(api.secrets[("kube-vgpu", secret)]["data"][key])


def test_first_run_creates_both_secrets_and_sets_every_ca_bundle(api: FakeApi, tmp_path: Path) -> None:
    run_job(api, tmp_path / "run1")
    tls = api.secrets[("kube-vgpu", "kube-vgpu-webhook-tls")]
    assert tls["type"] == "kubernetes.io/tls" and set(tls["data"]) == {"tls.crt", "tls.key", "ca.crt"}
    ca_secret = api.secrets[("kube-vgpu", "kube-vgpu-webhook-ca")]
    assert set(ca_secret["data"]) == {"ca.crt", "ca.key"}  # the CA key stays out of what the webhook mounts
    ca_pem = secret_file(api, "kube-vgpu-webhook-ca", "ca.crt")
    assert secret_file(api, "kube-vgpu-webhook-tls", "ca.crt") == ca_pem
    assert api.configuration is not None
    bundles = {w["clientConfig"]["caBundle"] for w in api.configuration["webhooks"]}
    assert bundles == {base64.b64encode(ca_pem).decode()} and len(api.configuration["webhooks"]) == 2
    serving = x509.load_pem_x509_certificate(secret_file(api, "kube-vgpu-webhook-tls", "tls.crt"))
    serving.verify_directly_issued_by(x509.load_pem_x509_certificate(ca_pem))
    names = serving.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "kube-vgpu-webhook.kube-vgpu.svc" in names.get_values_for_type(x509.DNSName)


def test_a_second_run_changes_nothing(api: FakeApi, tmp_path: Path) -> None:
    run_job(api, tmp_path / "run1")
    before = json.dumps([sorted(api.secrets.items()), api.configuration], sort_keys=True)
    writes = len(api.writes)
    run_job(api, tmp_path / "run2")
    assert api.writes[writes:] == []
    assert json.dumps([sorted(api.secrets.items()), api.configuration], sort_keys=True) == before


def test_a_serving_certificate_near_expiry_is_renewed_under_the_same_ca(api: FakeApi, tmp_path: Path) -> None:
    run_job(api, tmp_path / "run1")
    ca_pem = secret_file(api, "kube-vgpu-webhook-ca", "ca.crt")
    bundle = json.dumps(api.configuration)
    # put a serving certificate with 10 days left into the Secret, signed by the same CA
    JOB.fetch(api, tmp_path / "old")
    paths = SimpleNamespace(directory=tmp_path / "old", ca_cert=tmp_path / "old/ca.crt", ca_key=tmp_path / "old/ca.key")
    ca_cert, ca_key = load_ca(paths)  # type: ignore[arg-type]
    cert, key = issue_serving_cert(ca_cert, ca_key, ["kube-vgpu-webhook.kube-vgpu.svc"],
                                   now=dt.datetime.now(dt.UTC) - dt.timedelta(days=355))
    tls = api.secrets[("kube-vgpu", "kube-vgpu-webhook-tls")]["data"]
    tls["tls.crt"], tls["tls.key"] = base64.b64encode(cert).decode(), base64.b64encode(key).decode()
    writes = len(api.writes)
    run_job(api, tmp_path / "run2")
    assert api.writes[writes:] == ["patch secret kube-vgpu-webhook-tls"]
    renewed = x509.load_pem_x509_certificate(secret_file(api, "kube-vgpu-webhook-tls", "tls.crt"))
    assert renewed.not_valid_after_utc - dt.datetime.now(dt.UTC) > dt.timedelta(days=300)
    assert secret_file(api, "kube-vgpu-webhook-ca", "ca.crt") == ca_pem
    assert json.dumps(api.configuration) == bundle  # same CA: the API server trusts old and new alike


def test_publish_waits_for_the_webhook_configuration_and_fails_clearly_without_it(tmp_path: Path) -> None:
    configuration = one(render("overlays/self-signed"), "MutatingWebhookConfiguration", "kube-vgpu-webhook")
    api = FakeApi(None)
    assert kube_vgpu_main(["certs", f"--dir={tmp_path}", "--service=kube-vgpu-webhook"]) == 0
    slept: list[float] = []

    def sleep(seconds: float) -> None:  # kubectl apply creates the configuration after the Job
        slept.append(seconds)
        api.configuration = configuration

    done = JOB.publish(api, api, tmp_path, sleep=sleep)
    assert slept and done["MutatingWebhookConfiguration kube-vgpu-webhook"] == "caBundle set on 2 webhook(s)"
    with pytest.raises(RuntimeError, match="MutatingWebhookConfiguration missing not found"):
        JOB.publish(api, api, tmp_path, configuration_name="missing", wait_s=0)


def test_a_secret_of_another_type_is_reported_not_overwritten(api: FakeApi, tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    api.secrets[("kube-vgpu", "kube-vgpu-webhook-tls")] = {
        "metadata": {"name": "kube-vgpu-webhook-tls", "namespace": "kube-vgpu"}, "type": "Opaque", "data": {}}
    assert kube_vgpu_main(["certs", f"--dir={tmp_path}", "--service=kube-vgpu-webhook"]) == 0
    assert JOB.main(["publish", f"--dir={tmp_path}"], core=api, admission=api) == 1
    assert "has type 'Opaque', expected 'kubernetes.io/tls'; delete it and run the Job again" in capsys.readouterr().err
