"""packing (reference GpuPacking): use partly-used GPUs first, then idle GPUs of partly-used nodes, and only then
an idle node; among idle nodes the smaller ones. GPUs by best fit; CPU-only pods go to a random node.

Bands: sharing GPUs already in use 50..100 (fuller GPU scores higher), idle GPUs of a used node 33..50
(fewer idle GPUs taken scores higher), an idle node 0..33 (fewer GPUs scores higher).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kube_vgpu.extender.engine.policies._milli import MAX_NODE_SCORE, BestFitGpuChoice, free_milli_list, request_milli

if TYPE_CHECKING:

    from kube_vgpu.extender.engine.model import NodeState, Placement, PlacementRequest

_MILLI = 1000


class Packing(BestFitGpuChoice):
    name = "packing"


    def score(self, node: NodeState, request: PlacementRequest, placement: Placement) -> float:
        milli, count = request_milli(request, node)
        if count == 0:
            return 0.0
        free = free_milli_list(node)
        idle = sum(1 for f in free if f == _MILLI)
        if idle == len(free):  # an untouched node
            return float(max(MAX_NODE_SCORE // 3 - idle, idle))
        needed = count
        idle_used = 0
        used: list[int] = []
        for f in sorted(free):  # least free first, as the reference walks them
            if needed == 0:
                break
            if milli <= f:
                needed -= 1
                used.append(f)
                if f == _MILLI:
                    idle_used += 1
        if needed:
            return 0.0
        if idle_used:
            return float(max(MAX_NODE_SCORE // 2 - idle_used, MAX_NODE_SCORE // 3))
        free_ratio = sum(f * 100 // _MILLI for f in used)
        return float(max(MAX_NODE_SCORE - free_ratio // 10, MAX_NODE_SCORE // 2))
