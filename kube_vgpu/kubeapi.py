"""Kubernetes semantics, and nothing else: quantities and a pod's resource requests exactly as kube-scheduler counts
them (init containers, native sidecars, pod overhead, pod-level resources, in-place resizes).

The bottom layer: imports nothing of ours. Every component that needs "how much does this pod ask for" (the
extender's state and quota gate, the webhook, the simulator) calls `pod_requests`, so they can never disagree.

Units (as kube-scheduler's `framework.Resource`): `cpu` in millicores, every other resource in whole units of its
quantity (bytes for `memory` and `ephemeral-storage`, counts for extended resources), rounded up. As in
component-helpers' `PodRequests`, quantities are added and compared exactly and rounded once, on the pod's total.
"""

from __future__ import annotations

import datetime as _dt
import functools
import math
import re
from collections.abc import Iterable, Mapping
from decimal import Context, Decimal, InvalidOperation
from typing import Any

RESOURCE_CPU = "cpu"
RESOURCE_MEMORY = "memory"
RESOURCE_PODS = "pods"
#: resources a pod may set in `spec.resources` (PodLevelResources); they replace the containers' sum. Hugepages
#: (`hugepages-<size>`) are supported too (component-helpers' IsSupportedPodLevelResource).
POD_LEVEL_RESOURCES = frozenset({RESOURCE_CPU, RESOURCE_MEMORY})
HUGEPAGES_PREFIX = "hugepages-"
RESTART_POLICY_ALWAYS = "Always"
#: pod condition kubelet sets while a resize waits; reason Infeasible means it will never be applied
CONDITION_RESIZE_PENDING = "PodResizePending"
REASON_INFEASIBLE = "Infeasible"


class InvalidQuantity(ValueError):
    """A value that is not a Kubernetes quantity; the message says which and why."""


# k8s.io/apimachinery/pkg/api/resource: <sign><digits>[.<digits>]<suffix>, suffix binary (Ki..Ei), decimal
# (m, k, M, G, T, P, E, or none) or an exponent (e3, E-2).
_QUANTITY = re.compile(r"^([+-]?[0-9]+(?:\.[0-9]*)?|[+-]?\.[0-9]+)(Ki|Mi|Gi|Ti|Pi|Ei|m|k|M|G|T|P|E|[eE][+-]?[0-9]+)?$")
_SUFFIX = {
    "": Decimal(1), "m": Decimal("0.001"), "k": Decimal(10) ** 3, "M": Decimal(10) ** 6, "G": Decimal(10) ** 9,
    "T": Decimal(10) ** 12, "P": Decimal(10) ** 15, "E": Decimal(10) ** 18,
    "Ki": Decimal(2) ** 10, "Mi": Decimal(2) ** 20, "Gi": Decimal(2) ** 30, "Ti": Decimal(2) ** 40,
    "Pi": Decimal(2) ** 50, "Ei": Decimal(2) ** 60,
}
#: longest quantity text we read; the API server's own limit on a quantity's digits is far below this, and it keeps a
#: hostile 5000-digit value from costing a Decimal multiplication of that size
MAX_QUANTITY_TEXT = 64
_MAX_EXPONENT = 30
#: exact arithmetic for every quantity we can read (at most 64 digits, 10^±30, Ei) and sums of them: the default
#: context's 28 digits would round large or finely divided values, which Kubernetes' arbitrary precision does not
EXACT = Context(prec=400)
_ZERO = Decimal(0)
_THOUSAND = Decimal(1000)


@functools.lru_cache(maxsize=4096)  # pods repeat a handful of values ("500m", "1Gi"); parsing is on the event path
def _parse_text(raw: str) -> tuple[Decimal, str]:
    text = raw.strip()
    if len(text) > MAX_QUANTITY_TEXT:
        raise InvalidQuantity(f"{text[:20]}... is not a Kubernetes quantity (longer than {MAX_QUANTITY_TEXT})")
    match = _QUANTITY.match(text)
    if not match:
        raise InvalidQuantity(f"{text!r} is not a Kubernetes quantity")
    number, suffix = match.group(1), match.group(2) or ""
    multiplier = _SUFFIX.get(suffix)
    if multiplier is None:  # an exponent ("e3", "E-2"); "E" alone is exa and in _SUFFIX
        exponent = int(suffix[1:])  # the pattern admits only digits here
        if abs(exponent) > _MAX_EXPONENT:
            raise InvalidQuantity(f"{text!r}: exponent out of range")
        multiplier = EXACT.power(Decimal(10), exponent)
    try:
        return EXACT.multiply(Decimal(number), multiplier), suffix
    except InvalidOperation:
        raise InvalidQuantity(f"{text!r} is not a Kubernetes quantity") from None


def parse_quantity_and_suffix(value: Any) -> tuple[Decimal, str]:
    """A Kubernetes quantity ("500m", "2", "1.5Gi", "1e3", 2) as an exact Decimal, and its suffix as written ("m",
    "Gi", "e3"; "" for a plain number). Raises InvalidQuantity."""
    if type(value) is str:  # the usual case first (JSON gives str)
        return _parse_text(value)
    if isinstance(value, bool) or value is None or not isinstance(value, str | int | float | Decimal):
        raise InvalidQuantity(f"expected a quantity, got {value!r}")
    return _parse_text(str(value))


def parse_quantity(value: Any) -> Decimal:
    """A Kubernetes quantity ("500m", "2", "1.5Gi", "1e3", 2) as an exact Decimal. Raises InvalidQuantity."""
    return (_parse_text(value) if type(value) is str else parse_quantity_and_suffix(value))[0]


def _ceil(amount: Decimal) -> int:
    return math.ceil(amount)  # exact for a Decimal of any size


def quantity_milli(value: Any) -> int:
    """Quantity.MilliValue(): thousandths, rounded up ("500m" -> 500, "0.1" -> 100, "1" -> 1000)."""
    return _ceil(EXACT.multiply(parse_quantity(value), _THOUSAND))


def quantity_value(value: Any) -> int:
    """Quantity.Value(): whole units, rounded up ("1Gi" -> 1073741824, "500m" -> 1)."""
    return _ceil(parse_quantity(value))


def _in_unit(resource: str, amount: Decimal) -> int:
    return _ceil(EXACT.multiply(amount, _THOUSAND)) if resource == RESOURCE_CPU else _ceil(amount)


def resource_amount(resource: str, value: Any) -> int:
    """A quantity in the unit kube-scheduler counts `resource` in: millicores for cpu, whole units otherwise."""
    return _in_unit(resource, parse_quantity(value))


def is_pod_level_resource(resource: str) -> bool:
    """Whether `spec.resources` may name `resource` (component-helpers' IsSupportedPodLevelResource)."""
    return resource in POD_LEVEL_RESOURCES or resource.startswith(HUGEPAGES_PREFIX)


# A resource list as exact amounts: what component-helpers' v1.ResourceList holds.
_Exact = dict[str, Decimal]


def _exact(section: Mapping[str, Any] | None, wanted: frozenset[str] | None) -> _Exact:
    out: _Exact = {}
    if not section:
        return out
    if wanted is None:
        for resource, value in section.items():
            out[resource] = _non_negative(resource, value)
    else:  # callers want one or two resources of sections that name several
        for resource in wanted:
            if resource in section:
                out[resource] = _non_negative(resource, section[resource])
    return out


def _non_negative(resource: str, value: Any) -> Decimal:
    """The API server refuses negative requests and limits; a hand-made object's would lower a sum (and an init
    container's peak could hide it), so it is refused here too."""
    amount = parse_quantity(value)
    if amount < 0:
        raise InvalidQuantity(f"{resource}: {str(value)[:40]!r} is negative (requests and limits must not be)")
    return amount


def _container_exact(container: Mapping[str, Any], wanted: frozenset[str] | None) -> _Exact:
    resources = container.get("resources") or {}
    merged = _exact(resources.get("limits"), wanted)
    merged.update(_exact(resources.get("requests"), wanted))
    return merged


def _add(into: _Exact, other: Mapping[str, Decimal]) -> None:
    for resource, amount in other.items():
        into[resource] = EXACT.add(into.get(resource, _ZERO), amount)


def _max(into: _Exact, other: Mapping[str, Decimal]) -> None:
    for resource, amount in other.items():
        current = into.get(resource)
        if current is None or amount > current:
            into[resource] = amount


def container_requests(container: Mapping[str, Any], wanted: Iterable[str] | None = None) -> dict[str, int]:
    """A container's own requests (each rounded up). An unset request defaults to its limit (the API server's
    defaulting does this on write; objects that did not pass through it, such as snapshots, may lack it)."""
    amounts = _container_exact(container, frozenset(wanted) if wanted is not None else None)
    return {resource: _in_unit(resource, amount) for resource, amount in amounts.items()}


def is_sidecar(container: Mapping[str, Any]) -> bool:
    """A native sidecar: an init container with `restartPolicy: Always`, running beside the app containers."""
    return container.get("restartPolicy") == RESTART_POLICY_ALWAYS


def _resize_infeasible(pod: Mapping[str, Any]) -> bool:
    for condition in (pod.get("status") or {}).get("conditions") or ():
        if isinstance(condition, Mapping) and condition.get("type") == CONDITION_RESIZE_PENDING:
            return condition.get("reason") == REASON_INFEASIBLE
    return False


def _container_statuses(pod: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    status = pod.get("status") or {}
    found: dict[str, Mapping[str, Any]] = {}
    for key in ("containerStatuses", "initContainerStatuses"):  # init entries win, as in component-helpers
        for entry in status.get(key) or ():
            if isinstance(entry, Mapping):
                found[str(entry.get("name", ""))] = entry
    return found


def _with_status(
    own: _Exact, entry: Mapping[str, Any] | None, infeasible: bool, wanted: frozenset[str] | None
) -> _Exact:
    """component-helpers' determineContainerReqs: a container kubelet reports resources for counts the largest of
    what its spec asks (unless the resize is infeasible), what it runs with, and what kubelet allocated."""
    if entry is None or entry.get("resources") is None:
        return own
    result: _Exact = {} if infeasible else dict(own)
    _max(result, _exact((entry.get("resources") or {}).get("requests"), wanted))
    _max(result, _exact(entry.get("allocatedResources"), wanted))
    return result


def pod_requests(
    pod: Mapping[str, Any], resources: Iterable[str] | None = None, *, status_resources: bool = False
) -> dict[str, int]:
    """The pod's requests as kube-scheduler's NodeResourcesFit counts them (component-helpers' PodRequests):

    - app containers are summed, and every native sidecar runs beside them, so sidecars are added;
    - an ordinary init container runs alone beside the sidecars started before it: the pod needs the largest of
      those moments, and the larger of that and the app phase;
    - pod-level `spec.resources.requests` (cpu, memory, hugepages) replace the containers' figure for those
      resources; a pod-level limit without a request stands for it where no container asks for the resource (the
      API server's defaulting);
    - `spec.overhead` (RuntimeClass) is added on top.

    `status_resources`: count in-place resizes as kube-scheduler does for pods already on a node (NodeInfo, with
    InPlacePodVerticalScaling): an app container or sidecar with reported resources counts the largest of its
    spec, its status and its allocated resources. Filter (a pending pod) leaves it off.

    `resources` restricts the result to those names (cheaper for callers that need only cpu). Resources asked as
    0 are left out. Raises InvalidQuantity for a value that is not a quantity (the API server never stores one)."""
    wanted = frozenset(resources) if resources is not None else None
    spec = pod.get("spec") or {}
    statuses = _container_statuses(pod) if status_resources else None
    infeasible = status_resources and _resize_infeasible(pod)
    total: _Exact = {}
    for container in spec.get("containers") or ():
        own = _container_exact(container, wanted)
        if statuses is not None:
            own = _with_status(own, statuses.get(str(container.get("name", ""))), infeasible, wanted)
        _add(total, own)
    sidecars: _Exact = {}
    init_peak: _Exact = {}
    for container in spec.get("initContainers") or ():
        own = _container_exact(container, wanted)
        if container.get("restartPolicy") == RESTART_POLICY_ALWAYS:  # a native sidecar (is_sidecar)
            if statuses is not None:
                own = _with_status(own, statuses.get(str(container.get("name", ""))), infeasible, wanted)
            _add(total, own)
            _add(sidecars, own)
            _max(init_peak, sidecars)
        else:
            moment = dict(own)
            _add(moment, sidecars)
            _max(init_peak, moment)
    _max(total, init_peak)
    pod_resources = spec.get("resources")
    if pod_resources:
        _apply_pod_level(total, pod_resources, wanted)
    overhead = spec.get("overhead")
    if overhead:
        _add(total, _exact(overhead, wanted))
    rounded = {}
    for resource, amount in total.items():
        value = _in_unit(resource, amount)
        if value:
            rounded[resource] = value
    return rounded


def _apply_pod_level(total: _Exact, pod_resources: Mapping[str, Any], wanted: frozenset[str] | None) -> None:
    """Pod-level requests replace the containers' figure (PodLevelResources)."""
    pod_level = dict(pod_resources.get("requests") or {})
    for resource, value in (pod_resources.get("limits") or {}).items():
        # defaulting: a missing pod-level request is the containers' figure for cpu and memory when they ask for
        # it (no change here), else the pod-level limit (hugepages are never overcommitted: always the limit)
        if resource not in pod_level and is_pod_level_resource(resource):
            if resource.startswith(HUGEPAGES_PREFIX) or resource not in total:
                pod_level[resource] = value
    for resource, value in pod_level.items():
        if is_pod_level_resource(resource) and (wanted is None or resource in wanted):
            total[resource] = parse_quantity(value)


def pod_request(pod: Mapping[str, Any], resource: str, *, status_resources: bool = False) -> int:
    """One resource of `pod_requests` (0 when the pod does not ask for it)."""
    return pod_requests(pod, (resource,), status_resources=status_resources).get(resource, 0)


# ---------------------------------------------------------------------------------------------
# The shape of a Pod: every field kube-vgpu reads has the type the API gives it
# ---------------------------------------------------------------------------------------------


class InvalidObject(ValueError):
    """An object with a field of a type the API server never sends (it decodes every object into typed structs
    first, so only a hand-made request can carry one); the message names the field."""


def _check_object(value: Any, where: str) -> Mapping[str, Any] | None:
    if value is not None and not isinstance(value, Mapping):
        raise InvalidObject(f"{where} must be an object, got {_json_type(value)}")
    return value


def _check_list(value: Any, where: str) -> list[Any]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise InvalidObject(f"{where} must be a list, got {_json_type(value)}")
    return value


def _check_objects(value: Any, where: str) -> list[Mapping[str, Any]]:
    items = _check_list(value, where)
    for index, item in enumerate(items):
        if not isinstance(item, Mapping):
            raise InvalidObject(f"{where}[{index}] must be an object, got {_json_type(item)}")
    return items


def _check_string(value: Any, where: str) -> None:
    if value is not None and not isinstance(value, str):
        raise InvalidObject(f"{where} must be a string, got {_json_type(value)}")


def _check_strings(mapping: Mapping[str, Any], keys: Iterable[str], where: str) -> None:
    for key in keys:
        _check_string(mapping.get(key), f"{where}.{key}")


def _check_string_map(value: Any, where: str) -> None:
    mapping = _check_object(value, where)
    for key, item in (mapping or {}).items():
        if not isinstance(item, str):
            raise InvalidObject(f"{where}[{key!r}] must be a string, got {_json_type(item)}")


def _check_quantity_map(value: Any, where: str) -> None:
    """Values must be quantities in form (a string or a number); parse_quantity judges their text."""
    mapping = _check_object(value, where)
    for key, item in (mapping or {}).items():
        if isinstance(item, bool) or not isinstance(item, str | int | float):
            raise InvalidObject(f"{where}[{key!r}] must be a quantity (a string or a number), got {_json_type(item)}")


def _check_resources(value: Any, where: str) -> None:
    resources = _check_object(value, where) or {}
    for section in ("limits", "requests"):
        _check_quantity_map(resources.get(section), f"{where}.{section}")


def _check_container(container: Mapping[str, Any], where: str) -> None:
    _check_strings(container, ("name", "image", "restartPolicy"), where)
    _check_resources(container.get("resources"), f"{where}.resources")
    for index, entry in enumerate(_check_objects(container.get("env"), f"{where}.env")):
        _check_strings(entry, ("name", "value"), f"{where}.env[{index}]")
        _check_object(entry.get("valueFrom"), f"{where}.env[{index}].valueFrom")
    for index, mount in enumerate(_check_objects(container.get("volumeMounts"), f"{where}.volumeMounts")):
        _check_strings(mount, ("name", "mountPath"), f"{where}.volumeMounts[{index}]")
    for index, source in enumerate(_check_objects(container.get("envFrom"), f"{where}.envFrom")):
        _check_string(source.get("prefix"), f"{where}.envFrom[{index}].prefix")
    security = _check_object(container.get("securityContext"), f"{where}.securityContext") or {}
    _check_boolean(security.get("privileged"), f"{where}.securityContext.privileged")
    capabilities = _check_object(security.get("capabilities"), f"{where}.securityContext.capabilities") or {}
    added = capabilities.get("add")
    if added is not None and (not isinstance(added, list) or not all(isinstance(name, str) for name in added)):
        raise InvalidObject(f"{where}.securityContext.capabilities.add must be a list of strings")


def _check_boolean(value: Any, where: str) -> None:
    if value is not None and not isinstance(value, bool):
        raise InvalidObject(f"{where} must be a boolean, got {_json_type(value)}")


def check_pod(pod: Any, where: str = "pod") -> Mapping[str, Any]:
    """`pod` itself when every field kube-vgpu reads has its API type (an absent or null field is fine); raises
    InvalidObject naming the first that does not. Values are left to their parsers (quantities, GPU requests)."""
    if not isinstance(pod, Mapping):
        raise InvalidObject(f"{where} must be an object, got {_json_type(pod)}")
    metadata = _check_object(pod.get("metadata"), f"{where}.metadata") or {}
    _check_strings(metadata, ("name", "namespace", "uid", "generateName", "resourceVersion", "creationTimestamp"),
                   f"{where}.metadata")
    _check_string_map(metadata.get("labels"), f"{where}.metadata.labels")
    _check_string_map(metadata.get("annotations"), f"{where}.metadata.annotations")
    for index, owner in enumerate(_check_objects(metadata.get("ownerReferences"), f"{where}.metadata.ownerReferences")):
        _check_strings(owner, ("apiVersion", "kind", "name", "uid"), f"{where}.metadata.ownerReferences[{index}]")
    spec = _check_object(pod.get("spec"), f"{where}.spec") or {}
    _check_strings(spec, ("nodeName", "schedulerName", "priorityClassName", "restartPolicy", "runtimeClassName"),
                   f"{where}.spec")
    priority = spec.get("priority")
    if priority is not None and (isinstance(priority, bool) or not isinstance(priority, int)):
        raise InvalidObject(f"{where}.spec.priority must be an integer, got {_json_type(priority)}")
    _check_string_map(spec.get("nodeSelector"), f"{where}.spec.nodeSelector")
    _check_quantity_map(spec.get("overhead"), f"{where}.spec.overhead")
    _check_resources(spec.get("resources"), f"{where}.spec.resources")
    _check_object(spec.get("affinity"), f"{where}.spec.affinity")
    _check_object(spec.get("securityContext"), f"{where}.spec.securityContext")
    for flag in ("hostPID", "hostIPC", "hostNetwork", "shareProcessNamespace"):
        _check_boolean(spec.get(flag), f"{where}.spec.{flag}")
    _check_objects(spec.get("tolerations"), f"{where}.spec.tolerations")
    for index, volume in enumerate(_check_objects(spec.get("volumes"), f"{where}.spec.volumes")):
        _check_string(volume.get("name"), f"{where}.spec.volumes[{index}].name")
    for key in ("initContainers", "containers", "ephemeralContainers"):
        for index, container in enumerate(_check_objects(spec.get(key), f"{where}.spec.{key}")):
            _check_container(container, f"{where}.spec.{key}[{index}]")
    status = _check_object(pod.get("status"), f"{where}.status") or {}
    _check_string(status.get("phase"), f"{where}.status.phase")
    return pod


def _json_type(value: Any) -> str:
    """How JSON names the value's type, for messages (the value itself may be huge)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, Mapping):
        return "an object"
    return type(value).__name__


# ---------------------------------------------------------------------------------------------
# Node selection (kube-scheduler's NodeAffinity plugin: nodeSelector and required node affinity)
# ---------------------------------------------------------------------------------------------


def _expression_matches(expression: Mapping[str, Any], value: str | None) -> bool:
    operator = expression.get("operator")
    values = [str(v) for v in expression.get("values") or ()]
    if operator == "In":
        return value is not None and value in values
    if operator == "NotIn":
        return value is None or value not in values
    if operator == "Exists":
        return value is not None
    if operator == "DoesNotExist":
        return value is None
    if operator in ("Gt", "Lt") and value is not None and len(values) == 1:
        try:
            left, right = int(value), int(values[0])
        except ValueError:
            return False
        return left > right if operator == "Gt" else left < right
    return False  # an unknown operator matches nothing, as the API server would not have stored it


def _term_matches(term: Mapping[str, Any], labels: Mapping[str, str], node_name: str) -> bool:
    expressions = term.get("matchExpressions") or ()
    fields = term.get("matchFields") or ()
    if not expressions and not fields:
        return False  # an empty term matches no node (kube-scheduler's rule)
    for expression in expressions:
        if not _expression_matches(expression, labels.get(str(expression.get("key")))):
            return False
    for expression in fields:
        value = node_name if expression.get("key") == "metadata.name" else None
        if not _expression_matches(expression, value):
            return False
    return True


def node_matches_pod(pod: Mapping[str, Any], labels: Mapping[str, str], node_name: str) -> bool:
    """Whether the pod's nodeSelector and required node affinity admit this node (terms ORed, expressions ANDed)."""
    spec = pod.get("spec") or {}
    for key, value in (spec.get("nodeSelector") or {}).items():
        if labels.get(key) != value:
            return False
    required = ((spec.get("affinity") or {}).get("nodeAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution"
    )
    if not required:
        return True
    terms = required.get("nodeSelectorTerms") or ()
    return any(_term_matches(term, labels, node_name) for term in terms)


def timestamp_seconds(text: Any, default: float) -> float:
    """An API object's RFC 3339 timestamp (creationTimestamp, status.startTime) as epoch seconds; `default` when it
    is missing or unreadable."""
    if not isinstance(text, str) or not text:
        return default
    try:
        return _dt.datetime.fromisoformat(text).timestamp()
    except ValueError:
        return default
