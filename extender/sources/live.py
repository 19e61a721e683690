"""Live mode: list + watch Nodes and Pods through the official kubernetes client, and a Binder that
writes Bindings through it.

Connections, deadlines and keepalive: extender/sources/apiclient.py. List/watch and the watch watchdog:
extender/sources/watch.py. A watch that makes no progress for `ApiTimeouts.watch_progress_s` is opened again, and
/readyz answers 503 while it is dead. One object that cannot be applied (a malformed inventory, anything that
raises) is logged, counted and skipped, and a node's is made unusable, with the reason in /state: the rest of
the cluster keeps syncing.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from typing import Any

import orjson
from kubernetes import client
from kubernetes.client.rest import ApiException

from kube_vgpu.extender.sources.apiclient import (
    CONNECTION_POOL_SIZE,
    DEFAULT_TIMEOUTS,
    ApiTimeouts,
    make_api_client,
    read_body,
    urllib3_timeout,
)
from kube_vgpu.extender.sources.rawapi import RawApi
from kube_vgpu.extender.sources.watch import (
    LIST_PAGE_SIZE,
    Gone,
    ListPager,
    WatchHealth,
    WatchStalled,
    list_all,
    watch_events,
)
from kube_vgpu.extender.state import ClusterState

__all__ = [
    "CONNECTION_POOL_SIZE",
    "LIST_PAGE_SIZE",
    "Gone",
    "LiveBinder",
    "LiveSource",
    "make_api_client",
    "wait_until",
]

log = logging.getLogger(__name__)

INITIAL_BACKOFF_S = 0.5
MAX_BACKOFF_S = 30.0


class LiveSource:
    """Keeps ClusterState in step with the API server (one thread per resource)."""

    def __init__(
        self,
        state: ClusterState,
        api_client: client.ApiClient,
        *,
        timeouts: ApiTimeouts = DEFAULT_TIMEOUTS,
        max_backoff_s: float = MAX_BACKOFF_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.state = state
        self.core = RawApi(api_client)
        self.timeouts = timeouts
        self.max_backoff_s = max_backoff_s
        self.stop_event = threading.Event()
        self._nodes_synced = threading.Event()
        self._pods_synced = threading.Event()
        self._threads: list[threading.Thread] = []
        # relists asked for from outside (the leader fence), per resource: callbacks run once one is applied
        self._relist_lock = threading.Lock()
        self._relist_waiters: dict[str, list[Callable[[], None]]] = {"nodes": [], "pods": []}
        self._open_watches: dict[str, Any] = {}
        #: resource -> how its watch is doing (/readyz, /metrics)
        self.health = {
            resource: WatchHealth(resource, timeouts.watch_progress_s, clock) for resource in ("nodes", "pods")
        }

    def start(self) -> None:
        if self._threads:
            return
        self.state.readiness_checks.append(self.unready_reason)
        for target, name in ((self._run_nodes, "watch-nodes"), (self._run_pods, "watch-pods")):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)

    def stop(self) -> None:
        self.stop_event.set()

    def request_relist(self, resource: str, done: Callable[[], None]) -> None:
        """Relist `resource` now, from a quorum read, in its watch thread (so no older event is applied after it),
        and call `done` once the list has been applied."""
        with self._relist_lock:
            self._relist_waiters[resource].append(done)
            response = self._open_watches.get(resource)
        if response is not None:
            # ends the watch at once (close() would wait for the reading thread's lock); the loop then relists
            response.shutdown()

    def _take_relist_waiters(self, resource: str) -> list[Callable[[], None]] | None:
        with self._relist_lock:
            waiting = self._relist_waiters[resource]
            if not waiting:
                return None
            self._relist_waiters[resource] = []
            return waiting

    def _relist_if_needed(self, resource: str, resource_version: str, resync: Callable[[], str]) -> str:
        """The version to watch from: relisted when there is none yet, or when a relist was asked for."""
        waiters = self._take_relist_waiters(resource)
        if resource_version and not waiters:
            return resource_version
        try:
            resource_version = resync() or ""
        except BaseException:
            if waiters:  # still owed a relist: the next attempt serves them
                with self._relist_lock:
                    self._relist_waiters[resource][:0] = waiters
            raise
        self.health[resource].progressed()
        for done in waiters or ():
            done()
        return resource_version

    def _watch_opened(self, resource: str, response: Any) -> None:
        with self._relist_lock:
            self._open_watches[resource] = response
            requested = bool(self._relist_waiters[resource])
        if requested:
            response.shutdown()

    def unready_reason(self) -> str | None:
        """Why the watches cannot be trusted right now (a watch silent past its progress timeout), or None."""
        for health in self.health.values():
            problem = health.problem()
            if problem is not None:
                return problem
        return None

    def _mark_synced(self) -> None:
        if self._nodes_synced.is_set() and self._pods_synced.is_set() and not self.state.synced.is_set():
            log.info("initial sync done: %d nodes, %d assigned pods", len(self.state.nodes), len(self.state.pods))
            self.state.mark_synced()

    def _loop(
        self,
        name: str,
        resync: Callable[[], str],
        apply_event: Callable[[str, dict[str, Any]], None],
        list_call: Callable[..., Any],
    ) -> None:
        health = self.health[name]
        backoff_s = INITIAL_BACKOFF_S
        resource_version = ""
        while not self.stop_event.is_set():
            try:
                resource_version = self._relist_if_needed(name, resource_version, resync)
                for event in watch_events(
                    list_call, resource_version, self.stop_event, timeouts=self.timeouts,
                    on_progress=health.progressed, on_open=lambda response: self._watch_opened(name, response),
                ):
                    kind = str(event.get("type"))
                    obj = event.get("object")
                    if not isinstance(obj, dict):
                        obj = {}
                    if kind == "ERROR":
                        if obj.get("code") == 410:
                            raise Gone()
                        raise RuntimeError(obj.get("message", "watch error"))
                    if kind in ("ADDED", "MODIFIED", "DELETED"):
                        self._apply(name, apply_event, kind, obj)
                    metadata = obj.get("metadata")
                    version = metadata.get("resourceVersion") if isinstance(metadata, dict) else None
                    if isinstance(version, str) and version:
                        resource_version = version
                backoff_s = INITIAL_BACKOFF_S
            except Gone:
                log.info("%s watch expired; relisting", name)
                health.restarted("expired")
                resource_version = ""
            except WatchStalled as exc:
                # no backoff: the connection was dead, not the API server (if it is, the next attempt says so)
                log.warning("%s watch stalled (%s); opening it again", name, exc)
                health.restarted("stalled", str(exc))
            except ApiException as exc:
                if exc.status == 410:
                    health.restarted("expired")
                    resource_version = ""
                    continue
                health.restarted("error", f"{exc.status} {exc.reason}")
                log.warning("%s watch failed (%s); retrying in %.1fs", name, exc.reason, backoff_s)
                self.stop_event.wait(backoff_s)
                backoff_s = min(backoff_s * 2, self.max_backoff_s)
            except Exception as exc:  # network errors, deadlines: keep the state, retry the watch
                if self._relist_waiters[name]:
                    continue  # we closed the watch ourselves to relist: no backoff
                health.restarted("error", repr(exc))
                log.warning("%s watch failed (%r); retrying in %.1fs", name, exc, backoff_s)
                self.stop_event.wait(backoff_s)
                backoff_s = min(backoff_s * 2, self.max_backoff_s)

    def _apply(
        self, resource: str, apply_event: Callable[[str, dict[str, Any]], None], kind: str, obj: dict[str, Any]
    ) -> None:
        """One event; an object that cannot be applied is reported and skipped, never ends the watch (which
        would relist, meet the same object again, and stop the whole cluster from syncing)."""
        try:
            apply_event(kind, obj)
        except Exception as exc:
            self.state.object_failed(resource, _object_name(obj), exc)

    def _run_nodes(self) -> None:
        def resync() -> str:
            items, version = list_all(self.core.list_node, timeouts=self.timeouts)
            with self.state.lock:
                names = {_object_name(item) for item in items}
                for known in list(self.state.nodes):
                    if known not in names:
                        self.state.delete_node(known)
                for item in items:
                    self.state.upsert_node(item)  # a node that cannot be read is made unusable there
            self._nodes_synced.set()
            self._mark_synced()
            return version

        def apply_event(kind: str, obj: dict[str, Any]) -> None:
            if kind == "DELETED":
                self.state.delete_node(_object_name(obj))
            else:
                self.state.upsert_node(obj)

        self._loop("nodes", resync, apply_event, self.core.list_node)

    def _run_pods(self) -> None:
        def resync() -> str:
            # applied a page at a time as it is read (state.replace_pod_pages: the whole list at once is hundreds of
            # MiB at 40,000 pods); a pod that cannot be applied is reported and skipped there
            pager = ListPager(self.core.list_pod_for_all_namespaces, timeouts=self.timeouts)
            self.state.replace_pod_pages(pager)
            version = pager.resource_version
            self._pods_synced.set()
            self._mark_synced()
            return version

        def apply_event(kind: str, obj: dict[str, Any]) -> None:
            if kind == "DELETED":
                uid = (obj.get("metadata") or {}).get("uid")
                if isinstance(uid, str):
                    self.state.delete_pod(uid)
            else:
                self.state.upsert_pod(obj)

        self._loop("pods", resync, apply_event, self.core.list_pod_for_all_namespaces)


def _object_name(obj: Any) -> str:
    metadata = obj.get("metadata") if isinstance(obj, dict) else None
    name = metadata.get("name") if isinstance(metadata, dict) else None
    return name if isinstance(name, str) else ""


class LiveBinder:
    """Binder over the API server. The Binding carries the pod's UID, which the API server treats as a
    precondition: a recreated pod of the same name is never given another pod's GPUs. Every call has a deadline
    (ApiTimeouts: read_s, bind_s), so a bind holds its node's turn for at most bind_s + read_s."""

    def __init__(self, api_client: client.ApiClient, *, timeouts: ApiTimeouts = DEFAULT_TIMEOUTS) -> None:
        self.api_client = api_client
        self.core = RawApi(api_client)
        self.timeouts = timeouts

    def get_pod(self, namespace: str, name: str) -> dict[str, Any] | None:
        deadline = time.monotonic() + self.timeouts.read_s
        try:
            response: Any = self.core.read_namespaced_pod(
                name,
                namespace,
                _preload_content=False,
                _request_timeout=self.timeouts.read_s,  # connect and headers; the body: read_body
            )
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        pod: dict[str, Any] = orjson.loads(read_body(response, deadline, f"reading pod {namespace}/{name}"))
        return pod

    def remember_pod(self, pod: Any) -> None:
        """The API server already has the pod."""

    def bind(self, namespace: str, name: str, uid: str, node: str, annotations: dict[str, str]) -> None:
        # The API server copies a Binding's annotations onto the pod together with spec.nodeName, and refuses it
        # (409) if the pod's UID differs or the pod is already bound. A raw body through the client's own
        # connection pool and auth: the generated method's model validation and serialisation cost more CPU than
        # the rest of a bind (it runs once per pod, one node at a time).
        deadline = time.monotonic() + self.timeouts.bind_s
        body = {
            "apiVersion": "v1",
            "kind": "Binding",
            "metadata": {"name": name, "namespace": namespace, "uid": uid, "annotations": annotations},
            "target": {"apiVersion": "v1", "kind": "Node", "name": node},
        }
        _, url, headers, _, _ = self.api_client.param_serialize(
            "POST",
            "/api/v1/namespaces/{namespace}/pods/{name}/binding",
            path_params={"namespace": namespace, "name": name},
            # the API server gives up on the write after this too, so it cannot land after our deadline (the leader
            # fence counts on it: extender/fence.py)
            query_params=[("timeout", f"{math.ceil(self.timeouts.bind_s)}s")],
            header_params={"Content-Type": "application/json", "Accept": "application/json"},
            auth_settings=["BearerToken"],
        )
        response = self.api_client.rest_client.pool_manager.request(
            "POST",
            url,
            body=orjson.dumps(body),
            headers=headers,
            preload_content=False,
            timeout=urllib3_timeout(self.timeouts.bind_s, self.timeouts.connect_s),
        )
        data = read_body(response, deadline, f"binding pod {namespace}/{name}")
        if not 200 <= response.status < 300:
            raise ApiException(status=response.status, reason=response.reason, body=data.decode(errors="replace"))


def wait_until(predicate: Callable[[], bool], timeout_s: float, interval_s: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return predicate()
