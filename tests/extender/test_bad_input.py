"""Bad input to kube-scheduler's verbs over real HTTP: a wrong-typed field, an absurd quantity or an oversized body
is answered with an Error naming the problem (400 / 413, or the verb's own Error field), never a 500, and the
service keeps serving (issue 20, item 10)."""

from __future__ import annotations

import copy
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from kube_vgpu import protocol
from kube_vgpu.extender.cli import Extender, build, parse_args
from kube_vgpu.extender.scheduler import FilterOutcome
from kube_vgpu.extender.server import MAX_BODY_BYTES
from tests.helpers import gpu_node, pod
from tests.quota.helpers import A100, FLAVORS, local_queue
from tests.servers import serve

NAMES = ["a100-0", "a100-1"]


COVERING_QUEUE = """
---
apiVersion: kueue.x-k8s.io/v1beta1
kind: ClusterQueue
metadata: {name: team-a}
spec:
  namespaceSelector: {}
  resourceGroups:
  - coveredResources: [nvidia.com/gpu, nvidia.com/gpumem, nvidia.com/gpucores]
    flavors:
    - name: a100
      resources:
      - {name: nvidia.com/gpu, nominalQuota: 8}
      - {name: nvidia.com/gpumem, nominalQuota: 655360}
      - {name: nvidia.com/gpucores, nominalQuota: 800}
"""


@pytest.fixture()
def extender(tmp_path: Path) -> Extender:
    """The extender as deployed with a quota gate, which reads more of the pod (labels, owners, priority)."""
    snapshot = tmp_path / "snapshot.json"
    nodes = [gpu_node(name, model=A100) for name in NAMES]
    snapshot.write_bytes(orjson.dumps({"apiVersion": "v1", "kind": "List", "items": nodes}))
    quota = tmp_path / "quota.yaml"
    # the queue covers every GPU resource the pods ask for (Kueue's BlockUndeclared refuses the others)
    quota.write_text(FLAVORS + COVERING_QUEUE + local_queue("default", "q", "team-a"))
    args = parse_args([f"--snapshot={snapshot}", "--policy=binpack", "--gpu-policy=topology",
                       f"--quota-config={quota}"])
    return build(args)


@pytest.fixture()
def client(extender: Extender) -> Iterator[httpx.Client]:
    with serve(extender.app) as url, httpx.Client(base_url=url, timeout=30) as http:
        yield http


def queued_gpu_pod() -> dict[str, Any]:
    sent = pod(memory_mib=2000, cores=20, labels={"kueue.x-k8s.io/queue-name": "q"},
               annotations={protocol.ANNOTATION_USE_GPU_TYPE: "A100"})
    sent["metadata"]["ownerReferences"] = [{"apiVersion": "batch/v1", "kind": "Job", "name": "j", "uid": "u-1",
                                            "controller": True}]
    return sent


def _set(obj: dict[str, Any], path: tuple[str | int, ...], value: Any) -> dict[str, Any]:
    changed = copy.deepcopy(obj)
    target: Any = changed
    for part in path[:-1]:
        target = target[part]
    target[path[-1]] = value
    return changed


# (path in the pod, wrong value, the field the message names)
WRONG_TYPES = [
    (("metadata",), [], "ExtenderArgs.Pod.metadata must be an object, got a list"),
    (("metadata", "uid"), ["a", "b"], "ExtenderArgs.Pod.metadata.uid must be a string, got a list"),
    (("metadata", "name"), {"a": 1}, "ExtenderArgs.Pod.metadata.name must be a string, got an object"),
    (("metadata", "labels"), "q", "ExtenderArgs.Pod.metadata.labels must be an object, got a string"),
    (("metadata", "labels", "kueue.x-k8s.io/queue-name"), ["q"],
     "ExtenderArgs.Pod.metadata.labels['kueue.x-k8s.io/queue-name'] must be a string, got a list"),
    (("metadata", "annotations"), [1], "ExtenderArgs.Pod.metadata.annotations must be an object, got a list"),
    (("metadata", "annotations", protocol.ANNOTATION_USE_GPU_TYPE), {"x": 1},
     f"ExtenderArgs.Pod.metadata.annotations['{protocol.ANNOTATION_USE_GPU_TYPE}'] must be a string, got an object"),
    (("metadata", "ownerReferences"), {"kind": "Job"},
     "ExtenderArgs.Pod.metadata.ownerReferences must be a list, got an object"),
    (("spec",), "x", "ExtenderArgs.Pod.spec must be an object, got a string"),
    (("spec", "containers"), 7, "ExtenderArgs.Pod.spec.containers must be a list, got a number"),
    (("spec", "containers", 0), None, "ExtenderArgs.Pod.spec.containers[0] must be an object, got null"),
    (("spec", "containers", 0, "resources"), [], "ExtenderArgs.Pod.spec.containers[0].resources must be an object, "
     "got a list"),
    (("spec", "containers", 0, "resources", "limits"), "2", "ExtenderArgs.Pod.spec.containers[0].resources.limits "
     "must be an object, got a string"),
    (("spec", "containers", 0, "resources", "limits", protocol.RESOURCE_GPU_MEMORY), True,
     "ExtenderArgs.Pod.spec.containers[0].resources.limits['nvidia.com/gpumem'] must be a quantity (a string or a "
     "number), got a boolean"),
    (("spec", "priority"), "high", "ExtenderArgs.Pod.spec.priority must be an integer, got a string"),
]


@pytest.mark.parametrize("verb", ["filter", "prioritize"])
@pytest.mark.parametrize(
    ("path", "value", "message"), WRONG_TYPES, ids=[".".join(map(str, p)) for p, _, _ in WRONG_TYPES]
)
def test_a_wrong_typed_pod_field_is_a_400_naming_it(
    client: httpx.Client, verb: str, path: tuple[str | int, ...], value: Any, message: str
) -> None:
    bad = _set(queued_gpu_pod(), path, value)
    reply = client.post(f"/{verb}", json={"Pod": bad, "NodeNames": NAMES})
    assert reply.status_code == 400
    assert reply.headers["content-type"] == "application/json"
    assert reply.json() == {"Error": message}
    good = client.post(f"/{verb}", json={"Pod": queued_gpu_pod(), "NodeNames": NAMES})
    assert good.status_code == 200


def test_the_full_nodes_form_checks_the_pod_and_the_node_names(client: httpx.Client) -> None:
    nodes = [gpu_node(name, model=A100) for name in NAMES]
    reply = client.post("/filter", json={"Pod": _set(queued_gpu_pod(), ("spec",), []), "Nodes": {"items": nodes}})
    assert (reply.status_code, reply.json()) == (400, {"Error": "ExtenderArgs.Pod.spec must be an object, got a list"})
    for index, name in enumerate((7, None, ["a100-0"])):
        renamed = copy.deepcopy(nodes)
        renamed[1]["metadata"]["name"] = name
        reply = client.post("/filter", json={"Pod": queued_gpu_pod(), "Nodes": {"items": renamed}})
        # a number once came back as plain-text "Internal Server Error": the reply did not encode
        assert reply.status_code == 400, index
        assert reply.json() == {"Error": "ExtenderArgs.Nodes.items[1].metadata.name must be a string"}
    reply = client.post("/filter", json={"Pod": queued_gpu_pod(), "Nodes": {"items": nodes}})
    assert reply.status_code == 200 and [n["metadata"]["name"] for n in reply.json()["Nodes"]["items"]] == NAMES


@pytest.mark.parametrize("resource", [protocol.RESOURCE_GPU, protocol.RESOURCE_GPU_MEMORY, protocol.RESOURCE_GPU_CORES])
def test_a_5000_digit_quantity_is_an_invalid_request_not_a_crash(client: httpx.Client, resource: str) -> None:
    bad = _set(queued_gpu_pod(), ("spec", "containers", 0, "resources", "limits", resource), "1" * 5000)
    reply = client.post("/filter", json={"Pod": bad, "NodeNames": NAMES})
    assert reply.status_code == 200
    assert reply.json()["Error"] == (
        f"invalid GPU request: container main: {resource} must be a non-negative whole number, "
        f"got {'1' * 80!r}... (5000 characters)"
    )
    assert reply.json()["NodeNames"] == []
    assert client.post("/prioritize", json={"Pod": bad, "NodeNames": NAMES}).json() == []


def test_gpumem_in_bytes_units_is_an_invalid_request(client: httpx.Client) -> None:
    bad = _set(queued_gpu_pod(), ("spec", "containers", 0, "resources", "limits", protocol.RESOURCE_GPU_MEMORY), "8Gi")
    reply = client.post("/filter", json={"Pod": bad, "NodeNames": NAMES}).json()
    assert reply["Error"] == (
        "invalid GPU request: container main: nvidia.com/gpumem counts MiB, so it takes no Ki/Mi/Gi/Ti/Pi/Ei unit, "
        "got '8Gi'; for 8Gi write 8192"
    )


@pytest.mark.parametrize(
    "body",
    [{"PodName": ["p"], "PodNamespace": "default", "PodUID": "u", "Node": "a100-0"},
     {"PodName": "p", "PodNamespace": 7, "PodUID": "u", "Node": "a100-0"},
     {"PodName": "p", "PodNamespace": "default", "PodUID": {"u": 1}, "Node": None}],
)
def test_bind_with_wrong_typed_fields_is_a_400(client: httpx.Client, body: dict[str, Any]) -> None:
    reply = client.post("/bind", json=body)
    assert reply.status_code == 400
    assert reply.json()["Error"].startswith("ExtenderBindingArgs is missing ")


def _raw_post(client: httpx.Client, head: bytes, body: bytes) -> bytes:
    """A request over a raw socket (HTTP clients refuse a Content-Length they cannot back with data); the reply."""
    host, port = str(client.base_url.host), int(client.base_url.port or 80)
    with socket.create_connection((host, port), timeout=30) as sock:
        sock.sendall(head + body)
        reply = b""
        while not reply.rstrip().endswith(b"}") and not reply.rstrip().endswith(b"]"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            reply += chunk
    return reply


def test_body_size_limit_on_both_sides(client: httpx.Client) -> None:
    document = orjson.dumps({"Pod": queued_gpu_pod(), "NodeNames": NAMES})
    at_limit = document + b" " * (MAX_BODY_BYTES - len(document))  # trailing whitespace is still valid JSON
    head = f"POST /prioritize HTTP/1.1\r\nHost: x\r\nContent-Length: {MAX_BODY_BYTES}\r\n\r\n".encode()
    assert _raw_post(client, head, at_limit).startswith(b"HTTP/1.1 200")
    head = f"POST /prioritize HTTP/1.1\r\nHost: x\r\nContent-Length: {MAX_BODY_BYTES + 1}\r\n\r\n".encode()
    assert _raw_post(client, head, b"{").startswith(b"HTTP/1.1 413")
    # chunked: no declared length, refused once the body read passes the limit
    over = at_limit + b" "
    chunked = b"".join(f"{len(part):x}\r\n".encode() + part + b"\r\n"
                       for part in (over[i:i + (1 << 20)] for i in range(0, len(over), 1 << 20))) + b"0\r\n\r\n"
    head = b"POST /prioritize HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
    reply = _raw_post(client, head, chunked)
    assert reply.startswith(b"HTTP/1.1 413") and b"too large" in reply
    assert client.get("/healthz").status_code == 200


def test_a_reply_that_does_not_encode_is_a_json_error_not_plain_text(
    client: httpx.Client, extender: Extender, monkeypatch: pytest.MonkeyPatch
) -> None:
    def unencodable(*_: Any) -> FilterOutcome:
        outcome = FilterOutcome()
        outcome.failed = {7: "not a string key"}  # type: ignore[dict-item]
        return outcome

    monkeypatch.setattr(extender.scheduler, "filter", unencodable)
    reply = client.post("/filter", json={"Pod": queued_gpu_pod(), "NodeNames": NAMES})
    assert reply.status_code == 500
    assert reply.headers["content-type"] == "application/json"
    assert "internal error in filter" in reply.json()["Error"]
