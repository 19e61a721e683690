"""What a new request shape's batch reads of every node, kept as arrays from one pod to the next.

A new request shape is placed on every node at once (policies.batch), and before this module every such pod read
each of 5000 nodes again: its GPU columns, host CPU, heartbeat and node-equivalence key, one node object (and the
objects it points to) after another. On this kind of machine that is memory latency, ~8 ms of a ~25 ms filter,
whatever the loop is written in. Here those values are gathered once into arrays, in the order of a node list (the
state's own order, NodeOrder, in which a new shape is walked), and only the nodes the state's change journal names
since are read again: the next new shape reads arrays.

Valid because every change to what is kept goes through the journal: a node's GPUs and (while a policy reading it is
in use, as the batch's policies do) its host CPU change by NodeState.touch, which journals the node's name; its
heartbeat by a node update, which journals it too; an added or deleted node is journaled. Pure: no I/O, no locking
(the state's lock covers it).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, NamedTuple, cast

import numpy as np

from kube_vgpu.extender.engine.policies.batch import (
    COLUMN_DTYPE,
    GPU_COLUMNS,
    Floats,
    GroupColumns,
    Ints,
    host_cpu,
    node_links,
    node_row,
)

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping, Sequence

    from kube_vgpu.extender.engine.model import NodeState

#: more journal entries since than this share of the list: gathered again in full (one pass, no per-node patching);
#: a heartbeat alone costs ~1 us to patch (every node journals one per heartbeat period: 5000 per 30 s)
REBUILD_SHARE = 1.0


class NodeColumns:
    """The batch inputs of a list of nodes, all of one group (GPUs alike, nothing left to fit.place), by position in
    the list: GPU columns, host CPU, link matrix, heartbeat (NaN: none) and node-equivalence key (0: of no
    class)."""

    __slots__ = ("columns", "cpu_total", "cpu_used", "equivalence_array", "equivalences", "group", "heartbeats",
                 "index", "journal_epoch", "journal_position", "links", "names", "nodes", "versions")

    def __init__(self, names: list[str], nodes: list[NodeState], group: tuple[int, str, int, int], columns: Ints,
                 equivalences: list[int], journal_epoch: int, journal_position: int) -> None:
        self.names = names
        self.nodes = nodes
        self.group = group
        self.columns = columns
        self.cpu_total, self.cpu_used = host_cpu(nodes)
        self.links = node_links(nodes)
        self.heartbeats = np.fromiter(map(_heartbeat, nodes), dtype=np.float64, count=len(nodes))
        #: node-equivalence keys, also as a list (the scheduler's results are keyed by the ints)
        self.equivalences = equivalences
        self.equivalence_array = np.array(equivalences, dtype=np.int64)
        #: name -> position, built when first needed
        self.index: dict[str, int] | None = None
        #: each node's version (NodeState.version) as read: a node journaled but not touched since changed only its
        #: heartbeat
        self.versions: list[int] = [node.version for node in nodes]
        self.journal_epoch = journal_epoch
        self.journal_position = journal_position

    @classmethod
    def gather(cls, names: list[str], nodes: list[NodeState], equivalences: Sequence[int | None],
               journal_epoch: int, journal_position: int) -> NodeColumns | None:
        """The columns of these nodes (names: theirs, in order; equivalences: their keys, None for none), or None
        where they are not all of one group."""
        rows = list(map(node_row, nodes))
        if not rows or None in rows:
            return None
        kept_rows = cast(list[tuple[tuple[int, str, int, int], bytes]], rows)
        group = kept_rows[0][0]
        if any(row[0] != group for row in kept_rows):
            return None
        columns = np.frombuffer(b"".join(row[1] for row in kept_rows), dtype=COLUMN_DTYPE).reshape(
            len(rows), group[0], GPU_COLUMNS).copy()  # patched in place later: a writable copy
        return cls(names, nodes, group, columns, [equivalence or 0 for equivalence in equivalences], journal_epoch,
                   journal_position)

    def patch(self, changed: Sequence[str], nodes: Mapping[str, NodeState],
              equivalence_of: Callable[[NodeState], int | None], journal_epoch: int, journal_position: int) -> bool:
        """Read again the nodes named in `changed` (the journal since the last patch; names not in the list are
        skipped): False where one is gone or no longer of the group (the columns are then of no use)."""
        index = self._index()
        positions: list[int] = []  # nodes touched since: everything read again
        rows: list[bytes] = []
        beat_positions: list[int] = []  # every node named: its heartbeat
        versions = self.versions
        for name in dict.fromkeys(changed):
            position = index.get(name)
            if position is None:
                continue
            node = nodes.get(name)
            if node is None:
                return False
            beat_positions.append(position)
            if node is self.nodes[position] and node.version == versions[position]:
                continue  # not touched since: only its heartbeat may have changed (every node's, every period)
            row = node_row(node)
            if row is None or row[0] != self.group:
                return False
            versions[position] = node.version
            self.nodes[position] = node
            self.equivalences[position] = equivalence_of(node) or 0
            positions.append(position)
            rows.append(row[1])
        if beat_positions:  # the arrays written once for all the nodes read again
            self.heartbeats[beat_positions] = list(map(_heartbeat, map(self.nodes.__getitem__, beat_positions)))
        if positions:
            self.columns[positions] = np.frombuffer(b"".join(rows), dtype=COLUMN_DTYPE).reshape(
                len(positions), self.group[0], GPU_COLUMNS)
            read = list(map(self.nodes.__getitem__, positions))
            self.cpu_total[positions], self.cpu_used[positions] = host_cpu(read)
            self.links[positions] = node_links(read)
            self.equivalence_array[positions] = list(map(self.equivalences.__getitem__, positions))
        self.journal_epoch = journal_epoch
        self.journal_position = journal_position
        return True

    def gathered(self) -> GroupColumns:
        """What policies.batch reads of every node kept."""
        return GroupColumns(self.group, self.columns, self.cpu_total, self.cpu_used, self.links, self.names)

    def select(self, names: list[str]) -> Selected | None:
        """The kept values of these nodes, in this order (kube-scheduler asks each pod the nodes its own plugins
        passed: the list kept, or part of it); None where one is not among the nodes kept."""
        if names is self.names or names == self.names:
            return Selected(self.nodes, self.equivalences, self.heartbeats, self.equivalence_array, self.gathered())
        index = self._index()
        try:
            positions = list(map(index.__getitem__, names))
        except KeyError:
            return None
        nodes = list(map(self.nodes.__getitem__, positions))
        equivalences = list(map(self.equivalences.__getitem__, positions))
        return Selected(nodes, equivalences, self.heartbeats[positions], self.equivalence_array[positions],
                        GroupColumns(self.group, self.columns[positions], self.cpu_total[positions],
                                     self.cpu_used[positions], self.links[positions], names))

    def _index(self) -> dict[str, int]:
        index = self.index
        if index is None:
            index = self.index = dict(zip(self.names, range(len(self.names)), strict=True))
        return index


def _heartbeat(node: NodeState) -> float:
    beat = node.heartbeat_s
    return math.nan if beat is None else beat


class Selected(NamedTuple):
    """Kept values of some of the nodes (NodeColumns.select), in the order asked."""

    nodes: list[NodeState]
    #: their node-equivalence keys (0: of no class)
    equivalences: list[int]
    #: their heartbeats (NaN: none)
    heartbeats: Floats
    equivalence_array: Ints
    gathered: GroupColumns

    def all_distinct_classes(self) -> bool:
        """Whether every node is of a node-equivalence class, and no two of the same."""
        ordered = np.sort(self.equivalence_array)  # sorted and compared: np.unique takes ~15x as long
        return bool(ordered.all()) and bool((ordered[1:] != ordered[:-1]).all())

