"""The columns a new request shape's batch reads, kept from one new shape to the next (extender.node_columns):
patched from the state's change journal, they decide exactly as reading every node afresh, through binds, pods
without GPUs (host CPU), heartbeats fresh and expired, the clock, pod deletions, nodes deleted and added back and a
node whose GPUs change kind; and they are what the next new shape reads."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kube_vgpu import protocol
from kube_vgpu.extender import scheduler as scheduler_module
from kube_vgpu.extender.engine.model import NodeState
from kube_vgpu.extender.engine.policies.batch import node_row
from kube_vgpu.extender.node_columns import NodeColumns
from kube_vgpu.extender.scheduler import equivalence_key
from tests.extender.test_node_equivalence import (
    ASKS,
    START_S,
    TTL_S,
    Clock,
    Twin,
    cpu_only_pod,
    hardware_node,
    node_items,
)
from tests.helpers import pod

#: HARDWARE's 8-GPU kind: every node of one group, as the columns need
EIGHT_GPUS = 3
#: HARDWARE's 2-GPU kind: a node changed to it leaves the group
TWO_GPUS = 0


def distinct_cluster(count: int, running: list[list[int]]) -> tuple[list[str], list[dict[str, Any]]]:
    """count 8-GPU nodes, each with its running pods and a pod without GPUs asking its own number of CPUs (every
    node its own node-equivalence class)."""
    names = [f"n{index}" for index in range(count)]
    items: list[dict[str, Any]] = []
    for index, name in enumerate(names):
        items.extend(node_items(name, EIGHT_GPUS, running[index % len(running)] if running else [], START_S))
        items.append(cpu_only_pod(f"own-{name}", name, str(index + 1)))
    return names, items


def assert_current(columns: NodeColumns, twin: Twin) -> None:
    """Every kept value is the node's own, as the state holds it now."""
    nodes = twin.state.nodes
    for position, name in enumerate(columns.names):
        node = nodes[name]
        row = node_row(node)
        assert columns.nodes[position] is node
        assert row is not None and row[0] == columns.group and columns.columns[position].tobytes() == row[1]
        assert columns.cpu_total[position] == node.cpu_milli_total
        assert columns.cpu_used[position] == node.cpu_milli_used
        assert columns.links[position] == (node.link_id if node.has_links else -1)
        assert columns.heartbeats[position] == node.heartbeat_s
        assert columns.equivalences[position] == columns.equivalence_array[position] == equivalence_key(node)


def kept_reads(twin: Twin) -> list[bool]:
    """Records, for each new shape's batch of the twin's scheduler, whether it read the kept columns, and checks
    that what it read was current."""
    reads: list[bool] = []
    scheduler = twin.scheduler
    real = scheduler._kept_batch

    def recording(*args: Any) -> Any:
        result = real(*args)
        reads.append(isinstance(result, tuple))  # else None (none kept) or the loop decides
        if result is not None:
            assert scheduler._node_columns is not None
            assert_current(scheduler._node_columns, twin)
        return result

    scheduler._kept_batch = recording  # type: ignore[method-assign, assignment]
    return reads


def test_the_next_new_shape_reads_the_kept_columns_patched_for_the_nodes_changed_since(
        monkeypatch: pytest.MonkeyPatch) -> None:
    names, items = distinct_cluster(40, [[0], [1, 2], []])
    clock = Clock()
    kept, alone = Twin(clock, items, True, batch=True), Twin(clock, items, False)
    reads = kept_reads(kept)
    scheduler = kept.scheduler

    def both(step: int, memory_mib: int, asked: list[str] | None = None) -> None:
        pending = pod(f"p{step}", gpus=1, memory_mib=memory_mib, cores=10)
        asked = names if asked is None else asked
        assert kept.schedule(pending, asked) == alone.schedule(pending, asked), step

    both(0, 4096)
    columns = scheduler._node_columns
    assert reads == [False] and columns is not None and columns.names == names
    # binds (from the schedules), a pod without GPUs, a heartbeat: the next new shape patches those nodes
    both(1, 5000)
    for twin in (kept, alone):
        twin.state.upsert_pod(cpu_only_pod("busy", "n7", "50"))  # 58 CPUs: a class of its own
        twin.state.upsert_node(hardware_node("n9", EIGHT_GPUS, START_S + 5))
    both(2, 6000)
    assert reads == [False, True, True] and scheduler._node_columns is columns  # each read checked current
    assert columns.cpu_used[names.index("n7")] == 58_000 and columns.heartbeats[names.index("n9")] == START_S + 5
    # an expired heartbeat: the kept columns say so, the loop decides (the node is refused) without reading every
    # node again first
    whole_reads: list[int] = []
    real_whole = scheduler_module._whole_batch

    def counting_whole(names: list[str], *args: Any) -> Any:
        whole_reads.append(len(names))
        return real_whole(names, *args)

    monkeypatch.setattr(scheduler_module, "_whole_batch", counting_whole)
    for twin in (kept, alone):
        twin.state.upsert_node(hardware_node(names[0], EIGHT_GPUS, clock.now - TTL_S - 1))
    both(3, 7000)
    assert reads[-1] is False and scheduler._node_columns is columns and not whole_reads
    for twin in (kept, alone):
        twin.state.upsert_node(hardware_node(names[0], EIGHT_GPUS, clock.now))
    both(4, 8000)
    assert reads[-1] is True
    # kube-scheduler's own plugins passed part of the nodes: that part of the kept columns, in the order asked
    both(41, 8100, names[::3])
    assert reads[-1] is True and scheduler._node_columns is columns
    # most nodes' heartbeats (the device plugins' period): patched, heartbeats only (the nodes' versions unchanged;
    # more journal entries than nodes kept would gather them again)
    versions = list(columns.versions)
    renewed = names[:35]
    for twin in (kept, alone):
        for name in renewed:
            twin.state.upsert_node(hardware_node(name, EIGHT_GPUS, clock.now + 1))
    both(42, 8200)
    assert reads[-1] is True and scheduler._node_columns is columns
    bound_since = [position for position, (old, new) in enumerate(zip(versions, columns.versions, strict=True))
                   if old != new]
    assert len(bound_since) <= 2  # the nodes the last two pods were bound to: their rows read again
    assert all(columns.heartbeats[names.index(name)] == clock.now + 1 for name in renewed)
    # a node gone: the columns are dropped and gathered again for the new list
    for twin in (kept, alone):
        twin.state.delete_node("n3")
    names.remove("n3")
    both(5, 9000)
    assert reads[-1] is False and scheduler._node_columns is not columns
    # a node whose GPUs change kind leaves the group: no columns kept, each node read as before
    for twin in (kept, alone):
        twin.state.upsert_node(hardware_node("n5", TWO_GPUS, clock.now))
    both(6, 10000)
    both(7, 11000)
    assert reads[-2:] == [False, False] and scheduler._node_columns is None


def test_only_a_request_key_judged_again_looks_for_results_in_the_nodes_caches(
        monkeypatch: pytest.MonkeyPatch) -> None:
    names, items = distinct_cluster(40, [[0], [1, 2], []])
    clock = Clock()
    kept, alone = Twin(clock, items, True, batch=True), Twin(clock, items, False)
    scheduler = kept.scheduler
    looked: list[bool] = []
    real = scheduler_module._none_judged

    def recording(*args: Any) -> bool:
        looked.append(real(*args))
        return looked[-1]

    monkeypatch.setattr(scheduler_module, "_none_judged", recording)
    first = pod("p0", gpus=1, memory_mib=4096, cores=10)
    assert kept.schedule(first, names) == alone.schedule(first, names)
    assert looked == []  # a new key: no node can hold a result under it (gathered, then placed in one batch)
    # the shape's answer and class results gone (other shapes took the answer's place; a change of the learned model
    # starts the classes afresh): the nodes' caches still hold its results, which the loop takes
    scheduler._answers.clear()
    scheduler._class_results.clear()
    again = pod("p1", gpus=1, memory_mib=4096, cores=10)
    assert kept.schedule(again, names) == alone.schedule(again, names)
    assert looked == [False]
    # a key made but first judged by another (a gang's plan, under the state lock): judged again afterwards
    shape = pod("p2", gpus=1, memory_mib=6000, cores=10)
    request = scheduler._placement_request(shape, protocol.parse_pod_gpu_request(shape), scheduler.default_node_policy,
                                           scheduler.default_gpu_policy)
    key = scheduler._cache_key(request, scheduler.default_node_policy, scheduler.default_gpu_policy)
    assert scheduler._cache_key(request, scheduler.default_node_policy, scheduler.default_gpu_policy) == key
    assert scheduler._first_judged(key) and not scheduler._first_judged(key)
    assert kept.schedule(shape, names) == alone.schedule(shape, names)
    assert looked == [False, True]  # nothing cached after all: the batch placed them


def test_columns_are_gathered_only_for_nodes_all_of_one_group() -> None:
    eight = NodeState("a", None)
    names, items = distinct_cluster(3, [[0]])
    twin = Twin(Clock(), items, True, batch=True)
    nodes = [twin.state.nodes[name] for name in names]
    keys = [equivalence_key(node) for node in nodes]
    gathered = NodeColumns.gather(names, nodes, keys, 0, 0)
    assert gathered is not None and gathered.group == (8, "NVIDIA-A100-SXM4-80GB", 81920, 100)
    assert gathered.columns.shape == (3, 8, 5)
    whole = gathered.select(names)
    assert whole is not None and whole.all_distinct_classes() and whole.nodes == nodes
    assert NodeColumns.gather([*names, "a"], [*nodes, eight], [*keys, None], 0, 0) is None  # no GPUs: no row
    two = Twin(Clock(), node_items("b", TWO_GPUS, [], START_S), True).state.nodes["b"]
    assert NodeColumns.gather([*names, "b"], [*nodes, two], [*keys, equivalence_key(two)], 0, 0) is None
    twins = NodeColumns.gather([names[0], names[0]], [nodes[0], nodes[0]], [keys[0], keys[0]], 0, 0)
    selected_twins = None if twins is None else twins.select([names[0], names[0]])
    assert selected_twins is not None and not selected_twins.all_distinct_classes()
    assert NodeColumns.gather([], [], [], 0, 0) is None


operations_strategy = st.lists(
    st.one_of(
        st.tuples(st.just("pod"), st.integers(0, len(ASKS) - 1), st.integers(0, 7)),
        st.tuples(st.just("heartbeat"), st.integers(0, 9), st.sampled_from([0.0, 100.0])),
        st.tuples(st.just("time"), st.sampled_from([10.0, 30.0, 130.0]), st.just(0)),
        st.tuples(st.just("heartbeat-all"), st.just(0), st.just(0)),
        st.tuples(st.just("delete"), st.integers(0, 200), st.just(0)),
        st.tuples(st.just("cpu"), st.integers(0, 9), st.sampled_from(["1", "3", "20"])),
        st.tuples(st.just("node-delete"), st.integers(0, 9), st.just(0)),
        st.tuples(st.just("node-add"), st.integers(0, 9), st.sampled_from([EIGHT_GPUS, TWO_GPUS])),
    ),
    min_size=1, max_size=40,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(running=st.lists(st.lists(st.integers(0, 3), max_size=3), min_size=1, max_size=4),
       operations=operations_strategy)
def test_kept_columns_decide_exactly_as_every_node_on_its_own(
    running: list[list[int]], operations: list[tuple[Any, ...]]
) -> None:
    names, items = distinct_cluster(40, running)  # changes to the first 10: patched, not gathered again
    clock = Clock()
    kept, alone = Twin(clock, items, True, batch=True), Twin(clock, items, False)
    twins = (kept, alone)
    kept_reads(kept)  # each read of the kept columns checked current
    with pytest.MonkeyPatch.context() as patch:
        # after a change of the learned model the batch re-places every node of a shape at once, the node-by-node
        # twin STALE_REFRESH_PER_CALL a filter (by design: the rest answer with the older model's scores meanwhile);
        # with more nodes than that, the twin must re-place them all at once too to decide alike
        patch.setattr(scheduler_module, "STALE_REFRESH_PER_CALL", len(names))
        run_history(twins, clock, names, operations)


def run_history(twins: tuple[Twin, Twin], clock: Clock, names: list[str], operations: list[tuple[Any, ...]]) -> None:
    kept, alone = twins
    present = list(names)
    bound: list[str] = []
    for step, operation in enumerate(operations):
        kind, which, value = operation
        if kind == "pod":
            count, memory, cores = ASKS[which]
            # most pods a shape of their own (a new shape: a batch over every node), some a shape seen before; some
            # asked only part of the nodes (those kube-scheduler's own plugins passed)
            pending = pod(f"p{step}", gpus=count, memory_mib=memory + (step if value % 4 else 0), cores=cores)
            asked = [name for number, name in enumerate(names)
                     if name in present and (value < 4 or number % 4 != value % 4)]
            decided = kept.schedule(pending, asked)
            assert decided == alone.schedule(pending, asked), f"step {step}: {operation}"
            if decided[-1] is not None:
                bound.append(pending["metadata"]["uid"])
        else:
            apply_change(twins, clock, names, present, bound, step, operation)


def apply_change(twins: tuple[Twin, ...], clock: Clock, names: list[str], present: list[str], bound: list[str],
                 step: int, operation: tuple[Any, ...]) -> None:
    """One change of the history other than a pod, to every twin alike."""
    kind, which, value = operation
    if kind == "heartbeat" and names[which] in present:
        fresh = hardware_node(names[which], EIGHT_GPUS, clock.now - value)
        for twin in twins:
            twin.state.upsert_node(fresh)
    elif kind == "time":
        clock.now += which
    elif kind == "heartbeat-all":  # every node's heartbeat at once (a relist, or the device plugins' period)
        for name in present:
            renewed = hardware_node(name, EIGHT_GPUS, clock.now)
            for twin in twins:
                twin.state.upsert_node(renewed)
    elif kind == "cpu":
        cpu_pod = cpu_only_pod(f"c{step}", names[which], value)
        for twin in twins:
            twin.state.upsert_pod(cpu_pod)
    elif kind == "delete" and bound:
        uid = bound.pop(which % len(bound))
        for twin in twins:
            twin.state.delete_pod(uid)
    elif kind in ("node-delete", "node-add"):
        change_node(twins, clock, names[which], present, kind == "node-add", value)


def change_node(twins: tuple[Twin, ...], clock: Clock, name: str, present: list[str], add: bool, hardware: int
                ) -> None:
    """A node deleted, or added (back, or again as another kind of hardware), to every twin alike."""
    if not add:
        if name in present:
            present.remove(name)
            for twin in twins:
                twin.state.delete_node(name)
        return
    if name not in present:
        present.append(name)
    node = hardware_node(name, hardware, clock.now)
    for twin in twins:
        twin.state.upsert_node(node)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_kept_columns_are_read_in_long_histories(seed: int) -> None:
    """The property above reads the kept columns (a history of new shapes where they serve most of them), for
    every node kept or part of them (kube-scheduler's own plugins passed some nodes only)."""
    import random

    rng = random.Random(seed)
    names, items = distinct_cluster(40, [[0], [1], []])
    clock = Clock()
    kept, alone = Twin(clock, items, True, batch=True), Twin(clock, items, False)
    reads = kept_reads(kept)
    parts: list[bool] = []  # new shapes asking part of the nodes, served by the columns
    for step in range(30):
        if rng.random() < 0.3:  # a heartbeat (the binds of the pods change GPUs)
            renewed = hardware_node(rng.choice(names), EIGHT_GPUS, clock.now + step)
            for twin in (kept, alone):
                twin.state.upsert_node(renewed)
        count, memory, cores = ASKS[rng.randrange(len(ASKS))]
        pending = pod(f"p{step}", gpus=count, memory_mib=memory + step, cores=cores)
        asked = names if step < 2 or rng.random() < 0.5 else sorted(rng.sample(names, 30), key=names.index)
        before = len(reads)
        assert kept.schedule(pending, asked) == alone.schedule(pending, asked), step
        if asked is not names and any(reads[before:]):
            parts.append(True)  # part of the kept nodes, read from the columns
    assert sum(reads) >= len(reads) // 2 and parts
