"""The fit's exact answers, written to kill the mutants that survived mutation testing (docs/mutation-testing.md).

test_fit.py checks which GPU wins and that a reason contains a phrase; these pin the whole reason, its code and
its unresolvable flag for every branch of explain_failure, the boundaries (exactly full, exactly exclusive, exactly
the host's CPU), and the scratch arithmetic when several containers of one pod share a GPU."""

from __future__ import annotations

from typing import Any

import pytest

from kube_vgpu.extender.engine.fit import explain_failure, fitting_gpus, gpu_eligible, place
from kube_vgpu.extender.engine.model import FitFailure, NodeState, Placement, PlacementRequest
from kube_vgpu.extender.engine.policies import make_policy
from kube_vgpu.extender.engine.policies.base import Scratch
from kube_vgpu.protocol import ContainerGpuRequest, GpuInfo, GpuSelectors, NodeInventory, PodGpuRequest

BINPACK = make_policy("binpack")
T4 = "Tesla-T4"


def gpu(index: int, **fields: Any) -> GpuInfo:
    values: dict[str, Any] = {"uuid": f"GPU-{index}", "index": index, "model": T4, "memory_mib": 16000,
                              "numa_node": index // 2}
    values.update(fields)
    return GpuInfo(**values)


def node_of(*gpus: GpuInfo, used: list[tuple[int, int, int]] | None = None, **kwargs: Any) -> NodeState:
    """GPU i holds used[i] = (MiB, cores, vGPUs); cores 100 marks it held exclusively."""
    node = NodeState("n1", NodeInventory(tuple(gpus)), **kwargs)
    for state, (memory, cores, shares) in zip(node.gpus, used or [], strict=False):
        state.used_memory_mib, state.used_cores, state.used_vgpus = memory, cores, shares
        state.exclusive_holders = 1 if cores >= 100 else 0
    return node


def two_t4(used: list[tuple[int, int, int]] | None = None) -> NodeState:
    return node_of(gpu(0), gpu(1), used=used)


def container(name: str = "main", count: int = 1, **fields: Any) -> ContainerGpuRequest:
    return ContainerGpuRequest(name=name, count=count, **fields)


def request(*containers: ContainerGpuRequest, selectors: GpuSelectors | None = None,
            gpu_spec: tuple[str, ...] = (), **kwargs: Any) -> PlacementRequest:
    return PlacementRequest(PodGpuRequest(tuple(containers), selectors or GpuSelectors()), gpu_spec=gpu_spec, **kwargs)


def placed(node: NodeState, req: PlacementRequest, **kwargs: Any) -> Placement | FitFailure:
    return place(node, req, BINPACK, BINPACK, **kwargs)


ALL_SELECTORS = GpuSelectors(use_types=("t4", "tesla"), nouse_types=("a100", "h100"), nouse_uuids=("GPU-0",))

# (id, node, container, selectors/gpu_spec, expected reason, code, unresolvable)
FAILURES: list[tuple[str, Any, ContainerGpuRequest, dict[str, Any], str, str, bool]] = [
    ("count", two_t4(), container(count=3, memory_mib=10), {}, "needs 3 GPUs, node has 2", "count", True),
    ("count-one-gpu-every-selector", two_t4(), container(count=2, memory_mib=10),
     {"selectors": ALL_SELECTORS, "gpu_spec": (T4, "Tesla-V100")},
     "needs 2 GPUs matching model Tesla-T4|Tesla-V100, type t4/tesla, not type a100/h100, the UUID selectors, "
     "node has 1", "count", True),
    ("count-use-uuid-only", two_t4(), container(count=2, memory_mib=10),
     {"selectors": GpuSelectors(use_uuids=("GPU-1",))},
     "needs 2 GPUs matching the UUID selectors, node has 1", "count", True),
    ("count-singular", two_t4(), container(memory_mib=10), {"selectors": GpuSelectors(use_types=("a100",))},
     "needs 1 GPU matching type a100, node has 0", "count", True),
    ("memory-exactly-the-gpu-but-used", two_t4([(1, 0, 1), (1, 0, 1)]), container(memory_mib=16000), {},
     "no GPU with 16000 MiB free (largest free 15999 MiB)", "memory", False),
    ("memory-per-gpu", two_t4(), container(memory_mib=16001), {},
     "needs 16001 MiB per GPU, largest GPU here has 16000 MiB", "memory", True),
    ("unhealthy", node_of(gpu(0, healthy=False), gpu(1, healthy=False)), container(memory_mib=10), {},
     "needs 1 GPU, only 0 usable (2 unhealthy)", "health", False),
    ("mig-only", node_of(gpu(0, mig_mode=True), gpu(1, mig_mode=True), gpu(2)), container(count=2, memory_mib=10), {},
     "needs 2 GPUs, only 1 usable (2 in MIG mode)", "health", True),
    ("unhealthy-and-mig", node_of(gpu(0, healthy=False), gpu(1, mig_mode=True)), container(memory_mib=10), {},
     "needs 1 GPU, only 0 usable (1 unhealthy, 1 in MIG mode)", "health", False),
    ("external", node_of(gpu(0), gpu(1, external_pods=("b/y", "a/x")), used=[(0, 100, 1)]),
     container(memory_mib=10), {}, "needs 1 GPU, 1 used by pods outside kube-vgpu (a/x, b/y)", "external", False),
    ("held-exclusively", node_of(gpu(0), gpu(1), gpu(2), used=[(10, 100, 1), (10, 100, 1)]),
     container(count=2, memory_mib=10), {}, "needs 2 GPUs, 2 of 3 held exclusively", "exclusive", False),
    ("no-slot", two_t4([(10, 0, 10), (10, 0, 10)]), container(memory_mib=10), {},
     "needs 1 GPU with a vGPU slot left, 0 have one", "shares", False),
    ("exclusive-needs-idle", node_of(gpu(0), gpu(1), gpu(2), used=[(10, 10, 2), (10, 10, 2)]),
     container(count=3, memory_mib=10, cores=100), {},
     "needs 3 idle GPUs for exclusive use (gpucores 100), 1 idle", "exclusive", False),
    ("memory-mib", two_t4([(10000, 0, 1), (9000, 0, 1)]), container(memory_mib=8000), {},
     "no GPU with 8000 MiB free (largest free 7000 MiB)", "memory", False),
    ("memory-percent", two_t4([(10000, 0, 1), (9000, 0, 1)]), container(memory_percent=50), {},
     "no GPU with 50 percent of memory free (largest free 7000 MiB)", "memory", False),
    ("memory-whole", two_t4([(1, 0, 1), (2, 0, 1)]), container(), {},
     "no GPU with all its memory free (largest free 15999 MiB)", "memory", False),
    ("memory-two-gpus", two_t4([(10000, 0, 1), (0, 0, 1)]), container(count=2, memory_mib=8000), {},
     "needs 2 GPUs with 8000 MiB free, 1 have it (largest free 16000 MiB)", "memory", False),
    # exactly the free memory is enough memory: the shortfall is the cores (and one GPU with memory = count)
    ("cores-memory-exactly-free", node_of(gpu(0), used=[(8000, 90, 1)]), container(memory_mib=8000, cores=30), {},
     "no GPU with 30 percent cores free (most free 10 percent)", "cores", False),
    ("cores-two-gpus", two_t4([(0, 90, 1), (0, 10, 1)]), container(count=2, memory_mib=10, cores=30), {},
     "needs 2 GPUs with 30 percent cores and enough memory free, 1 have both", "cores", False),
]


@pytest.mark.parametrize(("node", "ask", "options", "reason", "code", "unresolvable"), [f[1:] for f in FAILURES],
                         ids=[f[0] for f in FAILURES])
def test_failure_reason_code_and_unresolvable_are_exact(
    node: NodeState, ask: ContainerGpuRequest, options: dict[str, Any], reason: str, code: str, unresolvable: bool
) -> None:
    result = placed(node, request(ask, **options))
    assert isinstance(result, FitFailure), result
    assert (result.reason, result.code, result.unresolvable) == (reason, code, unresolvable)


def test_numa_bind_failure_names_the_container() -> None:
    node = node_of(gpu(0), gpu(1), gpu(2), gpu(3), used=[(16000, 0, 1), (0, 0, 0), (16000, 0, 1), (0, 0, 0)])
    result = placed(node, request(container("trainer", count=2, memory_mib=10), selectors=GpuSelectors(numa_bind=True)))
    assert result == FitFailure("container trainer: no NUMA node has 2 fitting GPUs (nvidia.com/numa-bind is set)",
                                code="numa")


def test_numa_bind_does_not_group_a_single_vgpu() -> None:
    # GPU 0 (NUMA 0) is the fullest that fits, so binpack takes it although NUMA 1 has more fitting GPUs
    node = node_of(gpu(0), gpu(1), gpu(2), gpu(3), used=[(8000, 0, 1), (16000, 0, 1), (0, 0, 0), (0, 0, 0)])
    result = placed(node, request(container(memory_mib=10), selectors=GpuSelectors(numa_bind=True)))
    assert isinstance(result, Placement) and result.containers[0].devices == ((0, 10, 0),)


def test_no_gpus_on_the_node() -> None:
    assert placed(node_of(), request(container(memory_mib=10))) == FitFailure(
        "no GPUs (no kube-vgpu GPU inventory on this node)", True, "no-gpus")


HOST = [
    # (id, cpu asked, memory asked, expected failure or None)
    ("exactly-the-node", 4000, 8192, None),
    ("cpu-short-now", 3000, 0, FitFailure("not enough CPU", False, "host")),
    ("cpu-never", 4001, 0, FitFailure("not enough CPU", True, "host")),
    ("cpu-exactly-total-but-used", 4000, 0, FitFailure("not enough CPU", False, "host")),
    ("memory-short-now", 0, 5000, FitFailure("not enough memory", False, "host")),
    ("memory-never", 0, 8193, FitFailure("not enough memory", True, "host")),
    ("memory-exactly-total-but-used", 0, 8192, FitFailure("not enough memory", False, "host")),
]


@pytest.mark.parametrize(("cpu", "memory", "expected"), [h[1:] for h in HOST], ids=[h[0] for h in HOST])
def test_check_host(cpu: int, memory: int, expected: FitFailure | None) -> None:
    node = node_of(gpu(0), cpu_milli_total=4000, memory_mib_total=8192)
    if expected is not None:
        node.cpu_milli_used, node.memory_mib_used = 1001, 4000
    result = placed(node, request(container(memory_mib=10), cpu_milli=cpu, memory_mib=memory), check_host=True)
    if expected is None:
        assert isinstance(result, Placement), result
    else:
        assert result == expected


ELIGIBLE = [
    # (gpu_spec, selectors, eligible)
    ((), GpuSelectors(), True),
    ((T4,), GpuSelectors(), True),
    (("Tesla-V100",), GpuSelectors(), False),
    ((T4,), GpuSelectors(use_types=("a100",)), False),
    ((), GpuSelectors(use_types=("t4",)), True),
    ((), GpuSelectors(nouse_uuids=("GPU-0",)), False),
    ((), GpuSelectors(numa_bind=True), True),
]


@pytest.mark.parametrize(("gpu_spec", "selectors", "eligible"), ELIGIBLE)
def test_gpu_eligible(gpu_spec: tuple[str, ...], selectors: GpuSelectors, eligible: bool) -> None:
    assert gpu_eligible(two_t4().gpus[0], selectors, gpu_spec) is eligible


def test_gpu_spec_alone_refuses_other_models() -> None:
    result = placed(two_t4(), request(container(memory_mib=10), gpu_spec=("Tesla-V100",)))
    assert isinstance(result, FitFailure) and result.code == "count"


def scratch_with(size: int, **lists: list[Any]) -> Scratch:
    scratch = Scratch(size)
    for name, values in lists.items():
        setattr(scratch, name, values)
    return scratch


FITTING = [
    # (id, used per GPU, container, scratch lists, fitting positions)
    ("full-gpu-skipped-not-the-rest", [(0, 0, 10), (0, 0, 0)], container(memory_mib=10), {}, [1]),
    ("exclusive-skips-a-shared-gpu", [(100, 0, 1), (0, 0, 0)], container(memory_mib=10, cores=100), {}, [1]),
    ("exclusive-needs-no-share-even-at-0-cores", [(100, 0, 1)], container(memory_mib=10, cores=100), {}, []),
    ("scratch-vgpus-count", [(0, 0, 9), (0, 0, 0)], container(memory_mib=10), {"vgpus": [1, 0]}, [1]),
    ("scratch-cores-count", [(0, 50, 1), (0, 0, 0)], container(memory_mib=10, cores=30),
     {"cores": [30, 0], "vgpus": [1, 0]}, [1]),
    ("scratch-memory-counts", [(8000, 0, 1), (0, 0, 0)], container(memory_mib=4000),
     {"memory_mib": [6000, 0], "vgpus": [1, 0]}, [1]),
    ("scratch-exclusive", None, container(memory_mib=10), {"exclusive": [True, False], "vgpus": [1, 0]}, [1]),
]


@pytest.mark.parametrize(("used", "ask", "lists", "positions"), [f[1:] for f in FITTING], ids=[f[0] for f in FITTING])
def test_fitting_gpus(used: Any, ask: ContainerGpuRequest, lists: dict[str, list[Any]], positions: list[int]) -> None:
    node = two_t4(used) if used is None or len(used) == 2 else node_of(gpu(0), used=used)
    found = fitting_gpus(node, ask, request(ask), scratch_with(len(node.gpus), **lists))
    assert [g.position for g in found] == positions


def test_two_containers_on_one_gpu_add_up() -> None:
    node = node_of(gpu(0))
    result = placed(node, request(container("a", memory_mib=4000, cores=20), container("b", memory_mib=3000, cores=30)))
    assert isinstance(result, Placement), result
    ((position, memory, cores, vgpus, exclusive),) = [(u.position, u.memory_mib, u.cores, u.vgpus, u.exclusive)
                                                      for u in result.usage]
    assert (position, memory, cores, vgpus, exclusive) == (0, 7000, 50, 2, False)


def test_init_and_app_containers_are_all_placed_in_any_order() -> None:
    app = container("app", memory_mib=4000)
    init = container("init", memory_mib=9000, init=True)
    for order in ((init, app), (app, init)):
        result = placed(node_of(gpu(0)), request(*order))
        assert isinstance(result, Placement), result
        assert [c.request.name for c in result.containers] == ["app", "init"]
        assert [(u.memory_mib, u.vgpus) for u in result.usage] == [(9000, 1)]


def test_explain_failure_counts_the_pods_own_scratch() -> None:
    node = node_of(gpu(0), gpu(1), used=[(0, 0, 1), (0, 0, 0)])  # GPU 0: one vGPU of another pod, one of this pod
    ask = container(count=2, memory_mib=10, cores=100)
    scratch = scratch_with(2, vgpus=[1, 0], memory_mib=[4000, 0], cores=[40, 0])
    assert explain_failure(node, request(ask), ask, scratch, 1).reason == (
        "needs 2 idle GPUs for exclusive use (gpucores 100), 1 idle")
    # memory: GPU 0 has 12000 free after the scratch, GPU 1 16000
    ask = container(count=2, memory_mib=14000)
    assert explain_failure(node, request(ask), ask, scratch, 1).reason == (
        "needs 2 GPUs with 14000 MiB free, 1 have it (largest free 16000 MiB)")
    scratch = scratch_with(2, vgpus=[1, 0], memory_mib=[4000, 0], cores=[90, 0])
    ask = container(memory_mib=12000, cores=30)
    node.gpus[1].used_memory_mib = 16000
    assert explain_failure(node, request(ask), ask, scratch, 0).reason == (
        "no GPU with 30 percent cores free (most free 10 percent)")
    full = scratch_with(2, vgpus=[10, 10])
    assert explain_failure(node, request(ask), ask, full, 0).reason == (
        "needs 1 GPU with a vGPU slot left, 0 have one")
