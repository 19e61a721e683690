"""Does a pod fit a node, and where exactly: the per-GPU fit rules and per-container GPU choice.

Phases, as kubelet runs a pod (protocol.container_phases): init containers run one at a time in order; a native
sidecar (restartPolicy Always) starts in that order and keeps running. So each sidecar is placed once, beside the
sidecars before it, and stays on its GPUs; each ordinary init container is placed beside the sidecars started before
it; the app containers are placed together beside every sidecar. What the pod holds on a GPU is the peak over
those moments (model.peak_usage, the same function the cluster state applies to a written assignment).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from kube_vgpu.extender.engine.dynmig import choose_dynamic_mig, has_dynamic_mig, profile_for_memory
from kube_vgpu.extender.engine.mig import choose_mig_devices
from kube_vgpu.extender.engine.model import (
    ContainerPlacement,
    FitFailure,
    GpuState,
    GpuUsage,
    NodeState,
    Placement,
    PlacementRequest,
    peak_usage,
)
from kube_vgpu.extender.engine.policies.base import Policy, Scratch
from kube_vgpu.protocol import ContainerGpuRequest, GpuSelectors, container_phases


def gpu_eligible(gpu: GpuState, selectors: GpuSelectors, gpu_spec: tuple[str, ...]) -> bool:
    """Type / UUID selectors only (things that never change while the pod waits)."""
    if gpu_spec and gpu.model not in gpu_spec:
        return False
    if selectors.empty:
        return True
    return selectors.model_allowed(gpu.model_lower) and selectors.uuid_allowed(gpu.uuid)


def fitting_gpus(
    node: NodeState, container: ContainerGpuRequest, request: PlacementRequest, scratch: Scratch
) -> list[GpuState]:
    """The node's GPUs that can take one vGPU of `container` on top of `scratch`."""
    selectors = request.gpu.selectors
    plain = selectors.empty and not request.gpu_spec
    need_cores = container.cores
    fixed_memory = container.memory_mib
    found = []
    s_memory = scratch.memory_mib
    s_cores = scratch.cores
    s_vgpus = scratch.vgpus
    s_exclusive = scratch.exclusive
    for gpu in node.gpus:
        if not gpu.healthy or gpu.mig_mode or gpu.exclusive_holders:
            continue
        position = gpu.position
        if s_exclusive[position]:
            continue
        if not plain and not gpu_eligible(gpu, selectors, request.gpu_spec):
            continue
        shares = gpu.used_vgpus + s_vgpus[position]
        if shares >= gpu.max_vgpus:
            continue
        need_memory = fixed_memory if fixed_memory is not None else container.memory_on(gpu.memory_mib)
        if gpu.used_memory_mib + s_memory[position] + need_memory > gpu.memory_mib:
            continue
        if need_cores >= gpu.cores:
            if shares:  # exclusive use needs an idle GPU
                continue
        elif gpu.used_cores + s_cores[position] + need_cores > gpu.cores:
            continue
        found.append(gpu)
    return found


def _numa_group(candidates: Sequence[GpuState], count: int) -> list[GpuState] | None:
    """nvidia.com/numa-bind: all vGPUs of a container on one NUMA node; the largest group that fits."""
    groups: dict[int | None, list[GpuState]] = {}
    for gpu in candidates:
        groups.setdefault(gpu.numa_node, []).append(gpu)
    viable = [group for group in groups.values() if len(group) >= count]
    return max(viable, key=len) if viable else None


def _place_container(
    node: NodeState,
    request: PlacementRequest,
    container: ContainerGpuRequest,
    scratch: Scratch,
    gpu_policy: Policy,
) -> list[tuple[int, int, int]] | FitFailure:
    if container.mig_memory_mib is not None:  # vgpu-mode: mig: the node names the profile
        profile = profile_for_memory(node, container.mig_memory_mib)
        if isinstance(profile, FitFailure):
            return FitFailure(f"container {container.name}: {profile.reason}", profile.unresolvable, profile.code)
        return _place_mig_container(node, request, dataclasses.replace(container, mig_profile=profile), scratch,
                                    dynamic_only=True)
    if container.mig_profile is not None:
        return _place_mig_container(node, request, container, scratch)
    candidates: Sequence[GpuState] | None = fitting_gpus(node, container, request, scratch)
    assert candidates is not None
    if len(candidates) < container.count:
        return explain_failure(node, request, container, scratch, len(candidates))
    if gpu_policy.only_idle_gpus:
        candidates = [gpu for gpu in candidates if gpu.used_vgpus + scratch.vgpus[gpu.position] == 0]
        if len(candidates) < container.count:
            plural = "GPU" if container.count == 1 else "GPUs"
            return FitFailure(
                f"container {container.name}: needs {container.count} idle {plural} (GPU policy {gpu_policy.name} "
                f"takes no GPU another vGPU uses), {len(candidates)} idle with room for it",
                code="exclusive",
            )
    if request.gpu.selectors.numa_bind and container.count > 1:
        candidates = _numa_group(candidates, container.count)
        if candidates is None:
            return FitFailure(
                f"container {container.name}: no NUMA node has {container.count} fitting GPUs "
                f"(nvidia.com/numa-bind is set)",
                code="numa",
            )
    chosen = gpu_policy.choose_gpus(node, request, container, candidates, scratch)
    devices = []
    for gpu in chosen:
        position = gpu.position
        memory = container.memory_on(gpu.memory_mib)
        cores = gpu.cores if container.cores >= gpu.cores else container.cores
        scratch.memory_mib[position] += memory
        scratch.cores[position] += cores
        scratch.vgpus[position] += 1
        if container.cores >= gpu.cores:
            scratch.exclusive[position] = True
        devices.append((position, memory, cores))
    return devices


def _place_mig_container(
    node: NodeState, request: PlacementRequest, container: ContainerGpuRequest, scratch: Scratch,
    *, dynamic_only: bool = False,
) -> list[tuple[int, int, int]] | FitFailure:
    """Static MIG: `container.count` free MIG devices of its profile (engine/mig.py chooses), each held whole;
    failing that, new instances on the node's dynamic MIG GPUs (engine/dynmig.py chooses where)."""
    chosen: list[GpuState] | FitFailure = FitFailure("", code="mig")  # vgpu-mode mig: dynamic MIG only
    if not dynamic_only:
        chosen = choose_mig_devices(node, container, request.gpu.selectors, scratch)
    if isinstance(chosen, FitFailure) and has_dynamic_mig(node):
        dynamic = choose_dynamic_mig(node, container, request.gpu.selectors, scratch)
        if isinstance(dynamic, FitFailure):
            # static devices of the profile exist but are busy: both reasons; none: the dynamic one alone
            if node.mig_devices and not dynamic_only:
                reason = f"{chosen.reason}; {dynamic.reason}"
                dynamic = FitFailure(reason, chosen.unresolvable and dynamic.unresolvable, "mig")
            return FitFailure(f"container {container.name}: {dynamic.reason}", dynamic.unresolvable, dynamic.code)
        chosen = dynamic
        for device in chosen:  # the GPU becomes a MIG GPU: this pod's vGPU containers stay off it too
            assert device.mig_parent is not None
            scratch.exclusive[device.mig_parent] = True
    if isinstance(chosen, FitFailure):
        return FitFailure(f"container {container.name}: {chosen.reason}", chosen.unresolvable, chosen.code)
    devices = []
    for device in chosen:
        position = device.position
        scratch.memory_mib[position] += device.memory_mib
        scratch.cores[position] += device.cores
        scratch.vgpus[position] += 1
        scratch.exclusive[position] = True
        devices.append((position, device.memory_mib, device.cores))
    return devices


def place(
    node: NodeState,
    request: PlacementRequest,
    gpu_policy: Policy,
    node_policy: Policy,
    *,
    check_host: bool = False,
) -> Placement | FitFailure:
    """Place the pod on this node (no side effects). check_host adds CPU / memory fit (the simulator's;
    the extender leaves it to kube-scheduler)."""
    if check_host:
        if node.cpu_milli_used + request.cpu_milli > node.cpu_milli_total:
            return FitFailure("not enough CPU", request.cpu_milli > node.cpu_milli_total, "host")
        if node.memory_mib_used + request.memory_mib > node.memory_mib_total:
            return FitFailure(
                "not enough memory", request.memory_mib > node.memory_mib_total, "host"
            )
    gpu_request = request.gpu
    if gpu_request.is_empty:
        placement = Placement(node.name, (), ())
        return Placement(node.name, (), (), node_policy.score(node, request, placement))
    if not node.gpus:
        return FitFailure("no GPUs (no kube-vgpu GPU inventory on this node)", True, "no-gpus")
    size = len(node.devices)  # GPUs, then MIG devices
    containers = gpu_request.containers
    init_placed: list[ContainerPlacement] = []
    running = Scratch(size)  # the sidecars started so far: they keep their GPUs
    for container in containers:
        if not container.init:
            continue
        # a sidecar is placed into `running` and stays there; an ordinary init container beside it, then gone
        scratch = running if container.sidecar else running.copy()
        devices = _place_container(node, request, container, scratch, gpu_policy)
        if isinstance(devices, FitFailure):
            return devices
        init_placed.append(ContainerPlacement(container, tuple(devices)))
    placed: list[ContainerPlacement] = []
    for container in containers:
        if container.init:
            continue
        devices = _place_container(node, request, container, running, gpu_policy)
        if isinstance(devices, FitFailure):
            return devices
        placed.append(ContainerPlacement(container, tuple(devices)))
    if init_placed:
        placed.extend(init_placed)  # app containers first, as assignments have always listed them
        usage = peak_usage(node, ([d for c in phase for d in c.devices] for phase in container_phases(placed)))
    else:
        # the usual pod, one moment: its scratch is what peak_usage would return, without rebuilding it (hot path)
        usage = tuple(
            GpuUsage(p, running.memory_mib[p], running.cores[p], running.vgpus[p], running.exclusive[p])
            for p in range(size)
            if running.vgpus[p]
        )
    unscored = Placement(node.name, tuple(placed), usage)
    return Placement(node.name, unscored.containers, usage, node_policy.score(node, request, unscored))


def _selector_phrase(request: PlacementRequest) -> str:
    selectors = request.gpu.selectors
    parts = []
    if request.gpu_spec:
        parts.append("model " + "|".join(request.gpu_spec))
    if selectors.use_types:
        parts.append("type " + "/".join(selectors.use_types))
    if selectors.nouse_types:
        parts.append("not type " + "/".join(selectors.nouse_types))
    if selectors.use_uuids or selectors.nouse_uuids:
        parts.append("the UUID selectors")
    return (" matching " + ", ".join(parts)) if parts else ""


def explain_failure(
    node: NodeState, request: PlacementRequest, container: ContainerGpuRequest, scratch: Scratch, fitting: int
) -> FitFailure:
    """A reason a person can act on, computed only when the pod does not fit (off the hot path)."""
    count = container.count
    plural = "GPU" if count == 1 else "GPUs"
    # no node name in reasons: kube-scheduler keys them by node already and groups identical ones
    # ("3 node(s) ..."), which keeps FailedScheduling events short on large clusters
    prefix = ""
    eligible = [g for g in node.gpus if gpu_eligible(g, request.gpu.selectors, request.gpu_spec)]
    if len(eligible) < count:
        return FitFailure(
            f"{prefix}needs {count} {plural}{_selector_phrase(request)}, node has {len(eligible)}",
            unresolvable=True,
            code="count",
        )
    if container.memory_mib is not None and container.memory_mib > max(g.memory_mib for g in eligible):
        return FitFailure(
            f"{prefix}needs {container.memory_mib} MiB per GPU, largest GPU{_selector_phrase(request)} here has "
            f"{max(g.memory_mib for g in eligible)} MiB",
            unresolvable=True,
            code="memory",
        )
    usable = [g for g in eligible if g.schedulable]
    if len(usable) < count:
        unhealthy = sum(1 for g in eligible if not g.healthy)
        mig = sum(1 for g in eligible if g.mig_mode)
        details = ", ".join(
            p for p in (f"{unhealthy} unhealthy" if unhealthy else "", f"{mig} in MIG mode" if mig else "") if p
        )
        return FitFailure(
            f"{prefix}needs {count} {plural}, only {len(usable)} usable ({details})",
            unresolvable=unhealthy == 0,
            code="health",
        )
    exclusive = container.cores >= max(g.cores for g in usable)
    open_gpus = [g for g in usable if not g.exclusive_holders and not scratch.exclusive[g.position]]
    with_free_slot = [g for g in open_gpus if g.used_vgpus + scratch.vgpus[g.position] < g.max_vgpus]
    free_memory = [g.free_memory_mib - scratch.memory_mib[g.position] for g in with_free_slot]
    largest_free = max(free_memory, default=0)
    if len(open_gpus) < count:
        external = sum(1 for g in usable if node.inventory_external.get(g.uuid))
        if external:
            return FitFailure(
                f"{prefix}needs {count} {plural}, {external} used by pods outside kube-vgpu "
                f"({', '.join(sorted({p for g in usable for p in node.inventory_external.get(g.uuid, ())}))})",
                code="external",
            )
        return FitFailure(
            f"{prefix}needs {count} {plural}, {len(usable) - len(open_gpus)} of {len(usable)} held exclusively",
            code="exclusive",
        )
    if len(with_free_slot) < count:
        return FitFailure(
            f"{prefix}needs {count} {plural} with a vGPU slot left, {len(with_free_slot)} have one", code="shares"
        )
    if exclusive:
        idle = sum(1 for g in with_free_slot if g.used_vgpus + scratch.vgpus[g.position] == 0)
        return FitFailure(
            f"{prefix}needs {count} idle {plural} for exclusive use (gpucores 100), {idle} idle", code="exclusive"
        )
    memory_ok = [
        g
        for g in with_free_slot
        if g.free_memory_mib - scratch.memory_mib[g.position] >= container.memory_on(g.memory_mib)
    ]
    if len(memory_ok) < count:
        need = container.memory_mib if container.memory_mib is not None else None
        need_text = (
            f"{need} MiB"
            if need is not None
            else (f"{container.memory_percent} percent of memory" if container.memory_percent else "all its memory")
        )
        if count == 1:
            return FitFailure(f"{prefix}no GPU with {need_text} free (largest free {largest_free} MiB)", code="memory")
        return FitFailure(
            f"{prefix}needs {count} GPUs with {need_text} free, {len(memory_ok)} have it "
            f"(largest free {largest_free} MiB)",
            code="memory",
        )
    most_cores = max((g.free_cores - scratch.cores[g.position] for g in memory_ok), default=0)
    if count == 1:
        return FitFailure(
            f"{prefix}no GPU with {container.cores} percent cores free (most free {most_cores} percent)", code="cores"
        )
    return FitFailure(
        f"{prefix}needs {count} GPUs with {container.cores} percent cores and enough memory free, {fitting} have both",
        code="cores",
    )
