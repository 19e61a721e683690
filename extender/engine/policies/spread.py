"""spread: put each vGPU on the emptiest GPU of the emptiest node (least interference between tenants)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kube_vgpu.extender.engine.policies.base import Policy, Scratch, free_memory_after, node_fill_after

if TYPE_CHECKING:
    from kube_vgpu.extender.engine.model import GpuState, NodeState, Placement, PlacementRequest
    from kube_vgpu.protocol import ContainerGpuRequest


class Spread(Policy):
    name = "spread"

    def choose_gpus(
        self,
        node: NodeState,
        request: PlacementRequest,
        container: ContainerGpuRequest,
        candidates: Sequence[GpuState],
        scratch: Scratch,
    ) -> Sequence[GpuState]:
        ranked = sorted(
            candidates,
            key=lambda gpu: (
                -free_memory_after(gpu, container, scratch) / gpu.memory_mib,
                gpu.used_shares + scratch.shares[gpu.position],
                gpu.index,
            ),
        )
        return ranked[: container.count]

    def score(self, node: NodeState, request: PlacementRequest, placement: Placement) -> float:
        return 1.0 - node_fill_after(node, placement)
