"""The ValidatingAdmissionPolicy builder (webhook.policies) and manifests/base/admission: the YAML is what the code
builds, the policies name the identities and keys the components really use, and the namespaces they guard are
exactly those the webhook's namespaceSelector leaves out. What the policies refuse and allow is proved against the
real API server (tests/e2e/test_admission_policies.py)."""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any

import pytest
import yaml

from kube_vgpu import protocol
from kube_vgpu.deviceplugin.publisher import OWNED_LABELS, inventory_annotations
from kube_vgpu.webhook.config import DEFAULT_DEVICE_PLUGIN_USERNAME, DEFAULT_TRUSTED_USERNAMES
from kube_vgpu.webhook.policies import (
    DEVICE_PLUGIN_NODE_ANNOTATIONS,
    DEVICE_PLUGIN_NODE_LABELS,
    DEVICE_PLUGIN_NODES_POLICY,
    DEVICE_PLUGIN_POD_ANNOTATIONS,
    DEVICE_PLUGIN_PODS_POLICY,
    NODE_NAME_EXTRA,
    POD_ANNOTATIONS_POLICY,
    POLICY_NAMES,
    QUEUE_LABEL_POLICY,
    admission_policies,
)
from kube_vgpu.webhook.registration import ServiceReference, mutating_webhook_configuration

ADMISSION = Path(__file__).resolve().parents[2] / "manifests" / "base" / "admission"


def policies() -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in admission_policies() if d["kind"] == "ValidatingAdmissionPolicy"}


def test_the_manifest_is_what_the_code_builds() -> None:
    documents = [d for d in yaml.safe_load_all((ADMISSION / "validatingadmissionpolicies.yaml").read_text()) if d]
    assert documents == admission_policies()
    kustomization = yaml.safe_load((ADMISSION / "kustomization.yaml").read_text())
    assert kustomization["resources"] == ["validatingadmissionpolicies.yaml"]


def test_every_policy_fails_closed_and_is_bound_to_deny() -> None:
    documents = admission_policies()
    assert [d["metadata"]["name"] for d in documents if d["kind"] == "ValidatingAdmissionPolicy"] == [
        DEVICE_PLUGIN_PODS_POLICY, DEVICE_PLUGIN_NODES_POLICY, QUEUE_LABEL_POLICY, POD_ANNOTATIONS_POLICY]
    assert set(POLICY_NAMES) == set(policies())
    for policy, binding in zip(documents[::2], documents[1::2], strict=True):
        assert policy["apiVersion"] == binding["apiVersion"] == "admissionregistration.k8s.io/v1"
        assert policy["spec"]["failurePolicy"] == "Fail"
        assert binding["kind"] == "ValidatingAdmissionPolicyBinding"
        assert binding["metadata"]["name"] == binding["spec"]["policyName"] == policy["metadata"]["name"]
        assert binding["spec"]["validationActions"] == ["Deny"]
        assert "paramRef" not in binding["spec"] and "matchResources" not in binding["spec"]
        for validation in policy["spec"]["validations"]:
            assert validation["reason"] == "Forbidden"
            assert validation.get("message") or validation.get("messageExpression")


def test_the_device_plugin_policies_hold_its_identity_to_the_node_its_token_names() -> None:
    for name, resource in ((DEVICE_PLUGIN_PODS_POLICY, "pods"), (DEVICE_PLUGIN_NODES_POLICY, "nodes")):
        spec = policies()[name]["spec"]
        # UPDATE (patch is an UPDATE to admission) of the main resource; RBAC grants no subresource and no other verb
        assert spec["matchConstraints"]["resourceRules"] == [
            {"apiGroups": [""], "apiVersions": ["v1"], "operations": ["UPDATE"], "resources": [resource]}]
        assert spec["matchConditions"] == [{
            "name": "from-the-device-plugin",
            "expression": f"request.userInfo.username == '{DEFAULT_DEVICE_PLUGIN_USERNAME}'"}]
        (node_name,) = [v for v in spec["variables"] if v["name"] == "nodeName"]
        assert f"request.userInfo.extra['{NODE_NAME_EXTRA}'][0]" in node_name["expression"]
        expressions = [v["expression"] for v in spec["validations"]]
        assert expressions[0] == "variables.nodeName != ''"
        assert "(object.spec) == (oldObject.spec)" in expressions
    pods = " ".join(v["expression"] for v in policies()[DEVICE_PLUGIN_PODS_POLICY]["spec"]["validations"])
    assert "object.spec.nodeName == variables.nodeName" in pods
    assert "(variables.newLabels) == (variables.oldLabels)" in pods
    nodes = " ".join(v["expression"] for v in policies()[DEVICE_PLUGIN_NODES_POLICY]["spec"]["validations"])
    assert "object.metadata.name == variables.nodeName" in nodes


def test_the_device_plugin_may_write_exactly_the_keys_it_writes() -> None:
    # deviceplugin/allocate.py claims (and releases) containers in this one annotation
    assert DEVICE_PLUGIN_POD_ANNOTATIONS == (protocol.POD_ALLOCATION_ANNOTATION,)
    # deviceplugin/publisher.py: the node annotations and labels it writes
    inventory = protocol.NodeInventory(gpus=())
    assert set(DEVICE_PLUGIN_NODE_ANNOTATIONS) == set(inventory_annotations(inventory, dt.datetime.now(dt.UTC)))
    # the GPU labels, and the limiter label (set while the installed limiter is intact, deviceplugin/app.py)
    assert set(DEVICE_PLUGIN_NODE_LABELS) == {*OWNED_LABELS, protocol.LABEL_LIMITER}
    pods = " ".join(v.get("messageExpression", "") + v["expression"]
                    for v in policies()[DEVICE_PLUGIN_PODS_POLICY]["spec"]["validations"])
    assert f"['{protocol.POD_ALLOCATION_ANNOTATION}']" in pods
    nodes = " ".join(v["expression"] for v in policies()[DEVICE_PLUGIN_NODES_POLICY]["spec"]["validations"])
    assert "variables.changedLabels.all(k, k in ['nvidia.com/gpu.product', 'nvidia.com/gpu.count', " \
           "'nvidia.com/gpu.memory', 'kube-vgpu.io/limiter'])" in nodes
    assert "variables.changedAnnotations.all(k, k in ['kube-vgpu.io/gpu-inventory', 'kube-vgpu.io/gpu-heartbeat'])" \
           in nodes


def test_the_pod_guards_trust_exactly_the_webhooks_trusted_identities() -> None:
    webhook = mutating_webhook_configuration(b"", service=ServiceReference())
    (guard,) = [w for w in webhook["webhooks"] if w["rules"][0]["operations"] == ["UPDATE"]]
    trusted_condition = guard["matchConditions"][0]
    for name in (POD_ANNOTATIONS_POLICY, QUEUE_LABEL_POLICY):
        (condition,) = policies()[name]["spec"]["matchConditions"]
        assert condition == trusted_condition  # the same identities, the same CEL
    for username in DEFAULT_TRUSTED_USERNAMES:
        assert f"'{username}'" in trusted_condition["expression"]


def test_the_pod_guards_cover_every_way_to_write_pod_metadata() -> None:
    annotations = policies()[POD_ANNOTATIONS_POLICY]["spec"]
    rules = {(tuple(r["operations"]), tuple(r["resources"])) for r in annotations["matchConstraints"]["resourceRules"]}
    assert rules == {(("CREATE", "UPDATE"), ("pods",)), (("UPDATE",), ("pods/status",)),
                     (("CREATE",), ("pods/binding",))}
    queue = policies()[QUEUE_LABEL_POLICY]["spec"]
    assert [r["operations"] for r in queue["matchConstraints"]["resourceRules"]] == [["UPDATE"]]
    assert queue["matchConstraints"]["resourceRules"][0]["resources"] == ["pods", "pods/status"]
    assert f"'{protocol.LABEL_KUEUE_QUEUE_NAME}' in variables.newLabels" in queue["validations"][0]["expression"]


def test_the_mark_guard_mirrors_the_webhooks_namespace_selector() -> None:
    webhook = mutating_webhook_configuration(b"", service=ServiceReference())
    selectors = [w["namespaceSelector"] for w in webhook["webhooks"]]
    assert selectors[0] == selectors[1]
    (seen,) = [v["expression"] for v in policies()[POD_ANNOTATIONS_POLICY]["spec"]["variables"]
               if v["name"] == "webhookSeesNamespace"]
    for requirement in selectors[0]["matchExpressions"]:
        assert requirement["operator"] == "NotIn"
        values = ", ".join(f"'{value}'" for value in requirement["values"])
        assert (f"!(has(namespaceObject.metadata.labels) && '{requirement['key']}' in namespaceObject.metadata.labels "
                f"&& namespaceObject.metadata.labels['{requirement['key']}'] in [{values}])") in seen
    assert seen.count(" in [") == len(selectors[0]["matchExpressions"])
    # other namespaces, other trusted identities: one argument each, for both the webhook and the policies
    built = admission_policies(excluded_namespaces=("ops",), trusted_usernames=("system:serviceaccount:x:y",))
    custom = {d["metadata"]["name"]: d for d in built if d["kind"] == "ValidatingAdmissionPolicy"}
    assert "['ops']" in str(custom[POD_ANNOTATIONS_POLICY]["spec"]["variables"])
    assert "'system:serviceaccount:x:y'" in str(custom[QUEUE_LABEL_POLICY]["spec"]["matchConditions"])


@pytest.mark.parametrize("selector", [
    {"matchExpressions": [{"key": "a", "operator": "In", "values": ["b"]}]},
    {"matchLabels": {"a": "b"}, "matchExpressions": []},
])
def test_only_notin_selectors_are_mirrored(selector: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    from kube_vgpu.webhook import policies as module

    monkeypatch.setattr(module, "namespace_selector", lambda excluded: selector)
    with pytest.raises(ValueError, match="only NotIn"):
        admission_policies()
