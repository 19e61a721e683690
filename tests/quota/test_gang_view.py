"""GET /quota lists the gangs in each ClusterQueue (issue: gangs in /quota and `kube-vgpu quota status`): members
seen, bound, planned, why they wait, and what the whole gang asks of the queue; gangs in no queue apart."""

from __future__ import annotations

from typing import Any

from kube_vgpu import protocol
from tests.quota.helpers import FLAVORS, a100_node, gpu_queue, local_queue, make_env, queued_pod

GPU_AND_MIB_QUEUE = """
---
apiVersion: kueue.x-k8s.io/v1beta1
kind: ClusterQueue
metadata: {name: team-a}
spec:
  namespaceSelector: {}
  resourceGroups:
  - coveredResources: [nvidia.com/gpu, nvidia.com/gpumem, cpu, pods]
    flavors:
    - name: a100
      resources:
      - {name: nvidia.com/gpu, nominalQuota: 3}
      - {name: nvidia.com/gpumem, nominalQuota: 100000}
      - {name: cpu, nominalQuota: 100}
      - {name: pods, nominalQuota: 100}
"""


def gang_member(gang: str, size: int, index: int, queue: str | None = "q", **kwargs: Any) -> dict[str, Any]:
    p = queued_pod(queue, name=f"{gang}-{index}", **kwargs)
    p["metadata"]["labels"][protocol.LABEL_KUEUE_POD_GROUP_NAME] = gang
    p["metadata"]["annotations"][protocol.ANNOTATION_KUEUE_POD_GROUP_TOTAL_COUNT] = str(size)
    p["metadata"]["creationTimestamp"] = f"2026-11-24T10:00:{index:02d}Z"
    return p


def test_a_gang_over_its_quota_is_listed_in_its_queue_with_its_reason_and_ask() -> None:
    env = make_env(FLAVORS + GPU_AND_MIB_QUEUE + local_queue("team-a", "q", "team-a"), [a100_node("a100-0")])
    gang = [gang_member("train", 4, i, gpus=1, memory_mib=1000) for i in range(4)]
    for p in gang:
        env.cluster.add_pod(p)
    outcome = env.filter(gang[0])
    assert outcome.passed == []
    [queue] = env.gate.snapshot(env.scheduler.gangs)["clusterQueues"]
    [entry] = queue["gangs"]
    reason = next(iter(outcome.failed.values()))
    assert entry == {
        "name": "team-a/train", "size": 4, "membersSeen": 4, "bound": 0, "planned": 0, "waiting": reason,
        "membersInQueue": 4,
        "quota": {"resources": [
            {"resource": "cpu", "unit": "millicores", "amount": 4000},
            {"resource": "nvidia.com/gpu", "unit": "vGPUs", "amount": 4},
            {"resource": "nvidia.com/gpumem", "unit": "MiB", "amount": 4000},
            {"resource": "pods", "unit": "pods", "amount": 4},
        ], "dependsOnNode": []},
    }
    assert reason.startswith("gang team-a/train: 3 of 4 members fit; waiting for a node for member train-3")


def test_a_planned_gang_counts_its_reserved_and_bound_members() -> None:
    env = make_env(FLAVORS + gpu_queue("team-a", {"a100": 4}) + local_queue("team-a", "q", "team-a"),
                   [a100_node("a100-0")])
    gang = [gang_member("g", 2, i, gpus=2, memory_mib=1000) for i in range(2)]
    for p in gang:
        env.cluster.add_pod(p)
    assert env.retry(gang[0]) == "a100-0"  # planned both, bound the first
    [queue] = env.gate.snapshot(env.scheduler.gangs)["clusterQueues"]
    [entry] = queue["gangs"]
    assert (entry["membersSeen"], entry["bound"], entry["planned"], entry["waiting"]) == (2, 1, 1, "")
    assert entry["quota"]["resources"] == [{"resource": "nvidia.com/gpu", "unit": "vGPUs", "amount": 4}]


def test_a_gang_whose_gpu_memory_depends_on_the_node_says_so() -> None:
    env = make_env(FLAVORS + GPU_AND_MIB_QUEUE + local_queue("team-a", "q", "team-a"), [a100_node("a100-0")])
    first = gang_member("p", 2, 0, gpus=2, memory_percent=50)
    env.cluster.add_pod(first)
    env.filter(first)  # waits: one of two members created
    [entry] = env.gate.snapshot(env.scheduler.gangs)["clusterQueues"][0]["gangs"]
    assert {r["resource"]: r["amount"] for r in entry["quota"]["resources"]}["nvidia.com/gpu"] == 2
    assert "nvidia.com/gpumem" not in {r["resource"] for r in entry["quota"]["resources"]}
    assert entry["quota"]["dependsOnNode"] == ["nvidia.com/gpumem"]
    assert "1 of 2 members created" in entry["waiting"]


def test_gangs_in_no_queue_are_listed_apart_and_queues_without_gangs_list_none() -> None:
    env = make_env(FLAVORS + gpu_queue("team-a", {"a100": 4}) + local_queue("team-a", "q", "team-a"),
                   [a100_node("a100-0")])
    loose = gang_member("loose", 2, 0, queue=None, gpus=1, memory_mib=1000)
    env.cluster.add_pod(loose)
    env.filter(loose)
    view = env.gate.snapshot(env.scheduler.gangs)
    assert view["clusterQueues"][0]["gangs"] == []
    [entry] = view["unqueuedGangs"]
    assert (entry["name"], entry["size"], entry["membersSeen"], entry["bound"], entry["planned"]) == (
        "team-a/loose", 2, 1, 0, 0)
    assert "quota" not in entry
    assert env.gate.snapshot()["unqueuedGangs"] == []  # without the tracker: no gangs at all
