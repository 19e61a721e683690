"""random (reference): any node that fits, uniformly at random; GPUs by best fit.

Every fitting node scores the same, so the caller's uniform tie-break (kube-scheduler's selectHost, or the
simulator's) makes the choice random, as the FGD simulator's RandomScore plugin does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kube_vgpu.extender.engine.policies._milli import BestFitGpuChoice

if TYPE_CHECKING:

    from kube_vgpu.extender.engine.model import NodeState, Placement, PlacementRequest


class RandomPolicy(BestFitGpuChoice):
    name = "random"
    #: the choice among equal scores must be uniform (a simulator that breaks ties by node order must not)
    random_tie_break = True


    def score(self, node: NodeState, request: PlacementRequest, placement: Placement) -> float:
        return 0.0
