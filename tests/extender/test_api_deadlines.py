"""Issue 20 item 4, the bind side: every API call of a bind has a deadline that fits inside kube-scheduler's
httpTimeout, urllib3 retries nothing behind it, and the client's sockets have TCP keepalive.

The extender runs over real HTTP (its ASGI app served by uvicorn) and talks to a stand-in API server over real
HTTP, through tests/faultproxy.py, which makes the path hang or drop. (The e2e tier repeats the essential cases
against the real kube-apiserver: tests/e2e/test_api_faults.py.)
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from kube_vgpu.extender.scheduler import Scheduler
from kube_vgpu.extender.server import create_app
from kube_vgpu.extender.sources.apiclient import (
    DEFAULT_TIMEOUTS,
    SCHEDULER_EXTENDER_TIMEOUT_S,
    ApiTimeouts,
    DeadlineExceeded,
    make_api_client,
)
from kube_vgpu.extender.sources.live import LiveBinder
from kube_vgpu.extender.state import ClusterState
from tests.extender.fakeapi import FakeApiServer, running, write_kubeconfig
from tests.faultproxy import Fault, FaultProxy
from tests.helpers import gpu_node, pod
from tests.servers import serve

ROOT = Path(__file__).resolve().parents[2]
FAST = ApiTimeouts(connect_s=0.5, read_s=1.0, bind_s=2.0, list_page_s=5.0, watch_progress_s=2.0,
                   watch_server_timeout_s=1)
#: scheduling noise on a loaded test machine; the faults under test would otherwise last forever
SLACK_S = 5.0


def test_the_bind_budget_fits_inside_kube_schedulers_http_timeout() -> None:
    config = yaml.safe_load((ROOT / "manifests/base/scheduler/kube-scheduler-config.yaml").read_text())
    (extender,) = config["extenders"]
    assert extender["httpTimeout"] == f"{SCHEDULER_EXTENDER_TIMEOUT_S:g}s"
    # prepare's pod read + the Binding + the check after a failed Binding, with room left to wait for the node
    assert DEFAULT_TIMEOUTS.bind_worst_case_s == 20 and DEFAULT_TIMEOUTS.turn_wait_limit_s == 10
    assert DEFAULT_TIMEOUTS.watch_server_timeout_s < DEFAULT_TIMEOUTS.watch_progress_s
    with pytest.raises(ValueError, match="watch_server_timeout_s"):
        ApiTimeouts(watch_progress_s=30, watch_server_timeout_s=60)


@dataclass
class Env:
    fake: FakeApiServer
    proxy: FaultProxy
    binder: LiveBinder
    state: ClusterState
    http: httpx.Client

    def add_pod(self, **kwargs: Any) -> dict[str, Any]:
        p = pod(**kwargs)
        self.fake.put("pods", p)
        return p

    def filter(self, p: dict[str, Any]) -> None:
        """As kube-scheduler does before bind; the extender then binds without reading the pod."""
        answer = self.http.post("/filter", json={"Pod": p, "NodeNames": ["n1"]}).json()
        assert answer["NodeNames"] == ["n1"], answer

    def bind(self, p: dict[str, Any]) -> tuple[str, float]:
        """(the Error kube-scheduler gets, seconds the bind verb took)."""
        metadata = p["metadata"]
        started = time.monotonic()
        answer = self.http.post("/bind", json={"PodName": metadata["name"], "PodNamespace": metadata["namespace"],
                                               "PodUID": metadata["uid"], "Node": "n1"})
        assert answer.status_code == 200, answer.text  # a failed API call is an Error, never a 500
        return answer.json()["Error"], time.monotonic() - started


@pytest.fixture()
def env(tmp_path: Path) -> Iterator[Env]:
    fake = FakeApiServer()
    with running(fake) as fake_url, FaultProxy(("127.0.0.1", int(fake_url.rsplit(":", 1)[1]))) as proxy:
        api_client = make_api_client(str(write_kubeconfig(tmp_path / "kubeconfig", proxy.url)))
        state = ClusterState()
        state.upsert_node(gpu_node("n1"))
        state.mark_synced()
        binder = LiveBinder(api_client, timeouts=FAST)
        with serve(create_app(Scheduler(state, binder))) as url, httpx.Client(base_url=url, timeout=120) as http:
            yield Env(fake, proxy, binder, state, http)


def test_a_hung_follow_up_read_does_not_hold_the_nodes_turn(env: Env) -> None:
    """The reported case: a Binding fails, the read that checks whether it took effect anyway hangs; the bind
    held its node's turn forever and the next bind to that node was never answered."""
    first, second = env.add_pod(memory_mib=1000), env.add_pod(memory_mib=2000)  # different: one at a time
    env.filter(first)
    env.filter(second)
    env.fake.binding_status[first["metadata"]["name"]] = 500
    env.proxy.add_rule(Fault.HANG, method="GET", path=f"/pods/{first['metadata']['name']}$", times=None)
    answers: dict[str, tuple[str, float]] = {}

    def bind(p: dict[str, Any]) -> None:
        answers[p["metadata"]["name"]] = env.bind(p)

    threads = [threading.Thread(target=bind, args=(first,))]
    threads[0].start()
    assert wait_for(lambda: env.proxy.requests_matching("POST", f"/pods/{first['metadata']['name']}/binding"))
    threads.append(threading.Thread(target=bind, args=(second,)))  # queued behind the first on n1
    threads[1].start()
    for thread in threads:
        thread.join(60)
    error, elapsed_s = answers[first["metadata"]["name"]]
    assert "failed" in error and elapsed_s < FAST.bind_s + FAST.read_s + SLACK_S
    error, elapsed_s = answers[second["metadata"]["name"]]
    assert error == "" and elapsed_s < FAST.bind_worst_case_s + SLACK_S
    assert env.fake.bindings == [(second["metadata"]["name"], "n1")]
    assert env.state.pods[second["metadata"]["uid"]].assignment.containers[0].devices[0].memory_mib == 2000
    # the failed bind's outcome could not be read back: its GPUs stay reserved (freeing them could over-commit, if
    # the Binding was written after all), marked uncertain until the pod is read or the watch shows it
    record = env.state.pods[first["metadata"]["uid"]]
    assert record.uncertain and not record.bound


@pytest.mark.parametrize("filtered", [False, True], ids=["prepare-reads-the-pod", "pod-known-from-filter"])
def test_a_bind_never_outlasts_its_deadlines_when_the_api_server_hangs(env: Env, filtered: bool) -> None:
    p = env.add_pod(memory_mib=1000)
    if filtered:
        env.filter(p)
    env.proxy.set_fault(Fault.HANG)  # every connection accepted, nothing ever answered
    error, elapsed_s = env.bind(p)
    if filtered:
        assert error.startswith(f"binding default/{p['metadata']['name']} to n1 failed")
        assert elapsed_s < FAST.bind_s + FAST.read_s + SLACK_S
    else:
        assert error.startswith(f"reading pod default/{p['metadata']['name']} failed")
        assert elapsed_s < FAST.read_s + SLACK_S
    if filtered:  # the Binding's outcome is unknown: its reservation stays, uncertain (nothing over-commits)
        assert [r.uncertain for r in env.state.pods.values()] == [True]
    else:
        assert not env.state.pods  # nothing was reserved before the read failed
    env.proxy.set_fault(Fault.PASS)  # the API server is back: kube-scheduler's retry reads the pod, then binds it
    env.filter(p)
    assert env.bind(p)[0] == ""


def test_a_hung_read_is_tried_once_not_retried_by_urllib3(env: Env) -> None:
    """urllib3's default retries repeated a timed-out read three more times, each with the whole timeout."""
    p = env.add_pod(memory_mib=1000)
    name = p["metadata"]["name"]
    env.proxy.add_rule(Fault.HANG, method="GET", path=f"/pods/{name}$", times=None)
    started = time.monotonic()
    with pytest.raises(Exception, match="timed out"):
        env.binder.get_pod("default", name)
    assert time.monotonic() - started < FAST.read_s + SLACK_S
    assert len(env.proxy.requests_matching("GET", f"/pods/{name}$")) == 1


def test_an_answer_that_trickles_forever_is_cut_at_the_deadline(env: Env) -> None:
    """Bytes keep arriving, so no socket read ever times out: only the deadline ends the call."""
    p = env.add_pod(memory_mib=1000)
    env.fake.trickle.add(p["metadata"]["name"])
    started = time.monotonic()
    with pytest.raises(DeadlineExceeded, match="no complete answer within the deadline"):
        env.binder.get_pod("default", p["metadata"]["name"])
    assert time.monotonic() - started < FAST.read_s + SLACK_S
    env.fake.trickle.clear()
    assert env.binder.get_pod("default", p["metadata"]["name"]) is not None  # the pool still works


def test_the_clients_sockets_have_tcp_keepalive_and_urllib3_retries_nothing(env: Env) -> None:
    p = env.add_pod(memory_mib=1000)
    assert env.binder.get_pod("default", p["metadata"]["name"]) is not None
    pool_manager = env.binder.api_client.rest_client.pool_manager
    retries = pool_manager.connection_pool_kw["retries"]
    assert retries is False or retries.total is False  # urllib3 raises the first error instead of retrying
    pool = pool_manager.connection_from_url(env.proxy.url)
    sockets = [conn.sock for conn in pool.pool.queue if conn is not None and conn.sock is not None]
    assert sockets, "the read's connection went back to the pool"
    for sock in sockets:
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == 15
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL) == 5
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT) == 3
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 30_000


def wait_for(predicate: Any, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return bool(predicate())


def test_the_graceful_shutdown_lets_the_longest_bind_finish_inside_the_pods_grace_period() -> None:
    from kube_vgpu.extender.cli import GRACEFUL_SHUTDOWN_S

    deployment = yaml.safe_load(
        (Path(__file__).resolve().parents[2] / "manifests/base/scheduler/deployment.yaml").read_text())
    grace_s = deployment["spec"]["template"]["spec"].get("terminationGracePeriodSeconds", 30)  # Kubernetes' default
    assert DEFAULT_TIMEOUTS.bind_worst_case_s < GRACEFUL_SHUTDOWN_S < grace_s


def test_the_live_extender_waits_for_a_turn_only_as_long_as_its_deadlines_allow(tmp_path: Path) -> None:
    from kube_vgpu.extender.cli import build, parse_args

    extender = build(parse_args([f"--kubeconfig={write_kubeconfig(tmp_path / 'kc', 'https://127.0.0.1:1')}"]))
    assert extender.scheduler.ordering.turn_wait_limit_s == DEFAULT_TIMEOUTS.turn_wait_limit_s
    assert DEFAULT_TIMEOUTS.turn_wait_limit_s + DEFAULT_TIMEOUTS.bind_worst_case_s <= SCHEDULER_EXTENDER_TIMEOUT_S
