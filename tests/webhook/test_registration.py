"""The MutatingWebhookConfiguration builder and manifests/base/webhook: the settings the issue asks for, and the
YAML agreeing with the code (flags the CLI accepts, ports and selectors that line up)."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import pytest
import yaml

from kube_vgpu.cli import build_parser
from kube_vgpu.webhook.registration import ServiceReference, mutating_webhook_configuration

MANIFESTS = Path(__file__).resolve().parents[2] / "manifests" / "base" / "webhook"
PEM = b"-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"


def test_url_registration_for_the_dev_cluster() -> None:
    config = mutating_webhook_configuration(PEM, url="https://127.0.0.1:9443/mutate")
    assert config["apiVersion"] == "admissionregistration.k8s.io/v1"
    assert config["kind"] == "MutatingWebhookConfiguration"
    create, update = config["webhooks"]
    for hook in (create, update):
        assert hook["clientConfig"] == {
            "url": "https://127.0.0.1:9443/mutate",
            "caBundle": base64.b64encode(PEM).decode(),
        }
        assert hook["admissionReviewVersions"] == ["v1"]
        assert hook["sideEffects"] == "None"
        assert hook["failurePolicy"] == "Fail"
        assert hook["timeoutSeconds"] <= 10
        assert hook["rules"] == [
            {
                "apiGroups": [""],
                "apiVersions": ["v1"],
                "operations": [hook["rules"][0]["operations"][0]],
                "resources": ["pods"],
                "scope": "Namespaced",
            }
        ]
        assert hook["namespaceSelector"] == {
            "matchExpressions": [
                {"key": "kubernetes.io/metadata.name", "operator": "NotIn", "values": ["kube-system", "kube-vgpu"]},
                {"key": "kube-vgpu.io/webhook", "operator": "NotIn", "values": ["disabled"]},
            ]
        }
        assert "objectSelector" not in hook  # a pod label must not be able to opt a GPU pod out
    assert create["rules"][0]["operations"] == ["CREATE"] and create["reinvocationPolicy"] == "IfNeeded"
    assert update["rules"][0]["operations"] == ["UPDATE"] and update["reinvocationPolicy"] == "Never"
    # only GPU pods and pods carrying internal annotations reach the CREATE webhook, so an outage blocks nothing else
    (condition,) = create["matchConditions"]
    assert condition["name"] == "gpu-pods-and-internal-annotations"
    for needle in ("object.spec.containers.exists", "object.spec.initContainers", "'nvidia.com/gpucores'",
                   "startsWith('kube-vgpu.io/')"):
        assert needle in condition["expression"]
    # only updates that add, change or remove an internal annotation, from anyone but our own components, reach the
    # UPDATE webhook: an outage cannot block a label change, a finalizer removal or a scheduling gate (issue 20, 5)
    assert update["matchConditions"] == [
        {
            "name": "not-from-kube-vgpu-components",
            "expression": "!(request.userInfo.username in ["
            "'system:serviceaccount:kube-vgpu:kube-vgpu-device-plugin', "
            "'system:serviceaccount:kube-vgpu:kube-vgpu-extender'])",
        },
        {
            "name": "changes-internal-annotations",
            "expression": "(has(object.metadata.annotations) && object.metadata.annotations.exists(k, "
            "k.startsWith('kube-vgpu.io/') && !(has(oldObject.metadata.annotations) && "
            "k in oldObject.metadata.annotations && oldObject.metadata.annotations[k] == "
            "object.metadata.annotations[k]))) || "
            "(has(oldObject.metadata.annotations) && oldObject.metadata.annotations.exists(k, "
            "k.startsWith('kube-vgpu.io/') && !(has(object.metadata.annotations) && "
            "k in object.metadata.annotations && object.metadata.annotations[k] == "
            "oldObject.metadata.annotations[k])))",
        },
    ]


def test_service_registration_and_options() -> None:
    config = mutating_webhook_configuration(
        PEM.decode(),
        service=ServiceReference("gpu-system", "hook", 8443),
        excluded_namespaces=("kube-system", "gpu-system"),
        timeout_seconds=3,
        update_failure_policy="Ignore",
        trusted_usernames=["it's-me"],
    )
    create, update = config["webhooks"]
    assert create["clientConfig"]["service"] == {
        "namespace": "gpu-system",
        "name": "hook",
        "path": "/mutate",
        "port": 8443,
    }
    assert create["namespaceSelector"]["matchExpressions"][0]["values"] == ["kube-system", "gpu-system"]
    assert (create["timeoutSeconds"], create["failurePolicy"], update["failurePolicy"]) == (3, "Fail", "Ignore")
    assert update["matchConditions"][0]["expression"] == "!(request.userInfo.username in ['it\\'s-me'])"
    no_trust = mutating_webhook_configuration(PEM, service=ServiceReference(), trusted_usernames=())
    assert [c["name"] for c in no_trust["webhooks"][1]["matchConditions"]] == ["changes-internal-annotations"]
    assert (
        "caBundle" not in mutating_webhook_configuration(b"", service=ServiceReference())["webhooks"][0]["clientConfig"]
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({}, "exactly one of url or service"),
        ({"url": "https://x/mutate", "service": ServiceReference()}, "exactly one of url or service"),
        ({"url": "http://127.0.0.1/mutate"}, "HTTPS only"),
        ({"url": "https://x/mutate", "timeout_seconds": 31}, "between 1 and 30"),
    ],
)
def test_registration_refuses_bad_options(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        mutating_webhook_configuration(PEM, **kwargs)


# ---------------------------------------------------------------------------------------------
# manifests/base/webhook
# ---------------------------------------------------------------------------------------------


def _objects() -> dict[str, dict[str, Any]]:
    found = {}
    for path in sorted(MANIFESTS.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        for document in yaml.safe_load_all(path.read_text()):
            found[document["kind"]] = document
    return found


def test_kustomization_lists_every_file() -> None:
    kustomization = yaml.safe_load((MANIFESTS / "kustomization.yaml").read_text())
    files = {path.name for path in MANIFESTS.glob("*.yaml")} - {"kustomization.yaml"}
    assert sorted(kustomization["resources"]) == sorted(files)


def test_webhook_configuration_yaml_is_what_the_code_builds() -> None:
    assert _objects()["MutatingWebhookConfiguration"] == mutating_webhook_configuration(b"", service=ServiceReference())


def test_deployment_is_highly_available_and_its_flags_exist() -> None:
    objects = _objects()
    deployment, service, pdb = objects["Deployment"], objects["Service"], objects["PodDisruptionBudget"]
    assert deployment["spec"]["replicas"] == 2
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    pod_spec = deployment["spec"]["template"]["spec"]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"] == labels
    assert service["spec"]["selector"] == labels and pdb["spec"]["selector"]["matchLabels"] == labels
    assert pdb["spec"]["minAvailable"] == 1
    (container,) = pod_spec["containers"]
    args = build_parser(container["args"]).parse_args(container["args"])  # the real CLI accepts every flag
    assert (args.command, args.port) == ("webhook", 8443)
    (port,) = container["ports"]
    assert port == {"name": "https", "containerPort": 8443, "protocol": "TCP"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "https", "scheme": "HTTPS"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "https", "scheme": "HTTPS"}
    assert 0 < args.shutdown_delay_seconds < pod_spec.get("terminationGracePeriodSeconds", 30)
    # the Service the MutatingWebhookConfiguration names reaches that port
    reference = objects["MutatingWebhookConfiguration"]["webhooks"][0]["clientConfig"]["service"]
    assert (reference["namespace"], reference["name"]) == (
        service["metadata"]["namespace"],
        service["metadata"]["name"],
    )
    assert service["spec"]["ports"] == [
        {"name": "https", "port": reference["port"], "targetPort": "https", "protocol": "TCP"}
    ]
    # the certificate files the flags name are in the mounted Secret
    (mount,) = container["volumeMounts"]
    assert (
        args.tls_cert_file == mount["mountPath"] + "/tls.crt" and args.tls_key_file == mount["mountPath"] + "/tls.key"
    )
    (volume,) = pod_spec["volumes"]
    assert volume == {"name": mount["name"], "secret": {"secretName": "kube-vgpu-webhook-tls"}}
    # hardened: non-root, read-only root; its token only reads pods' owners (tests/manifests/test_rbac.py)
    assert pod_spec.get("automountServiceAccountToken", True) is True
    assert pod_spec["serviceAccountName"] == objects["ServiceAccount"]["metadata"]["name"]
    assert pod_spec["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }
    assert container["resources"]["requests"] and container["resources"]["limits"]["memory"]


def test_network_policy_admits_only_the_api_server_to_the_webhook_port() -> None:
    """Issue 20, item 5: pods cannot reach the webhook at all; the API server (not a pod) reaches its port only."""
    objects = _objects()
    policy, deployment = objects["NetworkPolicy"], objects["Deployment"]
    assert policy["metadata"]["namespace"] == deployment["metadata"]["namespace"]
    assert policy["spec"]["podSelector"] == {"matchLabels": deployment["spec"]["template"]["metadata"]["labels"]}
    assert policy["spec"]["policyTypes"] == ["Ingress"]  # egress: the webhook makes no calls, left alone
    (rule,) = policy["spec"]["ingress"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    (port,) = container["ports"]
    assert rule["ports"] == [{"port": port["name"], "protocol": "TCP"}]
    # address peers only: no podSelector / namespaceSelector, so no pod is admitted by label, and each peer
    # excepts the pod network so no pod is admitted by address either
    assert [sorted(peer) for peer in rule["from"]] == [["ipBlock"], ["ipBlock"]]
    blocks = {peer["ipBlock"]["cidr"]: peer["ipBlock"]["except"] for peer in rule["from"]}
    assert set(blocks) == {"0.0.0.0/0", "::/0"}
    assert all(blocks.values())
