"""Snapshot mode: a `kind: List` of Nodes and Pods loaded from a file; binds are applied in memory
exactly as the API server would apply them, and fed back to the state as watch events would be."""

from __future__ import annotations

import copy
import datetime as dt
import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import orjson
import yaml

from kube_vgpu.extender.preemption.evict import (
    DISRUPTION_TARGET,
    PREEMPTION_BY_SCHEDULER,
    REASON_PREEMPTED,
    REASON_PREEMPTING,
    EvictionOutcome,
    EvictionRequest,
    EvictionResult,
    condition_message,
    preemptor_event_message,
    victim_event_message,
)
from kube_vgpu.extender.sources.watch import WatchHealth
from kube_vgpu.extender.state import ClusterState
from kube_vgpu.protocol import DEFAULT_SCHEDULER_NAME

log = logging.getLogger(__name__)

#: the Eviction API's words when a PodDisruptionBudget refuses (what BLOCKED carries in live mode)
PDB_REFUSAL = "Cannot evict pod as it would violate the pod's disruption budget."


class SnapshotError(ValueError):
    pass


def load_snapshot(path: str | Path) -> list[dict[str, Any]]:
    raw = Path(path).read_bytes()
    try:
        doc = orjson.loads(raw) if raw.lstrip()[:1] in (b"{", b"[") else yaml.safe_load(raw)
    except (orjson.JSONDecodeError, yaml.YAMLError) as exc:
        raise SnapshotError(f"{path}: not valid JSON or YAML: {exc}") from None
    if isinstance(doc, dict) and doc.get("kind") == "List":
        items = doc.get("items") or []
    elif isinstance(doc, list):
        items = doc
    else:
        raise SnapshotError(f"{path}: expected a `kind: List` of Node and Pod objects")
    for position, item in enumerate(items):
        if not isinstance(item, dict) or item.get("kind") not in ("Node", "Pod"):
            raise SnapshotError(f"{path}: items[{position}] is not a Node or Pod object")
    return items


@dataclass(frozen=True, slots=True)
class RecordedEvent:
    """An event the snapshot's Evictor would have written (LiveEvictor writes it as an events.k8s.io/v1 Event)."""

    namespace: str  # of the pod it is about
    pod_name: str
    reason: str  # Preempted (on the victim) or Preempting (on the preemptor)
    message: str
    related: str  # namespace/name of the other pod


class SnapshotCluster:
    """In-memory API objects plus a Binder and an Evictor over them."""

    #: a snapshot has no watches (ClusterSource)
    health: Mapping[str, WatchHealth] = MappingProxyType({})

    def __init__(self, state: ClusterState, items: list[dict[str, Any]]) -> None:
        self.state = state
        self._lock = threading.Lock()
        self.nodes = {item["metadata"]["name"]: item for item in items if item["kind"] == "Node"}
        self.pods: dict[tuple[str, str], dict[str, Any]] = {}
        for item in items:
            if item["kind"] == "Pod":
                metadata = item.setdefault("metadata", {})
                metadata.setdefault("namespace", "default")
                metadata.setdefault("uid", f"uid-{metadata['namespace']}-{metadata.get('name')}")
                self.pods[(metadata["namespace"], metadata["name"])] = item
        state.replace_all(self.nodes.values(), self.pods.values())
        state.mark_synced()
        # --- Evictor: what a test sets and reads ---
        #: UIDs a PodDisruptionBudget protects: their eviction is refused (BLOCKED), as the Eviction API's 429
        self.protected_uids: set[str] = set()
        #: every request evict() was given, in order, whatever its outcome
        self.eviction_requests: list[EvictionRequest] = []
        #: (namespace, name, condition) of every DisruptionTarget condition written
        self.conditions: list[tuple[str, str, dict[str, str]]] = []
        self.events: list[RecordedEvent] = []
        self.scheduler_name = DEFAULT_SCHEDULER_NAME

    def start(self) -> None:
        """Nothing to start: the snapshot is complete at construction (ClusterSource)."""

    def stop(self) -> None:
        """Nothing to stop (ClusterSource)."""

    def add_pod(self, pod: dict[str, Any]) -> None:
        metadata = pod["metadata"]
        with self._lock:
            self.pods[(metadata.get("namespace", "default"), metadata["name"])] = pod
        self.state.upsert_pod(pod)

    def delete_pod(self, namespace: str, name: str) -> None:
        with self._lock:
            pod = self.pods.pop((namespace, name), None)
        if pod is not None:
            self.state.delete_pod(pod["metadata"]["uid"])

    # --- Binder -----------------------------------------------------------------------------------
    def get_pod(self, namespace: str, name: str) -> dict[str, Any] | None:
        with self._lock:
            pod = self.pods.get((namespace, name))
            return copy.deepcopy(pod) if pod is not None else None

    def remember_pod(self, pod: Any) -> None:
        """A pod kube-scheduler sent that the snapshot does not hold yet behaves as if just created."""
        metadata = pod.get("metadata") or {}
        name = metadata.get("name")
        if not isinstance(name, str) or not name:
            return
        key = (str(metadata.get("namespace") or "default"), name)
        with self._lock:
            if key not in self.pods:
                stored = copy.deepcopy(dict(pod))
                stored["metadata"].setdefault("namespace", "default")
                self.pods[key] = stored

    def _pod(self, namespace: str, name: str, uid: str) -> dict[str, Any]:
        pod = self.pods.get((namespace, name))
        if pod is None:
            raise LookupError(f'pods "{name}" not found')
        if pod["metadata"].get("uid") != uid:
            raise LookupError(f"pod {namespace}/{name}: UID precondition failed")
        return pod

    def bind(self, namespace: str, name: str, uid: str, node: str, annotations: dict[str, str]) -> None:
        """As the API server's pods/binding: annotations and nodeName together, refused if already bound."""
        with self._lock:
            pod = self._pod(namespace, name, uid)
            current = pod.setdefault("spec", {}).get("nodeName")
            if current:
                raise LookupError(f"pod {namespace}/{name} is already assigned to node {current}")
            pod["metadata"].setdefault("annotations", {}).update(annotations)
            pod["spec"]["nodeName"] = node
            event = copy.deepcopy(pod)
        self.state.upsert_pod(event)

    # --- Evictor ----------------------------------------------------------------------------------
    def evict(self, request: EvictionRequest) -> EvictionResult:
        """As LiveEvictor against the API server: the condition (unless the pod is gone or another one), then the
        eviction (refused for protected UIDs, the condition staying, as a 429 leaves it), then the events. An
        evicted pod is deleted at once (a terminating pod's grace period is not modelled)."""
        try:
            return self._evict(request)
        except Exception as exc:  # the interface never raises
            log.exception("snapshot eviction of pod %s/%s failed", request.namespace, request.name)
            return EvictionResult(EvictionOutcome.FAILED, f"{type(exc).__name__}: {exc}")

    def _evict(self, request: EvictionRequest) -> EvictionResult:
        self.eviction_requests.append(request)
        with self._lock:
            try:
                pod = self._pod(request.namespace, request.name, request.uid)
            except LookupError as exc:
                return EvictionResult(EvictionOutcome.GONE, str(exc))
            condition = {
                "type": DISRUPTION_TARGET,
                "status": "True",
                "reason": PREEMPTION_BY_SCHEDULER,
                "message": condition_message(request, self.scheduler_name),
                "lastTransitionTime": dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
            }
            status = pod.setdefault("status", {})
            others = [c for c in status.get("conditions") or [] if c.get("type") != DISRUPTION_TARGET]
            status["conditions"] = [*others, condition]
            self.conditions.append((request.namespace, request.name, dict(condition)))
            if request.uid in self.protected_uids:
                return EvictionResult(EvictionOutcome.BLOCKED, PDB_REFUSAL)
            del self.pods[(request.namespace, request.name)]
        self.state.delete_pod(request.uid)
        victim = f"{request.namespace}/{request.name}"
        preemptor = f"{request.preemptor_namespace}/{request.preemptor_name}"
        self.events.append(
            RecordedEvent(request.namespace, request.name, REASON_PREEMPTED, victim_event_message(request), preemptor)
        )
        self.events.append(
            RecordedEvent(
                request.preemptor_namespace, request.preemptor_name, REASON_PREEMPTING,
                preemptor_event_message(request), victim,
            )
        )
        return EvictionResult(EvictionOutcome.EVICTED)
