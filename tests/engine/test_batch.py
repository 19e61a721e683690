"""policies.batch: placing one request on many nodes at once over arrays gives exactly fit.place's placements and
scores (bfgd, the extender's default, and the look-ahead policies on it: lafgd, safgd, hsafgd), on random nodes in
every state the array rules read (host CPU and memory included); and what they leave to fit.place is only what the
module says."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from kube_vgpu import protocol
from kube_vgpu.dev.fixtures import TOPOLOGIES, synth_inventory
from kube_vgpu.extender.engine.fit import place
from kube_vgpu.extender.engine.model import FitFailure, GpuUsage, NodeState, PlacementRequest
from kube_vgpu.extender.engine.policies import REGISTRY, make_policy
from kube_vgpu.extender.engine.policies.base import Policy
from kube_vgpu.extender.engine.policies.batch import (
    _Measure,
    batch_container,
    gains_of_each_change,
    node_group,
    quantised_gains,
)
from kube_vgpu.extender.engine.policies.bfgd import BalancedFGD
from kube_vgpu.extender.engine.policies.fgd import quantised_gain
from kube_vgpu.extender.engine.policies.hostsupply import HostSupplyFGD
from kube_vgpu.extender.engine.policies.lookahead import LookaheadFGD
from kube_vgpu.extender.engine.policies.supply import SupplyLookaheadFGD
from tests.helpers import pod

#: hardware built once per (GPUs, memory, topology): synth_inventory runs the device plugin's discovery
_INVENTORIES: dict[tuple[int, int, str], protocol.NodeInventory] = {}


def random_node(rng: random.Random, name: str) -> NodeState:
    gpus = rng.choice((1, 2, 4, 8, 8, 8))
    memory_mib = rng.choice((81920, 40960, 16384))
    topology = rng.choice(TOPOLOGIES)
    inventory = _INVENTORIES.get((gpus, memory_mib, topology))
    if inventory is None:
        inventory = _INVENTORIES[(gpus, memory_mib, topology)] = synth_inventory(
            "n", gpus, "A100", memory_mib, topology)
    cpu_total = rng.choice((0, 64000, 128000))
    node = NodeState(name, inventory, cpu_milli_total=cpu_total)
    node.cpu_milli_used = rng.randrange(0, cpu_total + 1, 1000) if cpu_total else 0
    node.memory_mib_total = rng.choice((0, 262144, 524288))  # 0: unknown (hsafgd's memory filter off)
    node.memory_mib_used = rng.randrange(0, node.memory_mib_total + 1, 4096) if node.memory_mib_total else 0
    for gpu in node.gpus:
        roll = rng.random()
        if roll < 0.25:
            continue  # idle
        if roll < 0.3:
            usage = GpuUsage(gpu.position, gpu.memory_mib, gpu.cores, 1, True)  # held whole
        else:
            vgpus = rng.randint(1, 4)
            usage = GpuUsage(gpu.position, rng.randrange(0, gpu.memory_mib + 1, 1024), rng.randrange(0, 101, 5),
                             vgpus, False)
        node.apply_usage((usage,))
        if rng.random() < 0.05:
            gpu.healthy = False
        if rng.random() < 0.05:
            gpu.max_vgpus = gpu.used_vgpus  # out of slots
    if rng.random() < 0.05 and len(node.gpus) > 1:
        node.gpus[-1].memory_mib //= 2  # mixed hardware: left to fit.place
    node.touch()
    return node


def random_request(rng: random.Random) -> PlacementRequest:
    memory = rng.choice(("mib", "percent", "none"))
    kwargs: dict[str, int | None] = {
        "gpus": rng.choice((1, 1, 1, 2, 3, 4)),
        "cores": rng.choice((None, 0, 5, 10, 25, 50, 100)),
        "memory_mib": rng.randrange(1024, 40961, 1024) if memory == "mib" else None,
        "memory_percent": rng.choice((10, 25, 50)) if memory == "percent" else None,
    }
    return PlacementRequest(protocol.parse_pod_gpu_request(pod(**kwargs)), cpu_milli=rng.randrange(0, 32001, 500),
                            memory_mib=rng.choice((0, 8192, 65536, 131072)))


def learned_policy(rng: random.Random, name: str = "bfgd", **options: object) -> Policy:
    policy = make_policy(name, **options)
    for _ in range(rng.choice((0, 3, 40))):  # nothing learned, one refresh, several
        policy.observe(random_request(rng))
    return policy


def check(policy: Policy, nodes: list[NodeState], request: PlacementRequest) -> int:
    """Batch results equal fit.place's wherever given; returns how many were given."""
    got = policy.place_batch(nodes, request)
    assert got is not None
    assert len(got) == len(nodes)
    given = 0
    for node, result in zip(nodes, got, strict=True):
        expected = place(node, request, policy, policy)
        if result is None:
            covered = batch_container(request) is not None and node_group(node) is not None
            assert not covered or isinstance(expected, FitFailure), (node.name, expected)
            continue
        given += 1
        assert result == expected, (node.name, request, result, expected)
    return given


#: the policies that place in batches, with the options that change what the batch computes
BATCHED = [("bfgd", {}), ("bfgd", {"reference_ties": True}), ("lafgd", {}), ("lafgd", {"mode": "deep"}),
           ("safgd", {}), ("hsafgd", {}), ("hsafgd", {"balance_weight": 0.0})]


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize(("name", "options"), BATCHED)
def test_batch_places_exactly_as_fit_place(seed: int, name: str, options: dict[str, object]) -> None:
    rng = random.Random(seed)
    nodes = [random_node(rng, f"node-{i}") for i in range(60)]
    policy = learned_policy(rng, name, **options)
    given = 0
    for _ in range(25):
        given += check(policy, nodes, random_request(rng))
    assert given > 200  # the array rules cover most nodes, not a few


def test_nodes_in_equal_states_and_ties() -> None:
    """Idle and half-used alike nodes tie on every GPU: the tie-breaks (a split GPU first, least damaging idle GPU
    on linked nodes, lowest index without links) are fit.place's."""
    rng = random.Random(5)
    policy = learned_policy(rng)
    nodes = []
    for number, topology in enumerate(TOPOLOGIES * 3):
        node = NodeState(f"n{number}", synth_inventory("n", 8, "A100", 81920, topology), cpu_milli_total=64000)
        for position in range(number % 4):  # 0-3 GPUs split alike
            node.apply_usage((GpuUsage(position * 2, 8192, 20, 1, False),))
        node.touch()
        nodes.append(node)
    for shape in ({"gpus": 1, "memory_mib": 8192, "cores": 20}, {"gpus": 1, "cores": 100},
                  {"gpus": 2, "memory_mib": 4096, "cores": 10}, {"gpus": 4, "cores": 100}):
        request = PlacementRequest(protocol.parse_pod_gpu_request(pod(**shape)), cpu_milli=4000)
        assert check(policy, nodes, request) == len(nodes)


def test_what_is_left_to_fit_place() -> None:
    rng = random.Random(3)
    policy = learned_policy(rng)
    nodes = [random_node(rng, f"n{i}") for i in range(10)]
    with_init = PlacementRequest(protocol.parse_pod_gpu_request(pod(gpus=1, memory_mib=1024, init_gpus=1)))
    assert batch_container(with_init) is None
    assert policy.place_batch(nodes, with_init) == [None] * len(nodes)
    selected = pod(gpus=1, memory_mib=1024, annotations={protocol.ANNOTATION_NUMA_BIND: "true"})
    assert batch_container(PlacementRequest(protocol.parse_pod_gpu_request(selected))) is None
    full = NodeState("full", synth_inventory("full", 2, "A100", 81920, "pcie"), cpu_milli_total=64000)
    for gpu in full.gpus:
        full.apply_usage((GpuUsage(gpu.position, gpu.memory_mib, gpu.cores, 1, True),))
    full.touch()
    request = PlacementRequest(protocol.parse_pod_gpu_request(pod(gpus=1, memory_mib=1024, cores=10)))
    assert policy.place_batch([full], request) == [None]  # does not fit: fit.place says why
    assert isinstance(place(full, request, policy, policy), FitFailure)


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_every_policy_batches_exactly_or_not_at_all(name: str) -> None:
    """Every policy that offers batch placement places exactly as fit.place (a policy that inherits it but measures
    otherwise must not offer it); bfgd and the look-ahead policies on it offer it."""
    rng = random.Random(11)
    policy = learned_policy(rng, name)
    nodes = [random_node(rng, f"n{i}") for i in range(30)]
    for _ in range(6):
        request = random_request(rng)
        if policy.place_batch(nodes, request) is None:
            continue
        check(policy, nodes, request)
    offered = policy.place_batch(nodes, random_request(rng)) is not None
    assert offered == (type(policy) in (BalancedFGD, LookaheadFGD, SupplyLookaheadFGD, HostSupplyFGD))


def test_unquantised_look_ahead_is_left_to_fit_place() -> None:
    """The arrays score by the reference's integer gain only; lafgd's unquantised variant does not batch."""
    rng = random.Random(4)
    nodes = [random_node(rng, f"n{i}") for i in range(5)]
    assert learned_policy(rng, "lafgd", quantised=False).place_batch(nodes, random_request(rng)) is None


def test_quantised_gains_at_the_steps_are_math_exps() -> None:
    """Differences that put 100 * sigmoid right at an integer step are recomputed with math.exp."""
    steps = [1000 * math.log(k / (100 - k)) for k in range(1, 100)]  # sigmoid(x) * 100 == k
    differences = np.array([d + e for d in steps for e in (-1e-12, 0.0, 1e-12)] + [0.0, 5000.0, -5000.0])
    gains = quantised_gains(differences, np.zeros_like(differences))
    assert gains.tolist() == [quantised_gain(float(d), 0.0) for d in differences]


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize(("name", "options"), BATCHED)
def test_columns_gathered_by_the_caller_place_as_each_node_read(seed: int, name: str, options: dict[str, object]
                                                                ) -> None:
    """The extender keeps a new shape's columns from one shape to the next (extender.node_columns) and hands them
    to the batch: the same placements as the batch reading each node (so fit.place's), on nodes all of one group."""
    from kube_vgpu.extender.node_columns import NodeColumns

    rng = random.Random(seed)
    nodes = []
    while len(nodes) < 40:  # random_node's states, of its one most common group
        node = random_node(rng, f"node-{len(nodes)}")
        if node_group(node) == (8, "A100", 81920, 100):
            nodes.append(node)
    names = [node.name for node in nodes]
    kept = NodeColumns.gather(names, nodes, list(range(1, 41)), 0, 0)
    assert kept is not None
    policy = learned_policy(rng, name, **options)
    for number in range(25):
        asked = names if number % 2 else sorted(rng.sample(names, 25))  # the list kept, or part of it
        selected = kept.select(asked)
        assert selected is not None
        nodes_asked = selected.nodes
        assert [node.name for node in nodes_asked] == asked
        request = random_request(rng)
        assert policy.place_batch(nodes_asked, request, selected.gathered) == policy.place_batch(nodes_asked, request)


def test_sums_and_products_beyond_32_bits_are_taken_in_64() -> None:
    """The columns are 32-bit; on a GPU of 3 TiB (memory x 1000 > 2^31) the batch computes in 64 bits: fit.place's
    results still."""
    rng = random.Random(9)
    policy = learned_policy(rng)
    nodes = []
    for number in range(12):
        node = NodeState(f"n{number}", synth_inventory("n", 4, "HUGE", 3_145_728, "pcie"), cpu_milli_total=64000)
        if number % 3:
            node.apply_usage((GpuUsage(number % 4, 1_048_576 * (number % 3), 10 * (number % 4), 1, False),))
        node.touch()
        nodes.append(node)
    asks: list[dict[str, int]] = [{"memory_mib": 500_000}, {"memory_mib": 1_048_576}, {"memory_percent": 90}]
    for ask in asks:
        for gpus in (1, 2):
            request = PlacementRequest(protocol.parse_pod_gpu_request(pod(gpus=gpus, cores=10, **ask)))
            assert check(policy, nodes, request) >= 1


@pytest.mark.parametrize("gpus_per_node", [8, 32])
def test_whole_gpu_choices_are_made_once_per_distinct_node_and_spread(gpus_per_node: int) -> None:
    """A multi-GPU (or exclusive) container's GPUs are chosen once per distinct (link matrix, fitting GPUs, idle
    GPUs) and spread to every node so keyed, as fit.place chooses them node by node; nodes of 32 GPUs key their
    choices beyond 64 bits."""
    rng = random.Random(11)
    policy = learned_policy(rng)
    nodes = []
    for number in range(40):
        topology = TOPOLOGIES[number % len(TOPOLOGIES)]
        node = NodeState(f"n{number}", synth_inventory("n", gpus_per_node, "A100", 81920, topology),
                         cpu_milli_total=64000)
        for position in rng.sample(range(gpus_per_node), number % 5):  # alike nodes, and nodes of their own
            node.apply_usage((GpuUsage(position, 8192 * (1 + number % 3), 20, 1, False),))
        node.touch()
        nodes.append(node)
    for shape in ({"gpus": 2, "memory_mib": 4096, "cores": 10}, {"gpus": 3, "cores": 100}, {"gpus": 1, "cores": 100},
                  {"gpus": gpus_per_node, "cores": 100}):
        request = PlacementRequest(protocol.parse_pod_gpu_request(pod(**shape)), cpu_milli=4000)
        assert check(policy, nodes, request) >= 8


def change_measure_inputs(seed: int, width: int, count: int = 300) -> tuple[_Measure, np.ndarray, np.ndarray,
                                                                            np.ndarray, np.ndarray]:
    """A learned bfgd measure of A100 80 GB GPUs, and random free shares per GPU, the shares once one more vGPU is
    taken (at most the free ones), free host CPU and whether it is known, as _place_group passes them."""
    rng = random.Random(seed)
    policy = BalancedFGD()
    for _ in range(40):  # a workload of tens of shapes, as a cluster's: sums that round
        policy.observe(random_request(rng))
    measure = _Measure(policy, "A100", 81920, 0.0)
    numbers = np.random.default_rng(seed)
    free = numbers.choice([0, 50, 100, 250, 500, 750, 1000], size=(count, width)).astype(np.int32)
    free[numbers.random((count, width)) < 0.3] = numbers.integers(0, 1001, size=1)  # some not on the asks' grid
    taken = (free * numbers.random((count, width))).astype(np.int32)
    cpu_known = numbers.random(count) < 0.8
    cpu_free = np.where(cpu_known, numbers.integers(-2000, 64001, size=count), 1 << 40)
    return measure, free, taken, cpu_free, cpu_known


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("width", [1, 2, 8, 32])
def test_rounded_change_measures_are_the_exact_ones_within_their_bound(seed: int, width: int) -> None:
    """of_each_change_rounded sums the shapes' terms per ask instead of in the model's order: each value is within
    the bound it returns of of_each_change's, and the bound is far below a gain step (a measure unit moves
    100 * sigmoid by at most 1/40)."""
    measure, free, taken, cpu_free, cpu_known = change_measure_inputs(seed, width)
    exact = measure.of_each_change(free, taken, cpu_free, cpu_known, None)
    rounded, bound = measure.of_each_change_rounded(free, taken, cpu_free, cpu_known, None)
    assert rounded.shape == exact.shape == free.shape
    assert 0.0 <= bound < 1e-6
    assert float(np.abs(rounded - exact).max()) <= bound


@pytest.mark.parametrize("seed", range(6))
def test_gains_from_rounded_measures_are_the_exact_ones_at_the_steps(seed: int) -> None:
    """Where a rounded measure leaves 100 * sigmoid near an integer step, the row is measured again exactly: with
    the measure as it is equal to one variant's (no change: exactly 50, where a rounded value a hair above it would
    give 49), every gain is the exact one."""
    measure, free, taken, cpu_free, cpu_known = change_measure_inputs(seed, 8)
    exact = measure.of_each_change(free, taken, cpu_free, cpu_known, None)
    rounded, _ = measure.of_each_change_rounded(free, taken, cpu_free, cpu_known, None)
    # per node, a variant rounded above its exact value where there is one
    variant = (rounded > exact).argmax(axis=1)
    assert bool((rounded > exact).any())  # the case the test is for happens
    before = exact[np.arange(len(exact)), variant]
    expected = quantised_gains(before[:, None], exact)
    assert (expected[np.arange(len(exact)), variant] == 50).all()
    gains = gains_of_each_change(measure, before, free, taken, cpu_free, cpu_known, None)
    assert gains.tolist() == expected.tolist()


def test_gains_with_a_share_above_the_free_one_are_the_exact_ones() -> None:
    """The rounded sum assumes placing the pod frees nothing (taken <= free); where a GPU's taken share is above
    its free one, the gains are of_each_change's all the same."""
    measure, free, taken, cpu_free, cpu_known = change_measure_inputs(3, 8)
    taken[::7, 2] = np.minimum(free[::7, 2] + 150, 1000)
    assert bool((taken > free).any())
    before = measure.of(free, cpu_free, cpu_known, None)
    expected = quantised_gains(before[:, None], measure.of_each_change(free, taken, cpu_free, cpu_known, None))
    gains = gains_of_each_change(measure, before, free, taken, cpu_free, cpu_known, None)
    assert gains.tolist() == expected.tolist()
