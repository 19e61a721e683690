"""Dynamic MIG layout choice (kube_vgpu.extender.engine.mig_layout): legal placements only, against NVIDIA's
profile tables; hand-built cases of each policy; and the MIG simulator's bookkeeping (churn frees exactly what
arrivals took)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kube_vgpu.dev.simulator.mig import (
    MigAsk,
    TimedMigAsk,
    mig_arrivals,
    replay_mig_churn,
    simulate_mig,
    smallest_profile,
)
from kube_vgpu.extender.engine.mig_layout import (
    MIG_LAYOUT_POLICIES,
    FragAware,
    ProfileMix,
    free_starts,
    layout_of,
    make_layout_policy,
    placement_mask,
    uncoverable_free_slots,
)
from kube_vgpu.protocol.mig import A100_40GB, A100_80GB, H100_80GB, MIG_MODELS, MigModel, MigProfile, legal_layout

MODEL = A100_80GB


def profile(name: str) -> MigProfile:
    found = MODEL.profile(name)
    assert found is not None
    return found


def test_free_starts_follow_the_tables() -> None:
    assert free_starts(profile("3g.40gb"), 0) == (0, 4)
    assert free_starts(profile("4g.40gb"), 0) == (0,)
    # a 1g instance at slot 0 rules out 4g and 3g at 0; 3g at 4 still fits
    one_at_0 = placement_mask(profile("1g.10gb"), 0)
    assert free_starts(profile("4g.40gb"), one_at_0) == ()
    assert free_starts(profile("3g.40gb"), one_at_0) == (4,)
    # slot 7 takes no 1g.10gb instance
    assert 7 not in free_starts(profile("1g.10gb"), 0)


@pytest.mark.parametrize(
    ("name", "occupied", "expected"),
    [
        ("1g.10gb", {}, 1),  # slot 7: no 1g.10gb can use it
        ("1g.20gb", {}, 0),
        ("7g.80gb", {6: "1g.10gb"}, 7),  # nothing fits: every free slot is idle for it
        ("3g.40gb", {0: "1g.10gb"}, 3),  # slots 1-3 free, only 4-7 coverable
        ("2g.20gb", {0: "3g.40gb"}, 2),  # 2g starts at 0, 2, 4: slots 6-7 unusable for it
    ],
)
def test_uncoverable_free_slots(name: str, occupied: dict[int, str], expected: int) -> None:
    assert uncoverable_free_slots(profile(name), layout_of(MODEL, occupied)) == expected


def test_layout_of_refuses_illegal_layouts() -> None:
    with pytest.raises(ValueError, match="overlaps"):
        layout_of(MODEL, {0: "4g.40gb", 2: "2g.20gb"})


def test_first_and_best_fit() -> None:
    half_full = layout_of(MODEL, {0: "3g.40gb"})
    masks = [0, half_full, 0]
    first = make_layout_policy("first-fit", MODEL).choose(profile("1g.10gb"), masks)
    best = make_layout_policy("best-fit", MODEL).choose(profile("1g.10gb"), masks)
    assert first is not None and (first.gpu, first.start) == (0, 0)
    assert best is not None and (best.gpu, best.start) == (1, 4)
    assert make_layout_policy("first-fit", MODEL).choose(profile("7g.80gb"), [half_full]) is None


def test_frag_keeps_the_big_profiles_possible() -> None:
    """With 4g and 3g in the learned mix, a 3g instance on an empty GPU goes to slot 4 (4g can only start at 0)
    and a 1g instance to the top slots (first-fit puts both at 0)."""
    policy = FragAware(ProfileMix(MODEL, ["1g.10gb", "3g.40gb", "4g.40gb"]))
    for _ in range(5):
        policy.observe(profile("4g.40gb"))
    three = policy.choose(profile("3g.40gb"), [0])
    one = policy.choose(profile("1g.10gb"), [0])
    assert three is not None and three.start == 4
    assert one is not None and one.start >= 4
    # and it prefers the GPU where the instance adds no fragmentation over the emptier one
    three_at_4 = layout_of(MODEL, {4: "3g.40gb"})
    again = policy.choose(profile("4g.40gb"), [0, three_at_4])
    assert again is not None and again.gpu == 1


def test_unknown_policy_and_profile() -> None:
    with pytest.raises(ValueError, match="known: first-fit, best-fit, frag"):
        make_layout_policy("tetris", MODEL)
    with pytest.raises(ValueError, match="no MIG profile"):
        ProfileMix(MODEL, ["9g.90gb"])


def test_smallest_profile_gives_at_least_the_share() -> None:
    assert smallest_profile(MODEL, 100).name == "1g.10gb"
    assert smallest_profile(MODEL, 250).name == "2g.20gb"
    assert smallest_profile(MODEL, 300).name == "3g.40gb"
    assert smallest_profile(MODEL, 500).name == "4g.40gb"
    assert smallest_profile(MODEL, 600).name == "7g.80gb"
    assert smallest_profile(MODEL, 1000).name == "7g.80gb"


def _instances(placements: list[tuple[int, str, int]]) -> dict[int, list[tuple[str, int]]]:
    per_gpu: dict[int, list[tuple[str, int]]] = {}
    for gpu, name, start in placements:
        per_gpu.setdefault(gpu, []).append((name, start))
    return per_gpu


@settings(max_examples=60, deadline=None)
@given(
    model_index=st.integers(0, len(MIG_MODELS) - 1),
    policy_name=st.sampled_from(sorted(MIG_LAYOUT_POLICIES)),
    asks=st.lists(st.integers(0, 5), min_size=1, max_size=40),
    gpus=st.integers(1, 4),
)
def test_every_policy_places_legally(model_index: int, policy_name: str, asks: list[int], gpus: int) -> None:
    """Whatever the asks, each GPU's instances form a layout NVIDIA's tables allow (legal_layout), and an ask is
    refused only when no GPU has a free legal start for it."""
    model = MIG_MODELS[model_index]
    names = [p.name for p in model.profiles if not p.name.endswith("+me")]
    policy = make_layout_policy(policy_name, model)
    masks = [0] * gpus
    placed: list[tuple[int, str, int]] = []
    for pick in asks:
        wanted = model.profile(names[pick % len(names)])
        assert wanted is not None
        policy.observe(wanted)
        choice = policy.choose(wanted, masks)
        if choice is None:
            assert all(not free_starts(wanted, mask) for mask in masks)
            continue
        assert choice.start in free_starts(wanted, masks[choice.gpu])
        masks[choice.gpu] |= placement_mask(wanted, choice.start)
        placed.append((choice.gpu, wanted.name, choice.start))
    for instances in _instances(placed).values():
        assert legal_layout(model, instances) is None


def test_simulation_counts_and_layouts() -> None:
    asks = [MigAsk(profile("3g.40gb"), 1), MigAsk(profile("4g.40gb"), 1), MigAsk(profile("7g.80gb"), 2),
            MigAsk(profile("1g.10gb"), 1)]
    result = simulate_mig(MODEL, nodes=1, gpus_per_node=2, arrivals=asks, policy=make_layout_policy("frag", MODEL))
    # 3g@4 + 4g@0 fill GPU 0, 7g x2 cannot have two empty GPUs, 1g goes to GPU 1
    assert (result.placed, result.failed) == (3, 1)
    assert result.occupied_masks[0] == 0xFF
    assert max(result.curve) == round(100 * (3 + 4 + 14 + 1) / 14)


def test_arrivals_reach_the_target() -> None:
    asks = [MigAsk(profile("1g.10gb"), 1), MigAsk(profile("7g.80gb"), 1)]
    arrivals = mig_arrivals(asks, capacity_slices=70, seed=42)
    total = sum(ask.compute_slices for ask in arrivals)
    assert 91 - 7 < total <= 91


@pytest.mark.parametrize("policy_name", sorted(MIG_LAYOUT_POLICIES))
@pytest.mark.parametrize("model", [A100_40GB, H100_80GB])
def test_churn_frees_exactly_what_arrivals_took(policy_name: str, model: MigModel) -> None:
    names = [p.name for p in model.profiles if not p.name.endswith("+me")]
    timed = []
    for index in range(60):
        found = model.profile(names[index * 7 % len(names)])
        whole = model.profile(names[-1])
        assert found is not None and whole is not None
        ask = MigAsk(whole, 2) if index % 11 == 0 else MigAsk(found, 1)
        timed.append(TimedMigAsk(ask, created=index * 3, deleted=index * 3 + 5 + index % 17))
    result = replay_mig_churn(timed, nodes=1, gpus_per_node=4, policy=make_layout_policy(policy_name, model))
    assert result.final_masks == (0, 0, 0, 0)
    assert 0 < result.alloc_pct <= 100
    assert result.never_placed < len(timed)
