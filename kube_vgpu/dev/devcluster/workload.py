"""GPU pods on a dev cluster: build them, create many at once, wait until they are bound or refused, read the
scheduler's reasons, check the assignments, delete them. Shared by the demo, the end-to-end tests and the
throughput benchmark. Raw JSON throughout (no generated model classes): faster, and the objects look exactly as
the API server returns them.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import orjson

from kube_vgpu import protocol
from kube_vgpu.dev.fixtures import gpu_limits

#: never pulled (no kubelet runs the pods), but a real image name keeps the objects realistic
PAUSE_IMAGE = "registry.k8s.io/pause:3.10"
CREATE_THREADS = 16


def _core(api_client: Any) -> Any:
    """CoreV1Api, typed Any: its stubs describe model objects, and we pass and read raw JSON."""
    from kubernetes import client

    return client.CoreV1Api(api_client)


def gpu_pod(
    name: str,
    *,
    gpus: int = 1,
    memory_mib: int | None = None,
    memory_percent: int | None = None,
    cores: int | None = None,
    annotations: Mapping[str, str] | None = None,
    labels: Mapping[str, str] | None = None,
    node_selector: Mapping[str, str] | None = None,
    scheduler_name: str | None = None,
    containers: int = 1,
) -> dict[str, Any]:
    """A GPU pod in HAMi's pod API. scheduler_name None leaves routing to the webhook (as users do)."""
    limits = gpu_limits(gpus=gpus, memory_mib=memory_mib, memory_percent=memory_percent, cores=cores)
    spec: dict[str, Any] = {
        "containers": [
            {
                "name": "main" if containers == 1 else f"c{index}",
                "image": PAUSE_IMAGE,
                "resources": {"limits": dict(limits), "requests": {"cpu": "100m", "memory": "128Mi"}},
            }
            for index in range(containers)
        ],
        # deleting a pod of a node without kubelet must not wait for a kubelet to confirm
        "terminationGracePeriodSeconds": 0,
    }
    if scheduler_name:
        spec["schedulerName"] = scheduler_name
    if node_selector:
        spec["nodeSelector"] = dict(node_selector)
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "annotations": dict(annotations or {}), "labels": dict(labels or {})},
        "spec": spec,
    }


def ensure_namespace(api_client: Any, name: str) -> None:
    from kubernetes.client.rest import ApiException

    try:
        _core(api_client).create_namespace(
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}}, _preload_content=False
        )
    except ApiException as exc:
        if exc.status != 409:
            raise


def create_pods(
    api_client: Any, namespace: str, pods: Sequence[Mapping[str, Any]], threads: int = CREATE_THREADS
) -> None:
    """Create pods concurrently (the API server admits them in parallel, as from many clients)."""

    core = _core(api_client)

    def create(pod: Mapping[str, Any]) -> None:
        core.create_namespaced_pod(namespace, pod, _preload_content=False)

    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="create-pod") as pool:
        list(pool.map(create, pods))


def list_pods(api_client: Any, namespace: str, label_selector: str | None = None) -> list[dict[str, Any]]:

    kwargs: dict[str, Any] = {"_preload_content": False}
    if label_selector:
        kwargs["label_selector"] = label_selector
    response = _core(api_client).list_namespaced_pod(namespace, **kwargs)
    items: list[dict[str, Any]] = orjson.loads(response.data).get("items") or []
    return items


def scheduling_failures(api_client: Any, namespace: str) -> dict[str, str]:
    """Pod name -> message of its latest FailedScheduling event (what kube-scheduler recorded, our extender's
    reasons included)."""

    response = _core(api_client).list_namespaced_event(
        namespace, field_selector="reason=FailedScheduling", _preload_content=False
    )
    latest: dict[str, tuple[str, str]] = {}
    for event in orjson.loads(response.data).get("items") or []:
        involved = event.get("involvedObject") or {}
        if involved.get("kind") != "Pod":
            continue
        moment = event.get("lastTimestamp") or event.get("eventTime") or (event.get("metadata") or {}).get(
            "creationTimestamp", ""
        )
        name = str(involved.get("name"))
        if name not in latest or moment >= latest[name][0]:
            latest[name] = (moment or "", str(event.get("message") or ""))
    return {name: message for name, (_, message) in latest.items()}


@dataclass
class Outcome:
    """Where the pods stand: bound (name -> node), refused (name -> FailedScheduling message), still pending."""

    bound: dict[str, str] = field(default_factory=dict)
    refused: dict[str, str] = field(default_factory=dict)
    pending: list[str] = field(default_factory=list)
    pods: dict[str, dict[str, Any]] = field(default_factory=dict)

    def describe(self) -> str:
        parts = [f"{len(self.bound)} bound", f"{len(self.refused)} refused", f"{len(self.pending)} pending"]
        examples = [f"{name}: {message}" for name, message in list(self.refused.items())[:3]]
        return ", ".join(parts) + ("; e.g. " + " | ".join(examples) if examples else "")


def wait_for_pods(
    api_client: Any,
    namespace: str,
    names: Iterable[str],
    *,
    timeout_s: float,
    expect_refused: Iterable[str] = (),
    interval_s: float = 0.25,
) -> Outcome:
    """Wait until every pod is bound, except those in `expect_refused`, which must have a FailedScheduling
    event. Returns the outcome at that point or at the timeout (the caller checks)."""
    wanted = set(names)
    refusable = set(expect_refused)
    deadline = time.monotonic() + timeout_s
    while True:
        outcome = pod_outcome(api_client, namespace, wanted)
        done = all(name in outcome.bound for name in wanted - refusable) and all(
            name in outcome.refused or name in outcome.bound for name in refusable
        )
        if done or time.monotonic() >= deadline:
            return outcome
        time.sleep(interval_s)


def pod_outcome(api_client: Any, namespace: str, names: Iterable[str]) -> Outcome:
    wanted = set(names)
    outcome = Outcome()
    pods = {pod["metadata"]["name"]: pod for pod in list_pods(api_client, namespace)}
    failures: dict[str, str] | None = None
    for name in sorted(wanted):
        pod = pods.get(name)
        if pod is None:
            outcome.pending.append(name)
            continue
        outcome.pods[name] = pod
        node = (pod.get("spec") or {}).get("nodeName")
        if node:
            outcome.bound[name] = node
            continue
        if failures is None:
            failures = scheduling_failures(api_client, namespace)
        if name in failures:
            outcome.refused[name] = failures[name]
        else:
            outcome.pending.append(name)
    return outcome


def assignment_of(pod: Mapping[str, Any]) -> protocol.PodAssignment | None:
    text = ((pod.get("metadata") or {}).get("annotations") or {}).get(protocol.POD_ASSIGNMENT_ANNOTATION)
    return protocol.decode_assignment(text) if text else None


@dataclass
class GpuUse:
    node: str
    uuid: str
    model: str
    memory_mib: int
    cores: int
    max_vgpus: int
    used_memory_mib: int = 0
    used_cores: int = 0
    vgpus: int = 0
    pods: list[str] = field(default_factory=list)

    @property
    def overcommitted(self) -> bool:
        return self.used_memory_mib > self.memory_mib or self.used_cores > self.cores or self.vgpus > self.max_vgpus


def gpu_usage(nodes: Iterable[Mapping[str, Any]], pods: Iterable[Mapping[str, Any]]) -> dict[str, GpuUse]:
    """Sum every bound pod's assignment annotation per GPU (UUID), against the nodes' inventories: the
    ground truth through the API, independent of the extender's memory."""
    gpus: dict[str, GpuUse] = {}
    for node in nodes:
        metadata = node.get("metadata") or {}
        text = (metadata.get("annotations") or {}).get(protocol.NODE_INVENTORY_ANNOTATION)
        if not text:
            continue
        for gpu in protocol.decode_inventory(text).gpus:
            gpus[gpu.uuid] = GpuUse(metadata["name"], gpu.uuid, gpu.model, gpu.memory_mib, gpu.cores, gpu.max_vgpus)
    for pod in pods:
        assignment = assignment_of(pod)
        if assignment is None or not (pod.get("spec") or {}).get("nodeName"):
            continue
        label = f"{pod['metadata'].get('namespace')}/{pod['metadata']['name']}"
        for device in assignment.all_devices():
            use = gpus.get(device.uuid)
            if use is None:
                use = gpus[device.uuid] = GpuUse(assignment.node, device.uuid, "?", 0, 0, 0)
            use.used_memory_mib += device.memory_mib
            use.used_cores += device.cores
            use.vgpus += 1
            use.pods.append(label)
    return gpus


def list_all(api_client: Any, kind: str, field_selector: str | None = None) -> list[dict[str, Any]]:
    """Every Node ("nodes") or every Pod ("pods") of the cluster, raw JSON."""

    core = _core(api_client)
    call = core.list_node if kind == "nodes" else core.list_pod_for_all_namespaces
    kwargs: dict[str, Any] = {"_preload_content": False}
    if field_selector:
        kwargs["field_selector"] = field_selector
    items: list[dict[str, Any]] = orjson.loads(call(**kwargs).data).get("items") or []
    return items


def delete_pods(api_client: Any, namespace: str, label_selector: str | None = None) -> None:
    """Delete pods at once (grace period 0: no kubelet would ever confirm a graceful deletion)."""

    kwargs: dict[str, Any] = {"grace_period_seconds": 0, "_preload_content": False}
    if label_selector:
        kwargs["label_selector"] = label_selector
    _core(api_client).delete_collection_namespaced_pod(namespace, **kwargs)


def wait_until_gone(api_client: Any, namespace: str, timeout_s: float, label_selector: str | None = None) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not list_pods(api_client, namespace, label_selector):
            return True
        time.sleep(0.1)
    return not list_pods(api_client, namespace, label_selector)


def short_uuid(uuid: str) -> str:
    return uuid[:12]

