"""Gang options (issue 13 item 3): a gang's own timeout (pod annotation, set in a Job's pod template), the
extender's --gang-timeout-seconds, and the topology tie-breaker that keeps a gang spanning nodes in one rack, else
one zone."""

from __future__ import annotations

from typing import Any

import pytest

from kube_vgpu import protocol
from kube_vgpu.extender import cli
from kube_vgpu.extender.scheduler import Scheduler
from kube_vgpu.extender.sources.snapshot import SnapshotCluster
from kube_vgpu.extender.state import ClusterState
from tests.extender.test_gangs import WHOLE_MIB, Clock, Env, member
from tests.helpers import gpu_node

ZONE = "topology.kubernetes.io/zone"
RACK = "topology.kubernetes.io/rack"


def timed_member(gang: str, size: int, index: int, timeout: str) -> dict[str, Any]:
    p = member(gang, size, index)
    p["metadata"]["annotations"][protocol.ANNOTATION_GANG_TIMEOUT_SECONDS] = timeout
    return p


def test_a_gangs_own_timeout_wins_over_the_extenders() -> None:
    env = Env(nodes=3, free=3, timeout_s=300)
    gang = [timed_member("g", 3, i, "30") for i in range(3)]
    for p in gang:
        env.cluster.add_pod(p)
    passed, _ = env.filter(gang[0])
    env.bind(gang[0], passed[0])
    env.clock.now += 29
    assert len(env.filter(gang[1])[0]) == 1  # still planned: inside its own 30 s
    env.clock.now += 2
    passed, reasons = env.filter(gang[1])
    assert passed == []
    assert reasons == {"gang default/g: 1 of 3 members were bound within 30 s of the plan; not bound: g-1 on n1, "
                       "g-2 on n2 (see those pods' events for what refused the planned node); their reservations "
                       "were released; next plan in 15 s"}
    assert sum(env.used_mib().values()) == WHOLE_MIB
    state_view = env.scheduler.gangs.timeout_of(env.scheduler.gangs.gangs[next(iter(env.scheduler.gangs.gangs))])
    assert state_view == 30


def test_without_an_annotation_the_extenders_timeout_holds() -> None:
    env = Env(nodes=3, free=3, timeout_s=300)
    gang = [member("g", 3, i) for i in range(3)]
    for p in gang:
        env.cluster.add_pod(p)
    passed, _ = env.filter(gang[0])
    env.bind(gang[0], passed[0])
    env.clock.now += 299
    assert len(env.filter(gang[1])[0]) == 1  # the plan holds for the extender's 300 s


@pytest.mark.parametrize("value", ["soon", "0", "5", "100000", "nan", "-30"])
def test_an_unreadable_gang_timeout_is_refused_with_the_range(value: str) -> None:
    env = Env(nodes=1, free=1)
    p = timed_member("g", 1, 0, value)
    env.cluster.add_pod(p)
    passed, reasons = env.filter(p)
    assert passed == [] and len(reasons) == 1
    reason = reasons.pop()
    assert protocol.ANNOTATION_GANG_TIMEOUT_SECONDS in reason and "from 10 to 86400" in reason
    assert sum(env.used_mib().values()) == 0


@pytest.mark.parametrize(("words", "expected"), [
    ([], 300.0),
    (["--gang-timeout-seconds", "45"], 45.0),
])
def test_the_extenders_gang_timeout_flag(words: list[str], expected: float) -> None:
    assert cli.gang_timeout_s(cli.parse_args(["--snapshot", "x.json", *words])) == expected


@pytest.mark.parametrize("value", ["0", "1", "1e9"])
def test_an_out_of_range_gang_timeout_flag_is_refused(value: str) -> None:
    with pytest.raises(SystemExit, match="--gang-timeout-seconds must be from 10 to 86400"):
        cli.gang_timeout_s(cli.parse_args(["--snapshot", "x.json", "--gang-timeout-seconds", value]))


@pytest.mark.parametrize(("words", "expected"), [
    ([], (RACK, ZONE)),
    (["--gang-topology-labels", ""], ()),
    (["--gang-topology-labels", " example.com/block , example.com/rack "], ("example.com/block", "example.com/rack")),
])
def test_the_gang_topology_labels_flag(words: list[str], expected: tuple[str, ...]) -> None:
    assert cli.gang_topology_labels(cli.parse_args(["--snapshot", "x.json", *words])) == expected


# --- topology: a gang that needs several nodes keeps to one rack, else one zone -----------------------------------


def topology_env(layout: dict[str, dict[str, str]], labels: tuple[str, ...] = (RACK, ZONE)) -> tuple[
        ClusterState, SnapshotCluster, Scheduler, list[str]]:
    """One 80 GB GPU per node; `layout` maps node name -> its topology labels."""
    state = ClusterState(heartbeat_ttl_s=float("inf"), clock=Clock())
    nodes = [gpu_node(name, gpus=1, memory_mib=WHOLE_MIB, extra_labels=extra) for name, extra in layout.items()]
    cluster = SnapshotCluster(state, nodes)
    return state, cluster, Scheduler(state, cluster, gang_topology_labels=labels), list(layout)


def plan(gang_size: int, layout: dict[str, dict[str, str]], labels: tuple[str, ...] = (RACK, ZONE)) -> list[str]:
    """The nodes planned for a gang of whole-GPU members, in member order."""
    _, cluster, scheduler, names = topology_env(layout, labels)
    gang = [member("g", gang_size, i) for i in range(gang_size)]
    for p in gang:
        cluster.add_pod(p)
    planned = []
    for p in gang:
        outcome = scheduler.filter(p, names)
        assert len(outcome.passed) == 1, outcome.failed
        planned.append(outcome.passed[0])
    return planned


# Node names are chosen so that the name order (the last tie-breaker) would scatter the gang: the test sees the
# topology preference, not the alphabet.
LAYOUT = {
    "a-zone1-rack1": {ZONE: "z1", RACK: "r1"},
    "b-zone2-rack3": {ZONE: "z2", RACK: "r3"},
    "c-zone1-rack2": {ZONE: "z1", RACK: "r2"},
    "d-zone2-rack3": {ZONE: "z2", RACK: "r3"},
    "e-zone1-rack1": {ZONE: "z1", RACK: "r1"},
}


def test_a_gang_spanning_nodes_stays_in_one_rack_when_it_can() -> None:
    planned = plan(2, LAYOUT)
    racks = {LAYOUT[node][RACK] for node in planned}
    assert len(set(planned)) == 2 and len(racks) == 1


def test_a_gang_bigger_than_a_rack_stays_in_one_zone() -> None:
    planned = plan(3, LAYOUT)
    assert len(set(planned)) == 3
    assert {LAYOUT[node][ZONE] for node in planned} == {"z1"}  # zone z1 has 3 nodes (two racks), z2 only 2


def test_without_topology_labels_the_gang_follows_the_policys_scores_alone() -> None:
    # equal scores everywhere: the first node in the cluster's order wins each tie, whatever its zone
    assert plan(3, LAYOUT, labels=()) == ["a-zone1-rack1", "b-zone2-rack3", "c-zone1-rack2"]
    assert plan(3, LAYOUT) == ["a-zone1-rack1", "e-zone1-rack1", "c-zone1-rack2"]


def test_a_zone_is_preferred_over_unlabelled_nodes_between() -> None:
    assert plan(2, {"a": {ZONE: "z1"}, "b": {}, "c": {}, "d": {ZONE: "z1"}}) == ["a", "d"]


def test_nodes_without_the_labels_are_not_treated_as_one_domain() -> None:
    # "a" has no zone: "c" (no zone either) must not count as "the same zone" and win over "b"
    assert plan(2, {"a": {}, "b": {ZONE: "z9"}, "c": {}}) == ["a", "b"]
