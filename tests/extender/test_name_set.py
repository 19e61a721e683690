"""extender/name_set.py: a NameSet tells exactly whether a list holds the kept names, each once, in any order
(kube-scheduler's feasible nodes, asked again in a new order): equal hashes only pair names up, and the names
themselves are compared; lists it cannot keep are left to the caller's dict."""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kube_vgpu.extender.name_set import LazyNameSet, NameSet

NODES = [f"node-{index:04d}" for index in range(50)]


class HashedAs(str):
    """A string whose hash is another's: what a hash collision looks like, without searching for one."""

    hashed_as: str

    def __new__(cls, value: str, hashed_as: str) -> HashedAs:
        made = super().__new__(cls, value)
        made.hashed_as = hashed_as
        return made

    def __hash__(self) -> int:
        return hash(self.hashed_as)

    def __eq__(self, other: object) -> bool:
        return str.__eq__(self, other)


def shuffled(names: list[Any], seed: int = 1) -> list[Any]:
    return random.Random(seed).sample(names, len(names))


@pytest.mark.parametrize(("asked", "same"), [
    (shuffled(NODES), True),
    (list(NODES), True),
    ([*shuffled(NODES)[1:], "node-9999"], False),  # one replaced
    ([*NODES[1:], NODES[2]], False),  # one named twice, one missing
    (NODES[1:], False),  # one fewer
    ([*NODES, "node-9999"], False),  # one more
    ([*NODES[:-1], NODES[-1] + "\0"], False),  # a separator in a name
    ([*NODES[:-1], f"{NODES[-1][:-1]}\0{NODES[-1][-1]}"], False),
    ([*NODES[:-1], HashedAs("node-9999", NODES[-1])], False),  # a collision with a kept name: compared, refused
    # the same names, hashed as each other: paired with the wrong kept names, so refused (a "no" only costs the caller
    # its slower way; a "yes" is never wrong)
    ([*NODES[:-2], HashedAs(NODES[-1], NODES[-2]), HashedAs(NODES[-2], NODES[-1])], False),
    ([*NODES[:-1], 7], False),  # not a string
    ([*NODES[:-1], ["node-0049"]], False),
])
def test_a_list_is_the_kept_names_in_any_order_or_not(asked: list[Any], same: bool) -> None:
    name_set = NameSet.of(NODES)
    assert name_set is not None and len(name_set) == len(NODES)
    assert name_set.same_names(asked) is same


@pytest.mark.parametrize("names", [
    [*NODES, NODES[0]],  # a name twice
    [*NODES, f"{NODES[0]}\0x"],  # a separator in a name
    [*NODES, HashedAs("node-9999", NODES[0])],  # two names of one hash
    [*NODES, 7],  # not a string
])
def test_names_it_cannot_keep_are_left_to_the_caller(names: list[Any]) -> None:
    assert NameSet.of(names) is None


def test_no_names_and_one_name() -> None:
    empty = NameSet.of([])
    assert empty is not None and empty.same_names([]) and not empty.same_names(["a"])
    one = NameSet.of(["a"])
    assert one is not None and one.same_names(["a"]) and not one.same_names(["b"]) and not one.same_names([])


def test_a_lazy_name_set_is_built_once_when_first_needed() -> None:
    names = list(NODES)
    lazy = LazyNameSet(names)
    names.append("later")  # (the list as it is when first needed)
    built = lazy.get()
    assert built is not None and lazy.get() is built and len(built) == len(NODES) + 1
    refused = LazyNameSet([*NODES, NODES[0]])
    assert refused.get() is None and refused.get() is None


@settings(max_examples=300, deadline=None)
@given(kept=st.lists(st.sampled_from(["a", "b", "c", "ab", "a\0", "", "ü", "n1", "n10"]), max_size=8),
       asked=st.lists(st.sampled_from(["a", "b", "c", "ab", "a\0", "", "ü", "n1", "n10", "x"]), max_size=8))
def test_it_answers_as_comparing_the_names_counted(kept: list[str], asked: list[str]) -> None:
    name_set = NameSet.of(kept)
    if len(set(kept)) < len(kept) or any("\0" in name for name in kept):
        assert name_set is None
        return
    assert name_set is not None
    assert name_set.same_names(asked) == (Counter(asked) == Counter(kept))
    assert name_set.same_names(shuffled(kept, len(asked)))


def test_a_lazy_name_set_is_wanted_again_before_it_is_built() -> None:
    """Matched once (kube-scheduler asking other nodes every pod), a list never pays for its NameSet: the first
    want answers None (the caller matches its own way), the next ones the set, built once."""
    lazy = LazyNameSet(list(NODES))
    assert lazy.wanted() is None
    built = lazy.wanted()
    assert built is not None and lazy.wanted() is built and lazy.get() is built
    assert built.same_names(shuffled(NODES))
