"""Allocate: deliver the extender's decision to the container kubelet is admitting.

kubelet's Allocate names only the device IDs it picked for one container, never the pod. The extender wrote
each pod's exact assignment (POD_ASSIGNMENT_ANNOTATION) and the time it bound it (POD_BIND_TIME_ANNOTATION)
before binding. kubelet admits pods one at a time, in the order they reach it (binding order), and a pod's
containers in order (init containers, then app containers). So for a request of n device IDs:

1. candidates: pods bound to this node, not finished or deleting, with an assignment for this node, and a GPU
   container that has no allocation recorded yet (POD_ALLOCATION_ANNOTATION) and has not started. Each
   candidate offers only its NEXT such container in kubelet's order;
2. eligible: candidates whose next container was assigned exactly n devices;
3. order: a pod already part-way through allocation first (kubelet finishes one pod before the next), then
   bind time, then creation time, then namespace/name;
4. claim: record the container in the pod's allocation annotation with a patch guarded by the resourceVersion
   that was read. If another Allocate (another thread, or a restarted plugin) claimed it first, the API server
   answers Conflict and we re-read and decide again. No lock is held across any round trip;
5. answer with the ASSIGNED GPUs (never the ones kubelet happened to pick: its IDs are only a count).

No eligible container means nobody assigned GPUs for this request: Allocate fails with a reason naming what
was found (kubelet shows it on the pod as UnexpectedAdmissionError). GPUs are never handed out unassigned.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kube_vgpu import protocol
from kube_vgpu.deviceplugin.dynmig import DynamicMig, DynamicMigError
from kube_vgpu.deviceplugin.kube import ApiUnavailable, Conflict, NotFound, PodSource
from kube_vgpu.deviceplugin.state import DeviceState, uuid_of_device_id
from kube_vgpu.protocol import ContainerAssignment, PodAssignment

log = logging.getLogger(__name__)

#: Re-read-and-retry rounds after a Conflict; each round means another writer won a race, so a handful is plenty.
MAX_CLAIM_ATTEMPTS = 8

DEVICE_LIST_ENVVAR = "envvar"
DEVICE_LIST_VOLUME_MOUNTS = "volume-mounts"
DEVICE_LIST_CDI = "cdi-cri"
DEVICE_LIST_STRATEGIES = (DEVICE_LIST_ENVVAR, DEVICE_LIST_VOLUME_MOUNTS, DEVICE_LIST_CDI)
#: The NVIDIA container toolkit reads the device list from mounts under this directory when configured with
#: accept-nvidia-visible-devices-as-volume-mounts (a pod's author cannot forge these, unlike an env var).
VOLUME_MOUNT_DEVICE_DIR = "/var/run/nvidia-container-devices"
CDI_KIND = "nvidia.com/gpu"


class AllocationError(Exception):
    """Allocate must fail; the message is shown to the pod's owner by kubelet."""


@dataclass(frozen=True, slots=True)
class DeliveryConfig:
    """What a container gets besides its devices."""

    #: the limiter library on the node, mounted read-only at the same path ("" = not mounted, e.g. when the
    #: webhook mounts it)
    limiter_library_path: str = protocol.DEFAULT_LIMITER_LIBRARY_PATH
    #: node file mounted at /etc/ld.so.preload so every process loads the limiter ("" = not mounted)
    ld_so_preload_path: str = ""
    #: host directory holding one shared-cache directory per container ("" = no shared cache)
    cache_host_dir: str = "/usr/local/vgpu/containers"
    cache_container_dir: str = "/tmp/vgpu"
    device_list_strategies: tuple[str, ...] = (DEVICE_LIST_ENVVAR,)
    #: look for the limiter library / create cache dirs through the plugin's own view of those host paths
    #: (the DaemonSet mounts them at the same paths)
    check_host_paths: bool = True
    #: Allocate only for pods carrying the webhook's admission mark (a pod that skipped the webhook has no limiter)
    require_admission_mark: bool = False


@dataclass(frozen=True, slots=True)
class Candidate:
    pod: dict[str, Any]
    namespace: str
    name: str
    uid: str
    resource_version: str
    assignment: PodAssignment
    container: ContainerAssignment
    allocated: dict[str, tuple[str, ...]]
    in_progress: bool
    bind_time_s: float
    created: str

    @property
    def key(self) -> tuple[bool, float, str, str, str]:
        return (not self.in_progress, self.bind_time_s, self.created, self.namespace, self.name)

    @property
    def ref(self) -> str:
        return f"{self.namespace}/{self.name}"


@dataclass(slots=True)
class NodePods:
    """One read of the node's pods, sorted into what Allocate needs."""

    candidates: list[Candidate] = field(default_factory=list)
    foreign: list[dict[str, Any]] = field(default_factory=list)
    #: "namespace/name" of pods with an assignment but without the webhook's admission mark (when required)
    unadmitted: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class ContainerDelivery:
    """The answer for one container (server.py turns it into a ContainerAllocateResponse)."""

    pod: str  # namespace/name
    container: str
    uuids: tuple[str, ...]
    envs: dict[str, str]
    mounts: tuple[tuple[str, str, bool], ...]  # (container path, host path, read only)
    cdi_devices: tuple[str, ...] = ()


def _finished(pod: Mapping[str, Any]) -> bool:
    phase = (pod.get("status") or {}).get("phase")
    return phase in ("Succeeded", "Failed") or bool((pod.get("metadata") or {}).get("deletionTimestamp"))


def _started_containers(pod: Mapping[str, Any]) -> set[str]:
    """Containers kubelet already ran: their devices were allocated before (maybe before this plugin kept
    records), so they are never candidates again."""
    status = pod.get("status") or {}
    started = set()
    for key in ("initContainerStatuses", "containerStatuses"):
        for entry in status.get(key) or ():
            state = entry.get("state") or {}
            if "running" in state or "terminated" in state or (entry.get("lastState") or {}).get("terminated"):
                started.add(entry.get("name", ""))
    return started


def _device_count(container: Mapping[str, Any], resource: str = protocol.RESOURCE_GPU) -> int:
    """The container's quantity of `resource` (limits win, as for extended resources); 0 when unparsable."""
    resources = container.get("resources") or {}
    value = (resources.get("limits") or {}).get(resource)
    if value is None:
        value = (resources.get("requests") or {}).get(resource)
    if value is None:
        return 0
    try:
        return protocol.parse_count_quantity(value, what=resource)
    except protocol.InvalidGpuRequest:
        return 0


def _kubelet_order(pod: Mapping[str, Any], resource: str = protocol.RESOURCE_GPU) -> list[tuple[str, bool, int]]:
    """(name, init, device count) of the containers kubelet calls Allocate for on `resource`'s plugin, in the order
    it calls: init containers, then app containers, each in spec order; only those with a quantity of it."""
    spec = pod.get("spec") or {}
    order = []
    for key, init in (("initContainers", True), ("containers", False)):
        for container in spec.get(key) or ():
            count = _device_count(container, resource)
            if count > 0:
                order.append((container.get("name", ""), init, count))
    return order


def asks_for_gpu_devices(pod: Mapping[str, Any]) -> bool:
    """Whether kubelet will call this plugin for the pod: some container has a nvidia.com/gpu quantity > 0."""
    return bool(_kubelet_order(pod))


ADMITTED = protocol.ADMISSION_MARK_VALUE


def _next_container(
    pod: Mapping[str, Any],
    assignment: protocol.PodAssignment,
    allocated: Mapping[str, tuple[str, ...]],
    ref: str,
    notes: list[str],
    resource: str = protocol.RESOURCE_GPU,
) -> protocol.ContainerAssignment | None:
    """The container kubelet will call Allocate for next on `resource`'s plugin, with its assigned devices; None
    when none is left or the assignment cannot answer it (then a note says why)."""
    started = _started_containers(pod)
    by_name = {(c.name, c.init): c for c in assignment.containers if c.devices}
    for name, init, count in _kubelet_order(pod, resource):
        if name in allocated or name in started:
            continue
        assigned = by_name.get((name, init))
        if assigned is None or len(assigned.devices) != count:
            # kubelet will ask for this container, but the assignment cannot answer it: skip the pod rather than
            # let this container's request be matched against a later container's devices
            notes.append(
                f"{ref}: container {name} asks for {count} {resource} but was assigned "
                f"{len(assigned.devices) if assigned else 0} device(s)"
            )
            return None
        return assigned
    return None


def read_node_pods(pods: list[dict[str, Any]], node_name: str, *, require_admission_mark: bool = False,
                   resource: str = protocol.RESOURCE_GPU) -> NodePods:
    result = NodePods()
    for pod in pods:
        metadata = pod.get("metadata") or {}
        ref = f"{metadata.get('namespace', '')}/{metadata.get('name', '')}"
        if _finished(pod):
            continue
        annotations = metadata.get("annotations") or {}
        text = annotations.get(protocol.POD_ASSIGNMENT_ANNOTATION)
        if text is None:
            if asks_for_gpu_devices(pod):
                result.foreign.append(pod)
            continue
        try:
            assignment = protocol.decode_assignment(text)
        except protocol.ProtocolError as exc:
            result.notes.append(f"{ref}: unreadable assignment ({exc})")
            continue
        if assignment.node != node_name:
            result.notes.append(f"{ref}: assigned to node {assignment.node}, not {node_name}")
            continue
        if require_admission_mark and annotations.get(protocol.POD_ADMITTED_ANNOTATION) != ADMITTED:
            # an assignment without the webhook's mark: the pod skipped the webhook, so no limiter is wired
            result.unadmitted.append(ref)
            continue
        allocated: dict[str, tuple[str, ...]] = {}
        if protocol.POD_ALLOCATION_ANNOTATION in annotations:
            try:
                allocated = protocol.decode_allocation(annotations[protocol.POD_ALLOCATION_ANNOTATION])
            except protocol.ProtocolError as exc:
                # an unreadable record must not let a container be allocated twice
                result.notes.append(f"{ref}: unreadable allocation record ({exc}); pod skipped")
                continue
        next_container = _next_container(pod, assignment, allocated, ref, result.notes, resource)
        if next_container is None:
            continue
        bind_time_s = math.inf  # pods bound before bind times were written go last
        if protocol.POD_BIND_TIME_ANNOTATION in annotations:
            try:
                bind_time_s = protocol.parse_bind_time(annotations[protocol.POD_BIND_TIME_ANNOTATION])
            except protocol.ProtocolError as exc:
                result.notes.append(f"{ref}: {exc}")
        result.candidates.append(
            Candidate(
                pod=pod,
                namespace=metadata.get("namespace", ""),
                name=metadata.get("name", ""),
                uid=metadata.get("uid", ""),
                resource_version=metadata.get("resourceVersion", ""),
                assignment=assignment,
                container=next_container,
                allocated=allocated,
                in_progress=bool(allocated),
                bind_time_s=bind_time_s,
                created=metadata.get("creationTimestamp", ""),
            )
        )
    result.candidates.sort(key=lambda c: c.key)
    return result


class Allocator:
    def __init__(
        self,
        node_name: str,
        pods: PodSource | None,
        state: DeviceState,
        delivery: DeliveryConfig | None = None,
    ) -> None:
        self.node_name = node_name
        self.pods = pods
        self.state = state
        self.delivery = delivery or DeliveryConfig()
        #: dynamic MIG: creates the instances the extender placed (None: no dynamic GPUs on this node)
        self.dynamic: DynamicMig | None = None

    # -- Allocate -----------------------------------------------------------------------------------------------

    def allocate(self, requests: list[list[str]], resource: str = protocol.RESOURCE_GPU) -> list[ContainerDelivery]:
        """One delivery per container request of `resource`'s plugin (nvidia.com/gpu, or a MIG resource), in
        order; raises AllocationError."""
        if self.pods is None:
            raise AllocationError(
                "the kube-vgpu device plugin runs without API server access (no kubeconfig, not in a cluster), "
                "so it cannot read which GPUs the scheduler assigned; refusing to hand out GPUs"
            )
        done: list[tuple[Candidate, ContainerDelivery]] = []
        try:
            for device_ids in requests:
                claimed = self._claim(device_ids, resource)
                try:
                    created = self._create_dynamic(claimed)
                    delivery = self._deliver(claimed, device_ids, created)
                except AllocationError:
                    self._release(claimed)
                    raise
                done.append((claimed, delivery))
        except AllocationError:
            for claimed, _ in done:
                self._release(claimed)
            raise
        return [delivery for _, delivery in done]

    def _claim(self, device_ids: list[str], resource: str = protocol.RESOURCE_GPU) -> Candidate:
        assert self.pods is not None
        wanted = len(device_ids)
        for _attempt in range(MAX_CLAIM_ATTEMPTS):
            try:
                seen = read_node_pods(self.pods.list_node_pods(self.node_name), self.node_name,
                                      require_admission_mark=self.delivery.require_admission_mark, resource=resource)
            except ApiUnavailable as exc:
                raise AllocationError(f"cannot read the pods on node {self.node_name}: {exc}") from None
            eligible = [c for c in seen.candidates if len(c.container.devices) == wanted]
            if not eligible:
                raise AllocationError(self._no_match_reason(wanted, seen, resource))
            chosen = eligible[0]
            if len(eligible) > 1:
                log.info(
                    "Allocate of %d device(s): %s/%s chosen over %s (in progress first, then bind order)",
                    wanted,
                    chosen.ref,
                    chosen.container.name,
                    ", ".join(f"{c.ref}/{c.container.name}" for c in eligible[1:]),
                )
            unhealthy = [d.uuid for d in chosen.container.devices if not self.state.is_healthy(d.uuid)]
            unknown = [d.uuid for d in chosen.container.devices if self.state.capacity(d.uuid) is None]
            # a MIG resource's plugin hands over only MIG devices of its profile, nvidia.com/gpu's never one
            kind = f"MIG devices of profile {resource.removeprefix(protocol.MIG_RESOURCE_PREFIX)}" \
                if resource != protocol.RESOURCE_GPU else f"shareable GPUs ({protocol.RESOURCE_GPU})"
            wrong_kind = [d.uuid for d in chosen.container.devices
                          if d.uuid not in unknown and self._wrong_kind(d.uuid, resource)]
            if unknown or unhealthy or wrong_kind:
                problems = [
                    *([f"not on node {self.node_name}: {', '.join(unknown)}"] if unknown else []),
                    *([f"not {kind}: {', '.join(wrong_kind)}"] if wrong_kind else []),
                    *([f"unhealthy: {', '.join(unhealthy)}"] if unhealthy else []),
                ]
                raise AllocationError(
                    f"pod {chosen.ref} container {chosen.container.name} was assigned GPUs that are "
                    + "; ".join(problems) + "; the pod must be rescheduled"
                )
            record = dict(chosen.allocated)
            record[chosen.container.name] = tuple(device_ids)
            try:
                self.pods.patch_pod_annotations(
                    chosen.namespace,
                    chosen.name,
                    chosen.resource_version,
                    {protocol.POD_ALLOCATION_ANNOTATION: protocol.encode_allocation(record)},
                )
            except (Conflict, NotFound):
                log.info("pod %s changed while claiming container %s; re-reading", chosen.ref, chosen.container.name)
                continue
            except ApiUnavailable as exc:
                raise AllocationError(f"cannot record the allocation on pod {chosen.ref}: {exc}") from None
            log.info(
                "Allocate: pod %s container %s gets %s",
                chosen.ref,
                chosen.container.name,
                ",".join(d.uuid for d in chosen.container.devices),
            )
            return chosen
        raise AllocationError(
            f"could not claim a pod for {wanted} device(s) after {MAX_CLAIM_ATTEMPTS} attempts: pods on node "
            f"{self.node_name} kept changing; kubelet will retry the pod"
        )

    def _wrong_kind(self, uuid: str, resource: str) -> bool:
        """A device `resource`'s plugin must not hand over: a static MIG device on nvidia.com/gpu, on a MIG
        resource anything but a MIG device of its profile."""
        mig = self.state.mig_device(uuid)
        if resource == protocol.RESOURCE_GPU:  # a vgpu-mode: mig pod asks nvidia.com/gpu for a dynamic instance
            return mig is not None and protocol.parse_dynamic_mig_device(uuid) is None
        return mig is None or protocol.MIG_RESOURCE_PREFIX + mig[1].profile != resource

    def _release(self, claimed: Candidate) -> None:
        """Best effort: undo a claim when a later container of the same request failed."""
        assert self.pods is not None
        try:
            for pod in self.pods.list_node_pods(self.node_name):
                metadata = pod.get("metadata") or {}
                if (metadata.get("namespace"), metadata.get("name")) != (claimed.namespace, claimed.name):
                    continue
                record = protocol.decode_allocation(
                    (metadata.get("annotations") or {}).get(
                        protocol.POD_ALLOCATION_ANNOTATION, '{"v":1,"containers":{}}'
                    )
                )
                record.pop(claimed.container.name, None)
                value = protocol.encode_allocation(record) if record else None
                self.pods.patch_pod_annotations(
                    claimed.namespace,
                    claimed.name,
                    metadata.get("resourceVersion", ""),
                    {protocol.POD_ALLOCATION_ANNOTATION: value},
                )
        except (ApiUnavailable, Conflict, NotFound, protocol.ProtocolError) as exc:
            log.warning("could not undo the claim of %s/%s: %s", claimed.ref, claimed.container.name, exc)

    def _no_match_reason(self, wanted: int, seen: NodePods, resource: str = protocol.RESOURCE_GPU) -> str:
        parts = [
            f"no kube-vgpu assignment on node {self.node_name} matches a container asking for {wanted} "
            f"{resource} (kube-vgpu never hands out GPUs nobody assigned)"
        ]
        if seen.candidates:
            waiting = ", ".join(
                f"{c.ref}/{c.container.name} ({len(c.container.devices)} GPU)" for c in seen.candidates[:5]
            )
            parts.append(f"containers waiting for their assigned GPUs: {waiting}")
        if seen.foreign:
            names = ", ".join(
                f"{(p.get('metadata') or {}).get('namespace')}/{(p.get('metadata') or {}).get('name')} "
                f"(schedulerName {(p.get('spec') or {}).get('schedulerName', 'default-scheduler')})"
                for p in seen.foreign[:5]
            )
            parts.append(
                f"pods asking for {protocol.RESOURCE_GPU} that did not go through kube-vgpu: {names}; "
                f"GPU pods must use schedulerName {protocol.DEFAULT_SCHEDULER_NAME}"
            )
        if seen.unadmitted:
            parts.append(
                f"pods refused because they skipped kube-vgpu's webhook (no {protocol.POD_ADMITTED_ANNOTATION} "
                f"annotation, so no GPU limits were set up): {', '.join(seen.unadmitted[:5])}"
            )
        parts.extend(seen.notes[:5])
        return "; ".join(parts)

    # -- the answer ---------------------------------------------------------------------------------------------

    def _create_dynamic(self, claimed: Candidate) -> dict[str, str]:
        """Dynamic MIG: create the MIG instances the container was assigned (device name -> new MIG device UUID).
        A failure was rolled back by DynamicMig; the claim is released by the caller and kubelet fails the pod
        with this reason, so no pod runs on a half-made instance."""
        created: dict[str, str] = {}
        for device in claimed.container.devices:
            placement = protocol.parse_dynamic_mig_device(device.uuid)
            if placement is None:
                continue
            if self.dynamic is None:
                raise AllocationError(f"pod {claimed.ref} container {claimed.container.name} was assigned a dynamic "
                                      f"MIG instance ({device.uuid}), but dynamic MIG is off on node {self.node_name}")
            try:
                created[device.uuid] = self.dynamic.ensure(placement)
            except DynamicMigError as exc:
                for done in created:  # the container's earlier instances: all of its devices or none
                    earlier = protocol.parse_dynamic_mig_device(done)
                    if earlier is not None:
                        self.dynamic.destroy(earlier)
                raise AllocationError(
                    f"pod {claimed.ref} container {claimed.container.name}: creating its MIG instance failed: {exc}; "
                    "nothing was left on the GPU; the pod must be created again (a Job's or ReplicaSet's "
                    "controller does that) to be placed anew"
                ) from None
        return created

    def _deliver(self, claimed: Candidate, device_ids: list[str],
                 created: Mapping[str, str] | None = None) -> ContainerDelivery:
        devices = claimed.container.devices
        # a dynamic MIG device is delivered as the MIG device just created for it
        uuids = tuple((created or {}).get(d.uuid, d.uuid) for d in devices)
        delivery = self.delivery
        envs: dict[str, str] = {}
        mounts: list[tuple[str, str, bool]] = []
        cdi: tuple[str, ...] = ()
        visible = ",".join(uuids)
        if DEVICE_LIST_ENVVAR in delivery.device_list_strategies:
            envs[protocol.ENV_NVIDIA_VISIBLE_DEVICES] = visible
        if DEVICE_LIST_VOLUME_MOUNTS in delivery.device_list_strategies:
            envs[protocol.ENV_NVIDIA_VISIBLE_DEVICES] = VOLUME_MOUNT_DEVICE_DIR
            mounts.extend((f"{VOLUME_MOUNT_DEVICE_DIR}/{uuid}", "/dev/null", True) for uuid in uuids)
        if DEVICE_LIST_CDI in delivery.device_list_strategies:
            cdi = tuple(f"{CDI_KIND}={uuid}" for uuid in uuids)
        # CUDA numbers the visible GPUs in this order, so vGPU i of the assignment is CUDA device i, the index
        # the limiter's CUDA_DEVICE_MEMORY_LIMIT_<i> refers to
        envs[protocol.ENV_CUDA_VISIBLE_DEVICES] = visible
        for position, device in enumerate(devices):
            if self.state.mig_device(device.uuid) is not None:
                continue  # a MIG device is isolated by the hardware: no limiter memory limit
            # concrete MiB from the assignment; the only source for gpumem-percentage requests
            envs[f"{protocol.ENV_MEMORY_LIMIT_PREFIX}{position}"] = f"{device.memory_mib}m"
        mig_only = all(self.state.mig_device(device.uuid) is not None for device in devices)
        if delivery.limiter_library_path and not mig_only:  # a MIG device is isolated by the hardware: no limiter
            present = not delivery.check_host_paths or os.path.isfile(delivery.limiter_library_path)
            if present:
                mounts.append((delivery.limiter_library_path, delivery.limiter_library_path, True))
            elif self._limiter_needed(devices):
                raise AllocationError(
                    f"pod {claimed.ref} container {claimed.container.name} shares GPUs, but the limiter library "
                    f"{delivery.limiter_library_path} is missing on node {self.node_name}, so its limits could "
                    "not be enforced"
                )
            else:
                log.warning(
                    "limiter library %s missing; exclusive GPUs delivered without it", delivery.limiter_library_path
                )
        if delivery.ld_so_preload_path and not mig_only:
            mounts.append(("/etc/ld.so.preload", delivery.ld_so_preload_path, True))
        if delivery.cache_host_dir:
            host_dir = os.path.join(delivery.cache_host_dir, f"{claimed.uid or claimed.name}_{claimed.container.name}")
            if delivery.check_host_paths:
                try:
                    os.makedirs(host_dir, exist_ok=True)
                    # the container may run as any user and must create its cache file there (umask would
                    # have narrowed a mode given to makedirs)
                    os.chmod(host_dir, 0o777)
                except OSError as exc:
                    raise AllocationError(f"cannot create the limiter's shared cache {host_dir}: {exc}") from None
            mounts.append((delivery.cache_container_dir, host_dir, False))
            envs[protocol.ENV_SHARED_CACHE] = f"{delivery.cache_container_dir}/vgpu.cache"
        return ContainerDelivery(
            pod=claimed.ref,
            container=claimed.container.name,
            uuids=uuids,
            envs=envs,
            mounts=tuple(mounts),
            cdi_devices=cdi,
        )

    def _limiter_needed(self, devices: tuple[protocol.DeviceShare, ...]) -> bool:
        for device in devices:
            capacity = self.state.capacity(device.uuid)  # a MIG device is held whole: no limiter needed
            if capacity is None or device.memory_mib < capacity[0] or device.cores < capacity[1]:
                return True
        return False

    # -- GetPreferredAllocation ---------------------------------------------------------------------------------

    def preferred(self, available: list[str], must_include: list[str], size: int,
                  resource: str = protocol.RESOURCE_GPU) -> list[str]:
        """Device IDs on the GPUs the container Allocate will most likely match was assigned (keeps kubelet's
        per-device bookkeeping and NUMA alignment in line with reality); otherwise one ID per distinct GPU."""
        chosen: list[str] = list(dict.fromkeys(must_include))[:size]
        if len(chosen) >= size:
            return chosen
        pool = [d for d in available if d not in chosen]
        target: list[str] = []
        if self.pods is not None:
            try:
                seen = read_node_pods(self.pods.list_node_pods(self.node_name), self.node_name,
                                      require_admission_mark=self.delivery.require_admission_mark, resource=resource)
                eligible = [c for c in seen.candidates if len(c.container.devices) == size]
                if eligible:
                    target = [d.uuid for d in eligible[0].container.devices]
            except ApiUnavailable as exc:
                log.info("GetPreferredAllocation without pod information: %s", exc)
        used = {uuid_of_device_id(d) for d in chosen}
        for uuid in target:
            if len(chosen) >= size or uuid in used:
                continue
            for device in pool:
                if uuid_of_device_id(device) == uuid:
                    chosen.append(device)
                    pool.remove(device)
                    used.add(uuid)
                    break
        # then spread over GPUs not used yet (each vGPU of a container is on a different GPU), most free first
        free_by_uuid: dict[str, int] = {}
        for device in pool:
            free_by_uuid[uuid_of_device_id(device)] = free_by_uuid.get(uuid_of_device_id(device), 0) + 1
        for uuid in sorted(free_by_uuid, key=lambda u: (-free_by_uuid[u], u)):
            if len(chosen) >= size:
                break
            if uuid in used:
                continue
            device = next(d for d in pool if uuid_of_device_id(d) == uuid)
            chosen.append(device)
            pool.remove(device)
            used.add(uuid)
        for device in pool:
            if len(chosen) >= size:
                break
            chosen.append(device)
        return chosen
