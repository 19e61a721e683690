"""kube_vgpu.dev.fixtures, the builders behind the tests, the benchmarks and the demo: what they build is what the
components accept, and nothing they build depends on when it was built (issue 12: objects made at import time
went stale behind a long first-run build)."""

from __future__ import annotations

import datetime as dt

from kube_vgpu import kubeapi, protocol
from kube_vgpu.dev import fixtures
from kube_vgpu.dev.synth import synth_cluster
from kube_vgpu.extender.scheduler import Scheduler
from kube_vgpu.extender.sources.snapshot import SnapshotCluster
from kube_vgpu.extender.state import ClusterState

MOMENT = dt.datetime(2026, 1, 31, 12, 0, 0, tzinfo=dt.UTC)


def without_uid(obj: dict[str, object]) -> dict[str, object]:
    metadata = dict(obj["metadata"])  # type: ignore[call-overload]
    metadata.pop("uid", None)
    return {**obj, "metadata": metadata}


def test_pods_carry_no_clock_reading() -> None:
    """Two pods built alike differ at most in their uid; creation time is a fixed moment, never "now"."""
    first, second = fixtures.scheduled_pod("p", memory_mib=1000), fixtures.scheduled_pod("p", memory_mib=1000)
    assert without_uid(first) == without_uid(second)
    assert first["metadata"]["creationTimestamp"] == "2026-11-21T10:00:00Z"
    assert fixtures.gpu_pod_object("q", cores=10) == fixtures.gpu_pod_object("q", cores=10)


def test_a_node_with_a_pinned_heartbeat_is_fresh_for_an_extender_on_the_same_clock() -> None:
    """The recipe for nodes that outlive the test building them: pin the heartbeat and the extender's clock."""
    node = fixtures.gpu_node("n1", gpus=2, heartbeat=MOMENT)
    heartbeat = node["metadata"]["annotations"][protocol.NODE_HEARTBEAT_ANNOTATION]
    assert protocol.parse_heartbeat(heartbeat) == MOMENT.timestamp()
    state = ClusterState(clock=MOMENT.timestamp)
    scheduler = Scheduler(state, SnapshotCluster(state, [node]))
    assert scheduler.filter(fixtures.scheduled_pod(memory_mib=1000), ["n1"]).passed == ["n1"]
    later = ClusterState(clock=lambda: MOMENT.timestamp() + 121)  # past the 120 s TTL: the same node is stale
    outcome = Scheduler(later, SnapshotCluster(later, [node])).filter(fixtures.scheduled_pod(memory_mib=1000), ["n1"])
    assert outcome.failed == {"n1": "GPU inventory stale (last heartbeat 121 s ago)"}


def test_a_cpu_pod_asks_host_cpu_and_no_gpu() -> None:
    pending, bound = fixtures.cpu_pod(cpu="500m"), fixtures.cpu_pod(cpu="2", node_name="n1")
    assert protocol.parse_pod_gpu_request(pending).containers == ()
    assert kubeapi.pod_request(pending, "cpu") == 500 and kubeapi.pod_request(bound, "cpu") == 2000
    assert (pending["status"]["phase"], bound["status"]["phase"]) == ("Pending", "Running")
    assert "nodeName" not in pending["spec"] and bound["spec"]["nodeName"] == "n1"


def test_synthetic_snapshots_are_reproducible_and_every_pod_is_placed_validly() -> None:
    def pods(seed: int) -> list[dict[str, object]]:
        snapshot = synth_cluster(2, 4, "NVIDIA-A100-SXM4-80GB", 81920, pods_per_node=3, seed=seed)
        return [item for item in snapshot["items"] if item["kind"] == "Pod"]

    first = pods(5)
    assert first == pods(5)
    state = ClusterState()
    nodes = [fixtures.gpu_node(f"gpu-node-{i:05d}", gpus=4) for i in range(2)]
    SnapshotCluster(state, [*nodes, *first])
    assert len(state.pods) == 6 and all(record.bound and record.applied for record in state.pods.values())
    assert not state.inventory_errors


def test_a_node_group_can_carry_a_fake_nvml_profiles_inventory_such_as_static_mig() -> None:
    from kube_vgpu.dev.devcluster.cluster import NodeGroup

    plain = NodeGroup(count=1, gpus=2, model="Tesla-T4", memory_mib=15360, topology="pcie")
    assert plain.inventory("t4-0") == fixtures.synth_inventory("t4-0", 2, "Tesla-T4", 15360, "pcie")
    mig = NodeGroup(count=1, prefix="mig", fake_profile="a100-mig").inventory("mig-0")
    assert [len(gpu.mig_devices) for gpu in mig.gpus] == [4, 7, 0, 0]
    capacity = fixtures.node_object("mig-0", mig)["status"]["capacity"]
    assert capacity["nvidia.com/mig-3g.20gb"] == "1" and capacity[protocol.RESOURCE_GPU] == "20"
