"""A real local control plane with simulated GPU nodes: etcd, kube-apiserver, our webhook, our extender,
kube-scheduler (the manifests' KubeSchedulerConfiguration) and a node heartbeat, all on 127.0.0.1 and free ports;
with ClusterOptions.lifecycle also kube-controller-manager (Jobs, Deployments, garbage collection, ...) and KWOK,
which runs the bound pods in place of kubelets and finishes them when asked (see lifecycle.py).

    cluster = up(ClusterOptions(state_dir=..., node_groups=(NodeGroup(count=4),)))
    ...                      # cluster.kubeconfig, cluster.api_client(), cluster.restart_extender(), ...
    cluster.stop()           # or, from another process: down(state_dir)

Start-up is all or nothing: if any component fails to start (binary missing, port taken, not ready in time) the
ones already started are stopped and DevClusterError says which component failed, why, and the tail of its log.
Every process is recorded in <state-dir>/state.json (PID + start time) as soon as it is started, so `down` can stop
exactly what `up` started even if `up` itself was killed half-way.

Identities (--authorization-mode=Node,RBAC; the RBAC objects are the ones manifests/ ships, see rbac_documents):
  admin                       client cert, group system:masters (the kubeconfig `up` prints; tests use it)
  kube-scheduler, extender    ServiceAccount token of kube-vgpu/kube-vgpu-extender (as in the manifests, where
                              both run in one Pod under that account)
  device plugin               ServiceAccount token of kube-vgpu/kube-vgpu-device-plugin bound to one Node
                              (device_plugin_kubeconfig_for: the token names its node, as a DaemonSet pod's does)
  heartbeat                   ServiceAccount token of kube-vgpu/kube-vgpu-dev-heartbeat, a dev-only account bound to
                              the device plugin's ClusterRole: one process stands in for every node's device plugin,
                              which the device plugin's own identity may not (its admission policies hold it to one
                              node)
  webhook                     ServiceAccount token of kube-vgpu/kube-vgpu-webhook (reads GPU pods' owners)
  kube-controller-manager     client cert of system:kube-controller-manager (the API server's default RBAC), each
                              controller under its own kube-system ServiceAccount (--use-service-account-credentials)
  kwok                        ServiceAccount token of kube-system/kwok (lifecycle.kwok_rbac_documents)
The webhook trusts the extender's and the device plugin's ServiceAccounts to write kube-vgpu.io/ pod annotations
(webhook.registration), and the manifests' ValidatingAdmissionPolicies (webhook.policies) are in force.
"""

from __future__ import annotations

import contextlib
import copy
import datetime as dt
import http.client
import os
import shutil
import signal
import socket
import ssl
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import orjson
import yaml

from kube_vgpu.dev.devcluster import lifecycle as lifecycle_module
from kube_vgpu.dev.devcluster import pki as pki_module
from kube_vgpu.dev.devcluster.processes import ProcessRecord, is_running, kill, log_tail, spawn, stop
from kube_vgpu.dev.fixtures import node_object, synth_inventory
from kube_vgpu.deviceplugin.discovery import discover
from kube_vgpu.deviceplugin.fakenvml import FakeNvml, load_profile
from kube_vgpu.deviceplugin.nvml import Nvml
from kube_vgpu.protocol import LABEL_LIMITER, LIMITER_LABEL_SIMULATED, NodeInventory

STATE_VERSION = 1
STATE_FILE = "state.json"
NODES_FILE = "nodes.json"
KUBECONFIG_FILE = "kubeconfig"

# The manifests ship inside the package (kube_vgpu/manifests; a symlink to manifests/ in the source tree), so the dev
# cluster and the demo run the same files from a checkout, a wheel or the image.
MANIFESTS_DIR = Path(__file__).parents[2] / "manifests"
#: THE KubeSchedulerConfiguration (shipped by manifests/); the dev cluster runs a copy with only
#: clientConnection, leaderElection and the extender's urlPrefix port changed (scheduler_config below).
SCHEDULER_CONFIG_MANIFEST = MANIFESTS_DIR / "base" / "scheduler" / "kube-scheduler-config.yaml"
RBAC_MANIFESTS = (
    MANIFESTS_DIR / "base" / "scheduler" / "rbac.yaml",
    MANIFESTS_DIR / "base" / "deviceplugin" / "rbac.yaml",
    MANIFESTS_DIR / "base" / "webhook" / "rbac.yaml",
)
#: THE ValidatingAdmissionPolicies and their bindings (generated from webhook.policies), applied as shipped.
ADMISSION_POLICY_MANIFEST = MANIFESTS_DIR / "base" / "admission" / "validatingadmissionpolicies.yaml"

NAMESPACE = "kube-vgpu"
EXTENDER_SERVICE_ACCOUNT = "kube-vgpu-extender"
DEVICE_PLUGIN_SERVICE_ACCOUNT = "kube-vgpu-device-plugin"
WEBHOOK_SERVICE_ACCOUNT = "kube-vgpu-webhook"
#: the webhook Service's DNS name (manifests/base/webhook), which its serving certificate holds
WEBHOOK_SERVICE_DNS_NAME = f"kube-vgpu-webhook.{NAMESPACE}.svc"
#: The heartbeat's dev-only account (not in manifests/), bound to the device plugin's ClusterRole.
HEARTBEAT_SERVICE_ACCOUNT = "kube-vgpu-dev-heartbeat"
DEVICE_PLUGIN_CLUSTER_ROLE = "kube-vgpu-device-plugin"
#: ServiceAccount tokens last as long as a dev cluster reasonably lives (no kubelet rotates them here).
TOKEN_LIFETIME_S = 365 * 24 * 3600

#: kube-scheduler's client rate limits (defaults 50 QPS / 100 burst) would cap binding and event writing far below
#: what the extender can do; a real deployment with many pods per second raises them the same way.
DEFAULT_SCHEDULER_QPS = 500.0
DEFAULT_SCHEDULER_BURST = 1000
DEFAULT_HEARTBEAT_INTERVAL_S = 10.0
DEFAULT_READY_TIMEOUT_S = 90.0
NODE_REGISTRATION_THREADS = 8
NOT_READY_TAINT = "node.kubernetes.io/not-ready"

#: kube-controller-manager's client rate limits (defaults 20 QPS / 30 burst, the setting of every controller's
#: client): a Job or ReplicaSet of many pods would otherwise be created at 20 pods/s.
DEFAULT_CONTROLLER_MANAGER_QPS = 200.0
DEFAULT_CONTROLLER_MANAGER_BURST = 400
KWOK_NAMESPACE = "kube-system"

# Start order; stop runs the reverse. kube-controller-manager and kwok run only with ClusterOptions.lifecycle.
# kueue runs only with ClusterOptions.kueue.
COMPONENTS = (
    "etcd", "kube-apiserver", "kube-controller-manager", "kueue", "webhook", "extender", "kube-scheduler", "heartbeat",
    "prometheus", "kwok",
)
#: Components start_component can start again on their own (etcd and kube-apiserver hold the cluster's state).
RESTARTABLE = ("kube-controller-manager", "kueue", "webhook", "extender", "kube-scheduler", "heartbeat", "prometheus",
               "kwok")
#: How often ClusterOptions.prometheus's Prometheus scrapes and evaluates the rules.
PROMETHEUS_INTERVAL_S = 5.0

ProgressFn = Callable[[str], object]


#: What ClusterOptions.workload_api switches on in the API server (Kubernetes 1.37)
WORKLOAD_API_FEATURE_GATE = "GenericWorkload"
WORKLOAD_API_VERSION = "scheduling.k8s.io/v1beta1"


class DevClusterError(RuntimeError):
    """The dev cluster could not start (it was torn down) or could not be driven as asked."""


class ComponentError(DevClusterError):
    def __init__(self, component: str, message: str) -> None:
        super().__init__(f"{component}: {message}")
        self.component = component


@dataclass(frozen=True)
class NodeGroup:
    """`count` identical GPU nodes named <prefix>-<i>."""

    count: int
    gpus: int = 8
    model: str = "NVIDIA A100-SXM4-80GB"
    memory_mib: int = 81920
    topology: str = "nvswitch"
    prefix: str = "gpu-node"
    labels: tuple[tuple[str, str], ...] = ()
    first_index: int = 0
    #: With ClusterOptions.lifecycle, KWOK plays these nodes' kubelets (runs and finishes their pods). False for
    #: nodes whose kubelet is something else, e.g. a test's kubelet stand-in driving the real device plugin.
    kwok: bool = True
    #: a fake NVML profile (deviceplugin.fakenvml, e.g. "a100-mig" for a static-MIG node) whose discovered inventory
    #: these nodes carry instead of the synthetic layout of gpus/model/memory_mib/topology
    fake_profile: str | None = None
    #: the nodes stand for device plugins whose init container installed the limiter: they carry its label, which
    #: the webhook's node affinity requires of pods that load it (False: a node where the install failed)
    limiter_installed: bool = True
    #: dynamic MIG: the device plugin's --dynamic-mig and --dynamic-mig-profiles values for these nodes (with a
    #: fake_profile of MIG-capable GPUs, e.g. ("0", "H100-80GB=1g.10gb,3g.40gb") with "h100-mig-capable")
    dynamic_mig: tuple[str, str] | None = None

    def names(self) -> list[str]:
        return [f"{self.prefix}-{index}" for index in range(self.first_index, self.first_index + self.count)]

    def inventory(self, name: str) -> NodeInventory:
        """The inventory node `name` of this group publishes (the device plugin's own discovery on fake NVML)."""
        if self.fake_profile is None:
            return synth_inventory(name, self.gpus, self.model, self.memory_mib, self.topology)
        nvml = Nvml(FakeNvml(load_profile(self.fake_profile, name)))
        inventory = discover(nvml).inventory
        if self.dynamic_mig is None:
            return inventory
        from kube_vgpu.deviceplugin.dynmig import DynamicMigConfig, mark_dynamic, parse_gpus, parse_profiles

        config = DynamicMigConfig(parse_profiles(self.dynamic_mig[1]), parse_gpus(self.dynamic_mig[0]))
        return mark_dynamic(inventory, config, [g.index for g in inventory.gpus])


@dataclass(frozen=True)
class ClusterOptions:
    state_dir: Path
    node_groups: tuple[NodeGroup, ...] = (NodeGroup(count=4),)
    webhook: bool = True
    #: Pods really run and finish: kube-controller-manager (Jobs, ReplicaSets, Deployments, garbage collector,
    #: PodDisruptionBudgets, namespaces) and KWOK (bound pods become Running; pods annotated with
    #: lifecycle.RUN_SECONDS_ANNOTATION succeed after that many seconds). Off: pods are bound and stay Pending, and
    #: no controller creates pods (the benchmarks' setting, so their numbers stay comparable).
    lifecycle: bool = False
    #: False: kube-scheduler runs the same configuration without the extenders block (nvidia.com/gpu is then a
    #: plain extended resource); for the throughput comparison.
    extender: bool = True
    extender_args: tuple[str, ...] = ()
    #: The API server serves Kubernetes' Workload API (Workloads, PodGroups, pods' spec.schedulingGroup):
    #: feature gate GenericWorkload (beta, off by default in 1.37) and scheduling.k8s.io/v1beta1. Kubernetes 1.37+
    #: (older releases serve other versions of it and refuse these flags). kube-scheduler keeps the gate off: gangs
    #: are placed by our extender, not by kube-scheduler's own gang scheduling.
    workload_api: bool = False
    #: The real Kueue controller (built from its Go module, with its own CRDs, webhooks and RBAC: kueue.py) admits
    #: Jobs carrying a queue label; needs `lifecycle` (Jobs need their controller). The extender's quota mode is
    #: then up to extender_args (its default, auto, finds Kueue's controller and leaves admission to it).
    kueue: bool = False
    #: A real Prometheus (built from its Go module beside promtool) scraping the extender, the webhook and
    #: kube-scheduler as manifests/monitoring's monitors say, with its PrometheusRule as rule file (prometheus.py).
    prometheus: bool = False
    scheduler_qps: float = DEFAULT_SCHEDULER_QPS
    scheduler_burst: int = DEFAULT_SCHEDULER_BURST
    heartbeat_interval_s: float = DEFAULT_HEARTBEAT_INTERVAL_S
    ready_timeout_s: float = DEFAULT_READY_TIMEOUT_S
    #: component -> its own readiness timeout (tests of the "not ready in time" path)
    ready_timeouts: tuple[tuple[str, float], ...] = ()
    #: kill every process when the process that started them exits (tests, demo); `dev-cluster up` detaches
    die_with_parent: bool = False
    #: component -> port, instead of a free one (tests of the "port taken" path)
    ports: tuple[tuple[str, int], ...] = ()
    #: name -> path of etcd/kube-apiserver/kube-scheduler/kubectl (and kube-controller-manager/kwok with
    #: lifecycle); None: binaries.ensure_binaries()
    binaries: tuple[tuple[str, str], ...] | None = None
    progress: ProgressFn = field(default=print, compare=False)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def default_state_dir() -> Path:
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "kube-vgpu" / "dev-cluster"


# ---------------------------------------------------------------------------------------------------------------
# The scheduler configuration
# ---------------------------------------------------------------------------------------------------------------


def load_manifest_scheduler_config() -> dict[str, Any]:
    try:
        doc = yaml.safe_load(SCHEDULER_CONFIG_MANIFEST.read_text())
    except OSError as exc:
        raise DevClusterError(
            f"cannot read the KubeSchedulerConfiguration {SCHEDULER_CONFIG_MANIFEST}: {exc} (the dev cluster runs "
            "from a source checkout: install kube-vgpu with `pip install -e .`)"
        ) from None
    if not isinstance(doc, dict):
        raise DevClusterError(f"{SCHEDULER_CONFIG_MANIFEST} is not a YAML mapping")
    return doc


def scheduler_config(
    base: dict[str, Any],
    *,
    kubeconfig: str,
    extender_port: int | None,
    qps: float = DEFAULT_SCHEDULER_QPS,
    burst: int = DEFAULT_SCHEDULER_BURST,
) -> dict[str, Any]:
    """The dev cluster's copy of the manifests' configuration. The only differences: clientConnection (our
    kubeconfig, higher QPS/burst), leaderElection off (one scheduler, no lease to wait for), and the extenders'
    urlPrefix port (the extender listens on a free port). extender_port None drops the extenders block: the same
    scheduler with nvidia.com/gpu as a plain extended resource, for the throughput comparison only."""
    config = copy.deepcopy(base)
    config["clientConnection"] = {"kubeconfig": kubeconfig, "qps": qps, "burst": burst}
    config["leaderElection"] = {"leaderElect": False}
    if extender_port is None:
        config.pop("extenders", None)
        return config
    for extender in config.get("extenders") or []:
        parts = urlsplit(extender["urlPrefix"])
        extender["urlPrefix"] = urlunsplit(parts._replace(netloc=f"{parts.hostname}:{extender_port}"))
    return config


# ---------------------------------------------------------------------------------------------------------------
# RBAC
# ---------------------------------------------------------------------------------------------------------------

def rbac_documents() -> list[dict[str, Any]]:
    """The RBAC objects that manifests/ ships for the scheduler Pod (kube-scheduler and the extender
    share the ServiceAccount kube-vgpu-extender), the device plugin and the webhook. The dev cluster runs its components
    under exactly these identities and rules, so every end-to-end run checks the shipped RBAC."""
    documents: list[dict[str, Any]] = []
    for path in RBAC_MANIFESTS:
        documents += _manifest_documents(path, "the RBAC")
    return documents


def admission_policy_documents() -> list[dict[str, Any]]:
    """The ValidatingAdmissionPolicies and bindings that manifests/ ships; the dev cluster enforces exactly these."""
    return _manifest_documents(ADMISSION_POLICY_MANIFEST, "the admission policies")


def heartbeat_binding() -> dict[str, Any]:
    """The dev-only ClusterRoleBinding giving the heartbeat's account the device plugin's ClusterRole."""
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRoleBinding",
        "metadata": {"name": HEARTBEAT_SERVICE_ACCOUNT},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": DEVICE_PLUGIN_CLUSTER_ROLE},
        "subjects": [{"kind": "ServiceAccount", "name": HEARTBEAT_SERVICE_ACCOUNT, "namespace": NAMESPACE}],
    }


def _manifest_documents(path: Path, what: str) -> list[dict[str, Any]]:
    try:
        text = path.read_text()
    except OSError as exc:
        raise DevClusterError(
            f"cannot read {path} (the dev cluster runs with {what} manifests/ ships): {exc}"
        ) from None
    return [doc for doc in yaml.safe_load_all(text) if isinstance(doc, dict)]


# ---------------------------------------------------------------------------------------------------------------
# HTTP probes (stdlib only: they run while nothing else is up)
# ---------------------------------------------------------------------------------------------------------------


def _tls_context(ca: Path, client: pki_module.ClientCert | None) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(ca))
    if client is not None:
        context.load_cert_chain(str(client.cert), str(client.key))
    return context


def _probe(url: str, context: ssl.SSLContext | None, expect: Callable[[int, bytes], bool]) -> str | None:
    """None when the endpoint answers as expected, else what it answered (for the timeout message)."""
    parts = urlsplit(url)
    connection: http.client.HTTPConnection
    if parts.scheme == "https":
        connection = http.client.HTTPSConnection(parts.hostname or "", parts.port, timeout=2, context=context)
    else:
        connection = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=2)
    try:
        connection.request("GET", parts.path or "/")
        response = connection.getresponse()
        body = response.read()
    except (OSError, http.client.HTTPException) as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        connection.close()
    if expect(response.status, body):
        return None
    return f"HTTP {response.status}: {body[:300].decode(errors='replace').strip()}"


def _ok_200(status: int, _body: bytes) -> bool:
    return status == 200


# ---------------------------------------------------------------------------------------------------------------
# The cluster
# ---------------------------------------------------------------------------------------------------------------


class DevCluster:
    """A running dev cluster started by this process (see `up`). Thread-safe for the restart methods."""

    def __init__(self, options: ClusterOptions) -> None:
        self.options = options
        self.state_dir = options.state_dir.resolve()
        self.pki_dir = self.state_dir / "pki"
        self.log_dir = self.state_dir / "logs"
        self.kubeconfig = self.state_dir / KUBECONFIG_FILE
        self.scheduler_kubeconfig = self.state_dir / "kube-scheduler.kubeconfig"
        self.extender_kubeconfig = self.state_dir / "extender.kubeconfig"
        #: the device plugin's account with a token bound to no node: the admission policies refuse its writes
        #: (a device plugin's kubeconfig is device_plugin_kubeconfig_for(node))
        self.device_plugin_kubeconfig = self.state_dir / "device-plugin.kubeconfig"
        self.webhook_kubeconfig = self.state_dir / "webhook.kubeconfig"
        self.heartbeat_kubeconfig = self.state_dir / "heartbeat.kubeconfig"
        self.controller_manager_kubeconfig = self.state_dir / "kube-controller-manager.kubeconfig"
        self.kwok_kubeconfig = self.state_dir / "kwok.kubeconfig"
        self.kueue_kubeconfig = self.state_dir / "kueue.kubeconfig"
        self.kueue_config_path = self.state_dir / "kueue-config.yaml"
        self.kwok_config_path = self.state_dir / "kwok-stages.yaml"
        self.scheduler_config_path = self.state_dir / "kube-scheduler-config.yaml"
        self.nodes_file = self.state_dir / NODES_FILE
        self.ports: dict[str, int] = {}
        self.records: dict[str, ProcessRecord] = {}
        self._popens: dict[str, Any] = {}
        self._lock = threading.RLock()
        self._argv: dict[str, list[str]] = {}
        self._env: dict[str, dict[str, str] | None] = {}
        self._probes: dict[str, tuple[str, Callable[[], str | None]]] = {}
        self._api_client: Any = None
        self.nodes: list[str] = []
        self.binaries: dict[str, Path] = {}
        self.pki: pki_module.Pki | None = None
        self.webhook_ca_pem: bytes = b""
        self._owns_state = False

    # --- addresses ---------------------------------------------------------------------------------------------
    @property
    def server(self) -> str:
        return f"https://127.0.0.1:{self.ports['kube-apiserver']}"

    @property
    def extender_url(self) -> str:
        return f"http://127.0.0.1:{self.ports['extender']}"

    @property
    def extender_metrics_url(self) -> str:
        """The extender's separate metrics listener (--metrics-port, the manifests' container port `metrics`):
        /metrics, /healthz, /readyz, /state, /quota, as a Prometheus in the cluster scrapes them."""
        return f"http://127.0.0.1:{self.ports['extender-metrics']}"

    @property
    def prometheus_url(self) -> str | None:
        """Prometheus's HTTP API, with ClusterOptions.prometheus."""
        return f"http://127.0.0.1:{self.ports['prometheus']}" if self.options.prometheus else None

    @property
    def webhook_url(self) -> str | None:
        return f"https://127.0.0.1:{self.ports['webhook']}/mutate" if self.options.webhook else None

    def _progress(self, message: str) -> None:
        self.options.progress(message)

    # --- start-up ------------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Start everything; on any failure stop what was started and raise DevClusterError."""
        self._claim_state_dir()
        try:
            self._start()
        except BaseException as exc:
            self.stop()
            if isinstance(exc, DevClusterError):
                raise
            if isinstance(exc, KeyboardInterrupt):
                raise
            raise DevClusterError(f"start-up failed: {type(exc).__name__}: {exc}") from exc

    def _start(self) -> None:
        start_s = time.monotonic()
        self._prepare_state_dir()
        self._resolve_binaries()
        overrides = dict(self.options.ports)
        names = ["etcd", "etcd-peer", "kube-apiserver", "webhook", "extender", "extender-metrics", "kube-scheduler"]
        if self.options.lifecycle:
            names += ["kube-controller-manager", "kwok"]
        if self.options.kueue:
            if not self.options.lifecycle:
                raise DevClusterError("Kueue needs the pod lifecycle (its Jobs need kube-controller-manager)")
            names += ["kueue", "kueue-health", "kueue-metrics"]
        if self.options.prometheus:
            names.append("prometheus")
        for name in names:
            port = overrides.get(name) or free_port()
            while port in self.ports.values():  # the kernel may hand out a just-released port again
                port = free_port()
            self.ports[name] = port
        self.pki = pki_module.ensure_pki(self.pki_dir)
        pki_module.write_kubeconfig(
            self.kubeconfig,
            pki_module.kubeconfig_document(
                self.server, self.pki.ca_cert, pki_module.ADMIN_USER, client=self.pki.admin
            ),
        )
        self._save_state()

        self._start_etcd()
        self._start_apiserver()
        self._bootstrap_objects()
        if self.options.lifecycle:
            # Started now, waited for at the end: it needs nothing but the API server, and comes up meanwhile.
            self._spawn_controller_manager()
        if self.options.kueue:
            # Kueue's CRDs exist before the extender starts (it looks for them once a minute otherwise).
            self._start_kueue()
        node_registration = ThreadPoolExecutor(max_workers=1, thread_name_prefix="register-nodes")
        try:
            # Nodes are registered while the Python components import their dependencies (seconds on 2 cores).
            registering = node_registration.submit(self._register_groups, self.options.node_groups)
            if self.options.webhook:
                self._start_webhook()
            if self.options.extender:
                self._start_extender()
            registering.result()
        finally:
            node_registration.shutdown(wait=True)
        self._start_scheduler(with_extender=self.options.extender)
        self._start_heartbeat()
        if self.options.prometheus:
            self._start_prometheus()
        if self.options.lifecycle:
            self._wait_controller_manager_ready()
            self._start_kwok()
        self._progress(f"dev cluster ready in {time.monotonic() - start_s:.1f} s: {len(self.nodes)} GPU nodes")

    def _claim_state_dir(self) -> None:
        """Refuse a state dir whose cluster still runs (its records must not be overwritten)."""
        self.state_dir.mkdir(parents=True, exist_ok=True)
        running = [record.name for record in read_state(self.state_dir) if is_running(record)]
        if running:
            raise DevClusterError(
                f"a dev cluster is already running from {self.state_dir} ({', '.join(running)}); stop it with "
                f"`kube-vgpu dev-cluster down --state-dir {self.state_dir}` or use another --state-dir"
            )
        self._owns_state = True

    def _prepare_state_dir(self) -> None:
        # A fresh cluster every time: the previous run's etcd data and logs are ours to replace.
        shutil.rmtree(self.state_dir / "etcd", ignore_errors=True)
        shutil.rmtree(self.log_dir, ignore_errors=True)
        self.log_dir.mkdir(parents=True)
        self._write_nodes_file()

    def _resolve_binaries(self) -> None:
        if self.options.binaries is not None:
            self.binaries = {name: Path(path) for name, path in self.options.binaries}
            return
        from kube_vgpu.dev.devcluster.binaries import (
            CORE_BINARY_NAMES,
            KUEUE_BINARY_NAMES,
            LIFECYCLE_BINARY_NAMES,
            BinariesError,
            ensure_binaries,
        )

        names = CORE_BINARY_NAMES + (LIFECYCLE_BINARY_NAMES if self.options.lifecycle else ())
        names += KUEUE_BINARY_NAMES if self.options.kueue else ()
        names += ("prometheus",) if self.options.prometheus else ()
        try:
            self.binaries = ensure_binaries(progress=self._progress, names=names)
        except BinariesError as exc:
            raise ComponentError("binaries", str(exc)) from None

    def _binary(self, name: str) -> str:
        path = self.binaries.get(name)
        if path is None or not (path.is_file() and os.access(path, os.X_OK)):
            raise ComponentError(
                name,
                f"binary not found or not executable: {path} (run `python -m kube_vgpu.dev.devcluster.binaries` to "
                f"build it, or point KUBE_VGPU_BIN_DIR at a directory holding it)",
            )
        return str(path)

    def _python_env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["PYTHONUNBUFFERED"] = "1"
        return env

    def _spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> None:
        with self._lock:
            self._argv[name] = argv
            self._env[name] = env
            try:
                record, process = spawn(
                    name,
                    argv,
                    self.log_dir / f"{name}.log",
                    env=env,
                    cwd=self.state_dir,
                    die_with_parent=self.options.die_with_parent,
                )
            except OSError as exc:
                raise ComponentError(name, f"cannot start {argv[0]}: {exc}") from None
            self.records[name] = record
            self._popens[name] = process
            self._save_state()

    def _wait_ready(
        self, name: str, what: str, probe: Callable[[], str | None], timeout_s: float | None = None,
        *, record: bool = True,
    ) -> None:
        if record:
            self._probes[name] = (what, probe)  # start_component waits the same way
        if timeout_s is None:
            timeout_s = dict(self.options.ready_timeouts).get(name, self.options.ready_timeout_s)
        start_s = time.monotonic()
        deadline = start_s + timeout_s
        last = "no answer yet"
        while True:
            process = self._popens.get(name)
            if process is not None and process.poll() is not None:
                raise ComponentError(
                    name, f"exited with code {process.returncode} during start-up{self._hint(name)}\n{self._tail(name)}"
                )
            answer = probe()
            if answer is None:
                self._progress(f"{name} ready: {what} ({time.monotonic() - start_s:.1f} s)")
                return
            last = answer
            if time.monotonic() >= deadline:
                raise ComponentError(
                    name,
                    f"not ready within {timeout_s:g} s at {what} (last answer: {last}){self._hint(name)}\n"
                    f"{self._tail(name)}",
                )
            time.sleep(0.1)

    def _hint(self, name: str) -> str:
        text = log_tail(self.log_dir / f"{name}.log", 200).lower()
        if "address already in use" in text or "errno 98" in text:
            keys = {"etcd": ("etcd", "etcd-peer"), "extender": ("extender", "extender-metrics")}.get(name, (name,))
            ports = [str(self.ports[key]) for key in keys if key in self.ports]
            return f" (port {' or '.join(ports) or '?'} is already in use by another process)"
        return ""

    def _tail(self, name: str) -> str:
        path = self.log_dir / f"{name}.log"
        return f"--- last lines of {path} ---\n{log_tail(path)}"

    def _start_etcd(self) -> None:
        assert self.pki is not None
        client_url = f"https://127.0.0.1:{self.ports['etcd']}"
        peer_url = f"http://127.0.0.1:{self.ports['etcd-peer']}"  # one member: the peer port only has to be free
        argv = [
            self._binary("etcd"),
            "--name=dev",
            f"--data-dir={self.state_dir / 'etcd'}",
            f"--listen-client-urls={client_url}",
            f"--advertise-client-urls={client_url}",
            f"--listen-peer-urls={peer_url}",
            f"--initial-advertise-peer-urls={peer_url}",
            f"--initial-cluster=dev={peer_url}",
            f"--cert-file={self.pki.etcd_serving.cert}",
            f"--key-file={self.pki.etcd_serving.key}",
            f"--trusted-ca-file={self.pki.ca_cert}",
            "--client-cert-auth",
            # a throw-away store: no fsync per write (a dev cluster does not survive power loss anyway)
            "--unsafe-no-fsync",
            "--log-level=warn",
        ]
        self._spawn("etcd", argv)
        context = _tls_context(self.pki.ca_cert, self.pki.etcd_client)
        self._wait_ready(
            "etcd",
            f"{client_url}/health",
            lambda: _probe(f"{client_url}/health", context, lambda s, b: s == 200 and b'"health":"true"' in b),
        )

    def _start_apiserver(self) -> None:
        assert self.pki is not None
        argv = [
            self._binary("kube-apiserver"),
            "--bind-address=127.0.0.1",
            "--advertise-address=127.0.0.1",
            f"--secure-port={self.ports['kube-apiserver']}",
            f"--tls-cert-file={self.pki.serving.cert}",
            f"--tls-private-key-file={self.pki.serving.key}",
            f"--client-ca-file={self.pki.ca_cert}",
            f"--etcd-servers=https://127.0.0.1:{self.ports['etcd']}",
            f"--etcd-cafile={self.pki.ca_cert}",
            f"--etcd-certfile={self.pki.etcd_client.cert}",
            f"--etcd-keyfile={self.pki.etcd_client.key}",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-account-key-file={self.pki.service_account_public_key}",
            f"--service-account-signing-key-file={self.pki.service_account_key}",
            "--service-cluster-ip-range=10.96.0.0/16",
            "--authorization-mode=Node,RBAC",
            # On by default (1.30+); listed so that no default change can switch our webhook or policies off unnoticed.
            "--enable-admission-plugins=MutatingAdmissionWebhook,ValidatingAdmissionPolicy,ValidatingAdmissionWebhook",
            # No serviceaccount controller runs (not even with lifecycle), so no namespace gets its `default`
            # ServiceAccount, and this plugin would refuse every pod; nothing runs in the pods, they need no token.
            "--disable-admission-plugins=ServiceAccount",
            # The kubernetes Service's endpoints would be 127.0.0.1, which Endpoints validation refuses.
            "--endpoint-reconciler-type=none",
            "--profiling=false",
            # As kubeadm, kind and the managed clusters run it (the flag's own default is false): dynamic MIG's device
            # plugin is privileged (manifests/components/dynamic-mig); Pod Security Admission still decides per
            # namespace, and GPU tenants' namespaces enforce baseline (docs/security.md).
            "--allow-privileged=true",
        ]
        if self.options.workload_api:
            argv += [f"--feature-gates={WORKLOAD_API_FEATURE_GATE}=true",
                     f"--runtime-config={WORKLOAD_API_VERSION}=true"]
        self._spawn("kube-apiserver", argv)
        context = _tls_context(self.pki.ca_cert, self.pki.admin)
        url = f"{self.server}/readyz"
        self._wait_ready("kube-apiserver", url, lambda: _probe(url, context, lambda s, b: s == 200 and b == b"ok"))

    # --- API objects ---------------------------------------------------------------------------------------------
    def api_client(self, pool_size: int = 32) -> Any:
        """A new admin ApiClient (kubernetes client), with a connection pool big enough for worker threads."""
        from kubernetes import client, config

        configuration = client.Configuration()
        config.load_kube_config(config_file=str(self.kubeconfig), client_configuration=configuration)
        configuration.connection_pool_maxsize = pool_size
        return client.ApiClient(configuration)

    @property
    def api(self) -> Any:
        """A shared admin ApiClient."""
        with self._lock:
            if self._api_client is None:
                self._api_client = self.api_client()
            return self._api_client

    @property
    def core(self) -> Any:
        """CoreV1Api over the shared admin client."""
        from kubernetes import client

        return client.CoreV1Api(self.api)

    def _bootstrap_objects(self) -> None:
        from kubernetes import client, utils

        api = self.api
        core: Any = client.CoreV1Api(api)  # Any: raw dicts in, raw JSON out (the stubs expect model objects)
        core.create_namespace({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}})
        for account in (EXTENDER_SERVICE_ACCOUNT, DEVICE_PLUGIN_SERVICE_ACCOUNT, WEBHOOK_SERVICE_ACCOUNT,
                        HEARTBEAT_SERVICE_ACCOUNT):
            core.create_namespaced_service_account(
                NAMESPACE, {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": account}}
            )
        for document in [*rbac_documents(), heartbeat_binding(), *admission_policy_documents()]:
            utils.create_from_dict(api, document)
        for account, path in (
            (EXTENDER_SERVICE_ACCOUNT, self.extender_kubeconfig),
            # the manifests run kube-scheduler in the extender's Pod, under the same ServiceAccount
            (EXTENDER_SERVICE_ACCOUNT, self.scheduler_kubeconfig),
            (DEVICE_PLUGIN_SERVICE_ACCOUNT, self.device_plugin_kubeconfig),
            # it reads GPU pods' owners (their Kueue queue) under the manifests' read-only role
            (WEBHOOK_SERVICE_ACCOUNT, self.webhook_kubeconfig),
            (HEARTBEAT_SERVICE_ACCOUNT, self.heartbeat_kubeconfig),
        ):
            self.write_token_kubeconfig(account, path)
        if self.options.lifecycle:
            assert self.pki is not None
            for document in lifecycle_module.kwok_rbac_documents(KWOK_NAMESPACE):
                utils.create_from_dict(api, document)
            self.write_token_kubeconfig(lifecycle_module.KWOK_SERVICE_ACCOUNT, self.kwok_kubeconfig,
                                        namespace=KWOK_NAMESPACE)
            pki_module.write_kubeconfig(
                self.controller_manager_kubeconfig,
                pki_module.kubeconfig_document(
                    self.server, self.pki.ca_cert, pki_module.CONTROLLER_MANAGER_USER,
                    client=self.pki.controller_manager,
                ),
            )
        self._wait_for_admission_policies()

    def write_token_kubeconfig(
        self, account: str, path: Path, bound_to: dict[str, str] | None = None, *, namespace: str = NAMESPACE
    ) -> None:
        """Write a kubeconfig with a TokenRequest token of the account (in the kube-vgpu namespace unless said),
        bound to `bound_to` (an object reference: a Node, or a Pod, whose node the token then names too) if given."""
        assert self.pki is not None
        token = self.service_account_token(account, bound_to, namespace=namespace)
        user = f"system:serviceaccount:{namespace}:{account}"
        pki_module.write_kubeconfig(
            path, pki_module.kubeconfig_document(self.server, self.pki.ca_cert, user, token=token)
        )

    def service_account_token(
        self, account: str, bound_to: dict[str, str] | None = None, *, namespace: str = NAMESPACE
    ) -> str:
        """A TokenRequest token of the account, bound to `bound_to` if given."""
        from kubernetes import client

        core: Any = client.CoreV1Api(self.api)
        spec: dict[str, Any] = {"expirationSeconds": TOKEN_LIFETIME_S}
        if bound_to is not None:
            spec["boundObjectRef"] = bound_to
        response = core.create_namespaced_service_account_token(
            account,
            namespace,
            {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": spec},
            _preload_content=False,
        )
        token: str = orjson.loads(response.data)["status"]["token"]
        return token

    def device_plugin_kubeconfig_for(self, node_name: str) -> Path:
        """A kubeconfig of the device plugin's account whose token is bound to the Node (so it carries the
        authentication.kubernetes.io/node-name claim the admission policies hold the device plugin to, as the
        projected token of a DaemonSet pod does). Valid while the Node exists."""
        from kubernetes import client

        core: Any = client.CoreV1Api(self.api)
        node = orjson.loads(core.read_node(node_name, _preload_content=False).data)
        path = self.state_dir / f"device-plugin-{node_name}.kubeconfig"
        reference = {"apiVersion": "v1", "kind": "Node", "name": node_name, "uid": node["metadata"]["uid"]}
        self.write_token_kubeconfig(DEVICE_PLUGIN_SERVICE_ACCOUNT, path, bound_to=reference)
        return path

    def _wait_for_admission_policies(self) -> None:
        """The API server loads new policies in the background: wait until the last one refuses what it must, so no
        test (and no benchmark) runs before they are in force. The probe is a dry run: nothing is created."""
        from kubernetes import client
        from kubernetes.client.rest import ApiException

        from kube_vgpu.protocol import ADMISSION_MARK_VALUE, POD_ADMITTED_ANNOTATION

        core: Any = client.CoreV1Api(self.api)
        probe = {"apiVersion": "v1", "kind": "Pod",
                 "metadata": {"name": "kube-vgpu-policy-probe",
                              "annotations": {POD_ADMITTED_ANNOTATION: ADMISSION_MARK_VALUE}},
                 "spec": {"containers": [{"name": "probe", "image": "registry.k8s.io/pause:3.10"}]}}

        def refused() -> str | None:
            try:
                core.create_namespaced_pod(NAMESPACE, probe, dry_run="All", _preload_content=False)
            except ApiException as exc:
                body = exc.body.decode(errors="replace") if isinstance(exc.body, bytes) else str(exc.body)
                if exc.status == 403 and "ValidatingAdmissionPolicy" in body:
                    return None
                return f"HTTP {exc.status}: {body[:300]}"
            return "a pod carrying the admission mark is still accepted in the webhook's own namespace"

        # named after the API server: its log says why a policy is not in force
        self._wait_ready("kube-apiserver", "admission policies refusing a forged admission mark", refused, record=False)

    def trusted_usernames(self) -> list[str]:
        return [f"system:serviceaccount:{NAMESPACE}:{account}"
                for account in (EXTENDER_SERVICE_ACCOUNT, DEVICE_PLUGIN_SERVICE_ACCOUNT)]

    # --- nodes ---------------------------------------------------------------------------------------------------
    def _register_groups(self, groups: Iterable[NodeGroup]) -> list[str]:
        names: list[str] = []
        for group in groups:
            names += self.add_nodes(group)
        return names

    def add_nodes(self, group: NodeGroup) -> list[str]:
        """Register a group of GPU nodes (Node objects as the device plugin publishes them, status Ready) and
        keep their heartbeat fresh. Returns the node names."""
        from kubernetes import client

        core: Any = client.CoreV1Api(self.api)
        objects = []
        for name in group.names():
            limiter = {LABEL_LIMITER: LIMITER_LABEL_SIMULATED} if group.limiter_installed else {}
            obj = node_object(name, group.inventory(name), extra_labels={**limiter, **dict(group.labels)})
            if self.options.lifecycle and group.kwok:  # KWOK plays its kubelet (it never writes node metadata)
                obj["metadata"].setdefault("annotations", {})[lifecycle_module.NODE_ANNOTATION] = (
                    lifecycle_module.NODE_ANNOTATION_VALUE
                )
            objects.append(obj)

        def register(obj: dict[str, Any]) -> None:
            status = obj.pop("status")
            now = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
            for condition in status["conditions"]:
                condition.setdefault("lastHeartbeatTime", now)
                condition.setdefault("lastTransitionTime", now)
                condition.setdefault("message", "simulated by kube-vgpu dev-cluster (no kubelet)")
            name = obj["metadata"]["name"]
            created = orjson.loads(core.create_node(obj, _preload_content=False).data)
            # status is ignored on create: it has its own subresource
            core.patch_node_status(name, {"status": status}, _preload_content=False)
            # The TaintNodesByCondition admission plugin taints every new node not-ready:NoSchedule; the node
            # lifecycle controller lifts it once the node reports Ready. It does not run here (not even in
            # kube-controller-manager with lifecycle): we lift it.
            taints = (created.get("spec") or {}).get("taints") or []
            kept = [taint for taint in taints if taint.get("key") != NOT_READY_TAINT]
            if len(kept) != len(taints):
                patch = [
                    {"op": "test", "path": "/spec/taints", "value": taints},
                    {"op": "replace", "path": "/spec/taints", "value": kept},
                ]
                core.patch_node(name, patch, _preload_content=False)

        with ThreadPoolExecutor(max_workers=NODE_REGISTRATION_THREADS, thread_name_prefix="node") as pool:
            list(pool.map(register, objects))
        names = group.names()
        with self._lock:
            self.nodes += [name for name in names if name not in self.nodes]
            self._write_nodes_file()
        self._progress(
            f"registered {group.count} nodes {names[0]}..{names[-1]}: {group.gpus} x {group.model} "
            f"({group.memory_mib} MiB, {group.topology})"
            if names
            else "registered no nodes"
        )
        return names

    def delete_nodes(self, names: Sequence[str]) -> None:
        from kubernetes import client
        from kubernetes.client.rest import ApiException

        core = client.CoreV1Api(self.api)
        with self._lock:
            self.nodes = [name for name in self.nodes if name not in set(names)]
            self._write_nodes_file()
        for name in names:
            try:
                core.delete_node(name, _preload_content=False)
            except ApiException as exc:
                if exc.status != 404:
                    raise

    def _write_nodes_file(self) -> None:
        tmp = self.nodes_file.with_suffix(".tmp")
        tmp.write_bytes(orjson.dumps(self.nodes))
        os.replace(tmp, self.nodes_file)

    # --- our components ------------------------------------------------------------------------------------------
    def _kube_vgpu(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "kube_vgpu.cli", *args]

    def _start_webhook(self) -> None:
        from kube_vgpu.webhook.certs import ensure_ca_and_serving_cert
        from kube_vgpu.webhook.registration import mutating_webhook_configuration

        # also the Service name the manifests' ServiceMonitor verifies the webhook's certificate for (its tlsConfig
        # serverName), so a Prometheus scrapes this webhook with the manifests' TLS settings
        certs = ensure_ca_and_serving_cert(self.state_dir / "webhook-certs",
                                           ["localhost", WEBHOOK_SERVICE_DNS_NAME], ["127.0.0.1"])
        self.webhook_ca_pem = certs.ca_pem
        port = self.ports["webhook"]
        argv = self._kube_vgpu(
            "webhook",
            "--host=127.0.0.1",
            f"--port={port}",
            f"--tls-cert-file={certs.cert}",
            f"--tls-key-file={certs.key}",
            f"--kubeconfig={self.webhook_kubeconfig}",
            *[f"--trusted-user={user}" for user in self.trusted_usernames()],
        )
        self._spawn("webhook", argv, env=self._python_env())
        context = ssl.create_default_context(cafile=str(certs.ca_cert))
        url = f"https://127.0.0.1:{port}/healthz"
        self._wait_ready("webhook", url, lambda: _probe(url, context, _ok_200))
        from kubernetes import client

        configuration = mutating_webhook_configuration(
            certs.ca_pem, url=f"https://127.0.0.1:{port}/mutate", trusted_usernames=self.trusted_usernames()
        )
        admission: Any = client.AdmissionregistrationV1Api(self.api)
        admission.create_mutating_webhook_configuration(
            configuration, _preload_content=False
        )

    def _start_extender(self) -> None:
        argv = self._kube_vgpu(
            "extender",
            f"--kubeconfig={self.extender_kubeconfig}",
            "--host=127.0.0.1",
            f"--port={self.ports['extender']}",
            # the metrics listener the manifests give it (--metrics-port=8889, container port `metrics`), on a free
            # port: what the PodMonitor kube-vgpu-extender scrapes (extender_metrics_url)
            "--metrics-host=127.0.0.1",
            f"--metrics-port={self.ports['extender-metrics']}",
            # without the webhook no pod carries its admission mark: GPU pods would all be refused
            *(() if self.options.webhook else ("--no-require-admission-mark",)),
            *self.options.extender_args,
        )
        self._spawn("extender", argv, env=self._python_env())
        self._wait_extender_ready()

    def _wait_extender_ready(self) -> None:
        url = f"{self.extender_url}/readyz"
        self._wait_ready("extender", url, lambda: _probe(url, None, _ok_200))

    def _start_scheduler(self, *, with_extender: bool) -> None:
        assert self.pki is not None
        config = scheduler_config(
            load_manifest_scheduler_config(),
            kubeconfig=str(self.scheduler_kubeconfig),
            extender_port=self.ports["extender"] if with_extender else None,
            qps=self.options.scheduler_qps,
            burst=self.options.scheduler_burst,
        )
        self.scheduler_config_path.write_text(yaml.safe_dump(config, sort_keys=False))
        argv = [
            self._binary("kube-scheduler"),
            f"--config={self.scheduler_config_path}",
            "--bind-address=127.0.0.1",
            f"--secure-port={self.ports['kube-scheduler']}",
            f"--tls-cert-file={self.pki.serving.cert}",
            f"--tls-private-key-file={self.pki.serving.key}",
            # as kubeadm: delegated authn/authz of the scheduler's own endpoints (/healthz, /readyz are always open)
            f"--authentication-kubeconfig={self.scheduler_kubeconfig}",
            f"--authorization-kubeconfig={self.scheduler_kubeconfig}",
        ]
        self._spawn("kube-scheduler", argv)
        context = _tls_context(self.pki.ca_cert, None)
        url = f"https://127.0.0.1:{self.ports['kube-scheduler']}/readyz"
        self._wait_ready("kube-scheduler", url, lambda: _probe(url, context, _ok_200))

    def _spawn_controller_manager(self) -> None:
        assert self.pki is not None
        kubeconfig = self.controller_manager_kubeconfig
        argv = [
            self._binary("kube-controller-manager"),
            f"--kubeconfig={kubeconfig}",
            # as kubeadm: delegated authn/authz of its own endpoints (/healthz is always open)
            f"--authentication-kubeconfig={kubeconfig}",
            f"--authorization-kubeconfig={kubeconfig}",
            "--bind-address=127.0.0.1",
            f"--secure-port={self.ports['kube-controller-manager']}",
            f"--tls-cert-file={self.pki.serving.cert}",
            f"--tls-private-key-file={self.pki.serving.key}",
            f"--controllers={','.join(lifecycle_module.CONTROLLERS)}",
            # Each controller runs as its own ServiceAccount in kube-system (job-controller, ...), with the API
            # server's bootstrap role of that controller; the certificate's user only creates those accounts and
            # their tokens (the system:kube-controller-manager role).
            "--use-service-account-credentials=true",
            "--leader-elect=false",
            f"--kube-api-qps={DEFAULT_CONTROLLER_MANAGER_QPS:g}",
            f"--kube-api-burst={DEFAULT_CONTROLLER_MANAGER_BURST}",
            "--profiling=false",
        ]
        self._spawn("kube-controller-manager", argv)

    def _wait_controller_manager_ready(self) -> None:
        assert self.pki is not None
        context = _tls_context(self.pki.ca_cert, None)
        url = f"https://127.0.0.1:{self.ports['kube-controller-manager']}/healthz"
        self._wait_ready("kube-controller-manager", url, lambda: _probe(url, context, _ok_200))

    def _start_kwok(self) -> None:
        self.kwok_config_path.write_text(yaml.safe_dump_all(lifecycle_module.kwok_stages(), sort_keys=False))
        selector = f"{lifecycle_module.NODE_ANNOTATION}={lifecycle_module.NODE_ANNOTATION_VALUE}"
        argv = [
            self._binary("kwok"),
            f"--kubeconfig={self.kwok_kubeconfig}",
            f"--config={self.kwok_config_path}",
            "--manage-all-nodes=false",
            f"--manage-nodes-with-annotation-selector={selector}",
            # no node leases: nothing reads them (no node lifecycle controller), and they would be writes per node
            "--node-lease-duration-seconds=0",
            f"--cidr={lifecycle_module.KWOK_POD_CIDR}",
            f"--server-address=127.0.0.1:{self.ports['kwok']}",
        ]
        # KWOK also reads $KWOK_WORKDIR/kwok.yaml (default ~/.kwok): point it at an empty directory of ours.
        env = dict(os.environ)
        env["KWOK_WORKDIR"] = str(self.state_dir / "kwok")
        self._spawn("kwok", argv, env=env)
        url = f"http://127.0.0.1:{self.ports['kwok']}/healthz"
        self._wait_ready("kwok", url, lambda: _probe(url, None, _ok_200))

    def _start_kueue(self) -> None:
        """Kueue's namespace, identity, certificate Secret, CRDs and webhooks, then its controller (kueue.py)."""
        from kubernetes import client, utils

        from kube_vgpu.dev.devcluster import kueue as kueue_module
        from kube_vgpu.dev.devcluster.binaries import BinariesError, kueue_source_dir

        try:
            source = kueue_source_dir(progress=self._progress)
        except BinariesError as exc:
            raise ComponentError("kueue", str(exc)) from None
        api = self.api
        core: Any = client.CoreV1Api(api)
        core.create_namespace({"apiVersion": "v1", "kind": "Namespace",
                               "metadata": {"name": kueue_module.KUEUE_NAMESPACE}})
        for document in kueue_module.rbac_documents(source):
            utils.create_from_dict(api, document)
        secret, files = kueue_module.webhook_secret()
        ca_pem = files["ca.crt"]
        core.create_namespaced_secret(kueue_module.KUEUE_NAMESPACE, secret, _preload_content=False)
        cert_dir = self.state_dir / "kueue-certs"
        shutil.rmtree(cert_dir, ignore_errors=True)
        cert_dir.mkdir(mode=0o700)
        for name, content in files.items():  # what mounting the Secret at Kueue's certDir gives its Deployment
            (cert_dir / name).write_bytes(content)
        base_url = f"https://127.0.0.1:{self.ports['kueue']}"
        extensions: Any = client.ApiextensionsV1Api(api)
        for crd in kueue_module.crd_documents(source, conversion_url=base_url, ca_pem=ca_pem):
            extensions.create_custom_resource_definition(crd, _preload_content=False)
        admission: Any = client.AdmissionregistrationV1Api(api)
        for configuration in kueue_module.webhook_configurations(source, base_url, ca_pem):
            if configuration["kind"] == "MutatingWebhookConfiguration":
                admission.create_mutating_webhook_configuration(configuration, _preload_content=False)
            else:
                admission.create_validating_webhook_configuration(configuration, _preload_content=False)
        self.write_token_kubeconfig(kueue_module.SERVICE_ACCOUNT, self.kueue_kubeconfig,
                                    namespace=kueue_module.KUEUE_NAMESPACE)
        config = kueue_module.configuration(webhook_port=self.ports["kueue"], health_port=self.ports["kueue-health"],
                                            metrics_port=self.ports["kueue-metrics"], cert_dir=cert_dir)
        self.kueue_config_path.write_text(yaml.safe_dump(config, sort_keys=False))
        argv = [self._binary("kueue"), f"--config={self.kueue_config_path}", f"--kubeconfig={self.kueue_kubeconfig}",
                f"--feature-gates={kueue_module.FEATURE_GATES}"]
        self._spawn("kueue", argv)
        url = f"http://127.0.0.1:{self.ports['kueue-health']}/readyz"
        self._wait_ready("kueue", url, lambda: _probe(url, None, _ok_200))
        self._wait_ready("kueue", "its webhooks answering the API server", self._kueue_webhook_refusal, record=False)

    def _kueue_webhook_refusal(self) -> str | None:
        """None once the API server gets answers from Kueue's webhooks (a dry-run ResourceFlavor goes through its
        defaulting and validation webhooks; nothing is created)."""
        from kubernetes import client
        from kubernetes.client.rest import ApiException

        from kube_vgpu.protocol import KUEUE_API_GROUP

        custom: Any = client.CustomObjectsApi(self.api)
        probe = {"apiVersion": f"{KUEUE_API_GROUP}/v1beta2", "kind": "ResourceFlavor",
                 "metadata": {"name": "kube-vgpu-probe"}, "spec": {}}
        try:
            custom.create_cluster_custom_object(KUEUE_API_GROUP, "v1beta2", "resourceflavors", probe, dry_run="All",
                                                _preload_content=False)
        except ApiException as exc:
            body = exc.body.decode(errors="replace") if isinstance(exc.body, bytes) else str(exc.body)
            return f"HTTP {exc.status}: {body[:300]}"
        return None

    def _start_prometheus(self) -> None:
        """Prometheus scraping what manifests/monitoring's monitors scrape and the dev cluster runs (the extender's
        metrics listener, the webhook verified with its CA for its Service name, kube-scheduler with a token of the
        manifests' metrics-reader account), every PROMETHEUS_INTERVAL_S, with the manifests' alert rules."""
        from kubernetes import utils

        from kube_vgpu.dev.devcluster import prometheus as prom

        directory = self.state_dir / "prometheus"
        directory.mkdir(parents=True, exist_ok=True)
        documents = prom.monitoring_documents()
        reader = [d for d in documents if d["kind"] in ("ServiceAccount", "ClusterRole", "ClusterRoleBinding")]
        utils.create_from_yaml(self.api, yaml_objects=reader)  # the token Secret: no token controller runs here
        (account,) = [d["metadata"]["name"] for d in reader if d["kind"] == "ServiceAccount"]
        token_file = directory / "metrics-reader.token"
        token_file.write_text(self.service_account_token(account))
        ca_file = directory / "webhook-ca.crt"
        ca_file.write_bytes(self.webhook_ca_pem)
        listeners = {("kube-vgpu-scheduler", "https"): (f"127.0.0.1:{self.ports['kube-scheduler']}", "kube-scheduler")}
        if self.options.extender:
            listeners[("kube-vgpu-extender", "metrics")] = (f"127.0.0.1:{self.ports['extender-metrics']}", "extender")
        if self.options.webhook:
            listeners[("kube-vgpu-webhook", "https")] = (f"127.0.0.1:{self.ports['webhook']}", "webhook")
        jobs, _no_device_plugin = prom.monitor_jobs(documents, listeners, ca_file=str(ca_file),
                                                    bearer_token_file=str(token_file))
        (rule,) = [d for d in documents if d["kind"] == "PrometheusRule"]
        rules = directory / "kube-vgpu.rules.yaml"
        rules.write_text(yaml.safe_dump(prom.rules_document(rule), sort_keys=False))
        config = prom.write_config(directory, prom.scrape_config(jobs, rule_files=[str(rules)],
                                                                 interval_s=PROMETHEUS_INTERVAL_S))
        self._spawn("prometheus", prom.command(Path(self._binary("prometheus")), config, directory / "data",
                                               self.ports["prometheus"]))
        url = f"{self.prometheus_url}/-/ready"
        self._wait_ready("prometheus", url, lambda: _probe(url, None, _ok_200))

    def _start_heartbeat(self) -> None:
        ready_file = self.state_dir / "heartbeat.ready"
        ready_file.unlink(missing_ok=True)
        argv = [
            sys.executable,
            "-m",
            "kube_vgpu.dev.devcluster.heartbeat",
            f"--kubeconfig={self.heartbeat_kubeconfig}",
            f"--nodes-file={self.nodes_file}",
            f"--interval-seconds={self.options.heartbeat_interval_s:g}",
            f"--ready-file={ready_file}",
        ]
        self._spawn("heartbeat", argv, env=self._python_env())
        self._wait_ready("heartbeat", f"its first node patch ({ready_file})",
                         lambda: None if ready_file.exists() else "no node patched yet")

    # --- driving a running cluster -------------------------------------------------------------------------------
    def stop_component(self, name: str, *, crash: bool = False) -> None:
        """Stop one component (SIGTERM, or SIGKILL at once with crash=True)."""
        with self._lock:
            record = self.records.get(name)
            if record is None:
                raise DevClusterError(f"{name} is not running in this dev cluster")
            process = self._popens.get(name)
            if crash:
                kill(record, process)
            else:
                stop(record, process)
            del self.records[name]
            self._popens.pop(name, None)
            self._save_state()

    def start_component(self, name: str) -> None:
        """Start a stopped component again, with the same command line (same port, certificates, arguments), and
        wait until it is ready the way start-up did. For the components in RESTARTABLE; etcd and kube-apiserver
        hold the cluster's state and are not restartable here."""
        if name not in RESTARTABLE:
            raise DevClusterError(f"{name} cannot be restarted on its own")
        with self._lock:
            if name not in self._argv:
                raise DevClusterError(f"{name} was never started in this dev cluster")
            if self.is_running(name):
                raise DevClusterError(f"{name} is already running")
            if name == "heartbeat":
                (self.state_dir / "heartbeat.ready").unlink(missing_ok=True)
            self._spawn(name, self._argv[name], env=self._env.get(name))
        what, probe = self._probes[name]
        self._wait_ready(name, what, probe)

    def start_extender(self) -> None:
        """Start the extender again (same port and arguments) and wait until it has synced."""
        self.start_component("extender")

    def restart_extender(self, *, crash: bool = True, extra_args: Sequence[str] = ()) -> None:
        """Kill the extender (SIGKILL by default: a crash, no graceful shutdown) and start it again; `extra_args`
        are appended to its command line from now on (a later flag wins, e.g. --kubeconfig through a proxy)."""
        self.stop_component("extender", crash=crash)
        if extra_args:
            with self._lock:
                self._argv["extender"] = [*self._argv["extender"], *extra_args]
        self.start_extender()

    def restart_scheduler(self, *, with_extender: bool) -> None:
        """Run kube-scheduler again, with or without the extenders block (throughput comparison)."""
        self.stop_component("kube-scheduler")
        self.start_scheduler(with_extender=with_extender)

    def start_scheduler(self, *, with_extender: bool) -> None:
        """Start kube-scheduler (after stop_component("kube-scheduler")) and wait until it is ready."""
        if with_extender and "extender" not in self.records:
            raise DevClusterError("the extender is not running")
        if self.is_running("kube-scheduler"):
            raise DevClusterError("kube-scheduler is already running")
        self._start_scheduler(with_extender=with_extender)

    def stopped_components(self) -> list[str]:
        """Components this cluster started that are not running now (stopped, or died)."""
        return [name for name in COMPONENTS if name in self._argv and not self.is_running(name)]

    def is_running(self, name: str) -> bool:
        record = self.records.get(name)
        return record is not None and is_running(record)

    def log_tail(self, name: str, lines: int = 40) -> str:
        return log_tail(self.log_dir / f"{name}.log", lines)

    # --- stopping ------------------------------------------------------------------------------------------------
    def stop(self) -> list[str]:
        """Stop every component this cluster started (reverse start order). Returns the ones that were running."""
        stopped: list[str] = []
        with self._lock:
            for name in reversed(COMPONENTS):
                record = self.records.pop(name, None)
                if record is None:
                    continue
                if stop(record, self._popens.pop(name, None)):
                    stopped.append(name)
            if self._api_client is not None:
                with contextlib.suppress(Exception):
                    self._api_client.close()
                self._api_client = None
            self._save_state()
        return stopped

    def __enter__(self) -> DevCluster:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    # --- the state file ------------------------------------------------------------------------------------------
    def _save_state(self) -> None:
        if not self._owns_state:
            return
        state = {
            "version": STATE_VERSION,
            "kubeconfig": str(self.kubeconfig),
            "server": self.server if "kube-apiserver" in self.ports else None,
            "ports": self.ports,
            "extender": self.options.extender,
            "webhook": self.options.webhook,
            "lifecycle": self.options.lifecycle,
            "processes": [record.to_json() for record in self.records.values()],
        }
        path = self.state_dir / STATE_FILE
        tmp = path.with_name(f".{STATE_FILE}.tmp-{os.getpid()}")
        tmp.write_bytes(orjson.dumps(state, option=orjson.OPT_INDENT_2))
        os.replace(tmp, path)


def read_state(state_dir: Path) -> list[ProcessRecord]:
    """The processes recorded in the state dir (empty when there is no readable state)."""
    try:
        state = orjson.loads((state_dir / STATE_FILE).read_bytes())
    except (OSError, orjson.JSONDecodeError):
        return []
    records = []
    for raw in state.get("processes") or [] if isinstance(state, dict) else []:
        with contextlib.suppress(KeyError, TypeError, ValueError):
            records.append(ProcessRecord.from_json(raw))
    return records


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM raises KeyboardInterrupt in the main thread for the duration (the default would end Python without
    running `finally`, leaving a half-started cluster behind); the previous handler is restored after."""

    def interrupt(_signum: int, _frame: object) -> None:
        raise KeyboardInterrupt("SIGTERM")

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def up(options: ClusterOptions) -> DevCluster:
    """Start a dev cluster; raises DevClusterError (after tearing down) when a component fails."""
    cluster = DevCluster(options)
    cluster.start()
    return cluster


def down(state_dir: Path) -> list[str]:
    """Stop the processes recorded in `state_dir` (by PID and start time; nothing else is touched).
    Returns the names of the ones that were still running."""
    records = read_state(state_dir)
    order = {name: position for position, name in enumerate(COMPONENTS)}
    stopped = []
    for record in sorted(records, key=lambda r: -order.get(r.name, len(order))):
        if stop(record):
            stopped.append(record.name)
    path = state_dir / STATE_FILE
    if path.exists():
        state = orjson.loads(path.read_bytes())
        state["processes"] = []
        path.write_bytes(orjson.dumps(state, option=orjson.OPT_INDENT_2))
    return stopped

