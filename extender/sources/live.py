"""Live mode: list + watch Nodes and Pods through the official kubernetes client, and a Binder that
writes assignments and Bindings through it.

Objects are read as raw JSON (orjson) instead of the client's generated models: at tens of thousands
of pods the model deserialisation would dominate start-up and event handling.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import orjson
from kubernetes import client, config
from kubernetes.client.rest import ApiException

from kube_vgpu.extender.state import ClusterState

log = logging.getLogger(__name__)

LIST_PAGE_SIZE = 500
CONNECTION_POOL_SIZE = 64
WATCH_TIMEOUT_S = 300


def make_api_client(kubeconfig: str | None) -> client.ApiClient:
    """A client from --kubeconfig, else in-cluster config, else the default kubeconfig."""
    if kubeconfig:
        api_client = config.new_client_from_config(config_file=kubeconfig)
    else:
        try:
            config.load_incluster_config()
            api_client = client.ApiClient()
        except config.ConfigException:
            api_client = config.new_client_from_config()
    # binds run concurrently (one per node at a time): keep enough kept-alive connections for them
    api_client.configuration.connection_pool_maxsize = CONNECTION_POOL_SIZE
    api_client.rest_client.pool_manager.connection_pool_kw["maxsize"] = CONNECTION_POOL_SIZE
    made: client.ApiClient = api_client
    return made


class Gone(Exception):
    """The watch's resourceVersion is too old (HTTP 410): relist."""


def _list_all(list_call: Callable[..., Any]) -> tuple[list[dict[str, Any]], str]:
    items: list[dict[str, Any]] = []
    token = None
    while True:
        kwargs: dict[str, Any] = {"limit": LIST_PAGE_SIZE, "_preload_content": False}
        if token:
            kwargs["_continue"] = token
        response = list_call(**kwargs)
        doc = orjson.loads(response.data)
        items.extend(doc.get("items") or [])
        metadata = doc.get("metadata") or {}
        token = metadata.get("continue")
        if not token:
            return items, metadata.get("resourceVersion", "")


def _watch_lines(
    list_call: Callable[..., Any], resource_version: str, stop: threading.Event
) -> Iterator[dict[str, Any]]:
    response = list_call(
        watch=True,
        resource_version=resource_version,
        allow_watch_bookmarks=True,
        timeout_seconds=WATCH_TIMEOUT_S,
        _preload_content=False,
    )
    buffer = b""
    try:
        for chunk in response.stream(amt=None, decode_content=True):
            if stop.is_set():
                return
            buffer += chunk
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                if line.strip():
                    yield orjson.loads(line)
    finally:
        response.release_conn()


class LiveSource:
    """Keeps ClusterState in step with the API server (one thread per resource)."""

    def __init__(self, state: ClusterState, api_client: client.ApiClient) -> None:
        self.state = state
        self.core = client.CoreV1Api(api_client)
        self.stop_event = threading.Event()
        self._nodes_synced = threading.Event()
        self._pods_synced = threading.Event()
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        for target, name in ((self._run_nodes, "watch-nodes"), (self._run_pods, "watch-pods")):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)

    def stop(self) -> None:
        self.stop_event.set()

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
        backoff_s = 0.5
        resource_version = ""
        while not self.stop_event.is_set():
            try:
                if not resource_version:
                    resource_version = resync() or ""
                for event in _watch_lines(list_call, resource_version, self.stop_event):
                    kind = str(event.get("type"))
                    obj = event.get("object") or {}
                    if kind == "ERROR":
                        if obj.get("code") == 410:
                            raise Gone()
                        raise RuntimeError(obj.get("message", "watch error"))
                    resource_version = (obj.get("metadata") or {}).get("resourceVersion", resource_version)
                    if kind in ("ADDED", "MODIFIED", "DELETED"):
                        apply_event(kind, obj)
                backoff_s = 0.5
            except Gone:
                log.info("%s watch expired; relisting", name)
                resource_version = ""
            except ApiException as exc:
                if exc.status == 410:
                    resource_version = ""
                    continue
                log.warning("%s watch failed (%s); retrying in %.1fs", name, exc.reason, backoff_s)
                self.stop_event.wait(backoff_s)
                backoff_s = min(backoff_s * 2, 30.0)
            except Exception as exc:  # network errors: keep the state, retry the watch
                log.warning("%s watch failed (%s); retrying in %.1fs", name, exc, backoff_s)
                self.stop_event.wait(backoff_s)
                backoff_s = min(backoff_s * 2, 30.0)

    def _run_nodes(self) -> None:
        def resync() -> str:
            items, version = _list_all(self.core.list_node)
            with self.state.lock:
                names = {item["metadata"]["name"] for item in items}
                for known in list(self.state.nodes):
                    if known not in names:
                        self.state.delete_node(known)
                for item in items:
                    self.state.upsert_node(item)
            self._nodes_synced.set()
            self._mark_synced()
            return version

        def apply_event(kind: str, obj: dict[str, Any]) -> None:
            if kind == "DELETED":
                self.state.delete_node(obj["metadata"]["name"])
            else:
                self.state.upsert_node(obj)

        self._loop("nodes", resync, apply_event, self.core.list_node)

    def _run_pods(self) -> None:
        def resync() -> str:
            items, version = _list_all(self.core.list_pod_for_all_namespaces)
            self.state.replace_pods(items)
            self._pods_synced.set()
            self._mark_synced()
            return version

        def apply_event(kind: str, obj: dict[str, Any]) -> None:
            if kind == "DELETED":
                self.state.delete_pod(obj["metadata"]["uid"])
            else:
                self.state.upsert_pod(obj)

        self._loop("pods", resync, apply_event, self.core.list_pod_for_all_namespaces)


#: kube-scheduler gives the whole bind verb 30 s (the manifests' httpTimeout); the Binding call gets less, so a
#: lost reply is still verified by reading the pod back inside that budget
BIND_TIMEOUT_S = 20.0


def _drain(response: Any) -> bytes:
    """Read a raw response to the end and hand its connection back to the pool. Unread responses keep their
    connection, so every later call would open (and TLS-handshake) a new one."""
    try:
        data: bytes = response.data
        return data
    finally:
        response.release_conn()


class LiveBinder:
    """Binder over the API server. The assignment patch carries the pod's UID, which the API server
    treats as a precondition: a recreated pod of the same name is never given another pod's GPUs."""

    def __init__(self, api_client: client.ApiClient) -> None:
        self.api_client = api_client
        self.core = client.CoreV1Api(api_client)

    def get_pod(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            response: Any = self.core.read_namespaced_pod(name, namespace, _preload_content=False)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        pod: dict[str, Any] = orjson.loads(_drain(response))
        return pod

    def remember_pod(self, pod: Any) -> None:
        """The API server already has the pod."""

    def bind(self, namespace: str, name: str, uid: str, node: str, annotations: dict[str, str]) -> None:
        # The API server copies a Binding's annotations onto the pod together with spec.nodeName, and refuses it
        # (409) if the pod's UID differs or the pod is already bound. A raw body through the client's own
        # connection pool and auth: the generated method's model validation and serialisation cost more CPU than
        # the rest of a bind (it runs once per pod, one node at a time).
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
            header_params={"Content-Type": "application/json", "Accept": "application/json"},
            auth_settings=["BearerToken"],
        )
        response = self.api_client.rest_client.pool_manager.request(
            "POST", url, body=orjson.dumps(body), headers=headers, preload_content=False, timeout=BIND_TIMEOUT_S
        )
        data = _drain(response)
        if not 200 <= response.status < 300:
            raise ApiException(status=response.status, reason=response.reason, body=data.decode(errors="replace"))


def wait_until(predicate: Callable[[], bool], timeout_s: float, interval_s: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return predicate()
