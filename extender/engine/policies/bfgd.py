"""bfgd (ours): Balanced Fragmentation Gradient Descent.

FGD (policies/fgd.py) counts a node's idle GPU capacity as fragmented for a task shape only once the node's free
CPU drops below that one shape's ask, so it happily spends the CPU of GPU-rich nodes (CPU-only and CPU-heavy
pods) until, many pods later, their idle GPUs cannot be fed. bfgd adds to each node's fragmentation the idle
milli-GPU its free CPU cannot feed at the CPU-per-GPU ratio of the GPU pods seen so far:

    F(node) = FGD_frag(node) + balance_weight * max(0, idle_gpu_milli - free_cpu_milli / cpu_per_gpu)

and scores a placement like FGD, int(100 * sigmoid((F_before - F_after) / 1000)). CPU then goes preferentially
to nodes whose GPUs are already used (or to CPU-rich nodes), and GPUs of CPU-poor nodes stay usable.

Everything it knows is learned online from the pods it has seen (fragmentation.ShapeLearner for the target
workload, counts of GPU asks for cpu_per_gpu), refreshed at doubling pod counts; the policy's epoch changes then,
and only if the model did, so per-node caches stay valid in between. cpu_per_gpu is per GPU memory size: a pod
asking 8 GiB takes a tenth of an 80 GiB GPU but half of a 16 GiB one. A node whose allocatable CPU is unknown
strands nothing (bfgd is FGD there).

Topology (it is the extender's default, so multi-GPU pods must keep their NVLink): on nodes that report links,
several GPUs for one container are the best-connected set (policies.topology), a whole single GPU is the one
whose loss least breaks up well-connected idle GPUs, a sharing pod's ties go to a GPU already split (else the
least damaging idle one), and the node score adds up to TOPOLOGY_WEIGHT for how well a multi-GPU placement is
connected plus under one point (FILL_TIE_BREAK) for how full the node gets, so equal fragmentation scores go to
the fuller node instead of a random one (kube-scheduler's tie-break; FGD depends on ties, docs/simulator.md).
A node without links (`NodeState.has_links` false, e.g. the openb simulator's) has nothing for the topology
terms to say: whole GPUs are the lowest-index idle ones and the connectivity term is 0; the tie-breaks above
(split GPU first, fill term) apply on every node. `reference_ties=True` ("bfgd-ref" in the simulator) breaks
ties as the FGD reference does instead (lowest-index GPU, no fill term), the variant the first published
simulator table measured.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kube_vgpu.extender.engine.fragmentation import task_shape
from kube_vgpu.extender.engine.policies.base import Scratch, node_fill_after
from kube_vgpu.extender.engine.policies.batch import GroupColumns, place_batch
from kube_vgpu.extender.engine.policies.fgd import FragPolicyBase
from kube_vgpu.extender.engine.policies.topology import best_connected_gpus, connectivity, least_damaging_gpu
from kube_vgpu.extender.engine.shares import ask_share_milli

if TYPE_CHECKING:
    from kube_vgpu.extender.engine.model import GpuState, NodeState, Placement, PlacementRequest
    from kube_vgpu.protocol import ContainerGpuRequest

DEFAULT_BALANCE_WEIGHT = 1.0
#: score points (the fragmentation score spans 0..100) for a perfectly connected multi-GPU placement: NVLink
#: against PCIe (~0.9 of it) outweighs all but the largest fragmentation differences
TOPOLOGY_WEIGHT = 100.0

#: below one score point: only breaks ties of the integer fragmentation score, towards the fuller node
FILL_TIE_BREAK = 0.5

#: a GPU ask, GPU-independent: (compute milli, memory milli, memory MiB, GPU count)
_Ask = tuple[int, int, int, int]


class BalancedFGD(FragPolicyBase):
    name = "bfgd"

    def __init__(
        self, balance_weight: float = DEFAULT_BALANCE_WEIGHT, coverage: float = 0.95, reference_ties: bool = False
    ) -> None:
        super().__init__(None, coverage)  # no given workload: a live scheduler only knows the pods it has seen
        self.balance_weight = balance_weight
        #: break ties as the FGD reference: equally good GPUs by lowest index, no fill term between nodes
        self.reference_ties = reference_ties
        self._asks: dict[_Ask, list[int]] = {}  # GPU pods seen: ask -> [pods, milli-CPU summed]
        self._asks_at_refresh: tuple[tuple[_Ask, int, int], ...] = ()
        #: milli-CPU per milli-GPU of GPU pods, by GPU memory size, as of the last refresh (filled lazily)
        self._ratio_by_memory: dict[int, float] = {}

    def observe(self, request: PlacementRequest) -> None:
        shape = task_shape(request)
        if shape.gpu_count:
            ask = (shape.gpu_milli, shape.gpu_memory_milli, shape.gpu_memory_mib, shape.gpu_count)
            seen = self._asks.get(ask)
            if seen is None:
                self._asks[ask] = [1, request.cpu_milli]
            else:
                seen[0] += 1
                seen[1] += request.cpu_milli
        if self._learner.add(shape):
            self.refresh()

    def refresh(self) -> None:
        epoch = self._epoch
        super().refresh()
        self._asks_at_refresh = tuple((ask, pods, cpu) for ask, (pods, cpu) in self._asks.items())
        old = self._ratio_by_memory
        self._ratio_by_memory = {}
        # results cached for nodes of a memory size depend on its ratio: a changed ratio is a new model
        if self._epoch == epoch and any(self.cpu_per_gpu_on(memory) != ratio for memory, ratio in old.items()):
            self._epoch += 1

    def cpu_per_gpu_on(self, gpu_memory_mib: int) -> float:
        """Milli-CPU per milli-GPU of the GPU pods that fit GPUs of this memory size (0 = size unknown)."""
        ratio = self._ratio_by_memory.get(gpu_memory_mib)
        if ratio is None:
            cpu = gpu = 0
            for (compute, memory_milli, memory_mib, count), pods, cpu_sum in self._asks_at_refresh:
                share = ask_share_milli(compute, memory_milli, memory_mib, gpu_memory_mib)
                if share is not None:
                    cpu += cpu_sum
                    gpu += share * count * pods
            ratio = cpu / gpu if gpu else 0.0
            self._ratio_by_memory[gpu_memory_mib] = ratio
        return ratio

    @property
    def cpu_per_gpu(self) -> float:
        """The ratio ignoring fixed-MiB asks' size dependence (what openb tasks, which ask none, see)."""
        return self.cpu_per_gpu_on(0)

    def stranded(self, node: NodeState, cpu_free: int, cpu_known: bool, free: Sequence[int]) -> float:
        """Idle milli-GPU that the node's free CPU cannot feed at the learned CPU-per-GPU ratio."""
        if not cpu_known:
            return 0.0
        ratio = self.cpu_per_gpu_on(node.gpu_memory_mib)
        if not ratio:
            return 0.0
        return max(0.0, sum(free) - cpu_free / ratio)

    def measure(self, node: NodeState, cpu_free: int, cpu_known: bool, free: Sequence[int]) -> float:
        return self.node_frag(node, cpu_free, free) + self.balance_weight * self.stranded(
            node, cpu_free, cpu_known, free
        )

    def choose_whole(
        self, node: NodeState, container: ContainerGpuRequest, candidates: Sequence[GpuState], scratch: Scratch
    ) -> Sequence[GpuState]:
        if not node.has_links:
            return list(candidates[: container.count])
        if container.count == 1:
            return [least_damaging_gpu(node, candidates, scratch)]
        return best_connected_gpus(node, candidates, container.count)

    def break_tie(self, node: NodeState, tied: list[GpuState], scratch: Scratch) -> GpuState:
        if self.reference_ties:
            return tied[0]  # the reference: lowest index
        # as policies.topology: a GPU already split first (fullest memory), else the least damaging idle one
        shared = [gpu for gpu in tied if gpu.used_vgpus + scratch.vgpus[gpu.position] > 0]
        if shared:
            return min(shared, key=lambda g: (g.free_memory_mib - scratch.memory_mib[g.position], g.index))
        return least_damaging_gpu(node, tied, scratch)

    def place_batch(self, nodes: Sequence[NodeState], request: PlacementRequest,
                    gathered: GroupColumns | None = None) -> list[Placement | None] | None:
        return place_batch(nodes, request, self, gathered=gathered)

    def score(self, node: NodeState, request: PlacementRequest, placement: Placement) -> float:
        score = super().score(node, request, placement)
        quality = connectivity(node, placement) if node.has_links else None  # no links: nothing to add
        if quality is not None:
            score += TOPOLOGY_WEIGHT * quality
        if not self.reference_ties:
            # ties of the integer score go to the fuller node (kube-scheduler would pick one at random)
            score += FILL_TIE_BREAK * node_fill_after(node, placement)
        return score
