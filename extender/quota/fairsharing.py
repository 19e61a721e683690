"""Kueue's fair sharing: the dominant resource share (DRS) of a ClusterQueue or Cohort. Pure: reads a QuotaTree.

As Kueue computes it (pkg/cache fair_sharing.go), for a node with a parent cohort:

  borrowed(resource) = sum over flavors of max(0, usage + request - subtreeQuota)   (above its own quota)
  lendable(resource) = sum over flavors of potentialAvailable(parent)             (what the parent can lend)
  share              = max over resources of borrowed * 1000 // lendable, then * 1000 // weight (in thousandths)

so a queue within its nominal quota has share 0, one borrowing all its cohort can lend has 1000 (weight 1); a
weight of 2 halves the share. A weight of 0 makes the share infinite (INFINITE_SHARE) while anything is borrowed.
A node without a parent (no cohort) has share 0. Flavors are summed per resource name, as Kueue does.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from kube_vgpu.extender.quota.accounting import COHORT, CQ, FlavorResource, NodeKey, QuotaTree
from kube_vgpu.extender.quota.objects import DEFAULT_FAIR_WEIGHT_MILLI, QuotaConfig

#: Kueue's math.MaxInt: the share of a zero-weight node that borrows (it always loses)
INFINITE_SHARE = 2**63 - 1
#: shares are in thousandths of what the parent can lend (Kueue's scale)
SHARE_SCALE = 1000


@dataclass(frozen=True, slots=True)
class Share:
    """A node's weighted dominant resource share, and the resource that gave it ("" when nothing is borrowed)."""

    value: int
    resource: str = ""

    def describe(self) -> str:
        return "infinite (weight 0)" if self.value == INFINITE_SHARE else str(self.value)


def weights_of(config: QuotaConfig) -> dict[NodeKey, int]:
    """(kind, name) -> spec.fairSharing.weight in thousandths, for every ClusterQueue and Cohort object."""
    weights = {(CQ, name): queue.fair_weight for name, queue in config.cluster_queues.items()}
    weights.update({(COHORT, name): cohort.fair_weight for name, cohort in config.cohorts.items()})
    return weights


def _root(tree: QuotaTree, key: NodeKey) -> NodeKey:
    seen = {key}
    parent = tree.parent.get(key)
    while parent is not None and parent not in seen:  # cycles are cut in QuotaTree; guarded anyway
        seen.add(parent)
        key = parent
        parent = tree.parent.get(key)
    return key


def lendable(tree: QuotaTree, cohort: NodeKey) -> dict[str, int]:
    """resource -> what `cohort` could lend its children in all, summed over flavors (no usage anywhere)."""
    result: dict[str, int] = {}
    for fr in tree.subtree_quotas(_root(tree, cohort)):
        result[fr[1]] = result.get(fr[1], 0) + tree.potential_available(cohort, fr)
    return result


def dominant_resource_share(tree: QuotaTree, key: NodeKey, weight_milli: int = DEFAULT_FAIR_WEIGHT_MILLI,
                            request: Mapping[FlavorResource, int] | None = None, sign: int = 1) -> Share:
    """The node's weighted share now; with `request` (a ClusterQueue only), as if that were added (sign 1: the
    share with a pod admitted) or taken away (sign -1: the share with a victim gone). For a Cohort with a change,
    change a clone of the tree and ask without `request`."""
    parent = tree.parent.get(key)
    if parent is None:
        return Share(0)
    if request and key[0] != CQ:
        raise ValueError("a request is added to a ClusterQueue only; clone the tree for a Cohort")
    borrowed: dict[str, int] = {}
    for fr, quota in tree.subtree_quotas(key).items():
        amount = tree.node_usage(key, fr) + sign * (request or {}).get(fr, 0) - quota
        if amount > 0:
            borrowed[fr[1]] = borrowed.get(fr[1], 0) + amount
    if not borrowed:
        return Share(0)
    can_lend = lendable(tree, parent)
    ratio, dominant = 0, ""
    for resource in sorted(borrowed):  # sorted: ties go to the first name, as Kueue's
        if can_lend.get(resource, 0) > 0:
            value = borrowed[resource] * SHARE_SCALE // can_lend[resource]
            if value > ratio or not dominant:
                ratio, dominant = value, resource
    if weight_milli <= 0:
        return Share(INFINITE_SHARE, dominant or min(borrowed))
    return Share(ratio * 1000 // weight_milli, dominant)


def queue_share(tree: QuotaTree, weights: Mapping[NodeKey, int], queue: str,
                request: Mapping[FlavorResource, int] | None = None, sign: int = 1) -> Share:
    """A ClusterQueue's weighted share (with a request added, or taken away with sign -1)."""
    key = (CQ, queue)
    return dominant_resource_share(tree, key, weights.get(key, DEFAULT_FAIR_WEIGHT_MILLI), request, sign)
