"""The MutatingWebhookConfiguration that makes the API server call the webhook, as a plain dict.

One builder for every consumer: the dev cluster registers a URL (the webhook on localhost), manifests/ and the
`kube-vgpu certs --webhook-config-out` Job register a Service. Two webhooks share the one /mutate endpoint:

* CREATE of pods: validates and mutates. failurePolicy Fail, because a GPU pod admitted while we are down would run
  without limits and on the wrong scheduler (a silent limit escape, a known HAMi complaint). reinvocationPolicy
  IfNeeded: if a later webhook edits the pod (say, adds a container or env), we run again and patch what is missing.
* UPDATE of pods: guards kube-vgpu's internal annotations; never mutates. Two matchConditions keep every other
  update away from it, so a webhook outage blocks nothing else (a Job's finalizer removal, Kueue's scheduling-gate
  removal, ReplicaSet adoption, `kubectl label`): the update must add, change or remove a `kube-vgpu.io/`
  annotation (compared between oldObject and object), and must not come from kube-vgpu's own components (they
  write those annotations at bind and in Allocate, so an outage never stalls binding or container start).

Namespaces excluded: kube-system, our own (the webhook's pods must be creatable while the webhook is down, or it
could never come back), and any namespace labelled kube-vgpu.io/webhook=disabled. The opt-out is a namespace label
on purpose: a pod label would let a pod's author opt their own GPU pod out of the limits.
"""

from __future__ import annotations

import base64
import copy
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

from kube_vgpu.protocol import (
    ANNOTATION_PREFIX,
    GPU_RESOURCES,
    LABEL_WEBHOOK,
    LABEL_WEBHOOK_DISABLED,
    MIG_RESOURCE_PREFIX,
    RESOURCE_TASK_PRIORITY,
)
from kube_vgpu.webhook.config import DEFAULT_TRUSTED_USERNAMES

CONFIGURATION_NAME = "kube-vgpu-webhook"
MUTATE_WEBHOOK_NAME = "pods.mutate.kube-vgpu.io"
GUARD_WEBHOOK_NAME = "pods.guard.kube-vgpu.io"
MUTATE_PATH = "/mutate"
DEFAULT_NAMESPACE = "kube-vgpu"
DEFAULT_SERVICE_NAME = "kube-vgpu-webhook"
#: The API server's wait for one admission; we answer in milliseconds, this covers a cold connection and GC.
DEFAULT_TIMEOUT_SECONDS = 5
#: Matches the namespace name: set by the API server on every namespace since Kubernetes 1.21.
NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"
#: Namespaces the webhook never sees (besides those labelled kube-vgpu.io/webhook=disabled): kube-system, and our own,
#: whose pods must be creatable while the webhook is down.
DEFAULT_EXCLUDED_NAMESPACES = ("kube-system", DEFAULT_NAMESPACE)

FailurePolicy = Literal["Fail", "Ignore"]


@dataclass(frozen=True, slots=True)
class ServiceReference:
    namespace: str = DEFAULT_NAMESPACE
    name: str = DEFAULT_SERVICE_NAME
    port: int = 443
    path: str = MUTATE_PATH


def mutating_webhook_configuration(
    ca_bundle_pem: bytes | str,
    *,
    url: str | None = None,
    service: ServiceReference | None = None,
    name: str = CONFIGURATION_NAME,
    excluded_namespaces: tuple[str, ...] = DEFAULT_EXCLUDED_NAMESPACES,
    timeout_seconds: int = DEFAULT_TIMEOUT_SECONDS,
    update_failure_policy: FailurePolicy = "Fail",
    trusted_usernames: Iterable[str] = DEFAULT_TRUSTED_USERNAMES,
) -> dict[str, Any]:
    """The admissionregistration.k8s.io/v1 object. Give exactly one of `url` (https://host:port/mutate) or `service`.

    `ca_bundle_pem` is the PEM of the CA that signed the webhook's serving cert (an empty value leaves caBundle
    out, for cert-manager's CA injector to fill in)."""
    if (url is None) == (service is None):
        raise ValueError("give exactly one of url or service")
    if not 1 <= timeout_seconds <= 30:
        raise ValueError(f"timeout_seconds must be between 1 and 30 (the API server's limit), got {timeout_seconds}")
    client_config: dict[str, Any]
    if url is not None:
        if not url.startswith("https://"):
            raise ValueError(f"the API server calls webhooks over HTTPS only; got {url!r}")
        client_config = {"url": url}
    else:
        assert service is not None
        reference = {"namespace": service.namespace, "name": service.name, "path": service.path, "port": service.port}
        client_config = {"service": reference}
    pem = ca_bundle_pem.encode() if isinstance(ca_bundle_pem, str) else ca_bundle_pem
    if pem:
        client_config["caBundle"] = base64.b64encode(pem).decode()
    selector = namespace_selector(excluded_namespaces)

    def webhook(webhook_name: str, operation: str, failure_policy: FailurePolicy, reinvocation: str) -> dict[str, Any]:
        entry = {
            "name": webhook_name,
            "admissionReviewVersions": ["v1"],
            # copies: a YAML dump of shared dicts would show anchors and aliases
            "clientConfig": copy.deepcopy(client_config),
            "rules": [
                {
                    "apiGroups": [""],
                    "apiVersions": ["v1"],
                    "operations": [operation],
                    "resources": ["pods"],
                    "scope": "Namespaced",
                }
            ],
            "failurePolicy": failure_policy,
            "matchPolicy": "Equivalent",
            "namespaceSelector": copy.deepcopy(selector),
            "sideEffects": "None",
            "timeoutSeconds": timeout_seconds,
            "reinvocationPolicy": reinvocation,
        }
        if operation == "CREATE":
            # Only pods the webhook acts on are sent to it: with failurePolicy Fail, a webhook outage then
            # refuses GPU pods (which must not escape their limits) and never blocks anything else.
            entry["matchConditions"] = [{"name": "gpu-pods-and-internal-annotations", "expression": _CREATE_CONDITION}]
        if operation == "UPDATE":
            conditions = []
            if trusted:
                listed = ", ".join(cel_string(user) for user in trusted)
                expression = f"!(request.userInfo.username in [{listed}])"
                conditions.append({"name": "not-from-kube-vgpu-components", "expression": expression})
            conditions.append({"name": "changes-internal-annotations", "expression": _UPDATE_CONDITION})
            entry["matchConditions"] = conditions
        return entry

    trusted = sorted(trusted_usernames)

    return {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "MutatingWebhookConfiguration",
        "metadata": {
            "name": name,
            "labels": {"app.kubernetes.io/name": "kube-vgpu", "app.kubernetes.io/component": "webhook"},
        },
        "webhooks": [
            webhook(MUTATE_WEBHOOK_NAME, "CREATE", "Fail", "IfNeeded"),
            webhook(GUARD_WEBHOOK_NAME, "UPDATE", update_failure_policy, "Never"),
        ],
    }


def namespace_selector(excluded_namespaces: Iterable[str] = DEFAULT_EXCLUDED_NAMESPACES) -> dict[str, Any]:
    """The namespaces the webhook sees (both webhooks): every one but the excluded and the opted-out. The
    ValidatingAdmissionPolicies (webhook.policies) mirror it to guard the namespaces the webhook does not see."""
    return {
        "matchExpressions": [
            {"key": NAMESPACE_NAME_LABEL, "operator": "NotIn", "values": list(excluded_namespaces)},
            {"key": LABEL_WEBHOOK, "operator": "NotIn", "values": [LABEL_WEBHOOK_DISABLED]},
        ]
    }


def _cel_container_asks_gpu(container: str) -> str:
    """CEL: the container names a resource kube-vgpu serves (protocol.pod_asks_for_gpu's test): a GPU resource,
    HAMi's task priority, or a MIG profile (nvidia.com/mig-<profile>)."""
    names = ", ".join(cel_string(name) for name in (*GPU_RESOURCES, RESOURCE_TASK_PRIORITY))
    test = f"k in [{names}] || k.startsWith({cel_string(MIG_RESOURCE_PREFIX)})"
    return (
        f"has({container}.resources) && ("
        f"(has({container}.resources.limits) && {container}.resources.limits.exists(k, {test})) || "
        f"(has({container}.resources.requests) && {container}.resources.requests.exists(k, {test})))"
    )


def cel_string(text: str) -> str:
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


#: CEL for the CREATE webhook: any container or init container names a GPU resource, or the pod carries one of
#: our internal annotations (which the webhook must refuse).
_CREATE_CONDITION = (
    f"object.spec.containers.exists(c, {_cel_container_asks_gpu('c')}) || "
    f"(has(object.spec.initContainers) && object.spec.initContainers.exists(c, {_cel_container_asks_gpu('c')})) || "
    f"(has(object.metadata.annotations) && "
    f"object.metadata.annotations.exists(k, k.startsWith({cel_string(ANNOTATION_PREFIX)})))"
)


def _cel_changed_annotations(new: str, old: str) -> str:
    """CEL: `new` carries an internal annotation that `old` lacks or holds with another value."""
    prefix = cel_string(ANNOTATION_PREFIX)
    return (
        f"(has({new}.metadata.annotations) && {new}.metadata.annotations.exists(k, k.startsWith({prefix}) && "
        f"!(has({old}.metadata.annotations) && k in {old}.metadata.annotations && "
        f"{old}.metadata.annotations[k] == {new}.metadata.annotations[k])))"
    )


#: CEL for the UPDATE webhook: the update adds, changes or removes an internal annotation (what admit_update guards);
#: every other pod update, in every namespace, never reaches the webhook.
_UPDATE_CONDITION = (
    f"{_cel_changed_annotations('object', 'oldObject')} || {_cel_changed_annotations('oldObject', 'object')}"
)
