"""Fair sharing in the gate (--fair-sharing): /quota's weighted shares, the SHARE column, and admission order
across a cohort (the lowest share after admission goes first)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kube_vgpu.extender.quota import cli as quota_cli
from kube_vgpu.extender.quota.fairsharing import INFINITE_SHARE
from kube_vgpu.extender.scheduler import FilterOutcome
from tests.quota.helpers import FLAVORS, Env, a100_node, gpu_queue, local_queue, make_env, queued_pod


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


# a(4, weight 2), b(4) and c(4) in cohort ai: 12 A100 vGPUs the cohort can lend
COHORT3 = (FLAVORS + gpu_queue("a", {"a100": 4}, cohort="ai", extra=weight("2"))
           + gpu_queue("b", {"a100": 4}, cohort="ai") + gpu_queue("c", {"a100": 4}, cohort="ai")
           + local_queue("team-a", "q", "a") + local_queue("team-b", "q", "b") + local_queue("team-c", "q", "c"))
def nodes() -> list[dict[str, Any]]:
    """Made per test: a node's heartbeat is the moment it is made, and must not age while other tests run."""
    return [a100_node(f"n{i}", gpus=8) for i in range(3)]


def crowded(b_waits: int, *, fair_sharing: bool = True) -> tuple[Env, dict[str, Any]]:
    """Every queue at its nominal 4; b's pod of `b_waits` waits for quota; then c's pod leaves (4 free)."""
    env = make_env(COHORT3, nodes(), fair_sharing=fair_sharing)
    for namespace in ("team-a", "team-b"):
        assert isinstance(env.submit(pod(namespace, 4)), str)
    c_pod = pod("team-c", 4)
    assert isinstance(env.submit(c_pod), str)
    waiting = pod("team-b", b_waits, created="2026-01-01T00:01:00Z")
    assert "available now" in reasons(env.submit(waiting))["n0"]
    assert env.gate.pending[waiting["metadata"]["uid"]].needs == {("a100", "nvidia.com/gpu"): b_waits}
    env.delete(c_pod)
    return env, waiting


def test_lower_share_after_admission_goes_first() -> None:
    env, waiting = crowded(1)
    # a's pod of 4 would borrow 4 of 12: 333, weight 2: 166; b's waiting pod would borrow 1: 83, and would no
    # longer fit once a's is admitted (4 free - 4 = 0)
    late = pod("team-a", 4, created="2026-01-01T00:00:00Z")  # older than b's: the share decides, not age
    assert reasons(env.submit(late))["n0"] == (
        "quota: ClusterQueue a (LocalQueue team-a/q): fairSharing: ClusterQueue b goes first: its pod "
        f"team-b/{waiting['metadata']['name']} waits for the same quota, and its share after admission (83) is "
        "below a's share after admitting this pod (166)")
    assert env.retry(waiting) in ("n0", "n1", "n2")  # b's turn
    assert "needs 4, used 4/12" in reasons(env.retry(late))["n0"]  # then a's pod waits for quota as usual
    assert env.used("a", "a100") == 4 and env.used("b", "a100") == 5


def test_higher_share_waiting_does_not_block() -> None:
    env, waiting = crowded(3)
    # b's waiting pod would borrow 3 of 12: 250; a's pod of 3: 250, weight 2: 125 < 250: a goes first
    assert isinstance(env.submit(pod("team-a", 3)), str)
    assert "available now" in reasons(env.retry(waiting))["n0"]


def test_pods_that_do_not_compete_do_not_wait() -> None:
    env, waiting = crowded(1)
    # a's pod of 3 leaves 1 free: b's waiting pod of 1 still fits, so nothing is taken from it
    assert isinstance(env.submit(pod("team-a", 3)), str)
    assert isinstance(env.retry(waiting), str)


def test_within_nominal_never_waits_for_shares() -> None:
    env = make_env(COHORT3, nodes(), fair_sharing=True)
    assert isinstance(env.submit(pod("team-b", 4)), str)
    assert isinstance(env.submit(pod("team-c", 4)), str)
    waiting = pod("team-b", 3)
    assert isinstance(env.submit(waiting), str)  # b borrows 3 of a's 4 (share 250)
    blocked = pod("team-b", 2)
    assert "available now" in reasons(env.submit(blocked))["n0"]
    assert isinstance(env.submit(pod("team-a", 1)), str)  # a within its nominal: admitted, shares aside


def test_off_admits_in_arrival_order() -> None:
    env, waiting = crowded(1, fair_sharing=False)
    assert isinstance(env.submit(pod("team-a", 4)), str)
    assert "available now" in reasons(env.retry(waiting))["n0"]


def test_flag_reaches_the_gate_and_the_share_gauge(tmp_path: Path) -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from kube_vgpu.extender.cli import build, parse_args
    from kube_vgpu.extender.quota.gate import QuotaGate

    quota = tmp_path / "quota.yaml"
    quota.write_text(QUOTA)
    snapshot = tmp_path / "snapshot.json"
    snapshot.write_text('{"apiVersion": "v1", "kind": "List", "items": []}')
    for flags, expected in (([], False), (["--fair-sharing"], True), (["--no-fair-sharing"], False)):
        extender = build(parse_args(["--snapshot", str(snapshot), "--quota-config", str(quota), *flags]))
        [gate] = [g for g in extender.scheduler.gates if isinstance(g, QuotaGate)]
        assert gate.fair_sharing is expected
        registry = CollectorRegistry()
        registry.register(gate.collector())
        text = generate_latest(registry).decode()
        assert ('kube_vgpu_quota_weighted_share{cluster_queue="a"} 0.0' in text) is expected
