"""Helpers shared by the trace-reference policies (random, dotprod, clustering, packing, bestfit, fgd) and ours.

They see a node the way the FGD paper's simulator does: free milli-CPU, and free milli-GPU per GPU (1000 = one
whole GPU; engine.shares defines it for GPUs with memory and compute: the smaller free fraction; an ask: the
larger fraction, per GPU). Integer score arithmetic follows the reference (Go int64 division truncates toward
zero), because its 0..100 integer scores tie often and ties are broken at random.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kube_vgpu.extender.engine.fragmentation import task_shape
from kube_vgpu.extender.engine.policies.base import Policy
from kube_vgpu.extender.engine.shares import MILLI_PER_GPU, free_share_milli, request_share_milli

if TYPE_CHECKING:
    from kube_vgpu.extender.engine.model import GpuState, NodeState, Placement, PlacementRequest
    from kube_vgpu.extender.engine.policies.base import Scratch
    from kube_vgpu.protocol import ContainerGpuRequest

#: the reference's normalisers: the largest node it knows (128 cores, 8 GPUs)
MAX_SPEC_CPU_MILLI = 128_000
MAX_SPEC_GPU_MILLI = 8_000
MAX_NODE_SCORE = 100
#: free CPU of a node whose allocatable CPU is unknown: large enough that no task's CPU ask is refused by it
UNKNOWN_CPU_FREE_MILLI = 1 << 40


def gpu_free_milli(gpu: GpuState) -> int:
    """Free milli-GPU of one GPU (0 when held exclusively or unusable)."""
    return free_share_milli(gpu)


def free_milli_list(node: NodeState) -> list[int]:
    """Free milli-GPU per GPU, by position (a fresh list; computed once per node version)."""
    cached = node.free_milli_cache
    if cached is None:
        cached = node.free_milli_cache = tuple([free_share_milli(gpu) for gpu in node.gpus])
    return list(cached)


def free_with_scratch(node: NodeState, scratch: Scratch) -> list[int]:
    """Free milli-GPU per GPU once the containers already placed in this phase (scratch) are counted."""
    free = free_milli_list(node)
    s_memory, s_cores, s_vgpus, s_exclusive = scratch.memory_mib, scratch.cores, scratch.vgpus, scratch.exclusive
    for position, shares in enumerate(s_vgpus[: len(node.gpus)]):  # the GPUs (MIG devices follow them)
        if shares:  # only GPUs this phase already uses differ from the node's own free share
            free[position] = free_share_milli(
                node.gpus[position], s_memory[position], s_cores[position], shares, s_exclusive[position]
            )
    return free


def container_usage(container: ContainerGpuRequest, gpu: GpuState) -> tuple[int, int, bool]:
    """(memory MiB, cores, exclusive) one vGPU of `container` takes on `gpu` (as engine.fit records it)."""
    exclusive = container.cores >= gpu.cores
    return container.memory_on(gpu.memory_mib), gpu.cores if exclusive else container.cores, exclusive


def request_milli(request: PlacementRequest, node: NodeState | None = None) -> tuple[int, int]:
    """(milli-GPU per GPU, GPU count) of a pod; (0, 0) for a CPU-only pod. The per-GPU share is taken on the
    node's first GPU (it depends on the GPU's memory size); without a node, on a GPU of the request's cores unit
    whose memory is all asked unless the pod names memory (the openb view)."""
    containers = tuple(c for c in request.gpu.containers if not c.mig)  # vGPUs only
    if not containers:
        return 0, 0
    container = containers[0]
    count = sum(c.count for c in containers if c.sidecar or not c.init) or container.count  # the app phase
    if node is not None and node.gpus:
        return request_share_milli(container, node.gpus[0]), count
    shape = task_shape(request)
    return shape.share_on(0) or 0, count


def usage_milli(node: NodeState, placement: Placement) -> dict[int, int]:
    """Milli-GPU the placement takes per GPU position (the drop of the GPU's free share)."""
    gpus = node.gpus
    taken: dict[int, int] = {}
    for usage in placement.usage:
        if usage.position >= len(gpus):
            continue  # a MIG device (node.devices): not part of the GPUs' shares
        gpu = gpus[usage.position]
        taken[usage.position] = free_share_milli(gpu) - free_share_milli(
            gpu, usage.memory_mib, usage.cores, usage.vgpus, usage.exclusive
        )
    return taken


def free_after(node: NodeState, placement: Placement) -> list[int]:
    """Free milli-GPU per GPU once the placement is applied."""
    free = free_milli_list(node)
    gpus = node.gpus
    for usage in placement.usage:
        if usage.position >= len(gpus):
            continue  # a MIG device
        free[usage.position] = free_share_milli(
            gpus[usage.position], usage.memory_mib, usage.cores, usage.vgpus, usage.exclusive
        )
    return free


def cpu_free_milli(node: NodeState) -> int:
    return node.cpu_milli_total - node.cpu_milli_used


def frag_cpu_free_milli(node: NodeState) -> tuple[int, bool]:
    """(free milli-CPU, known) for the fragmentation measure. A node whose allocatable CPU is unknown (the live
    extender before a node reports it) counts as having CPU for every task rather than none, so the measure
    falls back to GPU-only FGD there instead of calling every idle GPU stranded."""
    if node.cpu_milli_total <= 0:
        return UNKNOWN_CPU_FREE_MILLI, False
    return node.cpu_milli_total - node.cpu_milli_used, True


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


class BestFitGpuChoice(Policy):
    """The reference simulator's GPU choice, shared by the baseline policies: best fit (see best_fit_gpus)."""

    def choose_gpus(
        self,
        node: NodeState,
        request: PlacementRequest,
        container: ContainerGpuRequest,
        candidates: Sequence[GpuState],
        scratch: Scratch,
    ) -> Sequence[GpuState]:
        return best_fit_gpus(container, candidates, scratch)
