"""`kube-vgpu extender`: the scheduler extender service."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kube_vgpu import protocol
from kube_vgpu.extender.engine.policies import DEFAULT_GPU_POLICY, DEFAULT_NODE_POLICY, policy_names
from kube_vgpu.extender.gangs import DEFAULT_TIMEOUT_S as DEFAULT_GANG_TIMEOUT_S
from kube_vgpu.extender.gangs import MAX_TIMEOUT_S as MAX_GANG_TIMEOUT_S
from kube_vgpu.extender.gangs import MIN_TIMEOUT_S as MIN_GANG_TIMEOUT_S
from kube_vgpu.extender.gates import ClusterSource, Gate
from kube_vgpu.extender.gcpolicy import freeze_survivors
from kube_vgpu.extender.preemption.nominations import Nominations
from kube_vgpu.extender.scheduler import Binder, Scheduler
from kube_vgpu.extender.state import ClusterState

if TYPE_CHECKING:
    from kube_vgpu.extender.fence import LeaderFence

log = logging.getLogger("kube_vgpu.extender")
#: see run(): how long a thread may hold the GIL while another waits for it (CPython's default is 5 ms)
GIL_SWITCH_INTERVAL_S = 0.0005
#: on SIGTERM, binds in flight get this long to finish (the longest bind's API calls), then are cancelled, which
#: releases what they reserved (extender/binding.py); inside the Pod's 30 s terminationGracePeriodSeconds
GRACEFUL_SHUTDOWN_S = 22


def add_arguments(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group()
    source.add_argument(
        "--snapshot", metavar="FILE", help="serve a `kind: List` of Nodes and Pods; binds stay in memory"
    )
    source.add_argument("--kubeconfig", metavar="FILE", help="live mode against this cluster (default: in-cluster)")
    parser.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: the sidecar case)"
    )
    parser.add_argument("--port", type=int, default=8888)
    parser.add_argument("--metrics-host", default="0.0.0.0",
                        help="address of the separate /metrics, /healthz, /readyz listener")
    parser.add_argument("--metrics-port", type=int, default=0,
                        help="port of that listener (0 = off; the verbs' port serves them too)")
    parser.add_argument("--metrics-per-pod-gpu", choices=["on", "off"], default="on",
                        help="export the per-pod-and-GPU allocation gauges (kube_vgpu_pod_*_allocated*): a third of "
                             "/metrics' series at 40,000 pods; the per-pod GPU-seconds counters and the per-node, "
                             "namespace and ClusterQueue gauges are exported either way")
    parser.add_argument(
        "--policy", default=DEFAULT_NODE_POLICY, help="default node policy (hami.io/node-scheduler-policy)"
    )
    parser.add_argument(
        "--gpu-policy", default=DEFAULT_GPU_POLICY, help="default GPU policy (hami.io/gpu-scheduler-policy)"
    )
    parser.add_argument(
        "--heartbeat-ttl-seconds",
        type=float,
        default=120.0,
        help="inventory older than this makes a node unschedulable for GPU pods",
    )
    parser.add_argument("--quota-mode", choices=("auto", "enforce", "kueue", "off"), default="auto",
                        help="who admits pods against Kueue's queues: enforce (our gate, with Kueue's objects and no "
                             "Kueue controller), kueue (Kueue's controller admits Workloads; we place the pods of "
                             "admitted ones and report what landed), off, or auto (kueue when Kueue's controller is "
                             "installed, else enforce); docs/quota.md, Quota modes")
    parser.add_argument("--force-quota-mode", action="store_true",
                        help="run --quota-mode=enforce even though Kueue's controller is installed (two admission "
                             "layers; refused without this)")
    parser.add_argument("--quota-config", metavar="FILE", help="Kueue ClusterQueue / LocalQueue / ResourceFlavor YAML")
    parser.add_argument("--quota-unqueued", choices=("admit", "default", "refuse"), default="admit",
                        help="pods without a kueue.x-k8s.io/queue-name label: admit them uncounted, use the "
                             "namespace's LocalQueue named 'default' (as Kueue), or refuse them")
    parser.add_argument("--quota-check-strategy", choices=("BlockUndeclared", "IgnoreUndeclared"),
                        default="BlockUndeclared",
                        help="Kueue's resources.quotaCheckStrategy: BlockUndeclared (Kueue's default) admits no pod "
                             "naming a GPU resource its ClusterQueue does not cover; IgnoreUndeclared checks only "
                             "the covered ones")
    parser.add_argument("--fair-sharing", action=argparse.BooleanOptionalAction, default=False,
                        help="Kueue's fair sharing (its Configuration's fairSharing.enable): ClusterQueues and "
                             "Cohorts' spec.fairSharing.weight order admission across a cohort by dominant "
                             "resource share, and preemption between borrowing queues uses Kueue's fair-sharing "
                             "strategies (docs/quota.md)")
    parser.add_argument("--fair-sharing-preemption-strategies", type=_fair_strategies,
                        default="LessThanOrEqualToFinalShare,LessThanInitialShare",
                        help="with --fair-sharing: Kueue's fairSharing.preemptionStrategies, comma-separated: "
                             "LessThanOrEqualToFinalShare,LessThanInitialShare (Kueue's default), "
                             "LessThanOrEqualToFinalShare, or LessThanInitialShare")
    parser.add_argument("--require-admission-mark", action=argparse.BooleanOptionalAction, default=None,
                        help="refuse GPU pods without the webhook's kube-vgpu.io/admitted annotation (they skipped "
                             "the webhook, so no limiter is set up; default: on in live mode, off with --snapshot)")
    parser.add_argument("--fence-lease", metavar="NAMESPACE/NAME", default="",
                        help="kube-scheduler's leader Lease: bind only while this replica's kube-scheduler holds it "
                             "(several scheduler replicas; off when empty)")
    parser.add_argument("--fence-identity-prefix", default="",
                        help="holderIdentity prefix of this replica's kube-scheduler (default: $POD_NAME + '_', "
                             "as kube-scheduler names itself <hostname>_<uuid>)")
    parser.add_argument("--gang-timeout-seconds", type=float, default=DEFAULT_GANG_TIMEOUT_S,
                        help="a gang's plan not fully bound within this long releases its reservations (a gang's "
                             f"pods may set their own with the annotation {protocol.ANNOTATION_GANG_TIMEOUT_SECONDS})")
    parser.add_argument("--gang-topology-labels", default=",".join(protocol.DEFAULT_GANG_TOPOLOGY_LABELS),
                        help="node labels, narrowest first, whose values a gang spanning nodes prefers to share "
                             "(comma-separated; empty: no preference)")
    parser.add_argument("--preemption", action=argparse.BooleanOptionalAction, default=True,
                        help="evict lower-priority pods for a pod that fits no node's GPUs (PriorityClass rules; "
                             "Kueue's withinClusterQueue between pods of one ClusterQueue); through the Eviction "
                             "API, so PodDisruptionBudgets hold")
    parser.add_argument("--log-level", default="INFO")


@dataclass
class Extender:
    state: ClusterState
    scheduler: Scheduler
    app: Any
    source: ClusterSource


def _fair_strategies(value: str | tuple[str, ...]) -> tuple[str, ...]:
    """argparse type (and the default's, which argparse passes as given when it is a string)."""
    if isinstance(value, tuple):
        return value
    from kube_vgpu.extender.preemption.fairsharing import parse_strategies

    try:
        return parse_strategies(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """The extender's configuration from command-line words, exactly as `kube-vgpu extender` reads them (tests and
    tools build one through here, so every option has its real default)."""
    parser = argparse.ArgumentParser(prog="kube-vgpu extender")
    add_arguments(parser)
    return parser.parse_args(list(argv))


def admission_mark_required(args: argparse.Namespace) -> bool:
    """On in live mode unless turned off; off for a snapshot (its pods never met a webhook) unless turned on."""
    explicit: bool | None = args.require_admission_mark
    return explicit if explicit is not None else not args.snapshot


def gang_timeout_s(args: argparse.Namespace) -> float:
    value: float = args.gang_timeout_seconds
    if not MIN_GANG_TIMEOUT_S <= value <= MAX_GANG_TIMEOUT_S:
        raise SystemExit(f"kube-vgpu extender: --gang-timeout-seconds must be from {MIN_GANG_TIMEOUT_S:g} to "
                         f"{MAX_GANG_TIMEOUT_S:g}, got {value:g}")
    return value


def gang_topology_labels(args: argparse.Namespace) -> tuple[str, ...]:
    text: str = args.gang_topology_labels
    return tuple(label.strip() for label in text.split(",") if label.strip())


def _build_fence(
    args: argparse.Namespace, api_client: Any, source: ClusterSource
) -> tuple[LeaderFence | None, Callable[[], None]]:
    """The leader fence and what starts its Lease watch; (None, a no-op) without --fence-lease."""
    lease: str = args.fence_lease
    if not lease:
        return None, lambda: None
    from kube_vgpu.extender.fence import LeaderFence
    from kube_vgpu.extender.sources.apiclient import DEFAULT_TIMEOUTS
    from kube_vgpu.extender.sources.lease import LeaseWatcher
    from kube_vgpu.extender.sources.live import LiveSource

    namespace, _, name = lease.partition("/")
    if not namespace or not name:
        raise ValueError(f"--fence-lease must be NAMESPACE/NAME, got {lease!r}")
    if api_client is None or not isinstance(source, LiveSource):
        raise ValueError("--fence-lease needs live mode (--kubeconfig or in-cluster), not --snapshot")
    prefix = args.fence_identity_prefix or (f"{os.environ['POD_NAME']}_" if os.environ.get("POD_NAME") else "")
    if not prefix:
        raise ValueError("--fence-lease needs --fence-identity-prefix or $POD_NAME (the downward API's metadata.name)")
    fence = LeaderFence(prefix, write_window_s=DEFAULT_TIMEOUTS.bind_s)
    fence.request_relist = lambda done: source.request_relist("pods", done)
    watcher = LeaseWatcher(fence, api_client, namespace, name)
    return fence, watcher.start


def _quota_mode(args: argparse.Namespace, api_client: Any) -> str:
    """--quota-mode resolved (auto looks for Kueue's controller in a live cluster); QuotaModeError if refused."""
    from kube_vgpu.extender.quota.factory import read_kueue_evidence, resolve_quota_mode

    requested: str = args.quota_mode
    evidence = read_kueue_evidence(api_client) if api_client is not None and requested in ("auto", "enforce") else None
    mode = resolve_quota_mode(requested, live=api_client is not None, evidence=evidence,
                              force=args.force_quota_mode)
    if requested == "auto" or evidence:
        log.info("quota mode %s%s", mode, f" ({evidence})" if evidence else "")
    return mode


def unused_quota_flags(args: argparse.Namespace, mode: str) -> list[str]:
    """The quota gate's flags given with a mode that has no gate of ours (kueue: Kueue's controller admits; off):
    said in the log, never silently ignored."""
    if mode == "enforce":
        return []
    given = [("--quota-config", bool(args.quota_config)), ("--quota-unqueued", args.quota_unqueued != "admit"),
             ("--quota-check-strategy", args.quota_check_strategy != "BlockUndeclared"),
             ("--fair-sharing", bool(args.fair_sharing)), ("--force-quota-mode", bool(args.force_quota_mode))]
    return [flag for flag, set_ in given if set_]


def build(args: argparse.Namespace, *, clock: Callable[[], float] = time.time) -> Extender:
    """Everything but the HTTP listener; tests and the dev cluster build in-process through this. `clock` (POSIX
    seconds) is what the state reads for heartbeat ages and usage accounting; tests pass their own."""
    from kube_vgpu.extender.server import create_app
    from kube_vgpu.extender.sources.metrics import SourceCollector

    known = policy_names()
    for name in (args.policy, args.gpu_policy):
        if name not in known:
            raise SystemExit(f"kube-vgpu extender: unknown policy {name!r}; known: {', '.join(known)}")
    # a snapshot is a still picture: its heartbeats are as old as the file, never "stale"
    ttl_s = float("inf") if args.snapshot else args.heartbeat_ttl_seconds
    state = ClusterState(heartbeat_ttl_s=ttl_s, freeze_gc_when_synced=True, clock=clock)
    gates: list[Gate] = []
    quota_config: str | None = args.quota_config
    source: ClusterSource
    binder: Binder
    api_client = None
    if not args.snapshot:
        from kube_vgpu.extender.sources.live import make_api_client

        api_client = make_api_client(args.kubeconfig)
    # the gate before the source: it learns each pod (CPU, memory, priority) as the state receives it, and a
    # snapshot's pods arrive when the source is built
    quota_mode = _quota_mode(args, api_client)
    for flag in unused_quota_flags(args, quota_mode):
        log.warning("quota mode %s: %s is not used (it configures kube-vgpu's own quota gate, which runs only in "
                    "mode enforce)", quota_mode, flag)
    if quota_mode == "kueue":
        from kube_vgpu.extender.quota.factory import build_kueue_mode_gate

        assert api_client is not None  # resolve_quota_mode refuses kueue without a cluster
        gates.append(build_kueue_mode_gate(state, api_client))
    elif quota_mode == "enforce" and (quota_config or api_client is not None):
        from kube_vgpu.extender.quota.factory import build_gate

        gate = build_gate(state, quota_config=quota_config, api_client=api_client, unqueued=args.quota_unqueued,
                          fair_sharing=args.fair_sharing, quota_check_strategy=args.quota_check_strategy,
                          fair_sharing_strategies=_fair_strategies(args.fair_sharing_preemption_strategies))
        if gate is not None:
            gates.append(gate)
    # preemption's facts of running pods (priority, start), listening before a snapshot's pods arrive
    nominations = Nominations(clock=state.clock)
    state.pod_listeners.append(nominations.on_pod)
    if args.snapshot:
        from kube_vgpu.extender.sources.snapshot import SnapshotCluster, load_snapshot

        snapshot = SnapshotCluster(state, load_snapshot(args.snapshot))
        source, binder = snapshot, snapshot
    else:
        from kube_vgpu.extender.sources.live import LiveBinder, LiveSource

        assert api_client is not None  # made above in live mode
        source = LiveSource(state, api_client)
        binder = LiveBinder(api_client)
    fence, start_fence = _build_fence(args, api_client, source)
    scheduler = Scheduler(state, binder, node_policy=args.policy, gpu_policy=args.gpu_policy, gates=gates,
                          require_admission_mark=admission_mark_required(args), fence=fence,
                          gang_timeout_s=gang_timeout_s(args), gang_topology_labels=gang_topology_labels(args),
                          nominations=nominations)
    if args.preemption:
        if args.snapshot:
            scheduler.enable_preemption(snapshot, inline=True)  # the snapshot evicts from itself, at once
        else:
            from kube_vgpu.extender.sources.evictor import LiveEvictor

            assert api_client is not None
            scheduler.enable_preemption(LiveEvictor(api_client))
    if not args.snapshot:
        from kube_vgpu.extender.binding import BindOrdering
        from kube_vgpu.extender.sources.apiclient import DEFAULT_TIMEOUTS

        # a bind's wait for its node's turn plus its own API calls fit in kube-scheduler's httpTimeout
        scheduler.ordering = BindOrdering(turn_wait_limit_s=DEFAULT_TIMEOUTS.turn_wait_limit_s)
    # the source's watches and those of gates that have their own (quota: Kueue objects in live mode) start with the app
    def start_all() -> None:
        source.start()
        start_fence()
        for started in gates:
            started.start()

    app = create_app(scheduler, on_startup=start_all, metrics_per_pod_gpu=args.metrics_per_pod_gpu == "on")
    app.state.registry.register(SourceCollector(state, source.health))
    return Extender(state, scheduler, app, source)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        extender = build(args)
    except (OSError, ValueError) as exc:
        print(f"kube-vgpu extender: {exc}", file=sys.stderr)
        return 2
    mode = f"snapshot {args.snapshot}" if args.snapshot else "live"
    log.info(
        "serving on %s:%d (%s, node policy %s, GPU policy %s)", args.host, args.port, mode, args.policy, args.gpu_policy
    )
    if args.metrics_port:
        from kube_vgpu.extender.server import serve_probes

        serve_probes(extender.app.state.registry, extender.scheduler, args.metrics_host, args.metrics_port,
                     render=extender.app.metrics_render,  # shared with the verbs' port, pausing for the verbs
                     state_render=extender.app.state_render,
                     send_pause=extender.app.activity.pause)  # the bodies go out between verbs
        log.info("metrics and probes on %s:%d", args.metrics_host, args.metrics_port)
    # Binds finish their API call in worker threads while the event loop answers filter and prioritize. With the
    # default 5 ms switch interval a thread whose reply has arrived waits up to 5 ms for the GIL, and binds to one
    # node run one after another: a burst onto one node measured 105 pods/s with 5 ms, 136 with 0.5 ms.
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    freeze_survivors()  # full collections scan only what survived the last one (kube_vgpu.extender.gcpolicy)
    uvicorn.run(extender.app, host=args.host, port=args.port, log_level="warning", access_log=False,
                timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)
    return 0
