"""Snapshot mode: a `kind: List` of Nodes and Pods loaded from a file; binds are applied in memory
exactly as the API server would apply them, and fed back to the state as watch events would be."""

from __future__ import annotations

import copy
import threading
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

import orjson
import yaml

from kube_vgpu.extender.sources.watch import WatchHealth
from kube_vgpu.extender.state import ClusterState


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


class SnapshotCluster:
    """In-memory API objects plus a Binder over them."""

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
