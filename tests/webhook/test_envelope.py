"""The AdmissionReview envelope: versions, uids, malformed bodies (HTTP 400 with a clear message, never an
exception), requests that are not ours to judge; plus a property test over generated GPU pods."""

from __future__ import annotations

import copy
import json
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kube_vgpu.webhook.config import LimiterMode, WebhookConfig
from kube_vgpu.webhook.mutate import Result, review
from tests.webhook.builders import (
    CORES,
    GPU,
    MEM,
    PCT,
    admission_review,
    apply_response,
    container,
    decode,
    gpu_container,
    patch_ops,
    pod,
    run_review,
)

CONFIG = WebhookConfig()


@pytest.mark.parametrize("api_version", ["admission.k8s.io/v1", "admission.k8s.io/v1beta1"])
def test_answers_in_the_version_asked_with_the_uid(api_version: str) -> None:
    body = admission_review(pod(gpu_container(gpu="1")), api_version=api_version, uid="c0ffee")
    outcome = review(orjson.dumps(body), CONFIG)
    doc = decode(outcome)
    assert doc["apiVersion"] == api_version
    assert doc["kind"] == "AdmissionReview"
    assert doc["response"]["uid"] == "c0ffee"
    assert doc["response"]["allowed"] is True
    assert set(doc) == {"apiVersion", "kind", "response"}


def _review_with(**request_changes: Any) -> bytes:
    body = admission_review(pod(gpu_container(gpu="1")))
    for key, value in request_changes.items():
        if value is _DELETE:
            del body["request"][key]
        else:
            body["request"][key] = value
    return orjson.dumps(body)


_DELETE = object()

MALFORMED = [
    # (the parser's own detail follows in parentheses; its wording is orjson's, so only the start is compared)
    ("not-json", b"{not json", "body is not valid JSON ("),
    ("empty", b"", "body is not valid JSON ("),
    ("json-array", b"[]", "body must be a JSON object"),
    (
        "wrong-api-version",
        orjson.dumps({"apiVersion": "admission.k8s.io/v2", "kind": "AdmissionReview", "request": {}}),
        "apiVersion must be one of admission.k8s.io/v1, admission.k8s.io/v1beta1, got 'admission.k8s.io/v2'",
    ),
    (
        "wrong-kind",
        orjson.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "Pod"}),
        "kind must be AdmissionReview, got 'Pod'",
    ),
    (
        "no-request",
        orjson.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview"}),
        "request must be an object",
    ),
    ("no-uid", _review_with(uid=_DELETE), "request.uid must be a non-empty string"),
    ("empty-uid", _review_with(uid=""), "request.uid must be a non-empty string"),
    ("no-operation", _review_with(operation=_DELETE), "request.operation must be a non-empty string"),
    (
        "no-kind",
        _review_with(kind=_DELETE),
        "request.kind must be an object with a kind, like {'version': 'v1', 'kind': 'Pod'}",
    ),
    ("no-object", _review_with(object=None), "request.object must be a Pod object with a spec"),
    ("object-without-spec", _review_with(object={"metadata": {}}), "request.object must be a Pod object with a spec"),
    (
        "metadata-not-object",
        _review_with(object={"metadata": [], "spec": {}}),
        "request.object.metadata must be an object, got a list",
    ),
    (
        "update-without-old-object",
        _review_with(operation="UPDATE", oldObject=None),
        "request.oldObject must be a Pod object with a spec",
    ),
    # Wrong-typed fields (issue 20, item 10): each one a 400 naming the field, never a 500
    ("uid-a-list", _review_with(uid=["a", "b"]), "request.uid must be a non-empty string"),
    ("spec-a-list", _review_with(object={"spec": []}), "request.object.spec must be an object, got a list"),
    (
        "containers-an-object",
        _review_with(object={"spec": {"containers": {"name": "c"}}}),
        "request.object.spec.containers must be a list, got an object",
    ),
    (
        "containers-not-objects",
        _review_with(object={"spec": {"containers": ["x"]}}),
        "request.object.spec.containers[0] must be an object, got a string",
    ),
    (
        "resources-not-object",
        _review_with(object={"spec": {"containers": [{"name": "c", "resources": {"limits": 7}}]}}),
        "request.object.spec.containers[0].resources.limits must be an object, got a number",
    ),
    (
        "quantity-a-list",
        _review_with(object={"spec": {"containers": [{"name": "c", "resources": {"limits": {GPU: [1]}}}]}}),
        "request.object.spec.containers[0].resources.limits['nvidia.com/gpu'] must be a quantity (a string or a "
        "number), got a list",
    ),
    (
        "annotations-a-list",
        _review_with(object={"metadata": {"annotations": ["kube-vgpu.io/x"]}, "spec": {"containers": []}}),
        "request.object.metadata.annotations must be an object, got a list",
    ),
    (
        "annotation-value-a-number",
        _review_with(object={"metadata": {"annotations": {"a": 1}}, "spec": {"containers": []}}),
        "request.object.metadata.annotations['a'] must be a string, got a number",
    ),
    (
        "old-object-labels-a-string",
        _review_with(operation="UPDATE", oldObject={"metadata": {"labels": "x"}, "spec": {"containers": []}}),
        "request.oldObject.metadata.labels must be an object, got a string",
    ),
    (
        "env-a-string",
        _review_with(object={"spec": {"containers": [{"name": "c", "env": "A=1"}]}}),
        "request.object.spec.containers[0].env must be a list, got a string",
    ),
    (
        "init-container-name-a-number",
        _review_with(object={"spec": {"containers": [], "initContainers": [{"name": 7}]}}),
        "request.object.spec.initContainers[0].name must be a string, got a number",
    ),
    (
        "privileged-a-string",
        _review_with(object={"spec": {"containers": [{"name": "c", "securityContext": {"privileged": "yes"}}]}}),
        "request.object.spec.containers[0].securityContext.privileged must be a boolean, got a string",
    ),
]


@pytest.mark.parametrize(("body", "message"), [(b, m) for _, b, m in MALFORMED], ids=[i for i, _, _ in MALFORMED])
def test_malformed_reviews_get_400_with_a_clear_message(body: bytes, message: str) -> None:
    outcome = review(body, CONFIG)
    assert outcome.http_status == 400
    assert outcome.result is Result.MALFORMED
    status = decode(outcome)
    full = status.pop("message")
    assert status == {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "BadRequest", "code": 400}
    wanted = f"malformed AdmissionReview: {message}"
    assert full.startswith(wanted) if message.endswith("(") or message.endswith(": ") else full == wanted


@pytest.mark.parametrize(
    "changes",
    [
        {"operation": "DELETE", "object": None},
        {"operation": "CONNECT"},
        {"subResource": "status"},
        {"kind": {"group": "", "version": "v1", "kind": "ConfigMap"}},
        {"kind": {"group": "apps", "version": "v1", "kind": "Pod"}},
    ],
    ids=["delete", "connect", "status-subresource", "configmap", "other-group"],
)
def test_requests_not_ours_to_judge_are_allowed_unchanged(changes: dict[str, Any]) -> None:
    outcome = review(_review_with(**changes), CONFIG)
    assert outcome.http_status == 200
    response = decode(outcome)["response"]
    assert response["allowed"] is True and "patch" not in response


def test_a_denied_review_keeps_the_uid_and_version() -> None:
    body = admission_review(pod(gpu_container(gpu="1", gpucores="150")), api_version="admission.k8s.io/v1beta1")
    doc = decode(review(orjson.dumps(body), CONFIG))
    assert doc["apiVersion"] == "admission.k8s.io/v1beta1"
    assert doc["response"]["uid"] == body["request"]["uid"]
    assert doc["response"]["allowed"] is False


# ---------------------------------------------------------------------------------------------
# Property: for any valid GPU request and any pre-existing env / mounts / volumes, the patch applies cleanly,
# the result carries exactly the limits asked for, and a second review changes nothing.
# ---------------------------------------------------------------------------------------------

_names = st.sampled_from(["trainer", "worker", "a", "b-1", "x"])
_user_env = st.lists(
    st.builds(
        lambda name, value: {"name": name, "value": value},
        st.sampled_from(["PATH", "CUDA_DEVICE_SM_LIMIT", "CUDA_DEVICE_MEMORY_LIMIT_0", "LD_PRELOAD", "HOME", "X"]),
        st.sampled_from(["1", "100", "/opt/a.so", ""]),
    ),
    max_size=4,
)


@st.composite
def gpu_pods(draw: st.DrawFn) -> dict[str, Any]:
    count = draw(st.integers(1, 4))
    containers = []
    for index in range(draw(st.integers(1, 3))):
        limits: dict[str, Any] = {}
        if draw(st.booleans()):
            limits[GPU] = str(count)
        memory = draw(st.sampled_from(["none", "mib", "pct"]))
        if memory == "mib":
            limits[MEM] = str(draw(st.integers(1, 81920)))
        elif memory == "pct":
            limits[PCT] = str(draw(st.integers(1, 100)))
        if draw(st.booleans()) or not limits:
            limits[CORES] = str(draw(st.integers(0, 100)))
        extra: dict[str, Any] = {}
        if draw(st.booleans()):
            extra["env"] = draw(_user_env)
        if draw(st.booleans()):
            extra["volumeMounts"] = [{"name": "data", "mountPath": "/data"}]
        requests = dict(limits) if draw(st.booleans()) else None
        containers.append(container(f"{draw(_names)}-{index}", limits=limits, requests=requests, **extra))
    spec_extra: dict[str, Any] = {}
    if draw(st.booleans()):
        spec_extra["volumes"] = [{"name": "data", "emptyDir": {}}]
    return pod(*containers, **spec_extra)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(gpu_pods(), st.sampled_from(list(LimiterMode)))
def test_any_valid_gpu_pod_patches_cleanly_and_idempotently(sent: dict[str, Any], mode: LimiterMode) -> None:
    config = WebhookConfig(limiter_mode=mode)
    outcome, response = run_review(sent, config)
    assert outcome.result is Result.MUTATED
    mutated = apply_response(sent, response)
    assert mutated["spec"]["schedulerName"] == "kube-vgpu-scheduler"
    for original, result in zip(sent["spec"]["containers"], mutated["spec"]["containers"], strict=True):
        merged = {**(original["resources"].get("requests") or {}), **(original["resources"].get("limits") or {})}
        limits, requests = result["resources"]["limits"], result["resources"]["requests"]
        gpu_part = {k: v for k, v in limits.items() if k.startswith("nvidia.com/")}
        assert gpu_part == {k: v for k, v in requests.items() if k.startswith("nvidia.com/")}
        count = int(merged.get(GPU, "1"))
        assert gpu_part[GPU] == merged.get(GPU, "1")
        values: dict[str, list[str]] = {}
        for entry in result["env"]:
            values.setdefault(entry["name"], []).append(entry.get("value", ""))
        assert values["CUDA_DEVICE_SM_LIMIT"] == [merged.get(CORES, "0")]
        memory_names = sorted(n for n in values if n.startswith("CUDA_DEVICE_MEMORY_LIMIT"))
        if MEM in merged:
            assert memory_names == [f"CUDA_DEVICE_MEMORY_LIMIT_{i}" for i in range(count)]
            assert all(values[n] == [f"{merged[MEM]}m"] for n in memory_names)
        else:
            assert memory_names == []
        if mode in (LimiterMode.LD_PRELOAD, LimiterMode.DEVICE_PLUGIN):  # one, ours first; other modes leave it
            assert len(values["LD_PRELOAD"]) == 1
            assert values["LD_PRELOAD"][0].split(":")[0] == "/usr/local/vgpu/libvgpu.so"
        else:
            assert values.get("LD_PRELOAD", []) == [
                e.get("value", "") for e in original.get("env", []) if e["name"] == "LD_PRELOAD"
            ]
    names = [volume["name"] for volume in mutated["spec"]["volumes"]]
    assert len(names) == len(set(names))
    again_outcome, again = run_review(copy.deepcopy(mutated), config)
    assert again_outcome.result is Result.ALLOWED and patch_ops(again) == []


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8) | st.sampled_from([GPU, MEM, CORES, "-1", "1"]),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(
            st.sampled_from(["spec", "containers", "resources", "limits", "name", "env", GPU, MEM, "metadata", "x"]),
            inner,
            max_size=4,
        )
    ),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(obj=_json, old=_json, operation=st.sampled_from(["CREATE", "UPDATE", "DELETE"]))
def test_any_json_in_the_object_is_answered_200_or_400_never_an_exception(obj: Any, old: Any, operation: str) -> None:
    body = admission_review(pod(gpu_container(gpu="1")), operation=operation)
    body["request"]["object"] = {"spec": obj} if isinstance(obj, dict) and "spec" not in obj else obj
    body["request"]["oldObject"] = old
    outcome = review(json.dumps(body).encode(), CONFIG)  # stdlib json: integers beyond 64 bits too
    assert outcome.http_status in (200, 400)
    assert isinstance(orjson.loads(outcome.body), dict)
