"""Cluster state: who uses what, updated incrementally by events (Kueue's "cache").

Sources (live watches, a snapshot file) call upsert_node / delete_node / upsert_pod / delete_pod;
filter and prioritize read under `lock`; bind reserves under `lock` and a per-pod guard.

Rules that keep GPUs from being over-committed or lost:
  * a pod's usage comes only from its assignment annotation (the API server is the source of truth),
    or from an in-flight reservation made by our own bind before the annotation is written;
  * an in-flight reservation survives pod events that do not yet carry the annotation;
  * a pod whose node is not known yet keeps its record and is applied when the node arrives;
  * finished (Succeeded / Failed) and deleted pods release their GPUs.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kube_vgpu import protocol
from kube_vgpu.protocol import PodAssignment, ProtocolError

from .engine.model import GpuUsage, NodeState

log = logging.getLogger(__name__)

FINISHED_PHASES = frozenset({"Succeeded", "Failed"})


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
    quota_data: Any = None  # the quota gate's accounting for this pod (issue 6)


def usage_from_assignment(node: NodeState, assignment: PodAssignment) -> tuple[tuple[GpuUsage, ...], list[str]]:
    """Per-GPU usage of an assignment on `node` (peak over init/app phases), and UUIDs not on the node."""
    missing: list[str] = []
    phases: list[list[protocol.ContainerAssignment]] = []
    app = [c for c in assignment.containers if not c.init]
    if app:
        phases.append(app)
    phases.extend([c] for c in assignment.containers if c.init)
    peak: dict[int, list[int]] = {}
    for phase in phases:
        totals: dict[int, list[int]] = {}
        for container in phase:
            for device in container.devices:
                gpu = node.gpu_by_uuid.get(device.uuid)
                if gpu is None:
                    missing.append(device.uuid)
                    continue
                entry = totals.setdefault(gpu.position, [0, 0, 0, 0])
                entry[0] += device.memory_mib
                entry[1] += device.cores
                entry[2] += 1
                if device.cores >= gpu.cores:
                    entry[3] = 1
        for position, values in totals.items():
            current = peak.setdefault(position, [0, 0, 0, 0])
            for i in range(4):
                current[i] = max(current[i], values[i])
    usage = tuple(GpuUsage(position, v[0], v[1], v[2], bool(v[3])) for position, v in sorted(peak.items()))
    return usage, missing


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
        self.pods: dict[str, PodRecord] = {}
        self.pods_by_node: dict[str, set[str]] = {}
        self.synced = threading.Event()
        self.generation = 0  # bumped on every change; cheap change detection for observers
        #: called with (record, +1 / -1) whenever a pod's usage starts or stops counting (quota gate)
        self.usage_listeners: list[Callable[[PodRecord, int], None]] = []
        #: called with (uid, pod object, or None when deleted) on every pod event, under the lock, before the
        #: state applies it (quota gate, issue 6: pending pods for StrictFIFO, priority of counted pods)
        self.pod_listeners: list[Callable[[str, Mapping[str, Any] | None], None]] = []
        self.inventory_errors: dict[str, str] = {}

    # --- nodes ----------------------------------------------------------------------------------
    def upsert_node(self, obj: Mapping[str, Any]) -> None:
        metadata = obj.get("metadata") or {}
        name = metadata.get("name")
        if not name:
            return
        annotations = metadata.get("annotations") or {}
        inventory_text = annotations.get(protocol.NODE_INVENTORY_ANNOTATION)
        heartbeat_text = annotations.get(protocol.NODE_HEARTBEAT_ANNOTATION)
        with self.lock:
            node = self.nodes.get(name)
            if node is None:
                node = NodeState(name, None)
                self.nodes[name] = node
                self.pods_by_node.setdefault(name, set())
                changed_inventory = True
            else:
                changed_inventory = node.inventory_text != inventory_text
            node.labels = dict(metadata.get("labels") or {})
            if changed_inventory:
                self._set_inventory(node, inventory_text)
            try:
                node.heartbeat_s = protocol.parse_heartbeat(heartbeat_text) if heartbeat_text else None
            except ProtocolError as exc:
                log.warning("node %s: %s", name, exc)
                node.heartbeat_s = None
            self.generation += 1

    def _set_inventory(self, node: NodeState, inventory_text: str | None) -> None:
        inventory = None
        if inventory_text:
            try:
                inventory = protocol.decode_inventory(inventory_text)
                self.inventory_errors.pop(node.name, None)
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

    def delete_node(self, name: str) -> None:
        with self.lock:
            node = self.nodes.pop(name, None)
            if node is None:
                return
            # pods keep their records: if the node comes back (re-registration) they are counted again
            for uid in self.pods_by_node.get(name, ()):
                self.pods[uid].applied = False
            self.generation += 1

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
                record.confirmed = True
                record.bound = bool(node_name)
                record.labels = dict(metadata.get("labels") or {})
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
                namespace=metadata.get("namespace", ""),
                name=metadata.get("name", ""),
                node_name=assignment.node,
                assignment=assignment,
                assignment_text=text,
                confirmed=True,
                bound=bool(node_name),
                labels=dict(metadata.get("labels") or {}),
            )
            self._add(record)

    def delete_pod(self, uid: str) -> None:
        with self.lock:
            for pod_listener in self.pod_listeners:
                pod_listener(uid, None)
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
            seen: set[str] = set()
            for pod in pods:
                uid = (pod.get("metadata") or {}).get("uid")
                if uid:
                    seen.add(uid)
                    self.upsert_pod(pod)
            for uid, record in list(self.pods.items()):
                if uid not in seen and record.confirmed:
                    self._remove(uid)

    # --- reservations (bind) ----------------------------------------------------------------------
    def reserve(
        self, uid: str, namespace: str, name: str, assignment: PodAssignment, labels: Mapping[str, str] | None = None
    ) -> PodRecord:
        """Count a bind's decision before its annotation is written (caller holds `lock`)."""
        with self.lock:
            if uid in self.pods:
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

    def release(self, uid: str, *, only_unconfirmed: bool = False) -> None:
        with self.lock:
            record = self.pods.get(uid)
            if record is not None and not (only_unconfirmed and record.confirmed):
                self._remove(uid)

    # --- internals ------------------------------------------------------------------------------
    def _add(self, record: PodRecord) -> None:
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

    def _remove(self, uid: str) -> None:
        record = self.pods.pop(uid)
        self.pods_by_node.get(record.node_name, set()).discard(uid)
        node = self.nodes.get(record.node_name)
        if node is not None and record.applied:
            node.apply_usage(record.usage, -1)
        record.applied = False
        for listener in self.usage_listeners:
            listener(record, -1)
        self.generation += 1

    # --- queries --------------------------------------------------------------------------------
    def heartbeat_age_s(self, node: NodeState, now: float | None = None) -> float | None:
        if node.heartbeat_s is None:
            return None
        return (now if now is not None else self.clock()) - node.heartbeat_s

    def snapshot(self) -> dict[str, Any]:
        """JSON-ready view for GET /state."""
        with self.lock:
            now = self.clock()
            nodes = []
            for node in self.nodes.values():
                age = self.heartbeat_age_s(node, now)
                nodes.append(
                    {
                        "name": node.name,
                        "heartbeatAgeSeconds": None if age is None else round(age, 1),
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
                                "maxShares": gpu.max_shares,
                                "usedShares": gpu.used_shares,
                                "exclusive": gpu.exclusive_holders > 0,
                            }
                            for gpu in node.gpus
                        ],
                    }
                )
            assignments = [
                {
                    "pod": f"{record.namespace}/{record.name}",
                    "uid": record.uid,
                    "node": record.node_name,
                    "confirmed": record.confirmed,
                    "bound": record.bound,
                    "containers": [
                        {
                            "name": c.name,
                            "init": c.init,
                            "devices": [
                                {"uuid": d.uuid, "memoryMiB": d.memory_mib, "cores": d.cores} for d in c.devices
                            ],
                        }
                        for c in record.assignment.containers
                    ],
                }
                for record in self.pods.values()
            ]
            return {"synced": self.synced.is_set(), "nodes": nodes, "assignments": assignments}
