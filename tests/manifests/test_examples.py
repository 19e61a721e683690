"""The example workloads do what their comments say: each pod goes through the real webhook (admitted and
mutated) and then through the extender's filter, prioritize and bind on a small synthetic cluster (two 8 x A100
NVSwitch nodes, one 4 x T4 PCIe node), and the resulting GPU assignment is the one described."""

from __future__ import annotations

import base64
import copy
import datetime as dt
import itertools
from typing import Any

import jsonpatch
import orjson
import pytest

from kube_vgpu import protocol
from kube_vgpu.extender.scheduler import Scheduler
from kube_vgpu.extender.sources.snapshot import SnapshotCluster
from kube_vgpu.extender.state import ClusterState
from kube_vgpu.webhook.config import WebhookConfig
from kube_vgpu.webhook.mutate import review
from tests.helpers import gpu_node
from tests.manifests.render import find, render

_uids = itertools.count()
#: The nodes' heartbeat, and the only time the extender's state sees: nothing here depends on the wall clock, so the
#: module passes however long after its import it runs (a first run builds the Go binaries in between).
MOMENT = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)


def nodes() -> list[dict[str, Any]]:
    return [gpu_node("a100-0", gpus=8, heartbeat=MOMENT), gpu_node("a100-1", gpus=8, heartbeat=MOMENT),
            gpu_node("t4-0", gpus=4, model="Tesla-T4", memory_mib=15360, topology="pcie", heartbeat=MOMENT)]


def example_pods() -> list[dict[str, Any]]:
    """Pods as their controllers would create them: Pods as written, a Deployment's template once per replica."""
    pods: list[dict[str, Any]] = []
    for obj in render("examples"):
        if obj["kind"] == "Pod":
            pods.append(obj)
        elif obj["kind"] == "Deployment":
            for replica in range(obj["spec"]["replicas"]):
                template = copy.deepcopy(obj["spec"]["template"])
                template["metadata"]["name"] = f"{obj['metadata']['name']}-{replica}"
                template["metadata"]["namespace"] = obj["metadata"]["namespace"]
                pods.append({"apiVersion": "v1", "kind": "Pod", **template})
    return pods


def admit(pod: dict[str, Any]) -> dict[str, Any]:
    """The pod after the webhook: the AdmissionReview the API server sends, the patch it gets back, applied."""
    request = {
        "uid": f"review-{next(_uids)}",
        "kind": {"group": "", "version": "v1", "kind": "Pod"},
        "resource": {"group": "", "version": "v1", "resource": "pods"},
        "namespace": pod["metadata"]["namespace"],
        "name": pod["metadata"]["name"],
        "operation": "CREATE",
        "userInfo": {"username": "kubernetes-admin"},
        "object": pod,
    }
    outcome = review(orjson.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
                                   "request": request}), WebhookConfig())
    response = orjson.loads(outcome.body)["response"]
    assert response["allowed"], response.get("status")
    assert response.get("warnings") is None, response["warnings"]  # the examples set nothing the webhook overrides
    patch = orjson.loads(base64.b64decode(response["patch"]))
    admitted: dict[str, Any] = jsonpatch.apply_patch(pod, patch)
    admitted["metadata"]["uid"] = f"uid-{next(_uids)}"
    admitted["status"] = {"phase": "Pending"}
    return admitted


@pytest.fixture(scope="module")
def placed() -> dict[str, tuple[str, protocol.PodAssignment, dict[str, Any]]]:
    """Every example pod admitted, then scheduled in file order: pod name -> (node, assignment, admitted pod)."""
    state = ClusterState(clock=MOMENT.timestamp)
    node_objects = nodes()
    cluster = SnapshotCluster(state, node_objects)
    scheduler = Scheduler(state, cluster)
    result = {}
    for pod in example_pods():
        admitted = admit(pod)
        assert admitted["spec"]["schedulerName"] == protocol.DEFAULT_SCHEDULER_NAME
        cluster.add_pod(admitted)
        # kube-scheduler's own filters first: only nodeSelector matters on these nodes
        selector = admitted["spec"].get("nodeSelector") or {}
        candidates = [n["metadata"]["name"] for n in node_objects
                      if selector.items() <= n["metadata"]["labels"].items()]
        outcome = scheduler.filter(admitted, candidates)
        assert outcome.passed and not outcome.error, (pod["metadata"]["name"], outcome)
        scores = dict(scheduler.prioritize(admitted, outcome.passed))
        best = max(outcome.passed, key=lambda name: scores[name])
        metadata = admitted["metadata"]
        scheduler.bind(metadata["namespace"], metadata["name"], metadata["uid"], best)
        stored = cluster.pods[(metadata["namespace"], metadata["name"])]
        assignment = protocol.decode_assignment(stored["metadata"]["annotations"][protocol.POD_ASSIGNMENT_ANNOTATION])
        result[metadata["name"]] = (best, assignment, admitted)
    return result


def gpu_models(node: str) -> dict[str, str]:
    [obj] = [n for n in nodes() if n["metadata"]["name"] == node]
    inventory = protocol.decode_inventory(obj["metadata"]["annotations"][protocol.NODE_INVENTORY_ANNOTATION])
    return {gpu.uuid: gpu.model for gpu in inventory.gpus}


def test_every_example_renders_into_the_example_namespace() -> None:
    objects = render("examples")
    assert [n["metadata"]["name"] for n in find(objects, "Namespace")] == ["gpu-examples"]
    assert all(o["metadata"]["namespace"] == "gpu-examples" for o in objects if o["kind"] != "Namespace")
    assert all("schedulerName" not in p["spec"] for p in example_pods())  # the webhook routes them


def test_fractional_pods_get_their_slice_and_env(placed: dict) -> None:
    _, assignment, admitted = placed["quarter-gpu"]
    [device] = assignment.all_devices()
    assert (device.memory_mib, device.cores) == (4096, 25)
    env = {e["name"]: e["value"] for e in admitted["spec"]["containers"][0]["env"]}
    assert env["CUDA_DEVICE_MEMORY_LIMIT_0"] == "4096m" and env["CUDA_DEVICE_SM_LIMIT"] == "25"
    node, assignment, admitted = placed["half-memory"]
    [device] = assignment.all_devices()
    total = 15360 if node.startswith("t4") else 81920
    assert (device.memory_mib, device.cores) == (total // 2, 50)
    assert admitted["spec"]["containers"][0]["resources"]["limits"][protocol.RESOURCE_GPU] == "1"  # added


def test_the_shared_inference_replicas_pack_onto_one_gpu(placed: dict) -> None:
    replicas = [placed[f"shared-inference-{i}"] for i in range(4)]
    gpus = {(node, a.all_devices()[0].uuid) for node, a, _ in replicas}
    assert len(gpus) == 1
    assert all((d.memory_mib, d.cores) == (3072, 20) for _, a, _ in replicas for d in a.all_devices())


def test_multi_gpu_pods_get_distinct_whole_or_numa_local_gpus(placed: dict) -> None:
    _, assignment, _ = placed["train-4-gpus"]
    devices = assignment.all_devices()
    assert len({d.uuid for d in devices}) == 4 and all(d.cores == 100 for d in devices)
    _, assignment, _ = placed["two-halves-one-numa-node"]
    devices = assignment.all_devices()
    assert len({d.uuid for d in devices}) == 2 and all((d.memory_mib, d.cores) == (20000, 50) for d in devices)


def test_type_selected_pods_land_on_the_models_they_ask_for(placed: dict) -> None:
    for name, allowed in (("a100-or-h100", ("A100", "H100")), ("on-a100-80gb-nodes", ("A100",))):
        node, assignment, _ = placed[name]
        models = gpu_models(node)
        assert all(any(t.lower() in models[d.uuid].lower() for t in allowed) for d in assignment.all_devices())
    node, assignment, _ = placed["anything-but-t4"]
    assert not node.startswith("t4")
