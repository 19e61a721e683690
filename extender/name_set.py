"""Whether a list of node names holds exactly the names of another, in any order, without a dict lookup per name.

kube-scheduler's parallel filter plugins hand the extender the same feasible nodes in a new order every pod, as
fresh strings decoded from JSON. Telling that they are the nodes a filter asked before, through a dict of those
nodes, cost 2 ms at 5000 nodes (4 ms at the tail): each lookup chases the kept dict's table and key strings,
scattered over a large heap and out of the cache by then. A NameSet keeps the names as one string, sorted by their
hashes, and the sorted hashes in an array: a list is matched by hashing its names (the fresh strings, in the cache),
finding each hash among the kept ones over the array, and comparing the names laid out in that order with the kept
string, one comparison of contiguous memory. The answer is exact: equal hashes only pair the names up, and the
names themselves are compared.
"""

from __future__ import annotations

from collections.abc import Sequence
from operator import itemgetter

import numpy as np
import numpy.typing as npt

#: between the names in the kept string: no node name holds it (a DNS subdomain), and a list whose names do is
#: never kept (and never matches: its string would hold more of them)
SEPARATOR = "\0"


class NameSet:
    """Distinct names, kept to match other lists against (same_names)."""

    __slots__ = ("_hashes", "_joined")

    def __init__(self, hashes: npt.NDArray[np.int64], joined: str) -> None:
        self._hashes = hashes
        self._joined = joined

    @classmethod
    def of(cls, names: Sequence[str]) -> NameSet | None:
        """The names kept; None where they cannot be (two of one hash: a name given twice, or a rare collision; a
        name holding the separator; not all strings): callers then match lists as before."""
        count = len(names)
        if not count:
            return cls(np.zeros(0, dtype=np.int64), "")
        try:
            hashes = np.fromiter(map(hash, names), dtype=np.int64, count=count)
        except TypeError:
            return None
        order = np.argsort(hashes, kind="stable")
        hashes = hashes[order]
        if count > 1 and bool((hashes[1:] == hashes[:-1]).any()):
            return None
        ordered = [names[int(order[0])]] if count == 1 else list(itemgetter(*order.tolist())(names))
        try:
            joined = SEPARATOR.join(ordered)
        except TypeError:  # (not a string)
            return None
        if joined.count(SEPARATOR) != count - 1:
            return None
        return cls(hashes, joined)

    def __len__(self) -> int:
        return len(self._hashes)

    def same_names(self, names: Sequence[str]) -> bool:
        """Whether names are exactly the kept names, each once, in any order."""
        kept = self._hashes
        count = len(kept)
        if len(names) != count:
            return False
        if not count:
            return True
        try:
            hashes = np.fromiter(map(hash, names), dtype=np.int64, count=count)
        except TypeError:
            return False
        at = np.searchsorted(kept, hashes)
        np.minimum(at, count - 1, out=at)  # (a hash above every kept one: matched against the last, and unequal)
        if not np.array_equal(kept[at], hashes):
            return False
        # the kept hashes are distinct: each name found its own slot only if no two found the same one
        slots = np.zeros(count, dtype=np.bool_)
        slots[at] = True
        if not slots.all():
            return False
        laid_out = np.empty(count, dtype=object)
        laid_out[at] = names
        try:
            # one separator fewer than names, in each: equal strings are the same names in the same slots
            return SEPARATOR.join(laid_out.tolist()) == self._joined
        except TypeError:  # (not a string)
            return False


class LazyNameSet:
    """The NameSet of a list of names, built when first needed (a list matched only by identity or equality never
    pays for it), once: None where it cannot be."""

    __slots__ = ("_name_set", "_names", "_wanted")

    def __init__(self, names: Sequence[str]) -> None:
        self._names: Sequence[str] | None = names
        self._name_set: NameSet | None = None
        self._wanted = False

    def wanted(self) -> NameSet | None:
        """get(), but None the first time: the caller then matches its own way. Building costs ~3x one match by a
        dict (~3 ms against ~1 ms at 5000 names), so it pays only for names matched again and again (the same nodes
        every pod, the set carried from one filter to the next), not where kube-scheduler asks other nodes every pod
        (a new list, matched once)."""
        if not self._wanted:
            self._wanted = True
            return None
        return self.get()

    def get(self) -> NameSet | None:
        names = self._names
        if names is not None:
            self._names = None  # (built once, whatever it gave)
            self._name_set = NameSet.of(names)
        return self._name_set
