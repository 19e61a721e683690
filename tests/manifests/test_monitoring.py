"""manifests/monitoring: the scrape configurations point at ports and labels the installed workloads really have,
every alert is unit-tested with the real promtool (fires on what should fire it, stays quiet on its near misses),
every PromQL expression of the rules and of the Grafana dashboard parses (promtool check rules), every metric
they use is one the components export (the docs test's exported_metrics(), from the real /metrics output), and every
dashboard query returns data from what the extender (over real HTTP, from a snapshot), the device plugin (fake NVML,
a shared-region file) and the webhook really export, fed to promtool's evaluator as input series. The monitors and
the rule are checked against the Prometheus Operator's own CRD schemas.

promtool is built from Prometheus's Go module on first use (kube_vgpu.dev.devcluster.binaries, opt-in; minutes on
a cold Go cache) and cached, like the dev cluster's binaries."""

from __future__ import annotations

import copy
import functools
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.manifests.render import INSTALLABLE, MANIFESTS, NAMESPACE, ROOT, Object, containers, find, one, render
from tests.manifests.test_docs import exported_metrics

MONITORING = "monitoring"
RULE_TESTS = Path(__file__).parent / "monitoring" / "rules_test.yaml"
DASHBOARD = MANIFESTS / MONITORING / "kube-vgpu-dashboard.json"
#: kube-scheduler's own metrics the rules use (scraped by the PodMonitor kube-vgpu-scheduler; docs/operations.md
#: lists them). Not ours, so not in exported_metrics(); nothing else outside kube_vgpu_* may appear.
KUBE_SCHEDULER_METRICS = {"scheduler_pending_pods"}
#: What Grafana substitutes into the dashboard's queries, with values of the same syntax, so promtool parses them.
GRAFANA_VARIABLES = {"$__rate_interval": "2m", "$__range": "6h", "$__interval": "30s", "$node": ".*",
                     "$namespace": ".*", "$cluster_queue": ".*"}


@functools.cache
def promtool() -> Path:
    from kube_vgpu.dev.devcluster.binaries import ensure_binaries

    return ensure_binaries(progress=lambda line: print(line, file=sys.stderr), names=("promtool",))["promtool"]


def run_promtool(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(promtool()), *args], capture_output=True, text=True, timeout=120, cwd=cwd)


def objects() -> list[Object]:
    return render(MONITORING)


def rule_groups() -> list[dict[str, Any]]:
    groups: list[dict[str, Any]] = one(objects(), "PrometheusRule", "kube-vgpu")["spec"]["groups"]
    return groups


def alerts() -> dict[str, dict[str, Any]]:
    return {rule["alert"]: rule for group in rule_groups() for rule in group["rules"] if "alert" in rule}


def dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return loaded


def dashboard_queries() -> list[tuple[str, str]]:
    """(where, PromQL) of every panel target and every query variable (label_values(m, l) -> m)."""
    found = []
    for panel in dashboard()["panels"]:
        for target in panel.get("targets", []):
            found.append((f"panel {panel['id']} {panel['title']!r} {target['refId']}", target["expr"]))
    for variable in dashboard()["templating"]["list"]:
        if variable["type"] == "query":
            match = re.fullmatch(r"label_values\((.+), *([a-z_]+)\)", variable["query"]["query"])
            assert match, variable
            found.append((f"variable {variable['name']}", match.group(1)))
    return found


def grafana_substituted(expr: str) -> str:
    for name in sorted(GRAFANA_VARIABLES, key=len, reverse=True):
        expr = expr.replace(name, GRAFANA_VARIABLES[name])
    assert "$" not in expr, f"a Grafana variable the test does not know: {expr}"
    return expr


_NOT_METRICS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset", "and", "or",
                "unless", "inf", "nan"}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: identifiers that are not functions, keywords, label names
    (in {...} and in by/without/on/ignoring/group_x lists), strings, durations or numbers."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # strings
    expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", expr)
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # range selectors
    names = set()
    for match in re.finditer(r"(?<![\w.])([A-Za-z_:][A-Za-z0-9_:]*)(\s*\()?", expr):
        word, call = match.group(1), match.group(2)
        if call or word.lower() in _NOT_METRICS:
            continue
        names.add(word)
    return names


# ---------------------------------------------------------------------------------------------------------------
# The kustomization and its scrape configurations
# ---------------------------------------------------------------------------------------------------------------


def test_the_monitoring_kustomization_holds_scrapes_rules_and_the_dashboard() -> None:
    rendered = objects()
    kinds = sorted((o["kind"], o["metadata"]["name"]) for o in rendered)
    assert kinds == sorted([
        ("PodMonitor", "kube-vgpu-extender"), ("PodMonitor", "kube-vgpu-scheduler"),
        ("PodMonitor", "kube-vgpu-device-plugin"), ("ServiceMonitor", "kube-vgpu-webhook"),
        ("PrometheusRule", "kube-vgpu"), ("ConfigMap", "kube-vgpu-dashboard"),
        ("NetworkPolicy", "kube-vgpu-webhook-metrics"), ("ServiceAccount", "kube-vgpu-metrics-reader"),
        ("Secret", "kube-vgpu-metrics-reader"), ("ClusterRole", "kube-vgpu-metrics-reader"),
        ("ClusterRoleBinding", "kube-vgpu-metrics-reader"),
    ])
    for obj in rendered:
        labels = obj["metadata"]["labels"]
        assert labels["app.kubernetes.io/name"] == "kube-vgpu" and labels["app.kubernetes.io/component"] == MONITORING
        if not obj["kind"].startswith("Cluster"):
            assert obj["metadata"]["namespace"] == NAMESPACE, obj["metadata"]["name"]
    configmap = one(rendered, "ConfigMap", "kube-vgpu-dashboard")
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"  # what Grafana's sidecar loads
    assert configmap["data"] == {DASHBOARD.name: DASHBOARD.read_text()}


def _container_ports(overlay: str, component: str) -> set[str]:
    matching = [w for w in render(overlay)
                if w["kind"] in ("Deployment", "DaemonSet")
                and w["spec"]["template"]["metadata"]["labels"].get("app.kubernetes.io/component") == component]
    assert len(matching) == 1, component
    return {port["name"] for _, c in containers(matching[0]) for port in c.get("ports", [])}


@pytest.mark.parametrize("overlay", INSTALLABLE)
def test_every_pod_monitor_selects_one_workload_by_its_labels_and_a_port_it_names(overlay: str) -> None:
    installed = render(overlay)
    for monitor in find(objects(), "PodMonitor"):
        selector = monitor["spec"]["selector"]["matchLabels"]
        selected = [w for w in installed if w["kind"] in ("Deployment", "DaemonSet")
                    and selector.items() <= w["spec"]["template"]["metadata"]["labels"].items()]
        assert len(selected) == 1, monitor["metadata"]["name"]
        ports = {port["name"]: (c["name"], port["containerPort"])
                 for _, c in containers(selected[0]) for port in c.get("ports", [])}
        for endpoint in monitor["spec"]["podMetricsEndpoints"]:
            assert endpoint["port"] in ports, (monitor["metadata"]["name"], endpoint["port"])
            assert endpoint["path"] == "/metrics"
    # the ports are the ones /metrics is served on: the extender's --metrics-port, the device plugin's probe
    # address (the default --metrics-address), kube-scheduler's secure port
    scheduler = one(installed, "Deployment", "kube-vgpu-scheduler")
    extender = next(c for _, c in containers(scheduler) if c["name"] == "extender")
    assert "--metrics-port=8889" in extender["args"] and {"name": "metrics", "containerPort": 8889} in extender["ports"]
    plugin = next(c for kind, c in containers(one(installed, "DaemonSet", "kube-vgpu-device-plugin")) if kind == "app")
    assert "--probe-address=:8081" in plugin["args"] and not any(a.startswith("--metrics-address")
                                                                 for a in plugin["args"])
    assert {"name": "probes", "containerPort": 8081} in plugin["ports"]
    # series carrying the GPU pod's namespace/pod (extender) or container (device plugin) keep them
    for name in ("kube-vgpu-extender", "kube-vgpu-device-plugin"):
        [endpoint] = one(objects(), "PodMonitor", name)["spec"]["podMetricsEndpoints"]
        assert endpoint["honorLabels"] is True


@pytest.mark.parametrize("overlay", INSTALLABLE)
def test_the_webhook_is_scraped_over_tls_verified_with_the_ca_of_its_own_secret(overlay: str) -> None:
    installed = render(overlay)
    monitor = one(objects(), "ServiceMonitor", "kube-vgpu-webhook")
    service = one(installed, "Service", "kube-vgpu-webhook")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    [endpoint] = monitor["spec"]["endpoints"]
    assert endpoint["port"] in {port["name"] for port in service["spec"]["ports"]}
    assert endpoint["scheme"] == "https"
    tls = endpoint["tlsConfig"]
    assert tls["ca"]["secret"] == {"name": "kube-vgpu-webhook-tls", "key": "ca.crt"}
    deployment = one(installed, "Deployment", "kube-vgpu-webhook")
    assert {"name": "tls", "secret": {"secretName": "kube-vgpu-webhook-tls"}} in \
        deployment["spec"]["template"]["spec"]["volumes"]
    assert tls["serverName"] == f"kube-vgpu-webhook.{NAMESPACE}.svc"  # a name its certificate holds
    for certificate in find(installed, "Certificate", "kube-vgpu-webhook"):
        assert tls["serverName"] in certificate["spec"]["dnsNames"]
    # the webhook's NetworkPolicy admits only the API server; the monitoring one admits Prometheus to that port
    policy = one(objects(), "NetworkPolicy", "kube-vgpu-webhook-metrics")
    assert policy["spec"]["podSelector"] == one(installed, "NetworkPolicy", "kube-vgpu-webhook")["spec"]["podSelector"]
    assert [port["port"] for rule in policy["spec"]["ingress"] for port in rule["ports"]] == ["https"]


def test_kube_scheduler_is_scraped_with_a_token_allowed_only_get_metrics() -> None:
    rendered = objects()
    [endpoint] = one(rendered, "PodMonitor", "kube-vgpu-scheduler")["spec"]["podMetricsEndpoints"]
    assert (endpoint["port"], endpoint["scheme"]) == ("https", "https")
    secret = one(rendered, "Secret", endpoint["authorization"]["credentials"]["name"])
    assert secret["type"] == "kubernetes.io/service-account-token"
    account = secret["metadata"]["annotations"]["kubernetes.io/service-account.name"]
    one(rendered, "ServiceAccount", account)
    binding = one(rendered, "ClusterRoleBinding", "kube-vgpu-metrics-reader")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account, "namespace": NAMESPACE}]
    role = one(rendered, "ClusterRole", binding["roleRef"]["name"])
    assert role["rules"] == [{"nonResourceURLs": ["/metrics"], "verbs": ["get"]}]


# ---------------------------------------------------------------------------------------------------------------
# The Prometheus Operator's objects against its own CRDs
# ---------------------------------------------------------------------------------------------------------------


class _CrdLoader(yaml.CSafeLoader):
    """YAML 1.1 reads a bare `=` (an enum value in the CRDs) as the obsolete `value` tag: read it as the string."""


def _value_as_string(loader: yaml.CSafeLoader, node: yaml.ScalarNode) -> str:
    return str(loader.construct_scalar(node))


_CrdLoader.add_constructor("tag:yaml.org,2002:value", _value_as_string)


@functools.cache
def crd_schemas() -> dict[str, dict[str, Any]]:
    """kind -> openAPIV3Schema of the served version, from the Prometheus Operator's module."""
    from kube_vgpu.dev.devcluster.binaries import prometheus_operator_crd_dir

    schemas = {}
    directory = prometheus_operator_crd_dir(progress=lambda line: print(line, file=sys.stderr))
    for plural in ("podmonitors", "servicemonitors", "prometheusrules"):
        crd = yaml.load((directory / f"monitoring.coreos.com_{plural}.yaml").read_text(), Loader=_CrdLoader)
        [version] = [v for v in crd["spec"]["versions"] if v["served"] and v["storage"]]
        schemas[crd["spec"]["names"]["kind"]] = version["schema"]["openAPIV3Schema"]
    return schemas


_TYPES: dict[str, type | tuple[type, ...]] = {"object": dict, "array": list, "string": str, "boolean": bool,
                                              "integer": int, "number": (int, float)}


def schema_errors(value: Any, schema: dict[str, Any], where: str = "") -> list[str]:
    """What the API server's structural schema validation would refuse: unknown fields (strict field validation),
    wrong types, values outside an enum, missing required fields."""
    if schema.get("x-kubernetes-int-or-string"):
        return [] if isinstance(value, (int, str)) else [f"{where}: {value!r} is not an int or a string"]
    expected = schema.get("type")
    if expected and not isinstance(value, _TYPES[expected]):
        return [f"{where}: {value!r} is not of type {expected}"]
    if "enum" in schema and value not in schema["enum"]:
        return [f"{where}: {value!r} is not one of {schema['enum']}"]
    errors = []
    if isinstance(value, dict):
        properties = schema.get("properties")
        errors += [f"{where}.{key}: required" for key in schema.get("required", []) if key not in value]
        for key, item in value.items():
            if properties is not None and key in properties:
                errors += schema_errors(item, properties[key], f"{where}.{key}")
            elif isinstance(schema.get("additionalProperties"), dict):
                errors += schema_errors(item, schema["additionalProperties"], f"{where}.{key}")
            elif properties is not None and not schema.get("x-kubernetes-preserve-unknown-fields"):
                errors.append(f"{where}.{key}: unknown field")
    elif isinstance(value, list) and "items" in schema:
        for index, item in enumerate(value):
            errors += schema_errors(item, schema["items"], f"{where}[{index}]")
    return errors


def test_the_operator_objects_follow_the_prometheus_operator_s_crds() -> None:
    checked = 0
    for obj in objects():
        if obj["apiVersion"].startswith("monitoring.coreos.com/"):
            body = {key: value for key, value in obj.items() if key != "metadata"}  # metadata: ObjectMeta's own
            assert schema_errors(body, crd_schemas()[obj["kind"]], obj["kind"]) == [], obj["metadata"]["name"]
            checked += 1
    assert checked == 5
    # control: a misspelt field and a wrong type are found
    monitor = copy.deepcopy(one(objects(), "PodMonitor", "kube-vgpu-extender"))
    monitor["spec"]["podMetricsEndpoints"][0]["honorLabel"] = True
    monitor["spec"]["podMetricsEndpoints"][0]["interval"] = 30
    del monitor["metadata"]
    assert schema_errors(monitor, crd_schemas()["PodMonitor"]) == [
        ".spec.podMetricsEndpoints[0].interval: 30 is not of type string",
        ".spec.podMetricsEndpoints[0].honorLabel: unknown field",
    ]


# ---------------------------------------------------------------------------------------------------------------
# The alert rules, with the real promtool
# ---------------------------------------------------------------------------------------------------------------


def write_rules(directory: Path, groups: list[dict[str, Any]] | None = None) -> Path:
    path = directory / "rules.yaml"
    path.write_text(yaml.safe_dump({"groups": rule_groups() if groups is None else groups}, sort_keys=False))
    return path


def test_promtool_checks_the_rules(tmp_path: Path) -> None:
    rules = write_rules(tmp_path)
    result = run_promtool("check", "rules", str(rules))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(alerts())} rules found" in result.stdout


def test_the_alerts_are_the_ones_operations_md_describes_each_with_for_severity_and_what_to_do() -> None:
    documented = set(re.findall(r"`(KubeVgpu[A-Za-z]+)`", (ROOT / "docs" / "operations.md").read_text()))
    assert set(alerts()) == documented
    for name, rule in alerts().items():
        assert re.fullmatch(r"\d+[mh]", rule["for"]), name
        assert rule["labels"]["severity"] in ("critical", "warning", "info"), name
        annotations = rule["annotations"]
        assert ": " in annotations["summary"], f"{name}: the summary says what is wrong, then what to do"
        assert annotations["description"] and "{{" not in annotations["description"], name
        page, _, anchor = annotations["runbook_url"].removeprefix(
            "https://github.com/kube-vgpu/kube-vgpu/blob/main/").partition("#")
        doc = (ROOT / page).read_text()
        if anchor:  # a heading of that page
            headings = {re.sub(r"[^a-z0-9 -]", "", h.lower()).replace(" ", "-")
                        for h in re.findall(r"^#+ (.+)$", doc, flags=re.M)}
            assert anchor in headings, f"{name}: {annotations['runbook_url']}"


def rule_tests_with_static_annotations() -> dict[str, Any]:
    """rules_test.yaml with each expected alert's description and runbook_url filled in from its rule."""
    tests: dict[str, Any] = yaml.safe_load(RULE_TESTS.read_text())
    by_name = alerts()
    for group in tests["tests"]:
        for case in group["alert_rule_test"]:
            for expected in case["exp_alerts"]:
                annotations = by_name[case["alertname"]]["annotations"]
                expected["exp_annotations"] |= {key: annotations[key] for key in ("description", "runbook_url")}
    return tests


def run_rule_tests(directory: Path, groups: list[dict[str, Any]] | None = None) -> subprocess.CompletedProcess[str]:
    write_rules(directory, groups)
    (directory / RULE_TESTS.name).write_text(yaml.safe_dump(rule_tests_with_static_annotations(), sort_keys=False))
    return run_promtool("test", "rules", RULE_TESTS.name, cwd=directory)


def test_every_alert_has_unit_tests_that_see_it_fire_and_stay_quiet() -> None:
    cases = [case for group in yaml.safe_load(RULE_TESTS.read_text())["tests"] for case in group["alert_rule_test"]]
    for name in alerts():
        mine = [case for case in cases if case["alertname"] == name]
        assert any(case["exp_alerts"] for case in mine), f"{name}: no test in which it fires"
        assert any(not case["exp_alerts"] for case in mine), f"{name}: no test in which it stays quiet"


def test_promtool_runs_the_alert_unit_tests(tmp_path: Path) -> None:
    result = run_rule_tests(tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_the_unit_tests_catch_a_changed_threshold(tmp_path: Path) -> None:
    # control: the same tests against rules whose bind-failure threshold is 50 instead of 5 fail, naming the alert
    groups = copy.deepcopy(rule_groups())
    [rule] = [r for g in groups for r in g["rules"] if r.get("alert") == "KubeVgpuBindFailures"]
    assert rule["expr"].endswith("> 5")
    rule["expr"] = rule["expr"].removesuffix("> 5") + "> 50"
    result = run_rule_tests(tmp_path, groups)
    assert result.returncode != 0
    assert "KubeVgpuBindFailures" in result.stdout + result.stderr


# ---------------------------------------------------------------------------------------------------------------
# The Grafana dashboard
# ---------------------------------------------------------------------------------------------------------------


def test_the_dashboard_has_the_cluster_node_gpu_and_team_views() -> None:
    board = dashboard()
    assert board["uid"] == "kube-vgpu"
    rows = [p["title"] for p in board["panels"] if p["type"] == "row"]
    assert {"Cluster overview", "Nodes", "GPUs", "Teams and queues"} <= set(rows)
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    for panel in board["panels"]:
        if panel["type"] != "row":
            assert panel["targets"] and panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
            grid = panel["gridPos"]
            assert grid["x"] + grid["w"] <= 24, panel["title"]
    variables = {v["name"] for v in board["templating"]["list"]}
    assert variables == {"datasource", "node", "namespace", "cluster_queue"}
    used = {name for _, expr in dashboard_queries() for name in re.findall(r"\$(\w+)", expr)}
    assert used - {"__rate_interval", "__range"} <= variables


def test_promtool_parses_every_dashboard_query(tmp_path: Path) -> None:
    queries = dashboard_queries()
    assert len(queries) > 40
    rules = [{"record": f"kube_vgpu:dashboard:query_{i}", "expr": grafana_substituted(expr)}
             for i, (_, expr) in enumerate(queries)]
    path = write_rules(tmp_path, [{"name": "dashboard", "rules": rules}])
    result = run_promtool("check", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(rules)} rules found" in result.stdout
    # control: one broken query is reported
    rules.append({"record": "kube_vgpu:dashboard:broken", "expr": "sum by (node (kube_vgpu_nodes)"})
    path = write_rules(tmp_path, [{"name": "dashboard", "rules": rules}])
    result = run_promtool("check", "rules", str(path))
    assert result.returncode != 0 and "parse error" in result.stdout + result.stderr


def test_metric_names_are_found_in_promql() -> None:
    expr = ('sum by (namespace) (max by (namespace, pod) (increase(kube_vgpu_pod_vgpu_seconds_total'
            '{namespace=~"a|b"}[6h]))) / on (pod_uid) group_left (pod) max(scheduler_pending_pods offset 5m) '
            "or vector(0) > bool 1e3")
    assert metric_names(expr) == {"kube_vgpu_pod_vgpu_seconds_total", "scheduler_pending_pods"}


def test_every_metric_the_rules_and_the_dashboard_use_is_exported() -> None:
    exported = exported_metrics()
    expressions = [(name, rule["expr"]) for name, rule in alerts().items()] + dashboard_queries()
    used: set[str] = set()
    for where, expr in expressions:
        names = metric_names(expr)
        assert names, f"{where}: no metric in {expr}"
        for name in names:
            assert name.startswith("kube_vgpu_") or name in KUBE_SCHEDULER_METRICS, f"{where}: {name}"
            base = re.sub(r"_(bucket|sum|count)$", "", name)
            if name.startswith("kube_vgpu_"):
                assert name in exported or base in exported, f"{where} uses {name}, which nothing exports"
        used |= names
    # what the dashboard covers, at least: allocation (extender), measured use (device plugin), the webhook
    assert {"kube_vgpu_gpu_memory_allocated_mib", "kube_vgpu_gpu_utilization_ratio",
            "kube_vgpu_container_gpu_memory_used_bytes", "kube_vgpu_pod_gpu_core_percent_seconds_total",
            "kube_vgpu_quota_used", "kube_vgpu_webhook_admissions_total"} <= used
    operations = (ROOT / "docs" / "operations.md").read_text()
    for name in KUBE_SCHEDULER_METRICS:
        assert f"`{name}" in operations


# ---------------------------------------------------------------------------------------------------------------
# Every dashboard query returns data from the components' real /metrics output
# ---------------------------------------------------------------------------------------------------------------

#: Panels that show nothing in a healthy cluster by design (title -> why).
EMPTY_WHEN_HEALTHY = {"Preemption evictions": "no pod was preempted (the counter has no series before the first)"}


def _device_plugin_exposition(node: str, pod_uid: str) -> str:
    """The device plugin's /metrics on fake T4s (NVML's UUIDs are the extender's synth_uuid(node, i)), with an XID
    seen and one container of `pod_uid` on GPU 0 in a shared region, compute-limited to 50 %."""
    from prometheus_client import CollectorRegistry, generate_latest

    from kube_vgpu.deviceplugin.discovery import discover
    from kube_vgpu.deviceplugin.fakenvml import FakeNvml, load_profile
    from kube_vgpu.deviceplugin.metrics import DevicePluginCollector
    from kube_vgpu.deviceplugin.nvml import Nvml
    from kube_vgpu.deviceplugin.state import DeviceState
    from tests.deviceplugin.regionfiles import Region

    nvml = Nvml(FakeNvml(load_profile("t4-4-pcie", node)))
    discovery = discover(nvml)
    state = DeviceState(discovery.inventory)
    uuid = state.uuids()[0]
    with tempfile.TemporaryDirectory() as cache:
        Region(uuids=[uuid], limits_bytes=[4 << 30], sm_limits=[50]).write(Path(cache), pod_uid, "main")
        registry = CollectorRegistry()
        registry.register(DevicePluginCollector(node, nvml, discovery.handles, state,
                                                xid_counts=lambda: {(uuid, 79): 1}, cache_dir=Path(cache)))
        return generate_latest(registry).decode()


def _extender_exposition(directory: Path, node: str) -> tuple[str, str]:
    """(the extender's /metrics over real HTTP after a filter and a prioritize, the GPU pod's uid): a snapshot of two
    T4 nodes, one pod bound through a ClusterQueue of the example quota, and a node with a malformed inventory."""
    import httpx
    import orjson

    from kube_vgpu import protocol
    from kube_vgpu.dev.fixtures import gpu_node, scheduled_pod
    from kube_vgpu.extender.cli import build, parse_args
    from tests.extender.test_usage_metrics import EXAMPLES, T0, bound_pod
    from tests.servers import serve

    broken = gpu_node("broken", gpus=1)
    broken["metadata"]["annotations"][protocol.NODE_INVENTORY_ANNOTATION] = '{"gpus": "not a list"}'
    trainer = bound_pod("trainer", "research", node, [(0, 8192, 50)], queue="research-queue")
    items = [gpu_node(node, gpus=4, model="Tesla-T4", memory_mib=15360),
             gpu_node("other", gpus=4, model="Tesla-T4", memory_mib=15360), broken, trainer]
    snapshot = directory / "snapshot.json"
    snapshot.write_bytes(orjson.dumps({"apiVersion": "v1", "kind": "List", "items": items}))
    args = parse_args(["--snapshot", str(snapshot), "--quota-config", str(EXAMPLES / "quota.yaml")])
    with serve(build(args, clock=lambda: T0 + 3600).app) as url, httpx.Client(base_url=url, timeout=10) as client:
        fitting, too_big = scheduled_pod(gpus=1, memory_mib=1024, cores=10), scheduled_pod(gpus=5)  # 4 GPUs a node
        for verb, asking in (("filter", fitting), ("prioritize", fitting), ("filter", too_big)):
            reply = client.post(f"/{verb}", json={"Pod": asking, "NodeNames": [node, "other"], "Nodes": None})
            reply.raise_for_status()
        return client.get("/metrics").text, str(trainer["metadata"]["uid"])


def _watch_exposition() -> str:
    """The watch series a live extender adds (a snapshot has no watches): its SourceCollector's, as extender/cli.py
    registers it with the nodes and pods watches."""
    from prometheus_client import CollectorRegistry, generate_latest

    from kube_vgpu.extender.sources.metrics import SourceCollector
    from kube_vgpu.extender.sources.watch import WatchHealth
    from kube_vgpu.extender.state import ClusterState

    registry = CollectorRegistry()
    watches = {resource: WatchHealth(resource, 90.0) for resource in ("nodes", "pods")}
    for health in watches.values():
        health.progressed()  # listed: the watches are open
        health.restarted("expired")
    registry.register(SourceCollector(ClusterState(), watches))
    return generate_latest(registry).decode()


def _webhook_exposition() -> str:
    from prometheus_client import generate_latest

    from kube_vgpu.webhook.metrics import WebhookMetrics

    metrics = WebhookMetrics()
    metrics.admissions.labels("CREATE", "mutated").inc()
    metrics.admission_duration.labels("mutated").observe(0.0004)
    metrics.certificate_expiry.set(2_000_000_000)
    return generate_latest(metrics.registry).decode()


def _input_series(exposition: str, prefix: str = "kube_vgpu_") -> list[dict[str, str]]:
    """promtool input series holding each sample of the exposition (of the families named `prefix`...) for 40
    minutes: gauges constant, counters and histograms growing by one a minute (so rate() and increase() see them
    move)."""
    from prometheus_client.parser import text_string_to_metric_families

    series = []
    for family in text_string_to_metric_families(exposition):
        if not family.name.startswith(prefix):
            continue
        for sample in family.samples:
            if sample.name.endswith("_created") or sample.value != sample.value:  # creation times, NaN
                continue
            labels = ",".join(f"{key}={json.dumps(value)}" for key, value in sorted(sample.labels.items()))
            value = f"{sample.value:.6f}".rstrip("0").rstrip(".")
            growing = family.type in ("counter", "histogram")
            series.append({"series": f"{sample.name}{{{labels}}}",
                           "values": f"{value}+1x40" if growing else f"{value}x40"})
    return series


def test_every_dashboard_query_returns_data_from_the_components_real_metrics(tmp_path: Path) -> None:
    exposition, pod_uid = _extender_exposition(tmp_path, "n")
    exposition += _device_plugin_exposition("n", pod_uid) + _webhook_exposition()
    queries = [(where, expr) for where, expr in dashboard_queries()
               if not any(f"{title!r}" in where for title in EMPTY_WHEN_HEALTHY)]
    assert len(queries) == len(dashboard_queries()) - len(EMPTY_WHEN_HEALTHY)
    write_rules(tmp_path, [])
    case: dict[str, Any] = {
        "interval": "1m",
        "input_series": _input_series(exposition) + _input_series(_watch_exposition(), "kube_vgpu_extender_watch_"),
        # absent(q) is empty exactly when q returns something
        "promql_expr_test": [{"expr": f"absent({grafana_substituted(expr)})", "eval_time": "30m", "exp_samples": []}
                             for _, expr in queries],
    }
    tests = {"rule_files": ["rules.yaml"], "evaluation_interval": "1m", "tests": [case]}
    (tmp_path / "dashboard_test.yaml").write_text(yaml.safe_dump(tests, sort_keys=False))
    result = run_promtool("test", "rules", "dashboard_test.yaml", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    # control: a query of a metric nobody exports is reported empty
    case["promql_expr_test"] = [{"expr": "absent(kube_vgpu_no_such_metric)", "eval_time": "30m", "exp_samples": []}]
    (tmp_path / "dashboard_test.yaml").write_text(yaml.safe_dump(tests, sort_keys=False))
    assert run_promtool("test", "rules", "dashboard_test.yaml", cwd=tmp_path).returncode != 0
