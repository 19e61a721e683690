"""The pods filter keeps for bind (extender/recent_pods.py): kept as JSON, read back equal and fresh, managedFields
left out, bounded in number and time."""

from __future__ import annotations

import copy
import tracemalloc
from typing import Any

import orjson
import pytest

from kube_vgpu.dev.fixtures import scheduled_pod
from kube_vgpu.extender.recent_pods import RecentPods, encode_pod


class ManualClock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


def pod_with_managed_fields(name: str = "p") -> dict[str, Any]:
    pod = scheduled_pod(name, gpus=1, cores=30, memory_percent=30)
    pod["metadata"]["managedFields"] = [
        {"manager": "kubectl", "operation": "Update", "apiVersion": "v1", "fieldsType": "FieldsV1",
         "fieldsV1": {"f:spec": {"f:containers": {"k:{\"name\":\"main\"}": {".": {}}}}}}]
    return pod


def test_a_pod_is_read_back_equal_without_its_managed_fields_and_the_original_untouched() -> None:
    pod = pod_with_managed_fields()
    before = copy.deepcopy(pod)
    recent = RecentPods()
    assert recent.remember("u1", pod) is True
    read = recent.get("u1")
    assert pod == before  # the caller's pod is not changed
    expected = copy.deepcopy(pod)
    del expected["metadata"]["managedFields"]
    assert read == expected
    assert recent.get("u2") is None


def test_each_read_is_a_fresh_object_a_caller_may_change() -> None:
    recent = RecentPods()
    recent.remember("u1", scheduled_pod("p", gpus=1, cores=30, memory_percent=30))
    first = recent.get("u1")
    assert first is not None
    first["metadata"]["labels"]["changed"] = "yes"  # type: ignore[index]
    second = recent.get("u1")
    assert second is not None and second is not first
    assert "changed" not in second["metadata"]["labels"]


def test_remember_says_whether_filter_sees_the_pod_for_the_first_time_within_the_ttl() -> None:
    clock = ManualClock()
    recent = RecentPods(ttl_s=600, clock=clock)
    pod = scheduled_pod("p", gpus=1, cores=30, memory_percent=30)
    assert recent.remember("u1", pod) is True
    clock.now_s = 599
    assert recent.remember("u1", pod) is False  # a retry: its TTL starts again
    clock.now_s = 599 + 599
    assert "u1" in recent and recent.get("u1") == pod
    clock.now_s = 599 + 601
    assert "u1" not in recent and recent.get("u1") is None
    assert recent.remember("u1", pod) is True


def test_the_oldest_pods_go_first_past_the_bound() -> None:
    recent = RecentPods(max_pods=3)
    for number in range(5):
        recent.remember(f"u{number}", scheduled_pod(f"p{number}", gpus=1, cores=10, memory_percent=10))
    assert len(recent) == 3
    assert [recent.get(f"u{number}") is not None for number in range(5)] == [False, False, True, True, True]


def test_a_pod_json_has_no_form_for_is_kept_as_given() -> None:
    pod: dict[str, Any] = {"metadata": {"name": "p", "uid": "u1"}, "spec": {"weird": {1, 2}}}
    assert encode_pod(pod) is pod
    recent = RecentPods()
    recent.remember("u1", pod)
    assert recent.get("u1") is pod


@pytest.mark.parametrize("managed_fields", [False, True])
def test_kept_pods_take_well_under_half_the_memory_of_their_parsed_objects(managed_fields: bool) -> None:
    template = pod_with_managed_fields() if managed_fields else scheduled_pod("p", gpus=1, cores=30,
                                                                              memory_percent=30)
    raw = orjson.dumps(template)
    tracemalloc.start()
    try:
        parsed = [orjson.loads(raw) for _ in range(500)]
        parsed_bytes = tracemalloc.get_traced_memory()[0]
        recent = RecentPods()
        baseline = tracemalloc.get_traced_memory()[0]
        for number, pod in enumerate(parsed):
            recent.remember(f"u{number}", pod)
        kept_bytes = tracemalloc.get_traced_memory()[0] - baseline
    finally:
        tracemalloc.stop()
    assert kept_bytes < parsed_bytes / 2, (kept_bytes, parsed_bytes)
