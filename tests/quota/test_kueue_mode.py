"""Quota mode kueue (extender/quota/kueue_mode.py, workloads.py) and the choice of mode (factory.py), case by case
from Kueue's published objects: Workload conditions and admission, ClusterQueue status, webhook configurations."""

from __future__ import annotations

from typing import Any

import pytest

from kube_vgpu import protocol
from kube_vgpu.dev.fixtures import node_object
from kube_vgpu.extender.quota import cli as quota_cli
from kube_vgpu.extender.quota.factory import QuotaModeError, kueue_controller_evidence, resolve_quota_mode
from kube_vgpu.extender.quota.gate import QuotaGate
from kube_vgpu.extender.quota.kueue_mode import KueueModeGate
from kube_vgpu.extender.quota.views import quota_view
from kube_vgpu.extender.quota.workloads import WorkloadIndex, parse_workload
from kube_vgpu.extender.scheduler import BindError, Scheduler
from kube_vgpu.extender.sources.snapshot import SnapshotCluster
from kube_vgpu.extender.state import ClusterState
from tests.engine.test_mig_placement import a100_mig, mig_pod
from tests.helpers import gpu_node, pod

JOB_UID = "job-uid-1"


def condition(kind: str, status: str, message: str = "", reason: str = "") -> dict[str, Any]:
    return {"type": kind, "status": status, "message": message, "reason": reason}


def workload(name: str = "job-train-1a2b3", *, conditions: list[dict[str, Any]] | None = None,
             owner_uid: str = JOB_UID, job_uid_label: str | None = None, admission: dict[str, Any] | None = None,
             namespace: str = "team-a") -> dict[str, Any]:
    """A Workload as Kueue's Job integration writes it (v1beta2)."""
    labels = {"kueue.x-k8s.io/job-uid": job_uid_label} if job_uid_label else {}
    status: dict[str, Any] = {"conditions": conditions or []}
    if admission is not None:
        status["admission"] = admission
    return {
        "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "Workload",
        "metadata": {"name": name, "namespace": namespace, "uid": f"wl-{name}", "labels": labels,
                     "ownerReferences": [{"apiVersion": "batch/v1", "kind": "Job", "name": "train",
                                          "uid": owner_uid, "controller": True}]},
        "spec": {"queueName": "team", "podSets": [{"name": "main", "count": 2}]},
        "status": status,
    }


ADMISSION = {
    "clusterQueue": "gpu-queue",
    "podSetAssignments": [{
        "name": "main", "count": 2,
        "flavors": {"nvidia.com/gpu": "a100", "nvidia.com/total-gpumem": "a100"},
        "resourceUsage": {"nvidia.com/gpu": "2", "nvidia.com/total-gpumem": "8192"},
    }],
}
ADMITTED = [condition("QuotaReserved", "True"), condition("Admitted", "True")]
NO_QUOTA = [condition("QuotaReserved", "False", "couldn't assign flavors to pod set main: insufficient quota for "
                      "nvidia.com/total-gpumem in flavor a100, previously considered podsets requests (0) + current "
                      "podset request (8192) > maximum capacity (4096)", "Pending")]


@pytest.mark.parametrize(("conditions", "admitted", "finished", "message"), [
    (ADMITTED, True, False, ""),
    (NO_QUOTA, False, False, NO_QUOTA[0]["message"]),
    # quota reserved, an admission check still pending: not admitted, Kueue's Admitted condition says why
    ([condition("QuotaReserved", "True"), condition("Admitted", "False", "waiting for admission checks")],
     False, False, "waiting for admission checks"),
    # evicted (preempted): the eviction's message first
    ([condition("QuotaReserved", "False", "quota released"), condition("Evicted", "True", "Preempted to "
      "accommodate a workload in the same ClusterQueue")], False, False,
     "Preempted to accommodate a workload in the same ClusterQueue"),
    # an old Evicted=False condition does not explain anything
    ([condition("Evicted", "False", "old"), *NO_QUOTA], False, False, NO_QUOTA[0]["message"]),
    # finished: not admitted any more, whatever the Admitted condition still says
    ([*ADMITTED, condition("Finished", "True", "Job finished successfully")], False, True, ""),
    ([], False, False, ""),
])
def test_a_workloads_conditions_say_whether_it_is_admitted_and_why_not(
    conditions: list[dict[str, Any]], admitted: bool, finished: bool, message: str
) -> None:
    parsed = parse_workload(workload(conditions=conditions))
    assert (parsed.admitted, parsed.finished, parsed.message) == (admitted, finished, message)
    assert parsed.key == "team-a/job-train-1a2b3" and parsed.queue_name == "team"


def test_what_kueue_charged_is_summed_per_flavor_and_resource_over_pod_sets() -> None:
    second = {"name": "workers", "flavors": {"nvidia.com/gpu": "a100"}, "resourceUsage": {"nvidia.com/gpu": "4"}}
    admission = {**ADMISSION, "podSetAssignments": [*ADMISSION["podSetAssignments"], second]}
    parsed = parse_workload(workload(conditions=ADMITTED, admission=admission))
    assert parsed.cluster_queue == "gpu-queue"
    assert dict(parsed.charged) == {("a100", "nvidia.com/gpu"): 6, ("a100", "nvidia.com/total-gpumem"): 8192}


def _pod(uid: str = "pod-uid", owner_uid: str | None = JOB_UID, queue: str | None = "team") -> dict[str, Any]:
    labels = {protocol.LABEL_KUEUE_QUEUE_NAME: queue} if queue else {}
    p = pod("train-0", namespace="team-a", gpus=1, memory_mib=4096, labels=labels)
    p["metadata"]["uid"] = uid
    if owner_uid:
        p["metadata"]["ownerReferences"] = [{"apiVersion": "batch/v1", "kind": "Job", "name": "train",
                                             "uid": owner_uid, "controller": True}]
    return p


def test_a_pod_finds_its_workload_through_its_owner_its_own_uid_or_the_job_uid_label() -> None:
    by_owner = WorkloadIndex([workload(conditions=ADMITTED)])
    assert by_owner.for_pod(_pod()) is not None
    # Kueue's plain-pod groups: the Workload is owned by the pods themselves
    by_pod = WorkloadIndex([workload(owner_uid="pod-uid")])
    assert by_pod.for_pod(_pod(owner_uid=None)) is not None
    by_label = WorkloadIndex([workload(owner_uid="someone-else", job_uid_label=JOB_UID)])
    assert by_label.for_pod(_pod()) is not None
    assert by_owner.for_pod(_pod(owner_uid="another-job")) is None
    # while Kueue replaces a finished Workload by a new one for the same Job, the unfinished one counts
    done = workload("old", conditions=[*ADMITTED, condition("Finished", "True")])
    current = workload("new", conditions=NO_QUOTA)
    for order in ([done, current], [current, done]):
        found = WorkloadIndex(order).for_pod(_pod())
        assert found is not None and found.name == "new"


def _gate(*objects: tuple[str, list[dict[str, Any]]], synced: bool = True) -> tuple[KueueModeGate, Scheduler,
                                                                                      SnapshotCluster]:
    state = ClusterState()
    gate = KueueModeGate(state, live=not synced)
    for kind, items in objects:
        gate.set_cluster_objects(kind, {(o["metadata"].get("namespace", ""), o["metadata"]["name"]): o
                                        for o in items})
    cluster = SnapshotCluster(state, [gpu_node("a100-0", gpus=4)])
    return gate, Scheduler(state, cluster, gates=[gate]), cluster


@pytest.mark.parametrize(("workloads", "p", "expected"), [
    ([workload(conditions=ADMITTED)], _pod(), None),
    # Kueue's reason, as Kueue wrote it
    ([workload(conditions=NO_QUOTA)], _pod(), "Kueue has not admitted Workload team-a/job-train-1a2b3: couldn't "
     "assign flavors"),
    ([workload(conditions=[*ADMITTED, condition("Finished", "True")])], _pod(), "has finished"),
    # in a Kueue queue, and no Workload for it: Kueue has not seen it (or does not manage its kind)
    ([], _pod(), "pod is in Kueue queue 'team' but Kueue has no Workload for it or its owner yet"),
    # not Kueue's: no queue label and no Workload
    ([], _pod(queue=None, owner_uid=None), None),
])
def test_filter_places_only_pods_of_admitted_workloads(
    workloads: list[dict[str, Any]], p: dict[str, Any], expected: str | None
) -> None:
    _, scheduler, cluster = _gate(("Workload", workloads))
    cluster.add_pod(p)
    outcome = scheduler.filter(p, ["a100-0"])
    if expected is None:
        assert outcome.passed == ["a100-0"], outcome
    else:
        assert outcome.passed == [] and expected in outcome.failed["a100-0"], outcome


def test_nothing_is_placed_before_kueues_workloads_were_listed_and_bind_checks_again() -> None:
    gate, scheduler, cluster = _gate(("Workload", [workload(conditions=ADMITTED)]), synced=False)
    p = _pod()
    cluster.add_pod(p)
    assert "not been listed" in scheduler.filter(p, ["a100-0"]).failed["a100-0"]
    gate.mark_synced()
    assert scheduler.filter(p, ["a100-0"]).passed == ["a100-0"]
    # Kueue evicts the Workload between filter and bind: bind refuses
    gate.set_cluster_objects("Workload", {("team-a", "w"): workload(conditions=NO_QUOTA)})
    with pytest.raises(BindError, match="Kueue has not admitted"):
        scheduler.bind("team-a", "train-0", "pod-uid", "a100-0")


def test_quota_shows_what_landed_beside_what_kueue_charged() -> None:
    cluster_queue = {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ClusterQueue",
                     "metadata": {"name": "gpu-queue"},
                     "status": {"admittedWorkloads": 1, "pendingWorkloads": 1,
                                "flavorsReservation": [{"name": "a100", "resources": [
                                    {"name": "nvidia.com/gpu", "total": "2", "borrowed": "0"},
                                    {"name": "nvidia.com/total-gpumem", "total": "8192", "borrowed": "0"}]}]}}
    local = {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "LocalQueue",
             "metadata": {"name": "team", "namespace": "team-a"}, "spec": {"clusterQueue": "gpu-queue"}}
    gate, scheduler, cluster = _gate(("Workload", [workload(conditions=ADMITTED, admission=ADMISSION)]),
                                     ("ClusterQueue", [cluster_queue]), ("LocalQueue", [local]))
    for index in range(2):
        p = _pod(uid=f"pod-{index}")
        p["metadata"]["name"] = f"train-{index}"
        cluster.add_pod(p)
        assert scheduler.filter(p, ["a100-0"]).passed == ["a100-0"]
        scheduler.bind("team-a", f"train-{index}", f"pod-{index}", "a100-0")
    stray = _pod(uid="stray", owner_uid=None, queue=None)
    stray["metadata"]["name"] = "stray"
    cluster.add_pod(stray)
    scheduler.bind("team-a", "stray", "stray", "a100-0")
    view = gate.snapshot()
    (queue,) = view["clusterQueues"]
    assert queue["landed"] == {"nvidia.com/gpu": 2, "nvidia.com/gpumem": 8192, "nvidia.com/gpucores": 0,
                               "nvidia.com/total-gpumem": 8192, "nvidia.com/total-gpucores": 0, "pods": 2}
    assert queue["kueueCharged"] == [{"flavor": "a100", "resources": [
        {"resource": "nvidia.com/gpu", "total": 2, "borrowed": 0},
        {"resource": "nvidia.com/total-gpumem", "total": 8192, "borrowed": 0}]}]
    assert (queue["admittedWorkloads"], queue["pendingWorkloads"], queue["workloadsSeen"]) == (1, 1, 1)
    assert view["landedOutsideQueues"]["pods"] == 1 and view["mode"] == "kueue"
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in gate.collector().collect() for s in family.samples}
    assert samples[("kube_vgpu_queue_landed", (("cluster_queue", "gpu-queue"),
                                               ("resource", "nvidia.com/total-gpumem")))] == 8192
    assert samples[("kube_vgpu_queue_kueue_charged", (("cluster_queue", "gpu-queue"), ("flavor", "a100"),
                                                      ("resource", "nvidia.com/gpu")))] == 2
    table = quota_cli.render(view)
    assert "gpu-queue" in table and "nvidia.com/total-gpumem" in table and "8192" in table
    assert "quota mode kueue" in table


KUEUE_WEBHOOKS = {"metadata": {"name": "kueue-mutating-webhook-configuration"}, "webhooks": [
    {"name": "mjob.kb.io", "rules": [{"apiGroups": ["batch"], "resources": ["jobs"]}]},
    {"name": "mworkload.kb.io", "rules": [{"apiGroups": ["kueue.x-k8s.io"], "resources": ["workloads"]}]},
]}
OURS = {"metadata": {"name": "kube-vgpu-webhook"}, "webhooks": [
    {"name": "pods.kube-vgpu.io", "rules": [{"apiGroups": [""], "resources": ["pods"]}]}]}


def test_kueues_controller_is_found_by_its_workload_webhook() -> None:
    evidence = kueue_controller_evidence([OURS, KUEUE_WEBHOOKS])
    assert evidence is not None and "kueue-mutating-webhook-configuration" in evidence
    assert kueue_controller_evidence([OURS]) is None
    assert kueue_controller_evidence([]) is None


@pytest.mark.parametrize(("requested", "live", "evidence", "force", "expected"), [
    ("auto", True, "Kueue's webhook", False, "kueue"),
    ("auto", True, None, False, "enforce"),
    ("auto", False, None, False, "enforce"),
    ("kueue", True, None, False, "kueue"),  # Kueue may be installed later: its Workloads are watched
    ("enforce", True, None, False, "enforce"),
    ("enforce", True, "Kueue's webhook", True, "enforce"),  # forced: both layers, on purpose
    ("off", True, "Kueue's webhook", False, "off"),
    ("enforce", True, "Kueue's webhook", False, "quota mode enforce refused: Kueue's controller is installed"),
    ("kueue", False, None, False, "a --snapshot has none"),
    ("strict", True, None, False, "is not one of auto, enforce, kueue, off"),
])
def test_the_quota_mode_and_the_combinations_refused(
    requested: str, live: bool, evidence: str | None, force: bool, expected: str
) -> None:
    if expected in ("kueue", "enforce", "off"):
        assert resolve_quota_mode(requested, live=live, evidence=evidence, force=force) == expected
    else:
        with pytest.raises(QuotaModeError, match=expected):
            resolve_quota_mode(requested, live=live, evidence=evidence, force=force)


def test_enforce_mode_warns_when_kueues_controller_writes_the_queues_status() -> None:
    """Kueue installed after the extender started in mode enforce: its controller's status on a ClusterQueue (the
    Active condition only it writes) is reported in /quota and quota status."""
    state = ClusterState()
    gate = QuotaGate(state, live=True)
    queue = {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ClusterQueue", "metadata": {"name": "gpu-queue"},
             "spec": {"namespaceSelector": {}, "resourceGroups": []}}
    gate.set_cluster_objects("ClusterQueue", {("", "gpu-queue"): queue})
    assert quota_view(gate)["warnings"] == []
    managed = {**queue, "status": {"conditions": [condition("Active", "True", "Can admit new workloads", "Ready")]}}
    gate.set_cluster_objects("ClusterQueue", {("", "gpu-queue"): managed})
    (warning,) = quota_view(gate)["warnings"]
    assert "ClusterQueue gpu-queue carries status written by Kueue's controller" in warning
    assert "warning: ClusterQueue gpu-queue" in quota_cli.render(quota_view(gate))


def test_the_gates_flags_given_with_a_mode_without_our_gate_are_named() -> None:
    from kube_vgpu.extender.cli import parse_args, unused_quota_flags

    args = parse_args(["--quota-mode=kueue", "--quota-config=q.yaml", "--fair-sharing", "--quota-unqueued=refuse"])
    assert unused_quota_flags(args, "kueue") == ["--quota-config", "--quota-unqueued", "--fair-sharing"]
    assert unused_quota_flags(args, "enforce") == []
    assert unused_quota_flags(parse_args(["--quota-mode=off"]), "off") == []
    # auto found Kueue's controller: forcing enforce beside it was asked for, and does not happen
    assert unused_quota_flags(parse_args(["--force-quota-mode"]), "kueue") == ["--force-quota-mode"]


def test_landed_mig_devices_are_shown_beside_what_kueue_charged_for_them() -> None:
    """A MIG pod landed as its nvidia.com/mig-<profile> (what Kueue charges for the request as written) and its
    memory, no vGPU; the table shows the MIG resource even where Kueue charged it under another name (a Replace
    ResourceTransformation)."""
    charged = [{"name": "nvidia.com/mig-1g.5gb", "total": "1", "borrowed": "0"}]
    cluster_queue: dict[str, Any] = {
        "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ClusterQueue", "metadata": {"name": "gpu-queue"},
        "status": {"admittedWorkloads": 1, "flavorsReservation": [{"name": "a100-mig", "resources": charged}]}}
    local: dict[str, Any] = {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "LocalQueue",
                             "metadata": {"name": "team", "namespace": "team-a"}, "spec": {"clusterQueue": "gpu-queue"}}
    state = ClusterState()
    gate = KueueModeGate(state, live=False)
    for kind, items in (("Workload", [workload(conditions=ADMITTED)]), ("ClusterQueue", [cluster_queue]),
                        ("LocalQueue", [local])):
        gate.set_cluster_objects(kind, {(o["metadata"].get("namespace", ""), o["metadata"]["name"]): o
                                        for o in items})
    cluster = SnapshotCluster(state, [node_object("mig-node", a100_mig())])
    scheduler = Scheduler(state, cluster, gates=[gate])
    p = mig_pod(("main", "mig-1g.5gb", 1))
    p["metadata"].update(name="train-0", namespace="team-a", uid="pod-uid",
                         labels={protocol.LABEL_KUEUE_QUEUE_NAME: "team"},
                         ownerReferences=_pod()["metadata"]["ownerReferences"])
    cluster.add_pod(p)
    assert scheduler.filter(p, ["mig-node"]).passed == ["mig-node"]
    scheduler.bind("team-a", "train-0", "pod-uid", "mig-node")
    view = gate.snapshot()
    (queue,) = view["clusterQueues"]
    assert queue["landed"] == {"nvidia.com/gpu": 0, "nvidia.com/gpumem": 4864, "nvidia.com/gpucores": 0,
                               "nvidia.com/total-gpumem": 4864, "nvidia.com/total-gpucores": 0, "pods": 1,
                               "nvidia.com/mig-1g.5gb": 1}
    row = next(line for line in quota_cli.render(view).splitlines() if "nvidia.com/mig-1g.5gb" in line)
    assert row.split()[-2:] == ["1", "1"]  # landed 1, Kueue charged 1
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in gate.collector().collect() for s in family.samples}
    assert samples[("kube_vgpu_queue_landed", (("cluster_queue", "gpu-queue"),
                                               ("resource", "nvidia.com/mig-1g.5gb")))] == 1
    # Kueue charged the device as accelerator memory (a Replace transformation): the landed device still shows
    charged[:] = [{"name": "example.com/accelerator-memory", "total": "5Gi", "borrowed": "0"}]
    row = next(line for line in quota_cli.render(gate.snapshot()).splitlines() if "nvidia.com/mig-1g.5gb" in line)
    assert row.split()[-2:] == ["1", "-"]
