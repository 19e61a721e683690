"""Admission logic, pure: an AdmissionReview body in, the HTTP status and response body out. No I/O.

On Pod CREATE a pod asking for vGPUs is validated (protocol.parse_pod_gpu_request holds the rules and messages),
routed to our scheduler, and given the env vars, volumes and mounts the in-container limiter needs. On UPDATE only
kube-vgpu's internal annotations are guarded. Everything is expressed as an RFC 6902 JSON Patch against the pod
exactly as the API server sent it, recomputed from that pod each time, so a reinvocation (reinvocationPolicy:
IfNeeded) after another webhook's change yields an empty patch when nothing of ours is missing.

The hot path avoids pydantic: orjson in, plain dicts, orjson out. A pod asking for no GPU resource costs one JSON
parse plus a scan of its annotations and container resource names.
"""

from __future__ import annotations

import base64
import re
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import orjson

from kube_vgpu.kubeapi import InvalidObject, check_pod
from kube_vgpu.protocol import (
    ADMISSION_MARK_VALUE,
    ANNOTATION_GANG_TIMEOUT_SECONDS,
    ANNOTATION_GPU_POLICY,
    ANNOTATION_KUEUE_POD_GROUP_TOTAL_COUNT,
    ANNOTATION_NODE_POLICY,
    ENV_LD_PRELOAD,
    ENV_MEMORY_LIMIT_PREFIX,
    ENV_NVIDIA_VISIBLE_DEVICES,
    ENV_SHARED_CACHE,
    ENV_SM_LIMIT,
    ENV_TASK_PRIORITY,
    GPU_RESOURCES,
    LABEL_COSCHEDULING_POD_GROUP,
    LABEL_KUEUE_POD_GROUP_NAME,
    LABEL_KUEUE_QUEUE_NAME,
    LIMITER_CACHE_VOLUME,
    MIG_RESOURCE_PREFIX,
    POD_ADMITTED_ANNOTATION,
    POLICY_NAMES,
    RESOURCE_GPU,
    RESOURCE_TASK_PRIORITY,
    WORKLOAD_API_GROUP,
    WORKLOAD_API_VERSION,
    WORKLOAD_POD_GROUPS,
    ContainerGpuRequest,
    InvalidGangDeclaration,
    InvalidGpuRequest,
    PodGpuRequest,
    is_internal_annotation,
    parse_gang_declaration,
    parse_pod_gpu_request,
    pod_asks_for_gpu,
)
from kube_vgpu.webhook.config import LimiterMode, WebhookConfig
from kube_vgpu.webhook.escapes import find_escape, is_limiter_env_name
from kube_vgpu.webhook.owners import GangRefused, NotServed, OwnerLookupError, OwnerResolver, owner_refs_of

API_VERSION_V1 = "admission.k8s.io/v1"
API_VERSION_V1BETA1 = "admission.k8s.io/v1beta1"
SUPPORTED_API_VERSIONS = (API_VERSION_V1, API_VERSION_V1BETA1)
#: What the API server defaults spec.schedulerName to.
KUBERNETES_DEFAULT_SCHEDULER = "default-scheduler"

# Names of what the webhook adds to GPU pods (reserved: a pod's own volume of that name is replaced).
CACHE_VOLUME = LIMITER_CACHE_VOLUME
LIMITER_VOLUME = "kube-vgpu-limiter"
LD_SO_PRELOAD_VOLUME = "kube-vgpu-ld-so-preload"
LD_SO_PRELOAD_MOUNT_PATH = "/etc/ld.so.preload"
#: Modes whose library reaches the container as a hostPath volume in the pod spec (Pod Security baseline forbids
#: those), and modes that set LD_PRELOAD in the pod's env (the device plugin's env would lose to the pod's own).
_HOST_PATH_MODES = (LimiterMode.LD_PRELOAD, LimiterMode.LD_SO_PRELOAD)
_LD_PRELOAD_ENV_MODES = (LimiterMode.LD_PRELOAD, LimiterMode.DEVICE_PLUGIN)
#: Modes that load the library from the node (a hostPath volume, or the device plugin's mount): their pods require
#: the node label saying it is installed there (mode none: the cluster provides the limiter its own way).
_NODE_LIBRARY_MODES = (LimiterMode.LD_PRELOAD, LimiterMode.LD_SO_PRELOAD, LimiterMode.DEVICE_PLUGIN)
_REQUIRED_AFFINITY = "requiredDuringSchedulingIgnoredDuringExecution"
#: NVIDIA_VISIBLE_DEVICES value for which the NVIDIA container runtime adds no GPU (and no driver files).
NO_DEVICES = "void"

_LD_PRELOAD_SEPARATOR = re.compile(r"[:\s]+")


class Result(StrEnum):
    """Outcome of one admission, as counted in metrics."""

    ALLOWED = "allowed"  # allowed, nothing to change
    MUTATED = "mutated"  # allowed with a patch
    DENIED = "denied"  # a well-formed review, refused (HTTP 200, allowed=false)
    MALFORMED = "malformed"  # not an AdmissionReview we can answer (HTTP 400)


@dataclass(frozen=True, slots=True)
class AdmissionOutcome:
    http_status: int
    body: bytes
    result: Result
    operation: str  # CREATE, UPDATE, ... ("" when the review was malformed)
    message: str = ""  # the denial or the reason the review was malformed, for logs
    warnings: tuple[str, ...] = ()
    subject: str = ""  # namespace/name of the pod, for logs


@dataclass(slots=True)
class Decision:
    """What to answer for one pod: allowed with an optional patch and warnings, or denied with a status code."""

    allowed: bool = True
    patch: list[dict[str, Any]] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    code: int = 200
    message: str = ""


ALLOW = Decision()  # shared: never mutated, handed out for the no-op cases
_STATUS_REASONS = {403: "Forbidden", 503: "ServiceUnavailable"}


class MalformedReview(ValueError):
    """The body is not an AdmissionReview about a pod that we can answer; the message says what is wrong."""


# ---------------------------------------------------------------------------------------------
# The AdmissionReview envelope
# ---------------------------------------------------------------------------------------------


def review(body: bytes, config: WebhookConfig, owners: OwnerResolver | None = None) -> AdmissionOutcome:
    """Answer one AdmissionReview (v1 or v1beta1, in the version asked). Never raises. With `owners`, a GPU pod
    lacking a queue label inherits its owners' (webhook/owners.py: API reads, so call it off the event loop)."""
    try:
        api_version, uid, operation, subject, decision = _decide(body, config, owners)
    except MalformedReview as exc:
        return _malformed(str(exc))
    response: dict[str, Any] = {"uid": uid, "allowed": decision.allowed}
    if not decision.allowed:
        reason = _STATUS_REASONS.get(decision.code, "BadRequest")
        response["status"] = {"status": "Failure", "code": decision.code, "reason": reason, "message": decision.message}
        result = Result.DENIED
    elif decision.patch:
        response["patchType"] = "JSONPatch"
        response["patch"] = base64.b64encode(orjson.dumps(decision.patch)).decode()
        result = Result.MUTATED
    else:
        result = Result.ALLOWED
    if decision.warnings:
        response["warnings"] = decision.warnings
    out = {"apiVersion": api_version, "kind": "AdmissionReview", "response": response}
    return AdmissionOutcome(
        200, orjson.dumps(out), result, operation, decision.message, tuple(decision.warnings), subject
    )


def _malformed(message: str) -> AdmissionOutcome:
    # A metav1.Status body: client-go (the API server's webhook client) shows its message in the error it reports.
    status = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "BadRequest", "code": 400}
    status["message"] = f"malformed AdmissionReview: {message}"
    return AdmissionOutcome(400, orjson.dumps(status), Result.MALFORMED, "", str(status["message"]))


def _decide(
    body: bytes, config: WebhookConfig, owners: OwnerResolver | None = None
) -> tuple[str, str, str, str, Decision]:
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise MalformedReview(f"body is not valid JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise MalformedReview("body must be a JSON object")
    api_version = doc.get("apiVersion")
    if api_version not in SUPPORTED_API_VERSIONS:
        raise MalformedReview(f"apiVersion must be one of {', '.join(SUPPORTED_API_VERSIONS)}, got {api_version!r}")
    if doc.get("kind") != "AdmissionReview":
        raise MalformedReview(f"kind must be AdmissionReview, got {doc.get('kind')!r}")
    request = doc.get("request")
    if not isinstance(request, dict):
        raise MalformedReview("request must be an object")
    uid = request.get("uid")
    if not isinstance(uid, str) or not uid:
        raise MalformedReview("request.uid must be a non-empty string")
    operation = request.get("operation")
    if not isinstance(operation, str) or not operation:
        raise MalformedReview("request.operation must be a non-empty string")
    kind = request.get("kind")
    if not isinstance(kind, dict) or not isinstance(kind.get("kind"), str):
        raise MalformedReview("request.kind must be an object with a kind, like {'version': 'v1', 'kind': 'Pod'}")
    subject = f"{request.get('namespace') or ''}/{request.get('name') or ''}"
    if kind["kind"] != "Pod" or kind.get("group", "") != "" or request.get("subResource"):
        return api_version, uid, operation, subject, ALLOW  # not ours to judge (a misconfigured rule); let it through
    user_info = request.get("userInfo")
    username = user_info.get("username", "") if isinstance(user_info, dict) else ""
    if operation not in ("CREATE", "UPDATE"):
        return api_version, uid, operation, subject, ALLOW
    pod = _pod_object(request, "object")
    old_pod = _pod_object(request, "oldObject") if operation == "UPDATE" else None
    try:
        if old_pod is None:
            decision = admit_create(pod, username, config, owners, str(request.get("namespace") or ""))
        else:
            decision = admit_update(pod, old_pod, username, config)
    except (AttributeError, TypeError, KeyError, IndexError, ValueError) as exc:
        # A pod that the API server could never have sent (it decodes pods into typed structs first).
        raise MalformedReview(f"request.object is not a valid Pod ({type(exc).__name__}: {exc})") from None
    return api_version, uid, operation, subject, decision


def _pod_object(request: dict[str, Any], key: str) -> dict[str, Any]:
    pod = request.get(key)
    if not isinstance(pod, dict) or pod.get("spec") is None:
        raise MalformedReview(f"request.{key} must be a Pod object with a spec")
    try:
        check_pod(pod, f"request.{key}")  # names the wrong-typed field, before any rule reads it
    except InvalidObject as exc:
        raise MalformedReview(str(exc)) from None
    return pod


# ---------------------------------------------------------------------------------------------
# Decisions about one pod
# ---------------------------------------------------------------------------------------------


def _deny(code: int, message: str) -> Decision:
    return Decision(allowed=False, code=code, message=message)


def _internal_annotations(pod: dict[str, Any]) -> dict[str, Any]:
    annotations = (pod.get("metadata") or {}).get("annotations") or {}
    return {key: value for key, value in annotations.items() if is_internal_annotation(key)}


def admit_update(pod: dict[str, Any], old_pod: dict[str, Any], username: str, config: WebhookConfig) -> Decision:
    """Pod UPDATE: only the internal annotations are guarded (a fake device assignment would corrupt the extender's
    accounting); nothing is mutated."""
    if username in config.trusted_usernames:
        return ALLOW
    new, old = _internal_annotations(pod), _internal_annotations(old_pod)
    if new == old:
        return ALLOW
    changed = sorted(key for key in new.keys() | old.keys() if new.get(key) != old.get(key))
    return _deny(403, f"{_annotation_words(changed)} written only by kube-vgpu and cannot be added, changed or removed")


def _annotation_words(keys: list[str]) -> str:
    return f"annotation {keys[0]} is" if len(keys) == 1 else f"annotations {', '.join(keys)} are"


def admit_create(
    pod: dict[str, Any],
    username: str,
    config: WebhookConfig,
    owners: OwnerResolver | None = None,
    namespace: str = "",
) -> Decision:
    """Pod CREATE: validate, then mutate a pod that asks for vGPUs."""
    if username not in config.trusted_usernames:
        internal = _internal_annotations(pod)
        if internal.get(POD_ADMITTED_ANNOTATION) == ADMISSION_MARK_VALUE:
            # our own mark, from an earlier pass over this pod (reinvocation); harmless in any case: this review
            # validates and mutates the pod whatever the mark says
            del internal[POD_ADMITTED_ANNOTATION]
        if internal:
            words = _annotation_words(sorted(internal))
            pronoun = "it" if len(internal) == 1 else "them"
            return _deny(403, f"{words} written only by kube-vgpu; remove {pronoun} from the pod")
    if not pod_asks_for_gpu(pod):
        return ALLOW
    try:
        request = parse_pod_gpu_request(pod)
        _check_policy_names(request)
    except InvalidGpuRequest as exc:
        return _deny(400, str(exc))
    if request.is_empty:  # every container asks for nvidia.com/gpu: 0
        return ALLOW
    spec = pod["spec"]
    node_name = spec.get("nodeName")
    if node_name:
        return _deny(
            403,
            f"pod sets spec.nodeName={node_name!r}, which skips GPU placement and limits; "
            "use a nodeSelector or node affinity instead",
        )
    escape = find_escape(spec, {(key, gpu.name) for key, _index, _container, gpu in _gpu_containers(spec, request)})
    if escape:
        return _deny(403, escape)
    try:
        parse_gang_declaration(pod)  # refused here, not left to wait in scheduling with the same message
    except InvalidGangDeclaration as exc:
        return _deny(400, f"invalid gang: {exc}")
    total = request.total_vgpus  # at its peak: native sidecars count beside the containers they run with
    if total > config.max_gpus_per_pod:
        sidecars = any(gpu.sidecar for gpu in request.containers)
        return _deny(
            403,
            f"pod asks for {total} vGPUs ({RESOURCE_GPU}), more than the maximum of {config.max_gpus_per_pod} "
            "per pod allowed in this cluster"
            + (" (native sidecars count with the containers they run beside)" if sidecars else ""),
        )
    decision = mutate_gpu_pod(pod, request, config)
    if owners is None:
        decision.warnings.extend(_unsupported_gang_declarations(pod, pod_group=True))
    else:
        decision.warnings.extend(_unsupported_gang_declarations(pod, pod_group=False))
        try:
            refusal = _patch_inherited_labels(
                decision, pod, owners, namespace or str(pod["metadata"].get("namespace") or "")
            )
        except OwnerLookupError as exc:
            return _deny(503, str(exc))
        except GangRefused as exc:
            return _deny(403, str(exc))
        if refusal:
            return _deny(403, refusal)
    decision.warnings.extend(_unread_gang_timeout(pod, decision))
    return decision


def _check_policy_names(request: PodGpuRequest) -> None:
    """A GPU pod naming a policy the extender does not know would fail every scheduling attempt: refused here
    instead (InvalidGpuRequest)."""
    if request.is_empty:
        return
    for key, name in ((ANNOTATION_GPU_POLICY, request.gpu_policy), (ANNOTATION_NODE_POLICY, request.node_policy)):
        if name is not None and name not in POLICY_NAMES:
            shown = repr(name) if len(name) <= 40 else repr(name[:40]) + "..."
            known = ", ".join(POLICY_NAMES)
            raise InvalidGpuRequest(f"annotation {key}: unknown policy {shown}; known policies: {known}")


def _unread_gang_timeout(pod: dict[str, Any], decision: Decision) -> list[str]:
    """A gang timeout on a pod that is in no gang (neither itself nor through the labels this review stamps on it)
    would be ignored: said."""
    if ANNOTATION_GANG_TIMEOUT_SECONDS not in (pod["metadata"].get("annotations") or {}):
        return []
    if LABEL_KUEUE_POD_GROUP_NAME in (pod["metadata"].get("labels") or {}):
        return []
    stamped = _pointer("metadata", "labels", LABEL_KUEUE_POD_GROUP_NAME)
    if any(op.get("path") == stamped or (op.get("path") == "/metadata/labels"
                                         and LABEL_KUEUE_POD_GROUP_NAME in (op.get("value") or {}))
           for op in decision.patch):
        return []
    return [f"annotation {ANNOTATION_GANG_TIMEOUT_SECONDS} is read only on a gang's pods, and this pod is in none: "
            f"{_GANG_HINT}"]


def _patch_inherited_labels(
    decision: Decision, pod: dict[str, Any], owners: OwnerResolver, namespace: str
) -> str | None:
    """The queue (and Kueue priority class) of the pod's owners, stamped on the pod (webhook/owners.py); a refusal
    when the queue an owner names does not exist."""
    metadata = pod.get("metadata") or {}
    labels = metadata.get("labels") or {}
    gang_labels, gang_annotations = _pod_group_gang(decision, pod, owners, namespace)
    # a gang from the pod's PodGroup stops the owners' walk from making it a Job's gang as well
    inherited = owners.inherited(namespace, {**labels, **gang_labels}, owner_refs_of(pod))
    inherited.labels.update(gang_labels)
    inherited.annotations.update(gang_annotations)
    decision.warnings.extend(inherited.warnings)
    queue = inherited.labels.get(LABEL_KUEUE_QUEUE_NAME)
    if queue and owners.local_queue_exists(namespace, queue) is False:
        return (f"the pod's owner {inherited.sources[LABEL_KUEUE_QUEUE_NAME]} names LocalQueue {namespace}/{queue} "
                f"(label {LABEL_KUEUE_QUEUE_NAME}), which does not exist: create it or fix the label")
    if inherited.labels:
        if not labels:
            _set(decision.patch, metadata, "labels", "/metadata/labels", dict(inherited.labels))
        else:
            for key, value in inherited.labels.items():
                decision.patch.append({"op": "add", "path": _pointer("metadata", "labels", key), "value": value})
    # after the admission mark's patch, which creates metadata.annotations when the pod had none
    for key, value in inherited.annotations.items():
        decision.patch.append({"op": "add", "path": _pointer("metadata", "annotations", key), "value": value})
    return None


def _pod_group_gang(
    decision: Decision, pod: dict[str, Any], owners: OwnerResolver, namespace: str
) -> tuple[dict[str, str], dict[str, str]]:
    """(labels, annotations) that make the pod a member of the gang of the PodGroup it names: Kubernetes' own
    (spec.schedulingGroup.podGroupName) or a coscheduling one (label). None when it names none, or already declares a
    Kueue pod group, which wins. Raises GangRefused and OwnerLookupError."""
    metadata = pod.get("metadata") or {}
    labels = metadata.get("labels") or {}
    spec = pod.get("spec") or {}
    named = []
    if isinstance(spec.get("schedulingGroup"), dict) and spec["schedulingGroup"].get("podGroupName"):
        named.append((lambda: owners.scheduling_group(namespace, spec),
                      "spec.schedulingGroup names a Kubernetes PodGroup, but this cluster does not serve "
                      f"{WORKLOAD_POD_GROUPS}.{WORKLOAD_API_GROUP}/{WORKLOAD_API_VERSION} (feature gate "
                      "GenericWorkload off)"))
    if labels.get(LABEL_COSCHEDULING_POD_GROUP):
        named.append((lambda: owners.pod_group(namespace, labels),
                      f"label {LABEL_COSCHEDULING_POD_GROUP} names a coscheduling PodGroup, but this cluster does not "
                      "serve podgroups.scheduling.x-k8s.io (the CRD is not installed)"))
    if not named:
        return {}, {}
    if len(named) > 1:
        decision.warnings.append(
            f"the pod names both a Kubernetes PodGroup (spec.schedulingGroup) and a coscheduling one (label "
            f"{LABEL_COSCHEDULING_POD_GROUP}): kube-vgpu reads the Kubernetes one")
    read, not_served = named[0]
    kueue_group = labels.get(LABEL_KUEUE_POD_GROUP_NAME)
    try:
        try:
            gang = read()
        except (NotServed, OwnerLookupError, GangRefused):
            if kueue_group:
                return {}, {}  # the pod's own Kueue declaration wins; the PodGroup is only read to compare
            raise
    except NotServed:
        decision.warnings.append(f"{not_served}: this pod is placed on its own, not all or nothing; {_GANG_HINT}")
        return {}, {}
    if gang is None:
        return {}, {}
    if gang.unread:
        decision.warnings.append(f"{gang.source}: {', '.join(gang.unread)} not read by kube-vgpu (a gang's own timeout "
                                 f"is the pod annotation {ANNOTATION_GANG_TIMEOUT_SECONDS})")
    if kueue_group:
        count = str((metadata.get("annotations") or {}).get(ANNOTATION_KUEUE_POD_GROUP_TOTAL_COUNT, ""))
        if count != str(gang.size):
            decision.warnings.append(
                f"the pod declares Kueue pod group {kueue_group} of {count or 'no'} members and {gang.source} of "
                f"{gang.size_field} {gang.size}: the Kueue declaration wins")
        return {}, {}
    return {LABEL_KUEUE_POD_GROUP_NAME: gang.name}, {ANNOTATION_KUEUE_POD_GROUP_TOTAL_COUNT: str(gang.size)}


def _gpu_containers(
    spec: dict[str, Any], request: PodGpuRequest
) -> list[tuple[str, int, dict[str, Any], ContainerGpuRequest]]:
    """(spec key, index, container, its request) for every container with a vGPU request."""
    by_name = {(gpu.init, gpu.name): gpu for gpu in request.containers}
    found = []
    for key, init in (("initContainers", True), ("containers", False)):
        for index, container in enumerate(spec.get(key) or ()):
            gpu = by_name.get((init, str(container.get("name", "?"))))
            if gpu is not None:
                found.append((key, index, container, gpu))
    return found


# ---------------------------------------------------------------------------------------------
# The mutation of a GPU pod
# ---------------------------------------------------------------------------------------------


def _pointer(*parts: str | int) -> str:
    """RFC 6901 JSON pointer: '~' -> '~0', '/' -> '~1' (so nvidia.com/gpu is nvidia.com~1gpu)."""
    return "".join("/" + str(part).replace("~", "~0").replace("/", "~1") for part in parts)


def _set(ops: list[dict[str, Any]], parent: dict[str, Any], key: str, path: str, value: Any) -> None:
    """Set parent[key] = value with a replace (member present) or an add (member absent)."""
    ops.append({"op": "replace" if key in parent else "add", "path": path, "value": value})


def mutate_gpu_pod(pod: dict[str, Any], request: PodGpuRequest, config: WebhookConfig) -> Decision:
    spec = pod["spec"]
    decision = Decision()
    ops, warnings = decision.patch, decision.warnings

    scheduler = spec.get("schedulerName")
    if scheduler in (None, "", KUBERNETES_DEFAULT_SCHEDULER):
        _set(ops, spec, "schedulerName", "/spec/schedulerName", config.scheduler_name)
    elif scheduler != config.scheduler_name:
        warnings.append(
            f"pod names scheduler {scheduler!r}, so kube-vgpu left spec.schedulerName alone: "
            f"its GPUs are not placed by {config.scheduler_name}"
        )

    _patch_admission_mark(ops, pod)
    mounts = _desired_mounts(config)
    gpu_containers = _gpu_containers(spec, request)
    for key, index, container, gpu in gpu_containers:
        base = ("spec", key, index)
        _patch_resources(ops, container, base, gpu)
        _patch_env(ops, warnings, container, gpu, base, config)
        # no limiter library or /etc/ld.so.preload in a MIG container (see _patch_env), the cache volume alone
        _patch_mounts(ops, warnings, container, gpu.name, base, mounts if not gpu.mig else mounts[:1])
    with_gpus = {(key, index) for key, index, _container, _gpu in gpu_containers}
    for key in ("initContainers", "containers"):
        for index, container in enumerate(spec.get(key) or ()):
            if (key, index) not in with_gpus:
                _patch_no_devices(ops, warnings, container, ("spec", key, index))
    _patch_volumes(ops, warnings, spec, _desired_volumes(config))
    if any(gpu.mig_profile is None for _key, _index, _container, gpu in gpu_containers):
        _patch_limiter_affinity(ops, spec, config)
    return decision


def _patch_limiter_affinity(ops: list[dict[str, Any]], spec: dict[str, Any], config: WebhookConfig) -> None:
    """A required node affinity on the limiter label: the pod is placed only where the device plugin found the
    installed limiter intact, instead of starting without limits or failing on a missing file (the hostPath's
    `type: File` stays as the second line of defence). nodeSelectorTerms are ORed, so every term gets the
    requirement; an empty term matches no node and is left so. MIG-only pods load no limiter and get none."""
    if not config.limiter_node_label or config.limiter_mode not in _NODE_LIBRARY_MODES:
        return
    requirement = {"key": config.limiter_node_label, "operator": "Exists"}
    only_ours = {"nodeSelectorTerms": [{"matchExpressions": [requirement]}]}
    affinity = spec.get("affinity")
    if not affinity:
        _set(ops, spec, "affinity", "/spec/affinity", {"nodeAffinity": {_REQUIRED_AFFINITY: only_ours}})
        return
    node_affinity = affinity.get("nodeAffinity")
    if not node_affinity:
        _set(ops, affinity, "nodeAffinity", "/spec/affinity/nodeAffinity", {_REQUIRED_AFFINITY: only_ours})
        return
    required = node_affinity.get(_REQUIRED_AFFINITY)
    terms: list[dict[str, Any]] = (required or {}).get("nodeSelectorTerms") or []
    if not terms:  # none (the API server refuses a required affinity without terms): ours alone
        _set(ops, node_affinity, _REQUIRED_AFFINITY, _pointer("spec", "affinity", "nodeAffinity", _REQUIRED_AFFINITY),
             {**(required or {}), **only_ours})
        return
    new_terms = []
    for term in terms:
        expressions = term.get("matchExpressions") or []
        if requirement in expressions or not (expressions or term.get("matchFields")):
            new_terms.append(term)
        else:
            new_terms.append({**term, "matchExpressions": [*expressions, requirement]})
    if new_terms != terms:
        path = _pointer("spec", "affinity", "nodeAffinity", _REQUIRED_AFFINITY, "nodeSelectorTerms")
        ops.append({"op": "replace", "path": path, "value": new_terms})


#: Gang declarations of other systems that kube-vgpu does not read (yet): said, not silently ignored.
_GANG_HINT = (f"declare the gang with the label {LABEL_KUEUE_POD_GROUP_NAME} and the annotation "
              f"{ANNOTATION_KUEUE_POD_GROUP_TOTAL_COUNT} (docs/user-guide.md, Gangs)")


def _unsupported_gang_declarations(pod: dict[str, Any], *, pod_group: bool) -> list[str]:
    """Warnings for the gang declarations not read: a PodGroup's when the webhook reads no API objects (`pod_group`),
    a Workload's always."""
    found = []
    if pod_group and LABEL_COSCHEDULING_POD_GROUP in ((pod.get("metadata") or {}).get("labels") or {}):
        found.append(f"label {LABEL_COSCHEDULING_POD_GROUP} (a coscheduling PodGroup) is not read by this kube-vgpu "
                     "webhook, which reads no API objects (--inherit-queue off, or no API access): this pod is placed "
                     f"on its own, not all or nothing; {_GANG_HINT}")
    if pod_group and (pod.get("spec") or {}).get("schedulingGroup"):
        found.append("spec.schedulingGroup (a Kubernetes PodGroup) is not read by this kube-vgpu webhook, which reads "
                     "no API objects (--inherit-queue off, or no API access): this pod is placed on its own, not all "
                     f"or nothing; {_GANG_HINT}")
    if (pod.get("spec") or {}).get("workloadRef"):
        # Kubernetes 1.35-1.36's alpha form; 1.37 (scheduling.k8s.io/v1beta1) names a PodGroup in
        # spec.schedulingGroup instead, which is read
        found.append("spec.workloadRef (a Kubernetes Workload) is not read by kube-vgpu: this pod is placed on its "
                     f"own, not all or nothing; {_GANG_HINT}")
    return found


def _patch_admission_mark(ops: list[dict[str, Any]], pod: dict[str, Any]) -> None:
    """The mark the extender and the device plugin look for: this pod went through this webhook."""
    metadata = pod.get("metadata") or {}
    annotations = metadata.get("annotations")
    if not annotations:
        if "metadata" not in pod:
            ops.append({"op": "add", "path": "/metadata", "value": {}})
        _set(ops, metadata, "annotations", "/metadata/annotations", {POD_ADMITTED_ANNOTATION: ADMISSION_MARK_VALUE})
    elif annotations.get(POD_ADMITTED_ANNOTATION) != ADMISSION_MARK_VALUE:
        path = _pointer("metadata", "annotations", POD_ADMITTED_ANNOTATION)
        _set(ops, annotations, POD_ADMITTED_ANNOTATION, path, ADMISSION_MARK_VALUE)


def _patch_no_devices(
    ops: list[dict[str, Any]], warnings: list[str], container: dict[str, Any], base: tuple[str | int, ...]
) -> None:
    """A container of a GPU pod that asks for no GPU gets none: NVIDIA_VISIBLE_DEVICES=void in its env (which wins
    over envFrom and the image's own env, e.g. NVIDIA's CUDA images set it to all), so the NVIDIA runtime gives it
    no device the limiter would not see."""
    env: list[dict[str, Any]] = container.get("env") or []
    wanted = {"name": ENV_NVIDIA_VISIBLE_DEVICES, "value": NO_DEVICES}
    kept = [entry for entry in env if entry.get("name") != ENV_NVIDIA_VISIBLE_DEVICES]
    new_env = [*kept, wanted]
    if new_env == env:
        return
    if any(entry.get("name") == ENV_NVIDIA_VISIBLE_DEVICES and entry != wanted for entry in env):
        warnings.append(
            f"container {container.get('name', '?')}: env {ENV_NVIDIA_VISIBLE_DEVICES} set by the pod was replaced "
            f"by {NO_DEVICES!r}: a container that asks for no vGPU gets no GPU"
        )
    _set(ops, container, "env", _pointer(*base, "env"), new_env)


def _patch_resources(
    ops: list[dict[str, Any]], container: dict[str, Any], base: tuple[str | int, ...], gpu: ContainerGpuRequest
) -> None:
    """GPU limits and requests made equal (limits win, as in protocol); nvidia.com/gpu: 1 when only memory or cores
    were given, so the device plugin's resource is what the scheduler and kubelet count. A MIG container keeps its
    one MIG resource (the device plugin advertises it) and gets no nvidia.com/gpu."""
    resources = container.get("resources") or {}
    merged: dict[str, Any] = {}
    merged.update(resources.get("requests") or {})
    merged.update(resources.get("limits") or {})
    if gpu.mig_profile is not None:
        mig_resource = MIG_RESOURCE_PREFIX + gpu.mig_profile
        wanted = {mig_resource: merged[mig_resource]}
    else:
        wanted = {name: merged[name] for name in GPU_RESOURCES if name in merged}
        wanted.setdefault(RESOURCE_GPU, "1")
        wanted = {name: wanted[name] for name in GPU_RESOURCES if name in wanted}  # fixed order: stable patches
    if not container.get("resources"):
        _set(ops, container, "resources", _pointer(*base, "resources"), {"limits": wanted, "requests": dict(wanted)})
        return
    for section in ("limits", "requests"):
        current = resources.get(section)
        if not current:
            _set(ops, resources, section, _pointer(*base, "resources", section), dict(wanted))
            continue
        # HAMi's task priority is no resource a node advertises (kube-scheduler would keep the pod Pending with
        # "Insufficient nvidia.com/priority"): it becomes the limiter's env (_desired_env) and leaves the resources
        if RESOURCE_TASK_PRIORITY in current:
            ops.append({"op": "remove", "path": _pointer(*base, "resources", section, RESOURCE_TASK_PRIORITY)})
        for name, value in wanted.items():
            if current.get(name) != value:
                _set(ops, current, name, _pointer(*base, "resources", section, name), value)


def _desired_env(gpu: ContainerGpuRequest, config: WebhookConfig) -> dict[str, str]:
    # 0 = no compute limit; a MIG device is isolated by the hardware, so the limiter (still loaded) limits nothing
    env = {ENV_SM_LIMIT: "0" if gpu.mig else str(gpu.cores)}
    if gpu.memory_mib is not None:
        # "<MiB>m": a bare number would be read as bytes. Percentages are resolved by the device plugin, which
        # alone knows which GPU (and so how much memory) the container got.
        for index in range(gpu.count):
            env[f"{ENV_MEMORY_LIMIT_PREFIX}{index}"] = f"{gpu.memory_mib}m"
    # Per container: the limiter's processes in one container share this file; containers must not.
    env[ENV_SHARED_CACHE] = f"{config.cache_dir}/{gpu.name}.cache"
    if gpu.task_priority is not None:  # HAMi's nvidia.com/priority, as HAMi's webhook passes it
        env[ENV_TASK_PRIORITY] = str(gpu.task_priority)
    return env


def _patch_env(
    ops: list[dict[str, Any]],
    warnings: list[str],
    container: dict[str, Any],
    gpu: ContainerGpuRequest,
    base: tuple[str | int, ...],
    config: WebhookConfig,
) -> None:
    desired = _desired_env(gpu, config)
    # a MIG device is isolated by the hardware: the limiter is not loaded into a MIG container (a pod-set LD_PRELOAD
    # then stays the pod's own)
    preload = config.limiter_mode in _LD_PRELOAD_ENV_MODES and not gpu.mig
    library = config.limiter_library_path if preload else None
    env: list[dict[str, Any]] = container.get("env") or []
    new_env: list[dict[str, Any]] = []
    overridden: list[str] = []  # names whose pod-supplied entry was replaced or dropped
    seen: set[str] = set()
    for entry in env:
        name = entry.get("name", "")
        if name in desired or (library and name == ENV_LD_PRELOAD):
            if name in seen:  # a duplicate entry: the later one would win in the container, drop it
                overridden.append(name)
                continue
            seen.add(name)
            if name == ENV_LD_PRELOAD:
                assert library is not None
                wanted = {"name": name, "value": _ld_preload_value(entry, library)}
            else:
                wanted = {"name": name, "value": desired[name]}
            if entry != wanted:
                overridden.append(name)
            new_env.append(wanted)
        elif is_limiter_env_name(name):
            overridden.append(name)
        else:
            new_env.append(entry)
    new_env.extend({"name": name, "value": value} for name, value in desired.items() if name not in seen)
    if library and ENV_LD_PRELOAD not in seen:
        new_env.append({"name": ENV_LD_PRELOAD, "value": library})
    if new_env != env:
        _set(ops, container, "env", _pointer(*base, "env"), new_env)
    if overridden:
        names = ", ".join(dict.fromkeys(overridden))
        warnings.append(
            f"container {gpu.name}: env {names} set by the pod was overridden; "
            "kube-vgpu sets GPU limits from the container's resources"
        )


def _ld_preload_value(entry: dict[str, Any], library: str) -> str:
    """The limiter first, then whatever the pod preloads itself (a valueFrom cannot be merged and is replaced)."""
    value = entry.get("value")
    if "valueFrom" in entry or not isinstance(value, str):
        return library
    others = [part for part in _LD_PRELOAD_SEPARATOR.split(value) if part and part != library]
    return ":".join([library, *others])


def _desired_mounts(config: WebhookConfig) -> list[dict[str, Any]]:
    mounts: list[dict[str, Any]] = [{"name": CACHE_VOLUME, "mountPath": config.cache_dir}]
    if config.limiter_mode in _HOST_PATH_MODES:
        mounts.append({"name": LIMITER_VOLUME, "mountPath": config.limiter_library_path, "readOnly": True})
    if config.limiter_mode is LimiterMode.LD_SO_PRELOAD:
        mounts.append({"name": LD_SO_PRELOAD_VOLUME, "mountPath": LD_SO_PRELOAD_MOUNT_PATH, "readOnly": True})
    return mounts


def _desired_volumes(config: WebhookConfig) -> list[dict[str, Any]]:
    volumes: list[dict[str, Any]] = [{"name": CACHE_VOLUME, "emptyDir": {}}]
    # type: File makes a node without the limiter fail the pod's start visibly instead of running it unlimited.
    if config.limiter_mode in _HOST_PATH_MODES:
        volumes.append({"name": LIMITER_VOLUME, "hostPath": {"path": config.limiter_library_path, "type": "File"}})
    if config.limiter_mode is LimiterMode.LD_SO_PRELOAD:
        volumes.append(
            {"name": LD_SO_PRELOAD_VOLUME, "hostPath": {"path": config.limiter_ld_so_preload_path, "type": "File"}}
        )
    return volumes


def _patch_mounts(
    ops: list[dict[str, Any]],
    warnings: list[str],
    container: dict[str, Any],
    container_name: str,
    base: tuple[str | int, ...],
    desired: list[dict[str, Any]],
) -> None:
    """Our mounts in the container; a pod's own mount of our volumes or at our paths is dropped (one at
    /etc/ld.so.preload or over the library would switch the limiter off)."""
    names = {mount["name"] for mount in desired}
    paths = {mount["mountPath"] for mount in desired}
    current: list[dict[str, Any]] = container.get("volumeMounts") or []
    new_mounts: list[dict[str, Any]] = []
    dropped: list[str] = []
    for mount in current:
        if mount.get("name") in names or mount.get("mountPath") in paths:
            if mount in desired and mount not in new_mounts:
                new_mounts.append(mount)
            else:
                dropped.append(str(mount.get("mountPath")))
        else:
            new_mounts.append(mount)
    new_mounts.extend(mount for mount in desired if mount not in new_mounts)
    if new_mounts != current:
        _set(ops, container, "volumeMounts", _pointer(*base, "volumeMounts"), new_mounts)
    if dropped:
        warnings.append(
            f"container {container_name}: volume mounts at {', '.join(dropped)} were replaced by kube-vgpu's own"
        )


def _patch_volumes(
    ops: list[dict[str, Any]], warnings: list[str], spec: dict[str, Any], desired: list[dict[str, Any]]
) -> None:
    volumes: list[dict[str, Any]] | None = spec.get("volumes")
    if not volumes:
        _set(ops, spec, "volumes", "/spec/volumes", desired)
        return
    wanted = {volume["name"]: volume for volume in desired}
    present: set[str] = set()
    for index, volume in enumerate(volumes):
        name = str(volume.get("name"))
        if name in wanted:
            present.add(name)
            if volume != wanted[name]:
                ops.append({"op": "replace", "path": _pointer("spec", "volumes", index), "value": wanted[name]})
                warnings.append(f"volume {name} was replaced: the name is reserved for kube-vgpu")
    for volume in desired:
        if volume["name"] not in present:
            ops.append({"op": "add", "path": "/spec/volumes/-", "value": volume})
