"""Live mode's Evictor: a preemption carried out through the API server (the interface: preemption/evict.py).

For one victim, in kube-scheduler's order (DefaultPreemption's PrepareCandidate), each call bounded by
`ApiTimeouts.evict_s` (client side, and the API server's own `timeout` so a write cannot land after we gave up):

1. PATCH pods/{name}/status (strategic merge): the DisruptionTarget condition, reason PreemptionByScheduler. The
   patch carries the victim's `metadata.uid`: the UID is immutable, so the API server refuses the patch (422,
   cause `metadata.uid`) when the pod of that name is another one. That is the UID precondition a patch allows,
   in one call and without a read-then-write race.
2. POST pods/{name}/eviction (policy/v1 Eviction) with `deleteOptions.preconditions.uid`. The Eviction API checks
   PodDisruptionBudgets: a refusal is 429 (cause DisruptionBudget) and is BLOCKED, never forced; a 429 of the API
   server's flow control is no refusal and is FAILED. Nothing here ever deletes a pod directly.
   The Eviction API writes its own DisruptionTarget condition (reason EvictionByEvictionAPI) over ours before
   deleting, so once the eviction is accepted ours is written once more (best effort: the pod may be gone).
3. Events (events.k8s.io/v1): "Preempted" on the victim, "Preempting" on the preemptor. Failures are logged and
   change nothing.

Raw JSON bodies through the kubernetes client's own connection pool and credentials, as LiveBinder does.
"""

from __future__ import annotations

import datetime as dt
import logging
import math
import socket
import time
from typing import Any

import orjson
from kubernetes import client

from kube_vgpu.extender.preemption.evict import (
    DISRUPTION_TARGET,
    PREEMPTION_BY_SCHEDULER,
    REASON_PREEMPTED,
    REASON_PREEMPTING,
    REPORTING_CONTROLLER,
    EvictionOutcome,
    EvictionRequest,
    EvictionResult,
    condition_message,
    preemptor_event_message,
    truncate_note,
    victim_event_message,
)
from kube_vgpu.extender.sources.apiclient import DEFAULT_TIMEOUTS, ApiTimeouts, read_body, urllib3_timeout
from kube_vgpu.protocol import DEFAULT_SCHEDULER_NAME

log = logging.getLogger(__name__)

#: reportingInstance is at most 128 characters (API server validation)
REPORTING_INSTANCE_LIMIT = 128
#: an Event's name is a DNS subdomain (at most 253 characters): "<pod name>.<nanoseconds in hex>"
EVENT_NAME_LIMIT = 253


def _status_message(data: bytes) -> str:
    """The `message` of a metav1.Status body, else the body's text (shortened)."""
    try:
        document = orjson.loads(data)
    except orjson.JSONDecodeError:
        document = None
    if isinstance(document, dict) and isinstance(document.get("message"), str):
        return str(document["message"])
    return data.decode(errors="replace")[:500]


def _budget_refusal(data: bytes) -> str | None:
    """The refusal's words when a 429 is a PodDisruptionBudget's (the Eviction API names the cause
    `DisruptionBudget`: the budget has no disruption left, or its controller has not counted it yet), else None: a
    429 from the API server's own flow control ("Too many requests", plain text) is not a refusal, only a failure."""
    try:
        document = orjson.loads(data)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(document, dict):
        return None
    message = str(document.get("message") or "")
    details = document.get("details")
    causes = [c for c in (details.get("causes") or [] if isinstance(details, dict) else []) if isinstance(c, dict)]
    budget = [str(c.get("message") or "") for c in causes if c.get("reason") == "DisruptionBudget"]
    if not budget and "disruption budget" not in message:
        return None
    # "Cannot evict pod as it would violate the pod's disruption budget." plus which budget and why
    return " ".join([message, *(m for m in budget if m)]).strip()


def _uid_refused(data: bytes) -> bool:
    """Whether a 422 names `metadata.uid`: the patch's UID differs from the pod's (another pod of that name)."""
    try:
        document = orjson.loads(data)
    except orjson.JSONDecodeError:
        return False
    details = document.get("details") if isinstance(document, dict) else None
    causes = details.get("causes") if isinstance(details, dict) else None
    return any(isinstance(cause, dict) and cause.get("field") == "metadata.uid" for cause in causes or [])


class LiveEvictor:
    """Evictor over the API server (see the module docstring). Thread-safe: each call is independent."""

    def __init__(
        self,
        api_client: client.ApiClient,
        *,
        scheduler_name: str = DEFAULT_SCHEDULER_NAME,
        reporting_instance: str | None = None,
        timeouts: ApiTimeouts = DEFAULT_TIMEOUTS,
    ) -> None:
        self.api_client = api_client
        self.scheduler_name = scheduler_name
        # as client-go's event recorder names its instance: the controller and the host (the pod's name in-cluster)
        instance = reporting_instance or f"{REPORTING_CONTROLLER}-{socket.gethostname()}"
        self.reporting_instance = instance[:REPORTING_INSTANCE_LIMIT]
        self.timeouts = timeouts

    # --- Evictor ----------------------------------------------------------------------------------
    def evict(self, request: EvictionRequest) -> EvictionResult:
        try:
            result = self._evict(request)
        except Exception as exc:  # the interface never raises: an unexpected failure is a FAILED result
            log.exception("evicting pod %s/%s failed", request.namespace, request.name)
            result = EvictionResult(EvictionOutcome.FAILED, f"{type(exc).__name__}: {exc}")
        log.info(
            "eviction of pod %s/%s (uid %s) for %s/%s on node %s: %s%s",
            request.namespace, request.name, request.uid, request.preemptor_namespace, request.preemptor_name,
            request.node_name, result.outcome.value, f" ({result.detail})" if result.detail else "",
        )
        return result

    def _evict(self, request: EvictionRequest) -> EvictionResult:
        refused = self._mark(request)
        if refused is not None:
            return refused
        result = self._post_eviction(request)
        if result.outcome is EvictionOutcome.EVICTED:
            self._mark_again(request)
            self._record_events(request)
        return result

    # --- 1. the DisruptionTarget condition ------------------------------------------------------------
    def _condition_patch(self, request: EvictionRequest) -> dict[str, Any]:
        now = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        condition = {
            "type": DISRUPTION_TARGET,
            "status": "True",
            "reason": PREEMPTION_BY_SCHEDULER,
            "message": condition_message(request, self.scheduler_name),
            "lastTransitionTime": now,
        }
        # conditions merge by `type` in a strategic merge patch: an existing DisruptionTarget is replaced, the
        # other conditions stay; metadata.uid is the precondition (module docstring)
        return {"metadata": {"uid": request.uid}, "status": {"conditions": [condition]}}

    def _mark(self, request: EvictionRequest) -> EvictionResult | None:
        """None when the condition is written, else the result to return (GONE, FAILED)."""
        try:
            status, data = self._call(
                "PATCH",
                "/api/v1/namespaces/{namespace}/pods/{name}/status",
                {"namespace": request.namespace, "name": request.name},
                self._condition_patch(request),
                "application/strategic-merge-patch+json",
                f"marking pod {request.namespace}/{request.name}",
            )
        except Exception as exc:  # a timeout or a broken connection: nothing evicted, retried later
            return EvictionResult(EvictionOutcome.FAILED, f"marking DisruptionTarget: {type(exc).__name__}: {exc}")
        if 200 <= status < 300:
            return None
        if status == 404:
            return EvictionResult(EvictionOutcome.GONE, _status_message(data))
        if status == 422 and _uid_refused(data):
            return EvictionResult(EvictionOutcome.GONE, f"pod {request.namespace}/{request.name} has another UID")
        return EvictionResult(
            EvictionOutcome.FAILED, f"marking DisruptionTarget: HTTP {status}: {_status_message(data)}"
        )

    def _mark_again(self, request: EvictionRequest) -> None:
        """After the Eviction API replaced our condition with its own: ours again, so the pod says why."""
        refused = self._mark(request)
        if refused is not None:  # typically gone already: nothing left to say it on
            log.debug("pod %s/%s: DisruptionTarget not rewritten: %s", request.namespace, request.name, refused)

    # --- 2. the Eviction --------------------------------------------------------------------------
    def _post_eviction(self, request: EvictionRequest) -> EvictionResult:
        body = {
            "apiVersion": "policy/v1",
            "kind": "Eviction",
            "metadata": {"name": request.name, "namespace": request.namespace},
            "deleteOptions": {"preconditions": {"uid": request.uid}},
        }
        try:
            status, data = self._call(
                "POST",
                "/api/v1/namespaces/{namespace}/pods/{name}/eviction",
                {"namespace": request.namespace, "name": request.name},
                body,
                "application/json",
                f"evicting pod {request.namespace}/{request.name}",
            )
        except Exception as exc:  # a timeout or a broken connection: whether it took effect is unknown
            return EvictionResult(EvictionOutcome.FAILED, f"eviction: {type(exc).__name__}: {exc}")
        message = _status_message(data)
        if status in (200, 201):
            return EvictionResult(EvictionOutcome.EVICTED)
        if status == 429:
            refusal = _budget_refusal(data)
            if refusal is not None:  # never forced: the caller chooses other victims or waits
                return EvictionResult(EvictionOutcome.BLOCKED, refusal)
            return EvictionResult(EvictionOutcome.FAILED, f"eviction: HTTP 429 (API server busy): {message}")
        if status in (404, 409):  # gone, or the UID precondition failed: another pod of that name
            return EvictionResult(EvictionOutcome.GONE, message)
        return EvictionResult(EvictionOutcome.FAILED, f"eviction: HTTP {status}: {message}")

    # --- 3. events --------------------------------------------------------------------------------
    # events.k8s.io/v1, not core/v1: it is the API kube-scheduler records its own Preempted events with, so both
    # look alike (regarding/related, action, reportingController), and `kubectl events` / describe show it as any
    # other event. One Event per preemption, never a series: only `create` is needed, no `patch`.
    def _record_events(self, request: EvictionRequest) -> None:
        victim = {"apiVersion": "v1", "kind": "Pod", "namespace": request.namespace, "name": request.name,
                  "uid": request.uid}
        preemptor = {"apiVersion": "v1", "kind": "Pod", "namespace": request.preemptor_namespace,
                     "name": request.preemptor_name, "uid": request.preemptor_uid}
        self._event(victim, preemptor, REASON_PREEMPTED, victim_event_message(request))
        self._event(preemptor, victim, REASON_PREEMPTING, preemptor_event_message(request))

    def _event(self, regarding: dict[str, str], related: dict[str, str], reason: str, note: str) -> None:
        now = dt.datetime.now(dt.UTC)
        # an Event lives in the namespace of the object it is about (the API server checks)
        namespace = regarding["namespace"]
        name = f"{regarding['name'][: EVENT_NAME_LIMIT - 17]}.{time.time_ns():x}"
        body = {
            "apiVersion": "events.k8s.io/v1",
            "kind": "Event",
            "metadata": {"name": name, "namespace": namespace},
            "eventTime": now.strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
            "reportingController": REPORTING_CONTROLLER,
            "reportingInstance": self.reporting_instance,
            "action": REASON_PREEMPTING,
            "reason": reason,
            "type": "Normal",
            "regarding": regarding,
            "related": related,
            "note": truncate_note(note),
        }
        try:
            status, data = self._call(
                "POST",
                "/apis/events.k8s.io/v1/namespaces/{namespace}/events",
                {"namespace": namespace},
                body,
                "application/json",
                f"recording event {reason} on pod {namespace}/{regarding['name']}",
            )
        except Exception as exc:
            log.warning("event %s on pod %s/%s not recorded: %s", reason, namespace, regarding["name"], exc)
            return
        if not 200 <= status < 300:
            log.warning("event %s on pod %s/%s not recorded: HTTP %d: %s", reason, namespace, regarding["name"],
                        status, _status_message(data))

    # --- one bounded call -------------------------------------------------------------------------
    def _call(
        self, method: str, path: str, path_params: dict[str, str], body: dict[str, Any], content_type: str,
        what: str,
    ) -> tuple[int, bytes]:
        """(HTTP status, body) of one write, within `evict_s`; a timeout or connection failure raises."""
        deadline = time.monotonic() + self.timeouts.evict_s
        _, url, headers, _, _ = self.api_client.param_serialize(
            method,
            path,
            path_params=path_params,
            # the API server gives up on the write after this too, so it cannot land after our deadline
            query_params=[("timeout", f"{math.ceil(self.timeouts.evict_s)}s")],
            header_params={"Content-Type": content_type, "Accept": "application/json"},
            auth_settings=["BearerToken"],
        )
        response = self.api_client.rest_client.pool_manager.request(
            method,
            url,
            body=orjson.dumps(body),
            headers=headers,
            preload_content=False,
            timeout=urllib3_timeout(self.timeouts.evict_s, self.timeouts.connect_s),
        )
        data = read_body(response, deadline, what)
        return int(response.status), data
