"""Issue 20 item 7: a GPU pod that skipped the webhook (opted-out namespace, kube-system, the webhook removed in an
emergency) has no limiter wiring; the extender refuses to place or bind it when the admission mark is required,
which `kube-vgpu extender` does in live mode by default."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from kube_vgpu import protocol
from kube_vgpu.extender.binding import BindError
from kube_vgpu.extender.cli import admission_mark_required, build, parse_args
from kube_vgpu.extender.scheduler import NOT_ADMITTED, Scheduler
from kube_vgpu.extender.sources.snapshot import SnapshotCluster
from kube_vgpu.extender.state import ClusterState
from tests.helpers import gpu_node, pod

NODES = ["gpu-0", "gpu-1"]


def _scheduler(*, require: bool) -> tuple[Scheduler, SnapshotCluster]:
    state = ClusterState()
    cluster = SnapshotCluster(state, [gpu_node(name) for name in NODES])
    return Scheduler(state, cluster, require_admission_mark=require), cluster


def _marked(p: dict[str, Any], value: str = protocol.ADMISSION_MARK_VALUE) -> dict[str, Any]:
    p["metadata"].setdefault("annotations", {})[protocol.POD_ADMITTED_ANNOTATION] = value
    return p


@pytest.mark.parametrize("mark", [None, "", "v2", "true"], ids=["absent", "empty", "other-version", "forged-text"])
def test_a_gpu_pod_without_the_mark_is_neither_placed_nor_bound(mark: str | None) -> None:
    scheduler, cluster = _scheduler(require=True)
    p = pod(gpus=1, memory_mib=1024)
    if mark is not None:
        _marked(p, mark)
    cluster.add_pod(p)
    outcome = scheduler.filter(p, NODES)
    assert (outcome.passed, outcome.error) == ([], NOT_ADMITTED)
    meta = p["metadata"]
    with pytest.raises(BindError, match="not admitted by kube-vgpu's webhook"):
        scheduler.bind(meta["namespace"], meta["name"], meta["uid"], "gpu-0")
    assert scheduler.state.pods == {}  # nothing reserved


def test_a_marked_pod_is_placed_and_bound() -> None:
    scheduler, cluster = _scheduler(require=True)
    p = _marked(pod(gpus=1, memory_mib=1024))
    cluster.add_pod(p)
    assert scheduler.filter(p, NODES).passed == NODES
    meta = p["metadata"]
    scheduler.bind(meta["namespace"], meta["name"], meta["uid"], "gpu-0")
    assert scheduler.state.pods[meta["uid"]].node_name == "gpu-0"


def test_the_message_says_why_and_what_to_do() -> None:
    assert "kube-vgpu.io/admitted" in NOT_ADMITTED and "kube-vgpu.io/webhook=disabled" in NOT_ADMITTED
    assert NOT_ADMITTED.endswith("recreate it in a namespace the webhook serves")


def test_not_required_places_unmarked_pods() -> None:
    scheduler, cluster = _scheduler(require=False)
    p = pod(gpus=1, memory_mib=1024)
    cluster.add_pod(p)
    assert scheduler.filter(p, NODES).passed == NODES


@pytest.mark.parametrize(
    ("words", "required"),
    [([], False), (["--require-admission-mark"], True), (["--no-require-admission-mark"], False)],
)
def test_snapshot_mode_defaults_to_not_requiring_it(tmp_path: Path, words: list[str], required: bool) -> None:
    snapshot = tmp_path / "snapshot.json"
    snapshot.write_bytes(orjson.dumps({"apiVersion": "v1", "kind": "List", "items": [gpu_node("gpu-0")]}))
    extender = build(parse_args([f"--snapshot={snapshot}", *words]))
    assert extender.scheduler.require_admission_mark is required


@pytest.mark.parametrize(
    ("words", "required"),
    [([], True), (["--kubeconfig=/x"], True), (["--kubeconfig=/x", "--no-require-admission-mark"], False)],
)
def test_live_mode_requires_it_by_default(words: list[str], required: bool) -> None:
    assert admission_mark_required(parse_args(words)) is required
