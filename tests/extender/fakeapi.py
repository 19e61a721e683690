"""A stand-in API server speaking the real wire protocol over real HTTP, for the unit tier: lists (paged with
limit/continue), watch streams (newline-delimited events, bookmarks when asked for, ended after timeoutSeconds),
pod reads and Bindings, as kube-apiserver serves them to the kubernetes client. Faults on the path come from
tests/faultproxy.py in front of it; the e2e tier uses the real kube-apiserver instead.
"""

from __future__ import annotations

import asyncio
import copy
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import orjson
import yaml
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from tests.servers import serve


def _status(code: int, reason: str, message: str) -> Response:
    body = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": code, "reason": reason,
            "message": message}
    return Response(orjson.dumps(body), status_code=code, media_type="application/json")


class FakeApiServer:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.version = 1
        #: plural -> key -> object
        self.objects: dict[str, dict[str, dict[str, Any]]] = {"nodes": {}, "pods": {}, "namespaces": {}}
        #: plural -> (resourceVersion, event) in order
        self.events: dict[str, list[tuple[int, dict[str, Any]]]] = {plural: [] for plural in self.objects}
        #: pod names whose reads answer 200 and then trickle a space every 0.1 s, never finishing
        self.trickle: set[str] = set()
        #: pod name -> HTTP status its Binding is answered with (instead of binding it)
        self.binding_status: dict[str, int] = {}
        self.bindings: list[tuple[str, str]] = []  # (pod name, node) bound
        self.stop = threading.Event()
        self.app = FastAPI()
        self.app.add_api_route("/api/v1/{plural}", self.collection, methods=["GET"])
        self.app.add_api_route("/api/v1/namespaces/{namespace}/pods/{name}", self.read_pod, methods=["GET"])
        self.app.add_api_route("/api/v1/namespaces/{namespace}/pods/{name}/binding", self.bind, methods=["POST"])

    # --- changing the cluster -----------------------------------------------------------------------
    @staticmethod
    def key(obj: dict[str, Any]) -> str:
        metadata = obj["metadata"]
        return f"{metadata.get('namespace', '')}/{metadata['name']}"

    def put(self, plural: str, obj: dict[str, Any]) -> None:
        """Create or update an object (ADDED / MODIFIED event)."""
        with self.lock:
            self.version += 1
            stored = copy.deepcopy(obj)
            stored["metadata"]["resourceVersion"] = str(self.version)
            kind = "MODIFIED" if self.key(stored) in self.objects[plural] else "ADDED"
            self.objects[plural][self.key(stored)] = stored
            self.events[plural].append((self.version, {"type": kind, "object": copy.deepcopy(stored)}))

    def delete(self, plural: str, obj: dict[str, Any]) -> None:
        with self.lock:
            self.version += 1
            stored = self.objects[plural].pop(self.key(obj))
            stored["metadata"]["resourceVersion"] = str(self.version)
            self.events[plural].append((self.version, {"type": "DELETED", "object": stored}))

    # --- serving ------------------------------------------------------------------------------------
    #: lists hand out copies, so a test changing a listed object changes nothing here; False where objects are
    #: only ever replaced, never changed in place (bench/extender_latency.py's 40,000 pods)
    copy_lists = True

    async def collection(self, plural: str, request: Request) -> Response:
        if plural not in self.objects:
            return _status(404, "NotFound", f"the server could not find the requested resource ({plural})")
        query = request.query_params
        if query.get("watch") in ("true", "1", "True"):
            since = int(query.get("resourceVersion") or 0)
            timeout_s = float(query.get("timeoutSeconds") or 1800)
            bookmarks = query.get("allowWatchBookmarks") in ("true", "1", "True")
            return StreamingResponse(self._stream(plural, since, timeout_s, bookmarks), media_type="application/json")
        limit = int(query.get("limit") or 0)
        start = int(query.get("continue") or 0)
        with self.lock:
            objects = self.objects[plural].values()
            items = [copy.deepcopy(o) for o in objects] if self.copy_lists else list(objects)
            version = self.version
        page = items[start:start + limit] if limit else items[start:]
        more = bool(limit) and start + limit < len(items)
        doc = {"kind": "List", "apiVersion": "v1",
               "metadata": {"resourceVersion": str(version), **({"continue": str(start + limit)} if more else {})},
               "items": page}
        return Response(orjson.dumps(doc), media_type="application/json")

    async def _stream(self, plural: str, since: int, timeout_s: float, bookmarks: bool) -> AsyncIterator[bytes]:
        loop = asyncio.get_running_loop()
        ends = loop.time() + timeout_s
        sent = since
        while not self.stop.is_set() and loop.time() < ends:
            with self.lock:
                pending = [(v, e) for v, e in self.events[plural] if v > sent]
                version = self.version
            for v, event in pending:
                yield orjson.dumps(event) + b"\n"
                sent = v
            if bookmarks and not pending and version > sent:
                bookmark = {"type": "BOOKMARK", "object": {"kind": "Node" if plural == "nodes" else "Pod",
                                                            "metadata": {"resourceVersion": str(version)}}}
                yield orjson.dumps(bookmark) + b"\n"
                sent = version
            await asyncio.sleep(0.02)

    async def read_pod(self, namespace: str, name: str) -> Response:
        if name in self.trickle:
            return StreamingResponse(self._trickle(), media_type="application/json")
        with self.lock:
            pod = self.objects["pods"].get(f"{namespace}/{name}")
        if pod is None:
            return _status(404, "NotFound", f'pods "{name}" not found')
        return Response(orjson.dumps(pod), media_type="application/json")

    async def _trickle(self) -> AsyncIterator[bytes]:
        while not self.stop.is_set():
            yield b" "  # JSON allows leading whitespace: the answer is never malformed, only never done
            await asyncio.sleep(0.1)

    async def bind(self, namespace: str, name: str, request: Request) -> Response:
        body = orjson.loads(await request.body())
        status = self.binding_status.get(name)
        if status is not None:
            return _status(status, "InternalError", f"binding {name} refused by the test")
        with self.lock:
            pod = self.objects["pods"].get(f"{namespace}/{name}")
        if pod is None:
            return _status(404, "NotFound", f'pods "{name}" not found')
        if pod["metadata"].get("uid") != body["metadata"].get("uid"):
            return _status(409, "Conflict", "Precondition failed: UID mismatch")
        if pod["spec"].get("nodeName"):
            return _status(409, "Conflict", f"pod {name} is already assigned to node {pod['spec']['nodeName']}")
        updated = copy.deepcopy(pod)
        updated["metadata"].setdefault("annotations", {}).update(body["metadata"].get("annotations") or {})
        updated["spec"]["nodeName"] = body["target"]["name"]
        self.put("pods", updated)
        self.bindings.append((name, body["target"]["name"]))
        return Response(orjson.dumps({"kind": "Status", "status": "Success", "code": 201}), status_code=201,
                        media_type="application/json")


@contextmanager
def running(server: FakeApiServer) -> Iterator[str]:
    """Serve it on a loopback port; yields its URL. Watches end when the block ends."""
    with serve(server.app) as url:
        try:
            yield url
        finally:
            server.stop.set()


def write_kubeconfig(path: Path, server_url: str, token: str = "test-token") -> Path:
    """A token kubeconfig for `server_url` (plain HTTP), as make_api_client reads one."""
    document = {
        "apiVersion": "v1", "kind": "Config", "current-context": "test",
        "clusters": [{"name": "test", "cluster": {"server": server_url}}],
        "users": [{"name": "test", "user": {"token": token}}],
        "contexts": [{"name": "test", "context": {"cluster": "test", "user": "test"}}],
    }
    path.write_text(yaml.safe_dump(document))
    return path
