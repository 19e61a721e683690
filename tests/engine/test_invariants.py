"""Hypothesis: no sequence of binds and releases ever over-commits a GPU, under every registered policy, for pods
with several app containers, init containers and native sidecars."""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kube_vgpu import protocol
from kube_vgpu.extender.engine.policies import policy_names
from kube_vgpu.extender.scheduler import BindError, Scheduler
from kube_vgpu.extender.sources.snapshot import SnapshotCluster
from kube_vgpu.extender.state import ClusterState
from tests.helpers import gpu_node, pod

POLICIES = policy_names()
#: policies whose GPU choice is the same for the same state: filter and bind must then agree on every node
DETERMINISTIC = frozenset(POLICIES) - {"random"}

container_shapes = st.fixed_dictionaries(
    {
        "gpus": st.integers(1, 3),
        "memory_mib": st.one_of(st.none(), st.integers(1, 20000)),
        "cores": st.one_of(st.none(), st.sampled_from([0, 10, 30, 50, 100])),
    }
)
pod_shapes = st.fixed_dictionaries(
    {
        "app": st.lists(container_shapes, max_size=3),
        # (container, is a native sidecar), in init order
        "init": st.lists(st.tuples(container_shapes, st.booleans()), max_size=3),
        "policy": st.sampled_from(POLICIES),
    }
).filter(lambda shape: bool(shape["app"] or shape["init"]))
operations = st.lists(
    st.one_of(
        st.tuples(st.just("bind"), pod_shapes, st.integers(0, 2)),
        st.tuples(st.just("release"), st.integers(0, 50), st.just(0)),
    ),
    min_size=1,
    max_size=40,
)


def gpu_limits(shape: dict[str, Any]) -> dict[str, str]:
    limits = {protocol.RESOURCE_GPU: str(shape["gpus"])}
    if shape["memory_mib"] is not None:
        limits[protocol.RESOURCE_GPU_MEMORY] = str(shape["memory_mib"])
    if shape["cores"] is not None:
        limits[protocol.RESOURCE_GPU_CORES] = str(shape["cores"])
    return limits


def build_pod(shape: dict[str, Any]) -> dict[str, Any]:
    policy = shape["policy"]
    obj = pod(gpus=None, annotations={protocol.ANNOTATION_GPU_POLICY: policy, protocol.ANNOTATION_NODE_POLICY: policy})
    template = obj["spec"]["containers"][0]
    obj["spec"]["containers"] = [
        {**template, "name": f"app-{i}", "resources": {"limits": gpu_limits(c), "requests": gpu_limits(c)}}
        for i, c in enumerate(shape["app"])
    ] or [template]  # a pod always has an app container; this one asks no GPU
    init = []
    for i, (c, sidecar) in enumerate(shape["init"]):
        container = {"name": f"init-{i}", "image": "busybox", "resources": {"limits": gpu_limits(c)}}
        if sidecar:
            container["restartPolicy"] = "Always"
        init.append(container)
    obj["spec"]["initContainers"] = init
    return obj


def moments(assignment: protocol.PodAssignment) -> list[list[protocol.ContainerAssignment]]:
    """The sidecar KEP's moments, written out independently of protocol.container_phases: init container i runs
    beside the sidecars before it; the app containers run beside every sidecar."""
    containers = assignment.containers
    init = [c for c in containers if c.init]
    result = []
    for i, container in enumerate(init):
        if not container.sidecar:
            result.append([s for s in init[:i] if s.sidecar] + [container])
    result.append([s for s in init if s.sidecar] + [c for c in containers if not c.init])
    return result


def check_invariants(cluster: SnapshotCluster, state: ClusterState) -> None:
    # recompute usage from the assignment annotations alone (the source of truth) and compare: per pod and GPU, the
    # largest of its moments; per GPU, the sum over pods
    held: dict[str, list[int]] = {}  # uuid -> [memory, cores, shares]
    holders: dict[str, int] = {}  # uuid -> pods holding it
    exclusive: set[str] = set()
    for stored in cluster.pods.values():
        text = (stored["metadata"].get("annotations") or {}).get(protocol.POD_ASSIGNMENT_ANNOTATION)
        if not text:
            continue
        peak: dict[str, list[int]] = {}
        for moment in moments(protocol.decode_assignment(text)):
            at_once: dict[str, list[int]] = {}
            for container in moment:
                for device in container.devices:
                    entry = at_once.setdefault(device.uuid, [0, 0, 0])
                    entry[0] += device.memory_mib
                    entry[1] += device.cores
                    entry[2] += 1
                    if device.cores >= 100:
                        exclusive.add(device.uuid)
            for uuid, values in at_once.items():
                if any(d.cores >= 100 for c in moment for d in c.devices if d.uuid == uuid):
                    assert values[2] == 1, "an exclusive vGPU shares its GPU with a container running beside it"
                current = peak.setdefault(uuid, [0, 0, 0])
                peak[uuid] = [max(a, b) for a, b in zip(current, values, strict=True)]
        for uuid, values in peak.items():
            total = held.setdefault(uuid, [0, 0, 0])
            held[uuid] = [a + b for a, b in zip(total, values, strict=True)]
            holders[uuid] = holders.get(uuid, 0) + 1
    for node in state.nodes.values():
        for gpu in node.gpus:
            memory, cores, shares = held.get(gpu.uuid, [0, 0, 0])
            assert memory <= gpu.memory_mib and cores <= gpu.cores and shares <= gpu.max_shares
            assert (gpu.used_memory_mib, gpu.used_cores, gpu.used_shares) == (memory, cores, shares)
            if gpu.uuid in exclusive:
                assert holders[gpu.uuid] == 1, "an exclusive GPU is held by another pod too"


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
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
            new_pod = build_pod(arg)
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
                if any(sidecar for _, sidecar in arg["init"]):
                    event("bound a pod with a native sidecar")
            except BindError:
                if arg["policy"] in DETERMINISTIC:
                    assert target is None, "bind refused a node that filter accepted"
        elif bound:
            victim = bound.pop(arg % len(bound))
            cluster.delete_pod(victim["metadata"]["namespace"], victim["metadata"]["name"])
        check_invariants(cluster, state)


def test_the_generator_reaches_every_policy_and_sidecars() -> None:
    """The invariant above is only as good as what it generates: every registered policy, and pods whose native
    sidecars hold GPUs beside app and init containers."""
    assert {"bfgd", "fgd", "binpack", "spread", "topology", "random"} <= set(POLICIES)
    sample = build_pod(
        {
            "app": [{"gpus": 1, "memory_mib": 100, "cores": None}],
            "init": [
                ({"gpus": 1, "memory_mib": 200, "cores": 10}, True),
                ({"gpus": 2, "memory_mib": None, "cores": 0}, False),
            ],
            "policy": "bfgd",
        }
    )
    request = protocol.parse_pod_gpu_request(sample)
    assert [(c.name, c.init, c.sidecar) for c in request.containers] == [
        ("init-0", True, True),
        ("init-1", True, False),
        ("app-0", False, False),
    ]
