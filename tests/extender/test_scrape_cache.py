"""/metrics keeps rendered text between scrapes (issue 18: per node, per pod, per node row): whatever changes in the
state shows in the next scrape, which is byte for byte what prometheus_client's generate_latest writes for the same
state and time (generate_latest reads collect(), which renders everything afresh), and what did not change is not
rendered again."""

from __future__ import annotations

import contextlib
import datetime as dt
from collections.abc import Callable
from pathlib import Path
from typing import Any

import hypothesis.strategies as st
import orjson
from hypothesis import HealthCheck, given, settings
from prometheus_client import CollectorRegistry, generate_latest

from kube_vgpu import protocol
from kube_vgpu.dev.fixtures import synth_uuid
from kube_vgpu.extender.cli import Extender, build, parse_args
from kube_vgpu.extender.exposition import render_registry
from kube_vgpu.extender.server import GpuCollector, StateViewText, state_view_bytes
from kube_vgpu.extender.usage_metrics import UsageCollector
from tests.extender.test_usage_metrics import BOUND_AT, EXAMPLES, T0, bound_pod, snapshot
from tests.helpers import assert_same_exposition, gpu_node, pod


class Clock:
    def __init__(self) -> None:
        self.now_s = T0 + 100.0

    def __call__(self) -> float:
        return self.now_s


def extender(tmp_path: Path, clock: Callable[[], float], *extra: str) -> Extender:
    args = parse_args(["--snapshot", str(snapshot(tmp_path)), "--quota-config", str(EXAMPLES / "quota.yaml"),
                       *extra])
    return build(args, clock=clock)


def scrape(registry: CollectorRegistry) -> bytes:
    """The cached render, checked against generate_latest for the same state and time."""
    rendered = b"".join(render_registry(registry))
    assert_same_exposition(rendered, generate_latest(registry))
    return rendered


def collector(built: Extender, kind: type) -> Any:
    return next(c for c in built.app.state.registry._collector_to_names if isinstance(c, kind))


def test_every_kind_of_change_shows_in_the_next_scrape(tmp_path: Path, monkeypatch: Any) -> None:
    clock = Clock()
    built = extender(tmp_path, clock)
    state, registry = built.state, built.app.state.registry
    first = scrape(registry)
    assert scrape(registry) == first  # nothing changed: the kept text is the same text

    clock.now_s += 30  # the GPU-seconds counters move with the clock alone
    text = scrape(registry)
    assert b'kube_vgpu_pod_vgpu_seconds_total{cluster_queue="ai-training-queue",namespace="research",' \
           b'pod="trainer"} 260\n' in text

    state.upsert_pod(bound_pod("new", "inference", "a100-1", [(0, 4096, 10)], queue="inference-queue"))
    text = scrape(registry)  # a pod bound
    assert b'pod="new"' in text and b'kube_vgpu_namespace_gpu_pods{namespace="inference"} 2.0' in text

    # its assignment changed (another GPU): the pod is counted again, on GPU 1
    state.upsert_pod(bound_pod("new", "inference", "a100-1", [(1, 4096, 10)], queue="inference-queue"))
    text = scrape(registry)
    assert b'gpu="1",namespace="inference",node="a100-1",pod="new"' in text
    assert b'gpu="0",namespace="inference",node="a100-1",pod="new"' not in text

    # its ClusterQueue changed (the quota gate keeps the one it charged; a reconfiguration could move it)
    rules = type(collector(built, UsageCollector)._queue_rules())
    queue_of = rules.queue_of
    monkeypatch.setattr(rules, "queue_of", lambda self, uid, *args: "moved" if uid == "uid-inference-new" else
                        queue_of(self, uid, *args))
    text = scrape(registry)
    assert b'cluster_queue="moved",gpu="1",namespace="inference",node="a100-1",pod="new"' in text
    assert b'kube_vgpu_cluster_queue_gpu_pods{cluster_queue="moved"} 1.0' in text
    monkeypatch.undo()

    # confirmed without a bind time: allocated, no longer accounted
    state.upsert_pod(bound_pod("new", "inference", "a100-1", [(1, 4096, 10)], queue="research-queue",
                               bound_at=None))
    scrape(registry)
    state.upsert_pod(bound_pod("new", "inference", "a100-1", [(1, 4096, 10)], queue="research-queue",
                               bound_at=BOUND_AT + dt.timedelta(seconds=50)))
    scrape(registry)

    state.delete_pod("uid-inference-new")  # a pod gone
    text = scrape(registry)
    assert b'pod="new"' not in text and b'kube_vgpu_namespace_gpu_pods{namespace="inference"} 1.0' in text

    state.upsert_node(gpu_node("a100-1", gpus=8))  # a node's inventory changed: its pods are counted again
    text = scrape(registry)
    assert b'kube_vgpu_gpu_memory_mib{gpu="7",model="NVIDIA-A100-SXM4-80GB",node="a100-1"' in text

    state.delete_node("a100-1")  # a node gone: its GPUs, its pods and its rows
    text = scrape(registry)
    assert b'node="a100-1"' not in text and b'pod="batch"' not in text

    state.upsert_node(gpu_node("a100-1", gpus=4))  # back (a new node object; its version starts afresh)
    text = scrape(registry)
    assert b'pod="batch"' in text and b'gpu="7",model="NVIDIA-A100-SXM4-80GB",node="a100-1"' not in text
    assert scrape(registry) == text


def test_a_pod_record_changed_in_place_shows_in_the_next_scrape(tmp_path: Path) -> None:
    """The state updates a pod's record in place when its annotation is seen again (a reservation confirmed, a
    bind time read later, labels): the node's kept text is rendered again (ClusterState.pod_marks)."""
    clock = Clock()
    built = extender(tmp_path, clock)
    registry = built.app.state.registry
    scrape(registry)
    counter = b'kube_vgpu_pod_vgpu_seconds_total{cluster_queue="",namespace="research",pod="p1"}'
    reserve = ("reserve", 1, "research", 0, [(2, 1024, 10)])
    apply(built, clock, reserve)
    text = scrape(registry)
    assert b'pod="p1"' in text and counter not in text  # counted, not accounted: not confirmed yet
    record = built.state.pods["uid-research-p1"]
    apply(built, clock, ("bind", 1, "research", 0, [(2, 1024, 10)], None, True))
    assert built.state.pods["uid-research-p1"] is record and record.confirmed  # the same record, confirmed
    assert counter + b" 100\n" in scrape(registry)

    apply(built, clock, ("bind", 2, "inference", 1, [(0, 1024, 10)], None, False))
    untimed = scrape(registry)
    assert b'pod="p2"' in untimed and b'namespace="inference",pod="p2"} ' not in untimed  # no bind time yet
    apply(built, clock, ("bind", 2, "inference", 1, [(0, 1024, 10)], None, True))
    assert b'kube_vgpu_pod_vgpu_seconds_total{cluster_queue="",namespace="inference",pod="p2"} 100\n' in \
        scrape(registry)


def test_a_learned_model_changes_the_fragmentation_rows(tmp_path: Path) -> None:
    built = extender(tmp_path, Clock(), "--policy", "fgd")
    registry = built.app.state.registry
    assert b'kube_vgpu_node_fragmented_gpus{node="a100-0",policy="fgd"} 0.0' in scrape(registry)
    built.scheduler.filter(pod(gpus=1, memory_mib=8192, cores=60), ["a100-0", "a100-1"])  # learns a 60 % task
    assert b'kube_vgpu_node_fragmented_gpus{node="a100-0",policy="fgd"} 0.75' in scrape(registry)


def test_only_what_changed_is_rendered_again(tmp_path: Path, monkeypatch: Any) -> None:
    built = extender(tmp_path, Clock())
    registry, state = built.app.state.registry, built.state
    scrape(registry)
    rendered: list[str] = []
    original = UsageCollector._pod_text_of

    def counting(record: Any, *args: Any) -> Any:
        rendered.append(record.name)
        return original(record, *args)

    monkeypatch.setattr(UsageCollector, "_pod_text_of", staticmethod(counting))
    gpus = collector(built, GpuCollector)
    kept = dict(gpus._text)
    b"".join(render_registry(registry))
    assert rendered == [] and gpus._text == kept and all(gpus._text[n] is kept[n] for n in kept)
    state.upsert_pod(bound_pod("new", "inference", "a100-1", [(0, 4096, 10)], queue="inference-queue"))
    b"".join(render_registry(registry))
    assert rendered == ["new"]  # one pod's text, and one node's
    assert gpus._text["a100-0"] is kept["a100-0"] and gpus._text["a100-1"] is not kept["a100-1"]


def test_per_pod_gpu_gauges_off_with_kept_text(tmp_path: Path) -> None:
    clock = Clock()
    built = extender(tmp_path, clock, "--metrics-per-pod-gpu", "off")
    registry = built.app.state.registry
    scrape(registry)
    built.state.delete_pod("uid-research-trainer")
    clock.now_s += 1
    assert b"kube_vgpu_pod_gpu_memory_allocated_mib{" not in scrape(registry)


_QUEUES = ["research-queue", "inference-queue", "production-queue", None]
_NAMESPACES = ["research", "inference", "production"]

change = st.one_of(
    st.tuples(st.just("bind"), st.integers(0, 5), st.sampled_from(_NAMESPACES), st.integers(0, 2),
              st.lists(st.tuples(st.integers(0, 3), st.sampled_from([1024, 8192, 40960]),
                                 st.sampled_from([10, 25, 100])), min_size=1, max_size=3, unique_by=lambda s: s[0]),
              st.sampled_from(_QUEUES), st.booleans()),
    st.tuples(st.just("delete-pod"), st.integers(0, 5), st.sampled_from(_NAMESPACES)),
    # a bind's reservation, counted before its annotation is seen (a later "bind" of the same shares confirms it)
    st.tuples(st.just("reserve"), st.integers(0, 5), st.sampled_from(_NAMESPACES), st.integers(0, 2),
              st.lists(st.tuples(st.integers(0, 3), st.sampled_from([1024, 8192, 40960]),
                                 st.sampled_from([10, 25, 100])), min_size=1, max_size=3, unique_by=lambda s: s[0])),
    st.tuples(st.just("node"), st.integers(0, 2), st.integers(0, 8)),
    st.tuples(st.just("delete-node"), st.integers(0, 2)),
    st.tuples(st.just("clock"), st.floats(0, 1e6, allow_nan=False)),
    st.tuples(st.just("learn"), st.sampled_from([10, 60, 100])),
)


def apply(built: Extender, clock: Clock, step: tuple[Any, ...]) -> None:
    state = built.state
    kind = step[0]
    if kind == "bind":
        _, number, namespace, node, shares, queue, timed = step
        state.upsert_pod(bound_pod(f"p{number}", namespace, f"a100-{node}", list(shares), queue=queue,
                                   bound_at=BOUND_AT if timed else None))
    elif kind == "reserve":
        _, number, namespace, node, shares = step
        devices = tuple(protocol.DeviceShare(synth_uuid(f"a100-{node}", index), memory, cores)
                        for index, memory, cores in shares)
        assignment = protocol.PodAssignment(f"a100-{node}", (protocol.ContainerAssignment("main", devices),))
        with contextlib.suppress(ValueError):  # already bound: a reservation never replaces it
            state.reserve(f"uid-{namespace}-p{number}", namespace, f"p{number}", assignment)
    elif kind == "delete-pod":
        state.delete_pod(f"uid-{step[2]}-p{step[1]}")
    elif kind == "node":
        state.upsert_node(gpu_node(f"a100-{step[1]}", gpus=step[2]))
    elif kind == "delete-node":
        state.delete_node(f"a100-{step[1]}")
    elif kind == "clock":
        clock.now_s = T0 + step[1]
    else:
        built.scheduler.filter(pod(gpus=1, memory_mib=8192, cores=step[1]), list(state.nodes))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=st.lists(change, max_size=12), policy=st.sampled_from(["fgd", "bfgd", "binpack"]))
def test_any_sequence_of_changes_renders_what_generate_latest_writes(tmp_path: Path, steps: list[tuple[Any, ...]],
                                                                       policy: str) -> None:
    clock = Clock()
    built = extender(tmp_path, clock, "--policy", policy)
    registry = built.app.state.registry
    scrape(registry)
    for step in steps:
        apply(built, clock, step)
        scrape(registry)


def test_state_view_keeps_json_and_writes_the_same_bytes(tmp_path: Path) -> None:
    """GET /state from kept JSON is byte for byte state_view_bytes (everything encoded afresh), change after
    change; the heartbeat ages move with the clock alone."""
    clock = Clock()
    built = extender(tmp_path, clock)
    state, scheduler = built.state, built.scheduler
    text = StateViewText(scheduler)

    def same() -> dict[str, Any]:
        body = b"".join(text.render())
        assert body == b"".join(state_view_bytes(scheduler))
        return dict(orjson.loads(body))

    same()
    state.upsert_node(gpu_node("a100-0", heartbeat=dt.datetime.fromtimestamp(clock.now_s - 5, dt.UTC)))
    assert same()["nodes"][0]["heartbeatAgeSeconds"] == 5.0
    clock.now_s += 2.5
    assert same()["nodes"][0]["heartbeatAgeSeconds"] == 7.5
    state.upsert_pod(bound_pod("new", "inference", "a100-1", [(0, 4096, 10)], queue="inference-queue"))
    assert "inference/new" in {a["pod"] for a in same()["assignments"]}
    state.mark_bound("uid-inference-new", "a100-1")
    state.upsert_pod(bound_pod("new", "inference", "a100-1", [(2, 4096, 10)], queue="inference-queue"))
    same()
    state.delete_pod("uid-inference-new")
    state.upsert_node(gpu_node("a100-1", gpus=2))
    same()
    state.delete_node("a100-1")
    assert [n["name"] for n in same()["nodes"]] == ["a100-0"]
    state.upsert_node({"metadata": {"name": "a100-1", "annotations": {protocol.NODE_INVENTORY_ANNOTATION: "not json"}}})
    same()
