"""`kube-vgpu webhook`: serve the admission webhook over HTTPS.

    kube-vgpu webhook --port 8443 --tls-cert-file /tls/tls.crt --tls-key-file /tls/tls.key
    kube-vgpu webhook --port 8443 --self-signed-dir DIR    # development: CA + localhost cert in DIR, CA on stdout

Readiness: GET https://<host>:<port>/healthz answers 200 once connections are accepted.
"""

from __future__ import annotations

import argparse
import logging
import os
import ssl
import sys
from typing import TYPE_CHECKING

from kube_vgpu.protocol import (
    DEFAULT_LIMITER_LD_SO_PRELOAD_PATH,
    DEFAULT_LIMITER_LIBRARY_PATH,
    DEFAULT_SCHEDULER_NAME,
    LABEL_KUEUE_QUEUE_NAME,
    LABEL_LIMITER,
)
from kube_vgpu.webhook.config import (
    DEFAULT_CACHE_DIR,
    DEFAULT_MAX_GPUS_PER_POD,
    DEFAULT_TRUSTED_USERNAMES,
    ConnectionLimits,
    LimiterMode,
    WebhookConfig,
)
from kube_vgpu.webhook.tls import DEFAULT_RELOAD_INTERVAL_S

if TYPE_CHECKING:
    from kube_vgpu.webhook.owners import OwnerResolver


def add_arguments(parser: argparse.ArgumentParser) -> None:
    serve = parser.add_argument_group("serving")
    serve.add_argument("--host", default="0.0.0.0", help="address to listen on (default: %(default)s)")
    serve.add_argument("--port", type=int, default=8443, help="HTTPS port; 0 picks a free one (default: %(default)s)")
    serve.add_argument("--tls-cert-file", help="serving certificate (PEM), re-read when it changes")
    serve.add_argument("--tls-key-file", help="its private key (PEM)")
    serve.add_argument(
        "--self-signed-dir",
        help="development: create (or reuse) a CA and a serving cert for localhost in this directory, print the CA "
        "bundle on stdout and serve with them",
    )
    serve.add_argument("--hostname", action="append", default=[], help="with --self-signed-dir: extra DNS name")
    serve.add_argument("--ip", action="append", default=[], help="with --self-signed-dir: extra IP address")
    serve.add_argument(
        "--cert-reload-interval-seconds",
        type=float,
        default=DEFAULT_RELOAD_INTERVAL_S,
        help="how often the certificate files are checked for changes (default: %(default)s)",
    )
    serve.add_argument(
        "--shutdown-delay-seconds",
        type=float,
        default=0.0,
        help="on SIGTERM, report not-ready on /readyz and keep answering this long before stopping, so the API "
        "server stops sending here first (a second SIGTERM stops at once) (default: %(default)s)",
    )
    defaults = ConnectionLimits()
    serve.add_argument(
        "--max-connections",
        type=int,
        default=defaults.max_connections,
        help="open connections at most (each TLS connection holds ~0.27 MiB); at the cap a new one replaces the "
        "longest-idle one (default: %(default)s)",
    )
    serve.add_argument(
        "--max-concurrent-requests",
        type=int,
        default=defaults.max_concurrent_requests,
        help="admission requests read and reviewed at once (each may buffer 8 MiB); more wait for a slot "
        "(default: %(default)s)",
    )
    serve.add_argument(
        "--header-timeout-seconds",
        type=float,
        default=defaults.header_timeout_s,
        help="close a connection whose TLS handshake and first request head take longer (default: %(default)s)",
    )
    serve.add_argument(
        "--idle-timeout-seconds",
        type=float,
        default=defaults.idle_timeout_s,
        help="close a connection with no complete request head this long after its last response "
        "(default: %(default)s)",
    )
    serve.add_argument(
        "--body-timeout-seconds",
        type=float,
        default=defaults.body_timeout_s,
        help="answer 408 to a request whose body takes longer to arrive (default: %(default)s)",
    )
    serve.add_argument("--kubeconfig", metavar="FILE",
                       help="API access for reading pods' owners (default: in-cluster when running in a Pod)")
    serve.add_argument("--inherit-queue", action=argparse.BooleanOptionalAction, default=True,
                       help="give a GPU pod without kueue.x-k8s.io/queue-name (or priority-class) its controller "
                            "owners' (Job, JobSet, ...; read from the API server) (default: on)")
    serve.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    serve.add_argument("--access-log", action="store_true", help="log every request (off: it costs latency)")

    policy = parser.add_argument_group("admission policy")
    policy.add_argument("--scheduler-name", default=DEFAULT_SCHEDULER_NAME, help="default: %(default)s")
    policy.add_argument("--max-gpus-per-pod", type=int, default=DEFAULT_MAX_GPUS_PER_POD, help="default: %(default)s")
    policy.add_argument(
        "--limiter-mode",
        choices=[mode.value for mode in LimiterMode],
        default=LimiterMode.LD_PRELOAD.value,
        help="how GPU containers load the limiter library: LD_PRELOAD env + a hostPath mount (ld-preload), an "
        "/etc/ld.so.preload hostPath mount (ld-so-preload), LD_PRELOAD env with the device plugin mounting the "
        "library (device-plugin: no hostPath, Pod Security baseline works), or none (the cluster provides it) "
        "(default: %(default)s)",
    )
    policy.add_argument("--limiter-library-path", default=DEFAULT_LIMITER_LIBRARY_PATH, help="default: %(default)s")
    policy.add_argument(
        "--limiter-ld-so-preload-path",
        default=DEFAULT_LIMITER_LD_SO_PRELOAD_PATH,
        help="host file mounted at /etc/ld.so.preload in ld-so-preload mode (default: %(default)s)",
    )
    policy.add_argument(
        "--limiter-node-label",
        default=LABEL_LIMITER,
        help="node label the device plugin sets where the limiter is installed: GPU pods that load the limiter from "
        "the node (every mode but none) get a required node affinity on it ('' = no affinity, e.g. nodes where you "
        "install the library yourself) (default: %(default)s)",
    )
    policy.add_argument("--cache-dir", default=DEFAULT_CACHE_DIR, help="limiter cache directory (default: %(default)s)")
    policy.add_argument(
        "--trusted-user",
        action="append",
        default=None,
        help="user allowed to write kube-vgpu's internal pod annotations (repeatable; default: "
        f"{', '.join(sorted(DEFAULT_TRUSTED_USERNAMES))})",
    )


def config_from_args(args: argparse.Namespace) -> WebhookConfig:
    return WebhookConfig(
        scheduler_name=args.scheduler_name,
        max_gpus_per_pod=args.max_gpus_per_pod,
        limiter_mode=LimiterMode(args.limiter_mode),
        limiter_library_path=args.limiter_library_path,
        limiter_ld_so_preload_path=args.limiter_ld_so_preload_path,
        limiter_node_label=args.limiter_node_label,
        cache_dir=args.cache_dir,
        trusted_usernames=frozenset(args.trusted_user) if args.trusted_user else DEFAULT_TRUSTED_USERNAMES,
    )


def limits_from_args(args: argparse.Namespace) -> ConnectionLimits:
    return ConnectionLimits(
        max_connections=args.max_connections,
        header_timeout_s=args.header_timeout_seconds,
        idle_timeout_s=args.idle_timeout_seconds,
        body_timeout_s=args.body_timeout_seconds,
        max_concurrent_requests=args.max_concurrent_requests,
    )


def _owner_resolver(args: argparse.Namespace) -> OwnerResolver | None:
    """Owners are read with --kubeconfig, or in-cluster; without either, pods keep only their own queue label (said
    at start-up, not silently)."""
    log = logging.getLogger("kube_vgpu.webhook")
    if not args.inherit_queue:
        return None
    from kubernetes import client, config

    from kube_vgpu.webhook.owners import OwnerResolver, api_fetch

    configuration = client.Configuration()
    try:
        if args.kubeconfig:
            config.load_kube_config(args.kubeconfig, client_configuration=configuration)
        elif os.environ.get("KUBERNETES_SERVICE_HOST"):
            config.load_incluster_config(client_configuration=configuration)
        else:
            log.warning("no --kubeconfig and not in a cluster: pods created by Jobs and other controllers keep only "
                        "their own %s label (their owners' is not read)", LABEL_KUEUE_QUEUE_NAME)
            return None
    except Exception as exc:  # an unreadable kubeconfig is a start-up error
        raise SystemExit(f"kube-vgpu webhook: cannot load API access for reading owners: {exc}") from None
    return OwnerResolver(api_fetch(client.ApiClient(configuration)))


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = config_from_args(args)
        limits = limits_from_args(args)
    except ValueError as exc:
        print(f"kube-vgpu webhook: {exc}", file=sys.stderr)
        return 2
    if args.self_signed_dir:
        if args.tls_cert_file or args.tls_key_file:
            print("kube-vgpu webhook: give either --self-signed-dir or --tls-cert-file/--tls-key-file", file=sys.stderr)
            return 2
        from kube_vgpu.webhook.certs import DEFAULT_HOSTNAMES, DEFAULT_IPS, ensure_ca_and_serving_cert

        paths = ensure_ca_and_serving_cert(
            args.self_signed_dir, [*DEFAULT_HOSTNAMES, *args.hostname], [*DEFAULT_IPS, *args.ip]
        )
        cert_file, key_file = str(paths.cert), str(paths.key)
        sys.stdout.write(paths.ca_pem.decode())
        sys.stdout.flush()
    elif args.tls_cert_file and args.tls_key_file:
        cert_file, key_file = args.tls_cert_file, args.tls_key_file
    else:
        print(
            "kube-vgpu webhook: HTTPS only: give --tls-cert-file and --tls-key-file, or --self-signed-dir DIR",
            file=sys.stderr,
        )
        return 2

    from kube_vgpu.webhook.server import WebhookServer, return_freed_buffers_to_the_os  # loads FastAPI, uvicorn

    return_freed_buffers_to_the_os()

    owners = _owner_resolver(args)
    try:
        server = WebhookServer(
            config,
            cert_file=cert_file,
            key_file=key_file,
            host=args.host,
            port=args.port,
            reload_interval_s=args.cert_reload_interval_seconds,
            log_level=args.log_level,
            access_log=args.access_log,
            shutdown_delay_s=args.shutdown_delay_seconds,
            limits=limits,
            owners=owners,
        )
    except (OSError, ssl.SSLError) as exc:
        print(f"kube-vgpu webhook: cannot serve: {exc}", file=sys.stderr)
        return 1
    logging.getLogger("kube_vgpu.webhook").info(
        "serving https://%s:%d/mutate (scheduler %s, limiter %s)",
        args.host,
        server.port,
        config.scheduler_name,
        config.limiter_mode.value,
    )
    server.run()
    return 0
