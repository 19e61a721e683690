"""Live mode: the real kubernetes client lists and watches Kueue objects from an API server stand-in over HTTP
(list, watch stream, 404 for a CRD that is not installed), and the gate follows."""

from __future__ import annotations

import asyncio
import copy
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

import orjson
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from kubernetes import client

from kube_vgpu.extender.quota.gate import QuotaGate
from kube_vgpu.extender.quota.live import KueueWatcher
from kube_vgpu.extender.quota.usage import IGNORE_UNDECLARED
from kube_vgpu.extender.scheduler import FilterOutcome, Scheduler
from kube_vgpu.extender.sources.live import wait_until
from kube_vgpu.extender.sources.snapshot import SnapshotCluster
from kube_vgpu.extender.state import ClusterState
from tests.quota.helpers import A100, Env, a100_node, queued_pod
from tests.servers import serve

V1 = "kueue.x-k8s.io/v1beta1"


def cluster_queue(nominal: int) -> dict[str, Any]:
    return {"apiVersion": V1, "kind": "ClusterQueue", "metadata": {"name": "team-a", "resourceVersion": "1"},
            "spec": {"namespaceSelector": {"matchLabels": {"team": "a"}},
                     "resourceGroups": [{"coveredResources": ["nvidia.com/gpu"], "flavors": [
                         {"name": "a100", "resources": [{"name": "nvidia.com/gpu", "nominalQuota": nominal}]}]}]}}


LOCAL_QUEUE = {"apiVersion": V1, "kind": "LocalQueue", "metadata": {"name": "q", "namespace": "team-a"},
               "spec": {"clusterQueue": "team-a"}}


class FakeApiServer:
    """Serves lists and watch streams of the objects it holds; kinds it does not serve answer 404."""

    def __init__(self) -> None:
        self.objects: dict[str, list[dict[str, Any]]] = {  # plural (v1beta1 only) -> objects
            "resourceflavors": [{"apiVersion": V1, "kind": "ResourceFlavor", "metadata": {"name": "a100"},
                                 "spec": {"nodeLabels": {"nvidia.com/gpu.product": A100}}}],
            "clusterqueues": [cluster_queue(1)],
            "localqueues": [LOCAL_QUEUE],
            "workloadpriorityclasses": [],
            "namespaces": [{"metadata": {"name": "team-a", "labels": {"team": "a"}}}],
        }
        self.events: dict[str, list[dict[str, Any]]] = {plural: [] for plural in self.objects}
        self.stop = threading.Event()
        self.app = FastAPI()
        self.app.add_api_route("/apis/{group}/{version}/{plural}", self.handle, methods=["GET"])
        self.app.add_api_route("/api/v1/{plural}", self.handle_core, methods=["GET"])

    def push(self, plural: str, event_type: str, obj: dict[str, Any]) -> None:
        self.events[plural].append({"type": event_type, "object": copy.deepcopy(obj)})

    async def handle(self, group: str, version: str, plural: str, request: Request) -> Response:
        if version != "v1beta1" or plural not in self.objects:
            return Response(orjson.dumps({"kind": "Status", "code": 404, "reason": "NotFound"}), status_code=404,
                            media_type="application/json")
        return self._answer(plural, request)

    async def handle_core(self, plural: str, request: Request) -> Response:
        return self._answer(plural, request)

    def _answer(self, plural: str, request: Request) -> Response:
        if request.query_params.get("watch") in ("true", "1", "True"):
            return StreamingResponse(self._stream(plural), media_type="application/json")
        doc = {"kind": "List", "metadata": {"resourceVersion": "1"}, "items": self.objects[plural]}
        return Response(orjson.dumps(doc), media_type="application/json")

    async def _stream(self, plural: str) -> AsyncIterator[bytes]:
        sent = 0
        yield b""
        while not self.stop.is_set():
            events = self.events[plural]
            while sent < len(events):
                yield orjson.dumps(events[sent]) + b"\n"
                sent += 1
            await asyncio.sleep(0.02)


@pytest.fixture()
def fake() -> Iterator[tuple[FakeApiServer, client.ApiClient]]:
    server = FakeApiServer()
    with serve(server.app) as url:
        configuration = client.Configuration()
        configuration.host = url
        api_client = client.ApiClient(configuration)
        try:
            yield server, api_client
        finally:
            server.stop.set()


def test_gate_follows_the_clusters_kueue_objects(fake: tuple[FakeApiServer, client.ApiClient]) -> None:
    server, api_client = fake
    state = ClusterState()
    cluster = SnapshotCluster(state, [a100_node("a100-0")])
    gate = QuotaGate(state, [], live=True, quota_check_strategy=IGNORE_UNDECLARED)  # vGPU-only queues
    gate.watcher = KueueWatcher(gate, api_client, absent_retry_s=0.05)
    env = Env(state, cluster, Scheduler(state, cluster, gates=[gate]), gate, ["a100-0"])

    early = queued_pod("q", gpus=1, memory_mib=1000)
    assert "Kueue objects have not been listed" in env.filter(early).failed["a100-0"]  # fail closed until synced

    gate.start()
    try:
        assert wait_until(lambda: gate.synced, 20)
        assert gate.watcher.versions == {"ResourceFlavor": "v1beta1", "ClusterQueue": "v1beta1",
                                         "LocalQueue": "v1beta1", "Cohort": None,
                                         "WorkloadPriorityClass": "v1beta1", "Namespace": "v1"}
        assert gate.snapshot()["sources"] == ["cluster"]
        # the namespace's labels come from the cluster: team=a is selected
        assert env.submit(queued_pod("q", gpus=1, memory_mib=1000)) == "a100-0"
        waiting = queued_pod("q", gpus=1, memory_mib=1000)
        assert "used 1/1" in next(iter(_failed(env.submit(waiting)).values()))

        server.push("clusterqueues", "MODIFIED", cluster_queue(2))  # the team gets a bigger budget
        assert wait_until(lambda: gate.tree.potential_available(("ClusterQueue", "team-a"), ("a100",
                                                                "nvidia.com/gpu")) == 2, 20)
        assert env.retry(waiting) == "a100-0"

        server.push("localqueues", "DELETED", LOCAL_QUEUE)
        assert wait_until(lambda: not gate.config.local_queues, 20)
        assert "LocalQueue team-a/q (label kueue.x-k8s.io/queue-name) does not exist" in next(iter(_failed(
            env.submit(queued_pod("q", gpus=1, memory_mib=1000))).values()))
        assert env.used("team-a", "a100") == 2  # admitted pods stay counted

        server.push("namespaces", "MODIFIED", {"metadata": {"name": "team-a", "labels": {"team": "b"}}})
        server.push("localqueues", "ADDED", LOCAL_QUEUE)
        assert wait_until(
            lambda: gate.namespace_labels("team-a").get("team") == "b" and bool(gate.config.local_queues), 20)
        assert "namespace team-a is not selected" in next(iter(_failed(
            env.submit(queued_pod("q", gpus=1, memory_mib=1000))).values()))
    finally:
        gate.stop()


def _failed(outcome: str | FilterOutcome) -> dict[str, str]:
    assert isinstance(outcome, FilterOutcome), f"bound to {outcome}"
    return outcome.failed


def test_without_kueue_crds_the_file_alone_counts(fake: tuple[FakeApiServer, client.ApiClient]) -> None:
    server, api_client = fake
    for plural in ("resourceflavors", "clusterqueues", "localqueues", "workloadpriorityclasses"):
        del server.objects[plural]  # Kueue is not installed: every kind answers 404
    state = ClusterState()
    cluster = SnapshotCluster(state, [a100_node("a100-0")])
    documents = [("file", dict(cluster_queue(1), metadata={"name": "team-a"})), ("file", LOCAL_QUEUE),
                 ("file", {"apiVersion": V1, "kind": "ResourceFlavor", "metadata": {"name": "a100"}})]
    gate = QuotaGate(state, documents, live=True, quota_check_strategy=IGNORE_UNDECLARED)
    gate.watcher = KueueWatcher(gate, api_client, absent_retry_s=0.05)
    gate.start()
    try:
        assert wait_until(lambda: gate.synced, 20)
        assert gate.watcher.versions["ClusterQueue"] is None
        env = Env(state, cluster, Scheduler(state, cluster, gates=[gate]), gate, ["a100-0"])
        assert env.submit(queued_pod("q", gpus=1, memory_mib=1000)) == "a100-0"
        assert "used 1/1" in next(iter(_failed(env.submit(queued_pod("q", gpus=1, memory_mib=1000))).values()))
    finally:
        gate.stop()
