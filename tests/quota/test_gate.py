"""The quota gate through the real Scheduler (filter and bind) over the snapshot API."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from kube_vgpu import protocol
from kube_vgpu.extender.scheduler import BindError, FilterOutcome
from tests.extender.test_bind_failures import FlakyCluster
from tests.quota.helpers import (
    FLAVORS,
    GPU,
    GPUCORES,
    GPUMEM,
    a100_node,
    gpu_queue,
    local_queue,
    make_env,
    queued_pod,
    v100_node,
)

TEAM_A = FLAVORS + gpu_queue("team-a", {"a100": 2, "v100": 4}) + local_queue("team-a", "q", "team-a")


def reasons(outcome: str | FilterOutcome) -> dict[str, str]:
    assert isinstance(outcome, FilterOutcome), f"expected a refusal, got bound to {outcome}"
    return {**outcome.failed, **outcome.unresolvable}


def test_flavor_exhausted_while_the_next_still_fits() -> None:
    env = make_env(TEAM_A, [a100_node("a100-0"), v100_node("v100-0")])
    assert env.submit(queued_pod("q", gpus=2, memory_mib=1000)) == "a100-0"  # a100: 2 of 2
    assert env.used("team-a", "a100") == 2
    second = queued_pod("q", gpus=1, memory_mib=1000)
    env.cluster.add_pod(second)
    outcome = env.filter(second)
    assert outcome.passed == ["v100-0"]  # v100 is the next flavor and still has room
    reason = outcome.failed["a100-0"]
    assert reason == ("quota: ClusterQueue team-a (LocalQueue team-a/q): flavor a100, nvidia.com/gpu: needs 1, "
                      "used 2/2 vGPUs (nominal 2), 0 available now")
    assert env.retry(second) == "v100-0"
    assert (env.used("team-a", "a100"), env.used("team-a", "v100")) == (2, 1)


def test_node_outside_every_flavor_is_refused() -> None:
    env = make_env(FLAVORS + gpu_queue("team-a", {"a100": 4}) + local_queue("team-a", "q", "team-a"),
                   [a100_node("a100-0"), v100_node("v100-0")])
    outcome = env.submit(queued_pod("q", gpus=1, memory_mib=1000))
    assert outcome == "a100-0"
    refused = env.filter(queued_pod("q", gpus=1, memory_mib=1000)).failed["v100-0"]
    assert "quota: the node carries the nodeLabels of no flavor of ClusterQueue team-a for nvidia.com/gpu" in refused
    assert "a100: nvidia.com/gpu.product=NVIDIA-A100-SXM4-80GB" in refused


def test_usage_is_what_was_assigned_memory_and_cores_summed() -> None:
    quota = FLAVORS + """
---
apiVersion: kueue.x-k8s.io/v1beta2
kind: ClusterQueue
metadata: {name: team-a}
spec:
  namespaceSelector: {}
  resourceGroups:
  - coveredResources: [nvidia.com/gpu, nvidia.com/gpumem, nvidia.com/gpucores, pods]
    flavors:
    - name: a100
      resources:
      - {name: nvidia.com/gpu, nominalQuota: 16}
      - {name: nvidia.com/gpumem, nominalQuota: 245760}
      - {name: nvidia.com/gpucores, nominalQuota: 300}
      - {name: pods, nominalQuota: 10}
""" + local_queue("team-a", "q", "team-a")
    env = make_env(quota, [a100_node("a100-0"), a100_node("a100-1")])
    # 2 vGPUs x 50% of an 80 GiB GPU, 30% cores each: 81920 MiB, 60 cores
    assert env.submit(queued_pod("q", gpus=2, memory_percent=50, cores=30)) in ("a100-0", "a100-1")
    # no gpumem: the whole GPU's memory is assigned and counted; gpucores 100: the whole GPU's compute
    assert env.submit(queued_pod("q", gpus=1, cores=100)) in ("a100-0", "a100-1")
    assert env.used("team-a", "a100", GPU) == 3
    assert env.used("team-a", "a100", GPUMEM) == 81920 + 81920
    assert env.used("team-a", "a100", GPUCORES) == 60 + 100
    assert env.used("team-a", "a100", "pods") == 2
    # 245760 - 163840 = 81920 MiB left: a pod asking for a whole GPU fits, cores 300 - 160 = 140 too
    big = queued_pod("q", gpus=2, memory_mib=40960, cores=80)  # 81920 MiB but 160 cores
    refused = reasons(env.submit(big))
    # a node that still has the GPUs names the quota (only the resource that falls short: memory fits)
    assert refused["a100-1"] == ("quota: ClusterQueue team-a (LocalQueue team-a/q): flavor a100, "
                                 "nvidia.com/gpucores: needs 160, used 160/300 percent of a GPU (nominal 300), "
                                 "140 available now")


def test_namespace_not_selected() -> None:
    quota = FLAVORS + gpu_queue("research", {"a100": 8}, selector="{matchLabels: {team: research}}") + """
---
apiVersion: v1
kind: Namespace
metadata: {name: lab, labels: {team: research}}
""" + local_queue("lab", "q", "research") + local_queue("sales", "q", "research")
    env = make_env(quota, [a100_node("a100-0")])
    assert env.submit(queued_pod("q", namespace="lab", gpus=1, memory_mib=1000)) == "a100-0"
    refused = reasons(env.submit(queued_pod("q", namespace="sales", gpus=1, memory_mib=1000)))
    assert refused["a100-0"] == ("quota: ClusterQueue research (LocalQueue sales/q): namespace sales is not "
                                 "selected by the namespaceSelector (team=research)")


def test_null_namespace_selector_selects_nothing() -> None:
    quota = FLAVORS + gpu_queue("closed", {"a100": 8}).replace("  namespaceSelector: {}\n", "") + local_queue(
        "team-a", "q", "closed")
    env = make_env(quota, [a100_node("a100-0")])
    assert "namespaceSelector is null, which selects no namespace" in reasons(
        env.submit(queued_pod("q", gpus=1, memory_mib=1000)))["a100-0"]


def test_selector_on_the_namespace_name_label_needs_no_namespace_objects() -> None:
    selector = "{matchExpressions: [{key: kubernetes.io/metadata.name, operator: In, values: [team-a]}]}"
    quota = FLAVORS + gpu_queue("team-a", {"a100": 8}, selector=selector) + local_queue("team-a", "q", "team-a")
    env = make_env(quota, [a100_node("a100-0")])
    assert env.submit(queued_pod("q", gpus=1, memory_mib=1000)) == "a100-0"


@pytest.mark.parametrize("strategy", ["StrictFIFO", "BestEffortFIFO"])
def test_head_of_line_blocking(strategy: str) -> None:
    quota = FLAVORS + gpu_queue("team-a", {"a100": 4}, extra=f"  queueingStrategy: {strategy}\n") + local_queue(
        "team-a", "q", "team-a")
    env = make_env(quota, [a100_node("a100-0", gpus=8)])
    first = queued_pod("q", gpus=2, memory_mib=1000, created="2026-01-01T00:00:00Z")
    assert env.submit(first) == "a100-0"  # 2 of 4 used
    older = queued_pod("q", gpus=3, memory_mib=1000, created="2026-01-01T00:01:00Z")
    assert "needs 3, used 2/4" in reasons(env.submit(older))["a100-0"]  # waits for quota
    newer = queued_pod("q", gpus=1, memory_mib=1000, created="2026-01-01T00:02:00Z")
    result = env.submit(newer)
    if strategy == "StrictFIFO":
        assert reasons(result)["a100-0"] == (
            f"quota: ClusterQueue team-a (LocalQueue team-a/q) is StrictFIFO and pod team-a/"
            f"{older['metadata']['name']} (priority 0) is ahead of this one, waiting for quota")
        env.delete(first)  # quota frees up: the head goes first, then the one behind it
        assert env.retry(older) == "a100-0"
        assert env.retry(newer) == "a100-0"
        assert env.used("team-a", "a100") == 4
    else:
        assert result == "a100-0"  # BestEffortFIFO: the older pod that does not fit blocks nobody
        assert env.used("team-a", "a100") == 3


def test_strict_fifo_orders_by_priority_first() -> None:
    quota = FLAVORS + gpu_queue("team-a", {"a100": 4}, extra="  queueingStrategy: StrictFIFO\n") + local_queue(
        "team-a", "q", "team-a") + """
---
apiVersion: kueue.x-k8s.io/v1beta1
kind: WorkloadPriorityClass
metadata: {name: high}
value: 1000
"""
    env = make_env(quota, [a100_node("a100-0", gpus=8)])
    assert env.submit(queued_pod("q", gpus=2, memory_mib=1000)) == "a100-0"
    low_old = queued_pod("q", gpus=3, memory_mib=1000, created="2026-01-01T00:00:00Z", priority=10)
    assert isinstance(env.submit(low_old), FilterOutcome)
    # newer but of higher priority (the WorkloadPriorityClass wins over spec.priority): ahead in the queue
    high_new = queued_pod("q", gpus=1, memory_mib=1000, created="2026-01-01T01:00:00Z", priority=0,
                          priority_class="high")
    assert env.submit(high_new) == "a100-0"
    # an equal-priority, newer pod is behind the waiting one
    assert "is ahead of this one" in next(iter(reasons(env.submit(
        queued_pod("q", gpus=1, memory_mib=1000, created="2026-01-01T02:00:00Z", priority=10))).values()))
    charges = env.gate.charges_of("team-a")
    assert [c.priority for c in charges] == [0, 1000]  # per-pod usage with priority, lowest first (preemption)


def test_a_pod_that_can_never_fit_does_not_block_the_queue() -> None:
    quota = FLAVORS + gpu_queue("team-a", {"a100": 4}, extra="  queueingStrategy: StrictFIFO\n") + local_queue(
        "team-a", "q", "team-a")
    env = make_env(quota, [a100_node("a100-0", gpus=8)])
    huge = queued_pod("q", gpus=6, memory_mib=1000, created="2026-01-01T00:00:00Z")
    assert "needs 6, used 0/4 vGPUs (nominal 4), never fits" in reasons(env.submit(huge))["a100-0"]
    assert env.submit(queued_pod("q", gpus=1, memory_mib=1000, created="2026-01-01T00:01:00Z")) == "a100-0"


def test_stop_policy_hold_stops_new_admissions_only() -> None:
    held = FLAVORS + gpu_queue("team-a", {"a100": 4}) + local_queue("team-a", "q", "team-a")
    env = make_env(held, [a100_node("a100-0")])
    running = queued_pod("q", gpus=1, memory_mib=1000)
    assert env.submit(running) == "a100-0"
    hold = gpu_queue("team-a", {"a100": 4}, extra="  stopPolicy: Hold\n")
    [held_queue] = [d for d in yaml.safe_load_all(hold) if d]
    env.gate.set_cluster_objects("ClusterQueue", {("", "team-a"): held_queue})  # the cluster's object wins
    refused = reasons(env.submit(queued_pod("q", gpus=1, memory_mib=1000)))
    assert refused["a100-0"] == ("quota: ClusterQueue team-a (LocalQueue team-a/q) is inactive: stopped "
                                 "(stopPolicy Hold); no new pods are admitted")
    assert env.used("team-a", "a100") == 1  # admitted pods run on and stay counted
    env.gate.set_cluster_objects("ClusterQueue", {})
    assert env.submit(queued_pod("q", gpus=1, memory_mib=1000)) == "a100-0"
    assert env.used("team-a", "a100") == 2


def test_local_queue_stop_policy() -> None:
    quota = FLAVORS + gpu_queue("team-a", {"a100": 4}) + local_queue("team-a", "q", "team-a").replace(
        "spec: {clusterQueue: team-a}", "spec: {clusterQueue: team-a, stopPolicy: HoldAndDrain}")
    env = make_env(quota, [a100_node("a100-0")])
    assert "LocalQueue team-a/q is stopped (stopPolicy HoldAndDrain)" in reasons(
        env.submit(queued_pod("q", gpus=1, memory_mib=1000)))["a100-0"]


@pytest.mark.parametrize(
    ("unqueued", "admitted", "counted"),
    [("admit", True, 0), ("default", True, 1), ("refuse", False, 0)],
)
def test_pods_without_a_queue(unqueued: str, admitted: bool, counted: int) -> None:
    env = make_env(TEAM_A + local_queue("team-a", "default", "team-a"), [a100_node("a100-0")], unqueued=unqueued)
    result = env.submit(queued_pod(None, gpus=1, memory_mib=1000))
    assert (result == "a100-0") is admitted
    assert env.used("team-a", "a100") == counted
    if not admitted:
        assert "has no kueue.x-k8s.io/queue-name label" in reasons(result)["a100-0"]


def test_default_policy_without_a_default_local_queue_admits_uncounted() -> None:
    env = make_env(TEAM_A, [a100_node("a100-0")], unqueued="default")
    assert env.submit(queued_pod(None, gpus=1, memory_mib=1000)) == "a100-0"
    assert env.used("team-a", "a100") == 0


def test_unknown_local_queue_and_invalid_cluster_queue() -> None:
    broken = gpu_queue("broken", {"a100": 1}).replace("nominalQuota: 1", "nominalQuota: many")
    env = make_env(TEAM_A + broken + local_queue("team-a", "b", "broken"), [a100_node("a100-0")])
    assert reasons(env.submit(queued_pod("nope", gpus=1, memory_mib=1000)))["a100-0"] == (
        "quota: LocalQueue team-a/nope (label kueue.x-k8s.io/queue-name) does not exist")
    refused = reasons(env.submit(queued_pod("b", gpus=1, memory_mib=1000)))["a100-0"]
    assert refused.startswith("quota: ClusterQueue broken (LocalQueue team-a/b) does not exist (it is invalid: ")
    assert "spec.resourceGroups[0].flavors[0].resources[0].nominalQuota: 'many' is not a Kubernetes quantity" in refused
    assert env.submit(queued_pod("q", gpus=1, memory_mib=1000)) == "a100-0"  # the valid queue keeps working


def test_missing_resource_flavor_makes_the_queue_inactive() -> None:
    env = make_env(gpu_queue("team-a", {"h100": 4}) + local_queue("team-a", "q", "team-a"), [a100_node("a100-0")])
    assert "is inactive: ResourceFlavor h100 not found" in reasons(
        env.submit(queued_pod("q", gpus=1, memory_mib=1000)))["a100-0"]


def test_released_when_deleted_or_finished() -> None:
    env = make_env(TEAM_A, [a100_node("a100-0")])
    first, second = queued_pod("q", gpus=1, memory_mib=1000), queued_pod("q", gpus=1, memory_mib=1000)
    assert env.submit(first) == env.submit(second) == "a100-0"
    assert env.used("team-a", "a100") == 2
    assert isinstance(env.submit(queued_pod("q", gpus=1, memory_mib=1000)), FilterOutcome)
    env.delete(first)
    assert env.used("team-a", "a100") == 1
    finished = env.cluster.get_pod("team-a", second["metadata"]["name"])
    assert finished is not None
    finished["status"]["phase"] = "Succeeded"
    env.state.upsert_pod(finished)
    assert env.used("team-a", "a100") == 0


def test_rebuilt_from_assignment_annotations_at_start_up() -> None:
    env = make_env(TEAM_A, [a100_node("a100-0"), v100_node("v100-0")])
    for _ in range(2):
        env.submit(queued_pod("q", gpus=1, memory_mib=1000))
    env.submit(queued_pod("q", gpus=3, memory_mib=1000))
    assert (env.used("team-a", "a100"), env.used("team-a", "v100")) == (2, 3)
    # a new extender process: the same API objects, nothing else
    stored: list[dict[str, Any]] = [env.cluster.get_pod(*key) for key in env.cluster.pods]  # type: ignore[misc]
    restarted = make_env(TEAM_A, [a100_node("a100-0"), v100_node("v100-0")], pods=stored)
    assert (restarted.used("team-a", "a100"), restarted.used("team-a", "v100")) == (2, 3)
    assert restarted.gate.snapshot()["clusterQueues"][0]["admittedPods"] == 3


def test_node_seen_after_its_pods_is_counted_then() -> None:
    env = make_env(TEAM_A, [a100_node("a100-0")])
    p = queued_pod("q", gpus=1, memory_mib=1000)
    assert env.submit(p) == "a100-0"
    stored = env.cluster.get_pod("team-a", p["metadata"]["name"])
    assert stored is not None
    late = make_env(TEAM_A, [], pods=[stored])  # live mode: the pod watch may run ahead of the node watch
    assert late.used("team-a", "a100") == 0
    late.state.upsert_node(a100_node("a100-0"))
    late.node_names = ["a100-0"]
    late.filter(queued_pod("q", gpus=1, memory_mib=1000))  # any decision resolves it first
    assert late.used("team-a", "a100") == 1


def test_failed_binding_rolls_the_quota_back() -> None:
    env = make_env(TEAM_A, [a100_node("a100-0")], cluster_cls=FlakyCluster)
    cluster = env.cluster
    assert isinstance(cluster, FlakyCluster)
    p = queued_pod("q", gpus=2, memory_mib=1000)
    cluster.add_pod(p)
    assert env.filter(p).passed == ["a100-0"]
    cluster.fail_bind = True
    with pytest.raises(BindError, match="binding"):
        env.scheduler.bind("team-a", p["metadata"]["name"], p["metadata"]["uid"], "a100-0")
    assert env.used("team-a", "a100") == 0
    cluster.fail_bind = False
    env.scheduler.bind("team-a", p["metadata"]["name"], p["metadata"]["uid"], "a100-0")
    assert env.used("team-a", "a100") == 2


def test_bind_rechecks_quota_taken_since_filter() -> None:
    env = make_env(TEAM_A, [a100_node("a100-0")])
    a, b = queued_pod("q", gpus=2, memory_mib=1000), queued_pod("q", gpus=1, memory_mib=1000)
    for p in (a, b):
        env.cluster.add_pod(p)
        assert env.filter(p).passed == ["a100-0"]  # both fit when filtered
    env.scheduler.bind("team-a", a["metadata"]["name"], a["metadata"]["uid"], "a100-0")
    with pytest.raises(BindError, match=r"flavor a100, nvidia\.com/gpu: needs 1, used 2/2"):
        env.scheduler.bind("team-a", b["metadata"]["name"], b["metadata"]["uid"], "a100-0")
    assert env.used("team-a", "a100") == 2


def test_cohort_borrowing_through_the_scheduler() -> None:
    quota = (FLAVORS + gpu_queue("team-a", {"a100": 2}, cohort="ai", borrowing={"a100": 1})
             + gpu_queue("team-b", {"a100": 4}, cohort="ai")
             + local_queue("team-a", "q", "team-a") + local_queue("team-b", "q", "team-b"))
    env = make_env(quota, [a100_node("a100-0", gpus=8)])
    assert env.submit(queued_pod("q", gpus=3, memory_mib=1000)) == "a100-0"  # 2 own + 1 borrowed
    refused = reasons(env.submit(queued_pod("q", gpus=1, memory_mib=1000)))["a100-0"]
    assert "needs 1, used 3/3 vGPUs (nominal 2, borrowing limit 1), 0 available now" in refused
    # team-b lent 1: it has 3 left
    assert env.submit(queued_pod("q", namespace="team-b", gpus=3, memory_mib=1000)) == "a100-0"
    assert isinstance(env.submit(queued_pod("q", namespace="team-b", gpus=1, memory_mib=1000)), FilterOutcome)
    snapshot = env.gate.snapshot()
    by_queue = {q["name"]: q["flavors"][0]["resources"][0] for q in snapshot["clusterQueues"]}
    assert {k: by_queue["team-a"][k] for k in ("nominal", "used", "borrowed", "lent", "available")} == {
        "nominal": 2, "used": 3, "borrowed": 1, "lent": 0, "available": 0}
    assert {k: by_queue["team-b"][k] for k in ("nominal", "used", "borrowed", "lent", "available")} == {
        "nominal": 4, "used": 3, "borrowed": 0, "lent": 1, "available": 0}


def test_snapshot_lists_pending_pods() -> None:
    env = make_env(TEAM_A, [a100_node("a100-0")])
    assert env.submit(queued_pod("q", gpus=2, memory_mib=1000)) == "a100-0"
    waiting = queued_pod("q", gpus=1, memory_mib=1000)
    env.submit(waiting)
    [queue] = env.gate.snapshot()["clusterQueues"]
    assert (queue["admittedPods"], queue["pendingPods"], queue["waitingForQuota"]) == (1, 1, 1)
    assert queue["pending"][0]["pod"] == f"team-a/{waiting['metadata']['name']}"
    assert "needs 1, used 2/2" in queue["pending"][0]["reason"]
    env.delete(waiting)
    [queue] = env.gate.snapshot()["clusterQueues"]
    assert queue["pendingPods"] == 0


def test_pods_of_unmanaged_namespaces_are_untouched_without_cluster_queues() -> None:
    env = make_env(FLAVORS, [a100_node("a100-0")])  # quota objects but no ClusterQueue: not enforced
    assert env.submit(queued_pod("anything", gpus=1, memory_mib=1000)) == "a100-0"


def test_assignment_annotation_is_the_source_of_usage() -> None:
    env = make_env(TEAM_A, [a100_node("a100-0")])
    p = queued_pod("q", gpus=2, memory_mib=1000)
    assert env.submit(p) == "a100-0"
    stored = env.cluster.get_pod("team-a", p["metadata"]["name"])
    assert stored is not None
    del stored["metadata"]["annotations"][protocol.POD_ASSIGNMENT_ANNOTATION]  # an operator removed it
    env.state.upsert_pod(stored)
    assert env.used("team-a", "a100") == 0


def test_needs_follow_each_nodes_gpu_size() -> None:
    # one flavor for every node (no nodeLabels): 50% of an A100 is 40960 MiB, of a V100 16384 MiB
    quota = """
apiVersion: kueue.x-k8s.io/v1beta1
kind: ResourceFlavor
metadata: {name: any}
---
apiVersion: kueue.x-k8s.io/v1beta1
kind: ClusterQueue
metadata: {name: team-a}
spec:
  namespaceSelector: {}
  resourceGroups:
  - coveredResources: [nvidia.com/gpu, nvidia.com/gpumem]
    flavors:
    - name: any
      resources: [{name: nvidia.com/gpu, nominalQuota: 8}, {name: nvidia.com/gpumem, nominalQuota: 50000}]
""" + local_queue("team-a", "q", "team-a")
    env = make_env(quota, [a100_node("a100-0"), v100_node("v100-0"), a100_node("a100-1"), v100_node("v100-1")])
    whole = queued_pod("q", gpus=1)  # no gpumem: the whole GPU
    env.cluster.add_pod(whole)
    outcome = env.filter(whole)
    assert outcome.passed == ["v100-0", "v100-1"]  # 32768 MiB fits in 50000, 81920 does not
    assert "nvidia.com/gpumem: needs 81920, used 0/50000 MiB (nominal 50000), never fits" in outcome.failed["a100-1"]
    half = queued_pod("q", gpus=1, memory_percent=50)
    assert env.submit(half) == "a100-0"
    assert env.used("team-a", "any", GPUMEM) == 40960
    # 50000 - 40960 = 9040 MiB left: 25% is 20480 MiB of an A100 (no) but 8192 MiB of a V100 (yes)
    quarter = env.filter(queued_pod("q", gpus=1, memory_percent=25))
    assert quarter.passed == ["v100-0", "v100-1"]
    assert "needs 20480, used 40960/50000 MiB (nominal 50000), 9040 available now" in quarter.failed["a100-1"]


def test_local_queue_listed_after_its_running_pods_counts_them() -> None:
    env = make_env(TEAM_A, [a100_node("a100-0")])
    p = queued_pod("q", gpus=2, memory_mib=1000)
    assert env.submit(p) == "a100-0"
    stored = env.cluster.get_pod("team-a", p["metadata"]["name"])
    assert stored is not None
    without_queue = FLAVORS + gpu_queue("team-a", {"a100": 2, "v100": 4})
    restarted = make_env(without_queue, [a100_node("a100-0")], pods=[stored])
    assert restarted.used("team-a", "a100") == 0  # the LocalQueue is not known yet
    [queue] = [d for d in yaml.safe_load_all(local_queue("team-a", "q", "team-a")) if d]
    restarted.gate.set_cluster_objects("LocalQueue", {("team-a", "q"): queue})
    assert restarted.used("team-a", "a100") == 2
