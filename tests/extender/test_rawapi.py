"""The extender's raw core reads (extender/sources/rawapi.py) send what the generated client's methods send, answer
as they do with _preload_content=False, and keep the generated core/v1 models out of the extender's process. Real
HTTP: a recording ASGI app on a loopback port, reached through make_api_client from a token kubeconfig."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl

import orjson
import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException

from kube_vgpu.extender.sources.apiclient import make_api_client, read_body
from kube_vgpu.extender.sources.rawapi import RawApi
from tests.extender.fakeapi import write_kubeconfig
from tests.servers import serve

ROOT = Path(__file__).resolve().parents[2]


class Recorder:
    """Answers every GET with a small list (404 for paths under /missing), recording method, path, query and the
    headers that matter."""

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        headers = {key.decode().lower(): value.decode() for key, value in scope["headers"]}
        self.requests.append({"method": scope["method"], "path": scope["path"],
                              "query": sorted(parse_qsl(scope["query_string"].decode(), keep_blank_values=True)),
                              "authorization": headers.get("authorization"), "accept": headers.get("accept")})
        missing = "/missing" in scope["path"] or scope["path"].endswith("/pods/gone")
        status = 404 if missing else 200
        body = orjson.dumps({"kind": "Status", "code": 404, "reason": "NotFound"} if missing else
                            {"kind": "List", "metadata": {"resourceVersion": "7"}, "items": [{"n": 1}]})
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


@pytest.fixture()
def recorded(tmp_path: Path) -> Iterator[tuple[Recorder, client.ApiClient]]:
    recorder = Recorder()
    with serve(recorder) as url:
        api_client = make_api_client(str(write_kubeconfig(tmp_path / "kubeconfig", url, token="secret-token")))
        yield recorder, api_client
        api_client.close()


CALLS: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = [
    ("list_node", (), {"limit": 500, "_continue": "abc=="}),
    ("list_node", (), {"watch": True, "resource_version": "42", "allow_watch_bookmarks": True,
                       "timeout_seconds": 300}),
    ("list_pod_for_all_namespaces", (), {"limit": 500, "field_selector": "spec.nodeName=n1",
                                         "label_selector": "a=b,c in (d)"}),
    ("list_namespace", (), {"limit": 10}),
    ("read_namespaced_pod", ("p-1", "team-a"), {}),
]


@pytest.mark.parametrize(("method", "args", "options"), CALLS, ids=[call[0] for call in CALLS])
def test_a_raw_read_sends_what_the_generated_method_sends(
    recorded: tuple[Recorder, client.ApiClient], method: str, args: tuple[Any, ...], options: dict[str, Any]
) -> None:
    recorder, api_client = recorded
    generated = getattr(client.CoreV1Api(api_client), method)(*args, _preload_content=False, _request_timeout=5,
                                                             **options)
    raw = getattr(RawApi(api_client), method)(*args, _preload_content=False, _request_timeout=5, **options)
    deadline = time.monotonic() + 30
    assert read_body(raw, deadline, "raw") == read_body(generated, deadline, "generated")
    sent_by_generated, sent_raw = recorder.requests
    assert sent_raw == sent_by_generated
    assert sent_raw["authorization"] == "Bearer secret-token"


def test_a_mutating_webhook_configuration_list_sends_what_the_generated_method_sends(
    recorded: tuple[Recorder, client.ApiClient],
) -> None:
    recorder, api_client = recorded
    client.AdmissionregistrationV1Api(api_client).list_mutating_webhook_configuration(_preload_content=False)
    RawApi(api_client).list_mutating_webhook_configuration(_preload_content=False)
    assert recorder.requests[0] == recorder.requests[1]
    assert recorder.requests[1]["path"] == "/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations"


def test_a_status_outside_2xx_raises_api_exception_as_the_generated_method_does(
    recorded: tuple[Recorder, client.ApiClient],
) -> None:
    _, api_client = recorded
    with pytest.raises(ApiException) as generated:
        client.CoreV1Api(api_client).read_namespaced_pod("gone", "team-a", _preload_content=False)
    with pytest.raises(ApiException) as raw:
        RawApi(api_client).read_namespaced_pod("gone", "team-a", _preload_content=False)
    assert raw.value.status == generated.value.status == 404
    assert raw.value.body == generated.value.body and "NotFound" in str(raw.value.body)


def test_an_option_it_does_not_pass_on_is_refused_not_dropped(recorded: tuple[Recorder, client.ApiClient]) -> None:
    recorder, api_client = recorded
    with pytest.raises(TypeError, match="unsupported option 'pretty'"):
        RawApi(api_client).list_node(pretty="true", _preload_content=False)
    with pytest.raises(ValueError, match="_preload_content=False"):
        RawApi(api_client).list_node()
    assert recorder.requests == []


def test_the_extenders_live_parts_leave_the_generated_core_models_unimported(tmp_path: Path) -> None:
    """What the memory is for: the live source, binder and Kueue watcher built as the extender builds them import no
    generated core/v1 API or model (a fresh interpreter: this one's tests import them)."""
    kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", "http://127.0.0.1:9")
    script = f"""
import sys
from kube_vgpu.extender.sources.apiclient import make_api_client
from kube_vgpu.extender.sources.live import LiveBinder, LiveSource
from kube_vgpu.extender.state import ClusterState
api_client = make_api_client({str(kubeconfig)!r})
LiveSource(ClusterState(), api_client)
LiveBinder(api_client)
prefixes = ("kubernetes.client.api.core_v1", "kubernetes.client.models.v1_pod", "kubernetes.client.models.v1_node")
loaded = sorted(m for m in sys.modules if m.startswith(prefixes))
print(loaded)
"""
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
