"""Prometheus metrics of the webhook. Each server owns its registry, so several servers in one test process do not
collide and /metrics shows only the webhook's own series."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# Admissions take tens of microseconds in-process; buckets resolve that and still catch a slow outlier.
ADMISSION_BUCKETS_SECONDS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5)


class WebhookMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.admissions = Counter(
            "kube_vgpu_webhook_admissions",
            "Admission reviews answered, by operation and result (allowed, mutated, denied, malformed).",
            ["operation", "result"],
            registry=self.registry,
        )
        self.admission_duration = Histogram(
            "kube_vgpu_webhook_admission_duration_seconds",
            "Time to answer one admission review inside the server (body read to response built).",
            ["result"],
            buckets=ADMISSION_BUCKETS_SECONDS,
            registry=self.registry,
        )
        self.warnings = Counter(
            "kube_vgpu_webhook_warnings",
            "Admission warnings returned (pod-supplied limit env overridden, foreign scheduler, ...).",
            registry=self.registry,
        )
        self.certificate_reloads = Counter(
            "kube_vgpu_webhook_certificate_reloads",
            "Serving certificate reloads after the files changed, by result (success, failure).",
            ["result"],
            registry=self.registry,
        )
        # both results exported from the start (0), so an alert on increase() sees the first failure too
        for result in ("success", "failure"):
            self.certificate_reloads.labels(result)
        self.certificate_expiry = Gauge(
            "kube_vgpu_webhook_certificate_expiry_timestamp_seconds",
            "notAfter of the serving certificate in use (POSIX seconds); alert well before it passes.",
            registry=self.registry,
        )
        self.connections = Gauge(
            "kube_vgpu_webhook_connections",
            "Open client connections, TLS handshakes included (at most --max-connections).",
            registry=self.registry,
        )
        self.connections_closed = Counter(
            "kube_vgpu_webhook_connections_closed",
            "Connections the server closed or refused itself, by reason (evicted: the longest-idle one, to make room "
            "at the cap; refused: at the cap with every connection mid-request; header_timeout, idle_timeout, "
            "handshake_failed, shutdown).",
            ["reason"],
            registry=self.registry,
        )
        # exported at 0 from the start, so an alert on increase() sees the first one too
        for reason in ("evicted", "refused"):
            self.connections_closed.labels(reason)
        self.requests_refused = Counter(
            "kube_vgpu_webhook_requests_refused",
            "Admission requests answered with an error before review, by reason (body_timeout: 408, busy: 503 when "
            "no request slot freed in time, too_large: 413, disconnected: the client left mid-body).",
            ["reason"],
            registry=self.registry,
        )
