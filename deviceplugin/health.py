"""GPU health: XID critical-error events from NVML, and a poll that notices lost GPUs.

A critical XID marks the GPU unhealthy in DeviceState, which wakes ListAndWatch (kubelet stops admitting pods to
it at once) and the publisher (the inventory says healthy=false at the next heartbeat at the latest, in practice
immediately). Application-level XIDs are caused by the workload, not the GPU, and are ignored.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from kube_vgpu.deviceplugin import nvml as nv
from kube_vgpu.deviceplugin.nvml import Nvml
from kube_vgpu.deviceplugin.state import DeviceState

log = logging.getLogger(__name__)

#: XIDs caused by the application (not the hardware): 13 graphics engine exception, 31 GPU memory page fault,
#: 43 GPU stopped processing, 45 preemptive cleanup, 68 video decoder exception, 109 context switch timeout.
APPLICATION_XIDS = frozenset({13, 31, 43, 45, 68, 109})


class HealthMonitor:
    """One thread: waits for NVML events (bounded waits, so it can stop) and polls for lost GPUs."""

    def __init__(
        self,
        nvml: Nvml,
        state: DeviceState,
        handles: dict[str, Any],
        *,
        poll_seconds: float = 5.0,
        event_wait_ms: int = 1000,
        ignored_xids: frozenset[int] = APPLICATION_XIDS,
    ) -> None:
        self.nvml = nvml
        self.state = state
        self.handles = dict(handles)
        self.poll_seconds = poll_seconds
        self.event_wait_ms = event_wait_ms
        self.ignored_xids = ignored_xids
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._event_set: Any = None
        self._uuid_by_handle = {nvml.handle_key(handle): uuid for uuid, handle in self.handles.items()}
        #: (GPU UUID, "" when NVML could not say, XID) -> events seen since start, ignored ones included (metrics)
        self._xid_counts: dict[tuple[str, int], int] = {}
        self._counts_lock = threading.Lock()
        #: set once the event set is registered; tests wait for it before injecting events
        self.ready = threading.Event()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="gpu-health", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _register(self) -> None:
        if not self.handles:
            return
        try:
            self._event_set = self.nvml.event_set_create()
        except nv.NVMLError as exc:
            log.warning("NVML event sets unavailable (%s): XID errors will not be seen; lost GPUs still are", exc)
            return
        for uuid, handle in self.handles.items():
            if not self.state.is_healthy(uuid):
                continue
            try:
                self.nvml.register_events(handle, nv.EVENT_XID_CRITICAL_ERROR, self._event_set)
            except nv.GpuIsLost:
                self.state.mark_unhealthy(uuid, "GPU is lost (NVML)")
            except nv.NVMLError as exc:
                log.warning("GPU %s: XID events not supported (%s); only loss of the GPU is detected", uuid, exc)

    def _run(self) -> None:
        self._register()
        self.ready.set()
        next_poll = time.monotonic()
        while not self._stop.is_set():
            if time.monotonic() >= next_poll:
                self.poll_lost()
                next_poll = time.monotonic() + self.poll_seconds
            if self._event_set is None:
                self._stop.wait(self.poll_seconds)
                continue
            try:
                event = self.nvml.event_wait(self._event_set, self.event_wait_ms)
            except nv.Timeout:
                continue
            except nv.NVMLError as exc:
                log.warning("waiting for NVML events failed (%s); retrying", exc)
                self._stop.wait(self.event_wait_ms / 1000)
                continue
            self.handle_event(event)
        if self._event_set is not None:
            try:
                self.nvml.event_set_free(self._event_set)
            except nv.NVMLError:
                pass

    def handle_event(self, event: Any) -> None:
        if not int(event.eventType) & nv.EVENT_XID_CRITICAL_ERROR:
            return
        xid = int(event.eventData)
        uuid = self._uuid_by_handle.get(self.nvml.handle_key(event.device))
        with self._counts_lock:
            key = (uuid or "", xid)
            self._xid_counts[key] = self._xid_counts.get(key, 0) + 1
        if xid in self.ignored_xids:
            log.info("ignoring application-level XID %d", xid)
            return
        if uuid is None:
            # NVML could not say which GPU: like NVIDIA's plugin, distrust all of them rather than none
            log.error("critical XID %d from an unidentified GPU: marking every GPU unhealthy", xid)
            for each in self.handles:
                self.state.mark_unhealthy(each, f"critical XID {xid} (GPU unidentified)")
            return
        self.state.mark_unhealthy(uuid, f"critical XID {xid}")

    def xid_counts(self) -> dict[tuple[str, int], int]:
        """(GPU UUID or "" for an unidentified GPU, XID) -> XID events seen since the monitor started."""
        with self._counts_lock:
            return dict(self._xid_counts)

    def poll_lost(self) -> None:
        for uuid, handle in self.handles.items():
            if not self.state.is_healthy(uuid):
                continue
            try:
                self.nvml.memory_total_mib(handle)
            except nv.GpuIsLost:
                self.state.mark_unhealthy(uuid, "GPU is lost (NVML)")
            except nv.NVMLError:
                pass  # any other answer means the GPU still talks
