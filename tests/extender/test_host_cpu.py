"""Host CPU in the cluster state: allocatable per node and the requests of every non-finished pod bound to it,
kept from the same events as GPU usage; the scheduler hands a pod's CPU request to CPU-aware policies."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest

from kube_vgpu.dev.fixtures import cpu_pod
from kube_vgpu.extender import scheduler as scheduler_module
from kube_vgpu.extender.engine.policies import make_policy
from kube_vgpu.extender.scheduler import STALE_REFRESH_PER_CALL, Scheduler
from kube_vgpu.extender.sources.snapshot import SnapshotCluster
from kube_vgpu.extender.state import ClusterState
from tests.helpers import gpu_node, placed_nodes, pod


def container(cpu: str | None, *, limits_only: bool = False, **extra: Any) -> dict[str, Any]:
    resources: dict[str, Any] = {}
    if cpu is not None:
        resources = {"limits": {"cpu": cpu}} if limits_only else {"requests": {"cpu": cpu}}
    return {"name": f"c{cpu}", "image": "busybox", "resources": resources, **extra}


@pytest.mark.parametrize(
    ("case", "spec", "expected_milli"),
    [
        ("one container", {"containers": [container("500m")]}, 500),
        ("decimal cores", {"containers": [container("0.25")]}, 250),
        ("limit only: the request defaults to it", {"containers": [container("1", limits_only=True)]}, 1000),
        ("no CPU asked", {"containers": [container(None)]}, 0),
        ("app containers add up", {"containers": [container("1"), container("1500m")]}, 2500),
        (
            "init containers count at their peak",
            {"initContainers": [container("4"), container("2")], "containers": [container("1"), container("1")]},
            4000,
        ),
        (
            "a sidecar runs beside the app and the later init containers",
            {
                "initContainers": [container("1", restartPolicy="Always"), container("3")],
                "containers": [container("1")],
            },
            4000,
        ),
        (
            "sidecars add to the app containers",
            {"initContainers": [container("2", restartPolicy="Always")], "containers": [container("1")]},
            3000,
        ),
        ("pod overhead", {"containers": [container("1")], "overhead": {"cpu": "250m"}}, 1250),
    ],
)
def test_state_counts_a_bound_pods_cpu_as_kube_scheduler(case: str, spec: dict[str, Any], expected_milli: int) -> None:
    """The state's per-node CPU is kubeapi.pod_requests' figure (kube-scheduler's), never a copy of the rules."""
    state = ClusterState()
    state.upsert_node(gpu_node("n1", cpu_milli=64000))
    bound = cpu_pod(node_name="n1")
    bound["spec"].update(spec)
    state.upsert_pod(bound)
    assert state.nodes["n1"].cpu_milli_used == expected_milli, case


def test_sidecar_cpu_is_counted_beside_the_app_container() -> None:
    """Regression (issue 12): a 1-CPU app container and a 2-CPU native sidecar use 3000m, as kube-scheduler counts
    them, not 2000m (the sidecar at an init container's peak)."""
    state = ClusterState()
    state.upsert_node(gpu_node("n1", cpu_milli=8000))
    bound = cpu_pod(node_name="n1", cpu="1")
    bound["spec"]["initContainers"] = [container("2", restartPolicy="Always")]
    state.upsert_pod(bound)
    assert state.nodes["n1"].cpu_milli_used == 3000


def test_an_in_place_resize_counts_as_on_kube_schedulers_node() -> None:
    """A bound pod whose kubelet reports larger resources than its spec (a resize down not applied yet) counts the
    larger figure, as kube-scheduler's NodeInfo does."""
    state = ClusterState()
    state.upsert_node(gpu_node("n1", cpu_milli=8000))
    bound = cpu_pod(node_name="n1", cpu="1")
    name = bound["spec"]["containers"][0]["name"]
    bound["status"]["containerStatuses"] = [{"name": name, "resources": {"requests": {"cpu": "3"}}}]
    state.upsert_pod(bound)
    assert state.nodes["n1"].cpu_milli_used == 3000


def test_an_unreadable_cpu_request_counts_zero_and_does_not_crash() -> None:
    state = ClusterState()
    state.upsert_node(gpu_node("n1", cpu_milli=8000))
    state.upsert_pod(cpu_pod(node_name="n1", cpu="lots"))
    assert state.nodes["n1"].cpu_milli_used == 0
    state.upsert_node(allocatable(gpu_node("n1", cpu_milli=8000), "many"))
    assert state.nodes["n1"].cpu_milli_total == 0  # unknown


def allocatable(obj: dict[str, Any], cpu: str) -> dict[str, Any]:
    changed = copy.deepcopy(obj)
    changed["status"]["allocatable"]["cpu"] = cpu
    return changed


def finished(obj: dict[str, Any], phase: str = "Succeeded") -> dict[str, Any]:
    changed = copy.deepcopy(obj)
    changed["status"]["phase"] = phase
    return changed


NODE = gpu_node("n1", cpu_milli=32000)
WEB = cpu_pod(node_name="n1", cpu="2")
BATCH = cpu_pod(node_name="n1", cpu="500m")
ELSEWHERE = cpu_pod(node_name="n2", cpu="8")
PENDING = cpu_pod(cpu="16")

Step = tuple[str, Callable[[ClusterState], None], tuple[int, int]]

#: one cluster's history, applied in order: (what happens, the event, (allocatable, requested) of n1 after it)
STEPS: list[Step] = [
    ("a pod bound before its node is known", lambda s: s.upsert_pod(WEB), (0, 0)),
    ("the node arrives: its allocatable, and the pod already bound", lambda s: s.upsert_node(NODE), (32000, 2000)),
    ("another pod bound (not a GPU pod)", lambda s: s.upsert_pod(BATCH), (32000, 2500)),
    ("a status update of a counted pod", lambda s: s.upsert_pod(finished(WEB, "Running")), (32000, 2500)),
    ("a pending pod (no node yet) counts nowhere", lambda s: s.upsert_pod(PENDING), (32000, 2500)),
    ("a pod on another node", lambda s: s.upsert_pod(ELSEWHERE), (32000, 2500)),
    (
        "the pending pod is bound here",
        lambda s: s.upsert_pod({**PENDING, "spec": {**PENDING["spec"], "nodeName": "n1"}}),
        (32000, 18500),
    ),
    ("it finishes (Succeeded)", lambda s: s.upsert_pod(finished(PENDING)), (32000, 2500)),
    ("a pod fails", lambda s: s.upsert_pod(finished(BATCH, "Failed")), (32000, 2000)),
    ("allocatable shrinks (kubelet reserved more)", lambda s: s.upsert_node(allocatable(NODE, "30")), (30000, 2000)),
    ("the node is deleted: nothing to report", lambda s: s.delete_node("n1"), (0, 0)),
    ("it comes back: its pods are counted again", lambda s: s.upsert_node(NODE), (32000, 2000)),
    ("the pod is deleted", lambda s: s.delete_pod(WEB["metadata"]["uid"]), (32000, 0)),
    ("a relist still has the pod", lambda s: s.replace_pods([WEB, ELSEWHERE]), (32000, 2000)),
    ("a relist without it", lambda s: s.replace_pods([ELSEWHERE]), (32000, 0)),
]


def test_cpu_follows_pod_and_node_events() -> None:
    state = ClusterState()
    for description, event, (total, used) in STEPS:
        event(state)
        node = state.nodes.get("n1")
        seen = (node.cpu_milli_total, node.cpu_milli_used) if node else (0, 0)
        assert seen == (total, used), description
    assert state.cpu_used_by_node == {"n2": 8000}  # n2 never registered: its pods wait for it


@pytest.mark.parametrize(("policy", "touches"), [("topology", False), ("binpack", False), ("bfgd", True)])
def test_cpu_changes_drop_cached_results_only_for_cpu_aware_policies(policy: str, touches: bool) -> None:
    state = ClusterState()
    cluster = SnapshotCluster(state, [gpu_node("n1")])
    scheduler = Scheduler(state, cluster, node_policy=policy, gpu_policy=policy)
    assert scheduler.filter(pod(memory_mib=1000), ["n1"]).passed == ["n1"]
    version = state.nodes["n1"].version
    state.upsert_pod(cpu_pod(node_name="n1", cpu="4"))
    assert state.nodes["n1"].cpu_milli_used == 4000  # tracked either way
    assert (state.nodes["n1"].version != version) is touches


def test_the_scheduler_hands_the_pod_cpu_request_to_the_policy() -> None:
    state = ClusterState()
    cluster = SnapshotCluster(state, [gpu_node("n1")])
    scheduler = Scheduler(state, cluster, node_policy="bfgd", gpu_policy="bfgd")
    gpu_pod = pod(gpus=1, cores=100)  # tests.helpers pods ask 1 CPU
    gpu_pod["spec"]["containers"][0]["resources"]["requests"]["cpu"] = "3"
    scheduler.filter(gpu_pod, ["n1"])
    policy = scheduler.default_node_policy
    assert policy.cpu_per_gpu == pytest.approx(3.0)  # type: ignore[attr-defined]  # 3000 milli-CPU per GPU
    assert not state.nodes["n1"].cpu_milli_used  # filtering reserves nothing


def test_an_outdated_model_re_places_a_bounded_number_of_nodes_per_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """After the learned model changes, each filter re-places at most STALE_REFRESH_PER_CALL nodes (prioritize
    none) and answers the rest from their previous result, until every node is current again."""
    names = [f"n{i}" for i in range(STALE_REFRESH_PER_CALL * 2 + 10)]
    state = ClusterState()
    cluster = SnapshotCluster(state, [gpu_node(name) for name in names])
    scheduler = Scheduler(state, cluster, node_policy="bfgd", gpu_policy="bfgd")
    calls = placed_nodes(monkeypatch)
    # counted per node: the nodes are identical, and equivalent nodes would otherwise share one placement
    monkeypatch.setattr(scheduler_module, "groupable", lambda *_: False)
    small = pod(memory_mib=1000)
    assert scheduler.filter(small, names).passed == names
    assert len(calls) == len(names)  # nothing cached yet: every node
    calls.clear()
    assert scheduler.filter(small, names).passed == names
    assert calls == []  # cached, same model
    policy = scheduler.default_node_policy
    epoch = policy.epoch()
    for _ in range(16):  # a different workload: the next refresh changes the model
        scheduler.filter(pod(gpus=2, cores=100), [])
    assert policy.epoch() != epoch
    calls.clear()
    assert len(scheduler.prioritize(small, names)) == len(names)
    assert calls == []  # prioritize answers from what is cached; filter does the re-placing
    per_call = []
    for _ in range(4):
        calls.clear()
        assert scheduler.filter(small, names).passed == names  # fit answers stay complete meanwhile
        per_call.append(len(calls))
    assert per_call == [STALE_REFRESH_PER_CALL, STALE_REFRESH_PER_CALL, 10, 0]


@pytest.mark.parametrize(
    ("policy", "reads_cpu"),
    [("bfgd", True), ("fgd", True), ("bestfit", True), ("dotprod", True), ("topology", False), ("binpack", False)],
)
def test_which_policies_read_host_cpu(policy: str, reads_cpu: bool) -> None:
    assert make_policy(policy).uses_host_cpu is reads_cpu
