"""The Evictors: LiveEvictor's answers to each thing the API server can say, over real HTTP (a small stand-in
server on a loopback port, through the kubernetes client and make_api_client as in production), and the
snapshot's in-memory evict. The real API server's side (RBAC, PodDisruptionBudgets, the UID precondition) is
tests/e2e/test_eviction_e2e.py."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import Response

from kube_vgpu.extender.preemption.evict import (
    DISRUPTION_TARGET,
    PREEMPTION_BY_SCHEDULER,
    EvictionOutcome,
    EvictionRequest,
)
from kube_vgpu.extender.sources.apiclient import ApiTimeouts, make_api_client
from kube_vgpu.extender.sources.evictor import LiveEvictor
from kube_vgpu.extender.sources.snapshot import PDB_REFUSAL, SnapshotCluster
from kube_vgpu.extender.state import ClusterState
from tests.extender.fakeapi import write_kubeconfig
from tests.helpers import gpu_node, pod
from tests.servers import free_port, serve

FAST = ApiTimeouts(connect_s=0.5, read_s=1.0, bind_s=1.0, evict_s=0.5)
REQUEST = EvictionRequest(
    namespace="team-b", name="victim", uid="uid-victim", preemptor_namespace="team-a", preemptor_name="big",
    preemptor_uid="uid-big", rule="priority 1000 > 0", node_name="n1",
)
Answer = dict[str, Any] | str  # a JSON document, or plain text
PDB_MESSAGE = "Cannot evict pod as it would violate the pod's disruption budget."
BUDGET_CAUSE = "The disruption budget keep needs 1 healthy pods and has 1 currently"


def status(code: int, message: str, **details: Any) -> tuple[int, dict[str, Any]]:
    body = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": code, "message": message}
    if details:
        body["details"] = details
    return code, body


@dataclass
class Seen:
    method: str
    path: str
    content_type: str
    body: dict[str, Any]


@dataclass
class Api:
    """Answers by the last path segment ("status", "eviction", "events"); 2xx unless told otherwise."""

    answers: dict[str, tuple[int, Answer]] = field(default_factory=dict)
    #: answers given once each, in order, before `answers`
    queued: dict[str, list[tuple[int, Answer]]] = field(default_factory=dict)
    delay_s: dict[str, float] = field(default_factory=dict)
    seen: list[Seen] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    #: set at the end of a test: delayed answers stop waiting, so the server shuts down at once
    stop: threading.Event = field(default_factory=threading.Event)

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.api_route("/{path:path}", methods=["GET", "POST", "PATCH", "PUT", "DELETE"])
        async def anything(path: str, request: Request) -> Response:
            body = orjson.loads(await request.body() or b"{}")
            kind = path.rsplit("/", 1)[-1]
            with self.lock:
                self.seen.append(Seen(request.method, "/" + path, request.headers.get("content-type", ""), body))
            until = time.monotonic() + self.delay_s.get(kind, 0.0)
            while time.monotonic() < until and not self.stop.is_set():
                await asyncio.sleep(0.02)
            with self.lock:
                queue = self.queued.get(kind) or []
                given = queue.pop(0) if queue else None
            code, answer = given or self.answers.get(
                kind, (201 if request.method == "POST" else 200, {"kind": "Status"})
            )
            if isinstance(answer, str):
                return Response(answer, status_code=code, media_type="text/plain")
            return Response(orjson.dumps(answer), status_code=code, media_type="application/json")

        return app

    def kinds(self) -> list[str]:
        with self.lock:
            return [s.path.rsplit("/", 1)[-1] for s in self.seen]


@pytest.fixture
def api(tmp_path: Path) -> Iterator[tuple[Api, LiveEvictor]]:
    fake = Api()
    with serve(fake.app()) as url:
        api_client = make_api_client(str(write_kubeconfig(tmp_path / "kubeconfig", url)))
        try:
            yield fake, LiveEvictor(api_client, reporting_instance="test-instance", timeouts=FAST)
        finally:
            fake.stop.set()
            api_client.close()


def test_an_accepted_eviction_marks_evicts_marks_again_and_records_both_events(
    api: tuple[Api, LiveEvictor],
) -> None:
    fake, evictor = api
    result = evictor.evict(REQUEST)
    assert result.outcome is EvictionOutcome.EVICTED and result.detail == ""
    assert fake.kinds() == ["status", "eviction", "status", "events", "events"]
    mark, eviction, _, on_victim, on_preemptor = fake.seen

    assert (mark.method, mark.path) == ("PATCH", "/api/v1/namespaces/team-b/pods/victim/status")
    assert mark.content_type == "application/strategic-merge-patch+json"
    assert mark.body["metadata"] == {"uid": "uid-victim"}  # the UID precondition of the patch
    [condition] = mark.body["status"]["conditions"]
    assert condition["type"] == DISRUPTION_TARGET and condition["status"] == "True"
    assert condition["reason"] == PREEMPTION_BY_SCHEDULER
    assert condition["message"] == (
        "kube-vgpu-scheduler: preempting to accommodate a higher priority pod team-a/big (priority 1000 > 0)"
    )

    assert (eviction.method, eviction.path) == ("POST", "/api/v1/namespaces/team-b/pods/victim/eviction")
    assert eviction.body["apiVersion"] == "policy/v1" and eviction.body["kind"] == "Eviction"
    assert eviction.body["deleteOptions"] == {"preconditions": {"uid": "uid-victim"}}

    assert on_victim.path == "/apis/events.k8s.io/v1/namespaces/team-b/events"
    assert on_victim.body["reason"] == "Preempted" and on_victim.body["type"] == "Normal"
    assert on_victim.body["note"] == "Preempted by team-a/big on node n1: priority 1000 > 0"
    assert on_victim.body["regarding"]["uid"] == "uid-victim" and on_victim.body["related"]["name"] == "big"
    assert on_victim.body["reportingController"] == "kube-vgpu-extender"
    assert on_victim.body["reportingInstance"] == "test-instance"
    assert on_victim.body["metadata"]["namespace"] == "team-b"
    assert on_preemptor.path == "/apis/events.k8s.io/v1/namespaces/team-a/events"
    assert on_preemptor.body["reason"] == "Preempting"
    assert on_preemptor.body["note"] == "Preempting team-b/victim on node n1: priority 1000 > 0"
    assert on_preemptor.body["regarding"]["uid"] == "uid-big"


@pytest.mark.parametrize(
    ("answer", "outcome", "detail"),
    [
        ((200, {"kind": "Eviction"}), EvictionOutcome.EVICTED, ""),
        (status(429, PDB_MESSAGE, causes=[{"reason": "DisruptionBudget", "message": BUDGET_CAUSE}]),
         EvictionOutcome.BLOCKED, f"{PDB_MESSAGE} {BUDGET_CAUSE}"),
        (status(429, PDB_MESSAGE, causes=[{"reason": "DisruptionBudget",
                                           "message": "The disruption budget keep is still being processed"}]),
         EvictionOutcome.BLOCKED, "is still being processed"),
        # API Priority and Fairness answers 429 in plain text: the server is busy, no budget refused anything
        ((429, "Too many requests, please try again later."), EvictionOutcome.FAILED, "HTTP 429 (API server busy)"),
        (status(404, 'pods "victim" not found'), EvictionOutcome.GONE, 'pods "victim" not found'),
        (status(409, "Precondition failed: UID in precondition: uid-victim, UID in object meta: other"),
         EvictionOutcome.GONE, "Precondition failed"),
        (status(500, "etcd is sad"), EvictionOutcome.FAILED, "HTTP 500: etcd is sad"),
        (status(403, "forbidden: cannot create pods/eviction"), EvictionOutcome.FAILED, "HTTP 403"),
    ],
)
def test_the_evictions_answer_decides_the_outcome(
    api: tuple[Api, LiveEvictor], answer: tuple[int, Answer], outcome: EvictionOutcome, detail: str
) -> None:
    fake, evictor = api
    fake.answers["eviction"] = answer
    result = evictor.evict(REQUEST)
    assert result.outcome is outcome
    assert detail in result.detail
    # events only for an eviction that happened; never a DELETE, whatever the answer
    assert ("events" in fake.kinds()) is (outcome is EvictionOutcome.EVICTED)
    assert all(s.method != "DELETE" for s in fake.seen)


@pytest.mark.parametrize(
    ("answer", "outcome"),
    [
        (status(404, 'pods "victim" not found'), EvictionOutcome.GONE),
        (status(422, "Pod \"victim\" is invalid: metadata.uid: Invalid value: \"uid-victim\": field is immutable",
                causes=[{"reason": "FieldValueInvalid", "field": "metadata.uid"}]), EvictionOutcome.GONE),
        (status(422, "Pod \"victim\" is invalid: status.conditions",
                causes=[{"reason": "FieldValueInvalid", "field": "status.conditions"}]), EvictionOutcome.FAILED),
        (status(403, "forbidden: cannot patch pods/status"), EvictionOutcome.FAILED),
    ],
)
def test_a_refused_mark_stops_before_the_eviction(
    api: tuple[Api, LiveEvictor], answer: tuple[int, dict[str, Any]], outcome: EvictionOutcome
) -> None:
    fake, evictor = api
    fake.answers["status"] = answer
    result = evictor.evict(REQUEST)
    assert result.outcome is outcome, result
    assert fake.kinds() == ["status"]  # nothing evicted, nothing recorded


def test_failed_events_do_not_change_the_outcome(api: tuple[Api, LiveEvictor]) -> None:
    fake, evictor = api
    fake.answers["events"] = status(403, "forbidden: cannot create events")
    assert evictor.evict(REQUEST).outcome is EvictionOutcome.EVICTED
    fake.answers["events"] = (200, {})
    fake.delay_s["events"] = 5 * FAST.evict_s  # hung: cut at its deadline, still EVICTED
    started = time.monotonic()
    assert evictor.evict(REQUEST).outcome is EvictionOutcome.EVICTED
    assert time.monotonic() - started < 2 * FAST.evict_s + 1.0  # two events, each cut at evict_s


def test_a_failed_second_mark_does_not_change_the_outcome(api: tuple[Api, LiveEvictor]) -> None:
    fake, evictor = api
    # the pod went away between the eviction and the second mark (KWOK or a kubelet was quick)
    fake.queued["status"] = [(200, {}), status(404, 'pods "victim" not found')]
    assert evictor.evict(REQUEST).outcome is EvictionOutcome.EVICTED
    assert fake.kinds() == ["status", "eviction", "status", "events", "events"]


@pytest.mark.parametrize("hung", ["status", "eviction"])
def test_a_hung_call_is_failed_at_its_deadline(api: tuple[Api, LiveEvictor], hung: str) -> None:
    fake, evictor = api
    fake.delay_s[hung] = 10 * FAST.evict_s
    started = time.monotonic()
    result = evictor.evict(REQUEST)
    elapsed_s = time.monotonic() - started
    assert result.outcome is EvictionOutcome.FAILED, result
    assert elapsed_s < FAST.evict_s + 1.0, elapsed_s
    assert "events" not in fake.kinds()


def test_evict_never_raises_even_without_a_server(tmp_path: Path) -> None:
    api_client = make_api_client(str(write_kubeconfig(tmp_path / "kubeconfig", f"http://127.0.0.1:{free_port()}")))
    try:
        result = LiveEvictor(api_client, timeouts=FAST).evict(REQUEST)
    finally:
        api_client.close()
    assert result.outcome is EvictionOutcome.FAILED
    assert result.detail


# --- the snapshot's Evictor ---------------------------------------------------------------------------------------


def snapshot_with(*names: str) -> tuple[SnapshotCluster, dict[str, dict[str, Any]]]:
    pods = {}
    for name in names:
        p = pod(name, namespace="team-b")
        p["metadata"]["uid"] = f"uid-{name}"
        p["spec"]["nodeName"] = "n1"
        pods[name] = p
    state = ClusterState(heartbeat_ttl_s=float("inf"))
    return SnapshotCluster(state, [gpu_node("n1"), *pods.values()]), pods


def test_the_snapshot_evicts_deletes_and_records() -> None:
    cluster, _ = snapshot_with("victim", "other")
    result = cluster.evict(REQUEST)
    assert result.outcome is EvictionOutcome.EVICTED
    assert cluster.get_pod("team-b", "victim") is None and cluster.get_pod("team-b", "other") is not None
    assert "uid-victim" not in cluster.state.pods
    [(namespace, name, condition)] = cluster.conditions
    assert (namespace, name, condition["type"], condition["reason"]) == (
        "team-b", "victim", DISRUPTION_TARGET, PREEMPTION_BY_SCHEDULER)
    assert [(e.namespace, e.pod_name, e.reason, e.related) for e in cluster.events] == [
        ("team-b", "victim", "Preempted", "team-a/big"),
        ("team-a", "big", "Preempting", "team-b/victim"),
    ]
    assert cluster.events[0].message == "Preempted by team-a/big on node n1: priority 1000 > 0"
    assert cluster.eviction_requests == [REQUEST]
    # again: the pod is gone
    assert cluster.evict(REQUEST).outcome is EvictionOutcome.GONE


def test_the_snapshot_honours_a_simulated_disruption_budget() -> None:
    cluster, _ = snapshot_with("victim")
    cluster.protected_uids.add("uid-victim")
    result = cluster.evict(REQUEST)
    assert result.outcome is EvictionOutcome.BLOCKED and result.detail == PDB_REFUSAL
    stored = cluster.get_pod("team-b", "victim")
    assert stored is not None
    # marked, as the live path leaves it when the Eviction API refuses
    assert [c["type"] for c in stored["status"]["conditions"] if c["type"] == DISRUPTION_TARGET] == [
        DISRUPTION_TARGET]
    assert cluster.events == []


def test_the_snapshot_evicts_nothing_for_another_uid() -> None:
    cluster, _ = snapshot_with("victim")
    stale = EvictionRequest(**{**{f: getattr(REQUEST, f) for f in REQUEST.__dataclass_fields__}, "uid": "old"})
    assert cluster.evict(stale).outcome is EvictionOutcome.GONE
    stored = cluster.get_pod("team-b", "victim")
    assert stored is not None and cluster.conditions == [] and cluster.events == []
