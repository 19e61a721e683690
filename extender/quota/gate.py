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

import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from prometheus_client.registry import Collector

from kube_vgpu import protocol
from kube_vgpu.extender.engine.model import NodeState
from kube_vgpu.extender.quota.accounting import FlavorResource, QuotaTree, Shortfall
from kube_vgpu.extender.quota.admission import Admission, DecisionCache, Refusal
from kube_vgpu.extender.quota.fairsharing import Share, queue_share, weights_of
from kube_vgpu.extender.quota.metrics import QuotaCollector
from kube_vgpu.extender.quota.mig import is_mig_resource, mig_profiles_by_uuid, resource_unit
from kube_vgpu.extender.quota.objects import (
    RESOURCE_CPU,
    RESOURCE_MEMORY,
    RESOURCE_PODS,
    RESOURCE_UNITS,
    STRICT_FIFO,
    TOTAL_GPU_CORES,
    ClusterQueue,
    LocalQueue,
    QuotaConfig,
    Toleration,
    build_config,
)
from kube_vgpu.extender.quota.usage import (
    BLOCK_UNDECLARED,
    GPU_RESOURCES,
    QUOTA_CHECK_STRATEGIES,
    Charge,
    PendingPod,
    PodInfo,
    assignment_usage,
    declared_by,
    gpu_memory_by_uuid,
    pod_info,
    request_usage_fixed,
    request_usage_on,
    undeclared_gpu_resources,
)
from kube_vgpu.extender.quota.views import kueue_controller_warnings, quota_view
from kube_vgpu.extender.state import FINISHED_PHASES, ClusterState, PodRecord
from kube_vgpu.protocol import PodGpuRequest

if TYPE_CHECKING:
    from kube_vgpu.extender.gangs import GangTracker
    from kube_vgpu.extender.preemption.rules import QueueCharge, QueueRules, QueueSnapshot

log = logging.getLogger(__name__)

#: What happens to pods without a kueue.x-k8s.io/queue-name label.
UNQUEUED_POLICIES = ("admit", "default", "refuse")
#: A pending pod not seen by filter for this long is forgotten (kube-scheduler retries unschedulable pods at least
#: every 5 minutes, so a live one is seen again well before; this only clears pods whose deletion was missed).
PENDING_TTL_S = 900.0


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
        fair_sharing: bool = False,
        fair_sharing_strategies: tuple[str, ...] = (),
        quota_check_strategy: str = BLOCK_UNDECLARED,
    ) -> None:
        if quota_check_strategy not in QUOTA_CHECK_STRATEGIES:
            raise ValueError(f"quota check strategy {quota_check_strategy!r} is not one of "
                             f"{', '.join(QUOTA_CHECK_STRATEGIES)}")
        if unqueued not in UNQUEUED_POLICIES:
            raise ValueError(f"unqueued pods policy {unqueued!r} is not one of {', '.join(UNQUEUED_POLICIES)}")
        if state.pods:
            # the gate learns each pod's CPU, memory and priority as the state receives it; pods already there
            # would be charged their GPUs only
            raise ValueError("the quota gate must be built before the cluster state holds pods")
        self.state = state
        self.unqueued = unqueued
        #: --fair-sharing: spec.fairSharing.weight orders admission in a cohort and drives preemption between
        #: borrowing queues (fairsharing.py); off, everything is as without it
        self.fair_sharing = fair_sharing
        #: Kueue's fairSharing.preemptionStrategies (empty: its default pair); checked by the flag's parser
        self.fair_sharing_strategies = fair_sharing_strategies
        #: Kueue's resources.quotaCheckStrategy (--quota-check-strategy): BlockUndeclared refuses a pod naming a
        #: GPU resource its queue does not cover; IgnoreUndeclared lets it through uncounted for that resource
        self.quota_check_strategy = quota_check_strategy
        self.file_documents = list(file_documents or [])
        #: kind -> {(namespace, name): object} listed from the cluster (live mode)
        self.cluster_documents: dict[str, dict[tuple[str, str], Mapping[str, Any]]] = {}
        self.cluster_namespaces: dict[str, dict[str, str]] = {}  # namespace -> labels (live mode)
        self._document_namespaces: dict[str, dict[str, str]] = {}  # from Namespace objects in the file
        self.live = live
        self._logged_warnings: set[str] = set()
        #: False until the cluster's Kueue objects were listed once (live mode): admit nothing before
        self.synced = not live
        self.sources = ["file"] if self.file_documents else []
        self.watcher: Any = None  # live.KueueWatcher in live mode
        self.config = QuotaConfig()
        self.weights: dict[tuple[str, str], int] = {}  # (kind, name) -> fairSharing.weight in thousandths
        self.tree = QuotaTree(())
        self.tree_queues: list[str] = []  # the ClusterQueues the tree was built from
        self.charges: dict[str, Charge] = {}
        #: nominated preemptors' needs, counted in their queues until they bind or their nomination ends
        #: (preemption/preemptor.py): the quota their victims free is not taken by others meanwhile
        self.holds: dict[str, tuple[str, dict[FlavorResource, int]]] = {}
        self.pending: dict[str, PendingPod] = {}
        self._pod_infos: dict[str, PodInfo] = {}
        self._unresolved: set[str] = set()
        #: uid -> the ClusterQueue a counted pod was admitted to; survives config reloads (as a Kueue Workload's
        #: status.admission does): deleting or re-pointing a LocalQueue does not move or drop running pods
        self._admitted_to: dict[str, str] = {}
        self._round: dict[str, Refusal] = {}  # refusals of the filter call under way, per pod
        self._version = 0  # bumped on anything that can change a decision
        self._decision: DecisionCache | None = None
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
            if kind == "ClusterQueue":
                for warning in kueue_controller_warnings(self):
                    if warning not in self._logged_warnings:
                        self._logged_warnings.add(warning)
                        log.warning("quota: %s", warning)

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
        config = build_config(docs, fair_sharing=self.fair_sharing)
        for error in config.errors:
            if error not in self.config.errors:
                log.error("quota: ignoring invalid object: %s", error)
        for warning in config.warnings:
            if warning not in self.config.warnings:  # once: a reload repeats only what is new
                log.warning("quota: %s", warning)
        self._document_namespaces = dict(config.namespaces)
        config.namespaces.update(self.cluster_namespaces)
        self.config = config
        self.weights = weights_of(config)
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
        for uid, (queue, amounts) in list(self.holds.items()):
            if queue in config.cluster_queues:
                self.tree.add(queue, amounts, 1)
            else:
                del self.holds[uid]  # its queue is gone: nothing to hold
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
        cluster_queue = self.cluster_queue_of(uid, record.namespace, record.labels)
        if cluster_queue is None:
            return  # not managed by any ClusterQueue
        self._admitted_to[uid] = cluster_queue.name
        info = self._pod_infos.get(uid)
        covered = cluster_queue.covered_resources
        resources = self._gpu_held(record, covered)
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

    def _gpu_held(self, record: PodRecord, covered: frozenset[str]) -> dict[str, int]:
        """The GPU resources the queue covers that the pod's assignment holds. total-gpucores needs its node's
        GPU sizes (a whole-GPU vGPU is charged 100): read only when the queue covers it; a MIG device's resource
        needs the node's MIG devices (their profiles)."""
        node = self.state.nodes.get(record.node_name)
        sizes = gpu_memory_by_uuid(node) if TOTAL_GPU_CORES in covered else None
        held = assignment_usage(record.assignment, sizes, mig_profiles_by_uuid(node))
        return {r: v for r, v in held.items() if r in covered and v > 0}

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
        record = self.state.pods.get(charge.uid)
        if charge.problem and record is not None:
            # counted late (its node was not known): whole GPUs are told by the node's GPU sizes and MIG devices
            # by its MIG devices' profiles, known now
            charge.resources = {r: v for r, v in charge.resources.items()
                                if r not in GPU_RESOURCES and not is_mig_resource(r)}
            charge.resources.update(self._gpu_held(record, cluster_queue.covered_resources))
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

    def resolve_unresolved(self) -> None:
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

    def cluster_queue_of(self, uid: str, namespace: str, labels: Mapping[str, str]) -> ClusterQueue | None:
        """The ClusterQueue a pod is in (caller holds state.lock): the one it was admitted to, which a config
        reload does not move, else its LocalQueue's; None when no queue manages it (as _on_usage decides)."""
        admitted_to = self._admitted_to.get(uid)
        found = self.config.cluster_queues.get(admitted_to) if admitted_to else None
        return found if found is not None else self._queue_of(namespace, labels)

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
    def _decide(self, pod: Mapping[str, Any]) -> DecisionCache:
        """Node-independent part: queue, namespace, stop policy, StrictFIFO (result None: not managed, admit).
        Kept while the pod object and the gate's version stay the same (one filter call, all its nodes)."""
        cache = self._decision
        if cache is not None and cache.pod is pod and cache.version == self._version:
            return cache
        if self._unresolved:
            self.resolve_unresolved()
        uid = str((pod.get("metadata") or {}).get("uid") or "")
        result = self._decide_uncached(pod, uid)
        cache = self._decision = DecisionCache(pod, self._version, result)
        return cache

    # complexity: Kueue's resolution steps (queue, local queue, stop policy, flavors) in their order
    def _decide_uncached(self, pod: Mapping[str, Any], uid: str) -> Admission | Refusal | None:  # noqa: C901
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

    def _prepare(self, cache: DecisionCache, admission: Admission, request: PodGpuRequest) -> None:
        cache.request = request
        cache.label_keys = admission.label_keys
        cache.single_key = admission.label_keys[0] if len(admission.label_keys) == 1 else None
        cache.needs_by_signature = {}
        cache.fits = {}
        cache.fast = {}
        fixed = request_usage_fixed(request)
        cache.fixed_needs = None if fixed is None else self._covered_needs(admission, fixed)
        cache.undeclared = self._undeclared(admission, request)
        cache.plain = request.selectors.empty

    def _undeclared(self, admission: Admission, request: PodGpuRequest) -> Refusal | None:
        """Kueue's BlockUndeclared: a resource the pod requests that its ClusterQueue does not cover gets no
        quota at all (Kueue: "resource ... unavailable in ClusterQueue"), rather than unlimited."""
        if self.quota_check_strategy != BLOCK_UNDECLARED:
            return None
        missing = undeclared_gpu_resources(request, admission.covered)
        if not missing:
            return None
        queue = admission.cluster_queue.name
        forms = "; ".join(f"{r}: {' or '.join(declared_by(r))}" for r in missing)
        return Refusal(f"quota: ClusterQueue {queue} (LocalQueue {admission.local_queue.namespace}/"
                       f"{admission.local_queue.name}) does not cover {', '.join(missing)}, which the pod requests: "
                       f"resource unavailable in ClusterQueue (Kueue's default quotaCheckStrategy BlockUndeclared). "
                       f"Add it to a resource group's coveredResources ({forms}), or run the extender with "
                       f"--quota-check-strategy IgnoreUndeclared", waiting=False)

    def _signature(self, node: NodeState) -> int:
        """An id for the (model, MiB, cores) set of the node's usable GPUs and the (profile, MiB) set of its MIG
        devices: what request_usage_on reads when the pod has no GPU selectors. Cached per inventory text (it changes
        only with the hardware or its health)."""
        found = self._signatures.get(node.inventory_text)
        if found is None:
            if len(self._signatures) > 100_000:  # bounded: old inventories of replaced nodes
                self._signatures.clear()
            shape = frozenset((g.model_lower, g.memory_mib, g.cores) for g in node.gpus if g.schedulable) | frozenset(
                (f"mig {d.mig_profile}", d.memory_mib, 0) for d in (*node.mig_devices, *node.dynamic_mig_devices))
            found = self._signatures[node.inventory_text] = self._signature_ids.setdefault(
                shape, len(self._signature_ids))
        return found

    def _node_key(self, cache: DecisionCache, node: NodeState) -> Any:
        """What the answer for this pod depends on, of the node."""
        labels = node.labels
        single = cache.single_key
        values = labels.get(single) if single is not None else tuple(map(labels.get, cache.label_keys))
        if cache.fixed_needs is not None:
            return values
        return (values, self._signature(node) if cache.plain else node.inventory_text)

    def _needs_on(self, cache: DecisionCache, admission: Admission, request: PodGpuRequest,
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

    def _fit(self, cache: DecisionCache, admission: Admission, request: PodGpuRequest,
             node: NodeState) -> Refusal | None:
        if cache.request is not request:
            self._prepare(cache, admission, request)
        if cache.undeclared is not None:
            return cache.undeclared
        key = self._node_key(cache, node)
        if key in cache.fast:
            return cache.fast[key]
        needs = self._needs_on(cache, admission, request, node)
        labels = node.labels
        full_key = (tuple(map(labels.get, cache.label_keys)), needs)
        found = cache.fits[full_key] if full_key in cache.fits else self._fit_uncached(admission, labels, dict(needs))
        cache.fits[full_key] = cache.fast[key] = found
        return found

    def _fit_uncached(self, admission: Admission, labels: Mapping[str, str], needs: dict[str, int]) -> Refusal | None:
        cluster_queue = admission.cluster_queue
        flavors = self._flavors(cluster_queue, labels, needs, admission.tolerations)
        if isinstance(flavors, str):
            return Refusal(flavors, waiting=False)
        amounts = {(flavors[r], r): v for r, v in needs.items()}
        shortfalls = self.tree.shortfalls(cluster_queue.name, amounts)
        where = f"ClusterQueue {cluster_queue.name} (LocalQueue {admission.local_queue.namespace}/" \
                f"{admission.local_queue.name})"
        if not shortfalls:
            return self._fair_turn(admission, amounts, where) if self.fair_sharing else None
        text = "; ".join(self._shortfall_text(s) for s in shortfalls)
        return Refusal(f"quota: {where}: {text}", waiting=not any(s.never_fits for s in shortfalls), needs=amounts)

    def _fair_turn(self, admission: Admission, amounts: dict[FlavorResource, int], where: str) -> Refusal | None:
        """Kueue's fair sharing orders admission across a cohort by share after admission, lowest first. A pod that
        fits but would borrow waits while a pod of another queue of its cohort tree, waiting for quota, fits now,
        would no longer fit once this one is admitted, and comes first: its queue's share after admitting it is
        lower (equal: higher priority, then older, as Kueue breaks ties). Pods that do not compete for the same
        quota do not wait for each other: Kueue skips a head that does not fit and admits the next."""
        queue = admission.cluster_queue.name
        root = self.tree.root_of(queue)
        if root is None:
            return None
        mine = queue_share(self.tree, self.weights, queue, amounts)
        if not mine.resource:
            return None  # within its nominal quota: no share to compare
        info = admission.info
        my_order = (mine.value, -self._priority(info), info.created_s)
        first: tuple[tuple[int, int, float], PendingPod, Share] | None = None
        for other in self.pending.values():
            if (not other.waiting_for_quota or not other.needs or other.cluster_queue == queue
                    or other.uid == admission.uid or self.tree.root_of(other.cluster_queue) != root):
                continue
            theirs = queue_share(self.tree, self.weights, other.cluster_queue, other.needs)
            order = (theirs.value, -other.priority, other.created_s)
            if order >= my_order or (first is not None and order >= first[0]):
                continue
            if self.tree.shortfalls(other.cluster_queue, other.needs):
                continue  # it does not fit anyway: not competing for what this pod takes
            self.tree.add(queue, amounts)  # what is left to it once this pod is admitted (undone at once)
            try:
                competing = bool(self.tree.shortfalls(other.cluster_queue, other.needs))
            finally:
                self.tree.add(queue, amounts, -1)
            if competing:
                first = (order, other, theirs)
        if first is None:
            return None
        _, other, theirs = first
        tie = " (equal shares: that pod has higher priority or is older)" if theirs.value == mine.value else ""
        return Refusal(f"quota: {where}: fairSharing: ClusterQueue {other.cluster_queue} goes first: its pod "
                       f"{other.namespace}/{other.name} waits for the same quota, and its share after admission "
                       f"({theirs.describe()}) is below {queue}'s share after admitting this pod "
                       f"({mine.describe()}){tie}", waiting=True, needs=amounts)

    @staticmethod
    def _shortfall_text(s: Shortfall) -> str:
        unit = resource_unit(s.resource, RESOURCE_UNITS)
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
            refusal = self._fit(cache, result, request, node)  # answered from cache.fast for a node like one seen
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
            needs = refusal.needs if waiting and refusal is not None else None
            if waiting != entry.waiting_for_quota or (self.fair_sharing and needs != entry.needs):
                self._version += 1  # what StrictFIFO and fair sharing's order read changed
            entry.waiting_for_quota = waiting
            entry.needs = needs
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

    def queue_rules(self) -> QueueRules:
        return _GateQueueRules(self)

    def snapshot(self, gangs: GangTracker | None = None) -> dict[str, Any]:
        """JSON-ready view for GET /quota (quota/views.py), with each queue's gangs when given the tracker."""
        return quota_view(self, gangs)

    def collector(self) -> Collector:
        return QuotaCollector(self)

    # --- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        if self.watcher is not None:
            self.watcher.start()

    def stop(self) -> None:
        if self.watcher is not None:
            self.watcher.stop()




class _GateQueueRules:
    """QueueRules over the gate (the caller holds the state lock, which guards the gate's accounting)."""

    def __init__(self, gate: QuotaGate) -> None:
        self.gate = gate

    def queue_of(self, uid: str, namespace: str, labels: Mapping[str, str]) -> str | None:
        found = self.gate.cluster_queue_of(uid, namespace, labels)
        return found.name if found is not None else None

    def snapshot(self, preemptor_queue: str | None, needs: Mapping[FlavorResource, int] | None = None) -> QueueSnapshot:
        from kube_vgpu.extender.preemption.rules import snapshot_queues

        config = self.gate.config
        policies = {name: queue.preemption for name, queue in config.cluster_queues.items()}
        # without needs (preemption for GPU capacity, not quota) nothing is reclaimed from a cohort
        return snapshot_queues(self.gate.tree, policies, preemptor_queue, needs=needs or {},
                               fair_sharing=self.gate.fair_sharing, weights=self.gate.weights,
                               strategies=self.gate.fair_sharing_strategies)

    def needs_on(self, pod: Mapping[str, Any], request: PodGpuRequest,
                 node: NodeState) -> tuple[str, dict[FlavorResource, int]] | None:
        gate = self.gate
        cache = gate._decide(pod)
        admission = cache.result
        if not isinstance(admission, Admission):
            return None
        if cache.request is not request:
            gate._prepare(cache, admission, request)
        if cache.undeclared is not None:
            return None  # no quota at all for it: preempting frees nothing it could use
        needs = dict(gate._needs_on(cache, admission, request, node))
        flavors = gate._flavors(admission.cluster_queue, node.labels, needs, admission.tolerations)
        if isinstance(flavors, str):
            return None
        return admission.cluster_queue.name, {(flavors[r], r): v for r, v in needs.items()}

    def tree(self) -> QuotaTree:
        return self.gate.tree

    def charges(self) -> list[QueueCharge]:
        from kube_vgpu.extender.preemption.rules import QueueCharge

        return [QueueCharge(c.uid, c.cluster_queue, dict(c.amounts), c.priority, c.created_s)
                for c in self.gate.charges.values() if c.counted]

    def hold(self, uid: str, cluster_queue: str, amounts: Mapping[FlavorResource, int]) -> None:
        self.release(uid)
        self.gate.holds[uid] = (cluster_queue, dict(amounts))
        self.gate.tree.add(cluster_queue, amounts, 1)
        self.gate._version += 1

    def release(self, uid: str) -> None:
        held = self.gate.holds.pop(uid, None)
        if held is not None:
            self.gate.tree.add(held[0], held[1], -1)
            self.gate._version += 1
