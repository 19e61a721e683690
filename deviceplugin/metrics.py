"""The device plugin's `/metrics`: what each GPU of the node really does (NVML) and what each container really uses
(the limiter's shared regions, deviceplugin/sharedregion.py), read at scrape time.

Names follow Prometheus' conventions: base units in the name (`_bytes`, `_celsius`, `_watts`, `_ratio` for 0..1),
counters end in `_total` (prometheus_client adds it). GPU series carry the labels the extender's allocation gauges
carry (`node`, `gpu`, `uuid`, `model`), so "allocated" and "used" join on them; container series carry `node`,
`pod_uid`, `container` and `uuid` (one series per GPU a container holds). A value NVML cannot give for a GPU
(NotSupported on that board, the GPU lost) is left out of that scrape and logged once per GPU and query.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kube_vgpu import protocol
from kube_vgpu.deviceplugin import nvml as nv
from kube_vgpu.deviceplugin.nvml import Nvml
from kube_vgpu.deviceplugin.sharedregion import ContainerUsage, Skipped, scan_cache_dir, scan_kubelet_pods
from kube_vgpu.deviceplugin.state import DeviceState

log = logging.getLogger(__name__)

T = TypeVar("T")
GPU_LABELS = ["node", "gpu", "uuid", "model"]
CONTAINER_LABELS = ["node", "pod_uid", "container", "uuid"]


class DevicePluginCollector(Collector):
    def __init__(
        self,
        node_name: str,
        nvml: Nvml,
        handles: dict[str, Any],
        state: DeviceState,
        *,
        xid_counts: Callable[[], dict[tuple[str, int], int]] | None = None,
        cache_dir: Path | None = None,
        kubelet_pods_dir: Path | None = None,
    ) -> None:
        self.node_name = node_name
        self.nvml = nvml
        self.handles = dict(handles)
        self.state = state
        self.xid_counts = xid_counts
        self.cache_dir = cache_dir
        self.kubelet_pods_dir = kubelet_pods_dir
        self._lock = threading.Lock()
        self._unavailable_logged: set[tuple[str, str]] = set()
        #: region file -> the reason it was skipped, as last logged (logged again only when the reason changes)
        self._skip_logged: dict[str, str] = {}

    # --- NVML, per GPU ---

    def _query(self, uuid: str, what: str, call: Callable[..., T], *args: Any, **kwargs: Any) -> T | None:
        try:
            return call(*args, **kwargs)
        except nv.NVMLError as exc:
            with self._lock:
                first = (uuid, what) not in self._unavailable_logged
                self._unavailable_logged.add((uuid, what))
            if first:
                log.warning("GPU %s: %s not available from NVML (%s); left out of /metrics", uuid, what, exc)
            return None

    def collect(self) -> Iterator[Metric]:
        yield from self._gpu_families()
        yield from self._container_families()

    def _gpu_families(self) -> Iterator[Metric]:
        def gauge(name: str, text: str) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, text, labels=GPU_LABELS)

        utilization = gauge("kube_vgpu_gpu_utilization_ratio",
                            "fraction of the last sample period during which a kernel ran on the GPU (NVML)")
        memory_utilization = gauge("kube_vgpu_gpu_memory_utilization_ratio",
                                   "fraction of the last sample period during which GPU memory was read or written")
        used = gauge("kube_vgpu_gpu_memory_used_bytes", "GPU memory in use, by any process (NVML)")
        total = gauge("kube_vgpu_gpu_memory_total_bytes", "GPU memory (NVML)")
        temperature = gauge("kube_vgpu_gpu_temperature_celsius", "GPU core temperature")
        power = gauge("kube_vgpu_gpu_power_watts", "GPU power draw")
        ecc = CounterMetricFamily("kube_vgpu_gpu_ecc_errors",
                                  "GPU memory ECC errors since the driver loaded, by type (corrected, uncorrected)",
                                  labels=[*GPU_LABELS, "type"])
        xids = CounterMetricFamily("kube_vgpu_gpu_xid_errors",
                                   "XID error events since the device plugin started, by XID (application-level "
                                   "ones included; uuid and gpu empty when NVML did not say which GPU)",
                                   labels=[*GPU_LABELS, "xid"])
        by_uuid: dict[str, list[str]] = {}
        for gpu in self.state.gpus():
            values = [self.node_name, str(gpu.index), gpu.uuid, gpu.model]
            by_uuid[gpu.uuid] = values
            handle = self.handles.get(gpu.uuid)
            if handle is None:  # lost at discovery: nothing to ask
                continue
            rates = self._query(gpu.uuid, "utilisation", self.nvml.utilization_percent, handle)
            if rates is not None:
                utilization.add_metric(values, rates[0] / 100)
                memory_utilization.add_metric(values, rates[1] / 100)
            memory = self._query(gpu.uuid, "memory", self.nvml.memory_bytes, handle)
            if memory is not None:
                used.add_metric(values, memory[0])
                total.add_metric(values, memory[1])
            celsius = self._query(gpu.uuid, "temperature", self.nvml.temperature_celsius, handle)
            if celsius is not None:
                temperature.add_metric(values, celsius)
            milliwatts = self._query(gpu.uuid, "power", self.nvml.power_milliwatts, handle)
            if milliwatts is not None:
                power.add_metric(values, milliwatts / 1000)
            for kind, corrected in (("corrected", True), ("uncorrected", False)):
                count = self._query(gpu.uuid, f"{kind} ECC errors", self.nvml.ecc_errors, handle, corrected=corrected)
                if count is not None:
                    ecc.add_metric([*values, kind], count)
        if self.xid_counts is not None:
            for (uuid, xid), count in sorted(self.xid_counts().items()):
                values = by_uuid.get(uuid, [self.node_name, "", uuid, ""])
                xids.add_metric([*values, str(xid)], count)
        yield from (utilization, memory_utilization, used, total, temperature, power, ecc, xids)

    # --- shared regions, per container ---

    def _log_skips(self, skipped: list[Skipped]) -> None:
        now = {item.path: item.reason for item in skipped}
        with self._lock:
            for path, reason in now.items():
                if self._skip_logged.get(path) != reason:
                    log.warning("limiter shared region %s skipped: %s", path, reason)
            self._skip_logged = now

    def _container_families(self) -> Iterator[Metric]:
        if self.cache_dir is None and self.kubelet_pods_dir is None:
            return
        found: list[ContainerUsage] = []
        skipped: list[Skipped] = []
        if self.kubelet_pods_dir is not None:
            more, less = scan_kubelet_pods(self.kubelet_pods_dir, protocol.LIMITER_CACHE_VOLUME)
            found += more
            skipped += less
        if self.cache_dir is not None:
            more, less = scan_cache_dir(self.cache_dir)
            found += more
            skipped += less
        self._log_skips(skipped)

        def gauge(name: str, text: str, labels: list[str] = CONTAINER_LABELS) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, text, labels=labels)

        used = gauge("kube_vgpu_container_gpu_memory_used_bytes",
                     "GPU memory the container's processes hold on the GPU, as the limiter counts it")
        limit = gauge("kube_vgpu_container_gpu_memory_limit_bytes", "the limiter's memory limit (0: none)")
        utilization = gauge("kube_vgpu_container_gpu_utilization_ratio",
                            "the container's share of the GPU's SM time (the limiter's samples, summed over its "
                            "processes; 1 = the whole GPU; 0 when the container has no compute limit: the limiter "
                            "samples only then)")
        core_limit = gauge("kube_vgpu_container_gpu_core_limit_ratio",
                           "the limiter's compute limit as a fraction of the GPU (0: none)")
        processes = gauge("kube_vgpu_container_gpu_processes", "CUDA processes registered in the container's region",
                          ["node", "pod_uid", "container"])
        regions = GaugeMetricFamily("kube_vgpu_shared_regions",
                                    "limiter shared-region files found at this scrape, by result (read, skipped: "
                                    "corrupt, foreign or unreadable; the log says why)",
                                    labels=["node", "result"])
        for usage in found:
            processes.add_metric([self.node_name, usage.pod_uid, usage.container], usage.region.processes)
            for device in usage.region.devices:
                values = [self.node_name, usage.pod_uid, usage.container, device.uuid]
                used.add_metric(values, device.memory_used_bytes)
                limit.add_metric(values, device.memory_limit_bytes)
                utilization.add_metric(values, device.sm_utilization_percent / 100)
                core_limit.add_metric(values, device.core_limit_percent / 100)
        regions.add_metric([self.node_name, "read"], len(found))
        regions.add_metric([self.node_name, "skipped"], len(skipped))
        yield from (used, limit, utilization, core_limit, processes, regions)
