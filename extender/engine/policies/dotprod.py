"""dotprod (reference, Tetris-style): prefer the node whose free (CPU, GPU) vector has the smallest dot product
with the pod's request, both normalised by the largest node (128 CPUs, 8 GPUs); GPUs by best fit.

Score = int(100 * (1 - dot / 2)), the FGD simulator's DotProductScore with merged GPU dimension and max
normalisation; its integer scores tie often and ties go to a random node.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kube_vgpu.extender.engine.policies._milli import (
    MAX_NODE_SCORE,
    MAX_SPEC_CPU_MILLI,
    MAX_SPEC_GPU_MILLI,
    BestFitGpuChoice,
    cpu_free_milli,
    free_milli_list,
    request_milli,
)

if TYPE_CHECKING:

    from kube_vgpu.extender.engine.model import NodeState, Placement, PlacementRequest


class DotProd(BestFitGpuChoice):
    name = "dotprod"
    uses_host_cpu = True


    def score(self, node: NodeState, request: PlacementRequest, placement: Placement) -> float:
        milli, count = request_milli(request, node)
        node_cpu = cpu_free_milli(node) / MAX_SPEC_CPU_MILLI
        node_gpu = sum(free_milli_list(node)) / MAX_SPEC_GPU_MILLI
        pod_cpu = request.cpu_milli / MAX_SPEC_CPU_MILLI
        pod_gpu = milli * count / MAX_SPEC_GPU_MILLI
        dot = (node_cpu * pod_cpu + node_gpu * pod_gpu) / 2
        return float(int(MAX_NODE_SCORE * (1 - dot)))
