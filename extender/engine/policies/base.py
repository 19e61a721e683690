"""The placement-policy interface (the registry of policies by name is registry.py).

A policy does two things, like a kube-scheduler score plugin plus HAMi's device policy:
  * `choose_gpus`: given the GPUs of one node that fit one container, pick `count` of them;
  * `score`: rate a node for a pod once the pod's placement on it is known (higher is better; any scale).
The extender uses the node policy's `score` and the GPU policy's `choose_gpus` (HAMi's
`hami.io/node-scheduler-policy` / `hami.io/gpu-scheduler-policy`); the simulator uses one policy for both.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from kube_vgpu.extender.engine.model import GpuState, NodeState, Placement, PlacementRequest
    from kube_vgpu.extender.engine.policies.batch import GroupColumns
    from kube_vgpu.protocol import ContainerGpuRequest


class Scratch:
    """Usage added by the containers already placed in the current phase (indexed by GPU position): the pod's own
    containers that run at the same moment, sidecars started earlier included."""

    __slots__ = ("cores", "exclusive", "memory_mib", "vgpus")

    def __init__(self, size: int) -> None:
        self.memory_mib = [0] * size
        self.cores = [0] * size
        self.vgpus = [0] * size
        self.exclusive = [False] * size

    def copy(self) -> Scratch:
        twin = Scratch(0)
        twin.memory_mib = self.memory_mib[:]
        twin.cores = self.cores[:]
        twin.vgpus = self.vgpus[:]
        twin.exclusive = self.exclusive[:]
        return twin


class Policy:
    name: ClassVar[str] = ""
    #: True when score/choice depend only on (node state, request): results may be cached per node version.
    cacheable: ClassVar[bool] = True
    #: True when score/choice read the node's free host CPU (NodeState.cpu_milli_*) or the request's cpu_milli:
    #: the extender then tracks every pod's CPU per node and drops a node's cached results when it changes.
    uses_host_cpu: ClassVar[bool] = False
    #: the same for host memory (NodeState.memory_mib_*, the request's memory_mib)
    uses_host_memory: ClassVar[bool] = False
    #: True when the policy breaks score ties at random itself (the simulator then skips its node-order tie-break)
    random_tie_break: ClassVar[bool] = False
    #: True when the policy reads the request's pod kind (the simulator then labels each task with its kind)
    uses_pod_kinds: ClassVar[bool] = False
    #: True when, as GPU policy, it takes only GPUs no vGPU holds (HAMi's mutex): fit offers it only those
    only_idle_gpus: ClassVar[bool] = False
    #: True when score/choice read nothing of a node but what the extender's node-equivalence key holds (its GPUs'
    #: hardware and usage, link layout, host CPU and memory, pod kinds; not its name, labels or GPU UUIDs): nodes in
    #: the same state then share one placement per request shape (scheduler.equivalence_key)
    node_equivalence: ClassVar[bool] = True

    def epoch(self) -> int:
        """Changes whenever the policy's learned model changes (cached results keyed by it)."""
        return 0

    def observe(self, request: PlacementRequest) -> None:
        """Called once per pod seen (placed or not), in arrival order: a policy may learn from it."""

    def choose_gpus(
        self,
        node: NodeState,
        request: PlacementRequest,
        container: ContainerGpuRequest,
        candidates: Sequence[GpuState],
        scratch: Scratch,
    ) -> Sequence[GpuState]:
        """Pick container.count GPUs out of `candidates` (every one fits; len >= count)."""
        return candidates[: container.count]

    def score(self, node: NodeState, request: PlacementRequest, placement: Placement) -> float:
        return 0.0

    def place_batch(self, nodes: Sequence[NodeState], request: PlacementRequest,
                    gathered: GroupColumns | None = None) -> list[Placement | None] | None:
        """Optional: fit.place(node, request, self, self) of many nodes at once, exactly (policies.batch), with None
        for each node it leaves to fit.place; None when the policy offers no batch placement (the default). The
        scheduler uses it for a request shape's first pods, where every node is placed. gathered: what the batch
        reads of the nodes (all of one group), as the caller keeps it."""
        return None


# --- helpers shared by policies ---------------------------------------------------------------------


def free_memory_after(gpu: GpuState, container: ContainerGpuRequest, scratch: Scratch) -> int:
    return gpu.memory_mib - gpu.used_memory_mib - scratch.memory_mib[gpu.position] - container.memory_on(gpu.memory_mib)


def node_fill_after(node: NodeState, placement: Placement) -> float:
    """Fraction (0..1) of the node's GPU memory and cores in use once the placement is applied."""
    # the node's GPU totals and usage, once per version of the node (keyed by this function)
    totals = node.version_cache.get(node_fill_after)
    if totals is None:
        total_memory = total_cores = used_memory = used_cores = 0
        for gpu in node.gpus:
            total_memory += gpu.memory_mib
            total_cores += gpu.cores
            used_memory += gpu.used_memory_mib
            used_cores += gpu.used_cores
        totals = node.version_cache[node_fill_after] = (total_memory, total_cores, used_memory, used_cores)
    else:
        total_memory, total_cores, used_memory, used_cores = totals
    for usage in placement.usage:
        if usage.position >= len(node.gpus):
            continue  # a MIG device (node.devices): not part of the GPUs' totals
        used_memory += usage.memory_mib
        used_cores += usage.cores
    if not total_memory:
        return 0.0
    return 0.5 * used_memory / total_memory + 0.5 * used_cores / max(total_cores, 1)
