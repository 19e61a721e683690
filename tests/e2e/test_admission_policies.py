"""The ValidatingAdmissionPolicies of manifests/base/admission (webhook.policies) against the real kube-apiserver:

* the device plugin, as its ServiceAccount with the node-name claim of node A (impersonated: the admin may set
  userInfo.extra; a real node-bound token and a real unbound token as well), may write Allocate's annotation on
  pods bound to A and its inventory on node A, and nothing else: not on B, not a pod's image, labels or other
  annotations, not the extender's assignment, not node A's taints or other labels; without the claim, nothing;
* RBAC (SubjectAccessReviews) gives it no delete, no secrets, no status subresources;
* a pod's Kueue queue label is fixed at creation for a tenant who may patch pods; kube-vgpu's extender may change it;
* in a namespace the webhook does not see, a tenant cannot create a pod carrying the admission mark (nor add it, nor
  bind with kube-vgpu.io/ annotations); a pod without it is created as usual.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client as k8s_client
from kubernetes import config as k8s_config
from kubernetes.client.rest import ApiException

from kube_vgpu import protocol
from kube_vgpu.dev.devcluster.cluster import DevCluster
from kube_vgpu.webhook.config import DEFAULT_DEVICE_PLUGIN_USERNAME, DEFAULT_EXTENDER_USERNAME
from kube_vgpu.webhook.policies import (
    DEVICE_PLUGIN_NODES_POLICY,
    DEVICE_PLUGIN_PODS_POLICY,
    NODE_NAME_EXTRA,
    POD_ANNOTATIONS_POLICY,
    QUEUE_LABEL_POLICY,
)

pytestmark = pytest.mark.e2e

TENANT = "e2e-tenant"
PAUSE = "registry.k8s.io/pause:3.10"


def as_user(cluster: DevCluster, user: str, *, node_name: str | None = None) -> Any:
    """CoreV1Api acting as `user` (Impersonate-User; a ServiceAccount user gets its account's groups), with the
    token's node-name claim when `node_name` is given (Impersonate-Extra-<key>, the key URL-escaped)."""
    api = cluster.api_client(pool_size=2)
    api.set_default_header("Impersonate-User", user)
    if node_name is not None:
        api.set_default_header("Impersonate-Extra-" + NODE_NAME_EXTRA.replace("/", "%2f"), node_name)
    return k8s_client.CoreV1Api(api)


def from_kubeconfig(path: Any) -> Any:
    return k8s_client.CoreV1Api(k8s_config.new_client_from_config(config_file=str(path)))


def refusal(call: Callable[[], Any]) -> str:
    """The API server's message refusing the call (the test fails if it is accepted)."""
    try:
        call()
    except ApiException as exc:
        assert exc.status == 403, exc
        message: str = json.loads(exc.body)["message"]
        return message
    raise AssertionError("the API server accepted what it should refuse")


def pod_on(name: str, node: str, **metadata: Any) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, **metadata},
            "spec": {"nodeName": node, "containers": [{"name": "main", "image": PAUSE}],
                     "terminationGracePeriodSeconds": 0}}


def plain_pod(name: str, **metadata: Any) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, **metadata},
            "spec": {"containers": [{"name": "main", "image": PAUSE}], "terminationGracePeriodSeconds": 0}}


def read_pod(cluster: DevCluster, namespace: str, name: str) -> dict[str, Any]:
    pod: dict[str, Any] = json.loads(cluster.core.read_namespaced_pod(name, namespace, _preload_content=False).data)
    return pod


def read_node(cluster: DevCluster, name: str) -> dict[str, Any]:
    node: dict[str, Any] = json.loads(cluster.core.read_node(name, _preload_content=False).data)
    return node


def grant(cluster: DevCluster, namespace: str, name: str, subject: dict[str, str], rules: list[dict[str, Any]]) -> None:
    rbac: Any = k8s_client.RbacAuthorizationV1Api(cluster.api)
    rbac.create_namespaced_role(namespace, {"metadata": {"name": name}, "rules": rules}, _preload_content=False)
    rbac.create_namespaced_role_binding(namespace, {
        "metadata": {"name": name}, "subjects": [subject],
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name}}, _preload_content=False)


def grant_tenant(cluster: DevCluster, namespace: str) -> Any:
    """A tenant who may create, patch and bind pods (and patch their status) in the namespace: more than tenants
    usually get, so that only the policies stand in the way."""
    grant(cluster, namespace, "e2e-tenant", {"kind": "User", "name": TENANT, "apiGroup": "rbac.authorization.k8s.io"},
          [{"apiGroups": [""], "resources": ["pods", "pods/status", "pods/binding"],
            "verbs": ["get", "create", "patch", "update", "delete"]}])
    return as_user(cluster, TENANT)


def eventually_refused(call: Callable[[], Any], needle: str, timeout_s: float = 15.0) -> str:
    """RBAC objects and namespace labels reach the authorizer's and the policies' caches a moment after they are
    written: retry until the refusal names `needle`."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            call()
            last = "accepted"
        except ApiException as exc:
            last = str(json.loads(exc.body).get("message"))
            if exc.status == 403 and needle in last:
                return last
        assert time.monotonic() < deadline, f"still not refused by {needle}: {last}"
        time.sleep(0.2)


def eventually_allowed(call: Callable[[], Any], timeout_s: float = 15.0) -> None:
    """A Role reaches the authorizer's cache a moment after it is written: retry while RBAC (not a policy) refuses."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            call()
            return
        except ApiException as exc:
            message = str(json.loads(exc.body).get("message"))
            assert exc.status == 403 and "ValidatingAdmissionPolicy" not in message, message
            assert time.monotonic() < deadline, message
            time.sleep(0.2)


# ---------------------------------------------------------------------------------------------
# The device plugin: its own node, its own keys
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def two_nodes(dev_cluster: DevCluster, gpu_nodes: Any, e2e_namespace: str) -> tuple[str, str]:
    """Nodes A and B with one (non-GPU, never scheduled: nodeName set) pod each, `on-a` and `on-b`."""
    node_a, node_b = gpu_nodes(2, gpus=2).names
    for name, node in (("on-a", node_a), ("on-b", node_b)):
        pod = pod_on(name, node, labels={"team": "a"}, annotations={"note": "n"})
        dev_cluster.core.create_namespaced_pod(e2e_namespace, pod, _preload_content=False)
    return node_a, node_b


def test_the_device_plugin_claims_only_pods_on_its_own_node(
    dev_cluster: DevCluster, e2e_namespace: str, two_nodes: tuple[str, str]
) -> None:
    node_a, node_b = two_nodes
    plugin_a = as_user(dev_cluster, DEFAULT_DEVICE_PLUGIN_USERNAME, node_name=node_a)
    claim = {"metadata": {"annotations": {protocol.POD_ALLOCATION_ANNOTATION: '{"v":1,"containers":{}}'}}}
    plugin_a.patch_namespaced_pod("on-a", e2e_namespace, claim, _preload_content=False)
    assert protocol.POD_ALLOCATION_ANNOTATION in read_pod(dev_cluster, e2e_namespace, "on-a")["metadata"]["annotations"]
    release = {"metadata": {"annotations": {protocol.POD_ALLOCATION_ANNOTATION: None}}}
    plugin_a.patch_namespaced_pod("on-a", e2e_namespace, release, _preload_content=False)  # _release undoes claims

    message = refusal(lambda: plugin_a.patch_namespaced_pod("on-b", e2e_namespace, claim, _preload_content=False))
    assert DEVICE_PLUGIN_PODS_POLICY in message
    assert f"on node {node_a} may update only pods bound to that node" in message and f"bound to {node_b}" in message
    # without the claim: refused, whichever the pod
    unbound = as_user(dev_cluster, DEFAULT_DEVICE_PLUGIN_USERNAME)
    message = refusal(lambda: unbound.patch_namespaced_pod("on-a", e2e_namespace, claim, _preload_content=False))
    assert f"no {NODE_NAME_EXTRA} claim" in message
    # the same with real tokens: the dev cluster's unbound one, and one bound to node A
    unbound_token = from_kubeconfig(dev_cluster.device_plugin_kubeconfig)
    message = refusal(lambda: unbound_token.patch_namespaced_pod("on-a", e2e_namespace, claim, _preload_content=False))
    assert f"no {NODE_NAME_EXTRA} claim" in message
    bound_token = from_kubeconfig(dev_cluster.device_plugin_kubeconfig_for(node_a))
    bound_token.patch_namespaced_pod("on-a", e2e_namespace, claim, _preload_content=False)
    refusal(lambda: bound_token.patch_namespaced_pod("on-b", e2e_namespace, claim, _preload_content=False))


def test_a_device_plugin_pods_own_token_names_its_node(
    dev_cluster: DevCluster, e2e_namespace: str, two_nodes: tuple[str, str], tmp_path: Path
) -> None:
    """What kubelet mounts into a DaemonSet pod: a token bound to the pod, which the API server (1.30+) makes name
    the pod's node too. Requested here as kubelet does (TokenRequest bound to a pod of the account on node A)."""
    node_a, _ = two_nodes
    pod = pod_on(f"device-plugin-{e2e_namespace}"[:63], node_a)
    pod["spec"]["serviceAccountName"] = "kube-vgpu-device-plugin"
    created = json.loads(dev_cluster.core.create_namespaced_pod("kube-vgpu", pod, _preload_content=False).data)
    try:
        reference = {"apiVersion": "v1", "kind": "Pod", "name": created["metadata"]["name"],
                     "uid": created["metadata"]["uid"]}
        path = tmp_path / "pod-token.kubeconfig"
        dev_cluster.write_token_kubeconfig("kube-vgpu-device-plugin", path, bound_to=reference)
        api = k8s_config.new_client_from_config(config_file=str(path))
        review: Any = k8s_client.AuthenticationV1Api(api).create_self_subject_review(
            {"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"}, _preload_content=False)
        user = json.loads(review.data)["status"]["userInfo"]
        assert user["username"] == DEFAULT_DEVICE_PLUGIN_USERNAME and user["extra"][NODE_NAME_EXTRA] == [node_a]
        plugin: Any = k8s_client.CoreV1Api(api)
        claim = {"metadata": {"annotations": {protocol.POD_ALLOCATION_ANNOTATION: "{}"}}}
        plugin.patch_namespaced_pod("on-a", e2e_namespace, claim, _preload_content=False)
        refusal(lambda: plugin.patch_namespaced_pod("on-b", e2e_namespace, claim, _preload_content=False))
    finally:
        dev_cluster.core.delete_namespaced_pod(created["metadata"]["name"], "kube-vgpu", grace_period_seconds=0,
                                               _preload_content=False)


@pytest.mark.parametrize(("change", "expected"), [
    ({"spec": {"containers": [{"name": "main", "image": "evil.example/miner:1"}]}}, "may not change a pod's spec"),
    ({"metadata": {"labels": {"team": "b"}}}, "may not change a pod's labels"),
    ({"metadata": {"labels": {protocol.LABEL_KUEUE_QUEUE_NAME: "free"}}}, "may not change a pod's labels"),
    ({"metadata": {"annotations": {"note": "changed"}}}, "this update changes note"),
    ({"metadata": {"annotations": {"note": None}}}, "this update changes note"),
    ({"metadata": {"annotations": {protocol.POD_ASSIGNMENT_ANNOTATION: '{"v":1}'}}},
     f"this update changes {protocol.POD_ASSIGNMENT_ANNOTATION}"),
    ({"metadata": {"annotations": {protocol.POD_ADMITTED_ANNOTATION: protocol.ADMISSION_MARK_VALUE}}},
     f"this update changes {protocol.POD_ADMITTED_ANNOTATION}"),
    ({"metadata": {"finalizers": ["e2e.kube-vgpu.io/hold"]}}, "may not change a pod's finalizers"),
], ids=["image", "label", "queue-label", "annotation", "annotation-removed", "forged-assignment", "admission-mark",
        "finalizer"])
def test_the_device_plugin_changes_nothing_else_on_a_pod_of_its_node(
    dev_cluster: DevCluster, e2e_namespace: str, two_nodes: tuple[str, str], change: dict[str, Any], expected: str
) -> None:
    plugin_a = as_user(dev_cluster, DEFAULT_DEVICE_PLUGIN_USERNAME, node_name=two_nodes[0])
    # even together with the one annotation it may write
    change.setdefault("metadata", {}).setdefault("annotations", {})[protocol.POD_ALLOCATION_ANNOTATION] = "{}"
    message = refusal(lambda: plugin_a.patch_namespaced_pod("on-a", e2e_namespace, change, _preload_content=False))
    assert DEVICE_PLUGIN_PODS_POLICY in message and expected in message, message
    assert protocol.POD_ALLOCATION_ANNOTATION not in (
        read_pod(dev_cluster, e2e_namespace, "on-a")["metadata"].get("annotations") or {})


def test_the_device_plugin_publishes_only_its_own_node(dev_cluster: DevCluster, gpu_nodes: Any) -> None:
    node_a, node_b = gpu_nodes(2, gpus=2).names
    plugin_a = as_user(dev_cluster, DEFAULT_DEVICE_PLUGIN_USERNAME, node_name=node_a)
    inventory = read_node(dev_cluster, node_a)["metadata"]["annotations"][protocol.NODE_INVENTORY_ANNOTATION]
    publish = {"metadata": {
        "annotations": {protocol.NODE_INVENTORY_ANNOTATION: inventory,
                        protocol.NODE_HEARTBEAT_ANNOTATION: "2030-01-01T00:00:00Z"},
        "labels": {protocol.LABEL_GPU_COUNT: "2", protocol.LABEL_GPU_PRODUCT: "Some-GPU",
                   protocol.LABEL_LIMITER: "v2-0123456789ab"}}}
    plugin_a.patch_node(node_a, publish, _preload_content=False)
    node = read_node(dev_cluster, node_a)
    assert node["metadata"]["annotations"][protocol.NODE_HEARTBEAT_ANNOTATION] == "2030-01-01T00:00:00Z"
    assert node["metadata"]["labels"][protocol.LABEL_GPU_PRODUCT] == "Some-GPU"
    # a GPU label removed (the publisher removes its labels when the node has no GPU any more)
    plugin_a.patch_node(node_a, {"metadata": {"labels": {protocol.LABEL_GPU_MEMORY_MIB: None}}}, _preload_content=False)
    # the limiter label removed (the installed library went missing or corrupt), and set back as installed
    plugin_a.patch_node(node_a, {"metadata": {"labels": {protocol.LABEL_LIMITER: None}}}, _preload_content=False)
    plugin_a.patch_node(node_a, {"metadata": {"labels": {protocol.LABEL_LIMITER: protocol.LIMITER_LABEL_SIMULATED}}},
                        _preload_content=False)

    message = refusal(lambda: plugin_a.patch_node(node_b, publish, _preload_content=False))
    assert DEVICE_PLUGIN_NODES_POLICY in message and f"may update only that node, not {node_b}" in message
    refusals = {
        "taint": {"spec": {"taints": [{"key": "evil", "effect": "NoSchedule"}]}},
        "cordon": {"spec": {"unschedulable": True}},
        "other label": {"metadata": {"labels": {"node-role.kubernetes.io/control-plane": ""}}},
        "group label": {"metadata": {"labels": {"e2e.kube-vgpu.io/group": "moved"}}},
        "other annotation": {"metadata": {"annotations": {"example.com/note": "x"}}},
        "another kube-vgpu annotation": {"metadata": {"annotations": {protocol.ANNOTATION_PREFIX + "other": "x"}}},
    }
    for what, change in refusals.items():
        message = refusal(lambda change=change: plugin_a.patch_node(node_a, change, _preload_content=False))
        assert DEVICE_PLUGIN_NODES_POLICY in message, (what, message)
    unbound = as_user(dev_cluster, DEFAULT_DEVICE_PLUGIN_USERNAME)
    message = refusal(lambda: unbound.patch_node(node_a, publish, _preload_content=False))
    assert f"no {NODE_NAME_EXTRA} claim" in message


#: (verb, resource, subresource, namespace, allowed?) for the device plugin's ServiceAccount
DEVICE_PLUGIN_ACCESS = [
    ("patch", "pods", "", "team-a", True),
    ("list", "pods", "", "", True),
    ("get", "nodes", "", "", True),
    ("patch", "nodes", "", "", True),
    ("create", "events", "", "team-a", True),
    ("delete", "pods", "", "team-a", False),
    ("update", "pods", "", "team-a", False),
    ("create", "pods", "", "team-a", False),
    ("patch", "pods", "status", "team-a", False),
    ("update", "pods", "status", "team-a", False),
    ("patch", "pods", "ephemeralcontainers", "team-a", False),
    ("create", "pods", "eviction", "team-a", False),
    ("create", "pods", "binding", "team-a", False),
    ("patch", "nodes", "status", "", False),
    ("delete", "nodes", "", "", False),
    ("get", "secrets", "", "kube-vgpu", False),
    ("list", "secrets", "", "", False),
    ("get", "configmaps", "", "kube-system", False),
]


def test_rbac_grants_the_device_plugin_no_more_than_it_needs(dev_cluster: DevCluster) -> None:
    authorization: Any = k8s_client.AuthorizationV1Api(dev_cluster.api)
    wrong = []
    for verb, resource, subresource, namespace, allowed in DEVICE_PLUGIN_ACCESS:
        attributes = {"verb": verb, "resource": resource, "subresource": subresource, "namespace": namespace}
        review = {"apiVersion": "authorization.k8s.io/v1", "kind": "SubjectAccessReview",
                  "spec": {"user": DEFAULT_DEVICE_PLUGIN_USERNAME,
                           "groups": ["system:serviceaccounts", "system:serviceaccounts:kube-vgpu",
                                      "system:authenticated"],
                           "extra": {NODE_NAME_EXTRA: ["base-a100-0"]},
                           "resourceAttributes": {k: v for k, v in attributes.items() if v}}}
        answer = json.loads(authorization.create_subject_access_review(review, _preload_content=False).data)
        if bool(answer["status"].get("allowed")) != allowed:
            wrong.append(f"{verb} {resource}/{subresource} in {namespace or '(all)'}: expected allowed={allowed}")
    assert not wrong, "\n".join(wrong)


# ---------------------------------------------------------------------------------------------
# The Kueue queue label
# ---------------------------------------------------------------------------------------------


def test_a_tenant_cannot_move_a_pod_to_another_queue(dev_cluster: DevCluster, e2e_namespace: str) -> None:
    tenant = grant_tenant(dev_cluster, e2e_namespace)
    queued = plain_pod("queued", labels={protocol.LABEL_KUEUE_QUEUE_NAME: "team", "app": "x"})
    eventually_allowed(lambda: tenant.create_namespaced_pod(e2e_namespace, queued, _preload_content=False))
    tenant.create_namespaced_pod(e2e_namespace, plain_pod("unqueued"), _preload_content=False)
    label = protocol.LABEL_KUEUE_QUEUE_NAME
    for name, change in (("queued", None), ("queued", "other-team"), ("unqueued", "team")):
        patch = {"metadata": {"labels": {label: change}}}
        message = refusal(lambda name=name, patch=patch: tenant.patch_namespaced_pod(
            name, e2e_namespace, patch, _preload_content=False))
        assert QUEUE_LABEL_POLICY in message and f"{label} label is fixed when the pod is created" in message
    # nor through the status subresource, which may change a pod's labels too
    message = refusal(lambda: tenant.patch_namespaced_pod_status(
        "queued", e2e_namespace, {"metadata": {"labels": {label: None}}}, _preload_content=False))
    assert QUEUE_LABEL_POLICY in message
    # every other label is the tenant's
    tenant.patch_namespaced_pod("queued", e2e_namespace, {"metadata": {"labels": {"app": "y"}}},
                                _preload_content=False)
    assert read_pod(dev_cluster, e2e_namespace, "queued")["metadata"]["labels"][label] == "team"
    # kube-vgpu's extender may (its RBAC has no pod patch: a test-only Role gives it one here)
    grant(dev_cluster, e2e_namespace, "e2e-extender-patch",
          {"kind": "ServiceAccount", "name": "kube-vgpu-extender", "namespace": "kube-vgpu"},
          [{"apiGroups": [""], "resources": ["pods"], "verbs": ["patch"]}])
    extender = as_user(dev_cluster, DEFAULT_EXTENDER_USERNAME)
    eventually_allowed(lambda: extender.patch_namespaced_pod(
        "queued", e2e_namespace, {"metadata": {"labels": {label: "moved"}}}, _preload_content=False))
    assert read_pod(dev_cluster, e2e_namespace, "queued")["metadata"]["labels"][label] == "moved"


# ---------------------------------------------------------------------------------------------
# The admission mark where the webhook does not look
# ---------------------------------------------------------------------------------------------


def test_no_admission_mark_in_a_namespace_the_webhook_skips(dev_cluster: DevCluster, e2e_namespace: str) -> None:
    dev_cluster.core.patch_namespace(
        e2e_namespace, {"metadata": {"labels": {protocol.LABEL_WEBHOOK: protocol.LABEL_WEBHOOK_DISABLED}}},
        _preload_content=False)
    tenant = grant_tenant(dev_cluster, e2e_namespace)
    marked = plain_pod("marked", annotations={protocol.POD_ADMITTED_ANNOTATION: protocol.ADMISSION_MARK_VALUE})
    # a dry run until the namespace label and the Role are in the API server's caches: nothing gets created
    eventually_refused(
        lambda: tenant.create_namespaced_pod(e2e_namespace, marked, dry_run="All", _preload_content=False),
        "does not see namespace")
    message = refusal(lambda: tenant.create_namespaced_pod(e2e_namespace, marked, _preload_content=False))
    assert POD_ANNOTATIONS_POLICY in message and f"may not carry {protocol.POD_ADMITTED_ANNOTATION}" in message
    # any kube-vgpu.io/ annotation
    forged = plain_pod("forged", annotations={protocol.POD_ASSIGNMENT_ANNOTATION: '{"v":1}'})
    message = refusal(lambda: tenant.create_namespaced_pod(e2e_namespace, forged, _preload_content=False))
    assert protocol.POD_ASSIGNMENT_ANNOTATION in message
    # a pod without one is created as usual
    tenant.create_namespaced_pod(e2e_namespace, plain_pod("plain", annotations={"note": "n"}), _preload_content=False)
    # ... and cannot be given one afterwards: not by patch, not through its status, not through a Binding
    add_mark = {"metadata": {"annotations": {protocol.POD_ADMITTED_ANNOTATION: protocol.ADMISSION_MARK_VALUE}}}
    message = refusal(lambda: tenant.patch_namespaced_pod("plain", e2e_namespace, add_mark, _preload_content=False))
    assert POD_ANNOTATIONS_POLICY in message and f"this update changes {protocol.POD_ADMITTED_ANNOTATION}" in message
    message = refusal(lambda: tenant.patch_namespaced_pod_status(
        "plain", e2e_namespace, add_mark, _preload_content=False))
    assert POD_ANNOTATIONS_POLICY in message
    binding = {"apiVersion": "v1", "kind": "Binding",
               "metadata": {"name": "plain", "annotations": {protocol.POD_ADMITTED_ANNOTATION: "v1"}},
               "target": {"apiVersion": "v1", "kind": "Node", "name": "base-t4-0"}}
    message = refusal(lambda: tenant.create_namespaced_pod_binding(
        "plain", e2e_namespace, binding, _preload_content=False))
    assert POD_ANNOTATIONS_POLICY in message and "Binding carries" in message
    pod = read_pod(dev_cluster, e2e_namespace, "plain")
    assert not pod["spec"].get("nodeName") and pod["metadata"]["annotations"] == {"note": "n"}
    # the admin is held to the same rule (only kube-vgpu's components write these annotations)
    message = refusal(lambda: dev_cluster.core.create_namespaced_pod(
        e2e_namespace, {**marked, "metadata": {**marked["metadata"], "name": "by-admin"}}, _preload_content=False))
    assert POD_ANNOTATIONS_POLICY in message
