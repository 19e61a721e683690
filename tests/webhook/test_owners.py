"""Issue 13 item 2: a GPU pod without a queue label gets its controller owners' (Job, JobSet, ...), stamped at
admission. The resolver is driven here through a table of owner objects (the API reads are its only I/O; the e2e
tier, tests/e2e/test_webhook_e2e.py, reads real Jobs from the real API server under the manifests' RBAC)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest

from kube_vgpu.webhook.config import WebhookConfig
from kube_vgpu.webhook.mutate import Result
from kube_vgpu.webhook.owners import NotServed, OwnerResolver
from tests.webhook.builders import apply_response, gpu_container, pod, run_review

QUEUE, PRIORITY = "kueue.x-k8s.io/queue-name", "kueue.x-k8s.io/priority-class"
GROUP, COUNT = "kueue.x-k8s.io/pod-group-name", "kueue.x-k8s.io/pod-group-total-count"


def ref(kind: str, name: str, api_version: str = "batch/v1", controller: bool = True) -> dict[str, Any]:
    return {"apiVersion": api_version, "kind": kind, "name": name, "uid": f"uid-{name}", "controller": controller}


def obj(name: str, labels: dict[str, str] | None = None, owners: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    metadata: dict[str, Any] = {"name": name, "namespace": "team-a", "labels": labels or {}}
    if owners:
        metadata["ownerReferences"] = owners
    return {"metadata": metadata}


class Api:
    """Owner objects by (plural, name); counts the reads."""

    def __init__(self, objects: Mapping[tuple[str, str], dict[str, Any]], fail: bool = False,
                 queues_served: bool = False, pod_groups_served: bool = True) -> None:
        self.objects, self.fail, self.reads, self.queues_served = dict(objects), fail, 0, queues_served
        self.pod_groups_served = pod_groups_served

    def __call__(self, group: str, version: str, plural: str, namespace: str, name: str) -> dict[str, Any] | None:
        if plural == "localqueues" and not self.queues_served:
            raise NotServed("kueue.x-k8s.io/v1beta1 localqueues is not served")
        if plural == "podgroups":
            assert (group, version) == ("scheduling.x-k8s.io", "v1alpha1")
            if not self.pod_groups_served:
                raise NotServed("scheduling.x-k8s.io/v1alpha1 podgroups is not served")
        self.reads += 1
        if self.fail:
            raise TimeoutError("no answer within 3 s")
        assert namespace == "team-a"
        return self.objects.get((plural, name))


def gpu_pod_owned_by(*owners: dict[str, Any], labels: dict[str, str] | None = None) -> dict[str, Any]:
    p = pod(gpu_container(gpu="1", gpumem="1024"))
    p["metadata"]["ownerReferences"] = list(owners)
    if labels is not None:
        p["metadata"]["labels"] = labels
    return p


ROWS = [
    ("job-label", gpu_pod_owned_by(ref("Job", "train")), {("jobs", "train"): obj("train", {QUEUE: "q"})},
     {QUEUE: "q"}),
    ("job-queue-and-priority", gpu_pod_owned_by(ref("Job", "train")),
     {("jobs", "train"): obj("train", {QUEUE: "q", PRIORITY: "high"})}, {QUEUE: "q", PRIORITY: "high"}),
    ("jobset-above-the-job", gpu_pod_owned_by(ref("Job", "w-0")),
     {("jobs", "w-0"): obj("w-0", {}, [ref("JobSet", "js", "jobset.x-k8s.io/v1alpha2")]),
      ("jobsets", "js"): obj("js", {QUEUE: "q"})}, {QUEUE: "q"}),
    ("nearest-owner-wins", gpu_pod_owned_by(ref("Job", "w-0")),
     {("jobs", "w-0"): obj("w-0", {QUEUE: "near"}, [ref("JobSet", "js", "jobset.x-k8s.io/v1alpha2")]),
      ("jobsets", "js"): obj("js", {QUEUE: "far"})}, {QUEUE: "near"}),
    ("pods-own-label-wins", gpu_pod_owned_by(ref("Job", "train"), labels={QUEUE: "mine"}),
     {("jobs", "train"): obj("train", {QUEUE: "q", PRIORITY: "high"})}, {QUEUE: "mine", PRIORITY: "high"}),
    ("pytorchjob-replica", gpu_pod_owned_by(ref("PyTorchJob", "ptj", "kubeflow.org/v1")),
     {("pytorchjobs", "ptj"): obj("ptj", {QUEUE: "q"})}, {QUEUE: "q"}),
    ("deployment-through-replicaset", gpu_pod_owned_by(ref("ReplicaSet", "web-5d", "apps/v1")),
     {("replicasets", "web-5d"): obj("web-5d", {}, [ref("Deployment", "web", "apps/v1")]),
      ("deployments", "web"): obj("web", {QUEUE: "q"})}, {QUEUE: "q"}),
    ("owner-without-labels", gpu_pod_owned_by(ref("Job", "train")), {("jobs", "train"): obj("train")}, {}),
    ("owner-gone", gpu_pod_owned_by(ref("Job", "train")), {}, {}),
    ("not-a-controller-reference", gpu_pod_owned_by(ref("Job", "train", controller=False)),
     {("jobs", "train"): obj("train", {QUEUE: "q"})}, {}),
]


@pytest.mark.parametrize(("case", "sent", "objects", "stamped"), ROWS, ids=[row[0] for row in ROWS])
def test_the_pod_gets_its_owners_queue(case: str, sent: dict[str, Any], objects: dict[Any, Any],
                                       stamped: dict[str, str]) -> None:
    outcome, response = run_review(sent, WebhookConfig(), owners=OwnerResolver(Api(objects)))
    assert outcome.result is Result.MUTATED
    labels = apply_response(sent, response)["metadata"].get("labels") or {}
    assert {key: labels[key] for key in (QUEUE, PRIORITY) if key in labels} == stamped


def test_an_owner_kind_it_does_not_read_is_said_not_silently_ignored() -> None:
    sent = gpu_pod_owned_by(ref("Workflow", "wf", "argoproj.io/v1alpha1"))
    api = Api({})
    outcome, response = run_review(sent, WebhookConfig(), owners=OwnerResolver(api))
    assert outcome.result is Result.MUTATED and api.reads == 0
    assert response["warnings"] == [
        "owner Workflow team-a/wf (argoproj.io/v1alpha1) is not a kind kube-vgpu reads for kueue.x-k8s.io/queue-name; "
        "set the label on the pod template instead"
    ]


def test_an_owner_that_cannot_be_read_refuses_the_pod_so_that_it_is_retried() -> None:
    sent = gpu_pod_owned_by(ref("Job", "train"))
    outcome, response = run_review(sent, WebhookConfig(), owners=OwnerResolver(Api({}, fail=True)))
    assert outcome.result is Result.DENIED
    assert response["status"]["code"] == 503 and response["status"]["reason"] == "ServiceUnavailable"
    assert response["status"]["message"] == (
        "cannot read the pod's owner Job team-a/train to find its queue (no answer within 3 s); the pod is refused "
        "so that its controller retries")


def test_a_burst_of_one_jobs_pods_reads_the_job_once() -> None:
    api = Api({("jobs", "train"): obj("train", {QUEUE: "q"})})
    resolver = OwnerResolver(api)
    for _ in range(50):
        outcome, _ = run_review(gpu_pod_owned_by(ref("Job", "train")), WebhookConfig(), owners=resolver)
        assert outcome.result is Result.MUTATED
    assert api.reads == 1


def test_cached_answers_expire() -> None:
    now = [0.0]
    api = Api({("jobs", "train"): obj("train", {QUEUE: "q"})})
    resolver = OwnerResolver(api, ttl_s=30, clock=lambda: now[0])
    resolver.inherited("team-a", {}, [ref("Job", "train")])
    now[0] = 31.0
    resolver.inherited("team-a", {}, [ref("Job", "train")])
    assert api.reads == 2


def test_pods_that_already_say_everything_read_nothing() -> None:
    api = Api({})
    run_review(gpu_pod_owned_by(ref("Job", "train"), labels={QUEUE: "q", PRIORITY: "p", GROUP: "g"}), WebhookConfig(),
               owners=OwnerResolver(api))
    assert api.reads == 0


def gang_job(name: str, parallelism: Any, mark: str | None = "true", owners: list[dict[str, Any]] | None = None,
             labels: dict[str, str] | None = None) -> dict[str, Any]:
    job = obj(name, labels, owners)
    if mark is not None:
        job["metadata"]["annotations"] = {"kube-vgpu.io/gang": mark}
    job["spec"] = {"template": GPU_TEMPLATE}
    if parallelism is not None:
        job["spec"]["parallelism"] = parallelism
    return job


GPU_TEMPLATE = {"spec": {"containers": [{"name": "t", "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}}
CPU_TEMPLATE = {"spec": {"containers": [{"name": "t", "resources": {"limits": {"cpu": "1"}}}]}}


def marked(name: str, spec: dict[str, Any], mark: str = "true", labels: dict[str, str] | None = None) -> dict[str, Any]:
    found = obj(name, labels)
    found["metadata"]["annotations"] = {"kube-vgpu.io/gang": mark}
    found["spec"] = spec
    return found


def jobset_spec(*jobs: tuple[int | None, int | None, dict[str, Any]]) -> dict[str, Any]:
    """replicatedJobs of (replicas, parallelism, pod template)."""
    replicated = []
    for index, (replicas, parallelism, template) in enumerate(jobs):
        job_spec: dict[str, Any] = {"template": template}
        if parallelism is not None:
            job_spec["parallelism"] = parallelism
        entry: dict[str, Any] = {"name": f"rj{index}", "template": {"spec": job_spec}}
        if replicas is not None:
            entry["replicas"] = replicas
        replicated.append(entry)
    return {"replicatedJobs": replicated}


@pytest.mark.parametrize(("case", "job", "group", "count"), [
    ("marked", gang_job("train", 4), "train", "4"),
    ("marked-any-case", gang_job("train", 2, "True"), "train", "2"),
    ("parallelism-defaults-to-1", gang_job("train", None), "train", "1"),
    ("not-marked", gang_job("train", 4, None), None, None),
    ("marked-false", gang_job("train", 4, "false"), None, None),
])
def test_a_job_marked_as_a_gang_makes_its_pods_one_gang(case: str, job: dict[str, Any], group: str | None,
                                                        count: str | None) -> None:
    sent = gpu_pod_owned_by(ref("Job", "train"), labels={QUEUE: "q"})
    _, response = run_review(sent, WebhookConfig(), owners=OwnerResolver(Api({("jobs", "train"): job})))
    mutated = apply_response(sent, response)
    assert mutated["metadata"]["labels"].get(GROUP) == group
    assert mutated["metadata"]["annotations"].get(COUNT) == count
    assert mutated["metadata"]["annotations"]["kube-vgpu.io/admitted"] == "v1"


def test_a_jobset_marked_as_a_gang_makes_all_its_gpu_pods_one_gang_and_the_queue_still_comes_from_above() -> None:
    spec = jobset_spec((2, 4, GPU_TEMPLATE), (None, None, GPU_TEMPLATE), (1, 1, CPU_TEMPLATE))
    api = Api({("jobs", "w-0"): gang_job("w-0", 4, None, [ref("JobSet", "js", "jobset.x-k8s.io/v1alpha2")]),
               ("jobsets", "js"): marked("js", spec, labels={QUEUE: "q"})})
    sent = gpu_pod_owned_by(ref("Job", "w-0"))
    _, response = run_review(sent, WebhookConfig(), owners=OwnerResolver(api))
    mutated = apply_response(sent, response)
    assert mutated["metadata"]["labels"][QUEUE] == "q"
    # 2 Jobs x 4 pods + 1 x 1, the CPU-only coordinator not counted (kube-vgpu never sees it)
    assert mutated["metadata"]["labels"][GROUP] == "jobset_js"
    assert mutated["metadata"]["annotations"][COUNT] == "9"


def test_a_job_marked_false_keeps_its_pods_out_of_its_jobsets_gang() -> None:
    api = Api({("jobs", "w-0"): gang_job("w-0", 4, "false", [ref("JobSet", "js", "jobset.x-k8s.io/v1alpha2")]),
               ("jobsets", "js"): marked("js", jobset_spec((2, 4, GPU_TEMPLATE)), labels={QUEUE: "q"})})
    sent = gpu_pod_owned_by(ref("Job", "w-0"))
    _, response = run_review(sent, WebhookConfig(), owners=OwnerResolver(api))
    mutated = apply_response(sent, response)
    assert mutated["metadata"]["labels"][QUEUE] == "q" and GROUP not in mutated["metadata"]["labels"]


@pytest.mark.parametrize(("kind", "api_version", "plural", "field", "count"), [
    ("PyTorchJob", "kubeflow.org/v1", "pytorchjobs", "pytorchReplicaSpecs", "5"),
    ("TFJob", "kubeflow.org/v1", "tfjobs", "tfReplicaSpecs", "5"),
    ("MPIJob", "kubeflow.org/v2beta1", "mpijobs", "mpiReplicaSpecs", "5"),
])
def test_a_training_job_marked_as_a_gang_counts_its_gpu_replicas(kind: str, api_version: str, plural: str,
                                                                 field: str, count: str) -> None:
    # Master 1 (replicas defaults to 1) + Worker 4 with GPUs; a CPU-only Launcher is not a member
    spec = {field: {"Master": {"template": GPU_TEMPLATE}, "Worker": {"replicas": 4, "template": GPU_TEMPLATE},
                    "Launcher": {"replicas": 1, "template": CPU_TEMPLATE}}}
    api = Api({(plural, "train"): marked("train", spec)})
    sent = gpu_pod_owned_by(ref(kind, "train", api_version), labels={QUEUE: "q"})
    _, response = run_review(sent, WebhookConfig(), owners=OwnerResolver(api))
    mutated = apply_response(sent, response)
    assert mutated["metadata"]["labels"][GROUP] == f"{kind.lower()}_train"
    assert mutated["metadata"]["annotations"][COUNT] == count


def test_a_marked_workload_without_gpu_pods_at_once_is_refused() -> None:
    api = Api({("jobsets", "js"): marked("js", jobset_spec((0, 4, GPU_TEMPLATE)))})
    sent = gpu_pod_owned_by(ref("JobSet", "js", "jobset.x-k8s.io/v1alpha2"), labels={QUEUE: "q"})
    outcome, response = run_review(sent, WebhookConfig(), owners=OwnerResolver(api))
    assert outcome.result is Result.DENIED and response["status"]["code"] == 403
    assert response["status"]["message"] == ("JobSet team-a/js runs GPU pods at once: 0: kube-vgpu needs a whole "
                                             "number from 1 to 4096 (the gang's size)")


def test_a_gang_mark_on_a_kind_without_a_size_is_said() -> None:
    api = Api({("rayjobs", "r"): marked("r", {})})
    sent = gpu_pod_owned_by(ref("RayJob", "r", "ray.io/v1"), labels={QUEUE: "q"})
    outcome, response = run_review(sent, WebhookConfig(), owners=OwnerResolver(api))
    assert outcome.result is Result.MUTATED
    assert any("annotation kube-vgpu.io/gang on RayJob team-a/r is not read" in w for w in response["warnings"])


@pytest.mark.parametrize(("served", "queues", "allowed"), [
    (True, {("localqueues", "q"): obj("q")}, True),
    (True, {}, False),
    (False, {}, True),  # no LocalQueues served (quota from a file): the extender judges the queue
], ids=["exists", "missing", "not-served"])
def test_a_queue_named_by_an_owner_must_exist(served: bool, queues: dict[Any, Any], allowed: bool) -> None:
    api = Api({("jobs", "train"): obj("train", {QUEUE: "q"}), **queues}, queues_served=served)
    outcome, response = run_review(gpu_pod_owned_by(ref("Job", "train")), WebhookConfig(), owners=OwnerResolver(api))
    assert (outcome.result is Result.MUTATED) is allowed
    if not allowed:
        assert response["status"]["code"] == 403
        assert response["status"]["message"] == (
            "the pod's owner Job team-a/train names LocalQueue team-a/q (label kueue.x-k8s.io/queue-name), which does "
            "not exist: create it or fix the label")


def test_a_gang_mark_that_is_neither_true_nor_false_is_said() -> None:
    api = Api({("jobs", "train"): gang_job("train", 4, "yes")})
    _, response = run_review(gpu_pod_owned_by(ref("Job", "train"), labels={QUEUE: "q"}), WebhookConfig(),
                             owners=OwnerResolver(api))
    assert response["warnings"] == [
        "annotation kube-vgpu.io/gang='yes' on Job team-a/train is neither \"true\" nor \"false\": its pods are "
        "not a gang"
    ]


@pytest.mark.parametrize(("edit", "warning"), [
    (lambda p: p["metadata"]["labels"].update({"scheduling.x-k8s.io/pod-group": "pg"}),
     "label scheduling.x-k8s.io/pod-group (a coscheduling PodGroup) is not read by this kube-vgpu webhook, which "
     "reads no API objects"),
    (lambda p: p["spec"].update({"workloadRef": {"name": "w", "podGroup": "g"}}),
     "spec.workloadRef (a Kubernetes Workload) is not read by kube-vgpu"),
], ids=["coscheduling-pod-group", "workload-ref"])
def test_gang_declarations_kube_vgpu_does_not_read_are_warned_about(edit: Any, warning: str) -> None:
    sent = gpu_pod_owned_by()
    edit(sent)
    outcome, response = run_review(sent, WebhookConfig())
    assert outcome.result is Result.MUTATED
    [said] = response["warnings"]
    assert said.startswith(warning) and said.endswith(
        "this pod is placed on its own, not all or nothing; declare the gang with the label "
        "kueue.x-k8s.io/pod-group-name and the annotation kueue.x-k8s.io/pod-group-total-count (docs/user-guide.md, "
        "Gangs)")


TIMEOUT = "gang.kube-vgpu.io/timeout-seconds"


@pytest.mark.parametrize(("case", "job", "labels", "warned"), [
    ("no-gang", gang_job("train", 4, None), {QUEUE: "q"}, True),
    ("own-kueue-group", gang_job("train", 4, None), {QUEUE: "q", GROUP: "g"}, False),
    ("gang-job", gang_job("train", 4), {QUEUE: "q"}, False),  # the webhook stamps the group itself
])
def test_a_gang_timeout_on_a_pod_in_no_gang_is_said(case: str, job: dict[str, Any], labels: dict[str, str],
                                                     warned: bool) -> None:
    sent = gpu_pod_owned_by(ref("Job", "train"), labels=labels)
    sent["metadata"]["annotations"] = {TIMEOUT: "600", **({COUNT: "4"} if GROUP in labels else {})}
    outcome, response = run_review(sent, WebhookConfig(), owners=OwnerResolver(Api({("jobs", "train"): job})))
    assert outcome.result is Result.MUTATED
    said = [w for w in response.get("warnings") or [] if TIMEOUT in w]
    assert bool(said) is warned, response.get("warnings")
