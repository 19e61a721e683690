"""Issue 20 item 4 against the real kube-apiserver: an extender whose API path runs through a fault-injecting
proxy (tests/faultproxy.py, terminating TLS with the dev cluster's serving certificate, so it sees each request)
keeps every bind inside its deadlines, never lets a hung read hold a node's turn, and notices a silently dead
watch (/readyz 503) and opens it again when the path heals.

The extender under test runs in this process, composed as `kube-vgpu extender --kubeconfig` composes it, with the
ServiceAccount token and RBAC of the manifests and timeouts of seconds (the defaults are the same mechanism with
larger numbers: tests/extender/test_api_deadlines.py checks they fit kube-scheduler's httpTimeout). Its pods name
a scheduler nobody runs, so only the test's own /bind calls bind them; the cluster's own extender is untouched.
"""

from __future__ import annotations

import ssl
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import yaml

from kube_vgpu.dev.devcluster.cluster import DevCluster
from kube_vgpu.dev.devcluster.workload import create_pods, gpu_pod
from kube_vgpu.extender.scheduler import Scheduler
from kube_vgpu.extender.server import create_app
from kube_vgpu.extender.sources.apiclient import ApiTimeouts, make_api_client
from kube_vgpu.extender.sources.live import LiveBinder, LiveSource, wait_until
from kube_vgpu.extender.sources.metrics import SourceCollector
from kube_vgpu.extender.state import ClusterState
from tests.e2e.conftest import NodeSet
from tests.faultproxy import Fault, FaultProxy
from tests.servers import serve

pytestmark = pytest.mark.e2e

TIMEOUTS = ApiTimeouts(connect_s=1.0, read_s=2.0, bind_s=3.0, list_page_s=20.0, watch_progress_s=4.0,
                       watch_server_timeout_s=3)
#: scheduling noise on a loaded test machine; the faults under test would otherwise last forever
SLACK_S = 5.0
UNSCHEDULED = "e2e-nobody"  # pods of this scheduler are bound only by the test's /bind calls


@dataclass
class Extender:
    cluster: DevCluster
    proxy: FaultProxy
    state: ClusterState
    source: LiveSource
    http: httpx.Client
    namespace: str
    node: str

    def ready(self) -> int:
        return self.http.get("/readyz").status_code

    def create_pod(self, name: str, memory_mib: int) -> dict[str, Any]:
        create_pods(self.cluster.api, self.namespace,
                    [gpu_pod(name, memory_mib=memory_mib, scheduler_name=UNSCHEDULED)])
        return self.read_pod(name)

    def read_pod(self, name: str) -> dict[str, Any]:
        response = self.cluster.core.read_namespaced_pod(name, self.namespace, _preload_content=False)
        pod: dict[str, Any] = orjson.loads(response.data)
        return pod

    def filter(self, pod: dict[str, Any]) -> None:
        answer = self.http.post("/filter", json={"Pod": pod, "NodeNames": [self.node]}).json()
        assert answer["NodeNames"] == [self.node], answer

    def bind(self, pod: dict[str, Any]) -> tuple[str, float]:
        metadata = pod["metadata"]
        started = time.monotonic()
        answer = self.http.post("/bind", json={"PodName": metadata["name"], "PodNamespace": metadata["namespace"],
                                               "PodUID": metadata["uid"], "Node": self.node})
        assert answer.status_code == 200, answer.text
        return answer.json()["Error"], time.monotonic() - started

    def bound_to(self, name: str) -> str | None:
        node: str | None = self.read_pod(name)["spec"].get("nodeName")
        return node


def proxy_kubeconfig(cluster: DevCluster, proxy: FaultProxy, path: Path) -> Path:
    """The extender's own ServiceAccount kubeconfig, pointed at the proxy (it presents the API server's serving
    certificate, which the kubeconfig's CA trusts)."""
    document = yaml.safe_load(cluster.extender_kubeconfig.read_text())
    for entry in document["clusters"]:
        entry["cluster"]["server"] = proxy.url
    path.write_text(yaml.safe_dump(document))
    return path


@pytest.fixture()
def extender(dev_cluster: DevCluster, e2e_namespace: str, gpu_nodes: Callable[..., NodeSet],
             tmp_path: Path) -> Iterator[Extender]:
    assert dev_cluster.pki is not None
    (node,) = gpu_nodes(1, gpus=2).names
    server_tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_tls.load_cert_chain(dev_cluster.pki.serving.cert, dev_cluster.pki.serving.key)
    upstream_tls = ssl.create_default_context(cafile=str(dev_cluster.pki.ca_cert))
    upstream = ("127.0.0.1", dev_cluster.ports["kube-apiserver"])
    with FaultProxy(upstream, server_tls=server_tls, upstream_tls=upstream_tls) as proxy:
        api_client = make_api_client(str(proxy_kubeconfig(dev_cluster, proxy, tmp_path / "extender.kubeconfig")))
        state = ClusterState()
        source = LiveSource(state, api_client, timeouts=TIMEOUTS, max_backoff_s=1.0)
        app = create_app(Scheduler(state, LiveBinder(api_client, timeouts=TIMEOUTS)), on_startup=source.start)
        app.state.registry.register(SourceCollector(state, source.health))
        with serve(app) as url, httpx.Client(base_url=url, timeout=120) as http:
            env = Extender(dev_cluster, proxy, state, source, http, e2e_namespace, node)
            try:
                assert wait_until(lambda: env.ready() == 200 and node in state.nodes, 60), http.get("/readyz").text
                yield env
            finally:
                source.stop()
                proxy.set_fault(Fault.DROP)  # end the watches' connections now rather than at their timeouts


def test_a_hung_follow_up_read_does_not_hold_the_nodes_turn(extender: Extender) -> None:
    """A Binding fails (its connection is reset before it reaches the API server), the read that checks whether
    it took effect anyway hangs: the node's next bind is answered once the read's deadline passes."""
    first, second = extender.create_pod("first", 1000), extender.create_pod("second", 2000)
    extender.filter(first)
    extender.filter(second)
    extender.proxy.add_rule(Fault.DROP, method="POST", path="/pods/first/binding$")
    extender.proxy.add_rule(Fault.HANG, method="GET", path="/pods/first$", times=None)
    answers: dict[str, tuple[str, float]] = {}

    def bind(pod: dict[str, Any]) -> None:
        answers[pod["metadata"]["name"]] = extender.bind(pod)

    threads = [threading.Thread(target=bind, args=(first,))]
    threads[0].start()
    assert wait_until(lambda: extender.proxy.requests_matching("GET", "/pods/first$"), 30)  # the hung read
    threads.append(threading.Thread(target=bind, args=(second,)))  # waits for the first's turn on the node
    threads[1].start()
    for thread in threads:
        thread.join(60)
    error, elapsed_s = answers["first"]
    assert "binding" in error and "failed" in error, error
    assert elapsed_s < TIMEOUTS.bind_s + TIMEOUTS.read_s + SLACK_S
    error, elapsed_s = answers["second"]
    assert error == "" and elapsed_s < TIMEOUTS.bind_worst_case_s + SLACK_S
    assert extender.bound_to("second") == extender.node and extender.bound_to("first") is None
    assert len(extender.proxy.requests_matching("GET", "/pods/first$")) == 1  # tried once, not retried


@pytest.mark.parametrize("filtered", [False, True], ids=["prepare-reads-the-pod", "pod-known-from-filter"])
def test_a_bind_never_takes_longer_than_its_deadlines(extender: Extender, filtered: bool) -> None:
    pod = extender.create_pod("hung", 1000)
    if filtered:
        extender.filter(pod)
    extender.proxy.set_fault(Fault.HANG)  # the API server accepts connections and requests, and never answers
    error, elapsed_s = extender.bind(pod)
    assert error, "a bind through a hung API server cannot succeed"
    budget_s = TIMEOUTS.bind_s + TIMEOUTS.read_s if filtered else TIMEOUTS.read_s
    assert elapsed_s < budget_s + SLACK_S, f"{elapsed_s:.1f} s: {error}"
    assert extender.bound_to("hung") is None
    record = extender.state.pods.get(pod["metadata"]["uid"])
    # nothing reserved when the prepare's read failed; when the Binding's outcome is unknown, its GPUs stay reserved
    # (uncertain) until the retry reads the pod
    assert record is None if not filtered else (record is not None and record.uncertain)
    extender.proxy.set_fault(Fault.PASS)  # kube-scheduler's retry, once the API server answers again
    extender.filter(pod)
    assert extender.bind(pod)[0] == ""
    assert extender.bound_to("hung") == extender.node


def test_a_silently_dead_watch_is_noticed_and_opened_again(extender: Extender,
                                                           gpu_nodes: Callable[..., NodeSet]) -> None:
    extender.proxy.set_fault(Fault.HALF_OPEN)  # open connections go silent without closing; new ones too
    (added,) = gpu_nodes(1, gpus=2).names  # written straight to the API server, not through the dead path
    assert wait_until(lambda: extender.ready() == 503, TIMEOUTS.watch_progress_s + 30)
    assert "watch has delivered nothing for" in extender.http.get("/readyz").text
    assert added not in extender.state.nodes
    extender.proxy.set_fault(Fault.PASS)  # the path heals
    assert wait_until(lambda: extender.ready() == 200 and added in extender.state.nodes, 60), \
        extender.http.get("/readyz").text
    assert extender.source.health["nodes"].restarts.get("stalled", 0) >= 1
    # heartbeats flow again: the new node's inventory is fresh
    assert extender.state.heartbeat_age_s(extender.state.nodes[added]) is not None
