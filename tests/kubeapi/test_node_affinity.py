"""kubeapi.node_matches_pod: kube-scheduler's NodeAffinity rules (nodeSelector, required node affinity)."""

from __future__ import annotations

from typing import Any

import pytest

from kube_vgpu.kubeapi import node_matches_pod

LABELS = {"zone": "a", "gpu": "a100", "rack": "7"}


def pod(selector: dict[str, str] | None = None, terms: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {}
    if selector is not None:
        spec["nodeSelector"] = selector
    if terms is not None:
        spec["affinity"] = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": terms}}}
    return {"spec": spec}


def expr(key: str, operator: str, *values: str) -> dict[str, Any]:
    return {"key": key, "operator": operator, "values": list(values)}


ROWS = [
    ("nothing-asked", pod(), True),
    ("selector-match", pod({"zone": "a"}), True),
    ("selector-mismatch", pod({"zone": "b"}), False),
    ("selector-missing-label", pod({"team": "x"}), False),
    ("in", pod(terms=[{"matchExpressions": [expr("gpu", "In", "h100", "a100")]}]), True),
    ("not-in", pod(terms=[{"matchExpressions": [expr("gpu", "NotIn", "a100")]}]), False),
    ("not-in-absent-label", pod(terms=[{"matchExpressions": [expr("team", "NotIn", "x")]}]), True),
    ("exists", pod(terms=[{"matchExpressions": [expr("rack", "Exists")]}]), True),
    ("does-not-exist", pod(terms=[{"matchExpressions": [expr("rack", "DoesNotExist")]}]), False),
    ("gt", pod(terms=[{"matchExpressions": [expr("rack", "Gt", "5")]}]), True),
    ("lt", pod(terms=[{"matchExpressions": [expr("rack", "Lt", "5")]}]), False),
    ("gt-not-a-number", pod(terms=[{"matchExpressions": [expr("zone", "Gt", "5")]}]), False),
    ("expressions-anded", pod(terms=[{"matchExpressions": [expr("zone", "In", "a"), expr("gpu", "In", "h100")]}]),
     False),
    ("terms-ored", pod(terms=[{"matchExpressions": [expr("gpu", "In", "h100")]},
                              {"matchExpressions": [expr("zone", "In", "a")]}]), True),
    ("empty-term-matches-nothing", pod(terms=[{}]), False),
    ("match-fields-name", pod(terms=[{"matchFields": [expr("metadata.name", "In", "node-1")]}]), True),
    ("match-fields-other-name", pod(terms=[{"matchFields": [expr("metadata.name", "In", "node-2")]}]), False),
    ("selector-and-affinity-both-needed", pod({"zone": "b"}, [{"matchExpressions": [expr("gpu", "Exists")]}]), False),
]


@pytest.mark.parametrize(("case", "obj", "expected"), ROWS, ids=[row[0] for row in ROWS])
def test_node_matches_pod(case: str, obj: dict[str, Any], expected: bool) -> None:
    assert node_matches_pod(obj, LABELS, "node-1") is expected
