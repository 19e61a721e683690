"""NodeOrder: the state's own order of its nodes, and lists of node names put in it (filter walks a new request
shape's nodes in it, whatever order kube-scheduler names them in)."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kube_vgpu.extender.node_order import MIN_NODES, NodeOrder
from kube_vgpu.extender.state import ClusterState
from tests.extender.test_node_equivalence import START_S, node_items


def order_of(count: int) -> tuple[NodeOrder, list[str]]:
    order = NodeOrder()
    names = [f"node-{index:03d}" for index in range(count)]
    for name in reversed(names):  # arrival order is not name order
        order.add(name)
    return order, names[::-1]


def fresh(names: list[str]) -> list[str]:
    """The same names as other string objects (as a request body decodes them)."""
    return ["".join(list(name)) for name in names]


CASES = {
    # case: (nodes, asked as positions in arrival order, or names; expected as positions or names)
    "in order already": (40, list(range(40)), list(range(40))),
    "reversed": (40, list(range(39, -1, -1)), list(range(40))),
    "a subset, shuffled": (60, random.Random(1).sample(range(60), 45), sorted(random.Random(1).sample(range(60), 45))),
    "unknown names last, as given": (40, ["x-2", *range(39, -1, -1), "x-1"], [*range(40), "x-2", "x-1"]),
    "a name twice stays twice": (40, [5, *range(39, -1, -1)], [*range(5), 5, 5, *range(6, 40)]),
    "fewer than MIN_NODES: as given": (40, list(range(MIN_NODES - 2, -1, -1)), list(range(MIN_NODES - 2, -1, -1))),
}


@pytest.mark.parametrize("case", CASES)
def test_names_are_put_in_the_order_the_nodes_arrived(case: str) -> None:
    count, asked, expected = CASES[case]
    order, arrived = order_of(count)

    def named(items: list[int | str]) -> list[str]:
        return [arrived[item] if isinstance(item, int) else item for item in items]

    given_names = fresh(named(asked))
    assert order.in_order(given_names) == named(expected)


def test_a_list_in_order_is_returned_itself_and_a_reordered_one_holds_the_orders_own_copies() -> None:
    order, arrived = order_of(50)
    asked = fresh(arrived)
    assert order.in_order(asked) is asked
    reordered = order.in_order(list(reversed(asked)))
    assert reordered == arrived
    # copies made together (not the strings added, nor those asked), the same ones pod after pod
    assert not any(got is node for got, node in zip(reordered, [*arrived, *asked], strict=False))
    again = order.in_order(list(reversed(fresh(arrived))))
    assert all(first is second for first, second in zip(reordered, again, strict=True))
    assert list(order.rank) == reordered and all(a is b for a, b in zip(order.rank, reordered, strict=True))


def test_names_added_or_removed_since_are_copied_again_on_the_next_ordering() -> None:
    order, arrived = order_of(40)
    first = order.in_order(list(reversed(arrived)))
    late = "late"
    order.add(late)
    order.remove(arrived[3])
    expected = [*arrived[:3], *arrived[4:], late]
    second = order.in_order(list(reversed(fresh(expected))))
    assert second == expected and second[-1] is not late
    assert not any(a is b for a, b in zip(first, second, strict=False))


def test_a_node_removed_and_added_again_goes_last_and_many_removals_keep_the_order() -> None:
    order, arrived = order_of(100)
    order.remove(arrived[0])
    order.add(arrived[0])
    assert order.in_order(list(reversed(arrived))) == [*arrived[1:], arrived[0]]
    for name in arrived[10:95]:  # most ranks become holes: the nodes left are ranked again, in order
        order.remove(name)
    left = [*arrived[1:10], *arrived[95:], arrived[0]]
    assert len(order) == len(left) and sorted(order.rank, key=order.rank.__getitem__) == left
    assert order.in_order(list(reversed(left)) * 3) == [name for name in left for _ in range(3)]
    order.remove("never-added")
    order.add(arrived[1])  # already there: stays where it is
    assert order.in_order(list(reversed(left)) * 4)[:8] == [arrived[1]] * 4 + [arrived[2]] * 4


@settings(max_examples=200, deadline=None)
@given(data=st.data(), count=st.integers(0, 120), unknown=st.lists(st.sampled_from(["u1", "u2", "u3"]), max_size=4))
def test_in_order_is_a_stable_sort_by_arrival(data: st.DataObject, count: int, unknown: list[str]) -> None:
    order, arrived = order_of(count)
    removed = data.draw(st.sets(st.sampled_from(arrived), max_size=count // 2)) if arrived else set()
    for name in removed:
        order.remove(name)
    present = [name for name in arrived if name not in removed]
    asked = data.draw(st.lists(st.sampled_from(present), max_size=3 * count)) if present else []
    asked = data.draw(st.permutations([*asked, *unknown, *sorted(removed)[:2]]))
    result = order.in_order(fresh(asked))
    if len(asked) < MIN_NODES:
        assert result == asked
        return
    rank = {name: position for position, name in enumerate(present)}
    # sorted() is stable: names of no node keep the order given, after every node
    assert result == sorted(asked, key=lambda name: rank.get(name, len(rank)))


def test_the_state_ranks_its_nodes_as_they_arrive_and_forgets_deleted_ones() -> None:
    state = ClusterState()
    names = [f"n{index}" for index in (3, 1, 2)]
    for name in names:
        for item in node_items(name, 0, [], START_S):
            if item["kind"] == "Node":
                state.upsert_node(item)
    assert list(state.node_order.rank) == names
    state.delete_node("n1")
    assert list(state.node_order.rank) == ["n3", "n2"]
    for item in node_items("n1", 0, [], START_S):
        if item["kind"] == "Node":
            state.upsert_node(item)
    assert list(state.node_order.rank) == ["n3", "n2", "n1"]


@settings(max_examples=150, deadline=None)
@given(operations=st.lists(st.tuples(st.sampled_from(["add", "remove", "order"]), st.integers(0, 79)), max_size=60))
def test_orderings_between_additions_and_removals_follow_arrival(operations: list[tuple[str, int]]) -> None:
    """Orderings interleaved with nodes added and removed (each ordering after a change ranks the names under new
    copies): always the stable sort by arrival, with the order's own copies of known names."""
    order, arrived = order_of(40)
    present = list(arrived)  # in arrival order
    for operation, number in operations:
        name = f"node-{number:03d}"
        if operation == "add":
            order.add(name)
            if name not in present:
                present.append(name)
        elif operation == "remove":
            order.remove(name)
            if name in present:
                present.remove(name)
        else:
            unknown = ["unknown"] if number % 3 == 0 else []
            twice = present[:2] if number % 5 == 1 else []
            asked = fresh([*present[number % 7:], *twice, *unknown])[::-1]
            result = order.in_order(asked)
            if len(asked) < MIN_NODES:
                assert result is asked
                continue
            rank = {known: position for position, known in enumerate(present)}
            assert result == sorted(asked, key=lambda known: rank.get(known, len(rank)))
            if not unknown and len(set(asked)) == len(asked):  # reordered by rank: the order's copies
                assert not any(got is given for got in result for given in asked)
