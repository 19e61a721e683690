"""The extender freezes what survives each full collection and sweeps everything every sweep_every-th one
(kube_vgpu.extender.gcpolicy): a full collection then scans only what survived since the last, and cyclic garbage
among frozen objects is still collected, at the next sweep."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from kube_vgpu.extender import gcpolicy
from kube_vgpu.extender.gcpolicy import SurvivorFreezer, collector_paused, freeze_survivors


class Node:
    def __init__(self) -> None:
        self.other: Node | None = None


def cycle() -> tuple[weakref.ref[Node], Node]:
    """Two objects referring to each other: only the cyclic collector frees them once they are dropped."""
    first, second = Node(), Node()
    first.other, second.other = second, first
    return weakref.ref(first), first


@pytest.fixture
def freezer() -> Iterator[SurvivorFreezer]:
    gc.collect()
    gc.unfreeze()
    freezer = SurvivorFreezer(sweep_every=3)
    gc.callbacks.append(freezer)
    try:
        yield freezer
    finally:
        gc.callbacks.remove(freezer)
        gc.unfreeze()
        gc.collect()


def test_survivors_of_a_full_collection_are_frozen_and_new_garbage_is_still_collected(
        freezer: SurvivorFreezer) -> None:
    kept = [Node() for _ in range(1000)]
    gc.collect()  # full collection 1: everything alive is frozen
    assert freezer.full_collections == 1 and gc.get_freeze_count() >= len(kept)
    dead, held = cycle()
    del held
    gc.collect()  # full collection 2: garbage made since the freeze is collected as before
    assert dead() is None


def test_cyclic_garbage_among_frozen_objects_goes_at_the_next_sweep(freezer: SurvivorFreezer) -> None:
    dead, held = cycle()
    gc.collect()  # 1: frozen while alive
    del held
    gc.collect()  # 2: not scanned (frozen), so it stays
    assert dead() is not None
    gc.collect()  # 3: the sweep_every-th: unfreezes everything
    assert freezer.sweeps == 1 and gc.get_freeze_count() == 0
    gc.collect()  # 4: scans everything: the cycle is collected
    assert dead() is None


def test_only_the_end_of_a_full_collection_counts(freezer: SurvivorFreezer) -> None:
    freezer("start", {"generation": 2})
    freezer("stop", {"generation": 0})
    freezer("stop", {"generation": 1})
    assert freezer.full_collections == 0 and gc.get_freeze_count() == 0


def test_installed_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gcpolicy, "_installed", None)  # as in a fresh process; this one's test session keeps its GC
    first = freeze_survivors()
    try:
        assert freeze_survivors() is first and gc.callbacks.count(first) == 1
    finally:
        gc.callbacks.remove(first)
        gc.unfreeze()


def test_what_a_render_leaves_alive_is_frozen_where_the_freezer_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """A render allocates with the collector off (exposition.render_settings); what it keeps (the next scrape's
    text) would otherwise all be scanned by the first collection after it, while a verb waits (46 ms at 5000 nodes,
    then a 46 ms full one)."""
    from kube_vgpu.extender.exposition import render_settings

    gc.collect()
    gc.unfreeze()
    monkeypatch.setattr(gcpolicy, "_installed", SurvivorFreezer())  # as in the serving extender
    try:
        with render_settings():
            kept = [Node() for _ in range(1000)]
        assert gc.isenabled() and gc.get_freeze_count() >= len(kept)
    finally:
        gc.unfreeze()


def test_without_the_freezer_a_render_freezes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    from kube_vgpu.extender.exposition import render_settings

    gc.unfreeze()
    monkeypatch.setattr(gcpolicy, "_installed", None)  # a test process, a tool: its GC as Python runs it
    with render_settings():
        kept = [Node() for _ in range(1000)]
    assert kept and gc.get_freeze_count() == 0


def test_the_collector_is_off_while_any_holder_runs_across_threads_and_on_after_the_last() -> None:
    import threading

    assert gc.isenabled()
    entered, release = threading.Event(), threading.Event()

    def other_holder() -> None:
        with collector_paused():
            entered.set()
            release.wait(10)

    thread = threading.Thread(target=other_holder)
    with collector_paused():
        thread.start()
        assert entered.wait(10) and not gc.isenabled()
    assert not gc.isenabled()  # the other thread still holds it
    release.set()
    thread.join(10)
    assert gc.isenabled()
    gc.disable()
    try:
        with collector_paused():
            pass
        assert not gc.isenabled()  # off before: left off
    finally:
        gc.enable()


def test_a_filter_of_a_new_shape_at_scale_places_with_the_collector_off_and_freezes_what_it_kept(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A new request shape's filter over many nodes makes a result for each (the shape's answer): the collector is
    off meanwhile and what it kept is frozen where the freezer runs; a filter of few nodes leaves the collector be."""
    from kube_vgpu.extender import scheduler as scheduler_module
    from tests.extender.test_node_equivalence import START_S, Clock, Twin, node_items
    from tests.helpers import pod

    items: list[dict[str, object]] = []
    for index in range(40):
        items.extend(node_items(f"n{index:02d}", index % 3, [], START_S))
    twin = Twin(Clock(), items, True)
    seen: list[bool] = []
    real_place = scheduler_module.place

    def recording_place(*args: object, **kwargs: object) -> object:
        seen.append(gc.isenabled())
        return real_place(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(scheduler_module, "place", recording_place)
    monkeypatch.setattr(scheduler_module, "COLLECTOR_PAUSE_MIN_NODES", 30)
    names = [f"n{index:02d}" for index in range(40)]
    twin.scheduler.filter(pod("few", gpus=1, memory_mib=2048, cores=5), names[:20])
    assert seen and all(seen)
    seen.clear()
    gc.collect()
    gc.unfreeze()
    monkeypatch.setattr(gcpolicy, "_installed", SurvivorFreezer())  # as in the serving extender
    try:
        outcome = twin.scheduler.filter(pod("many", gpus=1, memory_mib=4096, cores=10), names)
        assert outcome.passed and seen and not any(seen)
        assert gc.isenabled() and gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
