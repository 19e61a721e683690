"""Pod lifecycle of the dev cluster (ClusterOptions.lifecycle): kube-controller-manager and KWOK.

* kube-controller-manager runs the workload controllers only (CONTROLLERS: Job, ReplicaSet, Deployment, garbage
  collector, PodDisruptionBudget, namespace), so Jobs and Deployments create pods, ownerReferences cascade and
  namespaces finish terminating. It authenticates with a client certificate of system:kube-controller-manager (the
  user the API server's default RBAC binds to the system:kube-controller-manager ClusterRole) and runs each
  controller under its own ServiceAccount in kube-system (--use-service-account-credentials, as kubeadm does), with
  the API server's bootstrap role of that controller: the least privilege upstream defines for it.
* KWOK (sigs.k8s.io/kwok) plays the kubelets of the nodes carrying NODE_ANNOTATION (every node the dev cluster
  registers), with our own stages (kwok_stages) instead of its defaults:

  - a bound pod becomes Running at once (KWOK's pod-ready stage: container statuses, pod IP, Ready conditions);
  - a Running pod with RUN_SECONDS_ANNOTATION and restartPolicy Never or OnFailure (a Job's pods) Succeeds that many
    seconds later; pods without it run until deleted, like a real long-running workload;
  - a deleted pod is removed (the final delete a kubelet makes once its containers stopped), without stripping
    anybody's finalizers (the Job controller's job-tracking finalizer is its own to remove);
  - nodes: KWOK writes only status.conditions, and only of a node whose Ready condition is not True (the nodes are
    registered Ready, so normally never). It never touches a node's labels, annotations, capacity or allocatable:
    the GPU inventory and its heartbeat stay ours (the heartbeat component, the device plugin's job). Node leases
    are off (--node-lease-duration-seconds=0): no node lifecycle controller reads them here.

  KWOK runs as its own ServiceAccount (kube-vgpu/kwok) with the rules of kwok_rbac_documents: read nodes, patch
  node and pod status, read and delete pods, write events.

These names are dev-cluster conventions, not part of kube-vgpu's protocol: the prefix is not kube-vgpu.io/ (which
the webhook reserves to kube-vgpu's components), so any pod author, the Job controller included, may set them.
"""

from __future__ import annotations

from typing import Any

#: Pod annotation: seconds (an integer or decimal number, e.g. "5" or "0.5") a pod runs before KWOK marks it
#: Succeeded. Only for pods whose restartPolicy is Never or OnFailure; put it on a Job's pod template.
RUN_SECONDS_ANNOTATION = "dev.kube-vgpu.io/run-seconds"
#: Node annotation that hands a node to KWOK (the dev cluster sets it on every node it registers).
NODE_ANNOTATION = "dev.kube-vgpu.io/lifecycle"
NODE_ANNOTATION_VALUE = "kwok"

#: kube-controller-manager's controllers (its --controllers names); nothing else runs (no node lifecycle controller:
#: the nodes' Ready conditions, leases and taints are left as the dev cluster registered them).
CONTROLLERS = (
    "job-controller",
    "replicaset-controller",
    "deployment-controller",
    "garbage-collector-controller",
    "disruption-controller",
    "namespace-controller",
)

KWOK_SERVICE_ACCOUNT = "kwok"
KWOK_CLUSTER_ROLE = "kube-vgpu-dev:kwok"
#: Pod IPs KWOK hands out (its default /24 would run out after 254 pods in a benchmark).
KWOK_POD_CIDR = "10.128.0.1/9"


def run_seconds_annotation(seconds: float) -> dict[str, str]:
    """The annotation that makes a pod finish `seconds` after it started running."""
    if seconds < 0:
        raise ValueError(f"run seconds must be >= 0, not {seconds}")
    return {RUN_SECONDS_ANNOTATION: f"{seconds:g}"}


def _stage(name: str, kind: str, selector: list[dict[str, Any]], next_: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {
        "apiVersion": "kwok.x-k8s.io/v1alpha1",
        "kind": "Stage",
        "metadata": {"name": name},
        "spec": {
            "resourceRef": {"apiGroup": "v1", "kind": kind},
            "selector": {"matchExpressions": selector},
            **extra,
            "next": next_,
        },
    }


_NOT_DELETED = {"key": ".metadata.deletionTimestamp", "operator": "DoesNotExist"}

_NODE_READY_TEMPLATE = """\
{{ $now := Now }}
conditions:
{{ range NodeConditions }}
- lastHeartbeatTime: {{ $now | Quote }}
  lastTransitionTime: {{ $now | Quote }}
  message: {{ .message | Quote }}
  reason: {{ .reason | Quote }}
  status: {{ .status | Quote }}
  type: {{ .type | Quote }}
{{ end }}
"""

# KWOK v0.7.0's kustomize/stage/pod/fast/pod-ready.yaml.
_POD_RUNNING_TEMPLATE = """\
{{ $now := Now }}
conditions:
- lastTransitionTime: {{ $now | Quote }}
  status: "True"
  type: Initialized
- lastTransitionTime: {{ $now | Quote }}
  status: "True"
  type: Ready
- lastTransitionTime: {{ $now | Quote }}
  status: "True"
  type: ContainersReady
{{ range .spec.readinessGates }}
- lastTransitionTime: {{ $now | Quote }}
  status: "True"
  type: {{ .conditionType | Quote }}
{{ end }}
containerStatuses:
{{ range .spec.containers }}
- image: {{ .image | Quote }}
  name: {{ .name | Quote }}
  ready: true
  restartCount: 0
  started: true
  state:
    running:
      startedAt: {{ $now | Quote }}
{{ end }}
initContainerStatuses:
{{ range .spec.initContainers }}
- image: {{ .image | Quote }}
  name: {{ .name | Quote }}
  ready: true
  restartCount: 0
  {{ if eq .restartPolicy "Always" }}
  started: true
  state:
    running:
      startedAt: {{ $now | Quote }}
  {{ else }}
  state:
    terminated:
      exitCode: 0
      finishedAt: {{ $now | Quote }}
      reason: Completed
      startedAt: {{ $now | Quote }}
  {{ end }}
{{ end }}
hostIP: {{ NodeIPWith .spec.nodeName | Quote }}
podIP: {{ PodIPWith .spec.nodeName ( or .spec.hostNetwork false ) ( or .metadata.uid "" ) ( or .metadata.name "" ) ( or .metadata.namespace "" ) | Quote }}
phase: Running
startTime: {{ $now | Quote }}
"""  # noqa: E501 (a template line)

# KWOK's pod-complete.yaml, plus the Ready conditions a kubelet turns False (reason PodCompleted).
_POD_SUCCEEDED_TEMPLATE = """\
{{ $now := Now }}
conditions:
- lastTransitionTime: {{ $now | Quote }}
  reason: PodCompleted
  status: "False"
  type: Ready
- lastTransitionTime: {{ $now | Quote }}
  reason: PodCompleted
  status: "False"
  type: ContainersReady
containerStatuses:
{{ range .spec.containers }}
- image: {{ .image | Quote }}
  name: {{ .name | Quote }}
  ready: false
  restartCount: 0
  started: false
  state:
    terminated:
      exitCode: 0
      finishedAt: {{ $now | Quote }}
      reason: Completed
      startedAt: {{ $now | Quote }}
{{ end }}
phase: Succeeded
"""


def kwok_stages() -> list[dict[str, Any]]:
    """KWOK's Stage documents for the dev cluster (its --config): see the module docstring."""
    annotation_path = f'.metadata.annotations["{RUN_SECONDS_ANNOTATION}"]'
    return [
        _stage(
            "kube-vgpu-dev-node-ready",
            "Node",
            [{"key": '.status.conditions.[] | select( .type == "Ready" ) | .status', "operator": "NotIn",
              "values": ["True"]}],
            {"statusTemplate": _NODE_READY_TEMPLATE},
        ),
        _stage(
            "kube-vgpu-dev-pod-running",
            "Pod",
            [_NOT_DELETED, {"key": ".status.podIP", "operator": "DoesNotExist"}],
            {"statusTemplate": _POD_RUNNING_TEMPLATE},
        ),
        _stage(
            "kube-vgpu-dev-pod-succeeded",
            "Pod",
            [
                _NOT_DELETED,
                {"key": ".status.phase", "operator": "In", "values": ["Running"]},
                {"key": ".spec.restartPolicy", "operator": "In", "values": ["Never", "OnFailure"]},
                {"key": annotation_path, "operator": "Exists"},
            ],
            {"statusTemplate": _POD_SUCCEEDED_TEMPLATE},
            # A string is read with Go's time.ParseDuration: "5" + "s". The delay counts from the moment the stage
            # matched, i.e. from when the pod was seen Running.
            delay={"durationMilliseconds": 0, "durationFrom": {"jq": {"expression": f'{annotation_path} + "s"'}}},
        ),
        _stage(
            "kube-vgpu-dev-pod-deleted",
            "Pod",
            [{"key": ".metadata.deletionTimestamp", "operator": "Exists"}],
            {"delete": True},
        ),
    ]


def kwok_rbac_documents(namespace: str) -> list[dict[str, Any]]:
    """KWOK's ServiceAccount and the least its stages need (upstream's kwok-controller role, minus leases, the
    kwok.x-k8s.io CRDs and node/pod updates, which these stages do not use)."""
    rules = [
        {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "list", "watch"]},
        {"apiGroups": [""], "resources": ["nodes/status"], "verbs": ["patch"]},
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch", "delete"]},
        {"apiGroups": [""], "resources": ["pods/status"], "verbs": ["patch"]},
        {"apiGroups": [""], "resources": ["events"], "verbs": ["create", "patch", "update"]},
        {"apiGroups": ["events.k8s.io"], "resources": ["events"], "verbs": ["create", "patch", "update"]},
    ]
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount",
         "metadata": {"name": KWOK_SERVICE_ACCOUNT, "namespace": namespace}},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
         "metadata": {"name": KWOK_CLUSTER_ROLE}, "rules": rules},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": {"name": KWOK_CLUSTER_ROLE},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": KWOK_CLUSTER_ROLE},
            "subjects": [{"kind": "ServiceAccount", "name": KWOK_SERVICE_ACCOUNT, "namespace": namespace}],
        },
    ]
