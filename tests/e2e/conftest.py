"""The end-to-end tier: ONE real dev cluster for the whole session, shared by every e2e test.

It is a real etcd, kube-apiserver (TLS, --authorization-mode=Node,RBAC, MutatingAdmissionWebhook), our webhook
(registered by URL through a MutatingWebhookConfiguration with its CA bundle), our extender in live mode, and
kube-scheduler running the manifests' KubeSchedulerConfiguration; see kube_vgpu/devcluster/cluster.py and
docs/dev-cluster.md. Nodes are API objects carrying the device plugin's inventory annotation. With lifecycle on
(as here), kube-controller-manager runs the Job, ReplicaSet, Deployment, garbage-collector, disruption and namespace
controllers, and KWOK plays the nodes' kubelets: a bound pod becomes Running, a pod annotated with
kube_vgpu.dev.devcluster.lifecycle.RUN_SECONDS_ANNOTATION (restartPolicy Never/OnFailure) Succeeds that many seconds
later, a deleted pod goes away. The first run builds the binaries (cached afterwards).

Fixtures (for everyone adding e2e tests here; mark tests with ``@pytest.mark.e2e``):

``dev_cluster`` (session) -> kube_vgpu.dev.devcluster.cluster.DevCluster
    .kubeconfig          admin kubeconfig path (system:masters client cert)
    .api / .core         shared admin kubernetes ApiClient / CoreV1Api (raw JSON: pass ``_preload_content=False``
                         and orjson.loads(response.data) if you want plain dicts)
    .api_client()        a fresh admin ApiClient (for threads of your own)
    .server              https://127.0.0.1:<port> of kube-apiserver
    .extender_url        http://127.0.0.1:<port> of the extender (/state, /metrics, /quota, /readyz)
    .webhook_url         https://127.0.0.1:<port>/mutate; .webhook_ca_pem its CA
    .extender_kubeconfig / .device_plugin_kubeconfig   token kubeconfigs of the two kube-vgpu ServiceAccounts
                         (system:serviceaccount:kube-vgpu:kube-vgpu-extender / ...-device-plugin), with the RBAC
                         of manifests/ (cluster.rbac_documents()) bound to them; the device plugin's token names no
                         node, so the admission policies (cluster.admission_policy_documents()) refuse its writes:
    .device_plugin_kubeconfig_for(node)  the device plugin's account with a token bound to that Node
    .restart_extender(crash=True)        SIGKILL + start + wait for its first sync; same port and arguments
    .stop_component(name, crash=False)   stop webhook / extender / kube-scheduler / heartbeat (crash: SIGKILL)
    .start_component(name)               start it again with the same command line and wait until ready
    .is_running(name)
    .add_nodes(NodeGroup(...)) -> names; .delete_nodes(names)   (the heartbeat keeps added nodes fresh)
    .log_tail(name)      the last lines of a component's log (put it in your assertion messages)
    Leave the cluster as you found it: delete your pods and nodes, restart what you stopped (a component a test
    leaves stopped is started again after it, and the test fails, so the next tests are not affected).

``e2e_namespace`` -> str: a fresh namespace for this test; its pods are deleted afterwards (grace period 0), then
    the namespace itself (the namespace controller deletes what else is left in it, e.g. Jobs and Deployments, in the
    background). The webhook mutates pods in every namespace but kube-system and kube-vgpu.

``kueue_crds`` (session): Kueue's own CRDs (from the Kueue module, as released: kube_vgpu/dev/devcluster/kueue.py)
    installed in the shared cluster, with no Kueue controller: our gate (quota mode enforce) admits against them.
    Write Kueue objects in v1beta2, the version the CRDs store (without Kueue's conversion webhook the API server
    converts between versions by renaming apiVersion only).

``gpu_nodes`` -> factory ``gpu_nodes(count, gpus=8, model=..., memory_mib=..., topology=..., kwok=True) -> NodeSet``:
    nodes only this test's pods can land on (a unique label; ``NodeSet.selector`` is the nodeSelector to put on
    the pods), deleted after the test. Tests on shared nodes would see each other's pods. ``kwok=False``: KWOK
    leaves the nodes' pods alone (they stay Pending once bound), for a test that plays their kubelet itself.

The cluster's own nodes (``BASE_NODE_GROUPS``) are there for tests that just need somewhere to schedule.
Set KUBE_VGPU_E2E_KEEP=1 to leave the cluster running after the session (its state dir is printed).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException

from kube_vgpu.dev.devcluster.cluster import ClusterOptions, DevCluster, DevClusterError, NodeGroup, up
from kube_vgpu.dev.devcluster.workload import delete_pods, ensure_namespace, list_all, wait_until_gone
from tests.e2e.checks import wait_until

NODE_GROUP_LABEL = "e2e.kube-vgpu.io/group"
BASE_NODE_GROUPS = (
    NodeGroup(
        count=2, gpus=8, model="NVIDIA A100-SXM4-80GB", memory_mib=81920, topology="nvswitch", prefix="base-a100"
    ),
    NodeGroup(count=1, gpus=4, model="Tesla T4", memory_mib=15360, topology="pcie", prefix="base-t4"),
)
_counter = itertools.count()


@contextlib.contextmanager
def private_cluster(label: str, **options: Any) -> Iterator[DevCluster]:
    """A dev cluster of a module's own (options as ClusterOptions'), stopped and its state dir removed afterwards;
    a start-up failure fails the test with the reason. Progress lines carry `label`."""
    state_dir = Path(tempfile.mkdtemp(prefix=f"kube-vgpu-e2e-{label}-"))
    try:
        cluster = up(ClusterOptions(state_dir=state_dir, die_with_parent=True,
                                    progress=lambda message: print(f"[{label}] {message}", file=sys.stderr,
                                                                   flush=True), **options))
    except DevClusterError as exc:
        shutil.rmtree(state_dir, ignore_errors=True)
        pytest.fail(f"the {label} dev cluster did not start (and was torn down): {exc}", pytrace=False)
    try:
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(state_dir, ignore_errors=True)


@pytest.fixture(scope="session")
def kueue_crds(dev_cluster: DevCluster) -> None:
    from kube_vgpu.dev.devcluster import kueue as kueue_module
    from kube_vgpu.dev.devcluster.binaries import kueue_source_dir

    crds = kueue_module.crd_documents(kueue_source_dir(progress=lambda _message: None))
    extensions: Any = client.ApiextensionsV1Api(dev_cluster.api)
    for crd in crds:
        extensions.create_custom_resource_definition(crd, _preload_content=False)
    for crd in crds:
        name = crd["metadata"]["name"]

        def established(name: str = name) -> bool:
            found = orjson.loads(extensions.read_custom_resource_definition(name, _preload_content=False).data)
            conditions = {c["type"]: c["status"] for c in (found.get("status") or {}).get("conditions") or []}
            return conditions.get("Established") == "True"

        wait_until(f"CRD {name} established", established, lambda: "", timeout_s=60)
    # the extender looks for Kueue's CRDs again only every minute: restart it to see them now
    dev_cluster.restart_extender(crash=False)


@pytest.fixture(scope="session")
def dev_cluster() -> Iterator[DevCluster]:
    keep = os.environ.get("KUBE_VGPU_E2E_KEEP") == "1"
    state_dir = Path(tempfile.mkdtemp(prefix="kube-vgpu-e2e-"))
    options = ClusterOptions(
        state_dir=state_dir,
        node_groups=BASE_NODE_GROUPS,
        die_with_parent=not keep,
        lifecycle=True,
        progress=lambda message: print(f"[dev-cluster] {message}", file=sys.stderr, flush=True),
    )
    try:
        cluster = up(options)
    except DevClusterError as exc:
        pytest.fail(f"the e2e dev cluster did not start (and was torn down): {exc}", pytrace=False)
    try:
        yield cluster
    finally:
        if keep:
            print(f"\n[dev-cluster] kept running: export KUBECONFIG={cluster.kubeconfig}; "
                  f"stop with kube-vgpu dev-cluster down --state-dir {state_dir}", file=sys.stderr)
        else:
            cluster.stop()
            shutil.rmtree(state_dir, ignore_errors=True)  # logs and certs of a finished session


def _slug(text: str, limit: int = 40) -> str:
    return re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")[:limit].strip("-")


@pytest.fixture
def e2e_namespace(dev_cluster: DevCluster, request: pytest.FixtureRequest) -> Iterator[str]:
    name = f"e2e-{_slug(request.node.name)}-{next(_counter)}"
    ensure_namespace(dev_cluster.api, name)
    yield name
    delete_pods(dev_cluster.api, name)
    wait_until_gone(dev_cluster.api, name, timeout_s=30)
    if dev_cluster.options.lifecycle:  # a controller (Deployment, Job) may recreate pods: the namespace goes too
        with contextlib.suppress(ApiException):
            dev_cluster.core.delete_namespace(name, _preload_content=False)


@dataclass(frozen=True)
class NodeSet:
    names: list[str]
    label_value: str

    @property
    def selector(self) -> dict[str, str]:
        """nodeSelector that confines a pod to these nodes."""
        return {NODE_GROUP_LABEL: self.label_value}


@pytest.fixture
def gpu_nodes(dev_cluster: DevCluster, request: pytest.FixtureRequest) -> Iterator[Callable[..., NodeSet]]:
    created: list[str] = []

    def make(
        count: int,
        gpus: int = 8,
        model: str = "NVIDIA A100-SXM4-80GB",
        memory_mib: int = 81920,
        topology: str = "nvswitch",
        kwok: bool = True,
    ) -> NodeSet:
        number = next(_counter)
        value = f"{_slug(request.node.name, 30)}-{number}"
        group = NodeGroup(
            count=count,
            gpus=gpus,
            model=model,
            memory_mib=memory_mib,
            topology=topology,
            prefix=f"e2e-{number}",
            labels=((NODE_GROUP_LABEL, value),),
            kwok=kwok,
        )
        names = dev_cluster.add_nodes(group)
        created.extend(names)
        return NodeSet(names, value)

    yield make
    if created:
        # pods first (grace period 0: no kubelet confirms), so no pod is left bound to a deleted node
        for node in created:
            for pod in list_all(dev_cluster.api, "pods", field_selector=f"spec.nodeName={node}"):
                metadata = pod["metadata"]
                with contextlib.suppress(ApiException):
                    dev_cluster.core.delete_namespaced_pod(
                        metadata["name"], metadata["namespace"], grace_period_seconds=0, _preload_content=False
                    )
        dev_cluster.delete_nodes(created)


@pytest.fixture(autouse=True)
def _components_left_running(request: pytest.FixtureRequest) -> Iterator[None]:
    """After a test on the shared cluster: every component must be running again; restart any that is not (so the
    following tests run on a whole cluster) and fail the test that left it down."""
    yield
    if "dev_cluster" not in request.fixturenames:
        return
    cluster: DevCluster = request.getfixturevalue("dev_cluster")
    down = cluster.stopped_components()
    for name in down:
        cluster.start_component(name)  # raises for etcd / kube-apiserver: nothing after that can pass anyway
    if down:
        pytest.fail(f"the test left {', '.join(down)} stopped (started again for the next tests)", pytrace=False)
