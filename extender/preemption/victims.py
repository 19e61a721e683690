"""Which running pods to evict on one node so a pending pod fits its GPUs, and which node's victims to prefer.

kube-scheduler's DefaultPreemption (selectVictimsOnNode) and Kueue's preemptor, on our GPU model. On a copy of the
node, remove allowed candidates least important first (lowest priority, then latest start) until the preemptor
fits per engine.fit.place (memory, cores, exclusivity, vGPU slots and multi-GPU topology all count); if it never
fits, no victims here. Then give candidates back ("reprieve") from the most important down while the preemptor
still fits; the rest are the victims. So the lowest-priority, most recently started pods go first and no victim
is one whose removal does not help. A gang is one unit: evicting one member evicts them all, on every node.

Removing in order (rather than all at once, as kube-scheduler does) keeps Kueue's bound: a pod allowed because
its queue borrows (reclaimWithinCohort, borrowWithinCohort) is taken only while that queue still borrows, so its
pods within its nominal quota stay.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from kube_vgpu.extender.engine.fit import place
from kube_vgpu.extender.engine.model import FitFailure, GpuUsage, NodeState, Placement, PlacementRequest
from kube_vgpu.extender.engine.policies.base import Policy
from kube_vgpu.extender.quota.accounting import FlavorResource

#: what a pod counts in its ClusterQueue's quota, per (flavor, resource)
Charge = tuple[tuple[FlavorResource, int], ...]

#: kube-scheduler adds this to priorities before summing them, so negative priorities still sum sensibly
_PRIORITY_OFFSET = 2**31


@dataclass(frozen=True, slots=True)
class Candidate:
    """A pod running on the node. usage: what it holds there (its assignment, as the cluster state applies it);
    allowed: whether the rules let the preemptor evict it (rules.may_preempt)."""

    uid: str
    priority: int
    started_s: float
    usage: tuple[GpuUsage, ...]
    gang: str | None = None
    allowed: bool = True
    cluster_queue: str | None = None
    charge: Charge = ()


@dataclass(frozen=True, slots=True)
class GangMember:
    """A gang member on another node: evicted with the gang, counted in the cost, never freeing GPUs here."""

    uid: str
    priority: int
    started_s: float
    allowed: bool = True
    cluster_queue: str | None = None
    charge: Charge = ()


@dataclass(frozen=True, slots=True)
class Victims:
    node_name: str
    victims: tuple[Candidate, ...]  # on this node, least important first
    extra: tuple[GangMember, ...]  # their gangs' members elsewhere: the caller evicts them too
    placement: Placement  # where the preemptor goes once the victims are gone

    @property
    def count(self) -> int:
        return len(self.victims) + len(self.extra)

    def priorities(self) -> list[int]:
        return [v.priority for v in self.victims] + [m.priority for m in self.extra]


@dataclass(frozen=True, slots=True)
class NoVictims:
    node_name: str
    reason: str


@dataclass(frozen=True, slots=True)
class _Unit:
    """What is evicted together: one pod, or a gang's members here (and elsewhere)."""

    here: tuple[Candidate, ...]
    elsewhere: tuple[GangMember, ...]

    @property
    def priority(self) -> int:
        return max([c.priority for c in self.here] + [m.priority for m in self.elsewhere])

    @property
    def started_s(self) -> float:
        return min([c.started_s for c in self.here] + [m.started_s for m in self.elsewhere])


def _units(candidates: Iterable[Candidate], gangs: Mapping[str, Sequence[GangMember]]) -> tuple[list[_Unit], int]:
    """Allowed units, and how many candidates were left out because they or a gang mate may not be evicted."""
    by_gang: dict[str, list[Candidate]] = {}
    units: list[_Unit] = []
    refused = 0
    for candidate in candidates:
        if candidate.gang is not None:
            by_gang.setdefault(candidate.gang, []).append(candidate)
        elif candidate.allowed:
            units.append(_Unit((candidate,), ()))
        else:
            refused += 1
    for gang, here in by_gang.items():
        elsewhere = tuple(gangs.get(gang, ()))
        # a gang is preempted whole or not at all: one protected member protects it everywhere
        if all(c.allowed for c in here) and all(m.allowed for m in elsewhere):
            units.append(_Unit(tuple(here), elsewhere))
        else:
            refused += len(here)
    return units, refused


def _importance(unit: _Unit) -> tuple[int, float]:
    # kube-scheduler's MoreImportantPod: higher priority, then earlier start
    return (-unit.priority, unit.started_s)


class _Budget:
    """What may still be taken from each borrowing queue: a unit with a pod of such a queue is taken only while that
    queue still borrows something (Kueue's "candidate's queue is still borrowing" while it removes candidates)."""

    def __init__(self, reclaimable: Mapping[str, Mapping[FlavorResource, int]]) -> None:
        self.left = {queue: dict(amounts) for queue, amounts in reclaimable.items()}

    def _charges(self, unit: _Unit) -> list[tuple[str, Charge]]:
        """(queue, charge) of the unit's pods in a bounded queue."""
        found = [(c.cluster_queue, c.charge) for c in unit.here] + [(m.cluster_queue, m.charge) for m in unit.elsewhere]
        return [(queue, charge) for queue, charge in found if queue is not None and queue in self.left]

    def open(self, unit: _Unit) -> bool:
        return all(any(n > 0 for n in self.left[queue].values()) for queue, _ in self._charges(unit))

    def take(self, unit: _Unit, sign: int) -> None:
        for queue, charge in self._charges(unit):
            left = self.left[queue]
            for fr, amount in charge:
                if fr in left:
                    left[fr] -= sign * amount


def _remove(work: NodeState, unit: _Unit, budget: _Budget, sign: int) -> None:
    """Take the unit's pods off the copy (sign 1) or give them back (sign -1)."""
    for pod in unit.here:
        work.apply_usage(pod.usage, -sign)
    budget.take(unit, sign)


def find_victims(
    node: NodeState,
    request: PlacementRequest,
    candidates: Sequence[Candidate],
    gpu_policy: Policy,
    node_policy: Policy,
    *,
    gangs: Mapping[str, Sequence[GangMember]] | None = None,
    reclaimable: Mapping[str, Mapping[FlavorResource, int]] | None = None,
    check_host: bool = False,
) -> Victims | NoVictims:
    """The smallest set of allowed candidates (least important first) whose eviction lets `request` fit on
    `node`. `gangs`: gang key -> its members on other nodes. `reclaimable`: for each queue whose pods are allowed
    only because it borrows, what it borrows in resources the preemptor needs (rules.reclaimable); its pods are
    taken only while it still borrows. Never changes `node` (works on a copy)."""
    units, refused = _units(candidates, gangs or {})
    budget = _Budget(reclaimable or {})
    work = node.copy()

    def fits() -> Placement | None:
        result = place(work, request, gpu_policy, node_policy, check_host=check_host)
        return result if isinstance(result, Placement) else None

    removed: list[_Unit] = []
    lent_out = 0  # pods kept because their queue no longer borrows
    if fits() is None:
        for unit in sorted(units, key=_importance, reverse=True):  # least important first
            if not budget.open(unit):
                lent_out += len(unit.here)
                continue
            _remove(work, unit, budget, 1)
            removed.append(unit)
            if fits() is not None:
                break
    failure = place(work, request, gpu_policy, node_policy, check_host=check_host)
    if isinstance(failure, FitFailure):
        kept = f"; {refused} pod(s) here may not be preempted" if refused else ""
        kept += f"; {lent_out} kept as their queue would no longer borrow" if lent_out else ""
        return NoVictims(node.name, f"does not fit even with every preemptible pod gone: {failure.reason}{kept}")
    # give back from the most important down while the preemptor still fits: every victim left is needed
    victims: list[_Unit] = []
    for unit in sorted(removed, key=_importance):
        _remove(work, unit, budget, -1)
        if fits() is None:
            _remove(work, unit, budget, 1)
            victims.append(unit)
    # greedy reprieve is minimal when fit is monotone; a GPU policy's choice need not be, so check once more
    # that each victim is still needed, and give back any that is not (giving back never breaks the budget)
    changed = True
    while changed:
        changed = False
        for unit in sorted(victims, key=_importance):
            _remove(work, unit, budget, -1)
            if fits() is not None:
                victims.remove(unit)
                changed = True
                break
            _remove(work, unit, budget, 1)
    placement = fits()
    assert placement is not None  # every step above keeps the preemptor fitting
    victims.sort(key=_importance, reverse=True)
    return Victims(
        node.name,
        tuple(pod for unit in victims for pod in unit.here),
        tuple(member for unit in victims for member in unit.elsewhere),
        placement,
    )


def _node_cost(found: Victims) -> tuple[int, int, int, float]:
    priorities = found.priorities()
    if not priorities:
        return (-_PRIORITY_OFFSET, 0, 0, 0.0)
    highest = max(priorities)
    # among the most important victims, the earliest start; a later one costs less (less work lost)
    starts = [v.started_s for v in found.victims if v.priority == highest]
    starts += [m.started_s for m in found.extra if m.priority == highest]
    return (highest, sum(p + _PRIORITY_OFFSET for p in priorities), found.count, -min(starts))


def pick_node(results: Iterable[Victims]) -> Victims | None:
    """kube-scheduler's pickOneNodeForPreemption: lowest highest-victim priority, then lowest sum of priorities,
    then fewest victims, then the latest start among the most important victims; ties keep the first."""
    best: Victims | None = None
    best_cost: tuple[int, int, int, float] | None = None
    for found in results:
        cost = _node_cost(found)
        if best_cost is None or cost < best_cost:
            best, best_cost = found, cost
    return best
