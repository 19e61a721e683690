"""Host memory in the cluster state, as host CPU (tests/extender/test_host_cpu.py): allocatable per node and the
requests of every non-finished pod bound to it, kept from the same events as GPU usage, so that a policy reading
memory sees in the extender what the simulator gives it; the scheduler hands a pod's memory request to such a
policy, and only then do memory changes drop a node's cached results."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any, ClassVar

import pytest

from kube_vgpu.dev.fixtures import cpu_pod
from kube_vgpu.extender.engine.model import NodeState, Placement, PlacementRequest
from kube_vgpu.extender.engine.policies import REGISTRY
from kube_vgpu.extender.engine.policies.binpack import Binpack
from kube_vgpu.extender.scheduler import Scheduler
from kube_vgpu.extender.sources.snapshot import SnapshotCluster
from kube_vgpu.extender.state import ClusterState, bound_pod_host, node_allocatable_memory_mib
from tests.extender.test_host_cpu import finished
from tests.helpers import gpu_node, pod

GIB_MIB = 1024


def with_allocatable_memory(obj: dict[str, Any], memory: str) -> dict[str, Any]:
    changed = copy.deepcopy(obj)
    changed["status"]["allocatable"]["memory"] = memory
    return changed


@pytest.mark.parametrize(
    ("memory", "mib"),
    [("64Gi", 64 * GIB_MIB), ("1000Mi", 1000), ("1G", 953), ("1536Ki", 1), ("512Ki", 0), ("lots", 0), (None, 0)],
)
def test_allocatable_memory_in_whole_mib(memory: str | None, mib: int) -> None:
    node = gpu_node("n1")
    if memory is None:
        del node["status"]["allocatable"]["memory"]
    else:
        node["status"]["allocatable"]["memory"] = memory
    assert node_allocatable_memory_mib(node) == mib  # rounded down: what is surely there; 0 = unknown


def test_an_unreadable_allocatable_is_unknown_and_said(caplog: pytest.LogCaptureFixture) -> None:
    node = gpu_node("n1")
    node["status"]["allocatable"].update({"memory": "lots", "cpu": "many"})
    state = ClusterState()
    state.upsert_node(node)
    assert (state.nodes["n1"].memory_mib_total, state.nodes["n1"].cpu_milli_total) == (0, 0)
    said = [record.getMessage() for record in caplog.records]
    assert any("node n1: allocatable memory not read" in line for line in said), said
    assert any("node n1: allocatable cpu not read" in line for line in said), said


def test_a_pods_memory_is_counted_as_kube_scheduler_counts_it_in_whole_mib_rounded_up() -> None:
    spec_pod = cpu_pod(node_name="n1", cpu="500m", memory="1G")
    spec_pod["spec"]["initContainers"] = [{"name": "init", "resources": {"requests": {"memory": "3Gi"}}}]
    spec_pod["spec"]["overhead"] = {"memory": "1Mi"}
    # the init container's peak (3 GiB) beats the app's 1 GB; overhead on top (kubeapi.pod_requests' rules)
    assert bound_pod_host(spec_pod) == (500, 3 * GIB_MIB + 1)
    unreadable = cpu_pod(node_name="n1", memory="plenty")
    assert bound_pod_host(unreadable) == (0, 0)  # a warning, no crash


NODE = gpu_node("n1")  # allocatable memory 512 GiB (the fixture's)
WEB = cpu_pod(node_name="n1", cpu="2", memory="4Gi")
BATCH = cpu_pod(node_name="n1", cpu="0", memory="1Gi")  # memory without CPU still counts
ELSEWHERE = cpu_pod(node_name="n2", memory="8Gi")
PENDING = cpu_pod(memory="16Gi")

Step = tuple[str, Callable[[ClusterState], None], tuple[int, int]]

#: (what happens, the event, (allocatable MiB, requested MiB) of n1 after it)
STEPS: list[Step] = [
    ("a pod bound before its node is known", lambda s: s.upsert_pod(WEB), (0, 0)),
    ("the node arrives with the pod already bound", lambda s: s.upsert_node(NODE), (512 * GIB_MIB, 4 * GIB_MIB)),
    ("a pod asking memory and no CPU", lambda s: s.upsert_pod(BATCH), (512 * GIB_MIB, 5 * GIB_MIB)),
    ("a status update of a counted pod", lambda s: s.upsert_pod(finished(WEB, "Running")),
     (512 * GIB_MIB, 5 * GIB_MIB)),
    ("a pending pod counts nowhere", lambda s: s.upsert_pod(PENDING), (512 * GIB_MIB, 5 * GIB_MIB)),
    ("a pod on another node", lambda s: s.upsert_pod(ELSEWHERE), (512 * GIB_MIB, 5 * GIB_MIB)),
    ("the pending pod is bound here",
     lambda s: s.upsert_pod({**PENDING, "spec": {**PENDING["spec"], "nodeName": "n1"}}), (512 * GIB_MIB, 21 * GIB_MIB)),
    ("it finishes", lambda s: s.upsert_pod(finished(PENDING)), (512 * GIB_MIB, 5 * GIB_MIB)),
    ("allocatable shrinks", lambda s: s.upsert_node(with_allocatable_memory(NODE, "500Gi")),
     (500 * GIB_MIB, 5 * GIB_MIB)),
    ("the node is deleted", lambda s: s.delete_node("n1"), (0, 0)),
    ("it comes back: its pods are counted again", lambda s: s.upsert_node(NODE), (512 * GIB_MIB, 5 * GIB_MIB)),
    ("a pod is deleted", lambda s: s.delete_pod(WEB["metadata"]["uid"]), (512 * GIB_MIB, 1 * GIB_MIB)),
    ("a relist still has the other", lambda s: s.replace_pods([BATCH, ELSEWHERE]), (512 * GIB_MIB, 1 * GIB_MIB)),
    ("a relist without it", lambda s: s.replace_pods([ELSEWHERE]), (512 * GIB_MIB, 0)),
]


def test_memory_follows_pod_and_node_events() -> None:
    state = ClusterState()
    for description, event, (total, used) in STEPS:
        event(state)
        node = state.nodes.get("n1")
        seen = (node.memory_mib_total, node.memory_mib_used) if node else (0, 0)
        assert seen == (total, used), description
    assert state.memory_used_by_node == {"n2": 8 * GIB_MIB}  # n2 never registered: its pods wait for it
    assert state.cpu_used_by_node == {"n2": 2000}  # CPU kept beside it, as before


class MemoryReading(Binpack):
    """A policy that reads host memory, recording the requests it scores."""

    name = "test-memory-reading"
    uses_host_memory: ClassVar[bool] = True
    asked_mib: ClassVar[list[int]] = []

    def score(self, node: NodeState, request: PlacementRequest, placement: Placement) -> float:
        self.asked_mib.append(request.memory_mib)
        return super().score(node, request, placement) - node.memory_mib_used / max(node.memory_mib_total, 1)


def scheduler_with(policy: str) -> tuple[ClusterState, Scheduler]:
    state = ClusterState()
    cluster = SnapshotCluster(state, [gpu_node("n1")])
    return state, Scheduler(state, cluster, node_policy=policy, gpu_policy=policy,
                            policies={**REGISTRY, MemoryReading.name: MemoryReading})


@pytest.mark.parametrize(("policy", "touches"), [("bfgd", False), ("binpack", False), (MemoryReading.name, True)])
def test_memory_changes_drop_cached_results_only_for_policies_reading_memory(policy: str, touches: bool) -> None:
    state, scheduler = scheduler_with(policy)
    assert scheduler.filter(pod(memory_mib=1000), ["n1"]).passed == ["n1"]
    version = state.nodes["n1"].version
    state.upsert_pod(cpu_pod(node_name="n1", cpu="0", memory="2Gi"))
    assert state.nodes["n1"].memory_mib_used == 2 * GIB_MIB  # tracked either way
    assert (state.nodes["n1"].version != version) is touches


def test_the_scheduler_hands_the_pod_memory_request_to_a_policy_reading_it() -> None:
    MemoryReading.asked_mib.clear()
    _, scheduler = scheduler_with(MemoryReading.name)
    small, big = pod(gpus=1, cores=10), pod(gpus=1, cores=10)
    small["spec"]["containers"][0]["resources"]["requests"]["memory"] = "3Gi"
    big["spec"]["containers"][0]["resources"]["requests"]["memory"] = "5Gi"
    scheduler.filter(small, ["n1"])
    scheduler.filter(big, ["n1"])  # another memory ask: another cache entry, scored again
    assert MemoryReading.asked_mib == [3 * GIB_MIB, 5 * GIB_MIB]
    MemoryReading.asked_mib.clear()
    _, plain = scheduler_with("binpack")
    assert plain._placement_request(small, *_parsed(plain, small)).memory_mib == 0  # not read: not in the cache key


def _parsed(scheduler: Scheduler, obj: dict[str, Any]) -> tuple[Any, Any, Any]:
    from kube_vgpu import protocol

    request = protocol.parse_pod_gpu_request(obj)
    return (request, *scheduler._policies_for(request))


def test_hsafgd_reads_the_memory_the_extender_keeps() -> None:
    """hsafgd (policies/hostsupply.py) prices a hole by the fillers its node can still feed, host memory included:
    through the extender's state, two nodes alike but for the memory a CPU-only pod holds get different scores
    under hsafgd, and the same under bfgd (which reads CPU, not memory)."""
    scores: dict[str, dict[str, int]] = {}
    for policy in ("hsafgd", "bfgd"):
        state = ClusterState()
        cluster = SnapshotCluster(state, [gpu_node("roomy", gpus=1), gpu_node("tight", gpus=1),
                                          cpu_pod(node_name="tight", cpu="0", memory="500Gi")])
        scheduler = Scheduler(state, cluster, node_policy=policy, gpu_policy=policy)
        assert state.nodes["tight"].memory_mib_used == 500 * GIB_MIB
        # the learned workload: shares asking much host memory, whole GPUs asking little
        for number in range(16):
            seen = pod(f"seen{number}", gpus=1, memory_mib=40960 if number % 2 else 81920,
                       cores=50 if number % 2 else 100)
            seen["spec"]["containers"][0]["resources"]["requests"]["memory"] = "64Gi" if number % 2 else "1Gi"
            scheduler.filter(seen, ["roomy", "tight"])
        pending = pod("pending", gpus=1, memory_mib=40960, cores=50)
        pending["spec"]["containers"][0]["resources"]["requests"]["memory"] = "1Gi"
        assert scheduler.filter(pending, ["roomy", "tight"]).passed == ["roomy", "tight"]
        scores[policy] = {name: score for name, score in scheduler.prioritize(pending, ["roomy", "tight"])}
    assert scores["bfgd"]["roomy"] == scores["bfgd"]["tight"]
    # on "tight" the half GPU left cannot be filled (no memory for the shares that would fill it): worse there
    assert scores["hsafgd"]["roomy"] > scores["hsafgd"]["tight"]


@pytest.mark.parametrize(
    ("policy", "reads_memory"), [("hsafgd", True), ("safgd", False), ("bfgd", False), ("bestfit", False)],
)
def test_which_policies_read_host_memory(policy: str, reads_memory: bool) -> None:
    from kube_vgpu.extender.engine.policies import make_policy

    assert make_policy(policy).uses_host_memory is reads_memory
