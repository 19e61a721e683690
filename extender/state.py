"""Cluster state: who uses what, updated incrementally by events (Kueue's "cache").

Sources (live watches, a snapshot file) call upsert_node / delete_node / upsert_pod / delete_pod;
filter and prioritize read under `lock`; bind reserves under `lock` and a per-pod guard.

Rules that keep GPUs from being over-committed or lost:
  * a pod's usage comes only from its assignment annotation (the API server is the source of truth),
    or from an in-flight reservation made by our own bind before the annotation is written;
  * an in-flight reservation survives pod events that do not yet carry the annotation;
  * a pod whose node is not known yet keeps its record and is applied when the node arrives;
  * finished (Succeeded / Failed) and deleted pods release their GPUs.

Host CPU and memory (for policies that weigh them, e.g. bfgd the CPU; kube-scheduler still does the fit): each
node's allocatable CPU and memory, and the requests of every non-finished pod bound to it, GPU pods or not, are
kept incrementally from the same events. A node's cached placements are dropped on a CPU (memory) change only when
a policy reading it is in use (`touch_on_cpu_change`, `touch_on_memory_change`), because any pod landing on a
node changes them.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from kube_vgpu import kubeapi, protocol
from kube_vgpu.extender.engine.model import GpuUsage, NodeState, peak_usage
from kube_vgpu.extender.node_order import NodeOrder
from kube_vgpu.protocol import PodAssignment, ProtocolError

log = logging.getLogger(__name__)

FINISHED_PHASES = frozenset({"Succeeded", "Failed"})
#: entries of ClusterState.journal before it starts over (the scheduler's answers are then re-judged in full)
JOURNAL_LIMIT = 100_000


MIB = 1 << 20
#: what kubeapi.pod_requests is asked for the host (host_asks reads its answer)
HOST_RESOURCES = (kubeapi.RESOURCE_CPU, kubeapi.RESOURCE_MEMORY)


def host_asks(requests: Mapping[str, int]) -> tuple[int, int]:
    """(milli-CPU, memory MiB rounded up) from kubeapi.pod_requests' figures (memory in bytes)."""
    return requests.get(kubeapi.RESOURCE_CPU, 0), -(-requests.get(kubeapi.RESOURCE_MEMORY, 0) // MIB)


def bound_pod_host(obj: Mapping[str, Any]) -> tuple[int, int]:
    """A bound pod's (milli-CPU, memory MiB rounded up) requests as kube-scheduler counts them on its node
    (kubeapi.pod_requests, in-place resizes included); (0, 0) when unreadable (the API server never stores a bad
    quantity; a snapshot might)."""
    try:
        requests = kubeapi.pod_requests(obj, HOST_RESOURCES, status_resources=True)
    except kubeapi.InvalidQuantity as exc:
        metadata = obj.get("metadata") or {}
        log.warning("pod %s/%s: CPU and memory requests not counted: %s", metadata.get("namespace"),
                    metadata.get("name"), exc)
        return 0, 0
    return host_asks(requests)


def _node_allocatable(obj: Mapping[str, Any], resource: str, read: Callable[[Any], int]) -> int:
    """status.allocatable[resource] as `read` reads it; 0 = unknown: absent, or unreadable (the API server never
    stores a bad quantity; a snapshot might: warned)."""
    value = ((obj.get("status") or {}).get("allocatable") or {}).get(resource)
    if value is None:
        return 0
    try:
        return max(0, read(value))
    except kubeapi.InvalidQuantity as exc:
        log.warning("node %s: allocatable %s not read, counted as unknown: %s",
                    (obj.get("metadata") or {}).get("name"), resource, exc)
        return 0


def node_allocatable_cpu_milli(obj: Mapping[str, Any]) -> int:
    """status.allocatable.cpu in milli-CPU; 0 = unknown."""
    return _node_allocatable(obj, kubeapi.RESOURCE_CPU, kubeapi.quantity_milli)


def _add_to(sums: dict[str, int], key: str, delta: int) -> int:
    """sums[key] += delta, the entry dropped at 0; the new sum."""
    total = sums.get(key, 0) + delta
    if total:
        sums[key] = total
    else:
        sums.pop(key, None)
    return total


def node_allocatable_memory_mib(obj: Mapping[str, Any]) -> int:
    """status.allocatable.memory in whole MiB (rounded down); 0 = unknown."""
    return _node_allocatable(obj, kubeapi.RESOURCE_MEMORY, lambda value: kubeapi.quantity_value(value) // MIB)


@dataclass(slots=True)
class PodRecord:
    uid: str
    namespace: str
    name: str
    node_name: str
    assignment: PodAssignment
    assignment_text: str
    confirmed: bool  # the assignment annotation has been seen on the API object
    bound: bool = False  # spec.nodeName is set
    usage: tuple[GpuUsage, ...] = ()
    applied: bool = False  # usage is counted on the node
    labels: dict[str, str] = field(default_factory=dict)
    #: its Binding failed and whether it was written could not be read back: kept reserved until known
    uncertain: bool = False
    #: POSIX seconds of the bind-time annotation our bind wrote (None: not seen yet, a reservation, or unreadable);
    #: usage accounting counts from it, so its counters survive an extender restart
    bound_at_s: float | None = None


def usage_from_assignment(node: NodeState, assignment: PodAssignment) -> tuple[tuple[GpuUsage, ...], list[str]]:
    """Per-GPU usage of an assignment on `node` (the peak over the moments its containers run at once, with
    native sidecars beside the app containers and the later init containers), and UUIDs not on the node."""
    missing: list[str] = []
    by_uuid = node.gpu_by_uuid
    phases: list[list[tuple[int, int, int]]] = []
    for phase in assignment.phases:
        devices = []
        for container in phase:
            for device in container.devices:
                gpu = by_uuid.get(device.uuid)
                if gpu is None:
                    if device.uuid not in missing:  # a sidecar's device appears in several moments
                        missing.append(device.uuid)
                    continue
                devices.append((gpu.position, device.memory_mib, device.cores))
        phases.append(devices)
    return peak_usage(node, phases), missing


def bind_time_of(annotations: Mapping[str, Any], where: str = "") -> float | None:
    """The bind-time annotation in POSIX seconds; None when absent or unreadable (logged when `where` names the
    pod, so a pod's repeated updates do not log it again)."""
    text = annotations.get(protocol.POD_BIND_TIME_ANNOTATION)
    if not isinstance(text, str):
        return None
    try:
        return protocol.parse_bind_time(text)
    except ProtocolError as exc:
        if where:
            log.warning("pod %s: bind time not read, its GPU use is not accounted: %s", where, exc)
        return None


def pod_labels_at_bind(metadata: Mapping[str, Any]) -> dict[str, str]:
    """A bound pod's labels, with its Kueue queue as the extender recorded it at bind (POD_QUEUE_ANNOTATION):
    relabelling a running pod cannot move its usage to another queue or out of quota. Pods bound before the
    annotation existed keep their label."""
    labels = dict(metadata.get("labels") or {})
    recorded = (metadata.get("annotations") or {}).get(protocol.POD_QUEUE_ANNOTATION)
    if isinstance(recorded, str):
        if recorded:
            labels[protocol.LABEL_KUEUE_QUEUE_NAME] = recorded
        else:
            labels.pop(protocol.LABEL_KUEUE_QUEUE_NAME, None)
    return labels


class ClusterState:
    def __init__(
        self,
        *,
        heartbeat_ttl_s: float = 120.0,
        clock: Callable[[], float] = time.time,
        freeze_gc_when_synced: bool = False,
    ) -> None:
        self.freeze_gc_when_synced = freeze_gc_when_synced  # the service sets it; tests build many states
        self.lock = threading.RLock()
        self.heartbeat_ttl_s = heartbeat_ttl_s
        self.clock = clock
        self.nodes: dict[str, NodeState] = {}
        #: the nodes in the order they arrived: filter walks the nodes it is asked about in this order
        self.node_order = NodeOrder()
        self.pods: dict[str, PodRecord] = {}
        self.pods_by_node: dict[str, set[str]] = {}
        self.synced = threading.Event()
        self.generation = 0  # bumped on every change; cheap change detection for observers
        #: called with (record, +1 / -1) whenever a pod's usage starts or stops counting (quota gate)
        self.usage_listeners: list[Callable[[PodRecord, int], None]] = []
        #: called with (uid, pod object, or None when deleted) on every pod event, under the lock, before the
        #: state applies it (quota gate, issue 6: pending pods for StrictFIFO, priority of counted pods)
        self.pod_listeners: list[Callable[[str, Mapping[str, Any] | None], None]] = []
        #: node -> why its GPU inventory is ignored (the node is GPU-less for us until a readable one arrives)
        self.inventory_errors: dict[str, str] = {}
        #: objects that could not be applied at all, by kind ("nodes", "pods"): logged, counted and skipped
        self.ingest_errors: dict[str, int] = {}
        #: called by /readyz once synced; each returns why the extender is not ready, or None (live watches)
        self.readiness_checks: list[Callable[[], str | None]] = []
        # host CPU and memory: uid -> (node, milli-CPU, memory MiB) of each non-finished bound pod asking either,
        # and the sums per node (kept for nodes not known yet, applied when they arrive)
        self.pod_host: dict[str, tuple[str, int, int]] = {}
        self.cpu_used_by_node: dict[str, int] = {}
        self.memory_used_by_node: dict[str, int] = {}
        #: set by the scheduler when a policy reads host CPU (memory): its changes then invalidate a node's cached
        #: results
        self.touch_on_cpu_change = False
        self.touch_on_memory_change = False
        #: names of the nodes changed (touched, heartbeat, labels, deleted), in order, since `journal_epoch` began:
        #: the scheduler's per-shape answers re-judge only these. Whoever clears it (in place: nodes hold it)
        #: bumps the epoch.
        self.journal: list[str] = []
        self.journal_epoch = 0
        #: node name -> a number that changes whenever a pod record on that node is added, removed, counted,
        #: uncounted or changes what /metrics shows of it (confirmation, labels, bind time): the metrics keep each
        #: node's pods' text while it and the node's version are the same
        self.pod_marks: dict[str, int] = {}
        self._pod_mark_count = 0

    # --- nodes ----------------------------------------------------------------------------------
    def upsert_node(self, obj: Mapping[str, Any]) -> None:
        """Add or update a node. A node object that cannot be applied costs only that node: it is made GPU-less
        with the reason in /state (inventoryError), a log line and kube_vgpu_extender_ingest_errors_total."""
        metadata = obj.get("metadata") or {}
        name = metadata.get("name") if isinstance(metadata, Mapping) else None
        if not name or not isinstance(name, str):
            return
        try:
            self._upsert_node(name, metadata, obj)
        except Exception as exc:
            self._node_unusable(name, exc)

    def _upsert_node(self, name: str, metadata: Mapping[str, Any], obj: Mapping[str, Any]) -> None:
        annotations = metadata.get("annotations") or {}
        inventory_text = annotations.get(protocol.NODE_INVENTORY_ANNOTATION)
        heartbeat_text = annotations.get(protocol.NODE_HEARTBEAT_ANNOTATION)
        with self.lock:
            node = self.nodes.get(name)
            if node is None:
                node = self._new_node(name)
                node.cpu_milli_used = self.cpu_used_by_node.get(name, 0)
                node.memory_mib_used = self.memory_used_by_node.get(name, 0)
                changed_inventory = True
            else:
                changed_inventory = node.inventory_text != inventory_text
            self.trim_journal()
            self.journal.append(name)  # its heartbeat (and labels) may have changed: no touch, still news
            node.labels = dict(metadata.get("labels") or {})
            allocatable_cpu = node_allocatable_cpu_milli(obj)
            if allocatable_cpu != node.cpu_milli_total:
                node.cpu_milli_total = allocatable_cpu
                if self.touch_on_cpu_change:
                    node.touch()
            allocatable_memory = node_allocatable_memory_mib(obj)
            if allocatable_memory != node.memory_mib_total:
                node.memory_mib_total = allocatable_memory
                if self.touch_on_memory_change:
                    node.touch()
            if changed_inventory:
                self._set_inventory(node, inventory_text)
            try:
                node.heartbeat_s = protocol.parse_heartbeat(heartbeat_text) if heartbeat_text else None
            except ProtocolError as exc:
                log.warning("node %s: %s", name, exc)
                node.heartbeat_s = None
            self.generation += 1

    def _new_node(self, name: str) -> NodeState:
        name = sys.intern(name)  # one string for the node, its pods' records and every cache keyed by it
        node = NodeState(name, None)
        node.journal = self.journal
        self.nodes[name] = node
        self.node_order.add(name)
        self.pods_by_node.setdefault(name, set())
        return node

    def _set_inventory(self, node: NodeState, inventory_text: str | None) -> None:
        inventory = None
        self.inventory_errors.pop(node.name, None)
        if inventory_text:
            try:
                inventory = protocol.decode_inventory(inventory_text)
            except ProtocolError as exc:
                # a broken annotation makes the node GPU-less for us; it is reported, not guessed at
                log.error("node %s: ignoring invalid GPU inventory: %s", node.name, exc)
                self.inventory_errors[node.name] = str(exc)
        node.inventory_text = inventory_text
        node.set_inventory(inventory)
        # GPUs were rebuilt: re-apply every pod on this node by UUID
        for uid in self.pods_by_node.get(node.name, ()):
            record = self.pods[uid]
            record.applied = False
            self._apply(record)

    def _node_unusable(self, name: str, exc: Exception) -> None:
        """The node object raised while being applied: no GPUs on it for us until an update reads cleanly."""
        with self.lock:
            reason = f"node object could not be applied: {exc!r}"
            log.error("node %s: ignoring its GPUs: %s", name, reason, exc_info=exc)
            self.ingest_errors["nodes"] = self.ingest_errors.get("nodes", 0) + 1
            try:
                node = self.nodes.get(name)
                if node is None:
                    node = self._new_node(name)
                node.inventory_text = None  # the next update decodes its inventory afresh
                node.set_inventory(None)
                for uid in self.pods_by_node.get(name, ()):
                    self.pods[uid].applied = False  # counted again once the node's GPUs are known
                self.mark_pods(name)
            except Exception:  # never let one node stop the others from syncing
                log.exception("node %s: could not be made unusable either; dropping it", name)
                self.nodes.pop(name, None)
                self.node_order.remove(name)
            self.inventory_errors[name] = reason
            self.generation += 1

    def object_failed(self, kind: str, name: str, exc: Exception) -> None:
        """An object (kind: "nodes", "pods") whose event could not be applied: log and count it, go on."""
        with self.lock:
            self.ingest_errors[kind] = self.ingest_errors.get(kind, 0) + 1
        log.error("%s %s: could not be applied, skipped: %r", kind, name or "(unnamed)", exc, exc_info=exc)

    def delete_node(self, name: str) -> None:
        with self.lock:
            node = self.nodes.pop(name, None)
            if node is None:
                return
            self.node_order.remove(name)
            node.journal = None
            self.journal.append(name)
            # pods keep their records: if the node comes back (re-registration) they are counted again
            for uid in self.pods_by_node.get(name, ()):
                self.pods[uid].applied = False
            self.mark_pods(name)
            self.generation += 1

    def mark_pods(self, node_name: str) -> None:
        """A pod record on this node changed (caller holds `lock`): see pod_marks."""
        self._pod_mark_count += 1
        self.pod_marks[node_name] = self._pod_mark_count

    def trim_journal(self) -> None:
        """Keep the change journal bounded: past JOURNAL_LIMIT entries it starts over (in place) in a new epoch, and
        whoever reads it judges every node again (caller holds `lock`)."""
        if len(self.journal) > JOURNAL_LIMIT:
            self.journal.clear()
            self.journal_epoch += 1

    # --- pods -----------------------------------------------------------------------------------
    def upsert_pod(self, obj: Mapping[str, Any]) -> None:
        metadata = obj.get("metadata") or {}
        uid = metadata.get("uid")
        if not uid:
            return
        phase = (obj.get("status") or {}).get("phase")
        annotations = metadata.get("annotations") or {}
        text = annotations.get(protocol.POD_ASSIGNMENT_ANNOTATION)
        node_name = (obj.get("spec") or {}).get("nodeName")
        with self.lock:
            for pod_listener in self.pod_listeners:
                pod_listener(uid, obj)
            if node_name and phase not in FINISHED_PHASES:
                self._set_pod_host(uid, node_name, *bound_pod_host(obj))
            elif uid in self.pod_host:
                self._drop_pod_host(uid)
            record = self.pods.get(uid)
            if phase in FINISHED_PHASES:
                if record is not None:
                    self._remove(uid)
                return
            if text is None:
                if record is not None and record.confirmed:
                    # the annotation was removed (our own rollback, or an operator): stop counting it
                    self._remove(uid)
                elif record is not None and node_name:
                    record.bound = True
                return
            if record is not None and record.assignment_text == text:
                labels = pod_labels_at_bind(metadata)
                bound_at_s = record.bound_at_s if record.bound_at_s is not None else bind_time_of(annotations)
                if not record.confirmed or labels != record.labels or bound_at_s != record.bound_at_s:
                    self.mark_pods(record.node_name)  # what /metrics shows of it changes (not on status updates)
                record.confirmed = True
                record.bound = bool(node_name)
                record.labels = labels
                record.bound_at_s = bound_at_s
                return
            try:
                assignment = protocol.decode_assignment(text)
            except ProtocolError as exc:
                log.error(
                    "pod %s/%s: ignoring invalid assignment annotation: %s",
                    metadata.get("namespace"),
                    metadata.get("name"),
                    exc,
                )
                return
            if record is not None:
                self._remove(uid)
            record = PodRecord(
                uid=uid,
                namespace=sys.intern(str(metadata.get("namespace") or "")),  # one copy per namespace, not per pod
                name=metadata.get("name", ""),
                node_name=assignment.node,
                assignment=assignment,
                assignment_text=text,
                confirmed=True,
                bound=bool(node_name),
                labels=pod_labels_at_bind(metadata),
                bound_at_s=bind_time_of(annotations, f"{metadata.get('namespace')}/{metadata.get('name')}"),
            )
            self._add(record)

    def delete_pod(self, uid: str) -> None:
        with self.lock:
            for pod_listener in self.pod_listeners:
                pod_listener(uid, None)
            if uid in self.pod_host:
                self._drop_pod_host(uid)
            if uid in self.pods:
                self._remove(uid)

    def replace_all(self, nodes: Iterable[Mapping[str, Any]], pods: Iterable[Mapping[str, Any]]) -> None:
        """Full resync (start-up, or a watch that expired): converge on exactly these objects,
        keeping in-flight reservations of binds still under way."""
        with self.lock:
            node_list = list(nodes)
            names = {(n.get("metadata") or {}).get("name") for n in node_list}
            for name in list(self.nodes):
                if name not in names:
                    self.delete_node(name)
            for node in node_list:
                self.upsert_node(node)
            self.replace_pods(pods)

    def unready_reason(self) -> str | None:
        """Why /readyz answers 503 (the initial sync is not done, a watch is dead), or None when ready."""
        if not self.synced.is_set():
            return "initial sync with the API server not finished"
        for check in self.readiness_checks:
            reason = check()
            if reason:
                return reason
        return None

    def mark_synced(self) -> None:
        """The first full sync is done: ready to serve. The objects loaded so far live as long as the
        process, so move them out of the cyclic GC's reach (gc.freeze): full collections over
        hundreds of thousands of long-lived objects otherwise add ms-scale pauses to filter."""
        if self.freeze_gc_when_synced:
            import gc

            gc.collect()
            gc.freeze()
        self.synced.set()

    def replace_pods(self, pods: Iterable[Mapping[str, Any]]) -> None:
        with self.lock:
            self.replace_pod_pages((pods,))

    def replace_pod_pages(self, pages: Iterable[Iterable[Mapping[str, Any]]]) -> None:
        """replace_pods over a list read a page at a time: each page is applied under the lock as it comes (the lock
        is not held while the next one is read), and what the whole list left out is dropped at the end. Only one
        page of API objects is alive at a time: a list of 40,000 pods held whole is hundreds of MiB at its peak, and
        the state's records, interleaved with it in memory, keep much of that from ever being returned."""
        seen: set[str] = set()
        for page in pages:
            with self.lock:
                for pod in page:
                    uid = (pod.get("metadata") or {}).get("uid")
                    if uid:
                        seen.add(uid)
                        try:
                            self.upsert_pod(pod)
                        except Exception as exc:  # one pod that cannot be applied does not stop the others
                            self.object_failed("pods", str((pod.get("metadata") or {}).get("name") or uid), exc)
        with self.lock:
            for uid, record in list(self.pods.items()):
                # gone from the list: drop what the API server had (confirmed), had accepted (bound by the
                # Binding's reply) or may have (an unverifiable Binding); keep reservations of binds under way
                if uid not in seen and (record.confirmed or record.bound or record.uncertain):
                    self._remove(uid)
            for uid in [uid for uid in self.pod_host if uid not in seen]:
                self._drop_pod_host(uid)

    # --- reservations (bind) ----------------------------------------------------------------------
    def reserve(
        self, uid: str, namespace: str, name: str, assignment: PodAssignment, labels: Mapping[str, str] | None = None
    ) -> PodRecord:
        """Count a bind's decision before its annotation is written (caller holds `lock`)."""
        with self.lock:
            existing = self.pods.get(uid)
            if existing is not None:
                if existing.bound or existing.confirmed:
                    # never trade a pod's real usage for a reservation (the scheduler refuses such binds first)
                    raise ValueError(f"pod {namespace}/{name} is bound to {existing.node_name}: not reserving it again")
                self._remove(uid)
            record = PodRecord(
                uid=uid,
                namespace=namespace,
                name=name,
                node_name=assignment.node,
                assignment=assignment,
                assignment_text=protocol.encode_assignment(assignment),
                confirmed=False,
                labels=dict(labels or {}),
            )
            self._add(record)
            return record

    def mark_bound(self, uid: str, node_name: str) -> None:
        """The pod's Binding to `node_name` took effect (its reply, or a read after a lost reply, said so)."""
        with self.lock:
            record = self.pods.get(uid)
            if record is not None and record.node_name == node_name:
                record.bound = True

    def release(self, uid: str, *, only_unconfirmed: bool = False) -> None:
        with self.lock:
            record = self.pods.get(uid)
            if record is not None and not (only_unconfirmed and (record.confirmed or record.bound)):
                self._remove(uid)

    # --- host CPU and memory ------------------------------------------------------------------------
    def _set_pod_host(self, uid: str, node_name: str, cpu_milli: int, memory_mib: int) -> None:
        current = self.pod_host.get(uid)
        if current is not None:
            if current[1] == cpu_milli and current[2] == memory_mib and current[0] == node_name:
                return  # the common case: a status update of a pod already counted
            self._drop_pod_host(uid)
        if not cpu_milli and not memory_mib:
            return  # pods asking neither (BestEffort) need no record
        node_name = sys.intern(node_name)  # one string per node, not one per pod
        self.pod_host[uid] = (node_name, cpu_milli, memory_mib)
        self._add_node_host(node_name, cpu_milli, memory_mib)

    def _drop_pod_host(self, uid: str) -> None:
        node_name, cpu_milli, memory_mib = self.pod_host.pop(uid)
        self._add_node_host(node_name, -cpu_milli, -memory_mib)

    def _add_node_host(self, node_name: str, delta_milli: int, delta_mib: int) -> None:
        node = self.nodes.get(node_name)
        touch = False
        if delta_milli:
            used = _add_to(self.cpu_used_by_node, node_name, delta_milli)
            if node is not None:
                node.cpu_milli_used = used
                touch = self.touch_on_cpu_change
        if delta_mib:
            used = _add_to(self.memory_used_by_node, node_name, delta_mib)
            if node is not None:
                node.memory_mib_used = used
                touch = touch or self.touch_on_memory_change
        if touch and node is not None:
            node.touch()

    # --- internals ------------------------------------------------------------------------------
    def _add(self, record: PodRecord) -> None:
        self.trim_journal()
        self.pods[record.uid] = record
        self.pods_by_node.setdefault(record.node_name, set()).add(record.uid)
        self._apply(record)
        for listener in self.usage_listeners:
            listener(record, 1)
        self.generation += 1

    def _apply(self, record: PodRecord) -> None:
        node = self.nodes.get(record.node_name)
        if node is None or record.applied:
            return
        usage, missing = usage_from_assignment(node, record.assignment)
        if missing:
            log.warning(
                "pod %s/%s: assigned GPUs %s are not in node %s's inventory",
                record.namespace,
                record.name,
                ",".join(missing),
                node.name,
            )
        record.usage = usage
        node.apply_usage(usage, 1)
        record.applied = True
        self.mark_pods(record.node_name)

    def _remove(self, uid: str) -> None:
        self.trim_journal()
        record = self.pods.pop(uid)
        self.pods_by_node.get(record.node_name, set()).discard(uid)
        node = self.nodes.get(record.node_name)
        if node is not None and record.applied:
            node.apply_usage(record.usage, -1)
        record.applied = False
        self.mark_pods(record.node_name)
        for listener in self.usage_listeners:
            listener(record, -1)
        self.generation += 1

    # --- queries --------------------------------------------------------------------------------
    def heartbeat_age_s(self, node: NodeState, now: float | None = None) -> float | None:
        if node.heartbeat_s is None:
            return None
        return (now if now is not None else self.clock()) - node.heartbeat_s

    def snapshot(self) -> dict[str, Any]:
        """JSON-ready view for GET /state (the extender's server encodes it from view_chunks, a piece at a time)."""
        return {"synced": self.synced.is_set(),
                "nodes": [view for chunk in self.view_chunks("nodes") for view in chunk],
                "assignments": [view for chunk in self.view_chunks("assignments") for view in chunk]}

    def view_chunks(self, part: str, pause: Callable[[], None] | None = None) -> Iterator[list[dict[str, Any]]]:
        """/state's "nodes" or "assignments", ~0.1 ms of work at a time (5 nodes, 20 pods), each chunk built under
        the lock, the lock released (and `pause` called) between chunks: at 5000 nodes and 40,000 pods the whole
        view is ~0.3 s of work that filter would otherwise wait for in one piece. A pod bound or gone meanwhile may
        show in one part and not the other."""
        with self.lock:
            now = self.clock()
            objects: list[Any] = list(self.nodes.values() if part == "nodes" else self.pods.values())
        chunk = 5 if part == "nodes" else 20
        for start in range(0, len(objects), chunk):
            if pause is not None:
                pause()
            with self.lock:
                if part == "nodes":
                    views = [self._node_view(node, now) for node in objects[start:start + chunk]]
                else:
                    views = [self._assignment_view(record) for record in objects[start:start + chunk]]
            yield views

    def heartbeat_view(self, node: NodeState, now: float) -> float | None:
        """/state's heartbeatAgeSeconds."""
        age = self.heartbeat_age_s(node, now)
        return None if age is None else round(age, 1)

    def _node_view(self, node: NodeState, now: float) -> dict[str, Any]:
        return {
            "name": node.name,
            "heartbeatAgeSeconds": self.heartbeat_view(node, now),
            "cpuMilliAllocatable": node.cpu_milli_total,
            "cpuMilliRequested": node.cpu_milli_used,
            "inventoryError": self.inventory_errors.get(node.name),
            "gpus": [
                {
                    "uuid": gpu.uuid,
                    "index": gpu.index,
                    "model": gpu.model,
                    "healthy": gpu.healthy,
                    "memoryMiB": gpu.memory_mib,
                    "usedMemoryMiB": gpu.used_memory_mib,
                    "cores": gpu.cores,
                    "usedCores": gpu.used_cores,
                    "maxShares": gpu.max_vgpus,
                    "usedShares": gpu.used_vgpus,
                    "exclusive": gpu.exclusive_holders > 0,
                    # a GPU in MIG mode is never offered to vGPUs: its MIG devices are (migDevices)
                    "migMode": gpu.mig_mode,
                }
                for gpu in node.gpus
            ],
            # static MIG: each MIG device and whether a pod holds it (only on nodes that have some)
            **({"migDevices": [
                {
                    "uuid": device.uuid,
                    "gpuIndex": device.index,
                    "profile": device.mig_profile,
                    "memoryMiB": device.memory_mib,
                    "healthy": device.healthy,
                    "held": device.used_vgpus > 0 or device.exclusive_holders > 0,
                }
                for device in node.mig_devices
            ]} if node.mig_devices else {}),
        }

    @staticmethod
    def _assignment_view(record: PodRecord) -> dict[str, Any]:
        return {
            "pod": f"{record.namespace}/{record.name}",
            "uid": record.uid,
            "node": record.node_name,
            "confirmed": record.confirmed,
            "bound": record.bound,
            "containers": [
                {
                    "name": c.name,
                    "init": c.init,
                    "sidecar": c.sidecar,
                    "devices": [
                        {"uuid": d.uuid, "memoryMiB": d.memory_mib, "cores": d.cores} for d in c.devices
                    ],
                }
                for c in record.assignment.containers
            ],
        }
