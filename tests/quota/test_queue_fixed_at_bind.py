"""Issue 20 item 9: a pod's queue is fixed when it is bound. Relabelling a running pod (removing or changing
kueue.x-k8s.io/queue-name) must not take its usage out of its team's quota, not even across an extender restart,
which rebuilds everything from the pods' annotations."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from kube_vgpu import protocol
from tests.quota.helpers import FLAVORS, a100_node, gpu_queue, local_queue, make_env, queued_pod

QUOTA = (FLAVORS + gpu_queue("team-a", {"a100": 4}) + gpu_queue("team-b", {"a100": 4})
         + local_queue("team-a", "q", "team-a") + local_queue("team-a", "other", "team-b"))


def _relabel(pod: dict[str, Any], queue: str | None) -> dict[str, Any]:
    changed = copy.deepcopy(pod)
    labels = changed["metadata"].setdefault("labels", {})
    labels.pop(protocol.LABEL_KUEUE_QUEUE_NAME, None)
    if queue is not None:
        labels[protocol.LABEL_KUEUE_QUEUE_NAME] = queue
    return changed


def test_the_bind_records_the_queue_in_the_same_write_as_the_assignment() -> None:
    env = make_env(QUOTA, [a100_node("a100-0")])
    queued, unqueued = queued_pod("q", gpus=1, memory_mib=1000), queued_pod(None, gpus=1, memory_mib=1000)
    for p in (queued, unqueued):
        assert env.submit(p) == "a100-0"
    stored = [env.cluster.get_pod("team-a", p["metadata"]["name"]) for p in (queued, unqueued)]
    assert [p["metadata"]["annotations"][protocol.POD_QUEUE_ANNOTATION] for p in stored if p] == ["q", ""]


@pytest.mark.parametrize("new_queue", [None, "other", "no-such-queue"], ids=["removed", "moved", "dangling"])
def test_relabelling_a_running_pod_keeps_it_counted_where_it_was_admitted(new_queue: str | None) -> None:
    env = make_env(QUOTA, [a100_node("a100-0")])
    p = queued_pod("q", gpus=2, memory_mib=1000)
    assert env.submit(p) == "a100-0"
    stored = env.cluster.get_pod("team-a", p["metadata"]["name"])
    assert stored is not None
    relabelled = _relabel(stored, new_queue)
    env.state.upsert_pod(relabelled)  # the watch delivers the relabel to the running extender
    assert (env.used("team-a", "a100"), env.used("team-b", "a100")) == (2, 0)
    restarted = make_env(QUOTA, [a100_node("a100-0")], pods=[relabelled])  # rebuilt from the API's pods only
    assert (restarted.used("team-a", "a100"), restarted.used("team-b", "a100")) == (2, 0)
    # and team-a's quota is still spent: 2 more fit, a third pod of 2 does not
    assert restarted.submit(queued_pod("q", gpus=2, memory_mib=1000)) == "a100-0"
    assert restarted.filter(queued_pod("q", gpus=2, memory_mib=1000)).passed == []


def test_adding_a_queue_label_to_a_pod_bound_without_one_does_not_charge_it_later() -> None:
    env = make_env(QUOTA, [a100_node("a100-0")])
    p = queued_pod(None, gpus=1, memory_mib=1000)
    assert env.submit(p) == "a100-0"
    stored = env.cluster.get_pod("team-a", p["metadata"]["name"])
    assert stored is not None
    restarted = make_env(QUOTA, [a100_node("a100-0")], pods=[_relabel(stored, "q")])
    assert restarted.used("team-a", "a100") == 0


def test_pods_bound_before_the_annotation_existed_keep_using_their_label() -> None:
    env = make_env(QUOTA, [a100_node("a100-0")])
    p = queued_pod("q", gpus=1, memory_mib=1000)
    assert env.submit(p) == "a100-0"
    stored = env.cluster.get_pod("team-a", p["metadata"]["name"])
    assert stored is not None
    del stored["metadata"]["annotations"][protocol.POD_QUEUE_ANNOTATION]
    restarted = make_env(QUOTA, [a100_node("a100-0")], pods=[stored])
    assert restarted.used("team-a", "a100") == 1
