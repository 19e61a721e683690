"""Where a new MIG instance goes when the scheduler partitions GPUs itself (dynamic MIG), pure (no I/O).

A MIG-capable GPU's memory is 8 slots; a GPU instance of a profile takes `memory_slices` consecutive slots
starting on one of the profile's legal start slots (kube_vgpu.protocol.mig, NVIDIA's placement tables). Which
start a profile takes decides which profiles still fit later: a 1g instance at slot 0 rules out 4g (legal only at
0) and 3g at 0 on that GPU for as long as it lives, the same instance at slot 6 rules out neither.

On A100, H100 and H200 the placements imply every other rule (instance counts, the 7 compute slices), so a GPU's
layout is fully described by the bit mask of its occupied memory slots: 256 states, and everything below is
memoised by mask.

Policies choose (GPU, start) for one instance of a profile:
* `first-fit`: the first GPU (in the caller's order) where it fits, at its lowest free legal start;
* `best-fit`: the GPU with the fewest free slots where it fits (ties: order), lowest free legal start;
* `frag` (ours): the placement that adds the least MIG fragmentation, the idea of FGD (Weng et al., ATC'23) on
  MIG slots. For a profile p, the free slots of a GPU that no free legal placement of p covers are fragmented for
  p; a GPU's fragmentation is the sum over profiles of p's expected share of the workload times that count. The
  workload is learned from the instances asked so far (`ProfileMix`, no knowledge of future asks). Ties: fullest
  GPU (best fit), then order, then lowest start.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Protocol

from kube_vgpu.protocol.mig import MIG_MEMORY_SLOTS, MigModel, MigProfile, legal_layout

ALL_SLOTS_MASK = (1 << MIG_MEMORY_SLOTS) - 1


def placement_mask(profile: MigProfile, start: int) -> int:
    """The occupied-slot bits of one instance of `profile` at `start`."""
    return ((1 << profile.memory_slices) - 1) << start


@cache
def free_starts(profile: MigProfile, occupied_mask: int) -> tuple[int, ...]:
    """The legal starts of `profile` whose slots are all free in a GPU with `occupied_mask`, lowest first."""
    return tuple(start for start in profile.starts if not placement_mask(profile, start) & occupied_mask)


@cache
def uncoverable_free_slots(profile: MigProfile, occupied_mask: int) -> int:
    """How many free slots no free legal placement of `profile` covers: idle memory `profile` cannot use."""
    coverable = 0
    for start in free_starts(profile, occupied_mask):
        coverable |= placement_mask(profile, start)
    free = ~occupied_mask & ALL_SLOTS_MASK
    return (free & ~coverable).bit_count()


def free_slot_count(occupied_mask: int) -> int:
    return MIG_MEMORY_SLOTS - occupied_mask.bit_count()


class ProfileMix:
    """The expected share of each profile among future asks, learned from the asks seen so far (counts), with one
    pseudo-ask per placeable profile of the model so an unseen profile is not taken as impossible. `version`
    changes with the weights, so callers can memoise fragmentation per version."""

    __slots__ = ("_counts", "_profiles", "version")

    def __init__(self, model: MigModel, profile_names: Sequence[str] | None = None) -> None:
        names = profile_names if profile_names is not None else [
            p.name for p in model.profiles if not p.name.endswith("+me")]
        self._profiles: dict[str, MigProfile] = {}
        for name in names:
            profile = model.profile(name)
            if profile is None:
                raise ValueError(f"{model.key} has no MIG profile {name!r}")
            self._profiles[name] = profile
        self._counts: dict[str, int] = {name: 1 for name in self._profiles}
        self.version = 0

    def observe(self, profile: MigProfile) -> None:
        if profile.name in self._counts:
            self._counts[profile.name] += 1
            self.version += 1

    def weights(self) -> list[tuple[MigProfile, float]]:
        total = sum(self._counts.values())
        return [(self._profiles[name], count / total) for name, count in self._counts.items()]


class FragmentationMemo:
    """GPU fragmentation by occupied mask for the current weights of a ProfileMix (recomputed when they change)."""

    __slots__ = ("_by_mask", "_mix", "_version")

    def __init__(self, mix: ProfileMix) -> None:
        self._mix = mix
        self._version = -1
        self._by_mask: dict[int, float] = {}

    def __call__(self, occupied_mask: int) -> float:
        if self._version != self._mix.version:
            self._by_mask.clear()
            self._version = self._mix.version
        value = self._by_mask.get(occupied_mask)
        if value is None:
            value = sum(weight * uncoverable_free_slots(profile, occupied_mask)
                        for profile, weight in self._mix.weights())
            self._by_mask[occupied_mask] = value
        return value


@dataclass(frozen=True, slots=True)
class MigChoice:
    gpu: int  # index into the caller's list of GPU masks
    start: int


class MigLayoutPolicy(Protocol):
    """Chooses where one instance of a profile goes among candidate GPUs given by their occupied masks, in the
    caller's order. `observe` is told every ask (placed or not) before the choice, as a live scheduler sees each
    pod once submitted; policies that learn nothing ignore it."""

    name: str

    def observe(self, profile: MigProfile) -> None: ...

    def choose(self, profile: MigProfile, occupied_masks: Sequence[int]) -> MigChoice | None: ...


class FirstFit:
    name = "first-fit"

    def observe(self, profile: MigProfile) -> None:
        pass

    def choose(self, profile: MigProfile, occupied_masks: Sequence[int]) -> MigChoice | None:
        for gpu, mask in enumerate(occupied_masks):
            starts = free_starts(profile, mask)
            if starts:
                return MigChoice(gpu, starts[0])
        return None


class BestFit:
    name = "best-fit"

    def observe(self, profile: MigProfile) -> None:
        pass

    def choose(self, profile: MigProfile, occupied_masks: Sequence[int]) -> MigChoice | None:
        best: tuple[int, int] | None = None  # (free slots, gpu)
        for gpu, mask in enumerate(occupied_masks):
            if free_starts(profile, mask):
                key = (free_slot_count(mask), gpu)
                if best is None or key < best:
                    best = key
        if best is None:
            return None
        return MigChoice(best[1], free_starts(profile, occupied_masks[best[1]])[0])


class FragAware:
    """The `frag` policy: the least added MIG fragmentation under the ProfileMix learned from `observe`."""

    name = "frag"
    __slots__ = ("_best_by_mask", "_best_version", "fragmentation", "mix")

    def __init__(self, mix: ProfileMix) -> None:
        self.mix = mix
        self.fragmentation = FragmentationMemo(mix)
        self._best_by_mask: dict[tuple[str, int], tuple[float, int] | None] = {}
        self._best_version = -1

    def observe(self, profile: MigProfile) -> None:
        self.mix.observe(profile)

    def _best_on(self, profile: MigProfile, mask: int) -> tuple[float, int] | None:
        """(fragmentation added, start) of the best start on a GPU with `mask`; None when it does not fit."""
        if self._best_version != self.mix.version:
            self._best_by_mask.clear()
            self._best_version = self.mix.version
        key = (profile.name, mask)
        if key in self._best_by_mask:
            return self._best_by_mask[key]
        before = self.fragmentation(mask)
        best: tuple[float, int] | None = None
        for start in free_starts(profile, mask):
            # a float sum of weights: rounded so that equal layouts compare equal and ties fall to the start
            added = round(self.fragmentation(mask | placement_mask(profile, start)) - before, 9)
            if best is None or (added, start) < best:
                best = (added, start)
        self._best_by_mask[key] = best
        return best

    def choose(self, profile: MigProfile, occupied_masks: Sequence[int]) -> MigChoice | None:
        best: tuple[float, int, int, int] | None = None  # (added, free slots, gpu, start)
        for gpu, mask in enumerate(occupied_masks):
            on_gpu = self._best_on(profile, mask)
            if on_gpu is None:
                continue
            key = (on_gpu[0], free_slot_count(mask), gpu, on_gpu[1])
            if best is None or key < best:
                best = key
        return None if best is None else MigChoice(best[2], best[3])


#: The MIG layout policies by name (an explicit registry, as the placement policies' registry.py).
MIG_LAYOUT_POLICIES: dict[str, Callable[[MigModel], MigLayoutPolicy]] = {
    "first-fit": lambda model: FirstFit(),
    "best-fit": lambda model: BestFit(),
    "frag": lambda model: FragAware(ProfileMix(model)),
}


def make_layout_policy(name: str, model: MigModel) -> MigLayoutPolicy:
    factory = MIG_LAYOUT_POLICIES.get(name)
    if factory is None:
        raise ValueError(f"unknown MIG layout policy {name!r} (known: {', '.join(MIG_LAYOUT_POLICIES)})")
    return factory(model)


def layout_of(model: MigModel, occupied: Mapping[int, str]) -> int:
    """The occupied mask of a GPU from its instances {start: profile name}; ValueError when they are not legal."""
    why = legal_layout(model, [(name, start) for start, name in occupied.items()])
    if why is not None:
        raise ValueError(why)
    mask = 0
    for start, name in occupied.items():
        profile = model.profile(name)
        assert profile is not None
        mask |= placement_mask(profile, start)
    return mask
