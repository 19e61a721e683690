"""binpack: fill the fullest GPUs and nodes first, keeping whole GPUs free for big requests."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kube_vgpu.extender.engine.policies.base import Policy, Scratch, free_memory_after, node_fill_after

if TYPE_CHECKING:
    from kube_vgpu.extender.engine.model import GpuState, NodeState, Placement, PlacementRequest
    from kube_vgpu.protocol import ContainerGpuRequest


class Binpack(Policy):
    name = "binpack"

    def choose_gpus(
        self,
        node: NodeState,
        request: PlacementRequest,
        container: ContainerGpuRequest,
        candidates: Sequence[GpuState],
        scratch: Scratch,
    ) -> Sequence[GpuState]:
        # least free memory left after placing (then fewest free cores), lowest index to break ties
        ranked = sorted(
            candidates,
            key=lambda gpu: (
                free_memory_after(gpu, container, scratch) / gpu.memory_mib,
                gpu.cores - gpu.used_cores - scratch.cores[gpu.position],
                gpu.index,
            ),
        )
        return ranked[: container.count]

    def score(self, node: NodeState, request: PlacementRequest, placement: Placement) -> float:
        return node_fill_after(node, placement)
