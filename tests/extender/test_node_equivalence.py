"""Sharing work between nodes (issue 19, live cost) changes no decision: a scheduler that places each request shape
once per node-equivalence class and answers from each shape's kept answer gives exactly the filter outcome and the
scores of one that judges every node on its own, on randomized clusters where many nodes share a state, through
binds, pod deletions, heartbeats (fresh and expired) and the learned model's refreshes (bfgd's epochs); and so does
one that places each shape's new classes with bfgd's batch placement (policies.batch)."""

from __future__ import annotations

import datetime as dt
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kube_vgpu import protocol
from kube_vgpu.dev.fixtures import gpu_pod_object, node_object, synth_inventory
from kube_vgpu.extender.engine.fit import place
from kube_vgpu.extender.engine.model import NodeState, Placement, PlacementRequest, assignment_from_placement
from kube_vgpu.extender.engine.policies import make_policy
from kube_vgpu.extender.scheduler import Scheduler, _scaled, equivalence_key
from kube_vgpu.extender.sources.snapshot import SnapshotCluster
from kube_vgpu.extender.state import ClusterState
from tests.helpers import placed_nodes, pod

START_S = 1_800_000_000.0
TTL_S = 120.0
#: (GPU count, topology, allocatable milli-CPU, allocatable memory MiB): few hardware kinds, so nodes repeat; little
#: memory, so that pods' memory requests move hsafgd's tables
HARDWARE = [(2, "pcie", 32000, 65536), (4, "nvswitch", 64000, 262144), (4, "nvswitch", 32000, 131072),
            (8, "nvlink-pairs", 64000, 196608)]
#: (GPUs, memory MiB, cores) of the pods already running and of the pods scheduled
RUNNING = [(1, 8192, 20), (1, 40960, 50), (2, 10240, 30), (1, 81920, 100)]
ASKS = [(1, 8192, 20), (1, 20480, 25), (2, 6144, 15), (4, 10240, 10), (1, 81920, 100), (3, 2048, 5), (1, 1024, 1)]


class Clock:
    def __init__(self) -> None:
        self.now = START_S

    def __call__(self) -> float:
        return self.now


def heartbeat_at(seconds: float) -> dt.datetime:
    return dt.datetime.fromtimestamp(seconds, dt.UTC)


def hardware_node(name: str, hardware: int, heartbeat_s: float) -> dict[str, Any]:
    """A Node object of one of the HARDWARE kinds, its heartbeat at that moment."""
    gpus, topology, cpu_milli, memory_mib = HARDWARE[hardware]
    return node_object(name, synth_inventory(name, gpus, "NVIDIA-A100-SXM4-80GB", 81920, topology),
                       cpu_milli=cpu_milli, memory_mib=memory_mib, heartbeat=heartbeat_at(heartbeat_s))


def node_items(name: str, hardware: int, running: list[int], heartbeat_s: float) -> list[dict[str, Any]]:
    gpus = HARDWARE[hardware][0]
    node = hardware_node(name, hardware, heartbeat_s)
    inventory = protocol.decode_inventory(node["metadata"]["annotations"][protocol.NODE_INVENTORY_ANNOTATION])
    state = NodeState(name, inventory)
    policy = make_policy("binpack")
    items = [node]
    for number, shape in enumerate(running):
        count, memory, cores = RUNNING[shape]
        if count > gpus:
            continue
        running_pod = gpu_pod_object(f"{name}-r{number}", gpus=count, memory_mib=memory, cores=cores)
        placement = place(state, PlacementRequest(protocol.parse_pod_gpu_request(running_pod)), policy, policy)
        if not isinstance(placement, Placement):
            continue
        state.apply_usage(placement.usage)
        items.append(gpu_pod_object(f"{name}-r{number}", gpus=count, memory_mib=memory, cores=cores, node_name=name,
                                    assignment=assignment_from_placement(state, placement)))
    return items


nodes_strategy = st.lists(
    st.tuples(st.integers(0, len(HARDWARE) - 1), st.lists(st.integers(0, len(RUNNING) - 1), max_size=3)),
    min_size=1, max_size=12,
)
operations_strategy = st.lists(
    st.one_of(
        st.tuples(st.just("pod"), st.integers(0, len(ASKS) - 1), st.sampled_from(["", "2", "8", "30"])),
        st.tuples(st.just("heartbeat"), st.integers(0, 11), st.sampled_from([0.0, 100.0])),
        st.tuples(st.just("time"), st.sampled_from([30.0, 130.0])),
        st.tuples(st.just("delete"), st.integers(0, 200), st.just("")),
        st.tuples(st.just("cpu"), st.integers(0, 11), st.sampled_from(["1", "3", "20"])),
    ),
    min_size=1, max_size=40,
)


def cpu_only_pod(name: str, node_name: str, cpu: str) -> dict[str, Any]:
    """A pod without GPUs on the node, asking this many CPUs and 8 GiB of memory per CPU."""
    requests = {"cpu": cpu, "memory": f"{int(cpu) * 8}Gi"}
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": "default", "uid": f"uid-{name}", "annotations": {}},
        "spec": {"nodeName": node_name, "containers": [{"name": "main", "resources": {"requests": requests}}]},
        "status": {"phase": "Running"},
    }


class Twin:
    """One extender: its state, snapshot and scheduler."""

    def __init__(self, clock: Clock, items: list[dict[str, Any]], share_results: bool, batch: bool = False,
                 policy: str = "bfgd") -> None:
        self.state = ClusterState(heartbeat_ttl_s=TTL_S, clock=clock)
        self.cluster = SnapshotCluster(self.state, [dict(item) for item in items])
        # batch: a request shape's new classes go to the policy's batch placement (policies.batch) however few they
        # are
        self.scheduler = Scheduler(self.state, self.cluster, node_policy=policy, gpu_policy=policy,
                                   share_results=share_results, batch_min_nodes=1 if batch else 1 << 30)

    def schedule(self, pending: dict[str, Any], names: list[str]) -> tuple[Any, ...]:
        """The pod filtered, prioritized and bound to the best node (the highest score, then the first name: one
        choice whatever order the filter replied in), and what each verb answered as kube-scheduler reads it: the
        nodes and their scores in no order (a filter repeating the last one replies in that one's order)."""
        outcome = self.scheduler.filter(pending, names)
        scores = self.scheduler.prioritize(pending, outcome.passed)
        nonzero = self.scheduler.nonzero_scores(pending, outcome.passed)
        best = min(scores, key=lambda pair: (-pair[1], pair[0]))[0] if scores else None
        if best is not None:
            meta = pending["metadata"]
            self.scheduler.bind(meta["namespace"], meta["name"], meta["uid"], best)
        return (sorted(outcome.passed), outcome.failed, outcome.unresolvable, outcome.error, dict(scores),
                dict(nonzero), best)


@pytest.mark.parametrize("policy", ["bfgd", "hsafgd"])  # the default; the look-ahead that reads host memory
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(nodes=nodes_strategy, operations=operations_strategy)
def test_shared_results_decide_exactly_as_every_node_on_its_own(
    policy: str, nodes: list[tuple[int, list[int]]], operations: list[tuple[Any, ...]]
) -> None:
    clock = Clock()
    names = [f"n{index}" for index in range(len(nodes))]
    items: list[dict[str, Any]] = []
    for name, (hardware, running) in zip(names, nodes, strict=True):
        items.extend(node_items(name, hardware, running, START_S))
    twins = shared, batched, alone = (Twin(clock, items, True, policy=policy),
                                      Twin(clock, items, True, batch=True, policy=policy),
                                      Twin(clock, items, False, policy=policy))
    bound: list[str] = []
    for step, operation in enumerate(operations):
        kind = operation[0]
        if kind == "pod":
            count, memory, cores = ASKS[operation[1]]
            pending = pod(f"p{step}", gpus=count, memory_mib=memory, cores=cores)
            if operation[2]:
                requests = pending["spec"]["containers"][0]["resources"]["requests"]
                requests["cpu"] = operation[2]
                requests["memory"] = f"{int(operation[2]) * 4}Gi"
            # kube-scheduler's list: every node, in an order of its own
            asked = names[step % len(names):] + names[:step % len(names)]
            decided = shared.schedule(pending, asked)
            assert decided == alone.schedule(pending, asked), f"step {step}: {operation}"
            assert decided == batched.schedule(pending, asked), f"step {step}: {operation} (batch placement)"
            if decided[-1] is not None:
                bound.append(pending["metadata"]["uid"])
        elif kind == "heartbeat" and operation[1] < len(names):
            name = names[operation[1]]
            fresh = hardware_node(name, nodes[operation[1]][0], clock.now - operation[2])
            for twin in twins:
                twin.state.upsert_node(fresh)
        elif kind == "time":
            clock.now += operation[1]
        elif kind == "cpu" and operation[1] < len(names):
            # a pod without GPUs lands on the node: its GPUs stay as they were, its free CPU (which bfgd reads) drops
            cpu_pod = cpu_only_pod(f"c{step}", names[operation[1]], operation[2])
            for twin in twins:
                twin.state.upsert_pod(cpu_pod)
        elif kind == "delete" and bound:
            uid = bound.pop(operation[1] % len(bound))
            for twin in twins:
                twin.state.delete_pod(uid)


def test_equivalent_nodes_are_placed_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A new request shape costs one placement per distinct node state, and each node's result carries its own
    name."""

    names = [f"n{i}" for i in range(30)]
    items: list[dict[str, Any]] = []
    for index, name in enumerate(names):
        items.extend(node_items(name, 1, [0] * (index % 3), START_S))  # three distinct states
    clock = Clock()
    twin = Twin(clock, items, True)
    calls = placed_nodes(monkeypatch)
    pending = pod(gpus=1, memory_mib=4096, cores=10)
    assert twin.scheduler.filter(pending, names).passed == names
    assert len(calls) == 3
    assert len({equivalence_key(twin.state.nodes[name]) for name in names}) == 3
    for name in names:
        cached = twin.state.nodes[name].fit_cache
        assert all(result.node_name == name for result in cached.values())
    # a UUID selector names one node's GPUs: no sharing then
    calls.clear()
    gpu_uuid = twin.state.nodes["n0"].gpus[0].uuid
    selective = pod(gpus=1, memory_mib=4096, cores=10, annotations={protocol.ANNOTATION_USE_GPU_UUID: gpu_uuid})
    assert twin.scheduler.filter(selective, names).passed == ["n0"]
    assert len(calls) == len(names)


def test_nodes_whose_gpus_match_but_whose_free_cpu_differs_are_not_equivalent() -> None:
    """bfgd reads a node's free CPU: the same GPU state with less CPU free is another class (and decides so)."""
    clock = Clock()
    items = node_items("n0", 1, [0], START_S) + node_items("n1", 1, [0], START_S)
    shared, alone = Twin(clock, items, True), Twin(clock, items, False)
    names = ["n0", "n1"]
    warm = pod("warm", gpus=1, memory_mib=8192, cores=20)
    assert shared.scheduler.filter(warm, names).passed == names  # bfgd in use: CPU changes now touch nodes
    alone.scheduler.filter(warm, names)
    assert equivalence_key(shared.state.nodes["n0"]) == equivalence_key(shared.state.nodes["n1"])
    for twin in (shared, alone):
        twin.state.upsert_pod(cpu_only_pod("busy", "n1", "60"))
    assert equivalence_key(shared.state.nodes["n0"]) != equivalence_key(shared.state.nodes["n1"])
    for step in range(3):
        pending = pod(f"p{step}", gpus=1, memory_mib=8192, cores=20)
        pending["spec"]["containers"][0]["resources"]["requests"]["cpu"] = "2"
        assert shared.schedule(pending, names) == alone.schedule(pending, names)


def test_a_new_shape_on_many_distinct_nodes_is_placed_in_one_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first pod of a request shape on BATCH_MIN_NODES or more distinct node states goes to bfgd's batch
    placement once; fit.place runs only where the batch leaves a node (here: the nodes it does not fit); the next
    pod of the shape answers from the kept results, and a verb that walks every node (a quota gate) looks for a
    batch again only once enough nodes changed."""
    from kube_vgpu.extender import scheduler as scheduler_module
    from kube_vgpu.extender.engine.policies.bfgd import BalancedFGD

    count = scheduler_module.BATCH_MIN_NODES + 8
    names = [f"n{i}" for i in range(count)]
    items: list[dict[str, Any]] = []
    for index, name in enumerate(names):
        items.extend(node_items(name, index % 2, [3] if index % 5 == 0 else [], START_S))  # every 5th: 1 GPU held
    clock = Clock()
    twin = Twin(clock, items, True, batch=False)
    twin.scheduler.batch_min_nodes = scheduler_module.BATCH_MIN_NODES
    for index, name in enumerate(names):  # free CPU differs on every node: all states distinct
        twin.state.upsert_pod(cpu_only_pod(f"c{index}", name, f"{index + 1}"))
    assert len({equivalence_key(twin.state.nodes[name]) for name in names}) == count
    placed: list[str] = []
    batches: list[int] = []
    real_place, real_batch = scheduler_module.place, BalancedFGD.place_batch

    def counting_place(node: Any, *args: Any, **kwargs: Any) -> Any:
        placed.append(node.name)
        return real_place(node, *args, **kwargs)

    def counting_batch(self: BalancedFGD, nodes: Any, request: Any, gathered: Any = None) -> Any:
        batches.append(len(nodes))
        return real_batch(self, nodes, request, gathered)

    monkeypatch.setattr(scheduler_module, "place", counting_place)
    monkeypatch.setattr(BalancedFGD, "place_batch", counting_batch)
    whole = pod(gpus=2, cores=100)  # two idle GPUs: the 2-GPU nodes with one held do not fit
    outcome = twin.scheduler.filter(whole, names)
    unfit = [name for index, name in enumerate(names) if index % 2 == 0 and index % 5 == 0]
    assert batches == [count]
    assert sorted(placed) == sorted(unfit)  # fit.place only for their reasons
    assert sorted(outcome.failed) == sorted(unfit) and len(outcome.passed) == count - len(unfit)
    twin.scheduler.filter(pod(gpus=2, cores=100), names)
    assert batches == [count]  # the shape's answer
    # with a gate every verb walks every node (no kept answer): a batch only once enough nodes changed since
    twin.scheduler.gates = [OpenGate()]
    shape = {"gpus": 1, "memory_mib": 4096, "cores": 10}
    placed.clear()
    assert twin.scheduler.filter(pod(**shape), names).passed == names
    assert batches == [count, count] and not placed
    for index in range(5):
        twin.state.upsert_pod(cpu_only_pod(f"d{index}", names[index], "50"))
    assert twin.scheduler.filter(pod(**shape), names).passed == names
    assert batches == [count, count] and sorted(placed) == sorted(names[:5])  # too few for a batch
    for index, name in enumerate(names):
        twin.state.upsert_pod(cpu_only_pod(f"e{index}", name, "70"))
    placed.clear()
    assert twin.scheduler.filter(pod(**shape), names).passed == names
    assert batches == [count, count, count] and not placed


def test_an_outdated_model_is_re_placed_in_one_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    """After the learned model changes, the next filter of a shape re-places its nodes in one batch of bfgd's (once
    per node-equivalence class: a twin takes its class's result) and the nodes the batch leaves (here: those the pod
    does not fit) one by one within the per-call budget; every kept result, the answer and prioritize's scores are
    then exactly the current model's, and the next pod of the shape places nothing."""
    from kube_vgpu.extender import scheduler as scheduler_module
    from kube_vgpu.extender.engine.policies.bfgd import BalancedFGD

    count = scheduler_module.BATCH_MIN_NODES + 8
    names = [f"n{i}" for i in range(count)]
    items: list[dict[str, Any]] = []
    for index, name in enumerate(names):
        items.extend(node_items(name, index % 2, [3] if index % 5 == 0 else [], START_S))  # every 5th: 1 GPU held
    items.extend(node_items("twin", 1, [], START_S))  # n1's twin, once its CPU is taken alike
    clock = Clock()
    twin = Twin(clock, items, True, batch=False)
    scheduler = twin.scheduler
    scheduler.batch_min_nodes = scheduler_module.BATCH_MIN_NODES
    for index, name in enumerate(names):  # free CPU differs on every node: all states distinct
        twin.state.upsert_pod(cpu_only_pod(f"c{index}", name, f"{index + 1}"))
    twin.state.upsert_pod(cpu_only_pod("c-twin", "twin", "2"))
    everyone = [*names, "twin"]
    whole = {"gpus": 2, "cores": 100}  # two idle GPUs: the 2-GPU nodes with one held do not fit
    unfit = [name for index, name in enumerate(names) if index % 2 == 0 and index % 5 == 0]
    first = scheduler.filter(pod("first", **whole), everyone)
    assert sorted(first.failed) == sorted(unfit)
    policy = scheduler.default_node_policy
    assert isinstance(policy, BalancedFGD)
    epoch = policy.epoch()
    for number in range(16):  # another workload: the next refresh changes the model
        scheduler.filter(pod(f"w{number}", gpus=1, memory_mib=30000, cores=40), [])
    assert policy.epoch() != epoch

    placed = placed_nodes(monkeypatch)
    batches: list[int] = []
    real_batch = BalancedFGD.place_batch

    def counting_batch(self: BalancedFGD, nodes: Any, request: Any, gathered: Any = None) -> Any:
        batches.append(len(nodes))
        return real_batch(self, nodes, request, gathered)

    monkeypatch.setattr(BalancedFGD, "place_batch", counting_batch)
    pending = pod("after", **whole)
    outcome = scheduler.filter(pending, everyone)
    assert batches == [count]  # the twin took n1's result
    assert sorted(placed) == sorted(unfit)  # left by the batch: one by one (fewer than the budget)
    assert sorted(outcome.failed) == sorted(unfit) and sorted(outcome.passed) == sorted(set(everyone) - set(unfit))
    request = scheduler._placement_request(pending, protocol.parse_pod_gpu_request(pending), policy, policy)
    current = {name: place(twin.state.nodes[name], request, policy, policy) for name in everyone}
    for name in everyone:
        assert list(twin.state.nodes[name].fit_cache.values()) == [current[name]], name
    expected = _scaled(outcome.passed, np.array([current[name].score for name in outcome.passed]))  # type: ignore[union-attr]
    assert scheduler.scaled_scores(pending, outcome.passed) == expected
    placed.clear()
    assert scheduler.filter(pod("next", **whole), everyone).passed == outcome.passed
    assert batches == [count] and not placed


def test_a_shape_answered_by_a_batch_expires_with_the_first_stale_heartbeat() -> None:
    """The nodes the batch placed go straight into the shape's answer; the answer must then end when the first of
    their heartbeats goes stale, as it does for the nodes the per-node loop judges."""
    from kube_vgpu.extender import scheduler as scheduler_module

    count = scheduler_module.BATCH_MIN_NODES + 8
    names = [f"n{i}" for i in range(count)]
    items: list[dict[str, Any]] = []
    for index, name in enumerate(names):  # every other node's heartbeat 100 s old, the others fresh
        items.extend(node_items(name, 1, [], START_S - (100.0 if index % 2 else 0.0)))
    clock = Clock()
    twin = Twin(clock, items, True, batch=False)
    twin.scheduler.batch_min_nodes = scheduler_module.BATCH_MIN_NODES
    for index, name in enumerate(names):  # free CPU differs on every node: all states distinct, all batch-placed
        twin.state.upsert_pod(cpu_only_pod(f"c{index}", name, f"{index + 1}"))
    shape = {"gpus": 1, "memory_mib": 4096, "cores": 10}
    assert twin.scheduler.filter(pod(**shape), names).passed == names
    clock.now += 30.0  # the older heartbeats are now 130 s old: past the 120 s TTL
    outcome = twin.scheduler.filter(pod(**shape), names)
    assert outcome.passed == names[::2]
    assert all("stale" in reason for reason in outcome.failed.values()) and len(outcome.failed) == count // 2


class OpenGate:
    """A gate that refuses nothing (Gate's hooks as no-ops)."""

    def check(self, pod: Any, request: Any, node: Any) -> str | None:
        return None

    def reserve(self, pod: Any, request: Any, node: Any, uid: str) -> str | None:
        return None

    def observe_filter(self, pod: Any, request: Any, passed: list[str]) -> None:
        return None

    def collector(self) -> None:
        return None

    def snapshot(self, gangs: Any = None) -> None:
        return None

    def queue_rules(self) -> None:
        return None

    def start(self) -> None:
        return None

    def stop(self) -> None:
        return None


def test_a_repeated_filter_passes_a_node_the_batch_judged_again() -> None:
    """Found by the property above (batch placement for any number of nodes): the last filter refused n0 for a
    stale heartbeat and passed n1; then n1 took the pod and n0's heartbeat came back. The repeated filter judges
    both again, in one batch: both pass (the batch's nodes were left out of what it compared with the last)."""
    clock = Clock()
    names = ["n0", "n1"]
    items = node_items("n0", 0, [], START_S) + node_items("n1", 0, [0], START_S)
    batched, alone = Twin(clock, items, True, batch=True), Twin(clock, items, False)
    clock.now += TTL_S + 10
    for twin in (batched, alone):
        twin.state.upsert_node(hardware_node("n1", 0, clock.now))
    count, memory, cores = ASKS[0]
    first = [twin.schedule(pod("p0", gpus=count, memory_mib=memory, cores=cores), names) for twin in (batched, alone)]
    assert first[0] == first[1] and first[0][0] == ["n1"]
    for twin in (batched, alone):
        twin.state.upsert_node(hardware_node("n0", 0, clock.now))
    second = [twin.schedule(pod("p1", gpus=count, memory_mib=memory, cores=cores), names) for twin in (batched, alone)]
    assert second[0] == second[1] and second[0][0] == names
