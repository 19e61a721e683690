"""The webhook's required node affinity on the limiter label (webhook/mutate.py, _patch_limiter_affinity): merged into
whatever affinity the pod has, so the pod lands only on nodes where the device plugin found the limiter installed."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from kube_vgpu.webhook.config import LimiterMode, WebhookConfig
from tests.webhook.builders import apply_response, container, gpu_container, patch_ops, pod, run_review

# Written out here, not imported from the code under test.
LABEL = "kube-vgpu.io/limiter"
REQUIRED = "requiredDuringSchedulingIgnoredDuringExecution"
OURS = {"key": LABEL, "operator": "Exists"}
MIG = "nvidia.com/mig-1g.10gb"


def admitted(sent: dict[str, Any], config: WebhookConfig | None = None) -> dict[str, Any]:
    _, response = run_review(sent, config)
    assert response["allowed"], response
    mutated = apply_response(sent, response)
    _, again = run_review(mutated, config)  # reinvocation: nothing more to add
    assert patch_ops(again) == []
    return mutated


def gpu_pod(**spec_extra: Any) -> dict[str, Any]:
    return pod(gpu_container(gpu="1", gpumem="1024"), **spec_extra)


def terms_of(mutated: dict[str, Any]) -> list[dict[str, Any]]:
    terms: list[dict[str, Any]] = mutated["spec"]["affinity"]["nodeAffinity"][REQUIRED]["nodeSelectorTerms"]
    return terms


def matches(terms: list[dict[str, Any]], labels: dict[str, str], name: str = "n1") -> bool:
    """kube-scheduler's reading of required node affinity, for the operators used here: terms ORed, an empty term
    matching nothing, expressions and fields of a term ANDed."""
    def expression(e: dict[str, Any], values: dict[str, str]) -> bool:
        op, key = e["operator"], e["key"]
        if op == "Exists":
            return key in values
        if op == "DoesNotExist":
            return key not in values
        if op == "In":
            return values.get(key) in e["values"]
        if op == "NotIn":
            return values.get(key) not in e["values"]
        raise AssertionError(op)

    def term(t: dict[str, Any]) -> bool:
        expressions, fields = t.get("matchExpressions") or [], t.get("matchFields") or []
        if not expressions and not fields:
            return False
        return all(expression(e, labels) for e in expressions) and all(
            expression(f, {"metadata.name": name}) for f in fields)

    return any(term(t) for t in terms)


def test_a_pod_without_affinity_gets_the_requirement() -> None:
    mutated = admitted(gpu_pod())
    assert mutated["spec"]["affinity"] == {"nodeAffinity": {REQUIRED: {"nodeSelectorTerms": [
        {"matchExpressions": [OURS]}]}}}
    assert matches(terms_of(mutated), {LABEL: "v1-0123456789ab"})
    assert not matches(terms_of(mutated), {"nvidia.com/gpu.count": "4"})


def test_a_null_affinity_is_replaced() -> None:
    assert terms_of(admitted(gpu_pod(affinity=None))) == [{"matchExpressions": [OURS]}]


def test_pod_affinity_and_preferred_node_affinity_are_kept() -> None:
    anti = {"podAntiAffinity": {REQUIRED: [{"labelSelector": {"matchLabels": {"app": "train"}},
                                            "topologyKey": "kubernetes.io/hostname"}]}}
    mutated = admitted(gpu_pod(affinity=copy.deepcopy(anti)))
    assert mutated["spec"]["affinity"]["podAntiAffinity"] == anti["podAntiAffinity"]
    assert terms_of(mutated) == [{"matchExpressions": [OURS]}]
    preferred = [{"weight": 10, "preference": {"matchExpressions": [
        {"key": "zone", "operator": "In", "values": ["a"]}]}}]
    mutated = admitted(gpu_pod(affinity={"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution":
                                                           copy.deepcopy(preferred)}}))
    node_affinity = mutated["spec"]["affinity"]["nodeAffinity"]
    assert node_affinity["preferredDuringSchedulingIgnoredDuringExecution"] == preferred
    assert node_affinity[REQUIRED] == {"nodeSelectorTerms": [{"matchExpressions": [OURS]}]}


def test_every_ored_term_gets_the_requirement() -> None:
    terms = [
        {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]},
        {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["n7"]}]},
        {"matchExpressions": [{"key": "pool", "operator": "In", "values": ["gpu"]}],
         "matchFields": [{"key": "metadata.name", "operator": "NotIn", "values": ["n9"]}]},
    ]
    sent = gpu_pod(affinity={"nodeAffinity": {REQUIRED: {"nodeSelectorTerms": copy.deepcopy(terms)}}})
    merged = terms_of(admitted(sent))
    assert merged == [
        {"matchExpressions": [*terms[0]["matchExpressions"], OURS]},
        {"matchFields": terms[1]["matchFields"], "matchExpressions": [OURS]},
        {"matchExpressions": [*terms[2]["matchExpressions"], OURS], "matchFields": terms[2]["matchFields"]},
    ]
    # each term alone no longer admits a node without the limiter, and still admits one with it
    for labels, name in (({"zone": "a"}, "n1"), ({}, "n7"), ({"pool": "gpu"}, "n1")):
        assert matches(terms, labels, name) and not matches(merged, labels, name)
        assert matches(merged, {**labels, LABEL: "v1-0123456789ab"}, name)
    assert not matches(merged, {"pool": "gpu", LABEL: "x"}, "n9")  # the pod's own exclusions stay


def test_an_empty_term_still_matches_nothing_and_a_present_requirement_is_not_doubled() -> None:
    pinned = {"key": LABEL, "operator": "In", "values": ["v1-0123456789ab"]}  # a pod pinning a limiter version
    terms = [{}, {"matchExpressions": [OURS]}, {"matchExpressions": [pinned]}]
    merged = terms_of(admitted(gpu_pod(affinity={"nodeAffinity": {REQUIRED: {"nodeSelectorTerms": terms}}})))
    assert merged == [{}, {"matchExpressions": [OURS]}, {"matchExpressions": [pinned, OURS]}]
    assert not matches(merged[:1], {LABEL: "v1"})


def test_required_without_terms_gets_ours() -> None:
    sent = gpu_pod(affinity={"nodeAffinity": {REQUIRED: {"nodeSelectorTerms": []}}})
    assert terms_of(admitted(sent)) == [{"matchExpressions": [OURS]}]


@pytest.mark.parametrize("mode", [LimiterMode.LD_PRELOAD, LimiterMode.LD_SO_PRELOAD, LimiterMode.DEVICE_PLUGIN])
def test_every_mode_loading_the_library_from_the_node_requires_it(mode: LimiterMode) -> None:
    config = WebhookConfig(limiter_mode=mode)
    assert terms_of(admitted(gpu_pod(), config)) == [{"matchExpressions": [OURS]}]
    custom = WebhookConfig(limiter_mode=mode, limiter_node_label="example.com/hami-core")
    assert terms_of(admitted(gpu_pod(), custom)) == [
        {"matchExpressions": [{"key": "example.com/hami-core", "operator": "Exists"}]}]


@pytest.mark.parametrize("config", [WebhookConfig(limiter_mode=LimiterMode.NONE), WebhookConfig(limiter_node_label="")],
                         ids=["mode-none", "label-off"])
def test_no_requirement_when_the_node_does_not_provide_the_library_or_it_is_off(config: WebhookConfig) -> None:
    assert "affinity" not in admitted(gpu_pod(), config)["spec"]


def test_a_mig_only_pod_loads_no_limiter_and_needs_no_label() -> None:
    mig_only = pod(container("trainer", limits={MIG: "1"}))
    assert "affinity" not in admitted(mig_only)["spec"]
    mixed = pod(container("trainer", limits={MIG: "1"}), gpu_container(name="shared", gpu="1", gpumem="1024"))
    assert terms_of(admitted(mixed)) == [{"matchExpressions": [OURS]}]


def test_a_pod_without_gpus_is_not_touched() -> None:
    _, response = run_review(pod(container("web")))
    assert patch_ops(response) == []
