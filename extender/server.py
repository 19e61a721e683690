"""The HTTP edge of the extender: kube-scheduler's extender protocol (Go field names), health, metrics.

Bodies are parsed with orjson straight from bytes (no pydantic on the hot path) and validated by
hand, so malformed input gets a 400 with a message and the service keeps serving.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Collection, Iterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
import orjson
from fastapi import FastAPI
from fastapi.responses import Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from starlette.concurrency import run_in_threadpool
from starlette.types import Receive, Scope, Send

from kube_vgpu.extender.engine.model import NodeState
from kube_vgpu.extender.exposition import (
    ROWS_PER_CHUNK,
    Body,
    BytesOut,
    Family,
    FamilyGroup,
    GroupedCollector,
    Pause,
    RenderedGroup,
    SharedRender,
    VerbActivity,
    label_text,
    no_pause,
    render_registry,
    rows_text,
    sorted_labels,
)
from kube_vgpu.extender.gangs import gangs_view
from kube_vgpu.extender.scheduler import MAX_EXTENDER_SCORE, BindError, Scheduler
from kube_vgpu.extender.state import ClusterState
from kube_vgpu.extender.usage_metrics import UsageCollector
from kube_vgpu.kubeapi import InvalidObject, check_pod
from kube_vgpu.probes import BATCH_PIECES, ProbeServer, Reply, Route, body_length
from kube_vgpu.probes import serve_probes as serve_probe_routes
from kube_vgpu.protocol import InvalidGpuRequest

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 64 * 1024 * 1024  # full Node objects for 5000 nodes fit comfortably
#: hosts left out of and added to the last prioritize reply, at most, for its layout to be edited (ScoreReplies)
EDITED_ENTRIES_MAX = 64
LATENCY_BUCKETS_S = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.015, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class BadRequest(Exception):
    status = 400


class PayloadTooLarge(BadRequest):
    status = 413


def _chunked(body: Body, length: int, media_type: str) -> Response:
    """A rendered body sent a batch of pieces at a time (never joined whole: see kube_vgpu.extender.exposition)."""

    async def chunks() -> AsyncIterator[bytes]:
        for start in range(0, len(body), BATCH_PIECES):
            yield b"".join(body[start:start + BATCH_PIECES])

    return StreamingResponse(chunks(), media_type=media_type, headers={"Content-Length": str(length)})


def _with_length(render: SharedRender) -> tuple[Body, int]:
    body = render.get()
    return body, body_length(body)  # in the worker thread, not on the verbs' event loop


def _json(data: Any, status_code: int = 200) -> Response:
    return Response(orjson.dumps(data), status_code=status_code, media_type="application/json")


@dataclass(frozen=True, slots=True)
class _NodeText:
    """One node's per-GPU sample lines as of one version of it (NodeState.version: bumped by every change of its
    GPUs or their usage); `node` tells a node deleted and added again (a new object, its version from 0) apart."""

    node: NodeState
    version: int
    families: tuple[bytes, ...]  # its lines of each of GpuCollector.FAMILIES


class GpuCollector(GroupedCollector):
    """Per-GPU allocation gauges computed at scrape time from the state (no cost per bind). /metrics keeps each
    node's lines between scrapes and renders again only the nodes whose version changed (a few per bind)."""

    FAMILIES = (
        Family("kube_vgpu_gpu_memory_mib", "gauge", "GPU memory (MiB)"),
        Family("kube_vgpu_gpu_memory_allocated_mib", "gauge", "GPU memory assigned to pods (MiB)"),
        Family("kube_vgpu_gpu_cores", "gauge", "GPU compute units (100 per GPU)"),
        Family("kube_vgpu_gpu_cores_allocated", "gauge", "GPU compute units assigned to pods"),
        Family("kube_vgpu_gpu_vgpus_allocated", "gauge", "vGPUs on the GPU"),
        Family("kube_vgpu_gpu_healthy", "gauge", "1 if the GPU is healthy"),
    )
    LABELS = ("node", "gpu", "uuid", "model")

    def __init__(self, state: ClusterState) -> None:
        self.state = state
        #: node name -> its lines as last rendered (only nodes present at the last scrape)
        self._text: dict[str, _NodeText] = {}

    @staticmethod
    def _rows(node: NodeState) -> list[tuple[tuple[str, ...], tuple[float, ...]]]:
        return [((node.name, str(gpu.index), gpu.uuid, gpu.model),
                 (gpu.memory_mib, gpu.used_memory_mib, gpu.cores, gpu.used_cores, gpu.used_vgpus,
                  1 if gpu.healthy else 0))
                for gpu in node.gpus]

    def groups(self, pause: Pause) -> list[FamilyGroup]:
        gpus = FamilyGroup(self.FAMILIES, self.LABELS)
        # only plain tuples are copied under the lock (filter waits for it), a chunk of nodes at a time with the
        # lock released and `pause` called between chunks; rendering the samples happens outside it
        state = self.state
        with state.lock:
            nodes = list(state.nodes.values())
            node_count, pod_count = len(state.nodes), len(state.pods)
        for start in range(0, len(nodes), ROWS_PER_CHUNK // 8):  # ~8 GPUs a node
            pause()
            with state.lock:
                for node in nodes[start:start + ROWS_PER_CHUNK // 8]:
                    gpus.rows.extend(self._rows(node))
        return [gpus, *self._counts(node_count, pod_count)]

    @staticmethod
    def _counts(node_count: int, pod_count: int) -> list[FamilyGroup]:
        return [
            FamilyGroup([Family("kube_vgpu_nodes", "gauge", "GPU nodes known to the extender")], [],
                        [((), (node_count,))]),
            FamilyGroup([Family("kube_vgpu_assigned_pods", "gauge", "pods holding GPU assignments")], [],
                        [((), (pod_count,))]),
        ]

    def render_groups(self, pause: Pause, numbers: dict[float, str]) -> list[FamilyGroup | RenderedGroup]:
        """groups(), with each node's lines reused while its version is the one they were rendered at: a scrape
        looks up 5000 nodes and renders the few that changed, instead of 40,000 GPUs' lines."""
        state = self.state
        with state.lock:
            nodes = list(state.nodes.values())
            node_count, pod_count = len(state.nodes), len(state.pods)
        old, new = self._text, {}
        texts: list[_NodeText] = []
        order, names = sorted_labels(self.LABELS)
        nodes_per_chunk = ROWS_PER_CHUNK * 5  # a look-up is ~0.2 us: ~20 us a chunk when nothing changed
        for start in range(0, len(nodes), nodes_per_chunk):
            pause()
            changed: list[tuple[int, NodeState, int, list[tuple[tuple[str, ...], tuple[float, ...]]]]] = []
            with state.lock:  # the version and the rows are read together, under the lock
                for node in nodes[start:start + nodes_per_chunk]:
                    text = old.get(node.name)
                    if text is None or text.node is not node or text.version != node.version:
                        changed.append((len(texts), node, node.version, self._rows(node)))
                    texts.append(text)  # type: ignore[arg-type]  # replaced below when changed
            for done, (slot, node, version, rows) in enumerate(changed):
                if done % 4 == 3:
                    pause()  # ~50 us a node
                labels = [label_text(names, [values[i] for i in order]) for values, _ in rows]
                texts[slot] = _NodeText(node, version, rows_text(self.FAMILIES, labels,
                                                                 [amounts for _, amounts in rows], numbers))
        parts: list[list[bytes]] = [[] for _ in self.FAMILIES]
        for number, text in enumerate(texts):
            if number % nodes_per_chunk == 0:
                pause()
            new[text.node.name] = text
            for position, lines in enumerate(text.families):
                parts[position].append(lines)
        self._text = new  # nodes gone since the last scrape are dropped with the old dict
        return [RenderedGroup(self.FAMILIES, parts), *self._counts(node_count, pod_count)]


class BindTurnCollector(Collector):
    """How many binds hold their node's turn and how many wait for it, read at scrape time (extender/binding.py).
    Binds piling up here mean slow Binding calls: each waits for the one ahead of it on its node."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler

    def collect(self) -> Iterator[GaugeMetricFamily]:
        writing, waiting = self.scheduler.ordering.turn_counts()
        yield GaugeMetricFamily("kube_vgpu_extender_binds_writing",
                                "binds holding their node's turn (writing their Binding)", value=writing)
        yield GaugeMetricFamily("kube_vgpu_extender_binds_waiting",
                                "binds decided and reserved, waiting for their node's turn", value=waiting)


class PreemptionCollector(Collector):
    """Evictions by rule and outcome (blocked: a PodDisruptionBudget refused), and nominations in progress."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler

    def collect(self) -> Iterator[Any]:
        evictions = CounterMetricFamily("kube_vgpu_preemption_evictions",
                                        "evictions for preemption, by the rule that allowed them, the preemptor's "
                                        "ClusterQueue and their outcome", labels=["rule", "cluster_queue", "outcome"])
        preemptor = self.scheduler.preemptor
        if preemptor is not None:
            for (rule, queue, outcome), count in sorted(preemptor.executor.counts().items()):
                evictions.add_metric([rule, queue, outcome], count)
        yield evictions
        with self.scheduler.state.lock:
            nominated = len(self.scheduler.nominations.by_preemptor)
        yield GaugeMetricFamily("kube_vgpu_preemption_nominations",
                                "pods nominated to a node whose victims are being evicted for them", value=nominated)


def parse_json_body(body: bytes) -> Any:
    if not body:
        raise BadRequest("empty request body; expected JSON")
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from None


async def read_asgi_body(scope: Scope, receive: Receive) -> bytes:
    """The whole request body, refusing more than MAX_BODY_BYTES (declared or sent) with BadRequest."""
    for key, value in scope["headers"]:
        if key == b"content-length":
            try:
                declared = int(value)
            except ValueError:
                raise BadRequest("invalid Content-Length header") from None
            if declared > MAX_BODY_BYTES:
                raise PayloadTooLarge(f"request body too large ({declared} bytes; limit {MAX_BODY_BYTES})")
    chunks = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise BadRequest("client disconnected before sending the whole body")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise PayloadTooLarge(f"request body too large (over {MAX_BODY_BYTES} bytes)")
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def _extender_args(doc: Any) -> tuple[dict[str, Any], list[str], list[dict[str, Any]] | None]:
    """ExtenderArgs -> (pod, node names, full node objects or None when nodeCacheCapable)."""
    if not isinstance(doc, dict):
        raise BadRequest("ExtenderArgs must be a JSON object with Pod and NodeNames or Nodes")
    pod = doc.get("Pod")
    if not isinstance(pod, dict):
        raise BadRequest("ExtenderArgs.Pod must be a Pod object")
    try:
        check_pod(pod, "ExtenderArgs.Pod")  # wrong-typed fields: a 400 naming the field, not a 500 deep inside
    except InvalidObject as exc:
        raise BadRequest(str(exc)) from None
    names = doc.get("NodeNames")
    nodes = doc.get("Nodes")
    if names is not None:
        if not isinstance(names, list):
            raise BadRequest("ExtenderArgs.NodeNames must be a list of strings")
        try:
            "".join(names)  # raises on anything but a string; a C loop, where a generator over 5000 names is 0.2 ms
        except TypeError:
            raise BadRequest("ExtenderArgs.NodeNames must be a list of strings") from None
        return pod, names, None
    if nodes is not None:
        items = nodes.get("items") if isinstance(nodes, dict) else None
        if items is None:
            items = []
        if not isinstance(items, list) or not all(isinstance(n, dict) for n in items):
            raise BadRequest("ExtenderArgs.Nodes.items must be a list of Node objects")
        for index, node in enumerate(items):
            metadata = node.get("metadata")
            if not isinstance(metadata, dict) or not isinstance(metadata.get("name"), str):
                raise BadRequest(f"ExtenderArgs.Nodes.items[{index}].metadata.name must be a string")
        return pod, [((n.get("metadata") or {}).get("name") or "") for n in items], items
    raise BadRequest("ExtenderArgs needs NodeNames (nodeCacheCapable) or Nodes")


Verb = Callable[[Any], Any]
JSON_HEADERS = [(b"content-type", b"application/json")]


class ExtenderApp(FastAPI):
    """FastAPI for everything except kube-scheduler's three verbs, which are served straight from ASGI: a burst is
    three requests per pod, and Starlette's middleware and routing cost more CPU than filter itself."""

    verbs: dict[str, Verb]
    #: run after a verb's reply is sent (Verbs.follow_ups)
    follow_ups: dict[str, Callable[[], None]]
    verb_latency: Histogram
    bad_requests: Counter
    #: verbs being computed: rendering /metrics and /state pauses for them (kube_vgpu.extender.exposition)
    activity: VerbActivity
    metrics_render: SharedRender
    state_render: SharedRender

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            path = scope["path"]
            verb = self.verbs.get(path)
            if verb is not None:
                await self._serve_verb(path.lstrip("/"), verb, self.follow_ups.get(path), scope, receive, send)
                return
        await super().__call__(scope, receive, send)

    async def _serve_verb(self, name: str, verb: Verb, follow_up: Callable[[], None] | None, scope: Scope,
                          receive: Receive, send: Send) -> None:
        activity = self.activity
        activity.started()
        try:
            await self._compute_verb(name, verb, scope, receive, send)
            if follow_up is not None:
                # one turn of the event loop first, so that the reply is on its way (a transport may flush its writes
                # only when the loop runs) before this work: the client must not wait for it
                await asyncio.sleep(0)
                try:
                    follow_up()  # computing still: rendering keeps paused
                except Exception:  # an optimisation: the next verb computes what it needs itself
                    log.exception("%s: work after the reply failed", name)
        finally:
            activity.finished()

    async def _compute_verb(self, name: str, verb: Verb, scope: Scope, receive: Receive, send: Send) -> None:
        started = time.perf_counter()
        status = 200
        headers = JSON_HEADERS
        try:
            if scope["method"] != "POST":
                status, headers, result = 405, [*JSON_HEADERS, (b"allow", b"POST")], {"Error": "use POST"}
            else:
                result = verb(parse_json_body(await read_asgi_body(scope, receive)))
                if inspect.isawaitable(result):
                    # bind waits for its node's turn and the API server: no computing to pause rendering for
                    self.activity.finished()
                    try:
                        result = await result
                    finally:
                        self.activity.started()
            body = orjson.dumps(result)  # in the try: a result that does not encode is an Error too, not plain text
        except BadRequest as exc:
            self.bad_requests.labels(name).inc()
            status, body = exc.status, orjson.dumps({"Error": str(exc)})
        except Exception as exc:  # never let one request take the service down; kube-scheduler shows the Error
            log.exception("%s failed", name)
            status, body = 500, orjson.dumps({"Error": f"kube-vgpu extender internal error in {name}: {exc!r}"})
        if status == 200:
            self.verb_latency.labels(name).observe(time.perf_counter() - started)
        await send({"type": "http.response.start", "status": status,
                    "headers": [*headers, (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


@dataclass(slots=True)
class ExtenderMetrics:
    """The extender's own Prometheus metrics, on a registry of its own (plus the GPU and gate collectors)."""

    registry: CollectorRegistry
    latency: Histogram
    rejections: Counter
    binds: Counter
    bad_requests: Counter
    rejection_children: dict[str, Any] = field(default_factory=dict)

    def count_rejection(self, code: str, count: int) -> None:
        child = self.rejection_children.get(code)
        if child is None:
            child = self.rejection_children[code] = self.rejections.labels(code)
        child.inc(count)


def extender_metrics(scheduler: Scheduler, *, per_pod_gpu: bool = True) -> ExtenderMetrics:
    registry = CollectorRegistry()
    metrics = ExtenderMetrics(
        registry=registry,
        latency=Histogram("kube_vgpu_extender_request_seconds", "extender verb latency", ["verb"],
                          buckets=LATENCY_BUCKETS_S, registry=registry),
        rejections=Counter("kube_vgpu_extender_rejections_total", "nodes rejected by filter, by reason", ["reason"],
                           registry=registry),
        binds=Counter("kube_vgpu_extender_binds_total", "bind calls by outcome", ["outcome"], registry=registry),
        bad_requests=Counter("kube_vgpu_extender_bad_requests_total", "malformed requests", ["verb"],
                             registry=registry),
    )
    # both outcomes exported from the start (0), so an alert on increase() sees the first failure too
    for outcome in ("success", "failure"):
        metrics.binds.labels(outcome)
    registry.register(GpuCollector(scheduler.state))
    registry.register(UsageCollector(scheduler, per_pod_gpu=per_pod_gpu))
    registry.register(BindTurnCollector(scheduler))
    registry.register(PreemptionCollector(scheduler))
    for gate in scheduler.gates:  # gates may publish their own gauges (the quota gate)
        gate_collector = gate.collector()
        if gate_collector is not None:
            registry.register(gate_collector)
    scheduler.on_rejection = metrics.count_rejection
    return metrics


class ScoreReplies:
    """prioritize's reply (a HostPriorityList) as bytes. Each entry is `{"Host":"<name>","Score":DD}` with the score
    in two bytes (` 7` or `10`: JSON allows the space), so the reply for a list of hosts has one layout whatever the
    scores: the layout is kept, and a reply for the same hosts (the next pod of a shape, a prepared answer brought
    up to date) is the kept bytes with the scores written in at their offsets over an array: ~0.2 ms for 5000
    nodes, against ~0.8 ms to join 10,000 pieces again. It allocates no object the cyclic GC tracks."""

    #: a score's two bytes: its tens (a space below 10) and its units, for every score kube-scheduler accepts
    TENS = np.array([ord(" ")] * 10 + [ord("1")], dtype=np.uint8)
    UNITS = np.array([ord(str(score % 10)) for score in range(MAX_EXTENDER_SCORE + 1)], dtype=np.uint8)

    def __init__(self) -> None:
        self._heads: dict[str, bytes] = {}
        #: the last layout: a copy of its hosts, the reply with blank scores, and each score's offset in it
        self._layout: tuple[list[str], npt.NDArray[np.uint8], npt.NDArray[np.intp]] | None = None

    def encode(self, hosts: list[str], scores: list[int], known_nodes: int,
               change: tuple[Collection[str], Sequence[str]] | None = None) -> bytes:
        """The reply for hosts and their scores. change: the hosts left out of and added to the last reply's, where
        hosts are likely its hosts less those left out (in its order) and then those added: the kept layout is then
        edited (~0.2 ms at 5000 hosts), not laid out again (~0.4-2 ms); checked, so a wrong hint costs only the
        time."""
        if not hosts:
            return b"[]"
        if len(scores) != len(hosts):
            raise ValueError(f"{len(scores)} scores for {len(hosts)} hosts")
        values = np.fromiter(scores, dtype=np.int64, count=len(hosts))
        if int(values.min()) < 0 or int(values.max()) > MAX_EXTENDER_SCORE:
            raise ValueError(f"an extender score must be 0-{MAX_EXTENDER_SCORE}")
        layout = self._layout
        if layout is None or layout[0] != hosts:  # checked first: refused scores leave the kept layout as it was
            edited = self._edited(layout, hosts, *change) if change is not None and layout is not None else None
            layout = self._layout = edited if edited is not None else self._lay_out(hosts, known_nodes)
        _, blank, offsets = layout
        body = blank.copy()
        body[offsets] = self.TENS[values]
        body[offsets + 1] = self.UNITS[values]
        return body.tobytes()

    @staticmethod
    def head(host: str) -> bytes:
        """A node's entry up to its score: `{"Host":"<name>","Score":`."""
        return b'{"Host":' + orjson.dumps(host) + b',"Score":'

    def _edited(self, layout: tuple[list[str], npt.NDArray[np.uint8], npt.NDArray[np.intp]], hosts: list[str],
                removed: Collection[str], added: Sequence[str]
                ) -> tuple[list[str], npt.NDArray[np.uint8], npt.NDArray[np.intp]] | None:
        """layout less the entries of the hosts removed, plus entries for those added at its end, where that is
        hosts' layout (else None: lay it out afresh)."""
        kept_hosts, blank, offsets = layout
        if len(removed) + len(added) > EDITED_ENTRIES_MAX or len(kept_hosts) - len(removed) + len(added) != len(hosts):
            return None
        try:
            at = sorted({kept_hosts.index(host) for host in removed})
        except ValueError:
            return None
        edited_hosts = kept_hosts.copy()
        for position in reversed(at):
            del edited_hosts[position]
        edited_hosts += added
        if edited_hosts != hosts:
            return None
        # each entry's bytes: from the end of the one before (after `[` for the first) to past its `},` (`}]` for the
        # last); its score's offset moves back by the bytes of the entries removed before it
        ends = offsets + 4
        starts = np.empty_like(offsets)
        starts[0] = 1
        starts[1:] = ends[:-1]
        body = blank.copy()
        body[-1] = ord(",")  # the last entry's `]`, as if another followed: one is written at the end
        keep = np.ones(len(body), dtype=np.bool_)
        removed_bytes = np.zeros(len(at) + 1, dtype=np.intp)
        for number, position in enumerate(at):
            keep[starts[position]:ends[position]] = False
            removed_bytes[number + 1] = removed_bytes[number] + ends[position] - starts[position]
        if at:
            kept_entries = np.delete(np.arange(len(offsets)), at)
            # (the entries removed before each kept one: at is sorted and holds none of them)
            kept_offsets = offsets[kept_entries] - removed_bytes[np.searchsorted(np.array(at), kept_entries)]
        else:
            kept_offsets = offsets
        heads = [self._heads.get(host) or self.head(host) for host in added]
        body = body[keep] if at else body
        if heads:
            lengths = np.fromiter(map(len, heads), dtype=np.intp, count=len(heads))
            added_offsets = len(body) + np.cumsum(lengths + 4) - 4
            body = np.concatenate((body, np.frombuffer(b"".join(head + b"  }," for head in heads), dtype=np.uint8)))
            kept_offsets = np.concatenate((kept_offsets, added_offsets))
        body[-1] = ord("]")
        return edited_hosts, body, kept_offsets

    def _lay_out(self, hosts: list[str], known_nodes: int
                 ) -> tuple[list[str], npt.NDArray[np.uint8], npt.NDArray[np.intp]]:
        heads = self._heads
        if len(heads) > 2 * known_nodes + 1024:
            heads.clear()  # nodes come and go: keep the cache to about the nodes there are
        try:
            encoded = list(map(heads.__getitem__, hosts))
        except KeyError:
            for host in hosts:
                if host not in heads:
                    heads[host] = self.head(host)
            encoded = list(map(heads.__getitem__, hosts))
        # each entry: its head, two bytes of score, `},`; the first after the `[`, and the last `,` a `]`
        lengths = np.fromiter(map(len, encoded), dtype=np.intp, count=len(encoded))
        offsets = np.cumsum(lengths + 4) - 3  # (1 + the entries before, + its head) = cumsum(len + 4) - 4 + 1
        blank = np.frombuffer(b"[" + b"  },".join(encoded) + b"  }]", dtype=np.uint8).copy()
        return list(hosts), blank, offsets


class Verbs:
    """kube-scheduler's three extender verbs: a decoded ExtenderArgs / ExtenderBindingArgs in, the reply out."""

    def __init__(self, scheduler: Scheduler, metrics: ExtenderMetrics) -> None:
        self.scheduler = scheduler
        self.metrics = metrics
        self.score_replies = ScoreReplies()
        #: whether kube-scheduler asks prioritize at all (a configuration may name only filter and bind): until it
        #: does, no filter prepares its answer
        self.prioritize_asked = False
        #: the last filter's pod and passing nodes, for after_filter
        self._filtered: tuple[Any, list[str]] | None = None
        #: the prepared prioritize answer's scores (the list itself: a new one whenever they change) and its reply
        self._prepared_reply: tuple[list[int], bytes] | None = None

    def follow_ups(self) -> dict[str, Callable[[], None]]:
        """Work the server runs after a verb's reply is sent, before it reads the next request."""
        return {"/filter": self.after_filter}

    def after_filter(self) -> None:
        """Prepare the prioritize kube-scheduler sends next for the pod just filtered (Scheduler.prepare_scores),
        its reply encoded too: the time kube-scheduler takes to read the filter's reply and ask is spent on it."""
        filtered, self._filtered = self._filtered, None
        self._prepared_reply = None
        if filtered is None or not self.prioritize_asked:
            return
        prepared = self.scheduler.prepare_scores(*filtered)
        if prepared is not None:
            hosts, scores = prepared
            reply = self.score_replies.encode(hosts, scores, len(self.scheduler.state.nodes),
                                              self.scheduler.prepared_change)
            self._prepared_reply = (scores, reply)

    def routes(self) -> dict[str, Verb]:
        return {"/filter": self.filter, "/prioritize": self.prioritize, "/bind": self.bind}

    def filter(self, doc: Any) -> Any:
        pod, names, node_objects = _extender_args(doc)
        outcome = self.scheduler.filter(pod, names)
        self._filtered = (pod, outcome.passed) if not outcome.error else None
        result: dict[str, Any] = {
            "FailedNodes": outcome.failed,
            "FailedAndUnresolvableNodes": outcome.unresolvable,
            "Error": outcome.error,
        }
        if node_objects is None:
            result["NodeNames"] = outcome.passed
            result["Nodes"] = None
        else:
            passed = set(outcome.passed)
            result["NodeNames"] = None
            result["Nodes"] = {"items": [n for n in node_objects if (n.get("metadata") or {}).get("name") in passed]}
        return result

    def prioritize(self, doc: Any) -> Any:
        self.prioritize_asked = True
        pod, names, _ = _extender_args(doc)
        try:
            # kube-scheduler adds nothing for a node missing from the list, exactly as for a 0: those are left out
            # where they are many (a burst onto an empty cluster: nearly every node, and the reply shrinks from 500
            # entries to a few), kept where few (the hosts, and the reply's layout, stay as they were)
            hosts, scores = self.scheduler.scaled_scores(pod, names)
        except InvalidGpuRequest:
            return []
        prepared = self._prepared_reply
        if prepared is not None and prepared[0] is scores:  # scaled_scores returned the prepared answer as it was
            return orjson.Fragment(prepared[1])
        return orjson.Fragment(self.score_replies.encode(hosts, scores, len(self.scheduler.state.nodes)))

    @staticmethod
    def _binding_args(doc: Any) -> tuple[str, str, str, str]:
        """(namespace, name, uid, node) of an ExtenderBindingArgs; BadRequest names what is missing."""
        if not isinstance(doc, dict):
            raise BadRequest("ExtenderBindingArgs must be a JSON object")
        fields: dict[str, str] = {}
        missing = []
        for key in ("PodName", "PodNamespace", "PodUID", "Node"):
            value = doc.get(key)
            if isinstance(value, str) and value:
                fields[key] = value
            else:
                missing.append(key)
        if missing:
            raise BadRequest(f"ExtenderBindingArgs is missing {', '.join(missing)}")
        return fields["PodNamespace"], fields["PodName"], fields["PodUID"], fields["Node"]

    async def bind(self, doc: Any) -> Any:
        args = self._binding_args(doc)
        scheduler = self.scheduler
        ordering = scheduler.ordering
        try:
            pod = scheduler.recent_pod(args[2])
            if pod is not None:
                prepared = scheduler.prepare_bind(*args, pod)  # no I/O: decide here, without a thread hop
            else:  # reads the pod from the API in a worker thread
                prepared = await ordering.prepare_async(scheduler, functools.partial(scheduler.prepare_bind, *args))
            if prepared is not None:
                # decided and reserved at once (the next pods' filter sees it), then written in the node's turn,
                # waited for in the event loop (extender/binding.py)
                await ordering.commit_async(scheduler, prepared)
            self.metrics.binds.labels("success").inc()
            return {"Error": ""}
        except BindError as exc:
            self.metrics.binds.labels("failure").inc()
            return {"Error": str(exc)}
        except asyncio.CancelledError:
            # uvicorn cancels what still runs after its graceful shutdown timeout; the ordering has already let go
            # of this bind (extender/binding.py). kube-scheduler gets a reason in Error instead of a bare 500, and
            # nothing above this request task waits on its cancellation.
            task = asyncio.current_task()
            if task is not None:
                task.uncancel()
            self.metrics.binds.labels("failure").inc()
            namespace, name, _, node = args
            return {"Error": f"kube-vgpu extender shutting down: bind of {namespace}/{name} to {node} given up "
                             "(a Binding already being written completes); the pod will be retried"}


def add_views(app: ExtenderApp, scheduler: Scheduler) -> None:
    """Probes, metrics and the debug views: served by FastAPI (not on kube-scheduler's hot path)."""
    state = scheduler.state

    @app.get("/healthz")
    async def healthz() -> Response:
        return Response("ok", media_type="text/plain")

    @app.get("/readyz")
    async def readyz() -> Response:
        reason = state.unready_reason()  # the initial sync, then the watches (a dead one: 503)
        if reason is None:
            return Response("ok", media_type="text/plain")
        return Response(reason, status_code=503, media_type="text/plain")

    # both rendered in a worker thread, not on the event loop the verbs run on, pausing while a verb computes
    @app.get("/metrics")
    async def metrics() -> Response:
        return _chunked(*await run_in_threadpool(_with_length, app.metrics_render), CONTENT_TYPE_LATEST)

    @app.get("/state")
    async def state_view() -> Response:
        return _chunked(*await run_in_threadpool(_with_length, app.state_render), "application/json")

    @app.get("/quota")
    async def quota_view() -> Response:
        status, view = await run_in_threadpool(quota_document, scheduler)
        return _json(view, status)


def quota_document(scheduler: Scheduler) -> tuple[int, dict[str, Any]]:
    """GET /quota: per ClusterQueue and flavor, nominal, borrowed, lent, used, pending pods; 404 without a gate."""
    for gate in scheduler.gates:
        view = gate.snapshot(scheduler.gangs)
        if view is not None:
            return 200, view
    return 404, {"Error": "no quota gate: start the extender with --quota-config or in live mode"}


def state_view_bytes(scheduler: Scheduler, pause: Pause = no_pause) -> Body:
    """GET /state's body, as state.snapshot() plus gangs and nominations, built and encoded a chunk of nodes or
    pods at a time, pausing between chunks: the whole view as Python objects is ~0.5 million dicts, and building,
    encoding (orjson holds the GIL) and freeing it at once stalled the verbs for tens of ms each."""
    state = scheduler.state
    out = BytesOut()
    out.write(b'{"synced":' + orjson.dumps(state.synced.is_set()))
    for part in ("nodes", "assignments"):
        out.write(b',"' + part.encode() + b'":[')
        separator = b""
        for views in state.view_chunks(part, pause):
            if views:
                out.write(separator + orjson.dumps(views)[1:-1])
                separator = b","
        out.write(b"]")
    with state.lock:
        extra = {"gangs": gangs_view(scheduler.gangs), "nominations": scheduler.nominations.view()}
    out.write(b"," + orjson.dumps(extra)[1:])
    return out.pieces


class StateViewText:
    """GET /state's body (state_view_bytes' bytes) with each node's and each pod's JSON kept between requests: a
    dashboard polls it every few seconds, and at 5000 nodes and 40,000 pods building and encoding every view each
    time was ~0.13 s of CPU. A node's JSON is kept while its version (every change of its GPUs' usage or inventory),
    host CPU and inventory error are the same; only its heartbeat age, which moves with the clock, is encoded each
    time. A pod's is kept while its record (a new one for a new assignment) and its confirmed and bound flags are
    the same. One render at a time (SharedRender runs one; the lock covers any other caller)."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self._lock = threading.Lock()
        #: node name -> (key..., the JSON before its heartbeat age, the JSON after it)
        self._nodes: dict[str, tuple[Any, ...]] = {}
        #: pod UID -> (record, confirmed, bound, its JSON)
        self._pods: dict[str, tuple[Any, ...]] = {}

    def render(self, pause: Pause = no_pause) -> Body:
        with self._lock:
            try:
                return self._render(pause)
            except BaseException:
                self._nodes, self._pods = {}, {}
                raise

    def _render(self, pause: Pause) -> Body:
        state = self.scheduler.state
        out = BytesOut()
        with state.lock:
            now = state.clock()
            synced = state.synced.is_set()
            nodes = list(state.nodes.values())
            records = list(state.pods.values())
        out.write(b'{"synced":' + orjson.dumps(synced) + b',"nodes":[')
        kept, new = self._nodes, {}
        per_chunk = ROWS_PER_CHUNK * 5  # a kept node: a look-up, a comparison and its age encoded (~1 us)
        separator = b""
        for start in range(0, len(nodes), per_chunk):
            pause()
            pieces: list[bytes] = []
            changed: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
            with state.lock:
                for node in nodes[start:start + per_chunk]:
                    key = (node, node.version, node.cpu_milli_total, node.cpu_milli_used,
                           state.inventory_errors.get(node.name))
                    entry = kept.get(node.name)
                    if entry is None or entry[:-2] != key:
                        changed.append((key, state._node_view(node, now)))
                        entry = (*key, b"", b"")
                    new[node.name] = entry
                    pieces.append(orjson.dumps(state.heartbeat_view(node, now)))
            for key, view in changed:  # encoded outside the lock
                name = view.pop("name")
                view.pop("heartbeatAgeSeconds")
                new[name] = (*key, b'{"name":' + orjson.dumps(name) + b',"heartbeatAgeSeconds":',
                             b"," + orjson.dumps(view)[1:])  # slices and concatenations: new exact-size bytes
            text = b",".join([new[node.name][-2] + age + new[node.name][-1]
                              for node, age in zip(nodes[start:start + per_chunk], pieces, strict=True)])
            if text:
                out.write(separator + text)
                separator = b","
        self._nodes = new
        out.write(b'],"assignments":[')
        kept_pods, new_pods = self._pods, {}
        separator = b""
        for start in range(0, len(records), per_chunk):
            pause()
            views: list[tuple[int, Any]] = []
            encoded: list[bytes] = []
            with state.lock:
                for record in records[start:start + per_chunk]:
                    entry = kept_pods.get(record.uid)
                    if entry is None or entry[0] is not record or entry[1] != record.confirmed \
                            or entry[2] != record.bound:
                        views.append((len(encoded), (record, record.confirmed, record.bound,
                                                     state._assignment_view(record))))
                        encoded.append(b"")
                    else:
                        encoded.append(entry[3])
                        new_pods[record.uid] = entry
            for slot, (record, confirmed, bound, view) in views:
                # a copy of exact size: orjson's own bytes sit in a buffer it grew (1 KB and up) and shrank, and
                # kept for long between a render's freed garbage they held several times their size of heap
                # (measured at 5000 nodes and 40,000 pods: the /state text cost 170 MB of RSS, with copies 23 MB)
                encoded[slot] = bytes(memoryview(orjson.dumps(view)))
                new_pods[record.uid] = (record, confirmed, bound, encoded[slot])
            if encoded:
                out.write(separator + b",".join(encoded))
                separator = b","
        self._pods = new_pods
        out.write(b"]")
        with state.lock:
            extra = {"gangs": gangs_view(self.scheduler.gangs), "nominations": self.scheduler.nominations.view()}
        out.write(b"," + orjson.dumps(extra)[1:])
        return out.pieces


def create_app(scheduler: Scheduler, *, on_startup: Callable[[], None] | None = None,
               metrics_per_pod_gpu: bool = True) -> ExtenderApp:
    metrics = extender_metrics(scheduler, per_pod_gpu=metrics_per_pod_gpu)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if on_startup is not None:
            on_startup()  # live mode: start the watches once the server is up
        yield

    app = ExtenderApp(title="kube-vgpu extender", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.state.scheduler = scheduler
    app.state.registry = metrics.registry
    verbs = Verbs(scheduler, metrics)
    app.verbs = verbs.routes()
    app.follow_ups = verbs.follow_ups()
    app.verb_latency = metrics.latency
    app.bad_requests = metrics.bad_requests
    app.activity = activity = VerbActivity()
    registry = metrics.registry
    # rendered in a worker thread (or the metrics listener's), pausing while a verb computes; requests arriving
    # during a render share it
    app.metrics_render = SharedRender(lambda: activity.run(lambda: render_registry(registry, activity.pause)))
    state_text = StateViewText(scheduler)
    app.state_render = SharedRender(lambda: activity.run(lambda: state_text.render(activity.pause)))
    add_views(app, scheduler)
    return app


def serve_probes(registry: CollectorRegistry, scheduler: Scheduler, host: str, port: int, *,
                 render: SharedRender | None = None, state_render: SharedRender | None = None,
                 send_pause: Pause | None = None) -> ProbeServer:
    """/metrics, /healthz, /readyz and the read-only views /state and /quota on their own listener (a thread), so
    the extender's verbs can stay on loopback beside kube-scheduler while Prometheus, the kubelet's probes and the
    dashboard (kube_vgpu.extender.dashboard, through a Service) reach these from outside the Pod. The listener
    bounds its connections, threads and waits (kube_vgpu.probes). `render` and `state_render`: the app's shared
    /metrics and /state renders (pausing for the verbs, shared with the verbs' port); by default, ones of their
    own. `send_pause`: called between batches of a big body being sent (the app's VerbActivity.pause)."""
    state = scheduler.state
    metrics_render = render if render is not None else SharedRender(lambda: render_registry(registry))
    state_view = state_render if state_render is not None else SharedRender(StateViewText(scheduler).render)

    def readyz() -> Reply:
        reason = state.unready_reason()  # the initial sync, then the watches (a dead one: 503)
        if reason is None:
            return 200, "text/plain", b"ok"
        return 503, "text/plain", reason.encode()

    def quota() -> Reply:
        status, view = quota_document(scheduler)
        return status, "application/json", orjson.dumps(view)

    routes: dict[str, Route] = {
        "/metrics": lambda: (200, CONTENT_TYPE_LATEST, metrics_render.get()),
        "/healthz": lambda: (200, "text/plain", b"ok"),
        "/readyz": readyz,
        "/state": lambda: (200, "application/json", state_view.get()),
        "/quota": quota,
    }
    return serve_probe_routes(host, port, routes, send_pause=send_pause)
