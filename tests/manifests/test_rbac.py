"""RBAC exactly as intended and nothing more: per role the exact (group, resource, name) -> verbs; no wildcards;
Secrets only for the certificate Job; every binding and ServiceAccount accounted for; the identities the webhook
trusts are the ones the components run as; and every Kubernetes API call in the components' code is covered.

Sufficiency against a real API server (SubjectAccessReview per verb) is the e2e test's job
(tests/e2e/test_manifests_apply.py, when the dev cluster fixture exists)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from kube_vgpu.protocol import (
    COSCHEDULING_API_GROUP,
    COSCHEDULING_POD_GROUPS,
    WORKLOAD_API_GROUP,
    WORKLOAD_POD_GROUPS,
)
from kube_vgpu.webhook.config import DEFAULT_DEVICE_PLUGIN_USERNAME, DEFAULT_EXTENDER_USERNAME
from kube_vgpu.webhook.owners import SUPPORTED_OWNERS
from tests.manifests.render import (
    INSTALLABLE,
    NAMESPACE,
    ROOT,
    SCHEDULER_CONFIG,
    find,
    one,
    pod_spec,
    render,
    workloads,
)

Grant = tuple[str, str, str]  # (apiGroup, resource, resourceName or "" for any)
KUEUE = ("clusterqueues", "localqueues", "resourceflavors", "cohorts", "workloadpriorityclasses", "workloads")

#: Our roles: (kind, namespace or None, name) -> grant -> verbs.
INTENDED_ROLES: dict[tuple[str, str | None, str], dict[Grant, set[str]]] = {
    ("ClusterRole", None, "kube-vgpu-extender"): {
        ("", "nodes", ""): {"list", "watch"},
        ("", "pods", ""): {"get", "list", "watch"},
        ("", "pods/binding", ""): {"create"},
        # preemption (extender/sources/evictor.py): never pods delete, PodDisruptionBudgets apply
        ("", "pods/status", ""): {"patch"},
        ("", "pods/eviction", ""): {"create"},
        ("events.k8s.io", "events", ""): {"create"},
        ("", "namespaces", ""): {"list", "watch"},
        **{("kueue.x-k8s.io", plural, ""): {"list", "watch"} for plural in KUEUE},
        # quota mode auto/enforce: is Kueue's controller installed? (extender/quota/factory.py)
        ("admissionregistration.k8s.io", "mutatingwebhookconfigurations", ""): {"list"},
    },
    ("Role", NAMESPACE, "kube-vgpu-scheduler-leader-election"): {
        ("coordination.k8s.io", "leases", "kube-vgpu-scheduler"): {"get", "update", "list", "watch"},
    },
    ("ClusterRole", None, "kube-vgpu-device-plugin"): {
        ("", "pods", ""): {"list", "patch"},
        ("", "nodes", ""): {"get", "patch"},
        ("", "events", ""): {"create"},
    },
    # get on exactly the owner kinds webhook/owners.py follows
    ("ClusterRole", None, "kube-vgpu-webhook"): {
        **{(group, plural, ""): {"get"} for (group, _kind), (_version, plural) in SUPPORTED_OWNERS.items()},
        ("kueue.x-k8s.io", "localqueues", ""): {"get"},
        (COSCHEDULING_API_GROUP, COSCHEDULING_POD_GROUPS, ""): {"get"},
        (WORKLOAD_API_GROUP, WORKLOAD_POD_GROUPS, ""): {"get"},
    },
    # the self-signed overlay only
    ("Role", NAMESPACE, "kube-vgpu-certs"): {
        ("", "secrets", ""): {"create"},
        ("", "secrets", "kube-vgpu-webhook-tls"): {"get", "patch"},
        ("", "secrets", "kube-vgpu-webhook-ca"): {"get", "patch"},
    },
    ("ClusterRole", None, "kube-vgpu-certs"): {
        ("admissionregistration.k8s.io", "mutatingwebhookconfigurations", "kube-vgpu-webhook"): {"get", "patch"},
    },
}

#: ServiceAccount -> the roles bound to it: (kind, namespace of a Role's binding or None, role name).
INTENDED_BINDINGS: dict[str, set[tuple[str, str | None, str]]] = {
    "kube-vgpu-extender": {
        ("ClusterRole", None, "kube-vgpu-extender"),
        ("ClusterRole", None, "system:kube-scheduler"),
        ("ClusterRole", None, "system:volume-scheduler"),
        ("Role", NAMESPACE, "kube-vgpu-scheduler-leader-election"),
        ("Role", "kube-system", "extension-apiserver-authentication-reader"),
    },
    "kube-vgpu-device-plugin": {("ClusterRole", None, "kube-vgpu-device-plugin")},
    "kube-vgpu-webhook": {("ClusterRole", None, "kube-vgpu-webhook")},
    "kube-vgpu-certs": {("Role", NAMESPACE, "kube-vgpu-certs"), ("ClusterRole", None, "kube-vgpu-certs")},
}


def grants(role: dict) -> dict[Grant, set[str]]:
    found: dict[Grant, set[str]] = {}
    for rule in role.get("rules") or []:
        assert not rule.get("nonResourceURLs"), f"{role['metadata']['name']}: nonResourceURLs"
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                for name in rule.get("resourceNames") or [""]:
                    found.setdefault((group, resource, name), set()).update(rule["verbs"])
    return found


def role_key(role: dict) -> tuple[str, str | None, str]:
    return (role["kind"], role["metadata"].get("namespace"), role["metadata"]["name"])


@pytest.mark.parametrize("overlay", INSTALLABLE)
def test_every_role_grants_exactly_what_is_intended(overlay: str) -> None:
    objects = render(overlay)
    roles = find(objects, "Role") + find(objects, "ClusterRole")
    with_job = overlay == "overlays/self-signed"
    expected = {key for key in INTENDED_ROLES if key[2] != "kube-vgpu-certs" or with_job}
    assert {role_key(r) for r in roles} == expected
    for role in roles:
        assert grants(role) == INTENDED_ROLES[role_key(role)], role["metadata"]["name"]


@pytest.mark.parametrize("overlay", INSTALLABLE)
def test_no_wildcards_no_escalation_and_secrets_only_for_the_certificate_job(overlay: str) -> None:
    for role in find(render(overlay), "Role") + find(render(overlay), "ClusterRole"):
        for rule in role["rules"]:
            for field in ("apiGroups", "resources", "verbs", "resourceNames"):
                assert "*" not in (rule.get(field) or []), f"{role['metadata']['name']}: wildcard in {field}"
            assert not {"escalate", "bind", "impersonate", "deletecollection"} & set(rule["verbs"])
            if "secrets" in rule["resources"]:
                assert role["metadata"]["name"] == "kube-vgpu-certs"
        assert "aggregationRule" not in role


@pytest.mark.parametrize("overlay", INSTALLABLE)
def test_bindings_tie_each_service_account_to_exactly_its_roles(overlay: str) -> None:
    objects = render(overlay)
    accounts = {a["metadata"]["name"] for a in find(objects, "ServiceAccount")}
    assert all(a["metadata"]["namespace"] == NAMESPACE for a in find(objects, "ServiceAccount"))
    bound: dict[str, set[tuple[str, str | None, str]]] = {name: set() for name in accounts}
    for binding in find(objects, "RoleBinding") + find(objects, "ClusterRoleBinding"):
        ref = binding["roleRef"]
        namespace = binding["metadata"].get("namespace") if binding["kind"] == "RoleBinding" else None
        for subject in binding["subjects"]:
            assert subject["kind"] == "ServiceAccount" and subject["namespace"] == NAMESPACE, binding
            assert subject["name"] in accounts, f"{binding['metadata']['name']} binds a missing {subject['name']}"
            bound[subject["name"]].add((ref["kind"], namespace, ref["name"]))
    expected = {name: roles for name, roles in INTENDED_BINDINGS.items()
                if name != "kube-vgpu-certs" or overlay == "overlays/self-signed"}
    assert bound == expected


@pytest.mark.parametrize("overlay", INSTALLABLE)
def test_each_workload_runs_as_its_account(overlay: str) -> None:
    objects = render(overlay)
    accounts = {a["metadata"]["name"]: a for a in find(objects, "ServiceAccount")}
    used = {}
    for workload in workloads(objects):
        spec = pod_spec(workload)
        used[workload["metadata"]["name"]] = spec["serviceAccountName"]
        assert spec["serviceAccountName"] in accounts
    assert used["kube-vgpu-scheduler"] == "kube-vgpu-extender"
    assert used["kube-vgpu-device-plugin"] == "kube-vgpu-device-plugin"
    assert used["kube-vgpu-webhook"] == "kube-vgpu-webhook"
    # the webhook reads pods' owners (get only, INTENDED_ROLES): its token is mounted
    assert accounts["kube-vgpu-webhook"].get("automountServiceAccountToken", True) is True
    assert pod_spec(one(objects, "Deployment", "kube-vgpu-webhook")).get("automountServiceAccountToken", True) is True


def test_the_webhook_trusts_exactly_the_identities_the_writers_run_as() -> None:
    objects = render("overlays/self-signed")

    def username(workload: str, kind: str) -> str:
        return f"system:serviceaccount:{NAMESPACE}:{pod_spec(one(objects, kind, workload))['serviceAccountName']}"

    assert username("kube-vgpu-scheduler", "Deployment") == DEFAULT_EXTENDER_USERNAME
    assert username("kube-vgpu-device-plugin", "DaemonSet") == DEFAULT_DEVICE_PLUGIN_USERNAME
    [guard] = [w for w in one(objects, "MutatingWebhookConfiguration", "kube-vgpu-webhook")["webhooks"]
               if w["rules"][0]["operations"] == ["UPDATE"]]
    condition = guard["matchConditions"][0]["expression"]
    assert f"'{DEFAULT_EXTENDER_USERNAME}'" in condition and f"'{DEFAULT_DEVICE_PLUGIN_USERNAME}'" in condition


def test_the_lease_role_names_the_lease_of_the_scheduler_configuration() -> None:
    election = yaml.safe_load(SCHEDULER_CONFIG.read_text())["leaderElection"]
    assert election["leaderElect"] is True
    assert (election["resourceNamespace"], election["resourceName"]) != ("kube-system", "kube-scheduler")
    role = one(render("base"), "Role", "kube-vgpu-scheduler-leader-election")
    assert role["metadata"]["namespace"] == election["resourceNamespace"]
    verbs = {"get", "update", "list", "watch"}  # list/watch: the extender's fence follows the Lease
    assert grants(role) == {("coordination.k8s.io", "leases", election["resourceName"]): verbs}


# ---------------------------------------------------------------------------------------------
# Every API call in the code is covered by its component's role
# ---------------------------------------------------------------------------------------------

_CALL = re.compile(r"\b(?:core|custom|admission)\.(list|read|patch|create|replace|delete)_(namespaced_)?([a-z_]+?)"
                   r"(_for_all_namespaces)?\b")
_RESOURCES = {"node": "nodes", "pod": "pods", "pod_binding": "pods/binding", "namespace": "namespaces",
              "event": "events", "secret": "secrets", "config_map": "configmaps"}
_VERBS = {"list": "list", "read": "get", "patch": "patch", "create": "create", "replace": "update",
          "delete": "delete"}


# raw calls through ApiClient.param_serialize: the method, then the core API path (of a collection, or of one
# object and maybe its subresource; namespaced or not). A GET of a collection is a list, of one object a get.
_RAW_CALL = re.compile(
    r'"(GET|POST|PATCH|PUT|DELETE)",\s*"/api/v1/(?:namespaces/\{namespace\}/)?([a-z]+)(/\{name\})?(?:/([a-z]+))?"'
)
_RAW_VERBS = {"POST": "create", "PATCH": "patch", "PUT": "update", "DELETE": "delete"}
# raw calls to a collection of a named API group: "POST", "/apis/<group>/<version>/namespaces/{namespace}/<plural>"
_RAW_GROUP_CALL = re.compile(r'"(POST)",\s*"/apis/([a-z0-9.-]+)/[a-z0-9]+/namespaces/\{namespace\}/([a-z]+)"')


def api_calls(*paths: str) -> set[tuple[str, str, str]]:
    """(group, resource, verb) of every kubernetes-client call in these files; lists are watched too."""
    calls: set[tuple[str, str, str]] = set()
    for path in paths:
        text = (ROOT / path).read_text()
        for method, resource, one_object, subresource in _RAW_CALL.findall(text):
            verb = ("get" if one_object else "list") if method == "GET" else _RAW_VERBS[method]
            calls.add(("", f"{resource}/{subresource}" if subresource else resource, verb))
        for method, group, resource in _RAW_GROUP_CALL.findall(text):
            calls.add((group, resource, _RAW_VERBS[method]))
        for verb, _, kind, _ in _CALL.findall(text):
            if kind == "cluster_custom_object":  # Kueue's objects (extender/quota/live.py KINDS)
                resources = [("kueue.x-k8s.io", plural) for plural in KUEUE]
            elif kind == "mutating_webhook_configuration":
                resources = [("admissionregistration.k8s.io", "mutatingwebhookconfigurations")]
            else:
                resources = [("", _RESOURCES[kind])]
            for group, resource in resources:
                calls.add((group, resource, _VERBS[verb]))
    return calls


def allowed(role_name: str) -> set[tuple[str, str, str]]:
    role = INTENDED_ROLES[("ClusterRole", None, role_name)]
    return {(group, resource, verb) for (group, resource, name), verbs in role.items() if not name for verb in verbs}


@pytest.mark.parametrize(
    ("role", "sources", "watched"),
    [
        ("kube-vgpu-extender", ("extender/sources/live.py", "extender/sources/evictor.py", "extender/quota/live.py",
                                 "extender/quota/factory.py", "extender/scheduler.py"), True),
        ("kube-vgpu-device-plugin", ("deviceplugin/kube.py", "deviceplugin/app.py", "deviceplugin/foreign.py"), False),
    ],
)
def test_every_api_call_in_the_code_is_granted(role: str, sources: tuple[str, ...], watched: bool) -> None:
    calls = api_calls(*sources)
    assert calls, "the call pattern found nothing: update the test"
    if watched:  # the extender's lists feed its watches (sources/watch.py watch_events)
        calls |= {(group, resource, "watch") for group, resource, verb in calls
                  if verb == "list" and resource != "mutatingwebhookconfigurations"}  # read once, not watched
    missing = calls - allowed(role)
    assert not missing, f"{role} lacks {sorted(missing)}"
    unused = allowed(role) - calls
    assert not unused, f"{role} grants {sorted(unused)} that no code uses"


def test_the_call_scan_sees_the_files_it_is_given() -> None:
    for path in ("extender/sources/live.py", "deviceplugin/kube.py"):
        assert Path(ROOT / path).is_file()
