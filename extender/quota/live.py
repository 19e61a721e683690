"""Live mode: list + watch the cluster's Kueue objects (when Kueue's CRDs exist) and namespaces.

One thread per kind. A kind whose CRD is missing (HTTP 404 for every version) counts as listed-and-empty and is
looked for again every `absent_retry_s`, so installing Kueue later needs no restart. The preferred version is
tried first (v1beta2, then v1beta1; Cohort also v1alpha1); the API server converts between served versions.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any

from kubernetes import client
from kubernetes.client.rest import ApiException

from kube_vgpu import protocol
from kube_vgpu.extender.sources.rawapi import RawApi
from kube_vgpu.extender.sources.watch import Gone, list_all, watch_events

log = logging.getLogger(__name__)

#: kind -> (plural, versions in order of preference)
KINDS: dict[str, tuple[str, tuple[str, ...]]] = {
    "ResourceFlavor": ("resourceflavors", ("v1beta2", "v1beta1")),
    "ClusterQueue": ("clusterqueues", ("v1beta2", "v1beta1")),
    "LocalQueue": ("localqueues", ("v1beta2", "v1beta1")),
    "Cohort": ("cohorts", ("v1beta2", "v1beta1", "v1alpha1")),
    "WorkloadPriorityClass": ("workloadpriorityclasses", ("v1beta2", "v1beta1")),
}
#: What quota mode kueue watches: Kueue's controller admits, the extender reads its decisions and its queues.
KUEUE_MODE_KINDS: dict[str, tuple[str, tuple[str, ...]]] = {
    "Workload": ("workloads", ("v1beta2", "v1beta1")),
    "ClusterQueue": KINDS["ClusterQueue"],
    "LocalQueue": KINDS["LocalQueue"],
}
NAMESPACE = "Namespace"


def _key(obj: Mapping[str, Any]) -> tuple[str, str]:
    metadata = obj.get("metadata") or {}
    return (str(metadata.get("namespace") or ""), str(metadata.get("name") or ""))


class KueueWatcher:
    """Feeds `gate` (set_cluster_objects, set_namespaces, mark_synced) with the cluster's objects of `kinds`, and
    Namespaces unless `namespaces` is False."""

    def __init__(self, gate: Any, api_client: client.ApiClient, *, absent_retry_s: float = 60.0,
                 kinds: Mapping[str, tuple[str, tuple[str, ...]]] = KINDS, namespaces: bool = True) -> None:
        self.gate = gate
        self.kinds = dict(kinds)
        self.watched = [*self.kinds, *((NAMESPACE,) if namespaces else ())]
        self.custom = client.CustomObjectsApi(api_client)
        self.core = RawApi(api_client)
        self.absent_retry_s = absent_retry_s
        self.stop_event = threading.Event()
        self._listed: set[str] = set()
        self._listed_lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        #: kind -> the version being watched (None: CRD absent); for /quota and tests
        self.versions: dict[str, str | None] = {}

    def start(self) -> None:
        if self._threads:
            return
        for kind in self.watched:
            thread = threading.Thread(target=self._run, args=(kind,), name=f"watch-kueue-{kind}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def stop(self) -> None:
        self.stop_event.set()

    def _mark_listed(self, kind: str) -> None:
        with self._listed_lock:
            self._listed.add(kind)
            done = len(self._listed) == len(self.watched)
        if done:
            self.gate.mark_synced()

    def _list_call(self, kind: str, version: str) -> Callable[..., Any]:
        if kind == NAMESPACE:
            return self.core.list_namespace
        plural = self.kinds[kind][0]
        return functools.partial(self.custom.list_cluster_custom_object, protocol.KUEUE_API_GROUP, version, plural)

    def _first_list(self, kind: str) -> tuple[str | None, list[dict[str, Any]], str]:
        """(version, items, resourceVersion); version None when no version of the kind is served."""
        versions = ("v1",) if kind == NAMESPACE else self.kinds[kind][1]
        for version in versions:
            try:
                items, resource_version = list_all(self._list_call(kind, version))
            except ApiException as exc:
                if exc.status == 404:
                    continue
                raise
            for item in items:  # list items of custom resources normally carry these; make sure
                item.setdefault("apiVersion", version if kind == NAMESPACE else f"{protocol.KUEUE_API_GROUP}/{version}")
                item.setdefault("kind", kind)
            return version, items, resource_version
        return None, [], ""

    def _publish(self, kind: str, objects: dict[tuple[str, str], dict[str, Any]]) -> None:
        if kind == NAMESPACE:
            self.gate.set_namespaces({key[1]: dict((obj.get("metadata") or {}).get("labels") or {})
                                      for key, obj in objects.items()})
        else:
            self.gate.set_cluster_objects(kind, objects)

    def _run(self, kind: str) -> None:
        backoff_s = 0.5
        resource_version = ""
        version: str | None = None
        objects: dict[tuple[str, str], dict[str, Any]] = {}
        while not self.stop_event.is_set():
            try:
                if not resource_version:
                    version, items, resource_version = self._first_list(kind)
                    self.versions[kind] = version
                    objects = {_key(item): item for item in items}
                    self._publish(kind, objects)
                    self._mark_listed(kind)
                    if version is None:
                        self.stop_event.wait(self.absent_retry_s)
                        continue
                assert version is not None
                for event in watch_events(self._list_call(kind, version), resource_version, self.stop_event):
                    event_type = event.get("type")
                    obj = event.get("object") or {}
                    if event_type == "ERROR":
                        if obj.get("code") == 410:
                            raise Gone()
                        raise RuntimeError(obj.get("message", "watch error"))
                    resource_version = (obj.get("metadata") or {}).get("resourceVersion", resource_version)
                    if event_type == "BOOKMARK":
                        continue
                    obj.setdefault("apiVersion", version if kind == NAMESPACE
                                   else f"{protocol.KUEUE_API_GROUP}/{version}")
                    obj.setdefault("kind", kind)
                    if event_type == "DELETED":
                        objects.pop(_key(obj), None)
                    else:
                        objects[_key(obj)] = obj
                    self._publish(kind, objects)
                backoff_s = 0.5
            except Gone:
                resource_version = ""
            except ApiException as exc:
                if exc.status in (404, 410):  # the CRD went away, or the watch expired: list again
                    resource_version = ""
                    continue
                log.warning("quota: %s watch failed (%s); retrying in %.1fs", kind, exc.reason, backoff_s)
                self.stop_event.wait(backoff_s)
                backoff_s = min(backoff_s * 2, 30.0)
            except Exception as exc:  # network errors: keep what we have, retry
                log.warning("quota: %s watch failed (%s); retrying in %.1fs", kind, exc, backoff_s)
                self.stop_event.wait(backoff_s)
                backoff_s = min(backoff_s * 2, 30.0)
