"""An in-memory API server for the device plugin's two interfaces (PodSource, NodeClient).

A real implementation of those interfaces, with the semantics the plugin relies on: every write bumps
metadata.resourceVersion, a patch carrying a stale resourceVersion fails with Conflict, reads return copies.
Tests drive the matching logic with it; a dev cluster without kubelets could back simulated nodes with it.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kube_vgpu.deviceplugin.kube import Conflict, NotFound


@dataclass(frozen=True, slots=True)
class RecordedEvent:
    kind: str
    namespace: str
    name: str
    reason: str
    message: str
    warning: bool


class InMemoryCluster:
    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._revision = 0
        self.pods: dict[tuple[str, str], dict[str, Any]] = {}
        self.nodes: dict[str, dict[str, Any]] = {}
        self.events: list[RecordedEvent] = []
        self.conflicts = 0  # patches refused because the resourceVersion had moved on
        self.node_patches: list[tuple[str, dict[str, str], dict[str, str | None]]] = []
        #: called with (namespace, name) just before a pod patch is applied, outside the lock: lets a test
        #: interleave another writer exactly between a reader's read and its write
        self.before_pod_patch: Callable[[str, str], None] | None = None

    def _next_revision(self) -> str:
        self._revision += 1
        return str(self._revision)

    # -- setup helpers (what kubectl / the extender would do) ----------------------------------------------------

    def add_pod(self, pod: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            stored = copy.deepcopy(pod)
            metadata = stored.setdefault("metadata", {})
            metadata.setdefault("namespace", "default")
            metadata.setdefault("annotations", {})
            metadata["resourceVersion"] = self._next_revision()
            self.pods[(metadata["namespace"], metadata["name"])] = stored
            return copy.deepcopy(stored)

    def update_pod(self, namespace: str, name: str, change: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
        with self._lock:
            pod = self.pods[(namespace, name)]
            change(pod)
            pod["metadata"]["resourceVersion"] = self._next_revision()
            return copy.deepcopy(pod)

    def delete_pod(self, namespace: str, name: str) -> None:
        with self._lock:
            self.pods.pop((namespace, name), None)

    def pod(self, namespace: str, name: str) -> dict[str, Any]:
        with self._lock:
            return copy.deepcopy(self.pods[(namespace, name)])

    def add_node(self, node: dict[str, Any]) -> None:
        with self._lock:
            stored = copy.deepcopy(node)
            stored.setdefault("metadata", {})["resourceVersion"] = self._next_revision()
            self.nodes[stored["metadata"]["name"]] = stored

    # -- PodSource ------------------------------------------------------------------------------------------------

    def list_node_pods(self, node_name: str) -> list[dict[str, Any]]:
        with self._lock:
            return [
                copy.deepcopy(pod) for pod in self.pods.values() if (pod.get("spec") or {}).get("nodeName") == node_name
            ]

    def patch_pod_annotations(
        self, namespace: str, name: str, resource_version: str, annotations: dict[str, str | None]
    ) -> dict[str, Any]:
        hook = self.before_pod_patch
        if hook is not None:
            hook(namespace, name)
        with self._lock:
            pod = self.pods.get((namespace, name))
            if pod is None:
                raise NotFound(f"pod {namespace}/{name} not found")
            if pod["metadata"]["resourceVersion"] != resource_version:
                self.conflicts += 1
                raise Conflict(
                    f"pod {namespace}/{name} is at resourceVersion {pod['metadata']['resourceVersion']}, "
                    f"not {resource_version}"
                )
            stored = pod["metadata"].setdefault("annotations", {})
            for key, value in annotations.items():
                if value is None:
                    stored.pop(key, None)
                else:
                    stored[key] = value
            pod["metadata"]["resourceVersion"] = self._next_revision()
            return copy.deepcopy(pod)

    def record_event(self, involved: dict[str, Any], reason: str, message: str, *, warning: bool = True) -> None:
        metadata = involved.get("metadata") or {}
        with self._lock:
            self.events.append(
                RecordedEvent(
                    kind=involved.get("kind", "Pod"),
                    namespace=metadata.get("namespace", ""),
                    name=metadata.get("name", ""),
                    reason=reason,
                    message=message,
                    warning=warning,
                )
            )

    # -- NodeClient -----------------------------------------------------------------------------------------------

    def get_node(self, name: str) -> dict[str, Any]:
        with self._lock:
            if name not in self.nodes:
                raise NotFound(f"node {name} not found")
            return copy.deepcopy(self.nodes[name])

    def patch_node_metadata(self, name: str, annotations: dict[str, str], labels: dict[str, str | None]) -> None:
        with self._lock:
            if name not in self.nodes:
                raise NotFound(f"node {name} not found")
            metadata = self.nodes[name].setdefault("metadata", {})
            metadata.setdefault("annotations", {}).update(annotations)
            stored_labels = metadata.setdefault("labels", {})
            for key, value in labels.items():
                if value is None:
                    stored_labels.pop(key, None)
                else:
                    stored_labels[key] = value
            metadata["resourceVersion"] = self._next_revision()
            self.node_patches.append((name, dict(annotations), dict(labels)))
