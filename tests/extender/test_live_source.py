"""Live mode's watches (issue 20 items 3 and 4): a malformed object costs only itself, a silently dead watch is
noticed by its progress watchdog, /readyz answers 503 while it is dead, and it is opened again when the path
heals. The extender is built as `kube-vgpu extender --kubeconfig` builds it and served over real HTTP; the API
server is a stand-in speaking the real list/watch protocol, behind tests/faultproxy.py."""

from __future__ import annotations

import argparse
import copy
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from kube_vgpu import protocol
from kube_vgpu.dev.fixtures import gpu_pod_object
from kube_vgpu.extender.cli import Extender, build, parse_args
from kube_vgpu.extender.scheduler import Scheduler
from kube_vgpu.extender.server import create_app
from kube_vgpu.extender.sources.apiclient import ApiTimeouts, make_api_client
from kube_vgpu.extender.sources.live import LiveBinder, LiveSource, wait_until
from kube_vgpu.extender.sources.metrics import SourceCollector
from kube_vgpu.extender.sources.watch import WatchHealth
from kube_vgpu.extender.state import ClusterState
from tests.extender.fakeapi import FakeApiServer, running, write_kubeconfig
from tests.faultproxy import Fault, FaultProxy
from tests.helpers import gpu_node
from tests.servers import serve

FAST = ApiTimeouts(connect_s=0.5, read_s=1.0, bind_s=2.0, list_page_s=5.0, watch_progress_s=2.0,
                   watch_server_timeout_s=1)


def bad_link_node(name: str, value: Any = "x") -> dict[str, Any]:
    """One malformed link entry in one node's inventory (the reported probe: a non-integer, null or list peer)."""
    node = gpu_node(name)
    doc = orjson.loads(node["metadata"]["annotations"][protocol.NODE_INVENTORY_ANNOTATION])
    doc["gpus"][0]["links"][0][0] = value
    node["metadata"]["annotations"][protocol.NODE_INVENTORY_ANNOTATION] = orjson.dumps(doc).decode()
    return node


def extender_args(kubeconfig: Path) -> argparse.Namespace:
    return parse_args(["--kubeconfig", str(kubeconfig), "--policy", "binpack", "--gpu-policy", "topology"])


@pytest.fixture()
def fake() -> Iterator[tuple[FakeApiServer, str]]:
    server = FakeApiServer()
    with running(server) as url:
        yield server, url


def test_one_malformed_inventory_costs_only_its_node(fake: tuple[FakeApiServer, str], tmp_path: Path) -> None:
    """Before: decode_inventory raised ValueError on the bad node, every re-list aborted, /readyz stayed 503."""
    server, url = fake
    for node in (gpu_node("good-1"), bad_link_node("bad"), gpu_node("good-2")):
        server.put("nodes", node)
    extender: Extender = build(extender_args(write_kubeconfig(tmp_path / "kubeconfig", url)))
    with serve(extender.app) as extender_url, httpx.Client(base_url=extender_url, timeout=30) as http:
        assert wait_until(lambda: http.get("/readyz").status_code == 200, 30), http.get("/readyz").text
        nodes = {node["name"]: node for node in http.get("/state").json()["nodes"]}
        assert [len(nodes[n]["gpus"]) for n in ("good-1", "bad", "good-2")] == [4, 0, 4]
        assert "links[0]: field 'peer' must be an integer, not str" in nodes["bad"]["inventoryError"]
        assert 'kube_vgpu_node_inventory_invalid{node="bad"} 1.0' in http.get("/metrics").text

        # through the watch: a null and a list peer, and a node object that raises far from the codec
        server.put("nodes", bad_link_node("bad-null", None))
        server.put("nodes", bad_link_node("bad-list", [1]))
        broken = gpu_node("broken")
        broken["status"] = "not an object"
        server.put("nodes", broken)
        server.put("nodes", gpu_node("good-3"))
        state = extender.state
        assert wait_until(lambda: "good-3" in state.nodes, 30)
        assert "not NoneType" in state.inventory_errors["bad-null"]
        assert "not list" in state.inventory_errors["bad-list"]
        assert "node object could not be applied" in state.inventory_errors["broken"]
        assert len(state.nodes["good-3"].gpus) == 4 and http.get("/readyz").status_code == 200
        metrics = http.get("/metrics").text
        assert 'kube_vgpu_extender_ingest_errors_total{kind="nodes"} 1.0' in metrics
        assert 'kube_vgpu_extender_watch_restarts_total{reason="error",resource="nodes"} 0.0' in metrics

        server.put("nodes", gpu_node("bad"))  # the device plugin fixed it: usable again
        assert wait_until(lambda: len(state.nodes["bad"].gpus) == 4, 30)
        assert "bad" not in state.inventory_errors
        extender.source.stop()


def test_a_silently_dead_watch_is_noticed_and_opened_again(fake: tuple[FakeApiServer, str], tmp_path: Path) -> None:
    """Before: a watch over a half-open connection was never re-established and /readyz stayed 200 while every
    heartbeat went stale."""
    server, url = fake
    server.put("nodes", gpu_node("n1"))
    with FaultProxy(("127.0.0.1", int(url.rsplit(":", 1)[1]))) as proxy:
        # composed as build() composes it, with timeouts of seconds instead of minutes
        api_client = make_api_client(str(write_kubeconfig(tmp_path / "kubeconfig", proxy.url)))
        state = ClusterState()
        source = LiveSource(state, api_client, timeouts=FAST, max_backoff_s=0.5)
        app = create_app(Scheduler(state, LiveBinder(api_client, timeouts=FAST)), on_startup=source.start)
        app.state.registry.register(SourceCollector(state, source.health))
        with serve(app) as extender_url, httpx.Client(base_url=extender_url, timeout=30) as http:
            assert wait_until(lambda: http.get("/readyz").status_code == 200, 30)

            proxy.set_fault(Fault.HALF_OPEN)  # every open connection goes silent, and so do new ones
            server.put("nodes", gpu_node("n2"))
            assert wait_until(lambda: http.get("/readyz").status_code == 503, 30)
            assert "watch has delivered nothing for" in http.get("/readyz").text
            assert "n2" not in state.nodes  # the dead path hid it

            proxy.set_fault(Fault.PASS)  # the path heals: new connections work
            assert wait_until(lambda: http.get("/readyz").status_code == 200 and "n2" in state.nodes, 30)
            assert source.health["nodes"].restarts.get("stalled", 0) >= 1
            assert source.health["pods"].restarts.get("stalled", 0) >= 1
            assert 'kube_vgpu_extender_watch_restarts_total{reason="stalled",resource="nodes"}' in \
                http.get("/metrics").text
            source.stop()


def test_a_watch_is_healthy_until_silent_for_its_progress_timeout() -> None:
    now = [1000.0]
    health = WatchHealth("nodes", stall_after_s=90, clock=lambda: now[0])
    assert health.problem() is None  # not listed yet: readiness waits for the initial sync instead
    health.progressed()
    now[0] += 89.9
    assert health.problem() is None
    now[0] += 0.2
    health.restarted("stalled", "no event or bookmark for 90 s")
    assert health.problem() == ("the nodes watch has delivered nothing for 90 s; "
                                "last error: no event or bookmark for 90 s")
    health.progressed()
    assert health.problem() is None and health.restarts == {"stalled": 1}


def test_a_pod_event_that_cannot_be_applied_does_not_end_the_watch(fake: tuple[FakeApiServer, str],
                                                                   tmp_path: Path) -> None:
    server, url = fake
    server.put("nodes", gpu_node("n1"))
    extender = build(extender_args(write_kubeconfig(tmp_path / "kubeconfig", url)))
    state = extender.state
    state.pod_listeners.append(lambda uid, obj: _refuse(obj))  # any exception from one object
    with serve(extender.app):
        assert wait_until(state.synced.is_set, 30)
        server.put("pods", _pod("poison"))
        server.put("pods", _pod("fine"))
        assert wait_until(lambda: state.ingest_errors.get("pods") == 1, 30)
        assert wait_until(lambda: any(r.name == "fine" for r in state.pods.values()), 30)
        assert extender.source.health["pods"].restarts == {}  # the watch went on
        extender.source.stop()


def _refuse(obj: Any) -> None:
    if obj is not None and obj["metadata"]["name"] == "poison":
        raise RuntimeError("this pod breaks a listener")


def _pod(name: str) -> dict[str, Any]:
    assignment = protocol.PodAssignment("n1", (protocol.ContainerAssignment("main", ()),))
    return copy.deepcopy({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": "default", "uid": f"uid-{name}",
                     "annotations": {protocol.POD_ASSIGNMENT_ANNOTATION: protocol.encode_assignment(assignment)}},
        "spec": {"nodeName": "n1", "containers": [{"name": "main"}]},
        "status": {"phase": "Running"},
    })


def test_a_relist_asked_for_ends_the_open_watch_and_reports_when_applied(
    fake: tuple[FakeApiServer, str], tmp_path: Path
) -> None:
    """The leader fence's takeover relist (extender/fence.py): the pods watch is closed at once (not at its server
    timeout), the pods are listed and applied in the watch thread, and only then is the fence told."""
    server, url = fake
    server.put("nodes", gpu_node("n1"))
    slow = ApiTimeouts(connect_s=1.0, read_s=1.0, bind_s=2.0, list_page_s=5.0, watch_progress_s=120.0,
                       watch_server_timeout_s=100)
    state = ClusterState()
    source = LiveSource(state, make_api_client(str(write_kubeconfig(tmp_path / "kubeconfig", url))), timeouts=slow)
    source.start()
    try:
        assert wait_until(state.synced.is_set, 30)
        # a Binding the watch has not delivered (the previous leader's last write, still on its way to us)
        uuid = protocol.decode_inventory(
            gpu_node("n1")["metadata"]["annotations"][protocol.NODE_INVENTORY_ANNOTATION]).gpus[0].uuid
        share = protocol.ContainerAssignment("main", (protocol.DeviceShare(uuid, 1024, 0),))
        unseen = gpu_pod_object("unseen", node_name="n1", memory_mib=1024, uid="uid-unseen",
                                assignment=protocol.PodAssignment("n1", (share,)))
        unseen["metadata"]["resourceVersion"] = "1"
        with server.lock:
            server.objects["pods"][FakeApiServer.key(unseen)] = unseen
        done = threading.Event()
        # from another thread, as the Lease watch asks: neither the ask nor the relist may wait for the watch's end
        threading.Thread(target=source.request_relist, args=("pods", done.set), daemon=True).start()
        assert done.wait(20), "the relist waited for the open watch to end (100 s)"
        assert "uid-unseen" in state.pods  # applied before done was called
        assert source.health["pods"].restarts.get("error", 0) == 0  # closing our own watch is not a failure
    finally:
        source.stop()
