"""Which binds of one node may write their Binding now.

kubelet admits a node's pods in the order their Bindings reach it, and kubelet's Allocate never names the pod, so
the device plugin takes the pending pod with the earliest bind time (deviceplugin/allocate.py). The two orders
agree if a bind starts writing only after every bind with an earlier bind time has been answered: binds to one
node are written one at a time.

One exception keeps bursts fast: binds whose assignments are identical (the same GPUs, MiB and cores for the same
containers; the annotation names no pod) may be written together. If kubelet admits such pods in another order
than their bind times, the device plugin hands each the other's assignment, which is the same assignment, so every
pod still runs exactly what its own annotation says. A burst of identical pods packed onto one GPU is such a group.

Turns are granted in arrival order: a bind joins the group being written only if nobody waits ahead of it, and a
different assignment waits until the node has nothing in flight. Pure bookkeeping; the caller holds a lock (or is
the event loop) and does the waiting.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

Wake = Callable[[], None]


@dataclass(slots=True)
class NodeTurns:
    #: the assignment being written, and how many binds are writing it
    writing: str | None = None
    writers: int = 0
    #: (assignment, wake) in arrival order
    waiting: deque[tuple[str, Wake]] = field(default_factory=deque)

    def request(self, assignment: str, wake: Wake) -> bool:
        """True: write now. False: `wake` is called (by a later finish()) when it is this bind's turn."""
        if not self.waiting and (self.writers == 0 or self.writing == assignment):
            self.writing = assignment
            self.writers += 1
            return True
        self.waiting.append((assignment, wake))
        return False

    def finish(self) -> None:
        """A bind that had its turn is done (answered, failed or given up)."""
        if self.writers <= 0:
            raise RuntimeError("finish() without a turn")
        self.writers -= 1
        if self.writers:
            return
        self.writing = None
        # the first waiter, and everyone right behind it with the same assignment, write together
        while self.waiting and (self.writing is None or self.waiting[0][0] == self.writing):
            assignment, wake = self.waiting.popleft()
            self.writing = assignment
            self.writers += 1
            wake()

    def withdraw(self, wake: Wake) -> bool:
        """Leave the queue before the turn came (the caller gave up). False if the turn was already granted:
        the caller then holds it and must finish()."""
        for index, (_, queued) in enumerate(self.waiting):
            if queued is wake:
                del self.waiting[index]
                return True
        return False

    @property
    def idle(self) -> bool:
        return not self.writers and not self.waiting
