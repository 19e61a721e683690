"""The extender over real HTTP, with payloads shaped exactly as kube-scheduler sends them."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kube_vgpu import protocol
from kube_vgpu.extender.cli import Extender, build, parse_args
from kube_vgpu.extender.scheduler import Scheduler
from kube_vgpu.extender.server import ExtenderApp, create_app
from kube_vgpu.extender.state import ClusterState
from tests.extender.test_bind_failures import GatedCluster, add, used
from tests.helpers import gpu_node, pod
from tests.servers import serve


@pytest.fixture()
def snapshot_file(tmp_path: Path) -> Path:
    nodes = [
        gpu_node("a100-0", gpus=4, memory_mib=81920, topology="nvswitch"),
        gpu_node("a100-1", gpus=4, memory_mib=81920, topology="nvswitch"),
        gpu_node("t4-0", gpus=2, model="Tesla-T4", memory_mib=15360, topology="pcie"),
    ]
    path = tmp_path / "snapshot.json"
    path.write_bytes(orjson.dumps({"apiVersion": "v1", "kind": "List", "items": nodes}))
    return path


@pytest.fixture()
def extender(snapshot_file: Path) -> Extender:
    args = parse_args(["--snapshot", str(snapshot_file), "--policy", "binpack", "--gpu-policy", "topology"])
    return build(args)


@pytest.fixture()
def client(extender: Extender) -> Iterator[httpx.Client]:
    with serve(extender.app) as url, httpx.Client(base_url=url, timeout=10) as http:
        yield http


NAMES = ["a100-0", "a100-1", "t4-0"]


def test_filter_node_names_mode(client: httpx.Client) -> None:
    big = pod(memory_mib=40000, cores=50)
    reply = client.post("/filter", json={"Pod": big, "NodeNames": NAMES, "Nodes": None}).json()
    assert reply["NodeNames"] == ["a100-0", "a100-1"]
    assert reply["Error"] == ""
    assert reply["FailedAndUnresolvableNodes"] == {
        "t4-0": "needs 40000 MiB per GPU, largest GPU here has 15360 MiB"
    }


def test_filter_full_nodes_mode(client: httpx.Client) -> None:
    nodes = [gpu_node(name) for name in NAMES]
    reply = client.post("/filter", json={"Pod": pod(gpus=3, cores=100), "Nodes": {"items": nodes}}).json()
    assert [n["metadata"]["name"] for n in reply["Nodes"]["items"]] == ["a100-0", "a100-1"]
    assert reply["NodeNames"] is None
    assert "needs 3 GPUs, node has 2" in reply["FailedAndUnresolvableNodes"]["t4-0"]


def test_prioritize_scores_in_range_and_binpacks(client: httpx.Client, extender: Extender) -> None:
    first = pod(memory_mib=20000, cores=20)
    meta = first["metadata"]
    client.post("/filter", json={"Pod": first, "NodeNames": NAMES})
    assert client.post(
        "/bind", json={"PodName": meta["name"], "PodNamespace": "default", "PodUID": meta["uid"], "Node": "a100-1"}
    ).json() == {"Error": ""}
    scores = client.post("/prioritize", json={"Pod": pod(memory_mib=1000), "NodeNames": NAMES}).json()
    by_host = {entry["Host"]: entry["Score"] for entry in scores}
    assert all(0 < score <= 10 for score in by_host.values())  # a node left out scores 0 to kube-scheduler
    assert set(by_host) <= set(NAMES)
    assert by_host.get("a100-1", 0) > by_host.get("a100-0", 0)  # binpack: the node already in use


def test_bind_writes_assignment_and_is_idempotent(client: httpx.Client, extender: Extender) -> None:
    p = pod(gpus=2, memory_mib=10000, cores=30)
    meta = p["metadata"]
    client.post("/filter", json={"Pod": p, "NodeNames": NAMES})
    args = {"PodName": meta["name"], "PodNamespace": "default", "PodUID": meta["uid"], "Node": "a100-0"}
    assert client.post("/bind", json=args).json() == {"Error": ""}
    stored = extender.source.pods[("default", meta["name"])]
    assignment = protocol.decode_assignment(stored["metadata"]["annotations"][protocol.POD_ASSIGNMENT_ANNOTATION])
    assert stored["spec"]["nodeName"] == "a100-0" and assignment.node == "a100-0"
    protocol.parse_bind_time(stored["metadata"]["annotations"][protocol.POD_BIND_TIME_ANNOTATION])
    assert [(d.memory_mib, d.cores) for d in assignment.all_devices()] == [(10000, 30), (10000, 30)]
    assert client.post("/bind", json=args).json() == {"Error": ""}  # repeat: same answer, nothing counted twice
    used = sum(g.used_memory_mib for g in extender.state.nodes["a100-0"].gpus)
    assert used == 20000


def test_bind_refuses_when_it_no_longer_fits(client: httpx.Client) -> None:
    p = pod(memory_mib=20000)
    meta = p["metadata"]
    client.post("/filter", json={"Pod": p, "NodeNames": NAMES})
    reply = client.post(
        "/bind", json={"PodName": meta["name"], "PodNamespace": "default", "PodUID": meta["uid"], "Node": "t4-0"}
    ).json()
    assert "needs 20000 MiB per GPU" in reply["Error"]


@pytest.mark.parametrize(
    ("path", "body", "message"),
    [
        ("/filter", b"", "empty request body"),
        ("/filter", b"{not json", "not valid JSON"),
        ("/filter", b"[]", "must be a JSON object"),
        ("/filter", b'{"Pod": 3, "NodeNames": []}', "Pod must be a Pod object"),
        ("/filter", b'{"Pod": {}, "NodeNames": "a"}', "NodeNames must be a list of strings"),
        ("/filter", b'{"Pod": {}}', "needs NodeNames"),
        ("/prioritize", b"\xff\xfe", "not valid JSON"),
        ("/bind", b'{"PodName": "x"}', "missing PodNamespace, PodUID, Node"),
    ],
)
def test_malformed_bodies_get_400_and_service_keeps_serving(
    client: httpx.Client, path: str, body: bytes, message: str
) -> None:
    reply = client.post(path, content=body, headers={"Content-Type": "application/json"})
    assert reply.status_code == 400
    assert message in reply.json()["Error"]
    assert client.get("/healthz").status_code == 200


def test_oversized_body_rejected(client: httpx.Client) -> None:
    # a raw socket: HTTP clients refuse to send a Content-Length they cannot back with data
    host, port = str(client.base_url.host), int(client.base_url.port or 80)
    with socket.create_connection((host, port), timeout=10) as sock:
        sock.sendall(
            b"POST /filter HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000000000\r\n\r\n{"
        )
        reply = b""
        while b"}" not in reply:  # headers and body may arrive in separate segments
            chunk = sock.recv(65536)
            if not chunk:
                break
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 413") and b"too large" in reply
    assert client.get("/healthz").status_code == 200


def test_invalid_pod_request_reported_in_error_field(client: httpx.Client) -> None:
    reply = client.post("/filter", json={"Pod": pod(cores=150), "NodeNames": NAMES}).json()
    assert "nvidia.com/gpucores must be between 0 and 100, got 150" in reply["Error"]
    reply = client.post(
        "/filter", json={"Pod": pod(annotations={protocol.ANNOTATION_GPU_POLICY: "nope"}), "NodeNames": NAMES}
    ).json()
    assert "unknown policy 'nope'" in reply["Error"]


def test_health_ready_metrics_state(client: httpx.Client) -> None:
    assert client.get("/readyz").status_code == 200
    client.post("/filter", json={"Pod": pod(memory_mib=99999), "NodeNames": NAMES})
    metrics = client.get("/metrics").text
    assert 'kube_vgpu_extender_request_seconds_count{verb="filter"}' in metrics
    assert 'kube_vgpu_extender_rejections_total{reason="memory"}' in metrics
    assert 'kube_vgpu_gpu_memory_mib{gpu="0",model="Tesla-T4",node="t4-0"' in metrics
    state: dict[str, Any] = client.get("/state").json()
    assert {n["name"] for n in state["nodes"]} == set(NAMES)


def test_rejections_are_counted_per_node_refused(client: httpx.Client) -> None:
    """kube_vgpu_extender_rejections_total counts every node a filter refused, by reason, whether the node was
    judged afresh or answered from the shape's kept verdicts (counted once per reason and filter, not per node)."""

    def rejections() -> dict[str, float]:
        families = text_string_to_metric_families(client.get("/metrics").text)
        family = next(f for f in families if f.name == "kube_vgpu_extender_rejections")
        return {s.labels["reason"]: s.value for s in family.samples if s.name.endswith("_total")}

    too_big = pod(memory_mib=99999)
    client.post("/filter", json={"Pod": too_big, "NodeNames": NAMES})
    assert rejections()["memory"] == 3
    client.post("/filter", json={"Pod": too_big, "NodeNames": [*NAMES, "ghost"]})  # kept verdicts; one unknown node
    assert rejections()["memory"] == 6
    reply = client.post("/filter", json={"Pod": pod(memory_mib=40000, cores=50), "NodeNames": NAMES}).json()
    assert list(reply["FailedAndUnresolvableNodes"]) == ["t4-0"]
    counted = rejections()
    assert counted["memory"] == 7 and sum(counted.values()) == 7


def test_separate_probe_listener_serves_metrics_and_health(extender: Extender) -> None:
    from kube_vgpu.extender.server import serve_probes
    from tests.servers import free_port

    # one instant for both listeners: /state carries each node's heartbeat age, which would otherwise differ by the
    # time between the two requests
    frozen_now_s = extender.state.clock()
    extender.state.clock = lambda: frozen_now_s
    port = free_port()
    server = serve_probes(extender.app.state.registry, extender.scheduler, "127.0.0.1", port)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as probes:
            assert probes.get("/healthz").text == "ok"
            assert probes.get("/readyz").status_code == 200
            assert "kube_vgpu_gpu_memory_mib" in probes.get("/metrics").text
            assert probes.post("/bind", json={}).status_code == 501  # the verbs are not on this listener
            # the read-only views too (the dashboard reads them through a Service), the same as the verbs app's
            with serve(extender.app) as url, httpx.Client(base_url=url, timeout=10) as verbs_app:
                state = probes.get("/state")
                assert state.headers["content-type"] == "application/json"
                assert state.json() == verbs_app.get("/state").json()
                assert {n["name"] for n in state.json()["nodes"]} == set(NAMES)
                quota, app_quota = probes.get("/quota"), verbs_app.get("/quota")
                assert (quota.status_code, quota.json()) == (app_quota.status_code, app_quota.json())
    finally:
        server.shutdown()


def test_concurrent_binds_to_one_node_over_http_never_over_commit(client: httpx.Client, extender: Extender) -> None:
    """kube-scheduler binds every assumed pod at once; binds to one node queue in the extender's event loop.
    Half the pods were filtered first (decided without a thread), half were not (read back from the API)."""
    pods = [pod(memory_mib=30000) for _ in range(12)]  # two fit per 80 GiB GPU: 8 on a100-0's four GPUs
    for number, p in enumerate(pods):
        extender.source.add_pod(p)
        if number % 2:
            client.post("/filter", json={"Pod": p, "NodeNames": NAMES})

    def bind(p: dict[str, Any]) -> str:
        meta = p["metadata"]
        args = {"PodName": meta["name"], "PodNamespace": "default", "PodUID": meta["uid"], "Node": "a100-0"}
        reply = client.post("/bind", json=args)
        assert reply.status_code == 200
        error: str = reply.json()["Error"]
        return error

    with ThreadPoolExecutor(len(pods)) as pool:
        errors = list(pool.map(bind, pods))
    assert errors.count("") == 8
    assert all("30000 MiB" in e for e in errors if e)
    gpus = extender.state.nodes["a100-0"].gpus
    assert [g.used_memory_mib for g in gpus] == [60000] * 4
    bound = [extender.source.pods[("default", p["metadata"]["name"])] for p in pods]
    assert sum(1 for b in bound if b["spec"].get("nodeName") == "a100-0") == 8


def test_an_internal_error_answers_500_with_error_and_the_service_keeps_serving(
    client: httpx.Client, extender: Extender, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*_: Any) -> None:
        raise RuntimeError("engine bug")

    monkeypatch.setattr(extender.scheduler, "filter", broken)
    reply = client.post("/filter", json={"Pod": pod(), "NodeNames": NAMES})
    assert reply.status_code == 500 and "engine bug" in reply.json()["Error"]
    assert client.post("/prioritize", json={"Pod": pod(), "NodeNames": NAMES}).status_code == 200
    assert client.get("/healthz").status_code == 200


def test_verbs_only_answer_post(client: httpx.Client) -> None:
    reply = client.get("/filter")
    assert reply.status_code == 405 and reply.headers["allow"] == "POST" and reply.json()["Error"]


# --- bind ordering through the server: the async face of extender/binding.py as production runs it ------------------


@dataclass
class Gated:
    """An extender over one 80 GiB GPU whose Binding calls (and, when a test asks, pod reads) wait for the test."""

    state: ClusterState
    cluster: GatedCluster
    scheduler: Scheduler
    app: ExtenderApp


@pytest.fixture()
def gated() -> Gated:
    state = ClusterState()
    cluster = GatedCluster(state, [gpu_node("n1", gpus=1, memory_mib=81920)])
    scheduler = Scheduler(state, cluster)
    return Gated(state, cluster, scheduler, create_app(scheduler))


def eventually(check: Callable[[], bool]) -> bool:
    """True once `check` holds; a deadline only so that a broken build fails instead of hanging."""
    pause = threading.Event()
    for _ in range(1000):
        if check():
            return True
        pause.wait(0.01)
    return check()


def turns(client: httpx.Client) -> tuple[int, int]:
    """(binds holding the node's turn, binds waiting for it), as /metrics reports them."""
    values = {}
    for line in client.get("/metrics").text.splitlines():
        name, _, value = line.partition(" ")
        if name in ("kube_vgpu_extender_binds_writing", "kube_vgpu_extender_binds_waiting"):
            values[name] = int(float(value))
    return values["kube_vgpu_extender_binds_writing"], values["kube_vgpu_extender_binds_waiting"]


def filtered(client: httpx.Client, gated: Gated, memory_mib: int) -> dict[str, Any]:
    """A pod kube-scheduler filtered (so its bind decides without reading it back)."""
    meta = add(gated.cluster, memory_mib=memory_mib)
    client.post("/filter", json={"Pod": gated.cluster.pods[("default", meta["name"])], "NodeNames": ["n1"]})
    return meta


def send_bind(pool: ThreadPoolExecutor, client: httpx.Client, meta: dict[str, Any]) -> Future[dict[str, Any]]:
    args = {"PodName": meta["name"], "PodNamespace": "default", "PodUID": meta["uid"], "Node": "n1"}

    def post() -> dict[str, Any]:
        reply = client.post("/bind", json=args)
        assert reply.status_code == 200
        answer: dict[str, Any] = reply.json()
        return answer

    return pool.submit(post)


def bind_time(gated: Gated, meta: dict[str, Any]) -> Any:
    annotations = gated.cluster.pods[("default", meta["name"])]["metadata"]["annotations"]
    return protocol.parse_bind_time(annotations[protocol.POD_BIND_TIME_ANNOTATION])


def test_binds_to_one_node_are_written_in_arrival_order_over_http(gated: Gated) -> None:
    """A different assignment waits for the node; an identical one writes beside the one in flight unless someone
    waits ahead of it; bind times follow the order of the writes (the device plugin's order)."""
    with serve(gated.app) as url, httpx.Client(base_url=url, timeout=30) as client, ThreadPoolExecutor(4) as pool:
        first, twin, other, late_twin = (filtered(client, gated, m) for m in (4000, 4000, 8000, 4000))
        replies = [send_bind(pool, client, first)]
        assert eventually(lambda: turns(client) == (1, 0))  # first is being written (the API call waits)
        replies.append(send_bind(pool, client, twin))
        assert eventually(lambda: turns(client) == (2, 0))  # the same GPU and MiB: written beside it
        replies.append(send_bind(pool, client, other))
        assert eventually(lambda: turns(client) == (2, 1))  # another assignment: waits for the node
        replies.append(send_bind(pool, client, late_twin))
        assert eventually(lambda: turns(client) == (2, 2))  # identical to those writing, but may not overtake
        gated.cluster.gate.set()
        assert [reply.result(30) for reply in replies] == [{"Error": ""}] * 4
        assert turns(client) == (0, 0)
    order = gated.cluster.order
    assert set(order[:2]) == {first["name"], twin["name"]} and order[2:] == [other["name"], late_twin["name"]]
    assert max(bind_time(gated, first), bind_time(gated, twin)) <= bind_time(gated, other)
    assert bind_time(gated, other) <= bind_time(gated, late_twin)
    assert used(gated.state) == 20000


def test_a_pod_deleted_while_its_bind_waits_is_not_bound_over_http(gated: Gated) -> None:
    with serve(gated.app) as url, httpx.Client(base_url=url, timeout=30) as client, ThreadPoolExecutor(4) as pool:
        first, doomed = filtered(client, gated, 4000), filtered(client, gated, 8000)
        first_reply = send_bind(pool, client, first)
        assert eventually(lambda: turns(client) == (1, 0))
        doomed_reply = send_bind(pool, client, doomed)
        assert eventually(lambda: turns(client) == (1, 1))
        assert used(gated.state) == 12000  # reserved while it waits
        gated.cluster.delete_pod("default", doomed["name"])  # the watch delivers the deletion before its turn
        assert used(gated.state) == 4000
        gated.cluster.gate.set()
        assert first_reply.result(30) == {"Error": ""}
        assert "went away while waiting to be bound to n1" in doomed_reply.result(30)["Error"]
        after = filtered(client, gated, 8000)  # the node's next bind goes ahead
        assert send_bind(pool, client, after).result(30) == {"Error": ""}
        assert turns(client) == (0, 0)
    assert gated.cluster.order == [first["name"], after["name"]]  # the deleted pod's Binding was never written
    assert used(gated.state) == 12000 and doomed["uid"] not in gated.state.pods


def test_shutdown_gives_back_a_waiting_bind_and_lets_the_write_in_flight_finish(gated: Gated) -> None:
    """uvicorn cancels the requests still running after its graceful timeout (0 here: at once). A bind waiting for
    its turn leaves the queue and returns its reservation; one whose Binding is being written cannot unwind it: the
    write completes, holds the node's turn until it does, and its outcome stands. Both answer with a reason."""
    with ExitStack() as outlives_the_server:  # the replies come while the server shuts down
        pool = outlives_the_server.enter_context(ThreadPoolExecutor(4))
        with serve(gated.app, timeout_graceful_shutdown=0) as url:
            client = outlives_the_server.enter_context(httpx.Client(base_url=url, timeout=30))
            writing, waiting = filtered(client, gated, 4000), filtered(client, gated, 8000)
            writing_reply = send_bind(pool, client, writing)
            assert eventually(lambda: turns(client) == (1, 0))
            waiting_reply = send_bind(pool, client, waiting)
            assert eventually(lambda: turns(client) == (1, 1))
            assert used(gated.state) == 12000
        for reply in (writing_reply, waiting_reply):
            assert "kube-vgpu extender shutting down" in reply.result(30)["Error"]
    assert used(gated.state) == 4000 and waiting["uid"] not in gated.state.pods  # the waiting bind gave it back
    assert gated.scheduler.ordering.turn_counts() == (1, 0)  # the write in flight still holds the node's turn
    with serve(gated.app) as url, httpx.Client(base_url=url, timeout=30) as client, ThreadPoolExecutor(4) as pool:
        after = filtered(client, gated, 8000)
        after_reply = send_bind(pool, client, after)
        assert eventually(lambda: turns(client) == (1, 1))  # waits for the write that outlived its request
        gated.cluster.gate.set()  # the API server answers it
        assert after_reply.result(30) == {"Error": ""}
        assert turns(client) == (0, 0)
    assert gated.cluster.order == [writing["name"], after["name"]]
    assert gated.cluster.pods[("default", writing["name"])]["spec"]["nodeName"] == "n1"
    assert not gated.cluster.pods[("default", waiting["name"])]["spec"].get("nodeName")
    assert used(gated.state) == 12000


def test_shutdown_while_a_bind_reads_its_pod_leaves_nothing_reserved(gated: Gated) -> None:
    """A pod filter never saw is read from the API in a worker thread; a bind cancelled during that read must not
    leave the reservation the read leads to, nor the pod marked as being bound (its retry would be refused)."""
    gated.cluster.gate.set()
    meta = add(gated.cluster, memory_mib=4000)
    gated.cluster.read_gate.clear()
    with ExitStack() as outlives_the_server:  # the reply comes while the server shuts down
        pool = outlives_the_server.enter_context(ThreadPoolExecutor(1))
        with serve(gated.app, timeout_graceful_shutdown=0) as url:
            client = outlives_the_server.enter_context(httpx.Client(base_url=url, timeout=30))
            reply = send_bind(pool, client, meta)
            assert gated.cluster.reading.wait(10)
        assert "kube-vgpu extender shutting down" in reply.result(30)["Error"]
    gated.cluster.read_gate.set()  # the read returns after its caller is gone
    assert eventually(lambda: not gated.scheduler._binding)
    assert used(gated.state) == 0 and meta["uid"] not in gated.state.pods
    with serve(gated.app) as url, httpx.Client(base_url=url, timeout=30) as client, ThreadPoolExecutor(1) as pool:
        assert send_bind(pool, client, meta).result(30) == {"Error": ""}  # kube-scheduler's retry
    assert gated.cluster.order == [meta["name"]] and used(gated.state) == 4000
