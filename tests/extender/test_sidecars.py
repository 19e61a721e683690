"""Regression (issue 12): a native sidecar's GPU share is counted beside the app containers', through the
scheduler and the cluster state, over the extender's HTTP verbs, and again after a restart from the assignment."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from kube_vgpu import protocol
from kube_vgpu.extender.cli import Extender, build
from kube_vgpu.extender.scheduler import BindError, Scheduler
from kube_vgpu.extender.sources.snapshot import SnapshotCluster
from kube_vgpu.extender.state import ClusterState
from tests.helpers import gpu_node, pod
from tests.servers import serve

GPU_MIB = 81920
HALF_MIB = 40960


def with_sidecar() -> dict[str, Any]:
    """A 40960 MiB app container and a 40960 MiB native sidecar (init container with restartPolicy Always)."""
    obj = pod(memory_mib=HALF_MIB, init_gpus=1, init_memory_mib=HALF_MIB)
    obj["spec"]["initContainers"][0]["restartPolicy"] = "Always"
    return obj


def one_gpu_node() -> dict[str, Any]:
    return gpu_node("n1", gpus=1, memory_mib=GPU_MIB)


def bind(scheduler: Scheduler, obj: dict[str, Any], node: str = "n1") -> None:
    meta = obj["metadata"]
    scheduler.bind(meta["namespace"], meta["name"], meta["uid"], node)


def test_sidecar_and_app_fill_the_gpu_and_a_third_pod_is_refused() -> None:
    state = ClusterState()
    cluster = SnapshotCluster(state, [one_gpu_node()])
    scheduler = Scheduler(state, cluster)
    first = with_sidecar()
    cluster.add_pod(first)
    assert scheduler.filter(first, ["n1"]).passed == ["n1"]
    bind(scheduler, first)
    (gpu,) = state.nodes["n1"].gpus
    assert (gpu.used_memory_mib, gpu.used_shares) == (GPU_MIB, 2)  # both counted, not 40960

    neighbour = pod(memory_mib=HALF_MIB)
    cluster.add_pod(neighbour)
    outcome = scheduler.filter(neighbour, ["n1"])
    assert outcome.passed == []
    assert outcome.failed == {"n1": f"no GPU with {HALF_MIB} MiB free (largest free 0 MiB)"}
    with pytest.raises(BindError, match="largest free 0 MiB"):
        bind(scheduler, neighbour)  # bind re-checks: the GPU is never over-committed to 122880 MiB
    assert gpu.used_memory_mib == GPU_MIB

    stored = cluster.pods[("default", first["metadata"]["name"])]
    assignment = protocol.decode_assignment(stored["metadata"]["annotations"][protocol.POD_ASSIGNMENT_ANNOTATION])
    assert [(c.name, c.init, c.sidecar) for c in assignment.containers] == [
        ("main", False, False),
        ("warmup", True, True),
    ]


def test_a_restarted_extender_counts_the_sidecar_from_the_assignment() -> None:
    state = ClusterState()
    cluster = SnapshotCluster(state, [one_gpu_node()])
    first = with_sidecar()
    cluster.add_pod(first)
    bind(Scheduler(state, cluster), first)
    stored = cluster.pods[("default", first["metadata"]["name"])]

    restarted = ClusterState()  # a new process: only the API objects
    restarted.replace_all([one_gpu_node()], [stored])
    (gpu,) = restarted.nodes["n1"].gpus
    assert (gpu.used_memory_mib, gpu.used_shares) == (GPU_MIB, 2)


# --- over HTTP, as kube-scheduler calls the extender -----------------------------------------------------------


@pytest.fixture()
def extender(tmp_path: Path) -> Extender:
    path = tmp_path / "snapshot.json"
    path.write_bytes(orjson.dumps({"apiVersion": "v1", "kind": "List", "items": [one_gpu_node()]}))
    args = argparse.Namespace(
        snapshot=str(path),
        kubeconfig=None,
        policy="binpack",
        gpu_policy="binpack",
        heartbeat_ttl_seconds=120.0,
        quota_config=None,
    )
    return build(args)


@pytest.fixture()
def client(extender: Extender) -> Iterator[httpx.Client]:
    with serve(extender.app) as url, httpx.Client(base_url=url, timeout=10) as http:
        yield http


def test_http_filter_refuses_the_neighbour_of_a_sidecar_pod(client: httpx.Client, extender: Extender) -> None:
    first = with_sidecar()
    extender.source.add_pod(first)
    assert client.post("/filter", json={"Pod": first, "NodeNames": ["n1"]}).json()["NodeNames"] == ["n1"]
    meta = first["metadata"]
    reply = client.post(
        "/bind", json={"PodName": meta["name"], "PodNamespace": "default", "PodUID": meta["uid"], "Node": "n1"}
    ).json()
    assert reply == {"Error": ""}
    neighbour = pod(memory_mib=HALF_MIB)
    reply = client.post("/filter", json={"Pod": neighbour, "NodeNames": ["n1"]}).json()
    assert reply["NodeNames"] == []
    assert reply["FailedNodes"] == {"n1": f"no GPU with {HALF_MIB} MiB free (largest free 0 MiB)"}
