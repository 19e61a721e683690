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
    """PodSource and NodeClient over the official kubernetes client (raw JSON in and out, no model classes)."""

    def __init__(self, api_client: Any, *, component: str = "kube-vgpu-device-plugin", host: str = "") -> None:
        from kubernetes import client

        self._client = client
        self.core = client.CoreV1Api(api_client)
        self.component = component
        self.host = host

    def _call(self, what: str, method: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        from kubernetes.client.exceptions import ApiException

        try:
            response = method(*args, _preload_content=False, _request_timeout=REQUEST_TIMEOUT_SECONDS, **kwargs)
        except ApiException as exc:
            if exc.status == 409:
                raise Conflict(f"{what}: {exc.reason}") from None
            if exc.status == 404:
                raise NotFound(f"{what}: not found") from None
            raise ApiUnavailable(f"{what}: HTTP {exc.status} {exc.reason}") from None
        except Exception as exc:  # urllib3 connection errors and the like
            raise ApiUnavailable(f"{what}: {exc}") from None
        result: dict[str, Any] = orjson.loads(response.data)
        return result

    def list_node_pods(self, node_name: str) -> list[dict[str, Any]]:
        doc = self._call(
            f"list pods on node {node_name}",
            self.core.list_pod_for_all_namespaces,
            field_selector=f"spec.nodeName={node_name}",
        )
        items: list[dict[str, Any]] = doc.get("items") or []
        return items

    def patch_pod_annotations(
        self, namespace: str, name: str, resource_version: str, annotations: dict[str, str | None]
    ) -> dict[str, Any]:
        # metadata.resourceVersion in a merge patch is a precondition: the API server answers 409 if it moved on
        body = {"metadata": {"resourceVersion": resource_version, "annotations": annotations}}
        return self._call(
            f"patch pod {namespace}/{name}",
            self.core.patch_namespaced_pod,
            name,
            namespace,
            body,
            _content_type=MERGE_PATCH,
        )

    def record_event(self, involved: dict[str, Any], reason: str, message: str, *, warning: bool = True) -> None:
        metadata = involved.get("metadata") or {}
        namespace = metadata.get("namespace") or "default"
        now = dt.datetime.now(dt.UTC)
        event = self._client.CoreV1Event(
            metadata=self._client.V1ObjectMeta(generate_name=f"{metadata.get('name', 'object')}.", namespace=namespace),
            involved_object=self._client.V1ObjectReference(
                api_version=involved.get("apiVersion", "v1"),
                kind=involved.get("kind", "Pod"),
                name=metadata.get("name"),
                namespace=metadata.get("namespace"),
                uid=metadata.get("uid"),
                resource_version=metadata.get("resourceVersion"),
            ),
            reason=reason,
            message=message[:1024],
            type="Warning" if warning else "Normal",
            source=self._client.V1EventSource(component=self.component, host=self.host or None),
            first_timestamp=now,
            last_timestamp=now,
            count=1,
        )
        try:
            self._call(f"create event {reason}", self.core.create_namespaced_event, namespace, event)
        except (ApiUnavailable, Conflict, NotFound) as exc:
            log.warning("could not record event %s (%s): %s", reason, message, exc)

    def get_node(self, name: str) -> dict[str, Any]:
        return self._call(f"read node {name}", self.core.read_node, name)

    def patch_node_metadata(self, name: str, annotations: dict[str, str], labels: dict[str, str | None]) -> None:
        metadata: dict[str, Any] = {}
        if annotations:
            metadata["annotations"] = annotations
        if labels:
            metadata["labels"] = labels
        if metadata:
            self._call(
                f"patch node {name}", self.core.patch_node, name, {"metadata": metadata}, _content_type=MERGE_PATCH
            )
