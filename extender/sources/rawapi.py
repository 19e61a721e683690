"""The extender's reads of core Kubernetes objects as raw requests through the client's `ApiClient` (its connection
pool, TLS, auth and timeouts), not through the generated API classes.

Importing the generated `CoreV1Api` builds the models of all of core/v1 (251 modules, ~21 MiB of resident memory in
an extender whose whole budget at 5000 nodes and 40,000 pods is 250 MiB), and the extender never uses them: it reads
every object as raw JSON (watch.py) and writes its Bindings raw (live.py). The methods here take the generated
methods' names and options, so the list and watch machinery is unchanged, and behave as the generated ones do with
`_preload_content=False`: the undecoded urllib3 response, or ApiException for a status outside 2xx.
"""

from __future__ import annotations

from typing import Any

from kubernetes import client
from kubernetes.client.rest import ApiException

#: the generated methods' options this layer passes on, and their query parameter names
QUERY_PARAMETERS = {
    "limit": "limit",
    "_continue": "continue",
    "watch": "watch",
    "resource_version": "resourceVersion",
    "allow_watch_bookmarks": "allowWatchBookmarks",
    "timeout_seconds": "timeoutSeconds",
    "field_selector": "fieldSelector",
    "label_selector": "labelSelector",
}


class RawApi:
    """GETs of the few core objects the extender reads (nodes, pods, namespaces, MutatingWebhookConfigurations)."""

    def __init__(self, api_client: client.ApiClient) -> None:
        self.api_client = api_client

    def get(self, resource_path: str, path_params: dict[str, str] | None = None, **options: Any) -> Any:
        """GET resource_path with the generated methods' options (QUERY_PARAMETERS, `_request_timeout`, and
        `_preload_content`, which must be False: the caller reads the body); the raw response (urllib3's)."""
        request_timeout = options.pop("_request_timeout", None)
        if options.pop("_preload_content", True):
            raise ValueError("RawApi returns the raw response only: pass _preload_content=False")
        query: list[tuple[str, Any]] = []
        for option, value in options.items():
            name = QUERY_PARAMETERS.get(option)
            if name is None:
                raise TypeError(f"RawApi.get: unsupported option {option!r} (known: {', '.join(QUERY_PARAMETERS)})")
            if value is not None:
                query.append((name, value))
        method, url, headers, body, post_params = self.api_client.param_serialize(
            "GET",
            resource_path,
            path_params=path_params,
            query_params=query,
            header_params={"Accept": "application/json"},
            auth_settings=["BearerToken"],
        )
        response = self.api_client.call_api(method, url, headers, body, post_params, _request_timeout=request_timeout)
        if not 200 <= response.status <= 299:
            response.read()
            raise ApiException.from_response(http_resp=response, body=None, data=None)
        return response.response

    def list_node(self, **options: Any) -> Any:
        return self.get("/api/v1/nodes", **options)

    def list_pod_for_all_namespaces(self, **options: Any) -> Any:
        return self.get("/api/v1/pods", **options)

    def list_namespace(self, **options: Any) -> Any:
        return self.get("/api/v1/namespaces", **options)

    def read_namespaced_pod(self, name: str, namespace: str, **options: Any) -> Any:
        return self.get("/api/v1/namespaces/{namespace}/pods/{name}", {"namespace": namespace, "name": name},
                        **options)

    def list_mutating_webhook_configuration(self, **options: Any) -> Any:
        return self.get("/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations", **options)
