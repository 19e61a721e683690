"""safgd (policies/supply.py): the supply-aware residue computed by hand, its agreement with lafgd's residue when
no ask is scarce, and a placement where it parts from lafgd and bfgd."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kube_vgpu.dev.simulator.engine import build_request
from kube_vgpu.extender.engine.fit import place
from kube_vgpu.extender.engine.fragmentation import TaskShape
from kube_vgpu.extender.engine.model import Placement
from kube_vgpu.extender.engine.policies import REGISTRY, make_policy
from kube_vgpu.extender.engine.policies.lookahead import LookaheadFGD, ask_probabilities, residue_table
from kube_vgpu.extender.engine.policies.supply import (
    SUPPLY_LOOKAHEAD_WEIGHT,
    SupplyLookaheadFGD,
    _residue_under,
    residues_under,
    supply_residue,
    supply_residues,
    supply_table,
)
from tests.engine.test_lookahead import one_gpu_node, share

#: 810s and whole GPUs common, 160s (the only filler of an 810's 190) rare, as on the openb traces
WORKLOAD = (
    [share(810)] * 14 + [share(160)] + [share(470)] * 10 + [share(320)] * 4 + [share(650)] * 3 + [share(1000)] * 45
)


def score(name: str, used: tuple[int, ...], milli: int) -> float:
    policy = make_policy(name)
    for task in WORKLOAD:
        policy.observe(build_request(task))
    result = place(one_gpu_node(used), build_request(share(milli)), policy, policy, check_host=True)
    assert isinstance(result, Placement), result
    return result.score


def test_registered_under_its_name() -> None:
    assert REGISTRY["safgd"] is SupplyLookaheadFGD
    policy = make_policy("safgd")
    assert isinstance(policy, SupplyLookaheadFGD) and isinstance(policy, LookaheadFGD)
    assert policy.lookahead_weight == SUPPLY_LOOKAHEAD_WEIGHT


@pytest.mark.parametrize(
    ("probabilities", "hole", "expected", "availability"),
    [
        # half the 810s open a GPU and want a 160 for their 190: demand 0.2 against 0.02, a = 0.1;
        # E(190) = 0.1 * E(30) + 0.9 * 190 (lafgd's R(190) is 30)
        ({810: 0.4, 160: 0.02, 1000: 0.58}, 190, 0.1 * 30 + 0.9 * 190, {160: 0.1, 810: 1.0, 1000: 1.0}),
        ({810: 0.4, 160: 0.02, 1000: 0.58}, 840, 30.0, None),  # an 810 (never scarce) leaves 30
        ({810: 0.4, 160: 0.02, 1000: 0.58}, 1000, 0.0, None),  # a whole-GPU task
        ({810: 0.4, 160: 0.02, 1000: 0.58}, 100, 100.0, None),  # nothing fits
        # enough 160s for every 810: the 190 is as good as R says
        ({810: 0.4, 160: 0.3, 1000: 0.3}, 190, 30.0, {160: 1.0, 810: 1.0, 1000: 1.0}),
        ({}, 500, 500.0, {}),  # nothing learned: every hole stays
    ],
)
def test_supply_residue_by_hand(
    probabilities: dict[int, float], hole: int, expected: float, availability: dict[int, float] | None
) -> None:
    table, available = supply_residue(probabilities)
    assert len(table) == 1001 and table[0] == 0.0
    assert table[hole] == pytest.approx(expected)
    if availability is not None:
        assert available == pytest.approx(availability)


def test_two_rare_fillers_of_one_hole_both_come_out_short() -> None:
    # the 190 an 810 leaves wants a 160 (30 left): the 160s are short (a = 0.1); the hole then turns to the 110s
    # (80 left), short too; availability never rises again, so the iteration settles with both short
    table, available = supply_residue({810: 0.4, 160: 0.02, 110: 0.02, 1000: 0.56})
    assert available == pytest.approx({110: 0.1, 160: 0.1, 810: 1.0, 1000: 1.0})
    assert table[190] == pytest.approx(0.1 * 30 + 0.9 * 190)  # waiting for a 160 beats waiting for a 110
    assert table[80] == 80.0


def test_a_hole_several_fillers_close_alike_demands_none() -> None:
    # a 600 leaves 400 (a 400, 300 + 100 or 4 x 100 close it), a 400 leaves 600: no filler is indispensable, so
    # none is short however rare, and E is lafgd's R
    table, available = supply_residue({600: 0.3, 400: 0.3, 300: 0.01, 100: 0.01, 1000: 0.38})
    assert set(available.values()) == {1.0}
    assert table[100] == table[400] == table[600] == 0.0


def test_no_scarce_ask_is_lafgds_residue() -> None:
    shapes = ((TaskShape(1000, 470, 1), 0.5), (TaskShape(1000, 320, 1), 0.3), (TaskShape(1000, 1000, 2), 0.2))
    assert ask_probabilities(shapes, "T4", 0) == {470: 0.5, 320: 0.3, 1000: 0.2}
    assert supply_table(shapes, "T4", 0) == residue_table(shapes, "T4", 0)
    # a model the shapes do not allow, or CPU-only shapes: nothing fits anywhere
    assert supply_table(((TaskShape(1000, 470, 1, ("A10",)), 1.0),), "T4", 0)[600] == 600.0
    assert supply_table(((TaskShape(1000, 0, 0), 1.0),), "T4", 0)[600] == 600.0


@pytest.mark.parametrize(
    ("task", "safgd_prefers", "others_prefer", "why"),
    [
        # beside a 470 a 320 leaves 210, which only the rare 160 could fill (and the 810s' holes want those);
        # on a fresh GPU it leaves 680, which a 650 brings to 30. FGD's next-task term, and lafgd's R at FGD's
        # scale, keep the fresh GPU for the next whole-GPU task
        (320, (), (470,), "open a fresh GPU rather than strand 210 beside a 470"),
    ],
)
def test_preferred_gpu_where_lafgd_and_bfgd_disagree(
    task: int, safgd_prefers: tuple[int, ...], others_prefer: tuple[int, ...], why: str
) -> None:
    assert score("safgd", safgd_prefers, task) > score("safgd", others_prefer, task), why
    for name in ("lafgd", "bfgd"):
        assert score(name, others_prefer, task) > score(name, safgd_prefers, task), name


def test_tables_follow_the_learned_model() -> None:
    policy = make_policy("safgd")
    assert isinstance(policy, SupplyLookaheadFGD)
    node = one_gpu_node(())
    for task in WORKLOAD:
        policy.observe(build_request(task))
    table = policy.table(node)
    assert table is policy.table(node)  # memoised per GPU class
    assert table == supply_table(policy.frag_model.shapes, "T4", 0)
    assert table[210] == 210.0  # the one 160 is below the typical shapes' 95 %: nothing fills a 210


@settings(max_examples=150, deadline=None)
@given(asks=st.lists(st.integers(1, 1000), min_size=1, max_size=12, unique=True).map(sorted),
       rows=st.lists(st.lists(st.sampled_from([0.0, 1e-12, 0.1, 0.25, 1 / 3, 0.5, 0.92, 1.0]), min_size=12,
                              max_size=12), min_size=1, max_size=6))
def test_many_residues_at_once_are_each_computed_alone(asks: list[int], rows: list[list[float]]) -> None:
    """residues_under (hsafgd's tables for all its levels in one pass) gives every value _residue_under gives for
    that row alone, exactly: the same float operations, in the same order of asks, ties within 1e-9 included."""
    availabilities = [row[: len(asks)] for row in rows]
    together = residues_under(asks, availabilities)
    for row, values in zip(availabilities, together, strict=True):
        assert values.tolist() == _residue_under(asks, dict(zip(asks, row, strict=True)))[0]


def test_many_residues_need_ascending_asks() -> None:
    with pytest.raises(ValueError, match="ascending"):
        residues_under([300, 200], [[1.0, 1.0]])
    assert residues_under([], [[]]).tolist() == [list(map(float, range(1001)))]


ASKS = [50, 100, 110, 160, 190, 200, 230, 250, 320, 370, 470, 480, 500, 650, 810, 1000]


@settings(max_examples=150, deadline=None)
@given(classes=st.lists(st.dictionaries(st.sampled_from(ASKS), st.floats(0.001, 1.0), min_size=1, max_size=10),
                        min_size=1, max_size=5))
def test_the_availabilities_of_many_classes_at_once_are_each_computed_alone(classes: list[dict[int, float]]) -> None:
    """supply_residues (hsafgd: every GPU class a batch placement meets, after a model change) gives each class
    what supply_residue gives it alone, exactly: E and the availability of each ask, whatever asks the other
    classes have and however many rounds each takes to settle."""
    probabilities = [{ask: p / sum(row.values()) for ask, p in row.items()} for row in classes]
    together = supply_residues(probabilities)
    assert len(together) == len(probabilities)
    for row, (expected, available) in zip(probabilities, together, strict=True):
        alone = supply_residue(row)
        assert expected == alone[0] and available == alone[1]


def test_the_openb_classes_at_once_settle_as_each_alone() -> None:
    """On a learned openb-like workload the 160s come out short (several rounds to settle) on one class while an
    other class settles at once: each as computed alone."""
    rows = [{160: 0.007, 190: 0.01, 470: 0.1, 810: 0.14, 1000: 0.743},
            {230: 0.3, 470: 0.3, 1000: 0.4},
            {160: 0.05, 320: 0.2, 650: 0.2, 810: 0.55}]
    together = supply_residues(rows)
    assert [result[1] for result in together] == [supply_residue(row)[1] for row in rows]
    assert together[0][1][160] < 1.0 and supply_residues([]) == []
