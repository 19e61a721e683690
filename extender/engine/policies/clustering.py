"""clustering (reference GpuClustering): keep pods of one GPU kind (sharing, 1-GPU, 2-GPU, ...) together.

Bands, best first: nodes holding only this kind (75..100), nodes holding this kind among others (50..75),
empty nodes (25..50), nodes holding only other kinds (0..25); inside a band, fuller nodes score higher.
CPU-only pods score 0 everywhere (random node). GPUs by best fit.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kube_vgpu.extender.engine.policies._milli import (
    MAX_NODE_SCORE,
    MAX_SPEC_GPU_MILLI,
    BestFitGpuChoice,
    free_milli_list,
    go_div,
    pod_kind,
)

if TYPE_CHECKING:

    from kube_vgpu.extender.engine.model import NodeState, Placement, PlacementRequest


class Clustering(BestFitGpuChoice):
    name = "clustering"
    #: the score reads NodeState.pod_kinds besides GPU usage (state-keyed memos must include it)
    uses_pod_kinds = True


    def score(self, node: NodeState, request: PlacementRequest, placement: Placement) -> float:
        kind = pod_kind(request)
        if kind is None:
            return 0.0
        quarter = MAX_NODE_SCORE // 4
        fill = go_div(quarter * (MAX_SPEC_GPU_MILLI - sum(free_milli_list(node))), MAX_SPEC_GPU_MILLI)
        kinds = node.pod_kinds
        if kinds.get(kind, 0) > 0:
            return float(fill + (3 * quarter if len(kinds) == 1 else 2 * quarter))
        return float(fill + (quarter if not kinds else 0))
