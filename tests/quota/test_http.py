"""GET /quota, the gauges and `kube-vgpu quota status` over real HTTP, on the example manifests (issue 6 item 5)."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from kube_vgpu.cli import main as kube_vgpu_main
from kube_vgpu.extender.cli import Extender, build, parse_args
from kube_vgpu.extender.quota import cli as quota_cli
from tests.quota.helpers import a100_node, queued_pod, v100_node
from tests.servers import serve

EXAMPLES = Path(__file__).resolve().parents[2] / "manifests" / "examples" / "kueue"
NAMES = ["a100-0", "a100-1", "v100-0"]


def make_extender(tmp_path: Path, quota_config: str | None) -> Extender:
    snapshot = tmp_path / "snapshot.json"
    nodes = [a100_node("a100-0"), a100_node("a100-1"), v100_node("v100-0")]
    snapshot.write_bytes(orjson.dumps({"apiVersion": "v1", "kind": "List", "items": nodes}))
    args = parse_args(["--snapshot", str(snapshot), "--policy", "binpack", "--gpu-policy", "topology",
                       *(["--quota-config", quota_config] if quota_config else [])])
    return build(args)


@pytest.fixture(params=["quota.yaml", "quota-v1beta2.yaml"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    extender = make_extender(tmp_path, str(EXAMPLES / request.param))
    with serve(extender.app) as base:
        yield base


def training_pod(namespace: str, **kwargs: Any) -> dict[str, Any]:
    queue = {"research": "research-queue", "production": "production-queue"}[namespace]
    return queued_pod(queue, namespace=namespace, **kwargs)


def schedule(http: httpx.Client, pod: dict[str, Any], names: list[str]) -> dict[str, Any]:
    reply: dict[str, Any] = http.post("/filter", json={"Pod": pod, "NodeNames": names, "Nodes": None}).json()
    if reply["NodeNames"]:
        meta = pod["metadata"]
        bound = http.post("/bind", json={"PodName": meta["name"], "PodNamespace": meta["namespace"],
                                         "PodUID": meta["uid"], "Node": reply["NodeNames"][0]}).json()
        assert bound == {"Error": ""}
    return reply


def test_quota_view_metrics_and_status_table(url: str, capsys: pytest.CaptureFixture[str]) -> None:
    with httpx.Client(base_url=url, timeout=10) as http:
        big = {"gpus": 4, "memory_mib": 40960, "cores": 50}  # 4 vGPUs, 163840 MiB, 200 cores
        assert schedule(http, training_pod("research", **big), NAMES)["NodeNames"] == ["a100-0", "a100-1"]
        assert schedule(http, training_pod("production", **big), NAMES)["NodeNames"]
        # 8 of 8 A100 vGPUs used: the next 4 are borrowed from the inference queue (borrowingLimit 4)
        assert schedule(http, training_pod("research", **big), NAMES)["NodeNames"]
        small = training_pod("research", gpus=1, memory_mib=1000, cores=10, priority_class="normal")
        reply = schedule(http, small, ["a100-0", "a100-1"])
        assert reply["NodeNames"] == []
        assert reply["FailedNodes"]["a100-0"].startswith("no GPU with 1000 MiB free")  # GPUs full
        reason = reply["FailedNodes"]["a100-1"]  # GPUs to spare, quota none
        assert reason.startswith("quota: ClusterQueue ai-training-queue (LocalQueue research/research-queue): "
                                 "flavor a100, nvidia.com/gpu: needs 1, used 12/12 vGPUs (nominal 8, borrowing "
                                 "limit 4), 0 available now")

        quota = http.get("/quota").json()
        assert quota["errors"] == [] and quota["synced"] is True
        queues = {q["name"]: q for q in quota["clusterQueues"]}
        training, inference = queues["ai-training-queue"], queues["inference-queue"]
        a100 = {r["resource"]: r for r in training["flavors"][0]["resources"]}
        assert training["flavors"][0]["flavor"] == "a100"
        assert {k: a100["nvidia.com/gpu"][k] for k in ("nominal", "borrowingLimit", "used", "borrowed", "lent",
                                                       "available", "limit")} == {
            "nominal": 8, "borrowingLimit": 4, "used": 12, "borrowed": 4, "lent": 0, "available": 0, "limit": 12}
        assert a100["nvidia.com/gpumem"]["used"] == 3 * 163840
        assert a100["nvidia.com/gpucores"]["used"] == 600
        assert (training["admittedPods"], training["pendingPods"], training["waitingForQuota"]) == (3, 1, 1)
        assert training["pending"][0]["priority"] == 100  # the "normal" WorkloadPriorityClass
        lender = {r["resource"]: r for r in inference["flavors"][0]["resources"]}["nvidia.com/gpu"]
        assert (lender["used"], lender["lent"], lender["lendingLimit"], lender["available"]) == (0, 4, 4, 4)

        metrics = http.get("/metrics").text
        assert ('kube_vgpu_quota_used{cluster_queue="ai-training-queue",flavor="a100",resource="nvidia.com/gpu"} '
                "12.0") in metrics
        assert 'kube_vgpu_quota_lent{cluster_queue="inference-queue",flavor="a100",resource="nvidia.com/gpu"} 4.0' \
            in metrics
        assert 'kube_vgpu_quota_waiting_pods{cluster_queue="ai-training-queue"} 1.0' in metrics
        assert 'kube_vgpu_extender_rejections_total{reason="quota"}' in metrics

    assert kube_vgpu_main(["quota", "status", "--extender-url", url]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split() == ["CLUSTERQUEUE", "FLAVOR", "RESOURCE", "NOMINAL", "BORROWED", "LENT", "USED",
                                "LIMIT", "AVAILABLE", "PENDING"]
    assert table[1].split() == ["ai-training-queue", "a100", "nvidia.com/gpu", "(vGPUs)", "8", "4", "0", "12", "12",
                                "0", "1"]
    assert "ClusterQueue ai-training-queue: 1 pod(s) waiting for quota" in table


def test_status_as_json(url: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert kube_vgpu_main(["quota", "status", "--extender-url", url, "-o", "json"]) == 0
    doc = orjson.loads(capsys.readouterr().out)
    assert [q["name"] for q in doc["clusterQueues"]] == ["ai-training-queue", "inference-queue"]


def test_without_a_quota_gate(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    extender = make_extender(tmp_path, None)
    with serve(extender.app) as base:
        with httpx.Client(base_url=base, timeout=10) as http:
            assert http.get("/quota").status_code == 404
        assert kube_vgpu_main(["quota", "status", "--extender-url", base]) == 1
    assert "answered 404" in capsys.readouterr().err


def test_unreachable_extender(capsys: pytest.CaptureFixture[str]) -> None:
    from tests.servers import free_port

    args = argparse.Namespace(extender_url=f"http://127.0.0.1:{free_port()}", output="table", timeout_seconds=5.0)
    assert quota_cli.run(args) == 1
    assert "cannot read" in capsys.readouterr().err


def test_invalid_objects_are_shown(tmp_path: Path) -> None:
    broken = tmp_path / "quota.yaml"
    broken.write_text((EXAMPLES / "quota.yaml").read_text().replace("nominalQuota: 16", "nominalQuota: sixteen"))
    extender = make_extender(tmp_path, str(broken))
    with serve(extender.app) as base, httpx.Client(base_url=base, timeout=10) as http:
        doc = http.get("/quota").json()
    assert [q["name"] for q in doc["clusterQueues"]] == ["inference-queue"]
    [error] = doc["errors"]
    assert "ClusterQueue ai-training-queue: spec.resourceGroups[0].flavors[1].resources[0].nominalQuota" in error
    assert "invalid (left out): " in quota_cli.render(doc)


def test_unreadable_quota_file_stops_start_up(tmp_path: Path) -> None:
    broken = tmp_path / "quota.yaml"
    broken.write_text("kind: [unclosed\n")
    with pytest.raises(ValueError, match="not valid YAML"):
        make_extender(tmp_path, str(broken))


def test_a_waiting_gang_in_quota_and_in_the_status_table(url: str, capsys: pytest.CaptureFixture[str]) -> None:
    gang = []
    for index in range(3):  # 3 x 4 whole A100s: the queue's MiB (6 A100s, borrowing included) hold one member
        member = training_pod("research", gpus=4, memory_mib=81920, cores=50, name=f"train-7-{index}")
        member["metadata"]["labels"]["kueue.x-k8s.io/pod-group-name"] = "train-7"
        member["metadata"]["annotations"]["kueue.x-k8s.io/pod-group-total-count"] = "3"
        member["metadata"]["creationTimestamp"] = f"2026-11-24T10:00:0{index}Z"
        gang.append(member)
    with httpx.Client(base_url=url, timeout=10) as http:
        replies = [http.post("/filter", json={"Pod": p, "NodeNames": NAMES, "Nodes": None}).json() for p in gang]
        reason = replies[-1]["FailedNodes"]["a100-0"]
        quota = http.get("/quota").json()
    assert reason == (
        "gang research/train-7: 1 of 3 members fit; waiting for a node for member train-7-1 (4 x 81920 MiB, gpucores "
        "50): none of 3 node(s) fits it: 2 whose GPUs cannot take it (e.g. v100-0: needs 81920 MiB per GPU, largest "
        "GPU here has 32768 MiB); 1 refused by quota (e.g. a100-1: quota: ClusterQueue ai-training-queue (LocalQueue "
        "research/research-queue): flavor a100, nvidia.com/gpumem: needs 327680, used 327680/491520 MiB (nominal "
        "327680, borrowing limit 163840), 163840 available now); the 1 member(s) planned before it count as using "
        "their GPUs and quota")
    queues = {q["name"]: q for q in quota["clusterQueues"]}
    [entry] = queues["ai-training-queue"]["gangs"]
    assert {k: entry[k] for k in ("name", "size", "membersSeen", "bound", "planned", "waiting")} == {
        "name": "research/train-7", "size": 3, "membersSeen": 3, "bound": 0, "planned": 0, "waiting": reason}
    asked = {r["resource"]: r["amount"] for r in entry["quota"]["resources"]}
    assert asked == {"nvidia.com/gpu": 12, "nvidia.com/gpumem": 12 * 81920, "nvidia.com/gpucores": 12 * 50}
    assert entry["quota"]["dependsOnNode"] == []
    assert queues["inference-queue"]["gangs"] == [] and quota["unqueuedGangs"] == []

    assert kube_vgpu_main(["quota", "status", "--extender-url", url]) == 0
    out = capsys.readouterr().out.splitlines()
    start = out.index("Gangs in ClusterQueue ai-training-queue:")
    assert out[start + 1].split() == ["GANG", "SIZE", "SEEN", "BOUND", "PLANNED", "WAITING"]
    assert out[start + 2].split()[:5] == ["research/train-7", "3", "3", "0", "0"]
    assert out[start + 2].endswith(reason)
    assert not any(line.startswith("Gangs in ClusterQueue inference-queue") for line in out)


def test_the_status_table_has_no_gang_lines_without_gangs(url: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert kube_vgpu_main(["quota", "status", "--extender-url", url]) == 0
    assert "Gangs" not in capsys.readouterr().out


def test_gangs_in_no_queue_get_their_own_table() -> None:
    doc = {"clusterQueues": [], "unqueuedGangs": [
        {"name": "default/loose", "size": 2, "membersSeen": 1, "bound": 0, "planned": 0,
         "waiting": "gang default/loose: 1 of 2 members created; waiting for 1 more pod(s)"},
        {"name": "default/done", "size": 1, "membersSeen": 1, "bound": 1, "planned": 0, "waiting": ""},
    ]}
    lines = quota_cli.render(doc).splitlines()
    start = lines.index("Gangs in no ClusterQueue:")
    assert lines[start + 1:start + 4] == [
        "GANG           SIZE  SEEN  BOUND  PLANNED  WAITING",
        "default/loose     2     1      0        0  gang default/loose: 1 of 2 members created; waiting for 1 more "
        "pod(s)",
        "default/done      1     1      1        0  -",
    ]
