"""/metrics rendered straight to text (the same bytes as prometheus_client's generate_latest), pausing for the
verbs, shared between concurrent requests and never stale; /state encoded a chunk at a time (issue 18)."""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import orjson
from prometheus_client import generate_latest
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from kube_vgpu.extender.cli import Extender, build, parse_args
from kube_vgpu.extender.exposition import (
    BytesOut,
    Family,
    FamilyGroup,
    SharedRender,
    VerbActivity,
    escape_value,
    render_registry,
    render_settings,
)
from kube_vgpu.extender.gangs import gangs_view
from kube_vgpu.extender.server import state_view_bytes
from kube_vgpu.probes import serve_probes
from tests.extender.test_usage_metrics import EXAMPLES, T0, snapshot
from tests.helpers import assert_same_exposition


def extender(tmp_path: Path, *extra: str) -> Extender:
    args = parse_args(["--snapshot", str(snapshot(tmp_path)), "--quota-config", str(EXAMPLES / "quota.yaml"), *extra])
    return build(args, clock=lambda: T0 + 100)


def test_the_text_is_what_generate_latest_writes(tmp_path: Path) -> None:
    registry = extender(tmp_path).app.state.registry
    rendered = b"".join(render_registry(registry))
    assert_same_exposition(rendered, generate_latest(registry))
    # every family is there: per GPU, per pod and GPU, per node / namespace / queue, the counters, the verbs'
    for name in (b"kube_vgpu_gpu_memory_allocated_mib{", b"kube_vgpu_pod_vgpus_allocated{",
                 b"kube_vgpu_namespace_gpu_pods{", b"kube_vgpu_pod_vgpu_seconds_total{",
                 b"# TYPE kube_vgpu_extender_request_seconds histogram"):
        assert name in rendered


def test_label_values_are_escaped_as_prometheus_client_does() -> None:
    values = ["plain", 'quote"d', "back\\slash", "new\nline", 'all\\"\n']
    assert escape_value("plain") == "plain" and escape_value('a"\\\n') == 'a\\"\\\\\\n'
    group = FamilyGroup([Family("x", "gauge", "help with \\ and\nnewline"), Family("y", "counter", "c")],
                        ["b", "a"], [((value, "w"), (number, None if number % 2 else number * 1e9))
                                     for number, value in enumerate(values)])
    out = BytesOut()
    group.render(out, lambda: None, {})

    class One(Collector):
        def collect(self) -> Iterator[Metric]:
            return group.metrics()

    assert b"".join(out.pieces) == generate_latest(One())


def test_per_pod_gpu_gauges_off_keeps_the_counters_and_aggregates(tmp_path: Path) -> None:
    registry = extender(tmp_path, "--metrics-per-pod-gpu", "off").app.state.registry
    text = b"".join(render_registry(registry))
    assert b"kube_vgpu_pod_gpu_memory_allocated_mib{" not in text
    assert b"kube_vgpu_pod_vgpu_seconds_total{" in text  # accounting survives restarts from these: always on
    assert b"kube_vgpu_namespace_vgpus_allocated{" in text
    assert b"kube_vgpu_cluster_queue_gpu_memory_allocated_mib{" in text
    assert_same_exposition(text, generate_latest(registry))


def test_each_request_renders_the_current_state(tmp_path: Path) -> None:
    built = extender(tmp_path)
    app, state = built.app, built.state
    before = b"".join(app.metrics_render.get())
    state_before = orjson.loads(b"".join(app.state_render.get()))
    uid = next(uid for uid, record in state.pods.items() if record.name == "batch")
    state.release(uid)
    after = b"".join(app.metrics_render.get())
    assert before != after and b'pod="batch"' in before and b'pod="batch"' not in after
    state_after = orjson.loads(b"".join(app.state_render.get()))
    assert {a["pod"] for a in state_before["assignments"]} - {a["pod"] for a in state_after["assignments"]} == {
        "production/batch"}
    assert app.metrics_render.renders == 2


def test_state_body_is_the_snapshot_with_gangs_and_nominations(tmp_path: Path) -> None:
    built = extender(tmp_path)
    scheduler = built.scheduler
    pauses: list[int] = []
    body = orjson.loads(b"".join(state_view_bytes(scheduler, lambda: pauses.append(1))))
    expected = orjson.loads(orjson.dumps({**scheduler.state.snapshot(), "gangs": gangs_view(scheduler.gangs),
                                          "nominations": scheduler.nominations.view()}))
    assert body == expected and body["nodes"] and body["assignments"]
    assert pauses  # it paused between chunks


def test_requests_during_a_render_share_it() -> None:
    started, release = threading.Event(), threading.Event()
    calls = []

    def render() -> list[bytes]:
        calls.append(1)
        started.set()
        release.wait(5)
        return [b"body"]

    shared = SharedRender(render)
    results: list[list[bytes]] = []
    first = threading.Thread(target=lambda: results.append(shared.get()))
    first.start()
    started.wait(5)
    waiters = [threading.Thread(target=lambda: results.append(shared.get())) for _ in range(3)]
    for waiter in waiters:
        waiter.start()
    time.sleep(0.1)  # the waiters are blocked on the render in progress
    release.set()
    for thread in [first, *waiters]:
        thread.join(5)
    assert results == [[b"body"]] * 4 and len(calls) == 1
    shared.get()  # a later request renders again
    assert len(calls) == 2 and shared.renders == 2
    assert shared._current is None  # nothing held between requests (77 MB at 5000 nodes)


def test_background_work_pauses_while_a_verb_computes() -> None:
    activity = VerbActivity(max_pause_s=0.3, quiet_s=0.05, slice_s=0.2)
    started = time.monotonic()
    activity.pause()  # no verb yet: no wait
    assert time.monotonic() - started < 0.04
    activity.started()
    threading.Timer(0.1, activity.finished).start()
    started = time.monotonic()
    activity.pause()  # waits for the verb and quiet_s after it, not for max_pause_s
    assert 0.14 < time.monotonic() - started < 0.28
    activity.started()
    started = time.monotonic()
    activity.pause()  # a verb that does not end: max_pause_s, then a slice, so a burst cannot starve a scrape
    assert 0.28 < time.monotonic() - started < 1
    started = time.monotonic()
    activity.pause()  # within the slice: no wait
    assert time.monotonic() - started < 0.04
    time.sleep(0.25)
    started = time.monotonic()
    activity.pause()  # the slice is over: waits again
    assert 0.28 < time.monotonic() - started < 1
    activity.finished()
    assert activity.in_flight == 0
    time.sleep(0.06)
    started = time.monotonic()
    activity.pause()  # quiet for longer than quiet_s: no wait
    assert time.monotonic() - started < 0.04


def test_a_verb_and_a_render_step_never_run_at_once() -> None:
    """The turn: a render holds it for each step between two pauses and the event loop while a verb computes, so a
    verb that arrives during a step waits for the step's end, and a step never starts while a verb computes."""
    activity = VerbActivity(max_pause_s=0.02, quiet_s=0.0, slice_s=0.0, turn_wait_s=5.0)
    running: list[str] = []  # who runs now ("verb", "step"): never both
    overlaps: list[list[str]] = []
    steps_done = 0

    def mark(who: str) -> None:
        running.append(who)
        if len(set(running)) > 1:
            overlaps.append(list(running))

    def render() -> None:
        nonlocal steps_done
        for _ in range(200):
            mark("step")
            time.sleep(0.001)  # a step of 1 ms (sleeping keeps the GIL free: only the turn keeps them apart)
            running.remove("step")
            steps_done += 1
            activity.pause()

    renderer = threading.Thread(target=lambda: activity.run(render))
    renderer.start()
    waits_s = []
    for _ in range(50):
        started = time.monotonic()
        activity.started()  # waits for the step in progress
        waits_s.append(time.monotonic() - started)
        mark("verb")
        time.sleep(0.002)
        running.remove("verb")
        activity.finished()
        time.sleep(0.001)  # the gap between two verbs, where the render advances
    renderer.join(30)
    assert not renderer.is_alive() and steps_done == 200
    assert overlaps == []
    assert max(waits_s) < 0.5  # one step at a time (1 ms, plus the OS on a loaded machine), never the whole render


def test_a_render_step_that_blocks_delays_a_verb_by_at_most_turn_wait_s() -> None:
    activity = VerbActivity(turn_wait_s=0.05)
    release = threading.Event()
    renderer = threading.Thread(target=lambda: activity.run(lambda: release.wait(10)))
    renderer.start()
    time.sleep(0.05)  # the render holds the turn and blocks (a lock, the OS)
    started = time.monotonic()
    activity.started()
    assert 0.04 < time.monotonic() - started < 2  # the verb goes ahead without the turn
    activity.finished()  # and does not give back a turn it does not hold
    release.set()
    renderer.join(10)
    activity.started()  # the turn is free again
    activity.finished()
    assert activity.run(lambda: 7) == 7


def test_gc_is_off_during_renders_and_back_after_the_last() -> None:
    assert gc.isenabled()
    with render_settings():
        assert not gc.isenabled()
        with render_settings():
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()


def test_probe_listener_writes_a_body_of_many_pieces_whole_to_a_slow_reader() -> None:
    """More pieces than one sendmsg takes, and sends that stop within a piece (a reader slower than the writer)."""
    import http.client

    pieces = [bytes([65 + number % 26]) * (number % 5000) for number in range(5000)]  # ~12 MB, some pieces empty
    server = serve_probes("127.0.0.1", 0, {"/metrics": lambda: (200, "text/plain", pieces)})
    try:
        connection = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=30)
        connection.request("GET", "/metrics")
        reply = connection.getresponse()
        assert reply.getheader("Content-Length") == str(sum(map(len, pieces)))
        received = []
        while block := reply.read(65536):
            received.append(block)
            time.sleep(0.0005)  # the server's sends fill the socket's buffer and return short
        assert b"".join(received) == b"".join(pieces)
    finally:
        server.shutdown()
        server.server_close()


def test_probe_listener_pauses_before_each_batch_of_a_big_body() -> None:
    """The extender's listener sends /metrics between verbs: its pause hook runs before each batch of pieces."""
    import http.client

    pauses: list[int] = []
    pieces = [b"x" * 10] * 2500  # three batches
    server = serve_probes("127.0.0.1", 0, {"/metrics": lambda: (200, "text/plain", pieces),
                                            "/healthz": lambda: (200, "text/plain", b"ok")},
                          send_pause=lambda: pauses.append(1))
    try:
        for path, body, batches in (("/metrics", b"x" * 25000, 3), ("/healthz", b"ok", 0)):
            connection = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=30)
            connection.request("GET", path)
            assert connection.getresponse().read() == body
            assert len(pauses) == batches
            pauses.clear()
    finally:
        server.shutdown()
        server.server_close()


def test_probe_listener_writes_a_chunked_body_whole() -> None:
    import http.client

    server = serve_probes("127.0.0.1", 0, {"/metrics": lambda: (200, "text/plain", [b"a" * 70000, b"b", b"c\n"])})
    try:
        connection = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=10)
        connection.request("GET", "/metrics")
        reply = connection.getresponse()
        assert reply.getheader("Content-Length") == "70003"
        assert reply.read() == b"a" * 70000 + b"bc\n"
    finally:
        server.shutdown()
        server.server_close()
