"""The extender freezes what survives each full collection and sweeps everything every sweep_every-th one
(kube_vgpu.extender.gcpolicy): a full collection then scans only what survived since the last, and cyclic garbage
among frozen objects is still collected, at the next sweep."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from kube_vgpu.extender import gcpolicy
from kube_vgpu.extender.gcpolicy import SurvivorFreezer, freeze_survivors


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
