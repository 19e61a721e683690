"""Fair sharing in the gate (--fair-sharing): /quota's weighted shares, the SHARE column, and admission order
across a cohort (the lowest share after admission goes first)."""

from __future__ import annotations

from typing import Any

from kube_vgpu.extender.quota import cli as quota_cli
from kube_vgpu.extender.quota.fairsharing import INFINITE_SHARE
from kube_vgpu.extender.scheduler import FilterOutcome
from tests.quota.helpers import FLAVORS, a100_node, gpu_queue, local_queue, make_env, queued_pod


def reasons(result: str | FilterOutcome) -> dict[str, str]:
    assert isinstance(result, FilterOutcome), result
    return dict(result.failed)


def weight(value: str) -> str:
    return f"  fairSharing: {{weight: {value}}}\n"


# a(4, weight 2) and b(4) in cohort ai: 8 A100 vGPUs the cohort can lend
QUOTA = (FLAVORS + gpu_queue("a", {"a100": 4}, cohort="ai", extra=weight("2"))
         + gpu_queue("b", {"a100": 4}, cohort="ai") + gpu_queue("solo", {"a100": 1})
         + local_queue("team-a", "q", "a") + local_queue("team-b", "q", "b") + local_queue("team-s", "q", "solo"))


def pod(namespace: str, gpus: int, created: str = "2026-01-01T00:00:00Z", **kwargs: Any) -> dict[str, Any]:
    return queued_pod("q", namespace=namespace, gpus=gpus, memory_mib=1000, created=created, **kwargs)


def test_view_shows_weighted_shares_when_on() -> None:
    env = make_env(QUOTA, [a100_node("n0", gpus=8), a100_node("n1", gpus=8)], fair_sharing=True)
    assert env.submit(pod("team-a", 6)) == "n0"  # a borrows 2 of 8: 250, weight 2: 125
    assert env.submit(pod("team-b", 1)) == "n0"
    view = env.gate.snapshot()
    assert view["fairSharing"] is True
    queues = {q["name"]: q for q in view["clusterQueues"]}
    assert queues["a"]["fairSharing"] == {"weight": "2", "weightedShare": 125, "dominantResource": "nvidia.com/gpu"}
    assert queues["b"]["fairSharing"] == {"weight": "1", "weightedShare": 0, "dominantResource": ""}
    assert queues["solo"]["fairSharing"]["weightedShare"] == 0  # no cohort: borrows from nobody
    [cohort] = view["cohorts"]
    assert cohort["fairSharing"] == {"weight": "1", "weightedShare": 0, "dominantResource": ""}  # a root
    lines = quota_cli.render(view).splitlines()
    assert lines[0].split()[-2:] == ["PENDING", "SHARE"]
    assert lines[1].split()[0] == "a" and lines[1].endswith("0  125 (w2)")
    assert lines[2].split()[0] == "b" and lines[2].split()[-2:] == ["0", "0"]
    assert view["warnings"] == []


def test_view_and_table_unchanged_when_off() -> None:
    env = make_env(QUOTA, [a100_node("n0", gpus=8)])
    view = env.gate.snapshot()
    assert view["fairSharing"] is False
    assert all("fairSharing" not in q for q in view["clusterQueues"] + view["cohorts"])
    assert "SHARE" not in quota_cli.render(view)
    assert view["warnings"] == ["ClusterQueue a: spec.fairSharing.weight is read only with --fair-sharing (the "
                                "extender runs without it)"]


def test_table_shows_infinite_share() -> None:
    doc = {"fairSharing": True, "clusterQueues": [{"name": "z", "pendingPods": 0, "flavors": [],
                                                   "fairSharing": {"weight": "0", "weightedShare": INFINITE_SHARE}}]}
    assert quota_cli.render(doc).splitlines()[1].endswith("0  inf (w0)")
