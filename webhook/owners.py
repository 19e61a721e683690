"""A pod's queue from its owners (issue 13): Kueue users put `kueue.x-k8s.io/queue-name` (and
`kueue.x-k8s.io/priority-class`) on the Job, JobSet or training job, and the controllers do not copy it to the pods.
At admission the webhook walks the pod's controller `ownerReferences` up to the top-level workload and stamps the
first value found on the pod, so the API server holds it and the extender reads it from the pod alone.

This is the webhook's only I/O: one GET per owner, through the kubernetes client's connection pool, under a deadline,
cached for `ttl_s` (a Job's pods arrive in bursts: one read serves them all). Only the owner kinds below are read
(RBAC: get on exactly these); an owner of another kind ends the walk with a warning.

The same reads give a gang to a GPU pod that names a PodGroup (a coscheduling one by label, a Kubernetes one in
spec.schedulingGroup): its size becomes the Kueue pod-group count the extender reads (extender/gangs.py).
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson
from cachetools import TTLCache

from kube_vgpu.protocol import (
    ANNOTATION_JOB_GANG,
    ANNOTATION_KUEUE_POD_GROUP_TOTAL_COUNT,
    COSCHEDULING_API_GROUP,
    COSCHEDULING_API_VERSION,
    COSCHEDULING_POD_GROUPS,
    LABEL_COSCHEDULING_POD_GROUP,
    LABEL_KUEUE_POD_GROUP_NAME,
    LABEL_KUEUE_PRIORITY_CLASS,
    LABEL_KUEUE_QUEUE_NAME,
    MAX_GANG_SIZE,
    POD_GROUP_GANG_PREFIX,
    WORKLOAD_API_GROUP,
    WORKLOAD_API_VERSION,
    WORKLOAD_POD_GROUP_GANG_PREFIX,
    WORKLOAD_POD_GROUPS,
)
from kube_vgpu.webhook.workloads import GANG_SIZE_OF

log = logging.getLogger(__name__)

#: (apiVersion group, kind) -> (version, plural) of the owners read; the group's served version for each.
SUPPORTED_OWNERS: Mapping[tuple[str, str], tuple[str, str]] = {
    ("batch", "Job"): ("v1", "jobs"),
    ("batch", "CronJob"): ("v1", "cronjobs"),
    ("apps", "ReplicaSet"): ("v1", "replicasets"),
    ("apps", "Deployment"): ("v1", "deployments"),
    ("apps", "StatefulSet"): ("v1", "statefulsets"),
    ("jobset.x-k8s.io", "JobSet"): ("v1alpha2", "jobsets"),
    ("kubeflow.org", "PyTorchJob"): ("v1", "pytorchjobs"),
    ("kubeflow.org", "TFJob"): ("v1", "tfjobs"),
    ("kubeflow.org", "MPIJob"): ("v2beta1", "mpijobs"),
    ("ray.io", "RayJob"): ("v1", "rayjobs"),
    ("ray.io", "RayCluster"): ("v1", "rayclusters"),
    ("leaderworkerset.x-k8s.io", "LeaderWorkerSet"): ("v1", "leaderworkersets"),
}
#: labels a pod inherits from its owners when it lacks them
INHERITED_LABELS = (LABEL_KUEUE_QUEUE_NAME, LABEL_KUEUE_PRIORITY_CLASS)
#: Job -> JobSet -> ... : deeper chains are not workloads we know
MAX_DEPTH = 5
DEFAULT_TTL_S = 30.0
DEFAULT_DEADLINE_S = 3.0  # inside the API server's 10 s webhook timeout, with room for the rest of the review


class OwnerLookupError(Exception):
    """An owner could not be read; the pod is refused (admitting it without its queue would escape quota)."""


class NotServed(Exception):
    """The API server does not serve that resource (e.g. Kueue's CRDs are not installed)."""


#: Kueue's LocalQueue, read to check that a queue inherited from an owner exists
LOCAL_QUEUES = ("kueue.x-k8s.io", "v1beta1", "localqueues")


#: a coscheduling PodGroup's fields kube-vgpu does not carry out: a gang's own timeout is the pod annotation
#: gang.kube-vgpu.io/timeout-seconds, and the quota gate (not minResources) decides whether its resources are there
UNREAD_POD_GROUP_FIELDS = ("scheduleTimeoutSeconds", "minResources")
#: a label value's limit (the Kueue pod-group name is a label)
MAX_LABEL_VALUE_CHARS = 63


class GangRefused(Exception):
    """The pod's gang declaration names something that cannot make a gang; the message says what to fix."""


@dataclass(frozen=True, slots=True)
class DeclaredGang:
    """A gang declared by an object the pod names (a coscheduling or a Kubernetes PodGroup), as the Kueue label and
    annotation to stamp."""

    name: str  # the Kueue pod-group name to stamp
    size: int
    source: str  # e.g. "PodGroup team-a/train"
    size_field: str = "minMember"  # the source's word for the size
    #: fields of the declaring object that kube-vgpu does not carry out (said to the pod's creator)
    unread: tuple[str, ...] = ()


def _gang_size(value: Any, said: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_GANG_SIZE:
        shown = "missing" if value is None else repr(value)[:20]
        raise GangRefused(f"{said} {shown}: kube-vgpu needs a whole number from 1 to {MAX_GANG_SIZE} (the gang's "
                          "size)")
    return value


def derived_gang_name(prefix: str, name: str) -> str:
    """A Kueue pod-group name (a label value: at most 63 characters) for a gang declared by object `name`: the prefix
    keeps it apart from the names of Job gangs; a name too long is cut and given a digest of the whole."""
    whole = prefix + name
    if len(whole) <= MAX_LABEL_VALUE_CHARS:
        return whole
    digest = hashlib.sha256(name.encode()).hexdigest()[:10]
    return f"{whole[:MAX_LABEL_VALUE_CHARS - len(digest) - 1]}_{digest}"


@dataclass(frozen=True, slots=True)
class Inherited:
    labels: dict[str, str]
    #: where each came from, e.g. "Job team-a/train-7"
    sources: dict[str, str]
    warnings: tuple[str, ...] = ()
    #: annotations to add (a Job marked as a gang: the Kueue pod-group count)
    annotations: dict[str, str] = field(default_factory=dict)


#: (group, version, plural, namespace, name) -> the object, or None when it does not exist. Raises on any failure.
Fetch = Callable[[str, str, str, str, str], Mapping[str, Any] | None]


def _controller(owner_refs: Any) -> Mapping[str, Any] | None:
    if not isinstance(owner_refs, list):
        return None
    for ref in owner_refs:
        if isinstance(ref, Mapping) and ref.get("controller") is True:
            return ref
    return None


class OwnerResolver:
    def __init__(self, fetch: Fetch, *, ttl_s: float = DEFAULT_TTL_S, clock: Callable[[], float] = time.monotonic):
        self.fetch = fetch
        self._cache: TTLCache[tuple[str, str, str, str], Mapping[str, Any] | None] = TTLCache(
            maxsize=4096, ttl=ttl_s, timer=clock
        )
        self._lock = threading.Lock()

    def _cached(self, resource: tuple[str, str, str], namespace: str, name: str, what: str, *,
                not_served: bool = True, cache_missing: bool = True) -> Mapping[str, Any] | None:
        """The object, read at most once per TTL: None when it does not exist, _NOT_SERVED when its API is not
        served (with `not_served`; otherwise that is a read failure like any other). Raises OwnerLookupError naming
        `what`, so the pod is refused and its controller retries."""
        group, version, plural = resource
        key = (group, plural, namespace, name)
        with self._lock:
            if key in self._cache:
                return self._cache[key]
        try:
            obj = self.fetch(group, version, plural, namespace, name)
        except NotServed as exc:
            if not not_served:
                raise OwnerLookupError(self._unreadable(what, exc)) from None
            obj = _NOT_SERVED
        except Exception as exc:
            raise OwnerLookupError(self._unreadable(what, exc)) from None
        if obj is not None or cache_missing:
            with self._lock:
                self._cache[key] = obj
        return obj

    @staticmethod
    def _unreadable(what: str, exc: Exception) -> str:
        return f"cannot read {what} ({exc}); the pod is refused so that its controller retries"

    def _read(self, group: str, kind: str, namespace: str, name: str) -> Mapping[str, Any] | None:
        version, plural = SUPPORTED_OWNERS[(group, kind)]
        return self._cached((group, version, plural), namespace, name,
                            f"the pod's owner {kind} {namespace}/{name} to find its queue", not_served=False)

    def local_queue_exists(self, namespace: str, name: str) -> bool | None:
        """Whether LocalQueue namespace/name exists; None when LocalQueues are not served (quota from a file, or no
        Kueue objects at all: the extender then judges the queue). Raises OwnerLookupError."""
        obj = self._cached(LOCAL_QUEUES, namespace, name, f"LocalQueue {namespace}/{name}")
        return None if obj is _NOT_SERVED else obj is not None

    def pod_group(self, namespace: str, labels: Mapping[str, str]) -> DeclaredGang | None:
        """The gang of a pod labelled with a coscheduling PodGroup (LABEL_COSCHEDULING_POD_GROUP); None when it has no
        such label. Raises GangRefused (no such PodGroup, or a minMember we cannot honour), OwnerLookupError (the
        PodGroup cannot be read: refused with 503, so that its controller retries) and NotServed (no PodGroup CRD)."""
        name = labels.get(LABEL_COSCHEDULING_POD_GROUP)
        if not name:
            return None
        where = f"PodGroup {namespace}/{name}"
        named_by = f"the pod's label {LABEL_COSCHEDULING_POD_GROUP}={name}"
        obj = self._gang_object(
            (COSCHEDULING_API_GROUP, COSCHEDULING_API_VERSION, COSCHEDULING_POD_GROUPS), namespace, name, where,
            named_by, "label")
        min_member = (obj.get("spec") or {}).get("minMember")
        size = _gang_size(min_member, f"{where} (label {LABEL_COSCHEDULING_POD_GROUP} on the pod) has spec.minMember")
        unread = tuple(f"spec.{field}" for field in UNREAD_POD_GROUP_FIELDS if (obj.get("spec") or {}).get(field))
        return DeclaredGang(derived_gang_name(POD_GROUP_GANG_PREFIX, name), size, where, unread=unread)

    def scheduling_group(self, namespace: str, spec: Mapping[str, Any]) -> DeclaredGang | None:
        """The gang of a pod whose spec.schedulingGroup.podGroupName names a Kubernetes PodGroup (Workload API,
        scheduling.k8s.io) with a gang policy; None when it names none, or one of the basic policy (no gang). Raises
        as pod_group does (NotServed: the API, behind the GenericWorkload feature gate, is not served)."""
        group = spec.get("schedulingGroup")
        name = group.get("podGroupName") if isinstance(group, Mapping) else None
        if not isinstance(name, str) or not name:
            return None
        where = f"PodGroup {namespace}/{name} ({WORKLOAD_API_GROUP})"
        obj = self._gang_object((WORKLOAD_API_GROUP, WORKLOAD_API_VERSION, WORKLOAD_POD_GROUPS), namespace, name,
                                where, f"the pod's spec.schedulingGroup.podGroupName={name}", "pod's podGroupName")
        policy = (obj.get("spec") or {}).get("schedulingPolicy") or {}
        gang = policy.get("gang") if isinstance(policy, Mapping) else None
        if not isinstance(gang, Mapping):
            return None  # the basic policy: pods placed one by one, as the API server's own scheduler does
        size = _gang_size(gang.get("minCount"), f"{where} has spec.schedulingPolicy.gang.minCount")
        return DeclaredGang(derived_gang_name(WORKLOAD_POD_GROUP_GANG_PREFIX, name), size, where, "minCount")

    def _gang_object(
        self, resource: tuple[str, str, str], namespace: str, name: str, where: str, named_by: str, fix: str
    ) -> Mapping[str, Any]:
        """The object declaring a gang (cached like owners). Raises GangRefused when it does not exist."""
        # a group found (or its API not served) is cached; one missing is not, so that a retry after its creation
        # sees it at once
        obj = self._cached(resource, namespace, name, f"{where} named by {named_by}", cache_missing=False)
        if obj is _NOT_SERVED:
            raise NotServed(f"{resource[0]}/{resource[1]} {resource[2]}")
        if obj is None:
            # Refused, not warned: a typo must not quietly turn an all-or-nothing job into pods placed one by one.
            # Controllers that use PodGroups (training-operator, scheduler-plugins' own examples, the Job controller
            # for Workloads) create the group before the pods, and a refused pod is retried by its controller (a bare
            # pod by whoever applies it again), so the order "pods first" costs a retry, not a silent half gang.
            raise GangRefused(f"{named_by} names {where}, which does not exist: create it before the pods, or fix "
                              f"the {fix}")
        return obj

    def inherited(self, namespace: str, labels: Mapping[str, str], owner_refs: Any) -> Inherited:
        """The INHERITED_LABELS the pod lacks, from the nearest controller owner carrying each."""
        missing = [key for key in INHERITED_LABELS if not labels.get(key)]
        found: dict[str, str] = {}
        sources: dict[str, str] = {}
        warnings: list[str] = []
        annotations: dict[str, str] = {}
        ref = _controller(owner_refs)
        depth = 0
        want_gang = not labels.get(LABEL_KUEUE_POD_GROUP_NAME)
        while ref is not None and (missing or want_gang) and depth < MAX_DEPTH:
            depth += 1
            api_version, kind, name = str(ref.get("apiVersion", "")), str(ref.get("kind", "")), str(ref.get("name", ""))
            group = api_version.rpartition("/")[0] if "/" in api_version else ""
            if (group, kind) not in SUPPORTED_OWNERS:
                warnings.append(f"owner {kind} {namespace}/{name} ({api_version}) is not a kind kube-vgpu reads "
                                f"for {LABEL_KUEUE_QUEUE_NAME}; set the label on the pod template instead")
                break
            obj = self._read(group, kind, namespace, name)
            if obj is None:
                break  # deleted meanwhile: nothing to inherit
            metadata = obj.get("metadata") or {}
            owner_labels = metadata.get("labels") or {}
            if want_gang:
                # the nearest owner that says "true" or "false" decides: a JobSet's or a PyTorchJob's mark makes all
                # its GPU pods one gang; a Job's, its own pods (the Job keeps its historical gang name, its own)
                mark = str((metadata.get("annotations") or {}).get(ANNOTATION_JOB_GANG, "")).lower()
                if mark not in ("", "true", "false"):
                    warnings.append(f"annotation {ANNOTATION_JOB_GANG}={mark[:20]!r} on {kind} {namespace}/{name} "
                                    "is neither \"true\" nor \"false\": its pods are not a gang")
                    want_gang = False
                elif mark == "false":
                    want_gang = False
                elif mark == "true":
                    want_gang = False
                    size_of = GANG_SIZE_OF.get((group, kind))
                    if size_of is None:
                        warnings.append(f"annotation {ANNOTATION_JOB_GANG} on {kind} {namespace}/{name} is not read: "
                                        f"kube-vgpu reads it on {', '.join(k for _g, k in GANG_SIZE_OF)}; declare "
                                        f"the gang with the label {LABEL_KUEUE_POD_GROUP_NAME} and the annotation "
                                        f"{ANNOTATION_KUEUE_POD_GROUP_TOTAL_COUNT} on the pod template instead")
                    else:
                        size = _gang_size(size_of(obj), f"{kind} {namespace}/{name} runs GPU pods at once:")
                        is_own_job = depth == 1 and (group, kind) == ("batch", "Job")
                        gang_name = name if is_own_job else derived_gang_name(f"{kind.lower()}_", name)
                        found[LABEL_KUEUE_POD_GROUP_NAME] = gang_name
                        sources[LABEL_KUEUE_POD_GROUP_NAME] = f"{kind} {namespace}/{name}"
                        annotations[ANNOTATION_KUEUE_POD_GROUP_TOTAL_COUNT] = str(size)
            for key in list(missing):
                value = owner_labels.get(key)
                if isinstance(value, str) and value:
                    found[key] = value
                    sources[key] = f"{kind} {namespace}/{name}"
                    missing.remove(key)
            ref = _controller(metadata.get("ownerReferences"))
        return Inherited(found, sources, tuple(warnings), annotations)


def api_fetch(api_client: Any, timeout_s: float = DEFAULT_DEADLINE_S) -> Fetch:
    """A Fetch over the kubernetes client's connection pool: a raw GET (no model deserialisation), connect and each
    read bounded by `timeout_s` (the API server is trusted to send a small object promptly once it answers)."""
    import urllib3

    def fetch(group: str, version: str, plural: str, namespace: str, name: str) -> Mapping[str, Any] | None:
        prefix = f"/apis/{group}/{version}" if group else f"/api/{version}"
        _, url, headers, _, _ = api_client.param_serialize(
            "GET", f"{prefix}/namespaces/{{namespace}}/{plural}/{{name}}",
            path_params={"namespace": namespace, "name": name},
            header_params={"Accept": "application/json"}, auth_settings=["BearerToken"],
        )
        response = api_client.rest_client.pool_manager.request(
            "GET", url, headers=headers, retries=False,
            timeout=urllib3.Timeout(connect=timeout_s, read=timeout_s),
        )
        if response.status == 404:
            # an object that does not exist names itself in the Status's details; a resource not served does not
            try:
                details = (orjson.loads(response.data) or {}).get("details") or {}
            except orjson.JSONDecodeError:
                details = {}
            if details.get("name"):
                return None
            raise NotServed(f"{group}/{version} {plural} is not served")
        if not 200 <= response.status < 300:
            raise RuntimeError(f"HTTP {response.status}: {response.data[:200].decode(errors='replace')}")
        doc = orjson.loads(response.data)
        if not isinstance(doc, dict):
            raise RuntimeError("the API server answered with something other than an object")
        return doc

    return fetch


_NOT_SERVED: Mapping[str, Any] = {"notServed": True}  # cache marker


def owner_refs_of(pod: Mapping[str, Any]) -> Sequence[Any]:
    refs = (pod.get("metadata") or {}).get("ownerReferences")
    return refs if isinstance(refs, list) else []
