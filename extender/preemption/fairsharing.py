"""Preemption on quota with fair sharing on (--fair-sharing): Kueue's fair-sharing strategies replace the cohort
rules' "is the preemptor within its nominal quota" test between queues of one cohort tree. Pure: works on a clone.

Kueue (pkg/scheduler/preemption, fairPreemptions), with the default strategies
[LessThanOrEqualToFinalShare, LessThanInitialShare]:
  * the candidate queues (the preemptor's own, for withinClusterQueue, and the borrowing queues of its cohort
    that reclaimWithinCohort allows) are visited highest share first, the share recomputed after every eviction;
  * LessThanOrEqualToFinalShare: a candidate of another queue goes if the preemptor's queue's share with the
    preemptor admitted is <= the candidate's queue's share with the candidate gone (one at a time, least
    important first; a refused candidate is kept for the next strategy);
  * LessThanInitialShare, only if that was not enough: the first refused candidate of a queue goes if the
    preemptor's queue's share after admission is < that queue's share now;
  * a candidate below borrowWithinCohort's priority bound goes regardless of shares;
  * the preemptor's own queue's candidates go in their turn (withinClusterQueue allowed them already);
then victims are given back, most important first, while the preemptor still fits (as the classic search does).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kube_vgpu.extender.preemption.quota_victims import QuotaCandidate, _borrows, _order, _units
from kube_vgpu.extender.quota.accounting import FlavorResource, NodeKey, QuotaTree
from kube_vgpu.extender.quota.fairsharing import Share, queue_share

LESS_THAN_OR_EQUAL_TO_FINAL_SHARE = "LessThanOrEqualToFinalShare"
LESS_THAN_INITIAL_SHARE = "LessThanInitialShare"
#: Kueue's default fairSharing.preemptionStrategies
DEFAULT_STRATEGIES = (LESS_THAN_OR_EQUAL_TO_FINAL_SHARE, LESS_THAN_INITIAL_SHARE)
#: the lists Kueue's Configuration validation accepts (the second strategy, if any, is LessThanInitialShare)
ALLOWED_STRATEGIES = (
    DEFAULT_STRATEGIES,
    (LESS_THAN_OR_EQUAL_TO_FINAL_SHARE,),
    (LESS_THAN_INITIAL_SHARE,),
)


def parse_strategies(text: str) -> tuple[str, ...]:
    """--fair-sharing-preemption-strategies: comma-separated, one of Kueue's accepted lists; ValueError otherwise."""
    found = tuple(part.strip() for part in text.split(",") if part.strip())
    if found not in ALLOWED_STRATEGIES:
        allowed = "; ".join(",".join(s) for s in ALLOWED_STRATEGIES)
        raise ValueError(f"fair-sharing preemption strategies {text!r} are not one of Kueue's lists: {allowed}")
    return found

Unit = tuple[QuotaCandidate, ...]


def strategy_allows(strategy: str, preemptor_after: int, candidate_before: int, candidate_after: int) -> bool:
    """Kueue's two strategies, on weighted shares: the preemptor's queue with the preemptor admitted, the
    candidate's queue before and after the candidate is gone."""
    if strategy == LESS_THAN_OR_EQUAL_TO_FINAL_SHARE:
        return preemptor_after <= candidate_after
    if strategy == LESS_THAN_INITIAL_SHARE:
        return preemptor_after < candidate_before
    raise ValueError(f"unknown fair-sharing preemption strategy {strategy!r}")


@dataclass(frozen=True, slots=True)
class FairVictims:
    """The victims (least important first) and, per victim uid, the rule that chose it (for events)."""

    victims: list[QuotaCandidate]
    rules: dict[str, str]


class _Search:
    def __init__(self, tree: QuotaTree, weights: Mapping[NodeKey, int], preemptor_queue: str,
                 needs: Mapping[FlavorResource, int]) -> None:
        self.work = tree.clone()
        self.weights = weights
        self.queue = preemptor_queue
        self.needs = needs
        self.removed: list[Unit] = []
        self.rules: dict[str, str] = {}

    def share(self, queue: str) -> Share:
        return queue_share(self.work, self.weights, queue)

    def preemptor_after(self) -> Share:
        return queue_share(self.work, self.weights, self.queue, self.needs)

    def fits(self) -> bool:
        return not self.work.shortfalls(self.queue, self.needs)

    def take(self, unit: Unit, sign: int = 1) -> None:
        for member in unit:
            self.work.add(member.cluster_queue, member.amounts, -sign)

    def share_without(self, unit: Unit) -> Share:
        self.take(unit)
        try:
            return self.share(unit[0].cluster_queue)
        finally:
            self.take(unit, -1)

    def evict(self, unit: Unit, rule: str) -> bool:
        """Remove the unit; True when the preemptor fits now."""
        self.take(unit)
        self.removed.append(unit)
        for member in unit:
            self.rules[member.uid] = rule
        return self.fits()


def _highest_share(search: _Search, queues: Mapping[str, list[Unit]]) -> str:
    """The next queue to take from: the highest share now (Kueue's heap), then by name for a stable order."""
    return max(queues, key=lambda name: (search.share(name).value, name))


# complexity: Kueue's two-strategy loop, kept in one piece so it reads against fairPreemptions
def fair_quota_victims(  # noqa: C901
    tree: QuotaTree,
    weights: Mapping[NodeKey, int],
    preemptor_queue: str,
    needs: Mapping[FlavorResource, int],
    candidates: Sequence[QuotaCandidate],
    rules: Mapping[str, str],
    *,
    borrow_below_priority: int | None = None,
    strategies: Sequence[str] = DEFAULT_STRATEGIES,
) -> FairVictims | None:
    """Victims whose removal lets `needs` fit in `preemptor_queue` under Kueue's fair-sharing strategies; an empty
    list when it fits already; None when even the strategies' every allowed candidate is not enough. `rules`: the
    rule that allowed each candidate (kept for the preemptor's own queue's victims). Never changes `tree`."""
    search = _Search(tree, weights, preemptor_queue, needs)
    if search.fits():
        return FairVictims([], {})
    queues: dict[str, list[Unit]] = {}
    for unit in sorted(_units(candidates), key=lambda u: _order(preemptor_queue, u)):
        queue = unit[0].cluster_queue
        if queue == preemptor_queue or _borrows(search.work, queue, needs):
            queues.setdefault(queue, []).append(unit)
    mine_after = search.preemptor_after()
    retry: dict[str, list[Unit]] = {}
    fits = False
    first = strategies[0] if strategies else LESS_THAN_OR_EQUAL_TO_FINAL_SHARE
    while queues and not fits:
        queue = _highest_share(search, queues)
        units = queues.pop(queue)
        if queue == preemptor_queue:
            unit = units.pop(0)
            fits = search.evict(unit, rules.get(unit[0].uid, "withinClusterQueue"))
            mine_after = search.preemptor_after()
            if units:
                queues[queue] = units
            continue
        before = search.share(queue)
        for index, unit in enumerate(units):
            after = search.share_without(unit)
            below = borrow_below_priority is not None and max(c.priority for c in unit) < borrow_below_priority
            if below or strategy_allows(first, mine_after.value, before.value, after.value):
                if below:
                    rule = (f"borrowWithinCohort: priority below {borrow_below_priority}, {queue} borrows above "
                            f"its nominal quota")
                elif first == LESS_THAN_INITIAL_SHARE:
                    rule = (f"fairSharing: {queue} share {before.describe()} > {preemptor_queue} share "
                            f"{mine_after.describe()} after admission ({first})")
                else:
                    rule = (f"fairSharing: {queue} share {after.describe()} without this pod >= {preemptor_queue} "
                            f"share {mine_after.describe()} after admission ({first})")
                fits = search.evict(unit, rule)
                rest = units[index + 1:]
                if rest and _borrows(search.work, queue, needs):
                    queues[queue] = rest  # its share changed: the next queue is chosen again
                break
            retry.setdefault(queue, []).append(unit)
    if not fits and len(strategies) > 1:
        second = strategies[1]
        while retry and not fits:
            queue = _highest_share(search, retry)
            units = retry.pop(queue)
            now = search.share(queue)
            # Kueue's second strategy reads only the queue's share before: its first refused candidate goes
            if strategy_allows(second, mine_after.value, now.value, 0) and _borrows(search.work, queue, needs):
                fits = search.evict(units[0], f"fairSharing: {queue} share {now.describe()} > {preemptor_queue} "
                                              f"share {mine_after.describe()} after admission ({second})")
    if not fits:
        return None
    victims: list[Unit] = []
    for unit in reversed(search.removed):  # most recently taken first: Kueue's fillBackWorkloads order
        search.take(unit, -1)
        if not search.fits():
            search.take(unit, 1)
            victims.append(unit)
    victims.sort(key=lambda u: _order(preemptor_queue, u))
    chosen = [member for unit in victims for member in unit]
    return FairVictims(chosen, {m.uid: search.rules[m.uid] for m in chosen})


def borrow_below(preemptor_priority: int, policy_lower_priority: bool, threshold: int | None) -> int | None:
    """Kueue's allowBorrowingBelowPriority: with borrowWithinCohort LowerPriority, candidates of priority below
    this go regardless of shares (the preemptor's priority, or maxPriorityThreshold + 1 when lower)."""
    if not policy_lower_priority:
        return None
    if threshold is not None and threshold < preemptor_priority:
        return threshold + 1
    return preemptor_priority

