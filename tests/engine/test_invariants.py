"""Hypothesis: no sequence of binds and releases ever over-commits a GPU."""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kube_vgpu import protocol
from kube_vgpu.extender.scheduler import BindError, Scheduler
from kube_vgpu.extender.sources.snapshot import SnapshotCluster
from kube_vgpu.extender.state import ClusterState
from tests.helpers import gpu_node, pod

pod_shapes = st.fixed_dictionaries(
    {
        "gpus": st.integers(1, 3),
        "memory_mib": st.one_of(st.none(), st.integers(1, 20000)),
        "cores": st.one_of(st.none(), st.sampled_from([0, 10, 30, 50, 100])),
        "policy": st.sampled_from(["binpack", "spread", "topology"]),
    }
)
operations = st.lists(
    st.one_of(
        st.tuples(st.just("bind"), pod_shapes, st.integers(0, 2)),
        st.tuples(st.just("release"), st.integers(0, 50), st.just(0)),
    ),
    min_size=1,
    max_size=40,
)


def check_invariants(cluster: SnapshotCluster, state: ClusterState) -> None:
    # recompute usage from the assignment annotations alone (the source of truth) and compare
    per_gpu: dict[str, list[int]] = {}
    exclusive_users: dict[str, int] = {}
    for stored in cluster.pods.values():
        text = (stored["metadata"].get("annotations") or {}).get(protocol.POD_ASSIGNMENT_ANNOTATION)
        if not text:
            continue
        for device in protocol.decode_assignment(text).all_devices():
            entry = per_gpu.setdefault(device.uuid, [0, 0, 0])
            entry[0] += device.memory_mib
            entry[1] += device.cores
            entry[2] += 1
            if device.cores >= 100:
                exclusive_users[device.uuid] = exclusive_users.get(device.uuid, 0) + 1
    for node in state.nodes.values():
        for gpu in node.gpus:
            memory, cores, shares = per_gpu.get(gpu.uuid, [0, 0, 0])
            assert memory <= gpu.memory_mib and cores <= gpu.cores and shares <= gpu.max_shares
            assert (gpu.used_memory_mib, gpu.used_cores, gpu.used_shares) == (memory, cores, shares)
            if exclusive_users.get(gpu.uuid):
                assert shares == 1, "an exclusive vGPU shares its GPU"


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(operations)
def test_binds_and_releases_never_overcommit(ops: list[tuple[str, Any, int]]) -> None:
    state = ClusterState()
    nodes = [
        gpu_node(f"n{i}", gpus=4, memory_mib=24000, topology=t)
        for i, t in enumerate(["nvswitch", "pcie", "nvlink-pairs"])
    ]
    cluster = SnapshotCluster(state, nodes)
    scheduler = Scheduler(state, cluster)
    bound: list[dict[str, Any]] = []
    for op, arg, node_index in ops:
        if op == "bind":
            shape = dict(arg)
            policy = shape.pop("policy")
            new_pod = pod(**shape, annotations={protocol.ANNOTATION_GPU_POLICY: policy})
            cluster.add_pod(new_pod)
            names = [n["metadata"]["name"] for n in nodes]
            outcome = scheduler.filter(new_pod, names)
            target = names[node_index] if names[node_index] in outcome.passed else None
            meta = new_pod["metadata"]
            try:
                # also bind to nodes filter rejected: bind must re-check and refuse, never over-commit
                scheduler.bind(meta["namespace"], meta["name"], meta["uid"], target or names[node_index])
                bound.append(new_pod)
                assert target is not None, "bind accepted a node that filter rejected"
            except BindError:
                assert target is None, "bind refused a node that filter accepted"
        elif bound:
            victim = bound.pop(arg % len(bound))
            cluster.delete_pod(victim["metadata"]["namespace"], victim["metadata"]["name"])
        check_invariants(cluster, state)
