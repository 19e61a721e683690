"""bestfit (reference BestFit): the node left with the least free CPU and GPU (normalised by the largest node,
equal weights) once the pod is placed; GPUs by best fit.

Score = int(100 * (1 - (0.5 (cpu_free - cpu) / 128 CPUs + 0.5 (gpu_free - gpu) / 8 GPUs))). The reference
then min-max normalises the scores, which keeps the set of best nodes, so it is left out.
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


class BestFit(BestFitGpuChoice):
    name = "bestfit"
    uses_host_cpu = True


    def score(self, node: NodeState, request: PlacementRequest, placement: Placement) -> float:
        milli, count = request_milli(request, node)
        left = (cpu_free_milli(node) - request.cpu_milli) / MAX_SPEC_CPU_MILLI * 0.5
        left += (sum(free_milli_list(node)) - milli * count) / MAX_SPEC_GPU_MILLI * 0.5
        return float(int((1.0 - left) * MAX_NODE_SCORE))
