"""The quota gate: filter refuses nodes whose flavor cannot fit the pod in its ClusterQueue; bind re-checks and
takes the quota atomically with the device reservation.

Accounting is keyed by pod UID and driven only by ClusterState's usage listeners (+1 when a pod's assigned usage
starts counting: bind reservation, annotation seen at start-up or relist; -1 when it stops: finished, deleted,
rolled back). Usage is computed from the assignment actually written (vGPUs, MiB and cores % summed over vGPUs),
so a restart rebuilds it from the annotations and a rollback releases it, with no bookkeeping of our own.

Everything here runs under `state.lock` (filter, bind, the listeners, the status view), so `reserve` and the
listener's +1 that follows it are one atomic step: two binds cannot both take the last unit of quota.

Kueue semantics kept: a pod's ClusterQueue is its LocalQueue's (label kueue.x-k8s.io/queue-name, in the pod's
namespace); the flavor of a node is, per resource group, the first flavor whose ResourceFlavor nodeLabels the node
carries (and whose nodeTaints the pod tolerates); StrictFIFO blocks a pod while a pod ahead of it in the queue
(higher priority, or equal priority and older) waits for quota; stopPolicy Hold / HoldAndDrain admit nothing new.
"""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from kube_vgpu import kubeapi, protocol
from kube_vgpu.extender.engine.fit import gpu_eligible
from kube_vgpu.extender.engine.model import NodeState
from kube_vgpu.extender.quota.accounting import FlavorResource, QuotaTree, Shortfall
from kube_vgpu.extender.quota.objects import (
    RESOURCE_CPU,
    RESOURCE_MEMORY,
    RESOURCE_PODS,
    RESOURCE_UNITS,
    STRICT_FIFO,
    ClusterQueue,
    LocalQueue,
    QuotaConfig,
    Toleration,
    build_config,
    load_documents,
    parse_tolerations,
)
from kube_vgpu.extender.state import FINISHED_PHASES, ClusterState, PodRecord
from kube_vgpu.protocol import PodAssignment, PodGpuRequest

log = logging.getLogger(__name__)

#: What happens to pods without a kueue.x-k8s.io/queue-name label.
UNQUEUED_POLICIES = ("admit", "default", "refuse")
#: A pending pod not seen by filter for this long is forgotten (kube-scheduler retries unschedulable pods at least
#: every 5 minutes, so a live one is seen again well before; this only clears pods whose deletion was missed).
PENDING_TTL_S = 900.0
GPU_RESOURCES = (protocol.RESOURCE_GPU, protocol.RESOURCE_GPU_MEMORY, protocol.RESOURCE_GPU_CORES)


# ---------------------------------------------------------------------------------------------
# What a pod asks for / holds
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PodInfo:
    """What the gate needs from a pod object beyond the state's PodRecord."""

    spec_priority: int
    priority_class: str | None  # kueue.x-k8s.io/priority-class label
    created_s: float
    tolerations: tuple[Toleration, ...]
    cpu_milli: int
    memory_bytes: int


def _creation_seconds(text: Any, default: float) -> float:
    if not isinstance(text, str) or not text:
        return default
    try:
        return dt.datetime.fromisoformat(text).timestamp()
    except ValueError:
        return default


def _host_requests(pod: Mapping[str, Any]) -> tuple[int, int]:
    """The pod's CPU (millicores) and memory (bytes) as Kueue and kube-scheduler count them (native sidecars with
    the app containers, init containers at their peak, overhead; kube_vgpu.kubeapi). A quantity the API server
    would never have stored counts 0 rather than failing the pod's events."""
    try:
        requests = kubeapi.pod_requests(pod, (kubeapi.RESOURCE_CPU, kubeapi.RESOURCE_MEMORY))
    except kubeapi.InvalidQuantity as exc:
        metadata = pod.get("metadata") or {}
        log.warning("pod %s/%s: unreadable CPU or memory request (%s); charged 0", metadata.get("namespace"),
                    metadata.get("name"), exc)
        return 0, 0
    return requests.get(kubeapi.RESOURCE_CPU, 0), requests.get(kubeapi.RESOURCE_MEMORY, 0)


def pod_info(pod: Mapping[str, Any], now_s: float) -> PodInfo:
    metadata = pod.get("metadata") or {}
    spec = pod.get("spec") or {}
    labels = metadata.get("labels") or {}
    priority = spec.get("priority")
    try:
        tolerations = parse_tolerations(spec.get("tolerations"), "spec.tolerations")
    except ValueError:
        tolerations = ()
    cpu_milli, memory_bytes = _host_requests(pod)
    return PodInfo(
        spec_priority=priority if isinstance(priority, int) and not isinstance(priority, bool) else 0,
        priority_class=labels.get(protocol.LABEL_KUEUE_PRIORITY_CLASS) or None,
        created_s=_creation_seconds(metadata.get("creationTimestamp"), now_s),
        tolerations=tolerations,
        cpu_milli=cpu_milli,
        memory_bytes=memory_bytes,
    )


def assignment_usage(assignment: PodAssignment) -> dict[str, int]:
    """vGPUs, MiB and cores % a written assignment holds at its peak: the largest, per resource, of the moments
    that hold devices at once (protocol.container_phases: each init container beside the sidecars started before
    it, then the app containers beside every sidecar), as Kueue's pod-request rule counts them."""
    totals = {r: 0 for r in GPU_RESOURCES}
    for phase in assignment.phases:
        devices = [d for c in phase for d in c.devices]
        values = (len(devices), sum(d.memory_mib for d in devices), sum(d.cores for d in devices))
        for resource, value in zip(GPU_RESOURCES, values, strict=True):
            totals[resource] = max(totals[resource], value)
    return totals


def request_usage_fixed(request: PodGpuRequest) -> dict[str, int] | None:
    """What the pod will hold on any node, when that does not depend on the node's GPUs (every container names
    its MiB per vGPU); None otherwise. Cores: what the engine assigns on a GPU of 100 compute units (for
    exclusive use it assigns the GPU's units, never more than the 100 requested)."""
    if any(c.memory_mib is None for c in request.containers):
        return None
    totals = {r: 0 for r in GPU_RESOURCES}
    for phase in request.phases:
        values = (sum(c.count for c in phase), sum(c.count * (c.memory_mib or 0) for c in phase),
                  sum(c.count * c.cores for c in phase))
        for resource, value in zip(GPU_RESOURCES, values, strict=True):
            totals[resource] = max(totals[resource], value)
    return totals


def request_usage_on(request: PodGpuRequest, node: NodeState) -> dict[str, int]:
    """What the pod will hold if placed on `node`, before the GPUs are chosen. Exact when the node's eligible GPUs
    are alike (the usual case); otherwise an upper bound (the largest eligible GPU), so the assignment that is
    then counted never exceeds what was checked."""
    eligible = [g for g in node.gpus if g.schedulable and gpu_eligible(g, request.selectors, ())]
    totals = {r: 0 for r in GPU_RESOURCES}
    for phase in request.phases:
        count = memory_mib = cores = 0
        for container in phase:
            per_memory = container.memory_mib if container.memory_mib is not None else max(
                (container.memory_on(g.memory_mib) for g in eligible), default=0)
            per_cores = max((g.cores if container.cores >= g.cores else container.cores for g in eligible),
                            default=container.cores)
            count += container.count
            memory_mib += container.count * per_memory
            cores += container.count * per_cores
        for resource, value in zip(GPU_RESOURCES, (count, memory_mib, cores), strict=True):
            totals[resource] = max(totals[resource], value)
    return totals


# ---------------------------------------------------------------------------------------------
# Records
# ---------------------------------------------------------------------------------------------


@dataclass(slots=True)
class Charge:
    """One pod's counted usage. Kept per pod, with priority, so a preemptor can pick victims later."""

    uid: str
    namespace: str
    name: str
    cluster_queue: str
    node_name: str
    resources: dict[str, int]  # what the pod holds, per resource (only resources the queue covers)
    amounts: dict[FlavorResource, int] = field(default_factory=dict)  # what is counted in the tree
    priority: int = 0
    created_s: float = 0.0
    counted: bool = False
    problem: str = ""  # why it is not counted (node unknown yet, node outside the queue's flavors)


@dataclass(slots=True)
class PendingPod:
    """A pod of a ClusterQueue seen by filter and not admitted yet."""

    uid: str
    namespace: str
    name: str
    cluster_queue: str
    priority: int
    created_s: float
    last_seen_s: float
    waiting_for_quota: bool = False
    reason: str = ""

    @property
    def order(self) -> tuple[int, float, str, str]:
        """Kueue's queue order: higher priority first, then older, then name (a total order: no ties)."""
        return (-self.priority, self.created_s, self.namespace, self.name)


@dataclass(frozen=True, slots=True)
class Admission:
    """A pod resolved to a ClusterQueue that may be admitted, subject to the per-node quota check."""

    uid: str
    cluster_queue: ClusterQueue
    local_queue: LocalQueue
    tolerations: tuple[Toleration, ...]
    info: PodInfo
    covered: frozenset[str]  # the queue's covered resources
    host_needs: tuple[tuple[str, int], ...]  # cpu / memory / pods, when covered (node-independent)
    label_keys: tuple[str, ...]  # every node label key the queue's flavors select on


@dataclass(slots=True)
class _DecisionCache:
    """filter asks once per node for the same pod. The answer depends on the node only through the values of the
    labels the queue's flavors select on and (for requests in percent or whole GPUs) the sizes of its GPUs, so it
    is computed once per distinct (label values, GPU signature) rather than once per node."""

    pod: Mapping[str, Any]
    version: int
    result: Admission | Refusal | None
    request: PodGpuRequest | None = None
    label_keys: tuple[str, ...] = ()
    single_key: str | None = None  # the one label key, when the flavors select on exactly one (the usual case)
    fixed_needs: tuple[tuple[str, int], ...] | None = None  # when the needs do not depend on the node
    plain: bool = True  # no GPU type / UUID selectors: GPU eligibility depends on GPU sizes only
    needs_by_signature: dict[Any, tuple[tuple[str, int], ...]] = field(default_factory=dict)
    fits: dict[Any, Refusal | None] = field(default_factory=dict)  # (label values, needs) -> answer
    fast: dict[Any, Refusal | None] = field(default_factory=dict)  # label values [, GPU signature] -> answer


_MISSING: Any = object()


@dataclass(frozen=True, slots=True)
class Refusal:
    reason: str
    #: the pod waits for quota (blocks pods behind it under StrictFIFO); False when waiting cannot help
    waiting: bool


# ---------------------------------------------------------------------------------------------
# The gate
# ---------------------------------------------------------------------------------------------


class QuotaGate:
    """Implements extender.scheduler.Gate. All methods expect or take `state.lock`."""

    def __init__(
        self,
        state: ClusterState,
        file_documents: Sequence[tuple[str, Mapping[str, Any]]] | None = None,
        *,
        unqueued: str = "admit",
        live: bool = False,
    ) -> None:
        if unqueued not in UNQUEUED_POLICIES:
            raise ValueError(f"unqueued pods policy {unqueued!r} is not one of {', '.join(UNQUEUED_POLICIES)}")
        self.state = state
        self.unqueued = unqueued
        self.file_documents = list(file_documents or [])
        #: kind -> {(namespace, name): object} listed from the cluster (live mode)
        self.cluster_documents: dict[str, dict[tuple[str, str], Mapping[str, Any]]] = {}
        self.cluster_namespaces: dict[str, dict[str, str]] = {}  # namespace -> labels (live mode)
        self._document_namespaces: dict[str, dict[str, str]] = {}  # from Namespace objects in the file
        self.live = live
        #: False until the cluster's Kueue objects were listed once (live mode): admit nothing before
        self.synced = not live
        self.sources = ["file"] if self.file_documents else []
        self.watcher: Any = None  # live.KueueWatcher in live mode
        self.config = QuotaConfig()
        self.tree = QuotaTree(())
        self.tree_queues: list[str] = []  # the ClusterQueues the tree was built from
        self.charges: dict[str, Charge] = {}
        self.pending: dict[str, PendingPod] = {}
        self._pod_infos: dict[str, PodInfo] = {}
        self._unresolved: set[str] = set()
        #: uid -> the ClusterQueue a counted pod was admitted to; survives config reloads (as a Kueue Workload's
        #: status.admission does): deleting or re-pointing a LocalQueue does not move or drop running pods
        self._admitted_to: dict[str, str] = {}
        self._round: dict[str, Refusal] = {}  # refusals of the filter call under way, per pod
        self._version = 0  # bumped on anything that can change a decision
        self._decision: _DecisionCache | None = None
        #: inventory text -> id of its usable GPUs' (model, MiB, cores) set; see _signature
        self._signatures: dict[str | None, int] = {}
        self._signature_ids: dict[frozenset[tuple[str, int, int]], int] = {}
        self._last_expiry_s = 0.0
        with state.lock:
            state.usage_listeners.append(self._on_usage)
            state.pod_listeners.append(self._on_pod)
            self._reload()

    # --- configuration --------------------------------------------------------------------------
    def set_cluster_objects(self, kind: str, objects: Mapping[tuple[str, str], Mapping[str, Any]]) -> None:
        """Replace the cluster's objects of one kind (live watch) and re-evaluate everything."""
        with self.state.lock:
            self.cluster_documents[kind] = dict(objects)
            if "cluster" not in self.sources:
                self.sources.append("cluster")
            # LocalQueues and priority classes do not change what admitted pods count (Kueue keeps a workload's
            # queue and priority once admitted): only pods not counted yet need a look
            self._reload(recount=kind not in ("LocalQueue", "WorkloadPriorityClass"))

    def set_namespaces(self, namespaces: Mapping[str, Mapping[str, str]]) -> None:
        """The cluster's namespaces and their labels (for namespaceSelectors); cheap, no re-count."""
        with self.state.lock:
            self.cluster_namespaces = {name: dict(labels) for name, labels in namespaces.items()}
            self.config.namespaces = {**self._document_namespaces, **self.cluster_namespaces}
            self._version += 1

    def mark_synced(self) -> None:
        with self.state.lock:
            if not self.synced:
                self.synced = True
                self._version += 1

    def _reload(self, recount: bool = True) -> None:
        docs: list[tuple[str, Mapping[str, Any]]] = list(self.file_documents)
        for kind in sorted(self.cluster_documents):
            docs.extend(("cluster", doc) for doc in self.cluster_documents[kind].values())
        config = build_config(docs)
        for error in config.errors:
            if error not in self.config.errors:
                log.error("quota: ignoring invalid object: %s", error)
        self._document_namespaces = dict(config.namespaces)
        config.namespaces.update(self.cluster_namespaces)
        self.config = config
        if not recount and set(config.cluster_queues) == set(self.tree_queues):
            for record in self.state.pods.values():
                if record.uid not in self.charges:
                    self._on_usage(record, 1)  # e.g. its LocalQueue appeared only now
            self._version += 1
            return
        self.tree = QuotaTree(config.cluster_queues.values(), config.cohorts.values())
        self.tree_queues = list(config.cluster_queues)
        # re-derive every charge from the pods that count now: quotas, cohorts or flavors may have changed
        self.charges.clear()
        self._admitted_to = {uid: name for uid, name in self._admitted_to.items() if uid in self.state.pods}
        self._unresolved.clear()
        for record in self.state.pods.values():
            self._on_usage(record, 1)
        self._version += 1

    # --- listeners (called under state.lock) ------------------------------------------------------
    def _on_usage(self, record: PodRecord, sign: int) -> None:
        uid = record.uid
        if sign < 0:
            charge = self.charges.pop(uid, None)
            if charge is not None:
                if charge.counted:
                    self.tree.add(charge.cluster_queue, charge.amounts, -1)
                self._unresolved.discard(uid)
                self._version += 1
            self._admitted_to.pop(uid, None)
            return
        if uid in self.charges:
            return  # already counted: +1 is idempotent
        if self.pending.pop(uid, None) is not None:
            self._version += 1
        admitted_to = self._admitted_to.get(uid)
        cluster_queue = self.config.cluster_queues.get(admitted_to) if admitted_to else None
        if cluster_queue is None:
            cluster_queue = self._queue_of(record.namespace, record.labels)
        if cluster_queue is None:
            return  # not managed by any ClusterQueue
        self._admitted_to[uid] = cluster_queue.name
        info = self._pod_infos.get(uid)
        held = assignment_usage(record.assignment)
        covered = cluster_queue.covered_resources
        resources = {r: v for r, v in held.items() if r in covered and v > 0}
        if info is not None:
            for resource, value in ((RESOURCE_CPU, info.cpu_milli), (RESOURCE_MEMORY, info.memory_bytes)):
                if resource in covered and value > 0:
                    resources[resource] = value
        if RESOURCE_PODS in covered:
            resources[RESOURCE_PODS] = 1
        charge = Charge(
            uid=uid,
            namespace=record.namespace,
            name=record.name,
            cluster_queue=cluster_queue.name,
            node_name=record.node_name,
            resources=resources,
            priority=self._priority(info) if info is not None else 0,
            created_s=info.created_s if info is not None else 0.0,
        )
        self.charges[uid] = charge
        self._count(charge, info)
        self._version += 1

    def _count(self, charge: Charge, info: PodInfo | None) -> None:
        """Put the charge in the tree under the flavors of its node (or remember to retry)."""
        cluster_queue = self.config.cluster_queues.get(charge.cluster_queue)
        node = self.state.nodes.get(charge.node_name)
        if cluster_queue is None:
            return
        if node is None:
            charge.problem = f"node {charge.node_name} not known yet"
            self._unresolved.add(charge.uid)
            return
        flavors = self._flavors(cluster_queue, node.labels, charge.resources, info.tolerations if info else None)
        if isinstance(flavors, str):
            charge.problem = flavors  # admitted outside this queue's flavors (e.g. the queue changed since)
            self._unresolved.discard(charge.uid)
            return
        charge.amounts = {(flavors[r], r): v for r, v in charge.resources.items()}
        charge.counted = True
        charge.problem = ""
        self._unresolved.discard(charge.uid)
        self.tree.add(charge.cluster_queue, charge.amounts, 1)

    def _resolve_unresolved(self) -> None:
        for uid in list(self._unresolved):
            charge = self.charges.get(uid)
            if charge is None:
                self._unresolved.discard(uid)
            elif charge.node_name in self.state.nodes:
                self._count(charge, self._pod_infos.get(uid))
                self._version += 1

    def _on_pod(self, uid: str, pod: Mapping[str, Any] | None) -> None:
        """Every pod event (ClusterState.pod_listeners): remembers what charges need and forgets gone pods."""
        if pod is None or (pod.get("status") or {}).get("phase") in FINISHED_PHASES:
            self._pod_infos.pop(uid, None)
            self._forget_pending(uid)
            return
        metadata = pod.get("metadata") or {}
        if (pod.get("spec") or {}).get("nodeName"):
            self._forget_pending(uid)  # bound: no longer waits
        annotations = metadata.get("annotations") or {}
        if protocol.POD_ASSIGNMENT_ANNOTATION in annotations or uid in self.pending or uid in self._pod_infos:
            self._pod_infos[uid] = pod_info(pod, self.state.clock())

    def _forget_pending(self, uid: str) -> None:
        entry = self.pending.pop(uid, None)
        if entry is not None and entry.waiting_for_quota:
            self._version += 1

    # --- resolution -----------------------------------------------------------------------------
    def _local_queue_of(self, namespace: str, labels: Mapping[str, str]) -> LocalQueue | str | None:
        """The pod's LocalQueue; None when the pod is not managed; a reason when it cannot be resolved."""
        name = labels.get(protocol.LABEL_KUEUE_QUEUE_NAME)
        if not name:
            if self.unqueued == "refuse":
                return (f"quota: pod has no {protocol.LABEL_KUEUE_QUEUE_NAME} label and this cluster admits only "
                        f"queued pods (create a LocalQueue in namespace {namespace} and set the label)")
            if self.unqueued == "default":
                return self.config.local_queues.get((namespace, "default"))  # Kueue's default LocalQueue
            return None
        local_queue = self.config.local_queues.get((namespace, name))
        if local_queue is None:
            return (f"quota: LocalQueue {namespace}/{name} (label {protocol.LABEL_KUEUE_QUEUE_NAME}) does not exist"
                    + self._invalid_hint("LocalQueue", f"{namespace}/{name}"))
        return local_queue

    def _invalid_hint(self, kind: str, name: str) -> str:
        prefix = f"{kind} {name}:"
        for error in self.config.errors:
            if prefix in error:
                return f" (it is invalid: {error})"
        return ""

    def _queue_of(self, namespace: str, labels: Mapping[str, str]) -> ClusterQueue | None:
        local_queue = self._local_queue_of(namespace, labels)
        if not isinstance(local_queue, LocalQueue):
            return None
        return self.config.cluster_queues.get(local_queue.cluster_queue)

    def _priority(self, info: PodInfo) -> int:
        """As Kueue: a WorkloadPriorityClass named by label wins over the pod's PriorityClass value."""
        if info.priority_class:
            found = self.config.priority_classes.get(info.priority_class)
            if found is not None:
                return found.value
        return info.spec_priority

    def namespace_labels(self, namespace: str) -> dict[str, str]:
        labels = dict(self.config.namespaces.get(namespace, {}))
        labels.setdefault(protocol.LABEL_NAMESPACE_NAME, namespace)  # the API server sets it on every namespace
        return labels

    def inactive_reason(self, cluster_queue: ClusterQueue) -> str | None:
        """Why Kueue would mark the queue inactive (it admits nothing then), or None."""
        missing = [name for name in cluster_queue.flavor_names() if name not in self.config.flavors]
        if missing:
            return (f"ResourceFlavor {', '.join(missing)} not found"
                    + self._invalid_hint("ResourceFlavor", missing[0]))
        cycle = self.tree.in_cycle(cluster_queue.name)
        if cycle is not None:
            return f"cohort {cycle} is in a cycle of parents"
        if cluster_queue.stop_policy != "None":
            return f"stopped (stopPolicy {cluster_queue.stop_policy})"
        return None

    def _flavors(
        self,
        cluster_queue: ClusterQueue,
        labels: Mapping[str, str],
        resources: Mapping[str, int],
        tolerations: tuple[Toleration, ...] | None,
    ) -> dict[str, str] | str:
        """resource -> flavor on a node with these labels: per resource group, the first flavor whose nodeLabels
        the node carries (and whose nodeTaints the pod tolerates); a reason if a needed group has none. The
        reason does not name the node, so kube-scheduler's event can count the nodes that share it."""
        chosen: dict[str, str] = {}
        for group in cluster_queue.resource_groups:
            wanted = [r for r in group.covered_resources if resources.get(r, 0) > 0]
            if not wanted:
                continue
            for flavor_quotas in group.flavors:
                flavor = self.config.flavors.get(flavor_quotas.name)
                if flavor is None or not flavor.matches_node(labels):
                    continue
                if tolerations is not None and not flavor.tolerated_by(tolerations):
                    continue
                for resource in wanted:
                    chosen[resource] = flavor.name
                break
            else:
                options = "; ".join(
                    f"{fq.name}: {self.config.flavors[fq.name].describe_labels()}"
                    for fq in group.flavors if fq.name in self.config.flavors
                )
                return (f"quota: the node carries the nodeLabels of no flavor of ClusterQueue "
                        f"{cluster_queue.name} for {', '.join(wanted)} ({options})")
        return chosen

    # --- decisions ------------------------------------------------------------------------------
    def _decide(self, pod: Mapping[str, Any]) -> _DecisionCache:
        """Node-independent part: queue, namespace, stop policy, StrictFIFO (result None: not managed, admit).
        Kept while the pod object and the gate's version stay the same (one filter call, all its nodes)."""
        cache = self._decision
        if cache is not None and cache.pod is pod and cache.version == self._version:
            return cache
        if self._unresolved:
            self._resolve_unresolved()
        uid = str((pod.get("metadata") or {}).get("uid") or "")
        result = self._decide_uncached(pod, uid)
        cache = self._decision = _DecisionCache(pod, self._version, result)
        return cache

    def _decide_uncached(self, pod: Mapping[str, Any], uid: str) -> Admission | Refusal | None:
        if not self.synced:
            return Refusal("quota: Kueue objects have not been listed from the cluster yet", waiting=False)
        if self.config.empty:
            return None  # no ClusterQueue anywhere: quota is not in use
        metadata = pod.get("metadata") or {}
        namespace = str(metadata.get("namespace") or "default")
        local_queue = self._local_queue_of(namespace, metadata.get("labels") or {})
        if local_queue is None:
            return None
        if isinstance(local_queue, str):
            return Refusal(local_queue, waiting=False)
        cluster_queue = self.config.cluster_queues.get(local_queue.cluster_queue)
        where = f"ClusterQueue {local_queue.cluster_queue} (LocalQueue {namespace}/{local_queue.name})"
        if cluster_queue is None:
            return Refusal(f"quota: {where} does not exist"
                           + self._invalid_hint("ClusterQueue", local_queue.cluster_queue), waiting=False)
        now = self.state.clock()
        info = self._pod_infos.get(uid) if uid else None
        if info is None:
            info = pod_info(pod, now)
            if uid:
                self._pod_infos[uid] = info
        priority = self._priority(info)
        if uid and uid not in self.charges:
            entry = self.pending.get(uid)
            if entry is None or entry.cluster_queue != cluster_queue.name:
                self.pending[uid] = entry = PendingPod(uid, namespace, str(metadata.get("name") or ""),
                                                       cluster_queue.name, priority, info.created_s, now)
            entry.last_seen_s = now
            self._expire_pending(now)
        inactive = self.inactive_reason(cluster_queue)
        if inactive:
            return Refusal(f"quota: {where} is inactive: {inactive}; no new pods are admitted",
                           waiting=cluster_queue.stop_policy != "None")
        if local_queue.stop_policy != "None":
            return Refusal(f"quota: LocalQueue {namespace}/{local_queue.name} is stopped (stopPolicy "
                           f"{local_queue.stop_policy}); no new pods are admitted", waiting=True)
        selector = cluster_queue.namespace_selector
        if selector is None:
            return Refusal(f"quota: {where}: namespaceSelector is null, which selects no namespace "
                           f"(use {{}} for all)", waiting=False)
        if not selector.matches(self.namespace_labels(namespace)):
            return Refusal(f"quota: {where}: namespace {namespace} is not selected by the namespaceSelector "
                           f"({selector.describe()})", waiting=False)
        if cluster_queue.queueing_strategy == STRICT_FIFO:
            mine = (-priority, info.created_s, namespace, str(metadata.get("name") or ""))
            ahead = [p for p in self.pending.values()
                     if p.cluster_queue == cluster_queue.name and p.uid != uid and p.waiting_for_quota
                     and p.order < mine]
            if ahead:
                first = min(ahead, key=lambda p: p.order)
                return Refusal(f"quota: {where} is StrictFIFO and pod {first.namespace}/{first.name} (priority "
                               f"{first.priority}) is ahead of this one, waiting for quota", waiting=True)
        covered = cluster_queue.covered_resources
        host_needs = tuple((r, v) for r, v in ((RESOURCE_CPU, info.cpu_milli), (RESOURCE_MEMORY, info.memory_bytes),
                                               (RESOURCE_PODS, 1)) if r in covered and v > 0)
        label_keys = tuple(sorted({key for name in cluster_queue.flavor_names() if name in self.config.flavors
                                   for key, _ in self.config.flavors[name].node_labels}))
        return Admission(uid, cluster_queue, local_queue, info.tolerations, info, covered, host_needs, label_keys)

    def _prepare(self, cache: _DecisionCache, admission: Admission, request: PodGpuRequest) -> None:
        cache.request = request
        cache.label_keys = admission.label_keys
        cache.single_key = admission.label_keys[0] if len(admission.label_keys) == 1 else None
        cache.needs_by_signature = {}
        cache.fits = {}
        cache.fast = {}
        fixed = request_usage_fixed(request)
        cache.fixed_needs = None if fixed is None else self._covered_needs(admission, fixed)
        cache.plain = request.selectors.empty

    def _signature(self, node: NodeState) -> int:
        """An id for the (model, MiB, cores) set of the node's usable GPUs: what request_usage_on reads when the
        pod has no GPU selectors. Cached per inventory text (it changes only with the hardware or its health)."""
        found = self._signatures.get(node.inventory_text)
        if found is None:
            if len(self._signatures) > 100_000:  # bounded: old inventories of replaced nodes
                self._signatures.clear()
            shape = frozenset((g.model_lower, g.memory_mib, g.cores) for g in node.gpus if g.schedulable)
            found = self._signatures[node.inventory_text] = self._signature_ids.setdefault(
                shape, len(self._signature_ids))
        return found

    def _node_key(self, cache: _DecisionCache, node: NodeState) -> Any:
        """What the answer for this pod depends on, of the node."""
        labels = node.labels
        single = cache.single_key
        values = labels.get(single) if single is not None else tuple(map(labels.get, cache.label_keys))
        if cache.fixed_needs is not None:
            return values
        return (values, self._signature(node) if cache.plain else node.inventory_text)

    def _needs_on(self, cache: _DecisionCache, admission: Admission, request: PodGpuRequest,
                  node: NodeState) -> tuple[tuple[str, int], ...]:
        """(resource, amount) the pod needs on this node, for the resources its queue covers."""
        if cache.fixed_needs is not None:
            return cache.fixed_needs
        signature = self._signature(node) if cache.plain else node.inventory_text
        needs = cache.needs_by_signature.get(signature)
        if needs is None:
            needs = cache.needs_by_signature[signature] = self._covered_needs(
                admission, request_usage_on(request, node))
        return needs

    @staticmethod
    def _covered_needs(admission: Admission, gpu_needs: Mapping[str, int]) -> tuple[tuple[str, int], ...]:
        covered = admission.covered
        return tuple((r, v) for r, v in gpu_needs.items() if v > 0 and r in covered) + admission.host_needs

    def _fit(self, cache: _DecisionCache, admission: Admission, request: PodGpuRequest,
             node: NodeState) -> Refusal | None:
        if cache.request is not request:
            self._prepare(cache, admission, request)
        key = self._node_key(cache, node)
        found: Refusal | None = cache.fast.get(key, _MISSING)
        if found is _MISSING:
            needs = self._needs_on(cache, admission, request, node)
            labels = node.labels
            full_key = (tuple(map(labels.get, cache.label_keys)), needs)
            cached = cache.fits.get(full_key, _MISSING)
            found = self._fit_uncached(admission, labels, dict(needs)) if cached is _MISSING else cached
            cache.fits[full_key] = cache.fast[key] = found
        return found

    def _fit_uncached(self, admission: Admission, labels: Mapping[str, str], needs: dict[str, int]) -> Refusal | None:
        cluster_queue = admission.cluster_queue
        flavors = self._flavors(cluster_queue, labels, needs, admission.tolerations)
        if isinstance(flavors, str):
            return Refusal(flavors, waiting=False)
        shortfalls = self.tree.shortfalls(cluster_queue.name, {(flavors[r], r): v for r, v in needs.items()})
        if not shortfalls:
            return None
        where = f"ClusterQueue {cluster_queue.name} (LocalQueue {admission.local_queue.namespace}/" \
                f"{admission.local_queue.name})"
        text = "; ".join(self._shortfall_text(s) for s in shortfalls)
        return Refusal(f"quota: {where}: {text}", waiting=not any(s.never_fits for s in shortfalls))

    @staticmethod
    def _shortfall_text(s: Shortfall) -> str:
        unit = RESOURCE_UNITS.get(s.resource, "")
        limits = [f"nominal {s.quota.nominal}"]
        if s.quota.borrowing_limit is not None:
            limits.append(f"borrowing limit {s.quota.borrowing_limit}")
        if s.quota.lending_limit is not None:
            limits.append(f"lending limit {s.quota.lending_limit}")
        tail = "never fits" if s.never_fits else f"{max(s.available, 0)} available now"
        return (f"flavor {s.flavor}, {s.resource}: needs {s.need}, used {s.used}/{s.potential} {unit} "
                f"({', '.join(limits)}), {tail}")

    # --- the Gate protocol ----------------------------------------------------------------------
    def check(self, pod: Mapping[str, Any], request: PodGpuRequest, node: NodeState) -> str | None:
        """Called by filter for every node that fits on GPUs, with state.lock held by the caller (so no lock is
        taken here: this runs once per node and must cost next to nothing)."""
        cache = self._decision
        if cache is None or cache.pod is not pod or cache.version != self._version:
            cache = self._decide(pod)
        result = cache.result
        if result is None:
            return None
        if isinstance(result, Admission):
            # fast path: a node like one already answered for this pod (same flavor labels, same GPU sizes)
            found = cache.fast.get(self._node_key(cache, node), _MISSING) if cache.request is request else _MISSING
            refusal = found if found is not _MISSING else self._fit(cache, result, request, node)
            if refusal is None:
                return None
        else:
            refusal = result
        uid = result.uid if isinstance(result, Admission) else str((pod.get("metadata") or {}).get("uid") or "")
        if uid and (uid not in self._round or refusal.waiting):
            if len(self._round) > 10_000:  # observe_filter pops these; bounded in case a caller never does
                self._round.clear()
            self._round[uid] = refusal
        return refusal.reason

    def reserve(self, pod: Mapping[str, Any], request: PodGpuRequest, node: NodeState, uid: str) -> str | None:
        """Re-check on current usage; the usage listener's +1 (state.reserve, same lock) then counts it."""
        with self.state.lock:
            self._pod_infos[uid] = pod_info(pod, self.state.clock())
            self._decision = None  # decide afresh: usage may have changed since filter
            cache = self._decide(pod)
            result = cache.result
            if result is None:
                return None
            refusal = self._fit(cache, result, request, node) if isinstance(result, Admission) else result
            return refusal.reason if refusal is not None else None

    def observe_filter(self, pod: Mapping[str, Any], request: PodGpuRequest, passed: list[str]) -> None:
        """After a filter call (all nodes): does the pod wait for quota? That is what StrictFIFO blocks on."""
        with self.state.lock:
            uid = str((pod.get("metadata") or {}).get("uid") or "")
            refusal = self._round.pop(uid, None)
            entry = self.pending.get(uid)
            if entry is None:
                return
            waiting = not passed and refusal is not None and refusal.waiting
            if passed:
                reason = ""
            elif refusal is not None:
                reason = refusal.reason
            else:
                reason = "no node fits its GPU request"
            if waiting != entry.waiting_for_quota:
                self._version += 1
            entry.waiting_for_quota = waiting
            entry.reason = reason

    def _expire_pending(self, now: float) -> None:
        if now - self._last_expiry_s < 60:
            return
        self._last_expiry_s = now
        for uid, entry in list(self.pending.items()):
            if now - entry.last_seen_s > PENDING_TTL_S:
                self._forget_pending(uid)

    # --- views ----------------------------------------------------------------------------------
    def charges_of(self, cluster_queue: str) -> list[Charge]:
        """Counted pods of a queue, lowest priority first, newest first among equals (preemption candidates)."""
        with self.state.lock:
            found = [c for c in self.charges.values() if c.cluster_queue == cluster_queue and c.counted]
        return sorted(found, key=lambda c: (c.priority, -c.created_s))

    def snapshot(self) -> dict[str, Any]:
        """JSON-ready view for GET /quota."""
        with self.state.lock:
            if self._unresolved:
                self._resolve_unresolved()
            config = self.config
            queues = []
            for cluster_queue in sorted(config.cluster_queues.values(), key=lambda q: q.name):
                pending = sorted((p for p in self.pending.values() if p.cluster_queue == cluster_queue.name),
                                 key=lambda p: p.order)
                charges = [c for c in self.charges.values() if c.cluster_queue == cluster_queue.name]
                flavors = []
                for group in cluster_queue.resource_groups:
                    for flavor_quotas in group.flavors:
                        resources = []
                        for resource, _ in flavor_quotas.resources:
                            status = self.tree.status(cluster_queue.name, (flavor_quotas.name, resource))
                            resources.append({
                                "resource": resource,
                                "unit": RESOURCE_UNITS.get(resource, ""),
                                "nominal": status.nominal,
                                "borrowingLimit": status.borrowing_limit,
                                "lendingLimit": status.lending_limit,
                                "used": status.used,
                                "borrowed": status.borrowed,
                                "lent": status.lent,
                                "available": status.available,
                                "limit": status.potential,
                            })
                        flavors.append({"flavor": flavor_quotas.name, "resources": resources})
                queues.append({
                    "name": cluster_queue.name,
                    "cohort": cluster_queue.cohort,
                    "queueingStrategy": cluster_queue.queueing_strategy,
                    "stopPolicy": cluster_queue.stop_policy,
                    "inactiveReason": self.inactive_reason(cluster_queue),
                    "admittedPods": sum(1 for c in charges if c.counted),
                    "uncountedPods": [{"pod": f"{c.namespace}/{c.name}", "problem": c.problem}
                                      for c in charges if not c.counted],
                    "pendingPods": len(pending),
                    "waitingForQuota": sum(1 for p in pending if p.waiting_for_quota),
                    "flavors": flavors,
                    "pending": [{"pod": f"{p.namespace}/{p.name}", "priority": p.priority,
                                 "waitingForQuota": p.waiting_for_quota, "reason": p.reason}
                                for p in pending[:100]],
                })
            cohorts = []
            cohort_names = sorted({k[1] for k in self.tree.parent if k[0] == "Cohort"})
            all_frs = sorted({fr for quotas in self.tree.quotas.values() for fr in quotas})
            for name in cohort_names:
                totals = []
                for fr in all_frs:
                    subtree, usage = self.tree.cohort_totals(name, fr)
                    if subtree or usage:
                        totals.append({"flavor": fr[0], "resource": fr[1], "subtreeQuota": subtree, "usage": usage})
                parent = self.tree.parent.get(("Cohort", name))
                cohorts.append({"name": name, "parent": parent[1] if parent else None,
                                "inCycle": name in self.tree.cyclic, "resources": totals})
            return {
                "synced": self.synced,
                "sources": list(self.sources),
                "unqueuedPods": self.unqueued,
                "errors": list(config.errors),
                "warnings": list(config.warnings),
                "clusterQueues": queues,
                "cohorts": cohorts,
                "localQueues": [{"namespace": q.namespace, "name": q.name, "clusterQueue": q.cluster_queue,
                                 "stopPolicy": q.stop_policy}
                                for q in sorted(config.local_queues.values(), key=lambda q: (q.namespace, q.name))],
            }

    def collector(self) -> Collector:
        return QuotaCollector(self)

    # --- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        if self.watcher is not None:
            self.watcher.start()

    def stop(self) -> None:
        if self.watcher is not None:
            self.watcher.stop()


class QuotaCollector(Collector):
    """The /quota numbers as Prometheus gauges, computed at scrape time (no cost per bind)."""

    def __init__(self, gate: QuotaGate) -> None:
        self.gate = gate

    def collect(self) -> Iterator[GaugeMetricFamily]:
        labels = ["cluster_queue", "flavor", "resource"]
        names = {
            "nominal": "nominal quota",
            "borrowingLimit": "borrowing limit (absent: none)",
            "lendingLimit": "lending limit (absent: none)",
            "used": "usage counted on the devices actually assigned",
            "borrowed": "usage above nominal",
            "lent": "unused lendable quota the rest of the cohort is using",
            "available": "what can still be admitted now",
            "limit": "the most the queue could hold (nominal plus what the cohort could lend)",
        }
        families = {
            key: GaugeMetricFamily(
                f"kube_vgpu_quota_{snake}", f"ClusterQueue {text}, in the resource's unit "
                "(vGPUs, MiB, % of a GPU, millicores, bytes, pods)", labels=labels)
            for key, text, snake in (
                (k, t, "".join("_" + ch.lower() if ch.isupper() else ch for ch in k)) for k, t in names.items()
            )
        }
        pending = GaugeMetricFamily("kube_vgpu_quota_pending_pods", "pods seen by filter and not admitted yet",
                                    labels=["cluster_queue"])
        waiting = GaugeMetricFamily("kube_vgpu_quota_waiting_pods", "pending pods waiting for quota",
                                    labels=["cluster_queue"])
        admitted = GaugeMetricFamily("kube_vgpu_quota_admitted_pods", "pods counted against the queue",
                                     labels=["cluster_queue"])
        errors = GaugeMetricFamily("kube_vgpu_quota_invalid_objects", "Kueue objects left out as invalid")
        snapshot: dict[str, Any] = self.gate.snapshot()
        for queue in snapshot["clusterQueues"]:
            for flavor in queue["flavors"]:
                for resource in flavor["resources"]:
                    values = [queue["name"], flavor["flavor"], resource["resource"]]
                    for key, family in families.items():
                        if resource[key] is not None:
                            family.add_metric(values, resource[key])
            pending.add_metric([queue["name"]], queue["pendingPods"])
            waiting.add_metric([queue["name"]], queue["waitingForQuota"])
            admitted.add_metric([queue["name"]], queue["admittedPods"])
        errors.add_metric([], len(snapshot["errors"]))
        yield from families.values()
        yield pending
        yield waiting
        yield admitted
        yield errors


def build_gate(
    state: ClusterState,
    *,
    quota_config: str | None = None,
    api_client: Any = None,
    unqueued: str = "admit",
) -> QuotaGate | None:
    """The gate for `kube-vgpu extender`: objects from --quota-config and, in live mode, the cluster's Kueue
    objects (watched while their CRDs exist). None when there is neither a file nor a cluster."""
    if quota_config is None and api_client is None:
        return None
    documents: list[tuple[str, Mapping[str, Any]]] = []
    if quota_config:
        documents = [(quota_config, doc) for doc in load_documents(quota_config)]
    gate = QuotaGate(state, documents, unqueued=unqueued, live=api_client is not None)
    if gate.config.errors:
        log.error("quota: %d invalid object(s) in %s were left out", len(gate.config.errors), quota_config)
    if api_client is not None:
        from kube_vgpu.extender.quota.live import KueueWatcher

        gate.watcher = KueueWatcher(gate, api_client)
    return gate
