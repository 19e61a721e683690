"""Which admitted pods to evict so a pending pod's ClusterQueue can admit it (issue 14): Kueue's preemption on
quota, for a preemptor whose GPUs fit somewhere but whose queue is short (reclaimWithinCohort takes back what
other queues of the cohort borrow; withinClusterQueue makes room among the queue's own pods).

On a clone of the quota tree, remove allowed candidates until the preemptor's needs fit, in Kueue's order: pods of
other queues (which can only be borrowing ones) before the queue's own, lower priority first, newer first among
equals; a queue's pods are taken only while it still borrows what the preemptor needs (so its pods within its
nominal quota stay). Then give candidates back, most important first, while the needs still fit: every victim
left is needed. A gang is one unit. Pure: the caller evicts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kube_vgpu.extender.quota.accounting import CQ, FlavorResource, QuotaTree


@dataclass(frozen=True, slots=True)
class QuotaCandidate:
    uid: str
    cluster_queue: str
    amounts: Mapping[FlavorResource, int]  # what it is counted for in its queue
    priority: int
    created_s: float
    allowed: bool
    gang: str | None = None


def _order(preemptor_queue: str, unit: Sequence[QuotaCandidate]) -> tuple[bool, int, float]:
    """Least important first: other queues' pods, lower priority, newer."""
    return (unit[0].cluster_queue == preemptor_queue, max(c.priority for c in unit),
            -max(c.created_s for c in unit))


def _units(candidates: Sequence[QuotaCandidate]) -> list[tuple[QuotaCandidate, ...]]:
    by_gang: dict[str, list[QuotaCandidate]] = {}
    units: list[tuple[QuotaCandidate, ...]] = []
    for candidate in candidates:
        if candidate.gang is not None:
            by_gang.setdefault(candidate.gang, []).append(candidate)
        elif candidate.allowed:
            units.append((candidate,))
    units.extend(tuple(members) for members in by_gang.values() if all(m.allowed for m in members))
    return units


def _borrows(tree: QuotaTree, queue: str, needs: Mapping[FlavorResource, int]) -> bool:
    usage = tree.usage.get(queue, {})
    return any(usage.get(fr, 0) > tree.quota((CQ, queue), fr).nominal for fr, n in needs.items() if n > 0)


def find_quota_victims(tree: QuotaTree, preemptor_queue: str, needs: Mapping[FlavorResource, int],
                       candidates: Sequence[QuotaCandidate]) -> list[QuotaCandidate] | None:
    """The victims whose removal lets `needs` fit in `preemptor_queue` (least important first); [] when it fits
    already; None when even every allowed candidate is not enough. Never changes `tree`."""
    work = tree.clone()
    if not work.shortfalls(preemptor_queue, needs):
        return []

    def take(unit: Sequence[QuotaCandidate], sign: int) -> None:
        for member in unit:
            work.add(member.cluster_queue, member.amounts, -sign)

    removed: list[tuple[QuotaCandidate, ...]] = []
    for unit in sorted(_units(candidates), key=lambda u: _order(preemptor_queue, u)):
        queue = unit[0].cluster_queue
        # another queue gives back only what it borrows: once it is within its nominal quota, its pods stay
        if queue != preemptor_queue and not _borrows(work, queue, needs):
            continue
        take(unit, 1)
        removed.append(unit)
        if not work.shortfalls(preemptor_queue, needs):
            break
    else:
        return None
    victims: list[tuple[QuotaCandidate, ...]] = []
    for unit in sorted(removed, key=lambda u: _order(preemptor_queue, u), reverse=True):  # most important first
        take(unit, -1)
        if work.shortfalls(preemptor_queue, needs):
            take(unit, 1)
            victims.append(unit)
    victims.sort(key=lambda u: _order(preemptor_queue, u))
    return [member for unit in victims for member in unit]
