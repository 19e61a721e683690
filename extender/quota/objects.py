"""Kueue's quota objects in Kueue's own schema (`kueue.x-k8s.io/v1beta1` and `v1beta2`), parsed and validated.

Each invalid object is reported with its kind, name and the offending field, and left out; the rest keep working
(one typo in one team's ClusterQueue must not open or close every other team's budget). Validation follows
Kueue's webhooks where it matters for the arithmetic: unique flavors and resources per ClusterQueue, flavor
resources in coveredResources order, non-negative quantities, borrowing/lending limits only with a cohort (or a
parent), lendingLimit <= nominalQuota on ClusterQueues.

Quantities are whole numbers in the unit pods request them in: vGPUs, MiB (`nvidia.com/gpumem`), percent of one
GPU (`nvidia.com/gpucores`), millicores (`cpu`), bytes (`memory`), pods.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kube_vgpu import kubeapi, protocol
from kube_vgpu.extender.quota.mig import uncountable_reason

KUEUE_VERSIONS = ("v1beta1", "v1beta2")
#: Cohort objects were kueue.x-k8s.io/v1alpha1 before they reached v1beta1.
COHORT_VERSIONS = ("v1alpha1", *KUEUE_VERSIONS)
KUEUE_KINDS = ("ResourceFlavor", "ClusterQueue", "LocalQueue", "Cohort", "WorkloadPriorityClass")

RESOURCE_CPU = "cpu"
RESOURCE_MEMORY = "memory"
RESOURCE_PODS = "pods"
#: Kueue's HAMi guide budgets memory and compute with a Kueue Configuration `resources.transformations` (input
#: nvidia.com/gpumem or gpucores, multiplyBy nvidia.com/gpu, output 1 each): per-vGPU amount times the vGPU count.
#: Counted by the gate as if that transformation were configured (extender/quota/usage.py).
TOTAL_GPU_MEMORY = "nvidia.com/total-gpumem"
TOTAL_GPU_CORES = "nvidia.com/total-gpucores"
#: How each countable resource is measured (for reports and docs).
RESOURCE_UNITS = {
    protocol.RESOURCE_GPU: "vGPUs",
    protocol.RESOURCE_GPU_MEMORY: "MiB",
    protocol.RESOURCE_GPU_CORES: "percent of a GPU",  # no "%": reasons reach events as format strings
    TOTAL_GPU_MEMORY: "MiB",
    TOTAL_GPU_CORES: "percent of a GPU",
    RESOURCE_CPU: "millicores",
    RESOURCE_MEMORY: "bytes",
    RESOURCE_PODS: "pods",
}
#: Resources counted in the pod API's own whole-number units: a suffix ("80Gi") would silently mean something else.
PLAIN_COUNT_RESOURCES = frozenset({protocol.RESOURCE_GPU, protocol.RESOURCE_GPU_MEMORY, protocol.RESOURCE_GPU_CORES,
                                   TOTAL_GPU_MEMORY, TOTAL_GPU_CORES, RESOURCE_PODS})

STRICT_FIFO = "StrictFIFO"
BEST_EFFORT_FIFO = "BestEffortFIFO"
QUEUEING_STRATEGIES = (STRICT_FIFO, BEST_EFFORT_FIFO)
STOP_POLICIES = ("None", "Hold", "HoldAndDrain")
SELECTOR_OPERATORS = ("In", "NotIn", "Exists", "DoesNotExist")
TOLERATION_OPERATORS = ("Equal", "Exists")
TAINT_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")
# ClusterQueue spec.preemption (Kueue's ClusterQueuePreemption); "Never" everywhere is Kueue's default
NEVER = "Never"
LOWER_PRIORITY = "LowerPriority"
LOWER_OR_NEWER_EQUAL_PRIORITY = "LowerOrNewerEqualPriority"
ANY = "Any"
WITHIN_CLUSTER_QUEUE_POLICIES = (NEVER, LOWER_PRIORITY, LOWER_OR_NEWER_EQUAL_PRIORITY)
RECLAIM_WITHIN_COHORT_POLICIES = (NEVER, LOWER_PRIORITY, ANY)
BORROW_WITHIN_COHORT_POLICIES = (NEVER, LOWER_PRIORITY)
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
#: spec.fairSharing.weight when unset (Kueue's default: 1), in thousandths as Quantity.MilliValue() gives it
DEFAULT_FAIR_WEIGHT_MILLI = 1000


class QuotaConfigError(ValueError):
    """One invalid object; the message names the object and the field."""


# ---------------------------------------------------------------------------------------------
# Objects
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Requirement:
    key: str
    operator: str
    values: tuple[str, ...] = ()

    def matches(self, labels: Mapping[str, str]) -> bool:
        if self.operator == "Exists":
            return self.key in labels
        if self.operator == "DoesNotExist":
            return self.key not in labels
        if self.operator == "In":
            return self.key in labels and labels[self.key] in self.values
        return self.key not in labels or labels[self.key] not in self.values  # NotIn


@dataclass(frozen=True, slots=True)
class LabelSelector:
    """metav1.LabelSelector; `{}` selects everything (a null selector is represented by None, selecting nothing)."""

    match_labels: tuple[tuple[str, str], ...] = ()
    match_expressions: tuple[Requirement, ...] = ()

    def matches(self, labels: Mapping[str, str]) -> bool:
        return all(labels.get(k) == v for k, v in self.match_labels) and all(
            r.matches(labels) for r in self.match_expressions
        )

    def describe(self) -> str:
        parts = [f"{k}={v}" for k, v in self.match_labels]
        for r in self.match_expressions:
            parts.append(f"{r.key} {r.operator} ({','.join(r.values)})" if r.values else f"{r.key} {r.operator}")
        return ", ".join(parts) or "{} (all namespaces)"


@dataclass(frozen=True, slots=True)
class Taint:
    key: str
    value: str
    effect: str


@dataclass(frozen=True, slots=True)
class Toleration:
    key: str = ""
    operator: str = "Equal"
    value: str = ""
    effect: str = ""

    def tolerates(self, taint: Taint) -> bool:
        """corev1 semantics: an empty effect matches all effects, an empty key with Exists matches all keys."""
        if self.effect and self.effect != taint.effect:
            return False
        if not self.key:
            return self.operator == "Exists"
        if self.key != taint.key:
            return False
        return self.operator == "Exists" or self.value == taint.value


@dataclass(frozen=True, slots=True)
class ResourceFlavor:
    name: str
    node_labels: tuple[tuple[str, str], ...] = ()
    node_taints: tuple[Taint, ...] = ()
    tolerations: tuple[Toleration, ...] = ()

    def matches_node(self, labels: Mapping[str, str]) -> bool:
        return all(labels.get(k) == v for k, v in self.node_labels)

    def tolerated_by(self, tolerations: Iterable[Toleration]) -> bool:
        """Kueue skips a flavor whose NoSchedule/NoExecute nodeTaints the workload does not tolerate, counting the
        flavor's own spec.tolerations with the pod's (Kueue's flavor assigner: podSpec.Tolerations + flavor's,
        which Kueue then adds to the admitted pods)."""
        tolerations = (*tolerations, *self.tolerations)
        return all(any(t.tolerates(taint) for t in tolerations) for taint in self.node_taints
                   if taint.effect in ("NoSchedule", "NoExecute"))

    def describe_labels(self) -> str:
        return ",".join(f"{k}={v}" for k, v in self.node_labels) or "any node"


@dataclass(frozen=True, slots=True)
class ResourceQuota:
    """One (flavor, resource) quota. None limits mean "no limit" (Kueue's nil)."""

    nominal: int
    borrowing_limit: int | None = None
    lending_limit: int | None = None


@dataclass(frozen=True, slots=True)
class FlavorQuotas:
    name: str
    resources: tuple[tuple[str, ResourceQuota], ...]

    def quota(self, resource: str) -> ResourceQuota | None:
        for name, quota in self.resources:
            if name == resource:
                return quota
        return None


@dataclass(frozen=True, slots=True)
class ResourceGroup:
    covered_resources: tuple[str, ...]
    flavors: tuple[FlavorQuotas, ...]


@dataclass(frozen=True, slots=True)
class Preemption:
    """ClusterQueue spec.preemption. The defaults are Kueue's: nothing is ever preempted."""

    within_cluster_queue: str = NEVER
    reclaim_within_cohort: str = NEVER
    borrow_within_cohort: str = NEVER
    #: borrowWithinCohort.maxPriorityThreshold: only victims at or below it (None: any lower priority)
    max_priority_threshold: int | None = None


@dataclass(frozen=True, slots=True)
class ClusterQueue:
    name: str
    resource_groups: tuple[ResourceGroup, ...] = ()
    cohort: str | None = None
    namespace_selector: LabelSelector | None = None  # None: no namespace (Kueue's null)
    queueing_strategy: str = BEST_EFFORT_FIFO
    stop_policy: str = "None"
    preemption: Preemption = Preemption()
    #: spec.fairSharing.weight in thousandths; None when unset (weight 1). Read only with --fair-sharing.
    fair_weight_milli: int | None = None

    @property
    def fair_weight(self) -> int:
        """The weight in thousandths, defaulted (0 is allowed: the share is infinite while it borrows)."""
        return DEFAULT_FAIR_WEIGHT_MILLI if self.fair_weight_milli is None else self.fair_weight_milli

    @property
    def covered_resources(self) -> frozenset[str]:
        return frozenset(r for group in self.resource_groups for r in group.covered_resources)

    def quotas(self) -> dict[tuple[str, str], ResourceQuota]:
        return {(fq.name, r): q for group in self.resource_groups for fq in group.flavors for r, q in fq.resources}

    def flavor_names(self) -> list[str]:
        return [fq.name for group in self.resource_groups for fq in group.flavors]


@dataclass(frozen=True, slots=True)
class Cohort:
    name: str
    parent: str | None = None
    resource_groups: tuple[ResourceGroup, ...] = ()
    #: spec.fairSharing.weight in thousandths; None when unset (weight 1)
    fair_weight_milli: int | None = None

    @property
    def fair_weight(self) -> int:
        return DEFAULT_FAIR_WEIGHT_MILLI if self.fair_weight_milli is None else self.fair_weight_milli

    def quotas(self) -> dict[tuple[str, str], ResourceQuota]:
        return {(fq.name, r): q for group in self.resource_groups for fq in group.flavors for r, q in fq.resources}


@dataclass(frozen=True, slots=True)
class LocalQueue:
    namespace: str
    name: str
    cluster_queue: str
    stop_policy: str = "None"


@dataclass(frozen=True, slots=True)
class WorkloadPriorityClass:
    name: str
    value: int


@dataclass(slots=True)
class QuotaConfig:
    """Every valid object, by name, plus the reasons the invalid ones were left out."""

    flavors: dict[str, ResourceFlavor] = field(default_factory=dict)
    cluster_queues: dict[str, ClusterQueue] = field(default_factory=dict)
    local_queues: dict[tuple[str, str], LocalQueue] = field(default_factory=dict)
    cohorts: dict[str, Cohort] = field(default_factory=dict)
    priority_classes: dict[str, WorkloadPriorityClass] = field(default_factory=dict)
    #: namespace -> labels, from Namespace objects in the same sources (live mode: the cluster's namespaces)
    namespaces: dict[str, dict[str, str]] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.cluster_queues


# ---------------------------------------------------------------------------------------------
# Quantities
# ---------------------------------------------------------------------------------------------

def parse_quantity(value: Any, resource: str, where: str) -> int:
    """A Kubernetes quantity (read by kubeapi) as a whole number in the resource's counting unit (RESOURCE_UNITS)."""
    if isinstance(value, bool) or value is None:
        raise QuotaConfigError(f"{where}: expected a quantity, got {value!r}")
    text = str(value).strip()
    try:
        amount, suffix = kubeapi.parse_quantity_and_suffix(text)
    except kubeapi.InvalidQuantity:
        raise QuotaConfigError(f"{where}: {text!r} is not a Kubernetes quantity") from None
    if resource in PLAIN_COUNT_RESOURCES and suffix:
        unit = RESOURCE_UNITS.get(resource, "units")
        raise QuotaConfigError(f"{where}: {resource} is counted in {unit} as pods request it; write a plain "
                               f"number, not {text!r}")
    if resource == RESOURCE_CPU:
        amount = amount.scaleb(3, kubeapi.EXACT)  # millicores, as pods' "500m"
    if amount < 0:
        raise QuotaConfigError(f"{where}: {text!r} must be greater than or equal to 0")
    if amount != amount.to_integral_value():
        unit = RESOURCE_UNITS.get(resource, "units")
        raise QuotaConfigError(f"{where}: {text!r} is not a whole number of {unit}")
    return int(amount)


# ---------------------------------------------------------------------------------------------
# Parsing
# ---------------------------------------------------------------------------------------------


def _mapping(value: Any, where: str, *, optional: bool = True) -> Mapping[str, Any]:
    if value is None and optional:
        return {}
    if not isinstance(value, Mapping):
        raise QuotaConfigError(f"{where}: must be an object")
    return value


def _list(value: Any, where: str) -> list[Any]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise QuotaConfigError(f"{where}: must be a list")
    return value


def _string(value: Any, where: str, *, required: bool = False) -> str:
    if value is None or value == "":
        if required:
            raise QuotaConfigError(f"{where}: is required")
        return ""
    if not isinstance(value, str):
        raise QuotaConfigError(f"{where}: must be a string")
    return value


def _string_map(value: Any, where: str) -> tuple[tuple[str, str], ...]:
    items = _mapping(value, where)
    for key, item in items.items():
        if not isinstance(key, str) or not isinstance(item, str):
            raise QuotaConfigError(f"{where}: keys and values must be strings ({key!r}: {item!r})")
    return tuple(sorted(items.items()))


def _enum(value: Any, allowed: tuple[str, ...], default: str, where: str) -> str:
    if value is None or value == "":
        return default
    if value not in allowed:
        raise QuotaConfigError(f"{where}: {value!r} is not one of {', '.join(allowed)}")
    return str(value)


def parse_label_selector(value: Any, where: str) -> LabelSelector | None:
    if value is None:
        return None
    doc = _mapping(value, where, optional=False)
    expressions = []
    for i, raw in enumerate(_list(doc.get("matchExpressions"), f"{where}.matchExpressions")):
        here = f"{where}.matchExpressions[{i}]"
        raw = _mapping(raw, here, optional=False)
        operator = _enum(raw.get("operator"), SELECTOR_OPERATORS, "", f"{here}.operator")
        if not operator:
            raise QuotaConfigError(f"{here}.operator: is required")
        values = tuple(str(v) for v in _list(raw.get("values"), f"{here}.values"))
        if operator in ("In", "NotIn") and not values:
            raise QuotaConfigError(f"{here}.values: must be non-empty for operator {operator}")
        if operator in ("Exists", "DoesNotExist") and values:
            raise QuotaConfigError(f"{here}.values: must be empty for operator {operator}")
        expressions.append(Requirement(_string(raw.get("key"), f"{here}.key", required=True), operator, values))
    return LabelSelector(_string_map(doc.get("matchLabels"), f"{where}.matchLabels"), tuple(expressions))


def parse_tolerations(value: Any, where: str) -> tuple[Toleration, ...]:
    result = []
    for i, raw in enumerate(_list(value, where)):
        here = f"{where}[{i}]"
        raw = _mapping(raw, here, optional=False)
        operator = _enum(raw.get("operator"), TOLERATION_OPERATORS, "Equal", f"{here}.operator")
        effect = _enum(raw.get("effect"), TAINT_EFFECTS, "", f"{here}.effect")
        result.append(Toleration(_string(raw.get("key"), f"{here}.key"), operator,
                                 _string(raw.get("value"), f"{here}.value"), effect))
    return tuple(result)


# complexity: one check per field of Kueue's resourceGroups schema, each with its own message
def _parse_resource_groups(  # noqa: C901
    value: Any, where: str, *, has_parent: bool, parent_word: str, limit_lending_to_nominal: bool
) -> tuple[ResourceGroup, ...]:
    groups = []
    seen_resources: set[str] = set()
    seen_flavors: set[str] = set()
    raw_groups = _list(value, where)
    if len(raw_groups) > 16:
        raise QuotaConfigError(f"{where}: at most 16 resource groups")
    for i, raw in enumerate(raw_groups):
        here = f"{where}[{i}]"
        raw = _mapping(raw, here, optional=False)
        covered = []
        for j, name in enumerate(_list(raw.get("coveredResources"), f"{here}.coveredResources")):
            name = _string(name, f"{here}.coveredResources[{j}]", required=True)
            if name in seen_resources:
                raise QuotaConfigError(f"{here}.coveredResources[{j}]: duplicate resource {name!r} (each resource "
                                       f"belongs to one resource group)")
            seen_resources.add(name)
            covered.append(name)
        if not covered:
            raise QuotaConfigError(f"{here}.coveredResources: must not be empty")
        flavors = []
        raw_flavors = _list(raw.get("flavors"), f"{here}.flavors")
        if not raw_flavors:
            raise QuotaConfigError(f"{here}.flavors: must not be empty")
        for j, raw_flavor in enumerate(raw_flavors):
            fhere = f"{here}.flavors[{j}]"
            raw_flavor = _mapping(raw_flavor, fhere, optional=False)
            flavor_name = _string(raw_flavor.get("name"), f"{fhere}.name", required=True)
            if flavor_name in seen_flavors:
                raise QuotaConfigError(f"{fhere}.name: duplicate flavor {flavor_name!r}")
            seen_flavors.add(flavor_name)
            raw_resources = _list(raw_flavor.get("resources"), f"{fhere}.resources")
            if len(raw_resources) != len(covered):
                raise QuotaConfigError(f"{fhere}.resources: must list the {len(covered)} coveredResources "
                                       f"({', '.join(covered)}) in the same order, found {len(raw_resources)}")
            resources = []
            for k, raw_quota in enumerate(raw_resources):
                rhere = f"{fhere}.resources[{k}]"
                raw_quota = _mapping(raw_quota, rhere, optional=False)
                name = _string(raw_quota.get("name"), f"{rhere}.name", required=True)
                if name != covered[k]:
                    raise QuotaConfigError(f"{rhere}.name: {name!r} must match coveredResources[{k}] "
                                           f"({covered[k]!r})")
                if "nominalQuota" not in raw_quota:
                    raise QuotaConfigError(f"{rhere}.nominalQuota: is required")
                nominal = parse_quantity(raw_quota["nominalQuota"], name, f"{rhere}.nominalQuota")
                limits: list[int | None] = []
                for key in ("borrowingLimit", "lendingLimit"):
                    if raw_quota.get(key) is None:
                        limits.append(None)
                        continue
                    if not has_parent:
                        raise QuotaConfigError(f"{rhere}.{key}: must be nil when {parent_word} is empty")
                    limits.append(parse_quantity(raw_quota[key], name, f"{rhere}.{key}"))
                borrowing, lending = limits
                if limit_lending_to_nominal and lending is not None and lending > nominal:
                    raise QuotaConfigError(f"{rhere}.lendingLimit: {lending} must be less than or equal to the "
                                           f"nominalQuota ({nominal})")
                resources.append((name, ResourceQuota(nominal, borrowing, lending)))
            flavors.append(FlavorQuotas(flavor_name, tuple(resources)))
        groups.append(ResourceGroup(tuple(covered), tuple(flavors)))
    return tuple(groups)


def parse_preemption(value: Any, where: str) -> Preemption:
    """spec.preemption, with Kueue's validation (its CRD rule refuses reclaim Never with borrowing preemption)."""
    doc = _mapping(value, where)
    within = _enum(doc.get("withinClusterQueue"), WITHIN_CLUSTER_QUEUE_POLICIES, NEVER, f"{where}.withinClusterQueue")
    reclaim = _enum(doc.get("reclaimWithinCohort"), RECLAIM_WITHIN_COHORT_POLICIES, NEVER,
                    f"{where}.reclaimWithinCohort")
    borrow_doc = _mapping(doc.get("borrowWithinCohort"), f"{where}.borrowWithinCohort")
    borrow = _enum(borrow_doc.get("policy"), BORROW_WITHIN_COHORT_POLICIES, NEVER, f"{where}.borrowWithinCohort.policy")
    threshold = borrow_doc.get("maxPriorityThreshold")
    if threshold is not None and (isinstance(threshold, bool) or not isinstance(threshold, int)
                                  or not INT32_MIN <= threshold <= INT32_MAX):
        raise QuotaConfigError(f"{where}.borrowWithinCohort.maxPriorityThreshold: must be a 32-bit integer, "
                               f"got {threshold!r}")
    if reclaim == NEVER and borrow != NEVER:
        raise QuotaConfigError(f"{where}: reclaimWithinCohort=Never and borrowWithinCohort.policy={borrow} "
                               f"contradict each other (Kueue refuses them); set reclaimWithinCohort too")
    return Preemption(within, reclaim, borrow, threshold)


def parse_fair_sharing(value: Any, where: str) -> int | None:
    """spec.fairSharing: its weight in thousandths (Quantity.MilliValue(), rounded up as Kueue reads it), or None
    when unset. Kueue's CRD refuses a negative weight; 0 is allowed (the share is infinite while borrowing)."""
    doc = _mapping(value, where)
    raw = doc.get("weight")
    if raw is None:
        return None
    if isinstance(raw, bool):
        raise QuotaConfigError(f"{where}.weight: expected a quantity, got {raw!r}")
    text = str(raw).strip()
    try:
        amount = kubeapi.parse_quantity(text)
    except kubeapi.InvalidQuantity:
        raise QuotaConfigError(f"{where}.weight: {text!r} is not a Kubernetes quantity") from None
    if amount < 0:
        raise QuotaConfigError(f"{where}.weight: {text!r} must be greater than or equal to 0")
    milli = kubeapi.quantity_milli(text)
    if milli > 2**62:  # a share divided by it is 0 anyway; refused rather than carried as a huge number
        raise QuotaConfigError(f"{where}.weight: {text!r} is too large")
    return milli


def _check_version(api_version: str, kind: str, allowed: tuple[str, ...], where: str) -> str:
    group, _, version = api_version.partition("/")
    if group != protocol.KUEUE_API_GROUP or version not in allowed:
        supported = ", ".join(f"{protocol.KUEUE_API_GROUP}/{v}" for v in allowed)
        raise QuotaConfigError(f"{where}: apiVersion {api_version!r} is not supported for {kind} ({supported})")
    return version


def _reject_other_version_field(spec: Mapping[str, Any], version: str, v1beta1_name: str, v1beta2_name: str,
                                where: str) -> None:
    """A field spelled as in the other API version is a mistake worth naming (the API server would prune it)."""
    if version == "v1beta2" and v1beta1_name in spec:
        raise QuotaConfigError(f"{where}: spec.{v1beta1_name}: is the v1beta1 name; "
                               f"{protocol.KUEUE_API_GROUP}/v1beta2 calls it spec.{v1beta2_name}")
    if version != "v1beta2" and v1beta2_name in spec:
        raise QuotaConfigError(f"{where}: spec.{v1beta2_name}: is the v1beta2 name; "
                               f"{protocol.KUEUE_API_GROUP}/{version} calls it spec.{v1beta1_name}")


def _cohort_parent_field(spec: Mapping[str, Any], version: str, where: str) -> str:
    """Kueue's Cohort names its parent `spec.parent` in v1alpha1 only; from v1beta1 (Kueue v0.13) on, and in
    v1beta2, it is `spec.parentName`. The other spelling is refused with the right name (the API server would
    prune it, leaving a root cohort that lends nothing to its parent's queues)."""
    field_name, other = ("parent", "parentName") if version == "v1alpha1" else ("parentName", "parent")
    if other in spec:
        raise QuotaConfigError(f"{where}: spec.{other}: does not exist in {protocol.KUEUE_API_GROUP}/{version}; "
                               f"it calls the parent spec.{field_name}")
    return field_name


def parse_object(doc: Mapping[str, Any]) -> Any:
    """One Kueue object (or a Namespace) -> its dataclass; raises QuotaConfigError naming object and field.
    Returns None for kinds the gate does not use."""
    kind = doc.get("kind")
    metadata = _mapping(doc.get("metadata"), f"{kind}: metadata")
    name = metadata.get("name")
    if not isinstance(name, str) or not name:
        raise QuotaConfigError(f"{kind}: metadata.name is required")
    api_version = str(doc.get("apiVersion") or "")
    where = f"{kind} {name}"
    if kind == "Namespace":
        return ("Namespace", name, dict(_string_map(metadata.get("labels"), f"{where}: metadata.labels")))
    if kind not in KUEUE_KINDS:
        return None
    version = _check_version(api_version, kind, COHORT_VERSIONS if kind == "Cohort" else KUEUE_VERSIONS, where)
    if kind == "WorkloadPriorityClass":
        value = doc.get("value")
        if isinstance(value, bool) or not isinstance(value, int):
            raise QuotaConfigError(f"{where}: value: must be an integer, got {value!r}")
        return WorkloadPriorityClass(name, value)
    spec = _mapping(doc.get("spec"), f"{where}: spec")
    if kind == "ResourceFlavor":
        taints = []
        for i, raw in enumerate(_list(spec.get("nodeTaints"), f"{where}: spec.nodeTaints")):
            here = f"{where}: spec.nodeTaints[{i}]"
            raw = _mapping(raw, here, optional=False)
            effect = _enum(raw.get("effect"), TAINT_EFFECTS, "", f"{here}.effect")
            if not effect:
                raise QuotaConfigError(f"{here}.effect: is required")
            taints.append(Taint(_string(raw.get("key"), f"{here}.key", required=True),
                                _string(raw.get("value"), f"{here}.value"), effect))
        return ResourceFlavor(
            name,
            _string_map(spec.get("nodeLabels"), f"{where}: spec.nodeLabels"),
            tuple(taints),
            parse_tolerations(spec.get("tolerations"), f"{where}: spec.tolerations"),
        )
    if kind == "LocalQueue":
        namespace = metadata.get("namespace") or "default"
        where = f"LocalQueue {namespace}/{name}"
        return LocalQueue(
            namespace,
            name,
            _string(spec.get("clusterQueue"), f"{where}: spec.clusterQueue", required=True),
            _enum(spec.get("stopPolicy"), STOP_POLICIES, "None", f"{where}: spec.stopPolicy"),
        )
    if kind == "Cohort":
        parent_field = _cohort_parent_field(spec, version, where)
        parent = _string(spec.get(parent_field), f"{where}: spec.{parent_field}") or None
        groups = _parse_resource_groups(spec.get("resourceGroups"), f"{where}: spec.resourceGroups",
                                        has_parent=parent is not None, parent_word="parent",
                                        limit_lending_to_nominal=False)
        return Cohort(name, parent, groups,
                      parse_fair_sharing(spec.get("fairSharing"), f"{where}: spec.fairSharing"))
    # ClusterQueue
    _reject_other_version_field(spec, version, "cohort", "cohortName", where)
    cohort = _string(spec.get("cohortName" if version == "v1beta2" else "cohort"),
                     f"{where}: spec.{'cohortName' if version == 'v1beta2' else 'cohort'}") or None
    groups = _parse_resource_groups(spec.get("resourceGroups"), f"{where}: spec.resourceGroups",
                                    has_parent=cohort is not None, parent_word="cohort",
                                    limit_lending_to_nominal=True)
    return ClusterQueue(
        name=name,
        resource_groups=groups,
        cohort=cohort,
        namespace_selector=parse_label_selector(spec.get("namespaceSelector"), f"{where}: spec.namespaceSelector"),
        queueing_strategy=_enum(spec.get("queueingStrategy"), QUEUEING_STRATEGIES, BEST_EFFORT_FIFO,
                                f"{where}: spec.queueingStrategy"),
        stop_policy=_enum(spec.get("stopPolicy"), STOP_POLICIES, "None", f"{where}: spec.stopPolicy"),
        preemption=parse_preemption(spec.get("preemption"), f"{where}: spec.preemption"),
        fair_weight_milli=parse_fair_sharing(spec.get("fairSharing"), f"{where}: spec.fairSharing"),
    )


#: spec fields of Kueue's objects (v0.19) the gate reads and carries out
IMPLEMENTED_SPEC_FIELDS = {
    "ClusterQueue": frozenset({"resourceGroups", "cohort", "cohortName", "namespaceSelector", "queueingStrategy",
                               "stopPolicy", "preemption", "fairSharing"}),
    "Cohort": frozenset({"parent", "parentName", "resourceGroups", "fairSharing"}),
    "ResourceFlavor": frozenset({"nodeLabels", "nodeTaints", "tolerations"}),
    "LocalQueue": frozenset({"clusterQueue", "stopPolicy"}),
}
#: spec fields Kueue has that the gate does not carry out -> what that means (said once per object, never silent)
UNIMPLEMENTED_SPEC_FIELDS = {
    "ClusterQueue": {
        "admissionChecks": "no AdmissionCheck is run: pods are admitted on quota alone",
        "admissionChecksStrategy": "no AdmissionCheck is run: pods are admitted on quota alone",
        "flavorFungibility": "the node's labels pick the flavor, the first in list order that fits (docs/quota.md)",
        "admissionScope": "Admission Fair Sharing (usage history per LocalQueue) is not implemented",
        "concurrentAdmissionPolicy": "concurrent admission of workload variants is not implemented",
    },
    "Cohort": {},
    "ResourceFlavor": {
        "topologyName": "Topology Aware Scheduling is not implemented: pods are placed by the extender's policy",
    },
    "LocalQueue": {
        "fairSharing": "Admission Fair Sharing (usage history per LocalQueue) is not implemented",
    },
}


def spec_warnings(doc: Mapping[str, Any]) -> list[str]:
    """One warning per spec field of a Kueue object the gate does not carry out: Kueue's fields it does not
    implement (what that means), and fields Kueue does not have (a typo, or a newer Kueue: either way ignored)."""
    kind = str(doc.get("kind"))
    spec = doc.get("spec")
    if kind not in IMPLEMENTED_SPEC_FIELDS or not isinstance(spec, Mapping):
        return []
    name = (doc.get("metadata") or {}).get("name")
    if kind == "LocalQueue":
        name = f"{(doc.get('metadata') or {}).get('namespace') or 'default'}/{name}"
    unimplemented = UNIMPLEMENTED_SPEC_FIELDS[kind]
    warnings = []
    for key in spec:
        if key in IMPLEMENTED_SPEC_FIELDS[kind] or spec[key] is None:
            continue
        if key in unimplemented:
            warnings.append(f"{kind} {name}: spec.{key} is not implemented by the quota gate and is ignored "
                            f"({unimplemented[key]})")
        else:
            warnings.append(f"{kind} {name}: spec.{key} is not a field of Kueue's {kind} that the quota gate "
                            "knows; it is ignored")
    return warnings


def _add_once(warnings: list[str], new: Iterable[str]) -> None:
    """A file object replaced by the cluster's is said once."""
    warnings.extend(w for w in new if w not in warnings)


def build_config(docs: Iterable[tuple[str, Mapping[str, Any]]], *, fair_sharing: bool = False) -> QuotaConfig:
    """(source, object) pairs -> QuotaConfig. A later object of the same kind and name replaces an earlier one
    (callers list file objects first, then the cluster's: the API server is the source of truth).
    `fair_sharing`: the extender's --fair-sharing (without it a fairSharing.weight is read but not used: said)."""
    config = QuotaConfig()
    for source, doc in docs:
        if not isinstance(doc, Mapping):
            config.errors.append(f"{source}: a document is not an object")
            continue
        try:
            parsed = parse_object(doc)
        except QuotaConfigError as exc:
            config.errors.append(f"{source}: {exc}")
            continue
        if parsed is None:
            continue
        _add_once(config.warnings, spec_warnings(doc))
        if isinstance(parsed, tuple):  # a Namespace
            config.namespaces[parsed[1]] = parsed[2]
        elif isinstance(parsed, ResourceFlavor):
            config.flavors[parsed.name] = parsed
        elif isinstance(parsed, ClusterQueue):
            config.cluster_queues[parsed.name] = parsed
            for resource in parsed.covered_resources:
                if resource == protocol.RESOURCE_GPU_MEMORY_PERCENTAGE:
                    config.warnings.append(f"ClusterQueue {parsed.name}: {resource} is never counted (usage is "
                                           f"counted in MiB); cover {protocol.RESOURCE_GPU_MEMORY} instead")
                mig_problem = uncountable_reason(resource)
                if mig_problem is not None:
                    config.warnings.append(f"ClusterQueue {parsed.name}: {resource} is never counted: "
                                           f"{mig_problem}")
        elif isinstance(parsed, LocalQueue):
            config.local_queues[(parsed.namespace, parsed.name)] = parsed
        elif isinstance(parsed, Cohort):
            config.cohorts[parsed.name] = parsed
        elif isinstance(parsed, WorkloadPriorityClass):
            config.priority_classes[parsed.name] = parsed
    if not fair_sharing:
        _warn_unused_weights(config)
    return config


def _warn_unused_weights(config: QuotaConfig) -> None:
    """One warning per object whose fairSharing.weight nothing reads (after replacements: a file object
    overridden by the cluster's is not named)."""
    named = [("ClusterQueue", name, q.fair_weight_milli) for name, q in sorted(config.cluster_queues.items())]
    named += [("Cohort", name, c.fair_weight_milli) for name, c in sorted(config.cohorts.items())]
    for kind, name, weight in named:
        if weight is not None:
            config.warnings.append(f"{kind} {name}: spec.fairSharing.weight is read only with --fair-sharing "
                                   "(the extender runs without it)")


def load_documents(path: str | Path) -> list[dict[str, Any]]:
    """Multi-document YAML (or JSON); `kind: List` documents are flattened. Raises ValueError if unreadable."""
    text = Path(path).read_text()
    try:
        raw_docs = list(yaml.safe_load_all(text))
    except yaml.YAMLError as exc:
        raise ValueError(f"{path}: not valid YAML: {exc}") from None
    docs: list[dict[str, Any]] = []
    for doc in raw_docs:
        if doc is None:
            continue
        if isinstance(doc, dict) and doc.get("kind") == "List":
            docs.extend(item for item in doc.get("items") or [] if isinstance(item, dict))
        elif isinstance(doc, dict):
            docs.append(doc)
        else:
            raise ValueError(f"{path}: every YAML document must be an object")
    return docs
