"""Helpers shared by the trace-reference policies (random, dotprod, clustering, packing, bestfit, fgd) and ours.

They see a node the way the FGD paper's simulator does: free milli-CPU, and free milli-GPU per GPU (1000 = one
whole GPU; a GPU's `cores` maps to 1000). Integer score arithmetic follows the reference (Go int64 division
truncates toward zero), because its 0..100 integer scores tie often and ties are broken at random.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..fragmentation import MILLI_PER_GPU

if TYPE_CHECKING:
    from kube_vgpu.protocol import ContainerGpuRequest

    from ..model import GpuState, NodeState, Placement, PlacementRequest
    from .base import Scratch

#: the reference's normalisers: the largest node it knows (128 cores, 8 GPUs)
MAX_SPEC_CPU_MILLI = 128_000
MAX_SPEC_GPU_MILLI = 8_000
MAX_NODE_SCORE = 100


def gpu_free_milli(gpu: GpuState) -> int:
    """Free milli-GPU of one GPU (0 when held exclusively or unusable)."""
    if gpu.exclusive_holders or not gpu.healthy or gpu.mig_mode:
        return 0
    if gpu.cores == MILLI_PER_GPU:
        return gpu.cores - gpu.used_cores
    return (gpu.cores - gpu.used_cores) * MILLI_PER_GPU // max(gpu.cores, 1)


def free_milli_list(node: NodeState) -> list[int]:
    """Free milli-GPU per GPU, by position."""
    return [gpu_free_milli(gpu) for gpu in node.gpus]


def request_milli(request: PlacementRequest) -> tuple[int, int]:
    """(milli-GPU per GPU, GPU count) of a pod; (0, 0) for a CPU-only pod."""
    containers = request.gpu.containers
    if not containers:
        return 0, 0
    container = containers[0]
    milli = min(container.cores, MILLI_PER_GPU) if container.cores else MILLI_PER_GPU
    return milli, sum(c.count for c in containers if not c.init) or container.count


def usage_milli(node: NodeState, placement: Placement) -> dict[int, int]:
    """Milli-GPU the placement takes per GPU position."""
    taken: dict[int, int] = {}
    gpus = node.gpus
    for usage in placement.usage:
        gpu = gpus[usage.position]
        if usage.exclusive or usage.cores >= gpu.cores:
            taken[usage.position] = gpu_free_milli(gpu)
        elif gpu.cores == MILLI_PER_GPU:
            taken[usage.position] = usage.cores
        else:
            taken[usage.position] = usage.cores * MILLI_PER_GPU // max(gpu.cores, 1)
    return taken


def free_after(node: NodeState, placement: Placement) -> list[int]:
    """Free milli-GPU per GPU once the placement is applied."""
    free = free_milli_list(node)
    for position, milli in usage_milli(node, placement).items():
        free[position] -= milli
    return free


def cpu_free_milli(node: NodeState) -> int:
    return node.cpu_milli_total - node.cpu_milli_used


def go_div(a: int, b: int) -> int:
    """Go's integer division (truncates toward zero)."""
    q = abs(a) // abs(b)
    return q if (a >= 0) == (b > 0) else -q


def best_fit_gpus(container: ContainerGpuRequest, candidates: Sequence[GpuState], scratch: Scratch) -> list[GpuState]:
    """The reference's default GPU choice ("best"): a sharing request takes the fitting GPU with the least free
    compute (lowest index on ties); a whole-GPU request takes the lowest-index idle GPUs."""
    if container.count == 1 and candidates and container.cores < candidates[0].cores:
        best = candidates[0]
        best_free = best.cores - best.used_cores - scratch.cores[best.position]
        for gpu in candidates[1:]:
            free = gpu.cores - gpu.used_cores - scratch.cores[gpu.position]
            if free < best_free:
                best, best_free = gpu, free
        return [best]
    return list(candidates[: container.count])


def pod_kind(request: PlacementRequest) -> str | None:
    """The reference's GPU affinity tag of a pod: None (CPU only), "share" or "<n>-gpu"."""
    milli, count = request_milli(request)
    if count == 0:
        return None
    if count == 1 and milli < MILLI_PER_GPU:
        return "share"
    return f"{count}-gpu"
