"""/metrics and /state at 5000 nodes without stalling kube-scheduler's verbs (issue 18).

At 5000 nodes x 8 GPUs with 40,000 pods, /metrics is ~75 MB (one series per GPU and per pod and GPU, six and three
families of them, plus three counters per pod); prometheus_client's generate_latest built it in ~9 s of pure Python,
most of it re-validating and re-escaping the same label names for every sample. All that time holds the GIL, so
filter and prioritize, on the event loop, ran at a third of their speed (or not at all, when the FastAPI route ran
it on the loop) for as long as a scrape lasted. Three things here:

* `FamilyGroup`: families that share their label rows (the six per-GPU gauges; the three per-pod-and-GPU gauges)
  are rendered straight to text, each row's label string built once for all of them. The text is byte for byte
  what generate_latest writes for the same families (tested), several times faster.
* `VerbActivity`: the verbs mark themselves in flight, and the rendering (in the metrics listener's thread or a
  worker thread) stops at the next `pause()` until none is and none ended in the last 0.5 ms; after waiting 5 ms it
  runs a 0.1 ms slice, so a steady burst of verbs delays a scrape but cannot starve it. A render's steps (the work
  between two pauses, ~0.1-0.2 ms) and the verbs take turns (a lock), so a verb never shares the GIL with one.
* `SharedRender`: one render serves every request that arrives while it runs (two Prometheus replicas, several
  dashboards), with the cyclic GC off and a short GIL switch interval meanwhile (`render_settings`).
* Kept text: a scrape at that size was still ~0.8 s of CPU, taken from the verbs on a 2-core node. Collectors keep
  what they rendered between scrapes (`GroupedCollector.render_groups`: per node while its version is the same,
  per node's pods while the node's version and pod mark are, per row by its values: `RowTextCache`) and hand it
  over as `RenderedGroup`s, so a scrape renders again only what changed since the last one, and fills in only the
  values that move with the clock (the GPU-seconds counters, written as integers). The bytes are generate_latest's
  but for those integers (`30` for its `30.0`: the same numbers; tested after every kind of change); the price is
  the text held between scrapes (~110 MiB of RSS at 5000 nodes and 40,000 pods). The body is those very bytes,
  in order (`Body`), sent a batch at a time with sendmsg: nothing is copied into it.
"""

from __future__ import annotations

import math
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TypeVar

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from kube_vgpu.extender.gcpolicy import collector_paused

Pause = Callable[[], None]
T = TypeVar("T")
#: a rendered body as its pieces in order, never joined: joining (or encoding) 75 MB at once holds the GIL for tens
#: of ms, which is what a verb would then wait; and the pieces are mostly the very bytes the collectors keep between
#: scrapes, so a render copies none of them (kube_vgpu.probes sends them a batch at a time)
Body = list[bytes]
#: rows rendered or copied between two calls of pause(): ~20-100 us of work, so a slice that runs while a verb is
#: being computed ends soon after its time (VerbActivity.slice_s) and a chunk copied under the state lock is short
ROWS_PER_CHUNK = 20


def no_pause() -> None:
    return


class VerbActivity:
    """How many of kube-scheduler's verbs are being computed on the event loop, and when the last one ended;
    background rendering pauses for them. Only the event loop's thread writes these (no lock); others only read.

    A render runs freely while no verb is in flight and none ended in the last `quiet_s`. Otherwise it waits; when
    it has waited `max_pause_s`, it runs one slice of `slice_s`, then waits again: in a steady burst of verbs a
    render still advances and each verb meets at most a step or two of a render, instead of one chunk of a whole
    scrape's work or a render starved for as long as the burst lasts.

    The turn: inside `background()`, a render holds a lock (the turn) for each step between two `pause()` calls,
    and the event loop holds it while any verb computes (`started()` .. `finished()`). So a verb and a render step
    never run at once: a verb that arrives during a step waits for that step's end (~0.1 ms) and then computes alone.
    Without it both threads ran together, trading the GIL every switch interval: a verb ran at half speed for as
    long as the step lasted, and ~1 ms steps doubled the verbs that met one (filter's p99 +30% under a scrape).
    Both sides take the turn with a timeout, so a step that blocks (a lock, the OS) can delay a verb by at most
    `turn_wait_s`, and a render cannot starve."""

    def __init__(self, max_pause_s: float = 0.005, quiet_s: float = 0.0005, slice_s: float = 0.0001,
                 turn_wait_s: float = 0.002) -> None:
        self.in_flight = 0
        self.last_finished_s = -math.inf
        self.max_pause_s = max_pause_s
        #: kube-scheduler sends filter, prioritize and bind back to back, and a request being read (several socket
        #: reads for 5000 node names) is not yet in flight: each time the event loop comes back for the GIL while a
        #: render holds it costs a verb up to the switch interval (0.1 ms while rendering). Not longer: with 2 ms,
        #: a scheduler busy back to back left a render only its 0.1 ms slices, so a 0.15 s render took 7-9 s (27 s
        #: at worst, past Prometheus' default 10 s scrape timeout) and half of all verbs met one of its steps; with
        #: 0.5 ms it runs in the gaps between them, 1.3-1.4 s a scrape, and fewer verbs meet it (bench/scrape_cost.py)
        self.quiet_s = quiet_s
        self.slice_s = slice_s
        self.turn_wait_s = turn_wait_s
        self._idle = threading.Event()
        self._idle.set()
        #: rendering thread -> when its current slice ends (a set or get of one key is atomic under the GIL)
        self._slice_end_s: dict[int, float] = {}
        self._turn = threading.Lock()
        #: whether the event loop holds the turn (it did not time out taking it)
        self._loop_has_turn = False
        #: rendering thread inside background() -> whether it holds the turn now
        self._render_has_turn: dict[int, bool] = {}

    def started(self) -> None:
        self.in_flight += 1
        self._idle.clear()
        if self.in_flight == 1:
            # waits for the end of a render step in progress, if any (the render sees in_flight at its next pause)
            self._loop_has_turn = self._turn.acquire(timeout=self.turn_wait_s)

    def finished(self) -> None:
        self.in_flight -= 1
        if self.in_flight <= 0:
            self.last_finished_s = time.monotonic()
            if self._loop_has_turn:
                self._loop_has_turn = False
                self._turn.release()
            self._idle.set()

    @contextmanager
    def background(self) -> Iterator[None]:
        """A render's whole run: it starts when pause() would let it, and holds the turn between its pauses."""
        thread = threading.get_ident()
        self._wait()
        self._render_has_turn[thread] = self._turn.acquire(timeout=self.max_pause_s)
        try:
            yield
        finally:
            if self._render_has_turn.pop(thread, False):
                self._turn.release()
            self._slice_end_s.pop(thread, None)

    def run(self, work: Callable[[], T]) -> T:
        """work() in background() (work calls pause() between its steps)."""
        with self.background():
            return work()

    def pause(self) -> None:
        """Called by background work every ROWS_PER_CHUNK rows (cheap when it need not wait)."""
        now = time.monotonic()
        if not self.in_flight and now - self.last_finished_s >= self.quiet_s:
            return
        thread = threading.get_ident()
        if now < self._slice_end_s.get(thread, 0.0):
            return  # within the slice it was given after waiting max_pause_s
        has_turn = self._render_has_turn.get(thread)
        if has_turn is None:  # outside background(): waits, but takes no turn
            self._wait(now)
            return
        if has_turn:
            self._turn.release()
        self._render_has_turn[thread] = False
        try:
            self._wait(now)
        finally:
            # after the verbs in flight (the event loop holds the turn while any computes)
            self._render_has_turn[thread] = self._turn.acquire(timeout=self.max_pause_s)

    def _wait(self, now: float | None = None) -> None:
        """Until no verb is in flight and quiet_s has passed since the last, or max_pause_s (then a slice)."""
        thread = threading.get_ident()
        now = time.monotonic() if now is None else now
        deadline = now + self.max_pause_s
        while True:
            left = deadline - now
            if left <= 0:
                self._slice_end_s[thread] = time.monotonic() + self.slice_s
                return
            if self.in_flight:
                self._idle.wait(left)
            else:
                quiet_left = self.quiet_s - (now - self.last_finished_s)
                if quiet_left <= 0:
                    return
                time.sleep(min(quiet_left, left))
            now = time.monotonic()


_ESCAPES = str.maketrans({"\\": "\\\\", "\n": "\\n", '"': '\\"'})


def escape_value(value: str) -> str:
    """A label value as the text format writes it (prometheus_client's openmetrics._escape)."""
    if "\\" in value or "\n" in value or '"' in value:
        return value.translate(_ESCAPES)
    return value


def go_float(value: float, cache: dict[float, str]) -> str:
    """floatToGoString, memoised per render: most values repeat (GPU sizes, 0, 100)."""
    text = cache.get(value)
    if text is None:
        if len(cache) >= MAX_NUMBERS:  # the GPU-seconds counters are all different: bound the memo
            cache.clear()
        text = cache[value] = go_float_text(value)
    return text


def go_float_text(value: float) -> str:
    """floatToGoString(value) without its checks where repr already is the answer (a finite float that Go would
    not write with an exponent): the GPU-seconds counters, 120,000 values that differ every scrape."""
    text = repr(float(value))
    if "n" in text or text.find(".") > 6:  # inf, nan, or what Go writes with an exponent
        return str(floatToGoString(value))
    return text


#: go_float's memo is dropped when it holds this many values
MAX_NUMBERS = 4096


def label_text(names: Sequence[str], values: Sequence[str]) -> str:
    """A row's label set as the text format writes it: `{a="x",b="y"}` ("" without labels). `names` and
    `values` in the order generate_latest writes them (sorted by name)."""
    if not names:
        return ""
    return "{" + ",".join([f'{name}="{escape_value(value)}"' for name, value in zip(names, values, strict=True)]) + "}"


@dataclass(frozen=True, slots=True)
class Family:
    name: str  # a counter's without its _total, as prometheus_client's families take it
    kind: str  # "gauge" or "counter"
    documentation: str

    @property
    def sample_name(self) -> str:
        return self.name + "_total" if self.kind == "counter" else self.name

    def header(self) -> bytes:
        """Its HELP and TYPE lines, as generate_latest writes them."""
        documentation = self.documentation.replace("\\", r"\\").replace("\n", r"\n")
        return f"# HELP {self.sample_name} {documentation}\n# TYPE {self.sample_name} {self.kind}\n".encode()


def sorted_labels(label_names: Sequence[str]) -> tuple[list[int], list[str]]:
    """(positions of the label values, their names) in the order generate_latest writes them: sorted by name."""
    order = sorted(range(len(label_names)), key=lambda i: label_names[i])
    return order, [label_names[i] for i in order]


@dataclass(slots=True)
class FamilyGroup:
    """Families that share label names and rows: each row is its label values and one value per family (None: that
    family has no sample for the row)."""

    families: Sequence[Family]
    label_names: Sequence[str]
    rows: list[tuple[Sequence[str], Sequence[float | None]]] = field(default_factory=list)

    def metrics(self) -> Iterator[Metric]:
        """The same families as prometheus_client objects (collect(): tests, and any other registry reader)."""
        for position, family in enumerate(self.families):
            metric_family: GaugeMetricFamily | CounterMetricFamily
            if family.kind == "counter":
                metric_family = CounterMetricFamily(family.name, family.documentation, labels=self.label_names)
            else:
                metric_family = GaugeMetricFamily(family.name, family.documentation, labels=self.label_names)
            for values, amounts in self.rows:
                amount = amounts[position]
                if amount is not None:
                    metric_family.add_metric(list(values), amount)
            yield metric_family

    def render(self, out: BytesOut, pause: Pause, numbers: dict[float, str]) -> None:
        """Append the text format, exactly as generate_latest writes metrics()."""
        order, names = sorted_labels(self.label_names)
        labels: list[str] = []
        for start in range(0, len(self.rows), ROWS_PER_CHUNK):
            pause()
            for values, _ in self.rows[start:start + ROWS_PER_CHUNK]:
                labels.append(label_text(names, [values[i] for i in order]))
        for position, family in enumerate(self.families):
            name = family.sample_name
            out.write(family.header())
            for start in range(0, len(self.rows), ROWS_PER_CHUNK):
                pause()
                chunk = self.rows[start:start + ROWS_PER_CHUNK]
                out.write("".join([f"{name}{label} {go_float(amounts[position], numbers)}\n"  # type: ignore[arg-type]
                                    for label, (_, amounts) in zip(labels[start:start + ROWS_PER_CHUNK], chunk,
                                                                   strict=True)
                                    if amounts[position] is not None]).encode())


def rows_text(families: Sequence[Family], labels: Sequence[str], amounts: Sequence[Sequence[float | None]],
              numbers: dict[float, str]) -> tuple[bytes, ...]:
    """Some rows' sample lines, one piece per family (what FamilyGroup.render writes for these rows, between the
    headers): `labels` from label_text, `amounts` per row one value per family (None: no sample)."""
    return tuple("".join([f"{family.sample_name}{label} {go_float(row[position], numbers)}\n"  # type: ignore[arg-type]
                          for label, row in zip(labels, amounts, strict=True) if row[position] is not None]).encode()
                 for position, family in enumerate(families))


@dataclass(slots=True)
class RenderedGroup:
    """Families whose sample lines are already text (cached between scrapes): `parts[i]` are the pieces of family
    i's lines, in order. render_registry writes each family's header and then its pieces."""

    families: Sequence[Family]
    parts: list[list[bytes]]

    def render(self, out: BytesOut, pause: Pause, numbers: dict[float, str]) -> None:
        for family, pieces in zip(self.families, self.parts, strict=True):
            out.write(family.header())
            for start in range(0, len(pieces), PIECES_PER_PAUSE):
                pause()
                out.write_many(pieces[start:start + PIECES_PER_PAUSE])


#: cached pieces written between two calls of pause() (references appended, not bytes copied: ~10 us)
PIECES_PER_PAUSE = 1000


class RowTextCache:
    """One FamilyGroup's sample lines kept between scrapes, keyed by each row's label values and reused while its
    values are the same: rows whose values rarely change (per node: allocation, idle GPUs, fragmentation) cost a
    dict look-up and a tuple comparison per scrape instead of formatting. Correct by construction (the key is
    everything the lines show); rows gone from `rows` are dropped. Safe for concurrent renders: each builds its
    own dict and swaps it in (entries are immutable)."""

    def __init__(self, families: Sequence[Family], label_names: Sequence[str]) -> None:
        self.families = families
        self.label_names = label_names
        self._order, self._names = sorted_labels(label_names)
        self._rows: dict[tuple[str, ...], tuple[tuple[float | None, ...], tuple[bytes, ...]]] = {}

    def __len__(self) -> int:
        return len(self._rows)

    def render(self, rows: Iterable[tuple[tuple[str, ...], tuple[float | None, ...]]], pause: Pause,
               numbers: dict[float, str]) -> RenderedGroup:
        """`rows` may be a generator: building 5000 rows is itself milliseconds, paused here with the rest."""
        old = self._rows
        new: dict[tuple[str, ...], tuple[tuple[float | None, ...], tuple[bytes, ...]]] = {}
        parts: list[list[bytes]] = [[] for _ in self.families]
        order, names = self._order, self._names
        work = 0  # ~0.5 us a kept row, ~5 us a row formatted again
        for values, amounts in rows:
            if work >= ROWS_PER_CHUNK * 5:
                pause()
                work = 0
            work += 1
            entry = old.get(values)
            if entry is None or entry[0] != amounts:
                work += 10
                entry = (amounts, rows_text(self.families, [label_text(names, [values[i] for i in order])],
                                            [amounts], numbers))
            new[values] = entry
            for position, text in enumerate(entry[1]):
                if text:
                    parts[position].append(text)
        self._rows = new
        return RenderedGroup(self.families, parts)


class BytesOut:
    """A body's pieces in order (Body). Not joined into chunks: that copied all 75 MB each scrape (~40 ms of CPU,
    the body's size again in peak memory, and the verbs' working set pushed out of the CPU caches meanwhile)."""

    def __init__(self) -> None:
        self.pieces: Body = []

    def write(self, piece: bytes) -> None:
        self.pieces.append(piece)

    def write_many(self, pieces: list[bytes]) -> None:
        self.pieces.extend(pieces)


class GroupedCollector(Collector):
    """A collector whose families come as FamilyGroups: render_registry writes them straight to text, pausing
    between chunks; collect() gives the same families to any other reader (tests, generate_latest)."""

    def groups(self, pause: Pause) -> list[FamilyGroup]:
        raise NotImplementedError

    def render_groups(self, pause: Pause, numbers: dict[float, str]) -> Sequence[FamilyGroup | RenderedGroup]:
        """What render_registry writes: groups() by default; collectors that keep text between scrapes return
        RenderedGroups (the same samples as groups() would render: tested against generate_latest)."""
        return self.groups(pause)

    def collect(self) -> Iterator[Metric]:
        for group in self.groups(no_pause):
            yield from group.metrics()


class _One:
    """One collector as a registry for generate_latest (collectors with no text fast path: small ones)."""

    def __init__(self, collector: Collector) -> None:
        self.collector = collector

    def collect(self) -> Iterator[Metric]:
        return iter(self.collector.collect())


def render_registry(registry: CollectorRegistry, pause: Pause = no_pause) -> Body:
    """generate_latest(registry), with GroupedCollectors rendered by FamilyGroup, pausing between chunks; the
    output, joined, is the same bytes but for whole-number counters kept as templates (UsageCollector's GPU-seconds,
    written `30` where generate_latest writes `30.0`)."""
    # the registry's collectors in its own order (CollectorRegistry.collect() reads the same private mapping)
    with registry._lock:
        collectors = list(registry._collector_to_names)
    out = BytesOut()
    numbers: dict[float, str] = {}
    for collector in collectors:
        pause()
        if not isinstance(collector, GroupedCollector):
            out.write(generate_latest(_One(collector)))
            continue
        for group in collector.render_groups(pause, numbers):
            group.render(out, pause, numbers)
            # freed a chunk at a time: 40,000 rows (or pieces) at once is milliseconds of deallocation
            for rows in [group.rows] if isinstance(group, FamilyGroup) else group.parts:
                while rows:
                    del rows[-ROWS_PER_CHUNK * 10:]
                    pause()
    return out.pieces


#: The GIL switch interval while a render runs. A verb's request reaches the event loop (its first packet, before it
#: counts as in flight and the render pauses) only once the loop gets the GIL, which a rendering thread holds for up
#: to the switch interval; the extender's 0.5 ms (extender/cli.py) cost filter's p99 +1 ms under a scrape at 5000
#: nodes. Shorter while rendering only: the extra switches cost the render, not the verbs.
RENDER_SWITCH_INTERVAL_S = 0.0001


class _RenderSettings:
    """The cyclic GC switched off while any render runs (gcpolicy.collector_paused), and the GIL switch interval
    shortened (RENDER_SWITCH_INTERVAL_S). A render allocates a few hundred thousand containers, which set off full
    collections over all of them (measured: 17-50 ms each, one verb waiting through it); the state itself is frozen
    out of the GC at initial sync, and a render's garbage is freed by reference counting. Counted, so overlapping
    renders (/metrics and /state) restore them only when the last one ends."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holders = 0
        self._switch_interval_s = 0.0

    @contextmanager
    def __call__(self) -> Iterator[None]:
        with self._lock:
            if self._holders == 0:
                self._switch_interval_s = sys.getswitchinterval()
                sys.setswitchinterval(min(self._switch_interval_s, RENDER_SWITCH_INTERVAL_S))
            self._holders += 1
        try:
            with collector_paused():  # what the render keeps is frozen as it ends (the next scrape's text)
                yield
        finally:
            with self._lock:
                self._holders -= 1
                if self._holders == 0:
                    sys.setswitchinterval(self._switch_interval_s)


render_settings = _RenderSettings()


@dataclass(slots=True)
class _Render:
    done: threading.Event = field(default_factory=threading.Event)
    body: Body | None = None
    error: BaseException | None = None


class SharedRender:
    """One render shared by every request that arrives while it runs: they wait for it instead of starting their own
    (two Prometheus replicas, several dashboards polling at once: one render, not one each). Nothing is kept once
    they have it: what the bytes show (learned policy models, GPU-seconds counters, heartbeat ages) moves without the
    state's change counter, so a later request renders again, and 77 MB is not held between scrapes (the collectors
    keep the text of what did not change, not the body)."""

    def __init__(self, render: Callable[[], Body]) -> None:
        self.render = render
        self._lock = threading.Lock()
        self._current: _Render | None = None
        #: renders done and the seconds of the last one
        self.renders = 0
        self.last_render_s = 0.0

    def get(self) -> Body:
        with self._lock:
            job = self._current
            if job is None:
                job = self._current = _Render()
                mine = True
            else:
                mine = False
        if not mine:
            job.done.wait()
            if job.body is None:
                raise RuntimeError("the shared render failed") from job.error
            return job.body
        started = time.monotonic()
        try:
            with render_settings():
                job.body = self.render()
            return job.body
        except BaseException as exc:
            job.error = exc
            raise
        finally:
            with self._lock:
                self._current = None
                self.renders += 1
                self.last_render_s = time.monotonic() - started
            job.done.set()
