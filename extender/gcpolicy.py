"""The cyclic garbage collector in the long-running extender (installed by `kube-vgpu extender` when it serves).

At the initial sync the state loaded so far is frozen out of the collector's reach (`ClusterState.mark_synced`).
What the extender creates afterwards (pod records as pods bind, per-node answers, /metrics' kept text) still ends
in the oldest generation, and every full collection scans all of it again: at 5000 nodes, binding pods through the
verbs, one full collection per ~1000 binds took 108, 147, then 231 ms after 4000-6000 binds and collected nothing
(docs/benchmarks.md). Whichever verb allocates at that moment (prioritize: 5000 score dicts) waits for it, and the
pause grows with the cluster (up to 1 s in bench/scrape_cost.py's longer runs).

`SurvivorFreezer` freezes what survives each full collection, so the next one scans only what has survived since:
measured in the same setting, the first full collection after the sync 107 ms, every later one ~1 ms. Frozen
objects are still freed by reference counting (those full collections found no garbage at all); only cyclic
garbage among them would stay, so every `sweep_every`-th full collection unfreezes instead, and the next one scans
everything once (a pause as long as before this, that rarely: hours apart in a cluster binding a few pods a
second).

A /metrics render runs with the collector off (exposition.render_settings) and keeps tens of thousands of containers
alive for the next scrape; the first collections after it scanned them all (46 ms, then a 46 ms full collection, at
5000 nodes: two verbs waiting). `freeze_burst_survivors` freezes them as the render ends (then the longest
collection in the 50 pods after a render: 0.7 ms).

A filter of a new request shape is such a burst too: at 5000 nodes it makes a result per node for the shape's
answer (Placement, its containers, the answer's entries), kept as long as the shape is; with the collector on, a
young collection ran every ~700 of them and an older one over the lot, 2-5 ms of a 25 ms filter (a `/tmp` script,
12 new shapes). `collector_paused` switches it off for such a burst, counted across threads (a render and a filter
may overlap), and freezes what survived when the last holder ends.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

OLDEST_GENERATION = 2
#: full collections between two sweeps of everything (~80 per 1000 binds once the survivors are frozen)
SWEEP_EVERY = 4096


class SurvivorFreezer:
    """A gc.callbacks entry (see the module docstring). Deliberately cheap: gc.freeze and gc.unfreeze merge lists;
    nothing here walks the heap (gc.get_freeze_count does: ~0.1 s for a million objects)."""

    def __init__(self, sweep_every: int = SWEEP_EVERY) -> None:
        self.sweep_every = sweep_every
        self.full_collections = 0
        self.sweeps = 0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase != "stop" or info.get("generation") != OLDEST_GENERATION:
            return
        self.full_collections += 1
        if self.full_collections % self.sweep_every == 0:
            gc.unfreeze()  # into the oldest generation: the next full collection scans everything once
            self.sweeps += 1
        else:
            gc.freeze()  # everything tracked now survived this collection


_lock = threading.Lock()
_installed: SurvivorFreezer | None = None


def freeze_survivors() -> SurvivorFreezer:
    """Install the freezer in this process (once: later calls return the same one)."""
    global _installed
    with _lock:
        if _installed is None:
            _installed = SurvivorFreezer()
            gc.callbacks.append(_installed)
        return _installed


def freeze_burst_survivors() -> None:
    """Freeze what a burst of allocations made with the collector off left alive (a /metrics render: the kept text
    of 5000 nodes, tens of thousands of containers), so the first collection after it does not scan all of them
    while a verb waits; as after a full collection, they are still freed by reference counting, and cyclic garbage
    among them goes at the next sweep. Only where the survivor freezer runs (the serving extender)."""
    if _installed is not None:
        gc.freeze()


class _CollectorPause:
    """The cyclic collector off while any holder runs (counted: overlapping holders in several threads switch it
    back on only when the last one ends), and what they left alive frozen then (freeze_burst_survivors)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holders = 0
        self._was_enabled = False

    @contextmanager
    def __call__(self) -> Iterator[None]:
        with self._lock:
            if self._holders == 0:
                self._was_enabled = gc.isenabled()
                gc.disable()
            self._holders += 1
        try:
            yield
        finally:
            with self._lock:
                self._holders -= 1
                if self._holders == 0 and self._was_enabled:
                    freeze_burst_survivors()  # else the next collection scans all the burst left alive
                    gc.enable()


collector_paused = _CollectorPause()
