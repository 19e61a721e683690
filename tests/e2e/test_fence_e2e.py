"""Issue 20 item 2 against the real kube-apiserver: the extender binds only while the Lease of the kube-scheduler
beside it (kube-vgpu/kube-vgpu-scheduler, as the manifests configure it) names that scheduler and is fresh, follows
the Lease through a real watch under the manifests' RBAC (get/list/watch on that one Lease), refuses binds once
another replica holds it or its renewals stop, and after winning it back binds again only after relisting pods.

The test plays both kube-schedulers' leader election (the dev cluster's own kube-scheduler runs without it) and
calls /bind itself; its pods name a scheduler nobody runs. The extender is composed in this process exactly as
`kube-vgpu extender --fence-lease ...` composes it, with the webhook's admission mark required (the default).
"""

from __future__ import annotations

import datetime as dt
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import orjson
import pytest
from kubernetes import client as k8s_client
from kubernetes.client.rest import ApiException

from kube_vgpu.dev.devcluster.cluster import DevCluster
from kube_vgpu.dev.devcluster.workload import create_pods, gpu_pod
from kube_vgpu.extender.cli import Extender, build, parse_args
from kube_vgpu.extender.sources.live import wait_until
from tests.e2e.conftest import NodeSet
from tests.servers import serve

pytestmark = pytest.mark.e2e

NAMESPACE, LEASE = "kube-vgpu", "kube-vgpu-scheduler"
UNSCHEDULED = "e2e-nobody"


def micro_time(moment: dt.datetime) -> str:
    return moment.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class LeaderElection:
    """Writes the Lease as kube-scheduler's leader election does (renewing every second while `holder` leads)."""

    def __init__(self, api: Any) -> None:
        self.coordination = k8s_client.CoordinationV1Api(api)
        self.holder = ""
        self.transitions = 0
        self.renewing = threading.Event()
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._renew_loop, daemon=True)

    def write(self, holder: str, *, renew_age_s: float = 0.0) -> None:
        with self.lock:
            if holder != self.holder:
                self.transitions += 1 if self.holder else 0
            self.holder = holder
            now = dt.datetime.now(dt.UTC)
            body = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                    "metadata": {"name": LEASE, "namespace": NAMESPACE},
                    "spec": {"holderIdentity": holder, "leaseDurationSeconds": 15,
                             "leaseTransitions": self.transitions,
                             "acquireTime": micro_time(now), "renewTime": micro_time(
                                 now - dt.timedelta(seconds=renew_age_s))}}
            try:
                self.coordination.patch_namespaced_lease(LEASE, NAMESPACE, {"spec": body["spec"]})
            except ApiException as exc:
                if exc.status != 404:
                    raise
                self.coordination.create_namespaced_lease(NAMESPACE, body)

    def _renew_loop(self) -> None:
        while not self.stop.wait(1.0):
            if self.renewing.is_set():
                self.write(self.holder)

    def delete(self) -> None:
        self.stop.set()
        try:
            self.coordination.delete_namespaced_lease(LEASE, NAMESPACE)
        except ApiException as exc:
            if exc.status != 404:
                raise


@dataclass
class Replica:
    cluster: DevCluster
    extender: Extender
    http: httpx.Client
    namespace: str
    node: str

    def refusal(self) -> str | None:
        assert self.extender.scheduler.fence is not None
        return self.extender.scheduler.fence.refusal()

    def create_and_bind(self, name: str) -> str:
        create_pods(self.cluster.api, self.namespace, [gpu_pod(name, memory_mib=1000, scheduler_name=UNSCHEDULED)])
        pod = orjson.loads(self.cluster.core.read_namespaced_pod(name, self.namespace, _preload_content=False).data)
        answer = self.http.post("/filter", json={"Pod": pod, "NodeNames": [self.node]}).json()
        assert answer["NodeNames"] == [self.node], answer
        return self.bind(pod)

    def bind(self, pod: dict[str, Any]) -> str:
        metadata = pod["metadata"]
        answer = self.http.post("/bind", json={"PodName": metadata["name"], "PodNamespace": metadata["namespace"],
                                               "PodUID": metadata["uid"], "Node": self.node})
        assert answer.status_code == 200, answer.text
        error: str = answer.json()["Error"]
        return error

    def bound_to(self, name: str) -> str | None:
        pod = orjson.loads(self.cluster.core.read_namespaced_pod(name, self.namespace, _preload_content=False).data)
        node: str | None = pod["spec"].get("nodeName")
        return node


@pytest.fixture()
def election(dev_cluster: DevCluster) -> Iterator[LeaderElection]:
    leader = LeaderElection(dev_cluster.api)
    leader.write("replica-a_1")
    leader.renewing.set()
    leader.thread.start()
    yield leader
    leader.delete()


@pytest.fixture()
def replica(dev_cluster: DevCluster, e2e_namespace: str, gpu_nodes: Callable[..., NodeSet],
            election: LeaderElection) -> Iterator[Replica]:
    (node,) = gpu_nodes(1, gpus=2).names
    extender = build(parse_args([f"--kubeconfig={dev_cluster.extender_kubeconfig}",
                                 f"--fence-lease={NAMESPACE}/{LEASE}", "--fence-identity-prefix=replica-a_"]))
    with serve(extender.app) as url, httpx.Client(base_url=url, timeout=120) as http:
        env = Replica(dev_cluster, extender, http, e2e_namespace, node)
        try:
            assert wait_until(lambda: http.get("/readyz").status_code == 200 and node in extender.state.nodes, 60)
            yield env
        finally:
            extender.source.stop()
            for gate in extender.scheduler.gates:  # the quota gate's own watches (they outlived the API server)
                gate.stop()


def test_binds_follow_the_leader_lease(replica: Replica, election: LeaderElection) -> None:
    # our term: the Lease was read through the watch and the pods relisted for it
    assert wait_until(lambda: replica.refusal() is None, 30), replica.refusal()
    assert replica.create_and_bind("while-leading") == ""
    assert replica.bound_to("while-leading") == replica.node

    # another replica takes over
    election.renewing.clear()
    election.write("replica-b_2")
    assert wait_until(lambda: "held by replica-b_2" in (replica.refusal() or ""), 30), replica.refusal()
    error = replica.create_and_bind("after-handover")
    assert "does not hold the leader Lease (held by replica-b_2)" in error, error
    assert replica.bound_to("after-handover") is None
    uid = orjson.loads(replica.cluster.core.read_namespaced_pod(
        "after-handover", replica.namespace, _preload_content=False).data)["metadata"]["uid"]
    assert uid not in replica.extender.state.pods  # nothing stays reserved

    # ours again, but the last renewal is 6 s old: a Binding (10 s window + 1 s margin) could outlive the term
    election.write("replica-a_1", renew_age_s=6.0)
    assert wait_until(lambda: "the leader Lease ends in" in (replica.refusal() or ""), 30), replica.refusal()
    pod = orjson.loads(replica.cluster.core.read_namespaced_pod(
        "after-handover", replica.namespace, _preload_content=False).data)
    assert "the leader Lease ends in" in replica.bind(pod)

    # renewals resume: a new term of ours (transitions moved), relisted, binding again
    election.write("replica-a_1")
    election.renewing.set()
    assert wait_until(lambda: replica.refusal() is None, 30), replica.refusal()
    assert replica.bind(pod) == ""
    assert replica.bound_to("after-handover") == replica.node
