"""NodeTurns: which binds of one node may write their Binding now."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kube_vgpu.extender.binding import NodeTurns


class Binds:
    """Named binds against one NodeTurns; records who is writing."""

    def __init__(self) -> None:
        self.turns = NodeTurns()
        self.writing: dict[str, str] = {}  # bind -> assignment
        self.waiting: dict[str, tuple[str, Callable[[], None]]] = {}
        self.granted: list[str] = []  # in the order turns were granted

    def request(self, bind: str, assignment: str) -> bool:
        def wake() -> None:
            del self.waiting[bind]
            self.writing[bind] = assignment
            self.granted.append(bind)

        self.waiting[bind] = (assignment, wake)
        if self.turns.request(assignment, wake):
            wake()
            return True
        return False

    def finish(self, bind: str) -> None:
        del self.writing[bind]
        self.turns.finish()


@pytest.mark.parametrize(
    ("requests", "writing", "waiting"),
    [
        # (bind, assignment) in arrival order -> who writes, who waits
        ([("a", "X")], {"a"}, set()),
        ([("a", "X"), ("b", "X")], {"a", "b"}, set()),  # identical: together
        ([("a", "X"), ("b", "Y")], {"a"}, {"b"}),  # different: waits
        ([("a", "X"), ("b", "Y"), ("c", "X")], {"a"}, {"b", "c"}),  # c may not overtake b
        ([("a", "X"), ("b", "X"), ("c", "Y"), ("d", "Y")], {"a", "b"}, {"c", "d"}),
    ],
)
def test_who_may_write(requests: list[tuple[str, str]], writing: set[str], waiting: set[str]) -> None:
    binds = Binds()
    for bind, assignment in requests:
        binds.request(bind, assignment)
    assert set(binds.writing) == writing and set(binds.waiting) == waiting


def test_the_last_writer_hands_the_turn_to_the_next_group_in_arrival_order() -> None:
    binds = Binds()
    for bind, assignment in [("a", "X"), ("b", "X"), ("c", "Y"), ("d", "Y"), ("e", "X"), ("f", "Y")]:
        binds.request(bind, assignment)
    binds.finish("a")
    assert set(binds.writing) == {"b"}  # Y waits for every X in flight
    binds.finish("b")
    assert set(binds.writing) == {"c", "d"}  # the head and those right behind it with the same assignment
    binds.finish("c")
    binds.finish("d")
    assert set(binds.writing) == {"e"}
    binds.finish("e")
    assert set(binds.writing) == {"f"}
    binds.finish("f")
    assert binds.turns.idle and binds.granted == ["a", "b", "c", "d", "e", "f"]


def test_withdraw_before_the_turn_and_after_it() -> None:
    binds = Binds()
    binds.request("a", "X")
    binds.request("b", "Y")
    binds.request("c", "Z")
    assert binds.turns.withdraw(binds.waiting["b"][1])  # gave up while waiting
    del binds.waiting["b"]
    binds.finish("a")
    assert set(binds.writing) == {"c"}
    assert not binds.turns.withdraw(lambda: None)  # not waiting (c already writes): it must finish instead
    binds.finish("c")
    assert binds.turns.idle
    with pytest.raises(RuntimeError):
        binds.turns.finish()


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["request", "finish", "withdraw"]), st.sampled_from("XYZ")), max_size=60))
def test_never_two_assignments_at_once_and_turns_in_arrival_order(steps: list[tuple[str, str]]) -> None:
    binds = Binds()
    arrivals: list[str] = []
    for number, (action, assignment) in enumerate(steps):
        if action == "request":
            arrivals.append(f"b{number}")
            binds.request(f"b{number}", assignment)
        elif action == "finish" and binds.writing:
            binds.finish(next(iter(binds.writing)))
        elif action == "withdraw" and binds.waiting:
            bind = next(reversed(binds.waiting))
            assert binds.turns.withdraw(binds.waiting.pop(bind)[1])
            arrivals.remove(bind)
        assert len(set(binds.writing.values())) <= 1
        assert not binds.waiting or binds.writing  # someone waits only behind someone writing
    while binds.writing:
        binds.finish(next(iter(binds.writing)))
    assert binds.turns.idle and not binds.waiting
    assert binds.granted == arrivals  # every bind got its turn, in arrival order
