"""The device plugin process: discovery, health, kubelet gRPC, Allocate, publisher and probes wired together.

`DevicePluginApp` takes its collaborators as arguments (NVML or the fake, a cluster client or none), so the CLI
and the tests run the same object.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from kube_vgpu import protocol
from kube_vgpu.deviceplugin.allocate import Allocator, DeliveryConfig
from kube_vgpu.deviceplugin.discovery import Discovery, discover
from kube_vgpu.deviceplugin.dynmig import DynamicMig, DynamicMigConfig, gpus_from_node_label, mark_dynamic
from kube_vgpu.deviceplugin.foreign import DeviceHolders, ForeignPodMonitor
from kube_vgpu.deviceplugin.health import APPLICATION_XIDS, HealthMonitor
from kube_vgpu.deviceplugin.kube import ApiUnavailable, NodeClient, NotFound, PodSource
from kube_vgpu.deviceplugin.limiter_install import verified_name
from kube_vgpu.deviceplugin.metrics import DevicePluginCollector
from kube_vgpu.deviceplugin.nvml import Nvml, NVMLError
from kube_vgpu.deviceplugin.publisher import DEFAULT_HEARTBEAT_SECONDS, Publisher
from kube_vgpu.deviceplugin.server import (
    DEFAULT_KUBELET_DIR,
    DEFAULT_SOCKET_NAME,
    DevicePluginServicer,
    PluginServer,
    mig_socket_name,
)
from kube_vgpu.deviceplugin.state import DeviceState
from kube_vgpu.probes import ProbeServer, Reply, Route, serve_probes

log = logging.getLogger(__name__)


class Cluster(PodSource, NodeClient, Protocol):
    """What the plugin needs from the API server (KubeClient, InMemoryCluster)."""


@dataclass(frozen=True, slots=True)
class PluginConfig:
    node_name: str
    kubelet_dir: str = DEFAULT_KUBELET_DIR
    socket_name: str = DEFAULT_SOCKET_NAME
    sharing_count: int = protocol.DEFAULT_MAX_VGPUS_PER_GPU
    heartbeat_seconds: float = DEFAULT_HEARTBEAT_SECONDS
    #: how often kubelet's sockets are checked (restart detection) and registration retried
    kubelet_poll_seconds: float = 1.0
    #: lost-GPU poll; at most the heartbeat so a lost GPU is published within one heartbeat
    health_poll_seconds: float | None = None
    health_event_wait_ms: int = 1000
    ignored_xids: frozenset[int] = APPLICATION_XIDS
    sysfs_root: str = "/sys"
    delivery: DeliveryConfig = field(default_factory=DeliveryConfig)
    #: "host:port" for /healthz and /readyz ("" = no probe server)
    probe_address: str = ""
    #: "host:port" for /metrics ("" = none); the probe address itself serves /metrics beside the probes
    metrics_address: str = ""
    #: kubelet's pods directory, where the webhook's cache emptyDirs are read for container usage ("" = not read)
    kubelet_pods_dir: str = ""
    #: node label telling the webhook that the limiter is installed here ("" = the plugin leaves it alone)
    limiter_label: str = ""
    #: where `kube-vgpu limiter install` put the library; the label carries its version while it is intact
    limiter_dir: str = ""
    #: fake GPUs: the node stands for one with the limiter installed (protocol.LIMITER_LABEL_SIMULATED)
    limiter_simulated: bool = False
    #: dynamic MIG (issue 16 item 2): which GPUs the plugin partitions itself, with the profile allowlist per model
    #: (None = off)
    dynamic_mig: DynamicMigConfig | None = None


class DevicePluginApp:
    def __init__(
        self,
        config: PluginConfig,
        nvml: Nvml,
        cluster: Cluster | None = None,
        holders: DeviceHolders | None = None,
    ) -> None:
        self.config = config
        self.nvml = nvml
        self.cluster = cluster
        self.holders = holders
        self.stop_event = threading.Event()
        self._threads: list[threading.Thread] = []
        self._probe_server: ProbeServer | None = None
        self._metrics_server: ProbeServer | None = None
        self.discovery: Discovery = discover(
            nvml, sharing_count=config.sharing_count, sysfs_root=Path(config.sysfs_root)
        )
        self.dynamic_mig: DynamicMig | None = None
        dynamic_config = self._dynamic_mig_config(config.dynamic_mig)
        if dynamic_config is not None:
            self.discovery.inventory = mark_dynamic(self.discovery.inventory, dynamic_config, self._mig_capable())
        self.state = DeviceState(self.discovery.inventory)
        self.allocator = Allocator(config.node_name, cluster, self.state, config.delivery)
        if dynamic_config is not None and self.state.dynamic_gpus():
            self.dynamic_mig = DynamicMig(nvml, self.discovery.handles, self.state.dynamic_gpus(),
                                          self.state.set_dynamic_instances, dynamic_config.grace_seconds)
            self.allocator.dynamic = self.dynamic_mig
        self.servicer = DevicePluginServicer(self.state, self.allocator, self.stop_event)
        self.server = PluginServer(
            config.kubelet_dir, self.servicer, socket_name=config.socket_name, poll_seconds=config.kubelet_poll_seconds
        )
        #: static MIG: one more plugin per MIG profile found at discovery (nvidia.com/mig-<profile>)
        self.mig_servers = [
            PluginServer(
                config.kubelet_dir,
                DevicePluginServicer(self.state, self.allocator, self.stop_event, resource),
                socket_name=mig_socket_name(resource),
                resource_name=resource,
                poll_seconds=config.kubelet_poll_seconds,
            )
            for resource in self.state.mig_resources()
        ]
        poll = config.health_poll_seconds or config.heartbeat_seconds
        self.health = HealthMonitor(
            nvml,
            self.state,
            self.discovery.handles,
            poll_seconds=min(poll, config.heartbeat_seconds),
            event_wait_ms=config.health_event_wait_ms,
            ignored_xids=config.ignored_xids,
        )
        self.metrics_registry = CollectorRegistry()
        cache_dir = config.delivery.cache_host_dir
        self.metrics_collector = DevicePluginCollector(
            config.node_name,
            nvml,
            self.discovery.handles,
            self.state,
            xid_counts=self.health.xid_counts,
            cache_dir=Path(cache_dir) if cache_dir else None,
            kubelet_pods_dir=Path(config.kubelet_pods_dir) if config.kubelet_pods_dir else None,
        )
        self.metrics_registry.register(self.metrics_collector)
        self.publisher: Publisher | None = None
        self.foreign: ForeignPodMonitor | None = None
        if cluster is not None:
            self.foreign = ForeignPodMonitor(config.node_name, cluster, self.state, holders)
            self.publisher = Publisher(
                config.node_name,
                cluster,
                self.state,
                heartbeat_seconds=config.heartbeat_seconds,
                before_publish=[self.foreign.scan, self.reconcile_dynamic_mig],
                limiter_label=config.limiter_label,
                limiter_state=_limiter_state(config),
            )

    def _dynamic_mig_config(self, config: DynamicMigConfig | None) -> DynamicMigConfig | None:
        """The flags' dynamic MIG configuration, its GPUs taken from the node's label when the flags say so (read
        once, at start: a changed label takes effect when the plugin restarts)."""
        if config is None or not config.from_node_label:
            return config
        if self.cluster is None:
            log.warning("dynamic MIG by node label: no API server to read node %s from; dynamic MIG is off",
                        self.config.node_name)
            return None
        try:
            gpus = gpus_from_node_label(self.cluster.get_node(self.config.node_name))
        except (ApiUnavailable, NotFound, ValueError) as exc:
            log.warning("dynamic MIG by node label: %s; dynamic MIG is off", exc)
            return None
        if gpus is False:
            log.info("node %s has no %s label: dynamic MIG is off", self.config.node_name, protocol.LABEL_DYNAMIC_MIG)
            return None
        return dataclasses.replace(config, gpus=gpus, from_node_label=False)

    def _mig_capable(self) -> list[int]:
        """Indexes of the GPUs that answer NVML's MIG mode query (the others are NotSupported)."""
        capable = []
        for gpu in self.discovery.inventory.gpus:
            handle = self.discovery.handles.get(gpu.uuid)
            try:
                if handle is not None:
                    self.nvml.mig_enabled(handle)
                    capable.append(gpu.index)
            except NVMLError:
                continue
        return capable

    def reconcile_dynamic_mig(self) -> None:
        """Destroy the dynamic MIG instances no live pod names (each heartbeat, before publishing)."""
        if self.dynamic_mig is None or self.cluster is None:
            return
        cluster = self.cluster
        try:
            self.dynamic_mig.reconcile(lambda: cluster.list_node_pods(self.config.node_name), self.config.node_name)
        except ApiUnavailable as exc:  # nothing is destroyed without knowing which pods live
            log.warning("dynamic MIG reconcile skipped: %s", exc)

    def _thread(self, name: str, target: Any) -> None:
        thread = threading.Thread(target=target, args=(self.stop_event,), name=name, daemon=True)
        thread.start()
        self._threads.append(thread)

    def start(self) -> None:
        discovery = self.discovery
        log.info(
            "node %s: %d GPU(s), driver %s%s",
            self.config.node_name,
            len(discovery.inventory.gpus),
            discovery.driver_version or "unknown",
            "" if discovery.nvml_available else " (NVML unavailable)",
        )
        if self.publisher is None:
            # no API server: say once what would have been published, so a bare GPU machine can be checked
            log.info("inventory publishing is off (no kubeconfig, not in a cluster); inventory:")
            log.info("%s", protocol.encode_inventory(discovery.inventory))
        self.health.start()
        self._thread("kubelet-registration", self.server.run)
        for server in self.mig_servers:
            self._thread(f"kubelet-registration-{server.resource_name}", server.run)
        if self.publisher is not None:
            self._thread("inventory-publisher", self.publisher.run)
        if self.config.probe_address:
            self._start_probes(self.config.probe_address)
        if self.config.metrics_address and self.config.metrics_address != self.config.probe_address:
            host, port = split_address(self.config.metrics_address)
            self._metrics_server = serve_probes(host, port, {"/metrics": self.metrics_reply})
            log.info("metrics on http://%s/metrics", self.config.metrics_address)

    def ready(self) -> bool:
        """Registered with kubelet and, when publishing, the inventory is on the node."""
        registered = all(server.registered.is_set() for server in (self.server, *self.mig_servers))
        return registered and (self.publisher is None or self.publisher.published.is_set())

    def alive(self) -> bool:
        return all(thread.is_alive() for thread in self._threads)

    def stop(self) -> None:
        self.stop_event.set()
        self.state.wake_all()
        for thread in self._threads:
            thread.join(timeout=10)
        self.health.stop()
        for server in (self._probe_server, self._metrics_server):
            if server is not None:
                server.shutdown()
                server.server_close()
        if self.discovery.nvml_available:
            try:
                self.nvml.shutdown()
            except Exception as exc:  # shutting down; nothing left to protect
                log.debug("NVML shutdown: %s", exc)

    def metrics_reply(self) -> Reply:
        return 200, CONTENT_TYPE_LATEST, generate_latest(self.metrics_registry)

    def _start_probes(self, address: str) -> None:
        host, port = split_address(address)

        def check(ok: Callable[[], bool]) -> Route:
            return lambda: (200, "text/plain", b"ok\n") if ok() else (503, "text/plain", b"not ready\n")

        routes = {"/healthz": check(self.alive), "/readyz": check(self.ready)}
        if self.config.metrics_address == address:
            routes["/metrics"] = self.metrics_reply
        # bounded connections, threads and waits (kube_vgpu.probes)
        self._probe_server = serve_probes(host, port, routes)
        log.info("probes on http://%s (%s)", address, ", ".join(sorted(routes)))

    @property
    def probe_port(self) -> int | None:
        return None if self._probe_server is None else int(self._probe_server.server_address[1])

    @property
    def metrics_port(self) -> int | None:
        if self._metrics_server is not None:
            return int(self._metrics_server.server_address[1])
        return self.probe_port if self.config.metrics_address == self.config.probe_address else None


def split_address(address: str) -> tuple[str, int]:
    """"host:port" (host may be empty: every address) -> (host, port); ValueError says what is wrong."""
    host, separator, port = address.rpartition(":")
    if not separator or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"expected HOST:PORT or :PORT, got {address!r}")
    return host or "0.0.0.0", int(port)


def _limiter_state(config: PluginConfig) -> Callable[[], str | None] | None:
    """What the limiter label should say at each publish: the installed version while its library matches its
    checksum (hashing a few MiB every heartbeat is cheap, and catches a library replaced or damaged by hand)."""
    if not config.limiter_label:
        return None
    if config.limiter_simulated:
        return lambda: protocol.LIMITER_LABEL_SIMULATED
    if not config.limiter_dir:
        return lambda: None
    directory = Path(config.limiter_dir)
    return lambda: verified_name(directory)
