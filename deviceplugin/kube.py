"""The device plugin's access to the API server, behind two small interfaces.

`PodSource` (pods on this node: list, guarded annotation patch, events) is what Allocate and the foreign-pod
scan need; `NodeClient` (read the node, patch its annotations and labels) is what the publisher needs.
`KubeClient` implements both with the official kubernetes client; `InMemoryCluster`
(kube_vgpu/dev/fixtures/inmemory_api.py) implements both in memory, for tests. Objects travel as plain JSON dicts,
exactly as the API server sends them.
"""

from __future__ import annotations

import datetime as dt
import logging
import os
from typing import Any, Protocol

import orjson

log = logging.getLogger(__name__)

MERGE_PATCH = "application/merge-patch+json"
#: Bounded API calls: an Allocate must answer kubelet well within its own deadline.
REQUEST_TIMEOUT_SECONDS = 10.0


class Conflict(Exception):
    """The object changed since it was read (HTTP 409): re-read and decide again."""


class NotFound(Exception):
    """The object does not exist (HTTP 404)."""


class ApiUnavailable(Exception):
    """The API server could not be reached or refused the request for another reason."""


class PodSource(Protocol):
    def list_node_pods(self, node_name: str) -> list[dict[str, Any]]:
        """Every pod bound to the node (spec.nodeName), any phase."""
        ...

    def patch_pod_annotations(
        self, namespace: str, name: str, resource_version: str, annotations: dict[str, str | None]
    ) -> dict[str, Any]:
        """Merge-patch annotations, only if the pod is still at `resource_version` (else Conflict). A None value
        removes the key. Returns the updated pod."""
        ...

    def record_event(self, involved: dict[str, Any], reason: str, message: str, *, warning: bool = True) -> None:
        """A core/v1 Event about the object (best effort: failures are logged, not raised)."""
        ...


class NodeClient(Protocol):
    def get_node(self, name: str) -> dict[str, Any]: ...

    def patch_node_metadata(self, name: str, annotations: dict[str, str], labels: dict[str, str | None]) -> None:
        """Merge-patch annotations and labels (a None label value removes the label)."""
        ...


def load_api_client(kubeconfig: str | None) -> Any | None:
    """An ApiClient from a kubeconfig file, else the in-cluster service account, else None (no cluster)."""
    from kubernetes import client, config

    if kubeconfig:
        return config.new_client_from_config(config_file=kubeconfig)
    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        configuration = client.Configuration()
        config.load_incluster_config(client_configuration=configuration)
        return client.ApiClient(configuration)
    return None


class KubeClient:
    """PodSource and NodeClient over the official kubernetes client's ApiClient (its connection pool, TLS, auth and
    timeouts), as raw JSON requests in and out. Not through the generated `CoreV1Api`: its import builds the
    models of all of core/v1 (251 modules, ~21 MiB of a device plugin's ~80 MiB on every GPU node), which raw JSON
    never needs."""

    def __init__(self, api_client: Any, *, component: str = "kube-vgpu-device-plugin", host: str = "") -> None:
        self.api_client = api_client
        self.component = component
        self.host = host

    def _call(self, what: str, method: str, path: str, path_params: dict[str, str], *,
              query: list[tuple[str, str]] | None = None, body: dict[str, Any] | None = None,
              content_type: str = "application/json") -> dict[str, Any]:
        headers = {"Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = content_type
        try:
            serialized = self.api_client.param_serialize(
                method, path, path_params=path_params, query_params=query or [], header_params=headers, body=body,
                auth_settings=["BearerToken"])
            response = self.api_client.call_api(*serialized, _request_timeout=REQUEST_TIMEOUT_SECONDS)
            response.read()
        except Exception as exc:  # urllib3 connection errors and the like
            raise ApiUnavailable(f"{what}: {exc}") from None
        if response.status == 409:
            raise Conflict(f"{what}: {response.reason}")
        if response.status == 404:
            raise NotFound(f"{what}: not found")
        if not 200 <= response.status <= 299:
            raise ApiUnavailable(f"{what}: HTTP {response.status} {response.reason}")
        result: dict[str, Any] = orjson.loads(response.data)
        return result

    def list_node_pods(self, node_name: str) -> list[dict[str, Any]]:
        doc = self._call(f"list pods on node {node_name}", "GET", "/api/v1/pods", {},
                         query=[("fieldSelector", f"spec.nodeName={node_name}")])
        items: list[dict[str, Any]] = doc.get("items") or []
        return items

    def patch_pod_annotations(
        self, namespace: str, name: str, resource_version: str, annotations: dict[str, str | None]
    ) -> dict[str, Any]:
        # metadata.resourceVersion in a merge patch is a precondition: the API server answers 409 if it moved on
        body = {"metadata": {"resourceVersion": resource_version, "annotations": annotations}}
        return self._call(f"patch pod {namespace}/{name}", "PATCH", "/api/v1/namespaces/{namespace}/pods/{name}",
                          {"namespace": namespace, "name": name}, body=body, content_type=MERGE_PATCH)

    def record_event(self, involved: dict[str, Any], reason: str, message: str, *, warning: bool = True) -> None:
        metadata = involved.get("metadata") or {}
        namespace = metadata.get("namespace") or "default"
        now = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        involved_object = {
            "apiVersion": involved.get("apiVersion", "v1"),
            "kind": involved.get("kind", "Pod"),
            "name": metadata.get("name"),
            "namespace": metadata.get("namespace"),
            "uid": metadata.get("uid"),
            "resourceVersion": metadata.get("resourceVersion"),
        }
        source = {"component": self.component, **({"host": self.host} if self.host else {})}
        event = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": f"{metadata.get('name', 'object')}.", "namespace": namespace},
            # (as the generated model wrote it: fields without a value left out)
            "involvedObject": {key: value for key, value in involved_object.items() if value is not None},
            "reason": reason,
            "message": message[:1024],
            "type": "Warning" if warning else "Normal",
            "source": source,
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        try:
            self._call(f"create event {reason}", "POST", "/api/v1/namespaces/{namespace}/events",
                       {"namespace": namespace}, body=event)
        except (ApiUnavailable, Conflict, NotFound) as exc:
            log.warning("could not record event %s (%s): %s", reason, message, exc)

    def get_node(self, name: str) -> dict[str, Any]:
        return self._call(f"read node {name}", "GET", "/api/v1/nodes/{name}", {"name": name})

    def patch_node_metadata(self, name: str, annotations: dict[str, str], labels: dict[str, str | None]) -> None:
        metadata: dict[str, Any] = {}
        if annotations:
            metadata["annotations"] = annotations
        if labels:
            metadata["labels"] = labels
        if metadata:
            self._call(f"patch node {name}", "PATCH", "/api/v1/nodes/{name}", {"name": name},
                       body={"metadata": metadata}, content_type=MERGE_PATCH)
