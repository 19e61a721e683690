"""The ValidatingAdmissionPolicies (admissionregistration.k8s.io/v1, Kubernetes 1.30+) that the API server enforces
without calling any webhook, as plain dicts; manifests/base/admission holds them as YAML (tests check the two agree).

1. kube-vgpu-device-plugin-pods / -nodes: the device plugin runs on every GPU node and its RBAC (`pods: patch`,
   `nodes: patch`) cannot be narrowed to one node. These policies hold each device plugin to its own node: the
   node named by its token (the `authentication.kubernetes.io/node-name` claim that the kubelet-projected token of
   a DaemonSet pod carries since Kubernetes 1.30, or a TokenRequest bound to the Node), and to the keys it writes:
   on pods bound to that node only the gpu-allocation annotation (Allocate); on that Node only the inventory and
   heartbeat annotations, the GPU labels and the limiter label (the publisher). A token without the claim is
   refused outright.
2. kube-vgpu-pod-annotations: kube-vgpu.io/ pod annotations are written only by kube-vgpu's components (the
   extender at bind, the device plugin in Allocate, the webhook's admission mark at creation). The webhook refuses
   them from anyone else, but only in the namespaces it sees and only while it runs. This policy refuses, from
   anyone but the components: creating a pod that carries one in a namespace the webhook does not see (its
   namespaceSelector, mirrored; there nothing else would stop a user writing the admission mark), a Binding that
   carries one (the API server copies a Binding's annotations onto the pod), and any update (of the pod or its
   status) that adds, changes or removes one.
3. kube-vgpu-queue-label: a pod's kueue.x-k8s.io/queue-name label is fixed at creation (quota counts the pod in
   that queue; Kueue never rewrites it on pods); only kube-vgpu's components may change it afterwards.

Every policy fails closed (failurePolicy Fail) and is bound with validationActions [Deny].
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from kube_vgpu.protocol import (
    ANNOTATION_PREFIX,
    LABEL_GPU_COUNT,
    LABEL_GPU_MEMORY_MIB,
    LABEL_GPU_PRODUCT,
    LABEL_KUEUE_QUEUE_NAME,
    LABEL_LIMITER,
    NODE_HEARTBEAT_ANNOTATION,
    NODE_INVENTORY_ANNOTATION,
    POD_ALLOCATION_ANNOTATION,
)
from kube_vgpu.webhook.config import DEFAULT_DEVICE_PLUGIN_USERNAME, DEFAULT_TRUSTED_USERNAMES
from kube_vgpu.webhook.registration import DEFAULT_EXCLUDED_NAMESPACES, cel_string, namespace_selector

API_VERSION = "admissionregistration.k8s.io/v1"
DEVICE_PLUGIN_PODS_POLICY = "kube-vgpu-device-plugin-pods"
DEVICE_PLUGIN_NODES_POLICY = "kube-vgpu-device-plugin-nodes"
POD_ANNOTATIONS_POLICY = "kube-vgpu-pod-annotations"
QUEUE_LABEL_POLICY = "kube-vgpu-queue-label"
POLICY_NAMES = (DEVICE_PLUGIN_PODS_POLICY, DEVICE_PLUGIN_NODES_POLICY, POD_ANNOTATIONS_POLICY, QUEUE_LABEL_POLICY)

#: userInfo.extra key of the node a ServiceAccount token is bound to (directly, or through the pod it was issued to).
NODE_NAME_EXTRA = "authentication.kubernetes.io/node-name"
#: The only pod annotation the device plugin writes (Allocate's claim, deviceplugin/allocate.py).
DEVICE_PLUGIN_POD_ANNOTATIONS = (POD_ALLOCATION_ANNOTATION,)
#: What the device plugin's publisher writes on its Node (deviceplugin/publisher.py: inventory_annotations and
#: OWNED_LABELS, and the limiter label it sets while the installed limiter is intact); nothing else on the Node may
#: change under its identity.
DEVICE_PLUGIN_NODE_ANNOTATIONS = (NODE_INVENTORY_ANNOTATION, NODE_HEARTBEAT_ANNOTATION)
DEVICE_PLUGIN_NODE_LABELS = (LABEL_GPU_PRODUCT, LABEL_GPU_COUNT, LABEL_GPU_MEMORY_MIB, LABEL_LIMITER)

_LABELS = {"app.kubernetes.io/name": "kube-vgpu", "app.kubernetes.io/component": "admission-policy"}


def admission_policies(
    *,
    device_plugin_username: str = DEFAULT_DEVICE_PLUGIN_USERNAME,
    trusted_usernames: Iterable[str] = DEFAULT_TRUSTED_USERNAMES,
    excluded_namespaces: Iterable[str] = DEFAULT_EXCLUDED_NAMESPACES,
) -> list[dict[str, Any]]:
    """Every ValidatingAdmissionPolicy, each followed by its ValidatingAdmissionPolicyBinding.

    `trusted_usernames` and `excluded_namespaces` must be the webhook's (webhook.registration): the identities
    that write kube-vgpu.io/ pod annotations, and the namespaces the webhook does not see."""
    trusted = sorted(trusted_usernames)
    policies = [
        _device_plugin_pods(device_plugin_username),
        _device_plugin_nodes(device_plugin_username),
        _queue_label(trusted),
        # last: the dev cluster waits for this one to be in force (the API server loads policies in order)
        _pod_annotations(trusted, tuple(excluded_namespaces)),
    ]
    documents: list[dict[str, Any]] = []
    for policy in policies:
        documents += [policy, _binding(policy["metadata"]["name"])]
    return documents


# ---------------------------------------------------------------------------------------------------------------
# CEL pieces
# ---------------------------------------------------------------------------------------------------------------


def _cel_list(items: Iterable[str]) -> str:
    return "[" + ", ".join(cel_string(item) for item in items) + "]"


def _metadata_map(obj: str, field: str, *, nullable: bool = False) -> str:
    """CEL: the object's labels or annotations, {} when it has none (or, `nullable`, when the object is null)."""
    present = f"has({obj}.metadata.{field})"
    if nullable:
        present = f"{obj} != null && {present}"
    return f"{present} ? {obj}.metadata.{field} : {{}}"


def _metadata_list(obj: str, field: str) -> str:
    return f"has({obj}.metadata.{field}) ? {obj}.metadata.{field} : []"


def _changed_keys(new: str, old: str) -> str:
    """CEL: the keys that differ between two string maps (added, changed or removed)."""
    return (
        f"{new}.filter(k, !(k in {old}) || {old}[k] != {new}[k]) + "
        f"{old}.filter(k, !(k in {new}))"
    )


def _map_variables() -> list[dict[str, str]]:
    """Labels and annotations, old and new, and the keys that changed (UPDATE only)."""
    return [
        {"name": "newAnnotations", "expression": _metadata_map("object", "annotations")},
        {"name": "oldAnnotations", "expression": _metadata_map("oldObject", "annotations")},
        {"name": "newLabels", "expression": _metadata_map("object", "labels")},
        {"name": "oldLabels", "expression": _metadata_map("oldObject", "labels")},
        {"name": "changedAnnotations",
         "expression": _changed_keys("variables.newAnnotations", "variables.oldAnnotations")},
        {"name": "changedLabels", "expression": _changed_keys("variables.newLabels", "variables.oldLabels")},
    ]


def _node_name_variable() -> dict[str, str]:
    extra = f"request.userInfo.extra[{cel_string(NODE_NAME_EXTRA)}]"
    return {
        "name": "nodeName",
        "expression": (
            f"has(request.userInfo.extra) && {cel_string(NODE_NAME_EXTRA)} in request.userInfo.extra && "
            f"size({extra}) > 0 ? {extra}[0] : ''"
        ),
    }


def _node_claim_validation() -> dict[str, str]:
    return {
        "expression": "variables.nodeName != ''",
        "reason": "Forbidden",
        "message": (
            f"kube-vgpu's device plugin may write only to its own node, and its token names no node (no "
            f"{NODE_NAME_EXTRA} claim): run it with the projected ServiceAccount token of its DaemonSet pod "
            f"(Kubernetes 1.30+), or a token bound to its Node"
        ),
    }


def _keep_equal(what: str, new: str, old: str, who: str) -> dict[str, str]:
    return {"expression": f"({new}) == ({old})", "reason": "Forbidden", "message": f"{who} may not change {what}"}


def _only_keys(changed: str, allowed: tuple[str, ...], what: str, who: str) -> dict[str, str]:
    listed = _cel_list(allowed)
    return {
        "expression": f"{changed}.all(k, k in {listed})",
        "reason": "Forbidden",
        "messageExpression": (
            f"{cel_string(f'{who} may change only the {what} ' + ', '.join(allowed) + '; this update changes ')}"
            f" + {changed}.filter(k, !(k in {listed})).join(', ')"
        ),
    }


def _by_user(username: str) -> dict[str, str]:
    return {"name": "from-the-device-plugin", "expression": f"request.userInfo.username == {cel_string(username)}"}


def _not_trusted(trusted: list[str]) -> dict[str, str]:
    return {"name": "not-from-kube-vgpu-components",
            "expression": f"!(request.userInfo.username in {_cel_list(trusted)})"}


def _cel_selector_matches(selector: dict[str, Any], obj: str) -> str:
    """CEL: the label selector (matchExpressions with NotIn only: what webhook.registration builds) matches `obj`."""
    requirements = selector.get("matchExpressions") or []
    if set(selector) != {"matchExpressions"} or not requirements or any(r["operator"] != "NotIn" for r in requirements):
        raise ValueError(f"only NotIn matchExpressions can be mirrored, got {selector}")
    terms = []
    for requirement in requirements:
        key = cel_string(requirement["key"])
        terms.append(
            f"!(has({obj}.metadata.labels) && {key} in {obj}.metadata.labels && "
            f"{obj}.metadata.labels[{key}] in {_cel_list(requirement['values'])})"
        )
    return " && ".join(terms)


def _rule(operations: list[str], resources: list[str]) -> dict[str, Any]:
    return {"apiGroups": [""], "apiVersions": ["v1"], "operations": operations, "resources": resources}


def _policy(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "kind": "ValidatingAdmissionPolicy",
        "metadata": {"name": name, "labels": dict(_LABELS)},
        "spec": {"failurePolicy": "Fail", **spec},
    }


def _binding(policy_name: str) -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "kind": "ValidatingAdmissionPolicyBinding",
        "metadata": {"name": policy_name, "labels": dict(_LABELS)},
        "spec": {"policyName": policy_name, "validationActions": ["Deny"]},
    }


# ---------------------------------------------------------------------------------------------------------------
# The policies
# ---------------------------------------------------------------------------------------------------------------


def _device_plugin_pods(username: str) -> dict[str, Any]:
    who = "kube-vgpu's device plugin"
    return _policy(DEVICE_PLUGIN_PODS_POLICY, {
        "matchConstraints": {"resourceRules": [_rule(["UPDATE"], ["pods"])], "matchPolicy": "Equivalent"},
        "matchConditions": [_by_user(username)],
        "variables": [_node_name_variable(), *_map_variables()],
        "validations": [
            _node_claim_validation(),
            {
                # no second message when the claim is missing: the first one says it all
                "expression": "variables.nodeName == '' || "
                              "(has(object.spec.nodeName) && object.spec.nodeName == variables.nodeName)",
                "reason": "Forbidden",
                "messageExpression": (
                    f"{cel_string(who + ' on node ')} + variables.nodeName + "
                    "' may update only pods bound to that node; pod ' + request.namespace + '/' + request.name + "
                    "(has(object.spec.nodeName) ? ' is bound to ' + object.spec.nodeName : ' is not bound')"
                ),
            },
            _keep_equal("a pod's spec", "object.spec", "oldObject.spec", who),
            _keep_equal("a pod's labels", "variables.newLabels", "variables.oldLabels", who),
            _keep_equal("a pod's owner references", _metadata_list("object", "ownerReferences"),
                        _metadata_list("oldObject", "ownerReferences"), who),
            _keep_equal("a pod's finalizers", _metadata_list("object", "finalizers"),
                        _metadata_list("oldObject", "finalizers"), who),
            _only_keys("variables.changedAnnotations", DEVICE_PLUGIN_POD_ANNOTATIONS, "pod annotation", who),
        ],
    })


def _device_plugin_nodes(username: str) -> dict[str, Any]:
    who = "kube-vgpu's device plugin"
    return _policy(DEVICE_PLUGIN_NODES_POLICY, {
        "matchConstraints": {"resourceRules": [_rule(["UPDATE"], ["nodes"])], "matchPolicy": "Equivalent"},
        "matchConditions": [_by_user(username)],
        "variables": [_node_name_variable(), *_map_variables()],
        "validations": [
            _node_claim_validation(),
            {
                "expression": "variables.nodeName == '' || object.metadata.name == variables.nodeName",
                "reason": "Forbidden",
                "messageExpression": (
                    f"{cel_string(who + ' on node ')} + variables.nodeName + "
                    "' may update only that node, not ' + object.metadata.name"
                ),
            },
            _keep_equal("a node's spec (taints, unschedulable, ...)", "object.spec", "oldObject.spec", who),
            _keep_equal("a node's owner references", _metadata_list("object", "ownerReferences"),
                        _metadata_list("oldObject", "ownerReferences"), who),
            _keep_equal("a node's finalizers", _metadata_list("object", "finalizers"),
                        _metadata_list("oldObject", "finalizers"), who),
            _only_keys("variables.changedLabels", DEVICE_PLUGIN_NODE_LABELS, "node labels", who),
            _only_keys("variables.changedAnnotations", DEVICE_PLUGIN_NODE_ANNOTATIONS, "node annotations", who),
        ],
    })


def _pod_annotations(trusted: list[str], excluded_namespaces: tuple[str, ...]) -> dict[str, Any]:
    prefix = cel_string(ANNOTATION_PREFIX)
    seen = _cel_selector_matches(namespace_selector(excluded_namespaces), "namespaceObject")
    sub_resource = "(has(request.subResource) ? request.subResource : '')"
    return _policy(POD_ANNOTATIONS_POLICY, {
        "matchConstraints": {
            "resourceRules": [
                _rule(["CREATE", "UPDATE"], ["pods"]),
                # status updates may change a pod's metadata too; a Binding's annotations are copied onto the pod
                _rule(["UPDATE"], ["pods/status"]),
                _rule(["CREATE"], ["pods/binding"]),
            ],
            "matchPolicy": "Equivalent",
        },
        "matchConditions": [_not_trusted(trusted)],
        "variables": [
            {"name": "subResource", "expression": sub_resource},
            {"name": "newAnnotations", "expression": _metadata_map("object", "annotations")},
            {"name": "oldAnnotations", "expression": _metadata_map("oldObject", "annotations", nullable=True)},
            {"name": "internal", "expression": f"variables.newAnnotations.filter(k, k.startsWith({prefix}))"},
            {"name": "changedInternal", "expression": (
                f"({_changed_keys('variables.newAnnotations', 'variables.oldAnnotations')})"
                f".filter(k, k.startsWith({prefix}))")},
            # the webhook's namespaceSelector (webhook.registration.namespace_selector), evaluated on the namespace
            {"name": "webhookSeesNamespace", "expression": f"namespaceObject != null && {seen}"},
        ],
        "validations": [
            {
                "expression": "request.operation != 'CREATE' || variables.subResource != '' || "
                              "variables.webhookSeesNamespace || size(variables.internal) == 0",
                "reason": "Forbidden",
                "messageExpression": (
                    "'only kube-vgpu writes kube-vgpu.io/ annotations, and kube-vgpu\\'s webhook does not see "
                    "namespace ' + request.namespace + ' (excluded, or labelled kube-vgpu.io/webhook=disabled): "
                    "a pod created there may not carry ' + variables.internal.join(', ')"
                ),
            },
            {
                "expression": "variables.subResource != 'binding' || size(variables.internal) == 0",
                "reason": "Forbidden",
                "messageExpression": (
                    "'only kube-vgpu\\'s extender binds pods with kube-vgpu.io/ annotations; this Binding carries ' "
                    "+ variables.internal.join(', ')"
                ),
            },
            {
                "expression": "request.operation != 'UPDATE' || size(variables.changedInternal) == 0",
                "reason": "Forbidden",
                "messageExpression": (
                    "'only kube-vgpu\\'s components may add, change or remove kube-vgpu.io/ pod annotations; "
                    "this update changes ' + variables.changedInternal.join(', ')"
                ),
            },
        ],
    })


def _queue_label(trusted: list[str]) -> dict[str, Any]:
    label = cel_string(LABEL_KUEUE_QUEUE_NAME)
    return _policy(QUEUE_LABEL_POLICY, {
        "matchConstraints": {
            "resourceRules": [_rule(["UPDATE"], ["pods", "pods/status"])],
            "matchPolicy": "Equivalent",
        },
        "matchConditions": [_not_trusted(trusted)],
        "variables": [
            {"name": "newLabels", "expression": _metadata_map("object", "labels")},
            {"name": "oldLabels", "expression": _metadata_map("oldObject", "labels")},
        ],
        "validations": [
            {
                "expression": (
                    f"({label} in variables.newLabels) == ({label} in variables.oldLabels) && "
                    f"(!({label} in variables.newLabels) || "
                    f"variables.newLabels[{label}] == variables.oldLabels[{label}])"
                ),
                "reason": "Forbidden",
                "message": (
                    f"a pod's {LABEL_KUEUE_QUEUE_NAME} label is fixed when the pod is created (its GPU quota is "
                    f"counted in that queue): it cannot be added, changed or removed; delete the pod and create it "
                    f"again with the queue it should use"
                ),
            },
        ],
    })
