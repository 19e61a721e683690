"""GPU shares in milli-GPU (1000 = one whole GPU), the unit of the fragmentation-aware policies.

A GPU offers two resources a pod can ask for, compute (`cores`) and memory, so one number per GPU needs a rule:
  * a GPU's free share is the smaller of its free compute and free memory fractions (what a pod can still get
    of both), 0 when it is held exclusively, unusable (unhealthy, MIG) or out of vGPU slots;
  * a request's share of a GPU is the larger of its compute and memory fractions of that GPU. A pod asking only
    memory (gpucores 0 = no compute reservation) takes its memory fraction; a pod asking neither takes the whole
    memory, so a whole GPU; gpucores >= the GPU's cores is exclusive, a whole GPU.
The memory fraction of a fixed MiB ask depends on the GPU's size, so shares are per GPU, never per pod.

On the openb traces (GPUs modelled with cores = 1000, tasks asking cores = milli-GPU and no memory) these give
exactly the milli-GPU numbers of the FGD paper's simulator. Integer arithmetic: free shares round down, asks up
(a pod of 1 MiB still takes something).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kube_vgpu.extender.engine.model import GpuState
    from kube_vgpu.protocol import ContainerGpuRequest

MILLI_PER_GPU = 1000


def fraction_milli_floor(part: int, whole: int) -> int:
    """part / whole in milli, rounded down (whole == 1000 is the openb fast path, exact)."""
    if whole == MILLI_PER_GPU:
        return part
    return part * MILLI_PER_GPU // max(whole, 1)


def fraction_milli_ceil(part: int, whole: int) -> int:
    if whole == MILLI_PER_GPU:
        return part
    return -(-part * MILLI_PER_GPU // max(whole, 1))


def free_share_milli(
    gpu: GpuState,
    extra_memory_mib: int = 0,
    extra_cores: int = 0,
    extra_vgpus: int = 0,
    extra_exclusive: bool = False,
) -> int:
    """Free milli-GPU of one GPU, with `extra_*` usage (scratch of the pod being placed) added to what it holds."""
    # hot (every GPU of every node a fragmentation policy scores): inlined arithmetic, no helper calls
    if extra_exclusive or gpu.exclusive_holders or not gpu.healthy or gpu.mig_mode:
        return 0
    if gpu.used_vgpus + extra_vgpus >= gpu.max_vgpus:
        return 0
    cores = gpu.cores
    share = cores - gpu.used_cores - extra_cores
    if cores != MILLI_PER_GPU:
        share = share * MILLI_PER_GPU // (cores or 1)
    memory_mib = gpu.memory_mib
    free_memory_mib = memory_mib - gpu.used_memory_mib - extra_memory_mib
    if free_memory_mib < memory_mib:  # untouched memory (always, on openb) is 1000 and cannot be the minimum
        memory = free_memory_mib * MILLI_PER_GPU // (memory_mib or 1)
        if memory < share:
            share = memory
    return share if share > 0 else 0


def request_share_milli(container: ContainerGpuRequest, gpu: GpuState) -> int:
    """Milli-GPU one vGPU of `container` takes on `gpu`: max(compute fraction, memory fraction), capped at 1000."""
    if container.cores >= gpu.cores:
        return MILLI_PER_GPU  # exclusive
    compute = fraction_milli_ceil(container.cores, gpu.cores)
    memory = fraction_milli_ceil(container.memory_on(gpu.memory_mib), gpu.memory_mib)
    share = compute if compute > memory else memory
    return share if share < MILLI_PER_GPU else MILLI_PER_GPU


def ask_share_milli(compute_milli: int, memory_milli: int, memory_mib: int, gpu_memory_mib: int) -> int | None:
    """Share of a GPU-independent ask (compute and memory fractions in milli, plus a fixed MiB ask) on a GPU of
    `gpu_memory_mib`; None when the fixed ask cannot fit that GPU at all. gpu_memory_mib 0 = size unknown (the
    fixed MiB ask is then left out)."""
    share = compute_milli if compute_milli > memory_milli else memory_milli
    if memory_mib and gpu_memory_mib:
        if memory_mib > gpu_memory_mib:
            return None
        share = max(share, fraction_milli_ceil(memory_mib, gpu_memory_mib))
    return share if share < MILLI_PER_GPU else MILLI_PER_GPU
