"""The API-server half of the self-signed certificate Job (manifests/overlays/self-signed/job.yaml).

The Job runs three containers of the kube-vgpu image, in order, on one emptyDir:

1. ``python certs_job.py fetch --dir D``: the CA and serving certificate already in the cluster (Secrets
   kube-vgpu-webhook-ca and kube-vgpu-webhook-tls), if any, are written to D;
2. ``kube-vgpu certs --dir D --service kube-vgpu-webhook --namespace kube-vgpu`` reuses them while they are good,
   and otherwise issues what is missing (a new serving certificate 30 days before expiry, a new CA only when the
   old one is gone or expiring);
3. ``python certs_job.py publish --dir D`` writes both Secrets (the webhook's Secret volume follows, and the webhook
   re-reads the files without a restart) and sets the CA as caBundle of every webhook of the
   MutatingWebhookConfiguration kube-vgpu-webhook.

Running it again is harmless: with nothing to renew, nothing changes. The CA key is kept in its own Secret, which
only this Job reads; the webhook mounts only kube-vgpu-webhook-tls (serving cert, key, CA cert).

Only the kubernetes client shipped in the image is used; ``main(argv, core=..., admission=...)`` takes API objects
so tests can run it against an API server of their choice.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

NAMESPACE = "kube-vgpu"
TLS_SECRET = "kube-vgpu-webhook-tls"
CA_SECRET = "kube-vgpu-webhook-ca"
WEBHOOK_CONFIGURATION = "kube-vgpu-webhook"
#: Secret -> the file names (also the Secret keys) it holds; the names `kube-vgpu certs` uses.
SECRET_FILES: dict[str, tuple[str, ...]] = {
    TLS_SECRET: ("tls.crt", "tls.key", "ca.crt"),
    CA_SECRET: ("ca.crt", "ca.key"),
}
PRIVATE_FILES = frozenset({"tls.key", "ca.key"})
SECRET_TYPES = {TLS_SECRET: "kubernetes.io/tls", CA_SECRET: "Opaque"}
#: How long publish waits for the MutatingWebhookConfiguration (kubectl apply creates it after the Job).
WAIT_FOR_CONFIGURATION_S = 120.0
MERGE_PATCH = "application/merge-patch+json"
JSON_PATCH = "application/json-patch+json"


def log(message: str) -> None:
    print(f"certs-job: {message}", file=sys.stderr, flush=True)


def _status(exc: Exception) -> int | None:
    status = getattr(exc, "status", None)
    return status if isinstance(status, int) else None


def _read(call: Callable[..., Any], *args: Any) -> dict[str, Any] | None:
    """GET an object as a plain dict; None when it does not exist."""
    try:
        response = call(*args, _preload_content=False)
    except Exception as exc:
        if _status(exc) == 404:
            return None
        raise
    document: dict[str, Any] = json.loads(response.data)
    return document


# ---------------------------------------------------------------------------------------------
# fetch
# ---------------------------------------------------------------------------------------------


def fetch(core: Any, directory: Path, namespace: str = NAMESPACE) -> list[str]:
    """Write the files of both Secrets that exist to `directory`; the names written."""
    directory.mkdir(parents=True, exist_ok=True)
    written: list[str] = []
    for secret_name, files in SECRET_FILES.items():
        secret = _read(core.read_namespaced_secret, secret_name, namespace)
        data = (secret or {}).get("data") or {}
        for name in files:
            if name in data and name not in written:
                path = directory / name
                path.write_bytes(base64.b64decode(data[name]))
                os.chmod(path, 0o600 if name in PRIVATE_FILES else 0o644)
                written.append(name)
    log(f"fetched {', '.join(written) or 'nothing (first run)'} from namespace {namespace}")
    return written


# ---------------------------------------------------------------------------------------------
# publish
# ---------------------------------------------------------------------------------------------


def secret_body(secret_name: str, directory: Path, namespace: str = NAMESPACE) -> dict[str, Any]:
    """The Secret as `kube-vgpu certs` left the files in `directory`."""
    missing = [name for name in SECRET_FILES[secret_name] if not (directory / name).is_file()]
    if missing:
        raise FileNotFoundError(
            f"{', '.join(missing)} not in {directory}: run `kube-vgpu certs --dir {directory}` first"
        )
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {
            "name": secret_name,
            "namespace": namespace,
            "labels": {"app.kubernetes.io/name": "kube-vgpu", "app.kubernetes.io/component": "webhook"},
        },
        "type": SECRET_TYPES[secret_name],
        "data": {
            name: base64.b64encode((directory / name).read_bytes()).decode() for name in SECRET_FILES[secret_name]
        },
    }


def ca_bundle_patch(configuration: dict[str, Any], ca_pem: bytes) -> list[dict[str, Any]]:
    """JSON Patch setting caBundle on every webhook whose caBundle differs (empty when all are right). Each
    operation is preceded by a test of the webhook's name, so a concurrent reordering fails the patch instead of
    putting the CA on the wrong entry."""
    bundle = base64.b64encode(ca_pem).decode()
    operations: list[dict[str, Any]] = []
    for index, webhook in enumerate(configuration.get("webhooks") or []):
        client_config = webhook.get("clientConfig") or {}
        if client_config.get("caBundle") == bundle:
            continue
        operations.append({"op": "test", "path": f"/webhooks/{index}/name", "value": webhook["name"]})
        operations.append({"op": "add", "path": f"/webhooks/{index}/clientConfig/caBundle", "value": bundle})
    return operations


def _apply_secret(core: Any, body: dict[str, Any]) -> str:
    name, namespace = body["metadata"]["name"], body["metadata"]["namespace"]
    current = _read(core.read_namespaced_secret, name, namespace)
    if current is None:
        core.create_namespaced_secret(namespace, body, _preload_content=False)
        return "created"
    if current.get("data") == body["data"] and current.get("type") == body["type"]:
        return "unchanged"
    if current.get("type") != body["type"]:
        raise RuntimeError(f"Secret {namespace}/{name} has type {current.get('type')!r}, expected {body['type']!r}; "
                           "delete it and run the Job again")
    core.patch_namespaced_secret(name, namespace, {"data": body["data"]}, _content_type=MERGE_PATCH,
                                 _preload_content=False)
    return "updated"


def publish(
    core: Any,
    admission: Any,
    directory: Path,
    namespace: str = NAMESPACE,
    configuration_name: str = WEBHOOK_CONFIGURATION,
    *,
    wait_s: float = WAIT_FOR_CONFIGURATION_S,
    sleep: Callable[[float], None] = time.sleep,
) -> dict[str, str]:
    """Write both Secrets and the caBundle; what happened to each, for the log and tests."""
    done: dict[str, str] = {}
    # CA first: if the Job dies in between, the next run still finds the CA that signed the serving cert
    for secret_name in (CA_SECRET, TLS_SECRET):
        done[f"Secret {secret_name}"] = _apply_secret(core, secret_body(secret_name, directory, namespace))
    ca_pem = (directory / "ca.crt").read_bytes()
    deadline = time.monotonic() + wait_s
    while True:
        configuration = _read(admission.read_mutating_webhook_configuration, configuration_name)
        if configuration is not None or time.monotonic() >= deadline:
            break
        log(f"MutatingWebhookConfiguration {configuration_name} not found yet; waiting")
        sleep(2.0)
    if configuration is None:
        raise RuntimeError(f"MutatingWebhookConfiguration {configuration_name} not found after {wait_s:.0f} s")
    operations = ca_bundle_patch(configuration, ca_pem)
    what = f"MutatingWebhookConfiguration {configuration_name}"
    if operations:
        admission.patch_mutating_webhook_configuration(configuration_name, operations, _content_type=JSON_PATCH,
                                                       _preload_content=False)
        done[what] = f"caBundle set on {len(operations) // 2} webhook(s)"
    else:
        done[what] = "unchanged"
    for what, outcome in done.items():
        log(f"{what}: {outcome}")
    return done


# ---------------------------------------------------------------------------------------------
# command line
# ---------------------------------------------------------------------------------------------


def _clients() -> tuple[Any, Any]:
    from kubernetes import client, config

    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    api = client.ApiClient()
    return client.CoreV1Api(api), client.AdmissionregistrationV1Api(api)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="certs_job.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("step", choices=("fetch", "publish"))
    parser.add_argument("--dir", required=True, type=Path, help="the directory `kube-vgpu certs --dir` uses")
    parser.add_argument("--namespace", default=NAMESPACE, help="namespace of the Secrets (default: %(default)s)")
    parser.add_argument("--webhook-configuration", default=WEBHOOK_CONFIGURATION,
                        help="MutatingWebhookConfiguration to set the caBundle of (default: %(default)s)")
    return parser


def main(argv: list[str] | None = None, *, core: Any = None, admission: Any = None) -> int:
    args = build_parser().parse_args(argv)
    if core is None or admission is None:
        core, admission = _clients()
    try:
        if args.step == "fetch":
            fetch(core, args.dir, args.namespace)
        else:
            publish(core, admission, args.dir, args.namespace, args.webhook_configuration)
    except Exception as exc:  # one line for `kubectl logs`; the Job retries (backoffLimit)
        log(f"{args.step} failed: {type(exc).__name__}: {exc}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
