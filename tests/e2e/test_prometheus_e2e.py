"""A real Prometheus (built from Prometheus's Go module, kube_vgpu.dev.devcluster.binaries) scrapes the dev cluster
with the manifests' own monitors and evaluates the manifests' own alert rules, and the Grafana dashboard's queries are
asked of it over its HTTP API (issue 18).

The scene: one Tesla T4 node run by a real device plugin process (fake NVML, the one allowed stand-in; its
per-container usage read from shared-region files in kubelet's pods directory, --kubelet-pods-dir, as
docs/operations.md says to turn on), a team namespace with a Kueue ClusterQueue (Kueue's own CRDs, our quota gate),
a second namespace without one, GPU pods bound through the extender and admitted by the webhook, one pod too big for
any GPU (the extender's filter rejects the node with a reason, and kube-scheduler counts it pending).

Each endpoint of the PodMonitors and the ServiceMonitor becomes a scrape job (kube_vgpu.dev.devcluster.prometheus):
the port it names is the dev cluster's listener of that name, and path, scheme, honorLabels, TLS (the webhook's
serverName and CA, kube-scheduler's insecureSkipVerify) and the bearer token (the metrics-reader ServiceAccount's,
with the manifests' RBAC) are the endpoint's own. Scrapes and rule evaluation every second.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import math
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx
import orjson
import pytest
import yaml
from kubernetes import client
from kubernetes.client.rest import ApiException

from kube_vgpu import protocol
from kube_vgpu.dev.devcluster import prometheus as prom
from kube_vgpu.dev.devcluster.cluster import WEBHOOK_SERVICE_DNS_NAME, DevCluster, NodeGroup
from kube_vgpu.dev.devcluster.workload import (
    assignment_of,
    create_pods,
    delete_pods,
    ensure_namespace,
    gpu_pod,
    wait_for_pods,
    wait_until_gone,
)
from tests.deviceplugin.kubelet import KubeletStandIn
from tests.deviceplugin.regionfiles import Process, Region
from tests.e2e.conftest import NODE_GROUP_LABEL
from tests.manifests.render import NAMESPACE, one
from tests.manifests.test_monitoring import dashboard_queries, objects

pytestmark = pytest.mark.e2e

SCRAPE_INTERVAL_S = 1.0
WAIT_S = 240.0  # generous: a first scrape of everything, rates over two samples, the slowest rule's first run
GROUP = protocol.KUEUE_API_GROUP
QUEUE_NAME = "e2e-prometheus-queue"
TEAM = "e2e-prometheus-team"  # pods through QUEUE_NAME
OTHER = "e2e-prometheus-other"  # pods without a queue
PLUGIN_PROFILE = "t4-4-pcie"
#: (pod, namespace, MiB, cores, queue?) bound through the extender, and the memory (MiB) and SM use (percent) the
#: shared-region file of its container says its one process holds
BOUND = (("trainer", TEAM, 4096, 50, True, 3000, 40), ("notebook", OTHER, 2048, 20, False, 1000, 10))
#: bigger than a T4's 15360 MiB: the extender's filter rejects the node (kube_vgpu_extender_rejections_total)
TOO_BIG = ("too-big", OTHER, 20000)
#: panels (title, refId) that show nothing on this healthy cluster, and why; they are asked too, but may be empty
EMPTY_WHEN_HEALTHY = {
    ("Preemption evictions", "A"): "no pod was preempted (the counter has no series before the first eviction)",
    ("Nodes whose inventory is ignored", "A"): "`== 1` selects nodes with a malformed inventory; there is none",
    ("ECC and XID errors (per hour)", "B"): "the XID counter has a series per XID seen; the fake GPUs raise none",
}

T = TypeVar("T")


@dataclass
class Scene:
    url: str
    node: str
    pods: dict[str, dict[str, Any]]  # name -> the bound pod
    jobs: list[prom.ScrapeJob]
    started: dt.datetime  # when Prometheus started (UTC)
    directory: Path
    binary: Path

    @property
    def grafana_variables(self) -> dict[str, str]:
        """What Grafana substitutes into the queries here: the node and namespaces selected as a user would pick
        them (one node; the two namespaces, multi-value rendered as a regex alternation; the queue), a rate interval
        of 10 s (Grafana's max($__interval + scrape interval, 4 x scrape interval) is 4 s at a 1 s interval; 10 s
        keeps several scrapes in each window on a loaded machine) and the dashboard's range (an hour: longer than
        this Prometheus has lived, as a dashboard's 6 h default is on a new cluster)."""
        return {"$__rate_interval": "10s", "$__range": "1h", "$__interval": "1s", "$node": self.node,
                "$namespace": f"({TEAM}|{OTHER})", "$cluster_queue": QUEUE_NAME}

    def substituted(self, expr: str) -> str:
        variables = self.grafana_variables
        for name in sorted(variables, key=len, reverse=True):
            expr = expr.replace(name, variables[name])
        assert "$" not in expr, f"a Grafana variable the test does not know: {expr}"
        return expr


def poll(what: str, attempt: Callable[[], T | None], diagnose: Callable[[], str], timeout_s: float = WAIT_S) -> T:
    """attempt() until it returns something (not None); fail with diagnose() after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = attempt()
        if result is not None:
            return result
        if time.monotonic() > deadline:
            pytest.fail(f"{what} (waited {timeout_s:.0f} s): {diagnose()}", pytrace=False)
        time.sleep(0.5)


def _quota_objects(node_label: str) -> list[tuple[str, str | None, dict[str, Any]]]:
    """(plural, namespace, object): a ResourceFlavor of the test's node, a ClusterQueue for TEAM, its LocalQueue."""
    flavor = {"apiVersion": f"{GROUP}/v1beta2", "kind": "ResourceFlavor", "metadata": {"name": QUEUE_NAME},
              "spec": {"nodeLabels": {NODE_GROUP_LABEL: node_label}}}
    queue = {"apiVersion": f"{GROUP}/v1beta2", "kind": "ClusterQueue", "metadata": {"name": QUEUE_NAME},
             "spec": {"namespaceSelector": {"matchLabels": {protocol.LABEL_NAMESPACE_NAME: TEAM}},
                      "resourceGroups": [{
                          "coveredResources": [protocol.RESOURCE_GPU, protocol.RESOURCE_GPU_MEMORY,
                                               protocol.RESOURCE_GPU_CORES],
                          "flavors": [{"name": QUEUE_NAME, "resources": [
                              {"name": protocol.RESOURCE_GPU, "nominalQuota": 4},
                              {"name": protocol.RESOURCE_GPU_MEMORY, "nominalQuota": 1_000_000},
                              {"name": protocol.RESOURCE_GPU_CORES, "nominalQuota": 400}]}]}]}}
    local = {"apiVersion": f"{GROUP}/v1beta2", "kind": "LocalQueue", "metadata": {"name": "team"},
             "spec": {"clusterQueue": QUEUE_NAME}}
    return [("resourceflavors", None, flavor), ("clusterqueues", None, queue), ("localqueues", TEAM, local)]


def _metrics_reader_token(dev_cluster: DevCluster, path: Path) -> None:
    """The manifests' metrics-reader ServiceAccount, ClusterRole and binding (monitoring/scheduler-metrics-reader),
    and a token of it in `path`: what the kube-scheduler PodMonitor presents. The dev cluster runs no token
    controller, so a TokenRequest stands in for the Secret the manifest has it fill."""
    from kubernetes import utils

    rendered = objects()
    binding = one(rendered, "ClusterRoleBinding", "kube-vgpu-metrics-reader")
    documents = [one(rendered, "ServiceAccount", binding["subjects"][0]["name"]),
                 one(rendered, "ClusterRole", binding["roleRef"]["name"]), binding]
    for document in documents:
        with contextlib.suppress(utils.FailToCreateError):  # a rerun against a kept cluster
            utils.create_from_dict(dev_cluster.api, document)
    response = dev_cluster.core.create_namespaced_service_account_token(
        binding["subjects"][0]["name"], NAMESPACE,
        {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": {"expirationSeconds": 86400}},
        _preload_content=False)
    path.write_text(orjson.loads(response.data)["status"]["token"])


def _scrape_jobs(dev_cluster: DevCluster, plugin_port: int, directory: Path) -> list[prom.ScrapeJob]:
    """A job per monitor endpoint of manifests/monitoring, aimed at the dev cluster's listener of the port it names,
    with the target labels the Prometheus Operator would give it."""
    ca_file = directory / "webhook-ca.crt"
    ca_file.write_bytes(dev_cluster.webhook_ca_pem)
    token_file = directory / "metrics-reader.token"
    _metrics_reader_token(dev_cluster, token_file)
    # (monitor, port name) -> (address, the pod's container there); in the manifests the extender and kube-scheduler
    # share the pod kube-vgpu-scheduler
    listeners = {
        ("kube-vgpu-extender", "metrics"): (f"127.0.0.1:{dev_cluster.ports['extender-metrics']}", "extender"),
        ("kube-vgpu-scheduler", "https"): (f"127.0.0.1:{dev_cluster.ports['kube-scheduler']}", "kube-scheduler"),
        ("kube-vgpu-device-plugin", "probes"): (f"127.0.0.1:{plugin_port}", "device-plugin"),
        ("kube-vgpu-webhook", "https"): (f"127.0.0.1:{dev_cluster.ports['webhook']}", "webhook"),
    }
    jobs, unserved = prom.monitor_jobs(objects(), listeners, ca_file=str(ca_file), bearer_token_file=str(token_file))
    assert not unserved, f"monitor endpoints the test has no listener for: {unserved}"
    assert len(jobs) == len(listeners), "monitor endpoints the manifests no longer have"
    webhook = next(job for job in jobs if "kube-vgpu-webhook" in job.name)
    assert (webhook.scheme, webhook.server_name) == ("https", WEBHOOK_SERVICE_DNS_NAME)
    return jobs


@contextlib.contextmanager
def _device_plugin(dev_cluster: DevCluster, node: str, directory: Path) -> Iterator[tuple[int, Path]]:
    """A real device plugin process on fake NVML for `node`, with a kubelet stand-in; yields (its probe and metrics
    port, the kubelet pods directory it reads shared regions from) once its inventory is the extender's."""
    kubelet = KubeletStandIn(directory / "device-plugins")
    kubelet.start()
    pods_dir = directory / "pods"
    pods_dir.mkdir()
    port = prom._free_port()
    log_path = directory / "device-plugin.log"
    with log_path.open("wb") as log:
        plugin = subprocess.Popen(
            [sys.executable, "-m", "kube_vgpu.cli", "device-plugin", f"--node-name={node}",
             f"--fake-nvml={PLUGIN_PROFILE}", f"--kubelet-dir={kubelet.directory}",
             f"--kubeconfig={dev_cluster.device_plugin_kubeconfig_for(node)}",
             # the manifests' DaemonSet serves /metrics beside the probes (--probe-address=:8081, port `probes`)
             f"--probe-address=127.0.0.1:{port}", "--pod-resources-socket=", "--heartbeat-seconds=5",
             f"--kubelet-pods-dir={pods_dir}", "--shared-cache-dir=", "--limiter-label="],
            stdout=log, stderr=subprocess.STDOUT,
        )
    try:
        def published() -> bool | None:
            assert plugin.poll() is None, log_path.read_text()[-3000:]
            text = orjson.loads(dev_cluster.core.read_node(node, _preload_content=False).data)["metadata"][
                "annotations"].get(protocol.NODE_INVENTORY_ANNOTATION, "")
            state = httpx.get(f"{dev_cluster.extender_url}/state", timeout=10).json()
            known = {g["uuid"] for n in state["nodes"] if n["name"] == node for g in n["gpus"]}
            mine = {g.uuid for g in protocol.decode_inventory(text).gpus} if text else set()
            return True if mine and mine == known and "Tesla" in text else None

        poll("the device plugin's inventory in the extender", published, lambda: log_path.read_text()[-3000:], 90)
        yield port, pods_dir
    finally:
        plugin.terminate()
        plugin.wait(10)
        kubelet.stop()


@pytest.fixture(scope="module")
def scene(dev_cluster: DevCluster, kueue_crds: None) -> Iterator[Scene]:
    from kube_vgpu.dev.devcluster.binaries import ensure_binaries

    binary = ensure_binaries(progress=lambda line: print(line, file=sys.stderr), names=("prometheus",))["prometheus"]
    directory = Path(tempfile.mkdtemp(prefix="kvprom-e2e-", dir="/tmp"))  # unix socket paths must stay short
    custom: Any = client.CustomObjectsApi(dev_cluster.api)
    label = "prometheus-e2e"
    (node,) = dev_cluster.add_nodes(NodeGroup(count=1, gpus=4, model="Tesla T4", memory_mib=15360, topology="pcie",
                                              prefix="e2e-prom", labels=((NODE_GROUP_LABEL, label),)))
    selector = {NODE_GROUP_LABEL: label}
    created: list[tuple[str, str | None, str]] = []
    try:
        with _device_plugin(dev_cluster, node, directory) as (plugin_port, pods_dir):
            for namespace in (TEAM, OTHER):
                ensure_namespace(dev_cluster.api, namespace)
            for plural, namespace, body in _quota_objects(label):
                if namespace is None:
                    custom.create_cluster_custom_object(GROUP, "v1beta2", plural, body)
                else:
                    custom.create_namespaced_custom_object(GROUP, "v1beta2", namespace, plural, body)
                created.append((plural, namespace, body["metadata"]["name"]))
            poll("the extender sees the ClusterQueue",
                 lambda: True if any(q["name"] == QUEUE_NAME for q in httpx.get(
                     f"{dev_cluster.extender_url}/quota", timeout=10).json()["clusterQueues"]) else None,
                 lambda: dev_cluster.log_tail("extender"), 60)
            pods: dict[str, dict[str, Any]] = {}
            for name, namespace, mib, cores, queued, _, _ in BOUND:
                labels = {protocol.LABEL_KUEUE_QUEUE_NAME: "team"} if queued else {}
                create_pods(dev_cluster.api, namespace, [gpu_pod(name, memory_mib=mib, cores=cores, labels=labels,
                                                                 node_selector=selector)])
                outcome = wait_for_pods(dev_cluster.api, namespace, [name], timeout_s=120)
                assert name in outcome.bound, outcome.describe()
                pods[name] = outcome.pods[name]
            name, namespace, mib = TOO_BIG
            create_pods(dev_cluster.api, namespace, [gpu_pod(name, memory_mib=mib, node_selector=selector)])
            refused = wait_for_pods(dev_cluster.api, namespace, [name], timeout_s=120, expect_refused=[name])
            assert name in refused.refused, refused.describe()
            # each bound container's shared region, where kubelet keeps the webhook's cache emptyDir
            for name, _, mib, cores, _, used_mib, sm in BOUND:
                assignment = assignment_of(pods[name])
                assert assignment is not None
                (device,) = assignment.all_devices()
                Region(uuids=[device.uuid], limits_bytes=[mib << 20], sm_limits=[cores],
                       processes=[Process(pid=100, used_bytes=[used_mib << 20], sm_util=[sm])]).write_pod_volume(
                    pods_dir, pods[name]["metadata"]["uid"], "main", protocol.LIMITER_CACHE_VOLUME)
            jobs = _scrape_jobs(dev_cluster, plugin_port, directory)
            rules = directory / "kube-vgpu.rules.yaml"
            rules.write_text(yaml.safe_dump(prom.rules_document(one(objects(), "PrometheusRule", "kube-vgpu")),
                                            sort_keys=False))
            config = prom.scrape_config(jobs, rule_files=[str(rules)], interval_s=SCRAPE_INTERVAL_S)
            started = dt.datetime.now(dt.UTC)
            with prom.running_prometheus(binary, directory / "prometheus", config) as url:
                yield Scene(url, node, pods, jobs, started, directory, binary)
    finally:
        for namespace in (TEAM, OTHER):
            delete_pods(dev_cluster.api, namespace)
            wait_until_gone(dev_cluster.api, namespace, timeout_s=30)
        for plural, namespace, name in reversed(created):
            with contextlib.suppress(ApiException):
                if namespace is None:
                    custom.delete_cluster_custom_object(GROUP, "v1beta2", plural, name)
                else:
                    custom.delete_namespaced_custom_object(GROUP, "v1beta2", namespace, plural, name)
        for namespace in (TEAM, OTHER):
            with contextlib.suppress(ApiException):
                dev_cluster.core.delete_namespace(namespace, _preload_content=False)
        dev_cluster.delete_nodes([node])
        shutil.rmtree(directory, ignore_errors=True)


def _targets(url: str) -> list[dict[str, Any]]:
    targets: list[dict[str, Any]] = prom.api_get(url, "/api/v1/targets", {"state": "active"})["activeTargets"]
    return targets


def _all_up(scene: Scene) -> list[dict[str, Any]] | None:
    targets = _targets(scene.url)
    return targets if len(targets) == len(scene.jobs) and all(t["health"] == "up" for t in targets) else None


def _describe_targets(scene: Scene) -> str:
    return "\n".join(f"{t['scrapePool']} {t['scrapeUrl']}: {t['health']} {t.get('lastError')}"
                     for t in _targets(scene.url))


def test_every_monitor_endpoint_is_scraped_and_up(scene: Scene) -> None:
    targets = poll("every target up", lambda: _all_up(scene), lambda: _describe_targets(scene))
    assert sorted(t["scrapePool"] for t in targets) == sorted(job.name for job in scene.jobs)
    by_pool = {t["scrapePool"]: t for t in targets}
    # the manifests' schemes: the webhook verified over TLS, kube-scheduler over TLS with the reader's token
    assert by_pool["serviceMonitor/kube-vgpu/kube-vgpu-webhook/0"]["scrapeUrl"].startswith("https://")
    assert by_pool["podMonitor/kube-vgpu/kube-vgpu-scheduler/0"]["scrapeUrl"].startswith("https://")
    assert by_pool["podMonitor/kube-vgpu/kube-vgpu-extender/0"]["scrapeUrl"].startswith("http://")
    # each target's series are there (up alone would also be 1 for an empty page)
    for metric, job in (("kube_vgpu_nodes", "kube-vgpu-extender"), ("kube_vgpu_gpu_memory_total_bytes",
                                                                   "kube-vgpu-device-plugin"),
                        ("kube_vgpu_webhook_admissions_total", "kube-vgpu-webhook"),
                        ("scheduler_pending_pods", "kube-vgpu-scheduler")):
        poll(f"{metric} from {job}", lambda m=metric: prom.query(scene.url, m) or None,
             lambda: _describe_targets(scene))


def test_the_tls_settings_are_enforced_not_ignored(scene: Scene) -> None:
    """Control: the webhook's job with another serverName (one its certificate does not hold), and kube-scheduler's
    without its token, scraped by a Prometheus of their own: both down, for those reasons."""
    webhook = next(job for job in scene.jobs if "kube-vgpu-webhook" in job.name)
    scheduler = next(job for job in scene.jobs if "kube-vgpu-scheduler" in job.name)
    jobs = [dataclasses.replace(webhook, name="wrong-server-name", server_name="kube-vgpu-webhook.elsewhere.svc"),
            dataclasses.replace(scheduler, name="no-token", bearer_token_file=None)]
    config = prom.scrape_config(jobs, interval_s=SCRAPE_INTERVAL_S)
    with prom.running_prometheus(scene.binary, scene.directory / "control", config) as url:
        def failed() -> dict[str, str] | None:
            errors = {t["scrapePool"]: t["lastError"] for t in _targets(url) if t["health"] == "down"}
            return errors if len(errors) == 2 else None

        errors = poll("both control targets down", failed, lambda: orjson.dumps(_targets(url)).decode(), 60)
    assert "certificate" in errors["wrong-server-name"] and "elsewhere" in errors["wrong-server-name"], errors
    assert re.search(r"40[13]", errors["no-token"]), errors


def _dashboard_cases(scene: Scene) -> list[tuple[str, str, tuple[str, str] | None]]:
    """(where, substituted PromQL, the EMPTY_WHEN_HEALTHY key or None) of every panel target and variable."""
    from tests.manifests.test_monitoring import dashboard

    keys = {}
    for panel in dashboard()["panels"]:
        for target in panel.get("targets", []):
            keys[f"panel {panel['id']} {panel['title']!r} {target['refId']}"] = (panel["title"], target["refId"])
    cases = []
    for where, expr in dashboard_queries():
        key = keys.get(where)
        cases.append((where, scene.substituted(expr), key if key in EMPTY_WHEN_HEALTHY else None))
    assert {key for _, _, key in cases if key} == set(EMPTY_WHEN_HEALTHY), "an EMPTY_WHEN_HEALTHY entry is stale"
    return cases


def test_every_dashboard_query_returns_data(scene: Scene) -> None:
    poll("every target up", lambda: _all_up(scene), lambda: _describe_targets(scene))
    cases = _dashboard_cases(scene)
    assert len(cases) > 40
    missing: dict[str, str] = {}

    def all_answer() -> bool | None:
        missing.clear()
        for where, expr, allowed_empty in cases:
            result = prom.query(scene.url, expr)  # an error (bad PromQL) raises at once
            if not result and allowed_empty is None:
                missing[where] = expr
        return None if missing else True

    poll("every dashboard query answers", all_answer,
         lambda: "empty:\n" + "\n".join(f"{w}: {e}" for w, e in missing.items()) + "\n" + _describe_targets(scene))
    # and the ones allowed to be empty still evaluate (their PromQL is sound; prom.query raises otherwise)
    for where, expr, allowed_empty in cases:
        if allowed_empty:
            print(f"{where}: {len(prom.query(scene.url, expr))} series ({EMPTY_WHEN_HEALTHY[allowed_empty]})")
    # control: a metric nobody exports is empty here, and a query that does not parse raises
    assert prom.query(scene.url, scene.substituted('kube_vgpu_no_such_metric{node=~"$node"}')) == []
    with pytest.raises(prom.PrometheusError, match="parse error"):
        prom.query(scene.url, "sum by (node (kube_vgpu_nodes)")


def test_every_legend_and_variable_names_labels_the_series_carry(scene: Scene) -> None:
    """Data is not enough: a panel's legend ({{node}} GPU {{gpu}}) shows what the series' labels hold, and a
    variable offers the values of its label (label_values(metric, label)). Every label a legend names is on every
    series its query returns, and each variable offers what this cluster has: the node, both namespaces, the
    queue."""
    from tests.manifests.test_monitoring import dashboard

    poll("every target up", lambda: _all_up(scene), lambda: _describe_targets(scene))
    problems: list[str] = []

    def check() -> bool | None:
        problems.clear()
        for panel in dashboard()["panels"]:
            for target in panel.get("targets", []):
                if (panel["title"], target["refId"]) in EMPTY_WHEN_HEALTHY:
                    continue
                labels = re.findall(r"\{\{\s*(\w+)\s*\}\}", target.get("legendFormat", ""))
                for series in prom.query(scene.url, scene.substituted(target["expr"])):
                    absent = [label for label in labels if not series["metric"].get(label)]
                    if absent:
                        problems.append(f"{panel['title']!r} {target['refId']}: {series['metric']} lacks {absent}")
        expected = {"node": {scene.node}, "namespace": {TEAM, OTHER}, "cluster_queue": {QUEUE_NAME}}
        for variable in dashboard()["templating"]["list"]:
            if variable["type"] != "query":
                continue
            match = re.fullmatch(r"label_values\((.+), *([a-z_]+)\)", variable["query"]["query"])
            assert match, variable
            metric, label = match.groups()
            offered = {series["metric"].get(label, "") for series in prom.query(scene.url, metric)}
            if not expected[variable["name"]] <= offered:
                problems.append(f"variable {variable['name']} offers {sorted(offered)}, "
                                f"not {sorted(expected[variable['name']])}")
        return None if problems else True

    poll("legends and variables match the series", check, lambda: "\n".join(problems), 60)


def test_every_alert_rule_evaluates_without_error(scene: Scene) -> None:
    expected = {rule["alert"] for group in one(objects(), "PrometheusRule", "kube-vgpu")["spec"]["groups"]
                for rule in group["rules"] if "alert" in rule}

    def rules() -> list[dict[str, Any]]:
        groups = prom.api_get(scene.url, "/api/v1/rules")["groups"]
        return [rule for group in groups for rule in group["rules"]]

    def evaluated() -> list[dict[str, Any]] | None:
        found = rules()
        done = all(not rule["lastEvaluation"].startswith("0001-") for rule in found)
        return found if done and {rule["name"] for rule in found} == expected else None

    found = poll("every rule evaluated once", evaluated, lambda: orjson.dumps(rules()).decode()[:3000])
    assert sorted(rule["name"] for rule in found) == sorted(expected)
    for rule in found:
        assert rule["health"] == "ok" and not rule.get("lastError"), rule
    # the Pending pod too big for any GPU is what KubeVgpuPodsUnschedulable counts (kube-scheduler's own metric,
    # with the namespace label the PodMonitor gives its target)
    (unschedulable,) = [r for r in found if "scheduler_pending_pods" in r["query"]]
    assert unschedulable["query"].endswith(" > 0"), unschedulable["query"]
    poll("kube-scheduler counts the unschedulable pod", lambda: prom.query(scene.url, unschedulable["query"]) or None,
         lambda: f"{unschedulable['query']}: {prom.query(scene.url, 'scheduler_pending_pods')}")


def _value(scene: Scene, expr: str) -> float | None:
    result = prom.query(scene.url, expr)
    return float(result[0]["value"][1]) if len(result) == 1 else None


def test_prometheus_agrees_with_the_extenders_state(dev_cluster: DevCluster, scene: Scene) -> None:
    node = scene.node
    memory = f'sum(max by (uuid) (kube_vgpu_gpu_memory_allocated_mib{{node="{node}"}}))'
    cores = f'sum(max by (uuid) (kube_vgpu_gpu_cores_allocated{{node="{node}"}}))'
    team_pods = f'max(kube_vgpu_namespace_gpu_pods{{namespace="{TEAM}"}})'

    def state_figures() -> tuple[float, float, float]:
        state = httpx.get(f"{dev_cluster.extender_metrics_url}/state", timeout=10).json()
        (mine,) = [n for n in state["nodes"] if n["name"] == node]
        pods = [a for a in state["assignments"] if a["pod"].startswith(f"{TEAM}/")]
        return (float(sum(g["usedMemoryMiB"] for g in mine["gpus"])), float(sum(g["usedCores"] for g in mine["gpus"])),
                float(len(pods)))

    seen: list[Any] = []

    def agree() -> bool | None:
        # the scrape lags /state by up to an interval: compare until one read of each has seen the same moment
        figures = state_figures()
        scraped = tuple(_value(scene, expr) for expr in (memory, cores, team_pods))
        seen[:] = [figures, scraped]
        return True if figures == scraped else None

    poll("Prometheus's figures equal /state's", agree, lambda: f"/state {seen[0]}, Prometheus {seen[1]}", 60)
    assert seen[0] == (4096 + 2048, 50 + 20, 1)
    # and the device plugin's per-container use is the shared regions': 3000 MiB for the trainer's process
    trainer = scene.pods["trainer"]["metadata"]["uid"]
    (series,) = prom.query(scene.url, f'kube_vgpu_container_gpu_memory_used_bytes{{pod_uid="{trainer}"}}')
    assert float(series["value"][1]) == 3000 * 1048576
    # honorLabels: the GPU container's name, not the device plugin's target label
    assert series["metric"]["container"] == "main", series["metric"]


def _usage(scene: Scene, by: str, end: dt.datetime, start: dt.datetime) -> str:
    result = subprocess.run(
        [sys.executable, "-m", "kube_vgpu.cli", "usage", f"--prometheus-url={scene.url}",
         f"--start={start.isoformat()}", f"--end={end.isoformat()}", "--step=10s", f"--by={by}"],
        capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def test_kube_vgpu_usage_reports_the_teams_from_this_prometheus(scene: Scene) -> None:
    """`kube-vgpu usage` (query_range over the per-pod accounting counters) against this Prometheus: a period of
    10 s steps from its start to the last whole step, once at least three steps have passed."""
    start = scene.started.replace(microsecond=0) - dt.timedelta(seconds=scene.started.second % 10)

    def report() -> tuple[str, str] | None:
        steps = math.floor((dt.datetime.now(dt.UTC) - start).total_seconds() / 10)
        if steps < 3:
            return None
        end = start + dt.timedelta(seconds=10 * steps)
        by_namespace = _usage(scene, "namespace", end, start)
        if not all(re.search(rf"^{namespace}\s", by_namespace, re.M) for namespace in (TEAM, OTHER)):
            print(by_namespace, file=sys.stderr)
            return None
        return by_namespace, _usage(scene, "cluster_queue", end, start)

    by_namespace, by_queue = poll("`kube-vgpu usage` names both namespaces", report, lambda: "")
    assert "NAMESPACE" in by_namespace and "GPU-HOURS" in by_namespace
    rows = {line.split()[0]: line.split()[1:] for line in by_namespace.splitlines()[2:] if line.strip()}
    assert float(rows[TEAM][1]) >= 0 and float(rows[OTHER][1]) >= 0  # GPU-HOURS: tiny after seconds, but a number
    assert re.search(rf"^{QUEUE_NAME}\s", by_queue, re.M), by_queue


def test_dev_cluster_up_prometheus_scrapes_the_extender_the_webhook_and_kube_scheduler() -> None:
    """`kube-vgpu dev-cluster up --prometheus` (ClusterOptions.prometheus): the same translation of the monitors, for
    what a dev cluster runs (no device plugin: the heartbeat stands in for it), and the alert rules loaded."""
    from tests.e2e.conftest import private_cluster

    with private_cluster("prometheus", node_groups=(NodeGroup(count=2, gpus=2),), prometheus=True) as cluster:
        url = cluster.prometheus_url
        assert url is not None

        def up() -> list[dict[str, Any]] | None:
            targets = _targets(url)
            return targets if len(targets) == 3 and all(t["health"] == "up" for t in targets) else None

        targets = poll("the dev cluster's Prometheus scrapes its components", up, lambda: orjson.dumps(
            _targets(url)).decode() + "\n" + cluster.log_tail("prometheus"), 120)
        assert sorted(t["labels"]["job"] for t in targets) == [
            "kube-vgpu-webhook", "kube-vgpu/kube-vgpu-extender", "kube-vgpu/kube-vgpu-scheduler"]
        assert poll("the extender's series", lambda: _value_of(url, "max(kube_vgpu_nodes)"), lambda: "", 60) == 2
        groups = prom.api_get(url, "/api/v1/rules")["groups"]
        assert len([rule for group in groups for rule in group["rules"]]) == len(
            [rule for group in one(objects(), "PrometheusRule", "kube-vgpu")["spec"]["groups"]
             for rule in group["rules"]])


def _value_of(url: str, expr: str) -> float | None:
    result = prom.query(url, expr)
    return float(result[0]["value"][1]) if len(result) == 1 else None
