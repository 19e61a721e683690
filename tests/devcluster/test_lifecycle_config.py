"""What the dev cluster hands kube-controller-manager and KWOK (kube_vgpu.dev.devcluster.lifecycle), checked without
starting them; tests/e2e/test_jobs_e2e.py runs them for real."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from kube_vgpu import protocol
from kube_vgpu.dev.devcluster import lifecycle
from kube_vgpu.dev.devcluster.cluster import COMPONENTS, RESTARTABLE


def _stages() -> dict[str, dict[str, Any]]:
    # round-trip through YAML: that is how KWOK reads them (--config)
    documents = list(yaml.safe_load_all(yaml.safe_dump_all(lifecycle.kwok_stages(), sort_keys=False)))
    assert all(doc["apiVersion"] == "kwok.x-k8s.io/v1alpha1" and doc["kind"] == "Stage" for doc in documents)
    return {doc["metadata"]["name"]: doc["spec"] for doc in documents}


def _expressions(spec: dict[str, Any]) -> dict[str, tuple[str, list[str]]]:
    return {e["key"]: (e["operator"], e.get("values", [])) for e in spec["selector"]["matchExpressions"]}


def test_the_dev_annotations_are_not_kube_vgpu_internal() -> None:
    # the webhook refuses kube-vgpu.io/ annotations from anyone but kube-vgpu: pod authors and the Job controller
    # must be able to set the run time
    assert not protocol.is_internal_annotation(lifecycle.RUN_SECONDS_ANNOTATION)
    assert not protocol.is_internal_annotation(lifecycle.NODE_ANNOTATION)


def test_run_seconds_annotation() -> None:
    assert lifecycle.run_seconds_annotation(5) == {lifecycle.RUN_SECONDS_ANNOTATION: "5"}
    assert lifecycle.run_seconds_annotation(0.5) == {lifecycle.RUN_SECONDS_ANNOTATION: "0.5"}
    with pytest.raises(ValueError):
        lifecycle.run_seconds_annotation(-1)


def test_pod_stages_run_bound_pods_and_finish_only_annotated_run_to_completion_pods() -> None:
    stages = _stages()
    pods = {name: spec for name, spec in stages.items() if spec["resourceRef"]["kind"] == "Pod"}
    assert set(pods) == {"kube-vgpu-dev-pod-running", "kube-vgpu-dev-pod-succeeded", "kube-vgpu-dev-pod-deleted"}

    running = pods["kube-vgpu-dev-pod-running"]
    assert "phase: Running" in running["next"]["statusTemplate"]
    assert _expressions(running)[".status.podIP"] == ("DoesNotExist", [])

    succeeded = pods["kube-vgpu-dev-pod-succeeded"]
    annotation = f'.metadata.annotations["{lifecycle.RUN_SECONDS_ANNOTATION}"]'
    assert _expressions(succeeded) == {
        ".metadata.deletionTimestamp": ("DoesNotExist", []),
        ".status.phase": ("In", ["Running"]),
        ".spec.restartPolicy": ("In", ["Never", "OnFailure"]),
        annotation: ("Exists", []),
    }
    # KWOK reads a string delay with time.ParseDuration: "5" + "s"
    assert succeeded["delay"]["durationFrom"] == {"jq": {"expression": f'{annotation} + "s"'}}
    assert "phase: Succeeded" in succeeded["next"]["statusTemplate"]

    deleted = pods["kube-vgpu-dev-pod-deleted"]
    # the kubelet's final delete; other controllers' finalizers (the Job controller's job-tracking) are left alone
    assert deleted["next"] == {"delete": True}


def test_kwok_never_writes_node_metadata() -> None:
    nodes = [spec for spec in _stages().values() if spec["resourceRef"]["kind"] == "Node"]
    assert len(nodes) == 1  # one of ours, so KWOK does not fall back to its default node stages
    (node,) = nodes
    assert set(node["next"]) == {"statusTemplate"}  # status only: no patches of labels or annotations, no delete
    template = yaml.safe_load(node["next"]["statusTemplate"].replace("{{", "#").replace("}}", ""))
    assert set(template) == {"conditions"}  # not capacity/allocatable either: the GPU inventory stays ours
    # and only for a node that is not Ready (the dev cluster registers them Ready)
    assert _expressions(node)['.status.conditions.[] | select( .type == "Ready" ) | .status'] == ("NotIn", ["True"])


def test_kwok_rbac_is_least_privilege() -> None:
    documents = {doc["kind"]: doc for doc in lifecycle.kwok_rbac_documents("kube-system")}
    rules = documents["ClusterRole"]["rules"]
    granted = {(group, resource, verb) for rule in rules for group in rule["apiGroups"]
               for resource in rule["resources"] for verb in rule["verbs"]}
    assert not any("*" in entry for entry in granted)
    assert ("", "nodes", "patch") not in granted and ("", "nodes", "update") not in granted
    assert ("", "pods", "patch") not in granted and ("", "pods", "create") not in granted
    assert {("", "pods/status", "patch"), ("", "nodes/status", "patch"), ("", "pods", "delete")} <= granted
    binding = documents["ClusterRoleBinding"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": lifecycle.KWOK_SERVICE_ACCOUNT, "namespace": "kube-system"}
    ]


def test_controllers_and_component_order() -> None:
    assert set(lifecycle.CONTROLLERS) == {
        "job-controller", "replicaset-controller", "deployment-controller", "garbage-collector-controller",
        "disruption-controller", "namespace-controller",
    }
    # kube-controller-manager needs only the API server; KWOK starts last, once the nodes are registered
    assert COMPONENTS.index("kube-controller-manager") == COMPONENTS.index("kube-apiserver") + 1
    assert COMPONENTS[-1] == "kwok"
    assert {"kube-controller-manager", "kwok"} <= set(RESTARTABLE)
