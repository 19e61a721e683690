"""random (reference): any node that fits, uniformly at random; GPUs by best fit.

Every fitting node scores the same, so the caller's uniform tie-break (kube-scheduler's selectHost, or the
simulator's) makes the choice random, as the FGD simulator's RandomScore plugin does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ._milli import best_fit_gpus
from .base import Policy, Scratch, register

if TYPE_CHECKING:
    from kube_vgpu.protocol import ContainerGpuRequest

    from ..model import GpuState, NodeState, Placement, PlacementRequest


@register
class RandomPolicy(Policy):
    name = "random"
    #: the choice among equal scores must be uniform (a simulator that breaks ties by node order must not)
    random_tie_break = True

    def choose_gpus(
        self,
        node: NodeState,
        request: PlacementRequest,
        container: ContainerGpuRequest,
        candidates: Sequence[GpuState],
        scratch: Scratch,
    ) -> Sequence[GpuState]:
        return best_fit_gpus(container, candidates, scratch)

    def score(self, node: NodeState, request: PlacementRequest, placement: Placement) -> float:
        return 0.0
