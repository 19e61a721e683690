"""Kueue's Workloads as quota mode `kueue` reads them (pure: objects in, facts out; no I/O).

In that mode Kueue's controller admits: it creates a Workload for each Job it manages, reserves quota for it
(condition QuotaReserved), admits it (condition Admitted) and only then unsuspends the Job. The extender places the
pods of admitted Workloads and refuses the others. A pod is matched to its Workload through the UIDs Kueue records
on it: the Workload's ownerReferences (the Job; the pods themselves for Kueue's plain-pod groups) and its
kueue.x-k8s.io/job-uid label.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kube_vgpu.kubeapi import quantity_value

#: Workload label naming the UID of the Job it was created for (Kueue's controller/constants.JobUIDLabel).
JOB_UID_LABEL = "kueue.x-k8s.io/job-uid"
#: Condition types of a Workload's status (the same in v1beta1 and v1beta2).
QUOTA_RESERVED = "QuotaReserved"
ADMITTED = "Admitted"
FINISHED = "Finished"
EVICTED = "Evicted"


@dataclass(frozen=True)
class Workload:
    namespace: str
    name: str
    uid: str
    queue_name: str
    #: status.admission.clusterQueue once Kueue reserved quota for it ("" before)
    cluster_queue: str
    admitted: bool
    finished: bool
    #: Kueue's own words on why it is not admitted (or was evicted); "" when admitted
    message: str
    #: the UIDs a pod may point at: the Workload's owners and its job-uid label
    owner_uids: tuple[str, ...]
    #: what Kueue charged: (flavor, resource) -> amount, summed over its pod sets' status.admission resourceUsage
    charged: Mapping[tuple[str, str], int] = field(default_factory=dict)

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"


def _conditions(status: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    return {str(c.get("type")): c for c in status.get("conditions") or [] if isinstance(c, Mapping)}


def _true(condition: Mapping[str, Any] | None) -> bool:
    return condition is not None and condition.get("status") == "True"


def _charged(admission: Mapping[str, Any]) -> dict[tuple[str, str], int]:
    totals: dict[tuple[str, str], int] = {}
    for assignment in admission.get("podSetAssignments") or []:
        if not isinstance(assignment, Mapping):
            continue
        flavors = assignment.get("flavors") or {}
        for resource, amount in (assignment.get("resourceUsage") or {}).items():
            try:
                value = quantity_value(amount)
            except (ValueError, ArithmeticError):
                continue  # Kueue wrote it, the API server validated it: never expected
            key = (str(flavors.get(resource, "")), str(resource))
            totals[key] = totals.get(key, 0) + value
    return totals


def parse_workload(obj: Mapping[str, Any]) -> Workload:
    """One Workload object (either served version) as the facts quota mode kueue needs."""
    metadata = obj.get("metadata") or {}
    spec = obj.get("spec") or {}
    status = obj.get("status") or {}
    conditions = _conditions(status)
    admission = status.get("admission") or {}
    admitted = _true(conditions.get(ADMITTED))
    finished = _true(conditions.get(FINISHED))
    message = ""
    if not admitted:
        # the most telling of Kueue's conditions: why it was evicted, else why quota is not reserved (its
        # "couldn't assign flavors ... insufficient quota" message), else why admission is pending
        for kind in (EVICTED, QUOTA_RESERVED, ADMITTED):
            condition = conditions.get(kind)
            if condition is not None and condition.get("message") and (kind != EVICTED or _true(condition)):
                message = str(condition["message"])
                break
    owners = [str(ref.get("uid")) for ref in metadata.get("ownerReferences") or []
              if isinstance(ref, Mapping) and ref.get("uid")]
    job_uid = (metadata.get("labels") or {}).get(JOB_UID_LABEL)
    if job_uid:
        owners.append(str(job_uid))
    return Workload(
        namespace=str(metadata.get("namespace") or ""),
        name=str(metadata.get("name") or ""),
        uid=str(metadata.get("uid") or ""),
        queue_name=str(spec.get("queueName") or ""),
        cluster_queue=str(admission.get("clusterQueue") or "") if isinstance(admission, Mapping) else "",
        admitted=admitted and not finished,
        finished=finished,
        message=message,
        owner_uids=tuple(dict.fromkeys(owners)),
        charged=_charged(admission) if isinstance(admission, Mapping) else {},
    )


class WorkloadIndex:
    """Workloads by the UIDs pods point at. Built from the whole set at once (the watcher hands over every
    object of the kind on each change; rebuilding is cheaper than it sounds: one dict per Workload)."""

    def __init__(self, objects: Iterable[Mapping[str, Any]] = ()) -> None:
        self.workloads: list[Workload] = []
        self.by_uid: dict[str, Workload] = {}
        for obj in objects:
            workload = parse_workload(obj)
            self.workloads.append(workload)
            for uid in workload.owner_uids:
                current = self.by_uid.get(uid)
                # two Workloads for one Job happen for a moment while Kueue replaces one: the unfinished wins
                if current is None or current.finished:
                    self.by_uid[uid] = workload

    def for_pod(self, pod: Mapping[str, Any]) -> Workload | None:
        """The Workload of a pod: its own (Kueue's plain-pod groups own theirs), else its controller's."""
        metadata = pod.get("metadata") or {}
        found = self.by_uid.get(str(metadata.get("uid") or ""))
        if found is not None:
            return found
        for ref in metadata.get("ownerReferences") or []:
            if isinstance(ref, Mapping) and ref.get("uid"):
                found = self.by_uid.get(str(ref["uid"]))
                if found is not None:
                    return found
        return None
