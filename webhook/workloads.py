"""How many GPU pods a workload marked as a gang runs at once (issue 13): the gang's size, read from the workload's
own spec when the webhook admits one of its pods.

Only pods that ask for vGPUs are gang members (kube-vgpu places no other pod), so a replica whose pod template asks
for no GPU (an MPI launcher, a JobSet's CPU-only coordinator) is not counted: counting it would make the gang wait
for a member that never comes to us.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from kube_vgpu.protocol import pod_asks_for_gpu


def _count(value: Any, default: int = 1) -> int:
    """A replica count as the controllers read it: absent means their default (1); nonsense counts as 0 (the size
    check refuses a gang of 0 with a message)."""
    if value is None:
        return default
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def _asks_for_gpu(template: Any) -> bool:
    spec = template.get("spec") if isinstance(template, Mapping) else None
    return isinstance(spec, Mapping) and pod_asks_for_gpu({"spec": spec})


def _job_spec_gpu_pods(job_spec: Any) -> int:
    """A batch/v1 Job spec's GPU pods at once: its parallelism (default 1), if its template asks for GPUs."""
    if not isinstance(job_spec, Mapping) or not _asks_for_gpu(job_spec.get("template")):
        return 0
    return _count(job_spec.get("parallelism"))


def _job(obj: Mapping[str, Any]) -> int:
    return _job_spec_gpu_pods(obj.get("spec"))


def _jobset(obj: Mapping[str, Any]) -> int:
    """Each replicatedJob runs `replicas` Jobs of its template."""
    total = 0
    for replicated in (obj.get("spec") or {}).get("replicatedJobs") or ():
        if isinstance(replicated, Mapping):
            template = replicated.get("template") or {}
            job_spec = template.get("spec") if isinstance(template, Mapping) else None
            total += _count(replicated.get("replicas")) * _job_spec_gpu_pods(job_spec)
    return total


def _replica_specs(field: str) -> Callable[[Mapping[str, Any]], int]:
    """training-operator jobs: a map of replica type (Master, Worker, Launcher, ...) -> {replicas, template}."""

    def count(obj: Mapping[str, Any]) -> int:
        specs = (obj.get("spec") or {}).get(field) or {}
        if not isinstance(specs, Mapping):
            return 0
        return sum(_count(spec.get("replicas")) for spec in specs.values()
                   if isinstance(spec, Mapping) and _asks_for_gpu(spec.get("template")))

    return count


#: (API group, kind) -> the number of GPU pods it runs at once. A workload of another kind cannot be a gang by our
#: annotation (the webhook says so).
GANG_SIZE_OF: Mapping[tuple[str, str], Callable[[Mapping[str, Any]], int]] = {
    ("batch", "Job"): _job,
    ("jobset.x-k8s.io", "JobSet"): _jobset,
    ("kubeflow.org", "PyTorchJob"): _replica_specs("pytorchReplicaSpecs"),
    ("kubeflow.org", "TFJob"): _replica_specs("tfReplicaSpecs"),
    ("kubeflow.org", "MPIJob"): _replica_specs("mpiReplicaSpecs"),
}
