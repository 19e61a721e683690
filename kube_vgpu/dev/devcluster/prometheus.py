"""A real Prometheus (the server built from Prometheus's Go module, binaries.py) scraping a dev cluster the way the
manifests' monitors tell a Prometheus Operator to, with the manifests' PrometheusRule loaded as its rule file.

The Prometheus Operator turns each PodMonitor / ServiceMonitor endpoint into a scrape job whose targets are the
selected pods' ports. Here the components run as local processes on free ports, so each endpoint becomes a job with a
static target instead: the address is the dev cluster's listener for the port the endpoint names (the extender's
metrics listener for `metrics`, kube-scheduler's secure port for `https`, ...), and everything else is the
endpoint's own: path, scheme, honorLabels, TLS (CA, serverName, insecureSkipVerify) and the bearer token. The target
labels the operator adds (namespace, pod, container, job) are set to what they would be in the cluster, so rules
that select by them (e.g. ``scheduler_pending_pods{namespace="kube-vgpu"}``) see the same series.

    config = scrape_config(jobs, rule_files=[...], interval_s=1.0)
    with running_prometheus(binary, directory, config) as url:   # http://127.0.0.1:<port>
        query(url, "up")

Used by tests/e2e/test_prometheus_e2e.py (docs/operations.md, "Monitoring") and by `kube-vgpu dev-cluster up
--prometheus` (ClusterOptions.prometheus: the extender, the webhook and kube-scheduler; the dev cluster runs no device
plugin).
"""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

READY_TIMEOUT_S = 60.0
MONITORING_DIR = Path(__file__).resolve().parents[2] / "manifests" / "monitoring"


class PrometheusError(RuntimeError):
    """Prometheus did not start, or its HTTP API answered an error."""


@dataclass(frozen=True)
class ScrapeJob:
    """One monitor endpoint as a Prometheus scrape job with one static target."""

    name: str  # the job_name the Prometheus Operator gives it ("podMonitor/<namespace>/<name>/<index>")
    address: str  # host:port
    path: str = "/metrics"
    scheme: str = "http"
    honor_labels: bool = False
    labels: Mapping[str, str] = field(default_factory=dict)  # target labels (namespace, pod, container, job)
    ca_file: str | None = None
    server_name: str | None = None
    insecure_skip_verify: bool = False
    bearer_token_file: str | None = None

    def document(self, interval_s: float) -> dict[str, Any]:
        job: dict[str, Any] = {
            "job_name": self.name,
            "scrape_interval": _duration(interval_s),
            "scrape_timeout": _duration(interval_s),
            "metrics_path": self.path,
            "scheme": self.scheme,
            "honor_labels": self.honor_labels,
            "static_configs": [{"targets": [self.address], "labels": dict(self.labels)}],
        }
        tls: dict[str, str | bool] = {key: value for key, value in (("ca_file", self.ca_file),
                                                                     ("server_name", self.server_name))
                                      if value is not None}
        if self.insecure_skip_verify:
            tls["insecure_skip_verify"] = True
        if tls:
            job["tls_config"] = tls
        if self.bearer_token_file is not None:
            job["authorization"] = {"type": "Bearer", "credentials_file": self.bearer_token_file}
        return job


def _duration(seconds: float) -> str:
    return f"{round(seconds * 1000)}ms"


def endpoint_job(monitor: Mapping[str, Any], index: int, endpoint: Mapping[str, Any], address: str, *,
                 labels: Mapping[str, str], ca_file: str | None = None,
                 bearer_token_file: str | None = None) -> ScrapeJob:
    """The scrape job the Prometheus Operator makes of `monitor`'s endpoint `index` (a PodMonitor's
    podMetricsEndpoints[i] or a ServiceMonitor's endpoints[i]), aimed at `address`. Fields the translation does not
    know are refused rather than dropped (a monitor gaining, say, relabelings must be taught here first).
    `ca_file`: where the endpoint's tlsConfig.ca secret is; `bearer_token_file`: its authorization credentials."""
    known = {"port", "path", "scheme", "interval", "scrapeTimeout", "honorLabels", "tlsConfig", "authorization"}
    unknown = set(endpoint) - known
    kind, metadata = monitor["kind"], monitor["metadata"]
    if unknown:
        raise PrometheusError(f"{kind} {metadata['name']}: endpoint fields {sorted(unknown)} are not translated")
    tls = endpoint.get("tlsConfig") or {}
    if set(tls) - {"insecureSkipVerify", "serverName", "ca"}:
        raise PrometheusError(f"{kind} {metadata['name']}: tlsConfig {sorted(tls)} is not translated")
    if "ca" in tls and ca_file is None:
        raise PrometheusError(f"{kind} {metadata['name']}: its tlsConfig names a CA; pass its file")
    if "authorization" in endpoint and bearer_token_file is None:
        raise PrometheusError(f"{kind} {metadata['name']}: it presents a token; pass its file")
    prefix = "podMonitor" if kind == "PodMonitor" else "serviceMonitor"
    return ScrapeJob(
        name=f"{prefix}/{metadata['namespace']}/{metadata['name']}/{index}",
        address=address,
        path=endpoint.get("path", "/metrics"),
        scheme=endpoint.get("scheme", "http"),
        honor_labels=bool(endpoint.get("honorLabels", False)),
        labels=labels,
        ca_file=ca_file if "ca" in tls else None,
        server_name=tls.get("serverName"),
        insecure_skip_verify=bool(tls.get("insecureSkipVerify", False)),
        bearer_token_file=bearer_token_file if "authorization" in endpoint else None,
    )


def monitoring_documents(directory: Path = MONITORING_DIR) -> list[dict[str, Any]]:
    """The objects of manifests/monitoring's YAML files as written (no kustomize: the dashboard's ConfigMap, which
    only its kustomization generates, is not among them)."""
    documents: list[dict[str, Any]] = []
    for path in sorted(directory.glob("*.yaml")):
        if path.name != "kustomization.yaml":
            documents += [document for document in yaml.safe_load_all(path.read_text()) if document]
    return documents


def monitor_jobs(documents: Sequence[Mapping[str, Any]], listeners: Mapping[tuple[str, str], tuple[str, str]], *,
                 ca_file: str | None, bearer_token_file: str | None) -> tuple[list[ScrapeJob], list[str]]:
    """A job per endpoint of the PodMonitors and ServiceMonitors in `documents` that has a listener:
    (monitor name, port name) -> (host:port, the container serving it). Each gets the target labels the Prometheus
    Operator would give it (namespace, pod, container; job: "<namespace>/<PodMonitor>" or the Service's name).
    Returns the jobs and "monitor/port" of the endpoints without a listener."""
    jobs: list[ScrapeJob] = []
    unserved: list[str] = []
    for monitor in documents:
        if monitor.get("kind") not in ("PodMonitor", "ServiceMonitor"):
            continue
        metadata = monitor["metadata"]
        endpoints = monitor["spec"].get("podMetricsEndpoints") or monitor["spec"].get("endpoints") or []
        component = monitor["spec"]["selector"]["matchLabels"].get("app.kubernetes.io/component", metadata["name"])
        for index, endpoint in enumerate(endpoints):
            listener = listeners.get((metadata["name"], endpoint["port"]))
            if listener is None:
                unserved.append(f"{metadata['name']}/{endpoint['port']}")
                continue
            address, container = listener
            labels = {"namespace": metadata["namespace"], "pod": f"kube-vgpu-{component}-0", "container": container,
                      "job": (f"{metadata['namespace']}/{metadata['name']}" if monitor["kind"] == "PodMonitor"
                              else metadata["name"])}
            jobs.append(endpoint_job(monitor, index, endpoint, address, labels=labels, ca_file=ca_file,
                                     bearer_token_file=bearer_token_file))
    return jobs, unserved


def rules_document(prometheus_rule: Mapping[str, Any]) -> dict[str, Any]:
    """A PrometheusRule's spec.groups as a plain Prometheus rule file (what the operator mounts into Prometheus)."""
    return {"groups": list(prometheus_rule["spec"]["groups"])}


def scrape_config(jobs: Sequence[ScrapeJob], *, rule_files: Sequence[str] = (), interval_s: float = 1.0
                  ) -> dict[str, Any]:
    """prometheus.yml: the jobs scraped, and the rules evaluated, every `interval_s`."""
    return {
        "global": {"scrape_interval": _duration(interval_s), "scrape_timeout": _duration(interval_s),
                   "evaluation_interval": _duration(interval_s)},
        "rule_files": list(rule_files),
        "scrape_configs": [job.document(interval_s) for job in jobs],
    }


def command(binary: Path, config_path: Path, data_dir: Path, port: int) -> list[str]:
    """Prometheus's command line: the config, its TSDB, the HTTP API on 127.0.0.1:`port`, a day's retention."""
    return [str(binary), f"--config.file={config_path}", f"--storage.tsdb.path={data_dir}",
            f"--web.listen-address=127.0.0.1:{port}", "--storage.tsdb.retention.time=1d"]


def write_config(directory: Path, config: Mapping[str, Any]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "prometheus.yml"
    path.write_text(yaml.safe_dump(dict(config), sort_keys=False))
    return path


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@contextlib.contextmanager
def running_prometheus(binary: Path, directory: Path, config: Mapping[str, Any]) -> Iterator[str]:
    """Run Prometheus with `config` (its TSDB and log in `directory`) until the block ends; yields its URL once
    /-/ready answers. The web UI is not built in (binaries.py): the HTTP API is what this is for."""
    config_path = write_config(directory, config)
    port = _free_port()
    log_path = directory / "prometheus.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(command(binary, config_path, directory / "data", port),
                                   stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=directory)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            if process.poll() is not None:
                raise PrometheusError(f"prometheus exited with {process.returncode}:\n{_tail(log_path)}")
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(f"{url}/-/ready", timeout=2) as response:
                    if response.status == 200:
                        break
            if time.monotonic() > deadline:
                raise PrometheusError(f"prometheus not ready after {READY_TIMEOUT_S:.0f} s:\n{_tail(log_path)}")
            time.sleep(0.2)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def api_get(url: str, path: str, params: Mapping[str, str] | None = None, timeout_s: float = 30.0) -> Any:
    """GET `path` of Prometheus's HTTP API and return `data` of a `success` answer; raise PrometheusError with
    Prometheus's own error text otherwise."""
    query = f"?{urllib.parse.urlencode(dict(params))}" if params else ""
    try:
        with urllib.request.urlopen(f"{url}{path}{query}", timeout=timeout_s) as response:
            body = response.read()
    except urllib.error.HTTPError as exc:
        body = exc.read()
    except (urllib.error.URLError, OSError) as exc:
        raise PrometheusError(f"{path}: {exc}") from exc
    try:
        document = json.loads(body)
    except ValueError:
        raise PrometheusError(f"{path}: not JSON: {body[:200]!r}") from None
    if not isinstance(document, dict) or document.get("status") != "success":
        error = document.get("error") if isinstance(document, dict) else None
        raise PrometheusError(f"{path} {dict(params or {})}: {error or document}")
    return document.get("data")


def query(url: str, expr: str) -> list[dict[str, Any]]:
    """/api/v1/query of `expr` now: the vector's samples ({"metric": {...}, "value": [t, "v"]}), or a scalar's
    one value as a one-sample list."""
    data = api_get(url, "/api/v1/query", {"query": expr})
    if data["resultType"] in ("scalar", "string"):
        return [{"metric": {}, "value": data["result"]}]
    result: list[dict[str, Any]] = data["result"]
    return result
