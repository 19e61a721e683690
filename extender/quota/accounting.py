"""Quota arithmetic, exactly Kueue's (pkg/cache resource_node.go): pure, no I/O, no locks.

Every ClusterQueue and Cohort is a node of a tree (cohorts may have parent cohorts). For one (flavor, resource):

  subtreeQuota(cq)      = nominal
  subtreeQuota(cohort)  = own nominal + sum over children of (subtreeQuota(child) - guaranteed(child))
  guaranteed(node)      = max(0, subtreeQuota(node) - lendingLimit)  if lendingLimit is set, else 0
                          (the part of a node's quota it never lends to its cohort)
  usage(cohort)         = sum over children of max(0, usage(child) - guaranteed(child))
  available(root)       = subtreeQuota - usage
  available(node)       = max(0, guaranteed - usage)                  (local, never visible to the parent)
                          + min(available(parent),
                                subtreeQuota - guaranteed - max(0, usage - guaranteed) + borrowingLimit)
                                                                      (the min only when borrowingLimit is set)
  potentialAvailable    = the same with no usage anywhere (the most the node could ever get)

A workload fits when, for every (flavor, resource) it needs, need <= available.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from kube_vgpu.extender.quota.objects import ClusterQueue, Cohort, ResourceQuota

FlavorResource = tuple[str, str]  # (flavor, resource)
NodeKey = tuple[str, str]  # ("ClusterQueue" | "Cohort", name): a cohort and a queue may share a name

CQ = "ClusterQueue"
COHORT = "Cohort"
_NO_QUOTA = ResourceQuota(0)


@dataclass(frozen=True, slots=True)
class Shortfall:
    """Why a need does not fit one (flavor, resource) of a ClusterQueue."""

    flavor: str
    resource: str
    need: int
    used: int
    available: int
    potential: int  # the most this queue could ever hold (no usage anywhere): "limit" in reasons
    quota: ResourceQuota

    @property
    def never_fits(self) -> bool:
        """Even an empty cohort could not hold it: waiting does not help."""
        return self.need > self.potential


@dataclass(frozen=True, slots=True)
class FlavorResourceStatus:
    flavor: str
    resource: str
    nominal: int
    borrowing_limit: int | None
    lending_limit: int | None
    used: int
    borrowed: int  # usage above nominal (Kueue's status.flavorsUsage[].borrowed)
    lent: int  # this queue's lendable, unused quota that the rest of its cohort must be using now
    available: int
    potential: int


class QuotaTree:
    """ClusterQueues and Cohorts with their quotas, and the usage of each ClusterQueue."""

    def __init__(self, cluster_queues: Iterable[ClusterQueue], cohorts: Iterable[Cohort] = ()) -> None:
        self.quotas: dict[NodeKey, dict[FlavorResource, ResourceQuota]] = {}
        self.parent: dict[NodeKey, NodeKey | None] = {}
        self.children: dict[NodeKey, list[NodeKey]] = {}
        for cohort in cohorts:
            key = (COHORT, cohort.name)
            self.quotas[key] = cohort.quotas()
            self.parent[key] = (COHORT, cohort.parent) if cohort.parent else None
        for cq in cluster_queues:
            key = (CQ, cq.name)
            self.quotas[key] = cq.quotas()
            self.parent[key] = (COHORT, cq.cohort) if cq.cohort else None
        # a cohort named by a queue or a parent but without an object exists, with no quota and no parent
        for named in [p for p in self.parent.values() if p is not None]:
            if named not in self.parent:
                self.parent[named] = None
                self.quotas[named] = {}
        #: cohorts in a cycle: Kueue disables every member; here they are treated as roots so sums terminate
        self.cyclic: set[str] = self._find_cycles()
        for name in self.cyclic:
            self.parent[(COHORT, name)] = None
        for key, parent in self.parent.items():
            self.children.setdefault(key, [])
            if parent is not None:
                self.children.setdefault(parent, []).append(key)
        self.usage: dict[str, dict[FlavorResource, int]] = {}  # ClusterQueue name -> usage
        self._subtree: dict[NodeKey, dict[FlavorResource, int]] = {}
        self._usage_memo: dict[tuple[NodeKey, FlavorResource], int] = {}
        for key in self.parent:
            self._subtree_quota(key)

    # --- structure ------------------------------------------------------------------------------
    def _find_cycles(self) -> set[str]:
        cyclic: set[str] = set()
        for start in [k for k in self.parent if k[0] == COHORT]:
            path: list[NodeKey] = []
            node: NodeKey | None = start
            while node is not None and node not in path:
                path.append(node)
                node = self.parent.get(node)
            if node is not None and node in path:  # came back to a node on the path: the cycle is path[index(node):]
                cyclic.update(k[1] for k in path[path.index(node):])
        return cyclic

    def in_cycle(self, cluster_queue: str) -> str | None:
        """The first cohort of a cycle above this queue (Kueue stops admitting there), or None."""
        node = self.parent.get((CQ, cluster_queue))
        seen = set()
        while node is not None and node not in seen:
            if node[1] in self.cyclic:
                return node[1]
            seen.add(node)
            node = self.parent.get(node)
        return None

    def has(self, cluster_queue: str) -> bool:
        return (CQ, cluster_queue) in self.parent

    def root_of(self, cluster_queue: str) -> str | None:
        node = self.parent.get((CQ, cluster_queue))
        root = None
        while node is not None:
            root = node[1]
            node = self.parent.get(node)
        return root

    # --- Kueue's quantities -----------------------------------------------------------------------
    def quota(self, key: NodeKey, fr: FlavorResource) -> ResourceQuota:
        return self.quotas.get(key, {}).get(fr, _NO_QUOTA)

    def _subtree_quota(self, key: NodeKey) -> dict[FlavorResource, int]:
        found = self._subtree.get(key)
        if found is not None:
            return found
        result = {fr: q.nominal for fr, q in self.quotas.get(key, {}).items()}
        if key[0] == COHORT:
            for child in [k for k, p in self.parent.items() if p == key]:
                child_subtree = self._subtree_quota(child)
                for fr, amount in child_subtree.items():
                    result[fr] = result.get(fr, 0) + amount - self._guaranteed(child, fr, child_subtree)
        self._subtree[key] = result
        return result

    def subtree_quotas(self, key: NodeKey) -> Mapping[FlavorResource, int]:
        """Every (flavor, resource) of the node's subtree quota (read-only: it is memoised)."""
        return self._subtree_quota(key)

    def subtree_quota(self, key: NodeKey, fr: FlavorResource) -> int:
        return self._subtree_quota(key).get(fr, 0)

    def _guaranteed(self, key: NodeKey, fr: FlavorResource, subtree: Mapping[FlavorResource, int]) -> int:
        lending = self.quota(key, fr).lending_limit
        return max(0, subtree.get(fr, 0) - lending) if lending is not None else 0

    def guaranteed(self, key: NodeKey, fr: FlavorResource) -> int:
        return self._guaranteed(key, fr, self._subtree_quota(key))

    def node_usage(self, key: NodeKey, fr: FlavorResource) -> int:
        if key[0] == CQ:
            return self.usage.get(key[1], {}).get(fr, 0)
        memo = self._usage_memo.get((key, fr))
        if memo is None:
            memo = sum(max(0, self.node_usage(child, fr) - self.guaranteed(child, fr))
                       for child in self.children.get(key, ()))
            self._usage_memo[(key, fr)] = memo
        return memo

    def local_available(self, key: NodeKey, fr: FlavorResource) -> int:
        return max(0, self.guaranteed(key, fr) - self.node_usage(key, fr))

    def available(self, key: NodeKey, fr: FlavorResource) -> int:
        """Remaining capacity for `key`, borrowing through its cohorts; negative after over-admission."""
        parent = self.parent.get(key)
        if parent is None:
            return self.subtree_quota(key, fr) - self.node_usage(key, fr)
        parent_available = self.available(parent, fr)
        borrowing = self.quota(key, fr).borrowing_limit
        if borrowing is not None:
            guaranteed = self.guaranteed(key, fr)
            stored_in_parent = self.subtree_quota(key, fr) - guaranteed
            used_in_parent = max(0, self.node_usage(key, fr) - guaranteed)
            parent_available = min(stored_in_parent - used_in_parent + borrowing, parent_available)
        return self.local_available(key, fr) + parent_available

    def potential_available(self, key: NodeKey, fr: FlavorResource) -> int:
        parent = self.parent.get(key)
        if parent is None:
            return self.subtree_quota(key, fr)
        result = self.guaranteed(key, fr) + self.potential_available(parent, fr)
        borrowing = self.quota(key, fr).borrowing_limit
        if borrowing is not None:
            result = min(self.subtree_quota(key, fr) + borrowing, result)
        return result

    # --- usage ----------------------------------------------------------------------------------
    def add(self, cluster_queue: str, amounts: Mapping[FlavorResource, int], sign: int = 1) -> None:
        usage = self.usage.setdefault(cluster_queue, {})
        for fr, amount in amounts.items():
            usage[fr] = usage.get(fr, 0) + sign * amount
        self._usage_memo.clear()

    def shortfalls(self, cluster_queue: str, needs: Mapping[FlavorResource, int]) -> list[Shortfall]:
        """Every (flavor, resource) where the need exceeds what the queue has available now."""
        key = (CQ, cluster_queue)
        result = []
        for fr, need in needs.items():
            if need <= 0:
                continue
            available = self.available(key, fr)
            if need > available:
                result.append(Shortfall(fr[0], fr[1], need, self.node_usage(key, fr), available,
                                        self.potential_available(key, fr), self.quota(key, fr)))
        return result

    def status(self, cluster_queue: str, fr: FlavorResource) -> FlavorResourceStatus:
        key = (CQ, cluster_queue)
        quota = self.quota(key, fr)
        used = self.node_usage(key, fr)
        lent = 0
        parent = self.parent.get(key)
        if parent is not None:
            guaranteed = self.guaranteed(key, fr)
            lendable = self.subtree_quota(key, fr) - guaranteed
            stored = max(0, used - guaranteed)
            others = self.node_usage(parent, fr) - stored
            without_me = self.subtree_quota(parent, fr) - lendable
            lent = max(0, min(others - without_me, lendable - stored))
        return FlavorResourceStatus(
            flavor=fr[0],
            resource=fr[1],
            nominal=quota.nominal,
            borrowing_limit=quota.borrowing_limit,
            lending_limit=quota.lending_limit,
            used=used,
            borrowed=max(0, used - quota.nominal),
            lent=lent,
            # reported as Kueue reports it: never below 0 (an over-admitted queue, e.g. after its quota was
            # lowered, has nothing available, not a debt; the arithmetic above keeps the negative value)
            available=max(0, self.available(key, fr)),
            potential=self.potential_available(key, fr),
        )

    def cohort_totals(self, cohort: str, fr: FlavorResource) -> tuple[int, int]:
        """(subtreeQuota, usage) of a cohort, for reports."""
        key = (COHORT, cohort)
        return self.subtree_quota(key, fr), self.node_usage(key, fr)

    def clone(self) -> QuotaTree:
        """A copy whose usage can be changed freely (a future preemptor simulates removing victims on it)."""
        copy = object.__new__(QuotaTree)
        copy.quotas = self.quotas
        copy.parent = self.parent
        copy.children = self.children
        copy.cyclic = self.cyclic
        copy._subtree = self._subtree
        copy.usage = {name: dict(values) for name, values in self.usage.items()}
        copy._usage_memo = {}
        return copy
