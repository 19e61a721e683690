"""Many binds racing for the last units of quota through the real Scheduler.bind: exactly the right number win."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from kube_vgpu.extender.scheduler import BindError
from tests.quota.helpers import FLAVORS, Env, a100_node, gpu_queue, local_queue, make_env, queued_pod


def race(env: Env, pods: list[dict[str, Any]]) -> list[bool]:
    for p in pods:
        env.cluster.add_pod(p)
        assert env.filter(p).passed  # every one of them fits when filtered: only bind can tell them apart
    results: list[bool] = []
    barrier = threading.Barrier(len(pods))

    def attempt(p: dict[str, Any]) -> None:
        meta = p["metadata"]
        barrier.wait()
        try:
            env.scheduler.bind(meta["namespace"], meta["name"], meta["uid"], "a100-0")
            results.append(True)
        except BindError as exc:
            assert "quota: ClusterQueue" in str(exc), exc  # GPUs are plentiful: only quota refuses
            results.append(False)

    threads = [threading.Thread(target=attempt, args=(p,)) for p in pods]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


@pytest.mark.parametrize(("nominal", "vgpus_per_pod", "winners"), [(5, 1, 5), (7, 2, 3), (1, 1, 1)])
def test_binds_race_for_the_last_quota(nominal: int, vgpus_per_pod: int, winners: int) -> None:
    quota = FLAVORS + gpu_queue("team-a", {"a100": nominal}) + local_queue("team-a", "q", "team-a")
    env = make_env(quota, [a100_node("a100-0", gpus=8)])  # 80 vGPU slots: never the limit here
    results = race(env, [queued_pod("q", gpus=vgpus_per_pod, memory_mib=100) for _ in range(24)])
    assert results.count(True) == winners
    assert env.used("team-a", "a100") == winners * vgpus_per_pod
    assert len(env.gate.charges) == winners
    assert sum(g.used_vgpus for g in env.state.nodes["a100-0"].gpus) == winners * vgpus_per_pod


def test_two_queues_race_for_a_shared_cohort() -> None:
    # team-a 2 + team-b 3 in one cohort, no limits: 5 vGPUs in all, whoever comes first
    quota = (FLAVORS + gpu_queue("team-a", {"a100": 2}, cohort="ai") + gpu_queue("team-b", {"a100": 3}, cohort="ai")
             + local_queue("team-a", "q", "team-a") + local_queue("team-b", "q", "team-b"))
    env = make_env(quota, [a100_node("a100-0", gpus=8)])
    pods = [queued_pod("q", namespace=ns, gpus=1, memory_mib=100) for ns in ("team-a", "team-b") for _ in range(12)]
    results = race(env, pods)
    assert results.count(True) == 5
    assert env.used("team-a", "a100") + env.used("team-b", "a100") == 5
    for name in ("team-a", "team-b"):
        assert env.gate.tree.available(("ClusterQueue", name), ("a100", "nvidia.com/gpu")) == 0
