"""The rendered installs carry the ValidatingAdmissionPolicies and their bindings, naming the ServiceAccounts the
components really run as (what the policies allow or refuse is tests/e2e/test_admission_policies.py's job)."""

from __future__ import annotations

import pytest

from kube_vgpu.webhook.policies import (
    DEVICE_PLUGIN_NODES_POLICY,
    DEVICE_PLUGIN_PODS_POLICY,
    POD_ANNOTATIONS_POLICY,
    POLICY_NAMES,
    QUEUE_LABEL_POLICY,
)
from tests.manifests.render import INSTALLABLE, NAMESPACE, find, one, pod_spec, render


def username(objects: list, kind: str, workload: str) -> str:
    return f"system:serviceaccount:{NAMESPACE}:{pod_spec(one(objects, kind, workload))['serviceAccountName']}"


@pytest.mark.parametrize("kustomization", ["base", *INSTALLABLE])
def test_every_policy_is_rendered_with_a_deny_binding(kustomization: str) -> None:
    objects = render(kustomization)
    assert {p["metadata"]["name"] for p in find(objects, "ValidatingAdmissionPolicy")} == set(POLICY_NAMES)
    bindings = find(objects, "ValidatingAdmissionPolicyBinding")
    assert {b["spec"]["policyName"] for b in bindings} == set(POLICY_NAMES) and len(bindings) == len(POLICY_NAMES)
    for binding in bindings:
        assert binding["spec"]["validationActions"] == ["Deny"]
    for policy in find(objects, "ValidatingAdmissionPolicy"):
        assert policy["apiVersion"] == "admissionregistration.k8s.io/v1"
        assert policy["spec"]["failurePolicy"] == "Fail"
        assert "namespace" not in policy["metadata"]  # cluster-scoped: no kustomize namespace slipped in


@pytest.mark.parametrize("overlay", INSTALLABLE)
def test_the_policies_name_the_service_accounts_the_components_run_as(overlay: str) -> None:
    objects = render(overlay)
    device_plugin = username(objects, "DaemonSet", "kube-vgpu-device-plugin")
    extender = username(objects, "Deployment", "kube-vgpu-scheduler")  # the extender and kube-scheduler's Pod
    assert one(objects, "ServiceAccount", "kube-vgpu-device-plugin")["metadata"]["namespace"] == NAMESPACE
    for name in (DEVICE_PLUGIN_PODS_POLICY, DEVICE_PLUGIN_NODES_POLICY):
        (condition,) = one(objects, "ValidatingAdmissionPolicy", name)["spec"]["matchConditions"]
        assert condition["expression"] == f"request.userInfo.username == '{device_plugin}'"
    for name in (POD_ANNOTATIONS_POLICY, QUEUE_LABEL_POLICY):
        (condition,) = one(objects, "ValidatingAdmissionPolicy", name)["spec"]["matchConditions"]
        assert condition["expression"].startswith("!(request.userInfo.username in [")
        assert f"'{device_plugin}'" in condition["expression"] and f"'{extender}'" in condition["expression"]
    # the webhook's UPDATE guard trusts the same identities
    [guard] = [w for w in one(objects, "MutatingWebhookConfiguration", "kube-vgpu-webhook")["webhooks"]
               if w["rules"][0]["operations"] == ["UPDATE"]]
    assert guard["matchConditions"][0]["expression"] == one(
        objects, "ValidatingAdmissionPolicy", QUEUE_LABEL_POLICY)["spec"]["matchConditions"][0]["expression"]
