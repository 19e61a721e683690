"""The leader Lease, watched for the fence (extender/fence.py): list it, watch it, hand every version to the fence.

Failures keep the fence's last view: a Lease we cannot read is not evidence that our term goes on, but the fence's
time check already ends a term that is not renewed (renewals are what the watch delivers), so a dead watch can only
make binds stop, never let a deposed leader write.
"""

from __future__ import annotations

import functools
import logging
import threading
from typing import Any

from kubernetes import client

from kube_vgpu.extender.fence import LeaderFence
from kube_vgpu.extender.sources.apiclient import DEFAULT_TIMEOUTS, ApiTimeouts
from kube_vgpu.extender.sources.watch import list_all, watch_events

log = logging.getLogger(__name__)

RETRY_S = 1.0


class LeaseWatcher:
    def __init__(
        self,
        fence: LeaderFence,
        api_client: client.ApiClient,
        namespace: str,
        name: str,
        *,
        timeouts: ApiTimeouts = DEFAULT_TIMEOUTS,
    ) -> None:
        self.fence = fence
        self.namespace, self.name = namespace, name
        coordination = client.CoordinationV1Api(api_client)
        self._list_call = functools.partial(
            coordination.list_namespaced_lease, namespace, field_selector=f"metadata.name={name}"
        )
        self.timeouts = timeouts
        self.stop_event = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="watch-lease", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self.stop_event.set()

    def _run(self) -> None:
        resource_version = ""
        while not self.stop_event.is_set():
            try:
                if not resource_version:
                    items, resource_version = list_all(self._list_call, timeouts=self.timeouts)
                    self.fence.observe(items[0] if items else None)
                for event in watch_events(self._list_call, resource_version, self.stop_event, timeouts=self.timeouts):
                    self._apply(event)
                    version = (event.get("object") or {}).get("metadata", {}).get("resourceVersion")
                    if isinstance(version, str) and version:
                        resource_version = version
            except Exception as exc:  # any failure: relist after a pause (a 410 included)
                log.warning("lease %s/%s watch failed (%r); relisting in %.0f s", self.namespace, self.name, exc,
                            RETRY_S)
                resource_version = ""
                self.stop_event.wait(RETRY_S)

    def _apply(self, event: dict[str, Any]) -> None:
        kind, obj = event.get("type"), event.get("object")
        if kind == "ERROR":
            raise RuntimeError(f"watch error: {obj}")
        if not isinstance(obj, dict):
            return
        if kind in ("ADDED", "MODIFIED"):
            self.fence.observe(obj)
        elif kind == "DELETED":
            self.fence.observe(None)
