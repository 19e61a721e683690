"""Gangs declared by a coscheduling PodGroup (scheduler-plugins, podgroups.scheduling.x-k8s.io/v1alpha1): a GPU pod
labelled scheduling.x-k8s.io/pod-group=NAME becomes a Kueue pod-group member of the PodGroup's minMember pods. Driven
through the same fake API as the owner tests (test_owners.py); the e2e tier (tests/e2e/test_pod_group_gang_e2e.py)
reads a real PodGroup from the real API server."""

from __future__ import annotations

from typing import Any

import pytest

from kube_vgpu.webhook.config import WebhookConfig
from kube_vgpu.webhook.mutate import Result
from kube_vgpu.webhook.owners import MAX_LABEL_VALUE_CHARS, NotServed, OwnerResolver, derived_gang_name
from tests.webhook.builders import apply_response, run_review
from tests.webhook.test_owners import COUNT, GROUP, QUEUE, Api, gang_job, gpu_pod_owned_by, ref

PG_LABEL = "scheduling.x-k8s.io/pod-group"


def pod_group(name: str, min_member: Any = 2) -> dict[str, Any]:
    spec = {} if min_member is None else {"minMember": min_member}
    return {"apiVersion": "scheduling.x-k8s.io/v1alpha1", "kind": "PodGroup",
            "metadata": {"name": name, "namespace": "team-a"}, "spec": spec}


def member(group: str = "pg", **labels: str) -> dict[str, Any]:
    return gpu_pod_owned_by(labels={QUEUE: "q", PG_LABEL: group, **labels})


def test_a_pod_of_a_pod_group_becomes_a_member_of_its_gang() -> None:
    sent = member()
    outcome, response = run_review(sent, WebhookConfig(),
                                   owners=OwnerResolver(Api({("podgroups", "pg"): pod_group("pg", 3)})))
    assert outcome.result is Result.MUTATED and "warnings" not in response
    mutated = apply_response(sent, response)
    assert mutated["metadata"]["labels"][GROUP] == "podgroup_pg"
    assert mutated["metadata"]["annotations"][COUNT] == "3"
    assert mutated["metadata"]["labels"][PG_LABEL] == "pg"  # left for the coscheduling plugin, if it runs too


def test_a_pod_group_gang_never_shares_a_name_with_a_job_gang() -> None:
    # a Job gang is named after the Job; "_" cannot occur in a Job's name (a DNS subdomain)
    api = Api({("podgroups", "train"): pod_group("train", 2), ("jobs", "train"): gang_job("train", 2)})
    job_pod = gpu_pod_owned_by(ref("Job", "train"), labels={QUEUE: "q"})
    pg_pod = member("train")
    resolver = OwnerResolver(api)
    job_group = apply_response(job_pod, run_review(job_pod, owners=resolver)[1])["metadata"]["labels"][GROUP]
    pg_group = apply_response(pg_pod, run_review(pg_pod, owners=resolver)[1])["metadata"]["labels"][GROUP]
    assert job_group == "train" and pg_group == "podgroup_train"


def test_the_pods_pod_group_wins_over_its_jobs_gang_mark() -> None:
    api = Api({("podgroups", "pg"): pod_group("pg", 4), ("jobs", "train"): gang_job("train", 2)})
    sent = gpu_pod_owned_by(ref("Job", "train"), labels={PG_LABEL: "pg"})
    _, response = run_review(sent, owners=OwnerResolver(api))
    mutated = apply_response(sent, response)
    assert mutated["metadata"]["labels"][GROUP] == "podgroup_pg"
    assert mutated["metadata"]["annotations"][COUNT] == "4"


def test_a_long_pod_group_name_gives_a_valid_distinct_label_value() -> None:
    long_a, long_b = "a" * 100 + "-x", "a" * 100 + "-y"
    name_a, name_b = derived_gang_name("podgroup_", long_a), derived_gang_name("podgroup_", long_b)
    assert len(name_a) == MAX_LABEL_VALUE_CHARS and name_a != name_b and name_a[-1].isalnum()
    sent = member(long_a)
    _, response = run_review(sent, owners=OwnerResolver(Api({("podgroups", long_a): pod_group(long_a)})))
    assert apply_response(sent, response)["metadata"]["labels"][GROUP] == name_a


def test_a_pod_group_that_does_not_exist_refuses_the_pod_and_a_retry_after_its_creation_passes() -> None:
    api = Api({})
    resolver = OwnerResolver(api)
    outcome, response = run_review(member("pgg"), owners=resolver)
    assert outcome.result is Result.DENIED and response["status"]["code"] == 403
    assert response["status"]["message"] == (
        "the pod's label scheduling.x-k8s.io/pod-group=pgg names PodGroup team-a/pgg, which does not exist: create "
        "it before the pods, or fix the label")
    api.objects[("podgroups", "pgg")] = pod_group("pgg", 2)  # absence is not cached: the controller's retry passes
    outcome, response = run_review(member("pgg"), owners=resolver)
    assert outcome.result is Result.MUTATED


def test_a_pod_group_that_cannot_be_read_refuses_the_pod_so_that_it_is_retried() -> None:
    outcome, response = run_review(member(), owners=OwnerResolver(Api({}, fail=True)))
    assert outcome.result is Result.DENIED
    assert response["status"]["code"] == 503 and response["status"]["reason"] == "ServiceUnavailable"
    assert response["status"]["message"] == (
        "cannot read PodGroup team-a/pg named by the pod's label scheduling.x-k8s.io/pod-group=pg (no answer within "
        "3 s); the pod is refused so that its controller retries")


def test_without_the_pod_group_crd_the_pod_is_placed_alone_and_told_so() -> None:
    api = Api({}, pod_groups_served=False)
    resolver = OwnerResolver(api)
    for _ in range(3):
        sent = member()
        outcome, response = run_review(sent, owners=resolver)
        assert outcome.result is Result.MUTATED
        assert GROUP not in apply_response(sent, response)["metadata"]["labels"]
        [said] = response["warnings"]
        assert said.startswith("label scheduling.x-k8s.io/pod-group names a coscheduling PodGroup, but this cluster "
                               "does not serve podgroups.scheduling.x-k8s.io (the CRD is not installed): this pod is "
                               "placed on its own, not all or nothing;")
    assert api.reads == 0  # not-served is cached like an object (the fake counts only served reads)


@pytest.mark.parametrize(("min_member", "shown"), [
    (None, "missing"), (0, "0"), (-1, "-1"), (5000, "5000"), ("3", "'3'"), (True, "True"), (2.5, "2.5"),
])
def test_a_min_member_that_cannot_be_a_gang_size_refuses_the_pod(min_member: Any, shown: str) -> None:
    outcome, response = run_review(member(), owners=OwnerResolver(Api({("podgroups", "pg"): pod_group("pg",
                                                                                                     min_member)})))
    assert outcome.result is Result.DENIED and response["status"]["code"] == 403
    assert response["status"]["message"] == (
        f"PodGroup team-a/pg (label scheduling.x-k8s.io/pod-group on the pod) has spec.minMember {shown}: kube-vgpu "
        "needs a whole number from 1 to 4096 (the gang's size)")


@pytest.mark.parametrize(("count", "warned"), [("3", False), ("2", True)], ids=["agree", "disagree"])
def test_a_pods_own_kueue_pod_group_wins_over_its_pod_group(count: str, warned: bool) -> None:
    sent = member(**{GROUP: "mine"})
    sent["metadata"].setdefault("annotations", {})[COUNT] = count
    outcome, response = run_review(sent, owners=OwnerResolver(Api({("podgroups", "pg"): pod_group("pg", 3)})))
    assert outcome.result is Result.MUTATED
    mutated = apply_response(sent, response)
    assert mutated["metadata"]["labels"][GROUP] == "mine" and mutated["metadata"]["annotations"][COUNT] == count
    if warned:
        assert response["warnings"] == [
            "the pod declares Kueue pod group mine of 2 members and PodGroup team-a/pg of minMember 3: the Kueue "
            "declaration wins"]
    else:
        assert "warnings" not in response


@pytest.mark.parametrize("api", [Api({}, fail=True), Api({}), Api({}, pod_groups_served=False)],
                         ids=["unreadable", "missing", "not-served"])
def test_a_pods_own_kueue_pod_group_is_not_refused_for_its_pod_group(api: Api) -> None:
    sent = member(**{GROUP: "mine"})
    sent["metadata"].setdefault("annotations", {})[COUNT] = "2"
    outcome, _ = run_review(sent, owners=OwnerResolver(api))
    assert outcome.result is Result.MUTATED


def test_a_burst_of_one_pod_groups_pods_reads_it_once() -> None:
    api = Api({("podgroups", "pg"): pod_group("pg", 8)})
    resolver = OwnerResolver(api)
    for _ in range(8):
        assert run_review(member(), owners=resolver)[0].result is Result.MUTATED
    assert api.reads == 1


# --- Kubernetes' own PodGroup (Workload API, scheduling.k8s.io/v1beta1 in 1.37): spec.schedulingGroup.podGroupName --
class K8sApi(Api):
    """Kubernetes PodGroups as ("k8s-podgroups", name); served unless told otherwise."""

    def __init__(self, groups: dict[str, dict[str, Any]], fail: bool = False, served: bool = True) -> None:
        super().__init__({("k8s-podgroups", name): group for name, group in groups.items()}, fail=fail)
        self.served = served

    def __call__(self, group: str, version: str, plural: str, namespace: str, name: str) -> dict[str, Any] | None:
        if group == "scheduling.k8s.io":
            assert (version, plural) == ("v1beta1", "podgroups")
            if not self.served:
                raise NotServed("scheduling.k8s.io/v1beta1 podgroups is not served")
            plural = "k8s-podgroups"
        return super().__call__(group, version, plural, namespace, name)


def k8s_pod_group(name: str, policy: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "scheduling.k8s.io/v1beta1", "kind": "PodGroup",
            "metadata": {"name": name, "namespace": "team-a"},
            "spec": {"schedulingPolicy": policy, "workloadRef": {"workloadName": "w", "templateName": "workers"}}}


def scheduled_member(group: str = "workers-0", **labels: str) -> dict[str, Any]:
    p = gpu_pod_owned_by(labels={QUEUE: "q", **labels})
    p["spec"]["schedulingGroup"] = {"podGroupName": group}
    return p


def test_a_pod_of_a_kubernetes_gang_pod_group_becomes_a_member_of_its_gang() -> None:
    sent = scheduled_member()
    api = K8sApi({"workers-0": k8s_pod_group("workers-0", {"gang": {"minCount": 4}})})
    outcome, response = run_review(sent, owners=OwnerResolver(api))
    assert outcome.result is Result.MUTATED and "warnings" not in response
    mutated = apply_response(sent, response)
    assert mutated["metadata"]["labels"][GROUP] == "workload_workers-0"  # apart from a coscheduling group's name
    assert mutated["metadata"]["annotations"][COUNT] == "4"


def test_a_kubernetes_pod_group_of_the_basic_policy_is_no_gang() -> None:
    sent = scheduled_member()
    api = K8sApi({"workers-0": k8s_pod_group("workers-0", {"basic": {}})})
    outcome, response = run_review(sent, owners=OwnerResolver(api))
    assert outcome.result is Result.MUTATED and "warnings" not in response
    assert GROUP not in apply_response(sent, response)["metadata"]["labels"]


@pytest.mark.parametrize(("api", "code", "message"), [
    (K8sApi({}), 403, "the pod's spec.schedulingGroup.podGroupName=workers-0 names PodGroup team-a/workers-0 "
                      "(scheduling.k8s.io), which does not exist: create it before the pods, or fix the pod's "
                      "podGroupName"),
    (K8sApi({}, fail=True), 503, "cannot read PodGroup team-a/workers-0 (scheduling.k8s.io) named by the pod's "
                                 "spec.schedulingGroup.podGroupName=workers-0 (no answer within 3 s); the pod is "
                                 "refused so that its controller retries"),
    (K8sApi({"workers-0": k8s_pod_group("workers-0", {"gang": {}})}), 403,
     "PodGroup team-a/workers-0 (scheduling.k8s.io) has spec.schedulingPolicy.gang.minCount missing: kube-vgpu needs "
     "a whole number from 1 to 4096 (the gang's size)"),
], ids=["missing", "unreadable", "no-min-count"])
def test_a_kubernetes_pod_group_that_cannot_make_a_gang_refuses_the_pod(api: K8sApi, code: int, message: str) -> None:
    outcome, response = run_review(scheduled_member(), owners=OwnerResolver(api))
    assert outcome.result is Result.DENIED
    assert (response["status"]["code"], response["status"]["message"]) == (code, message)


def test_without_the_workload_api_the_pod_is_placed_alone_and_told_so() -> None:
    sent = scheduled_member()
    outcome, response = run_review(sent, owners=OwnerResolver(K8sApi({}, served=False)))
    assert outcome.result is Result.MUTATED
    [said] = response["warnings"]
    assert said.startswith("spec.schedulingGroup names a Kubernetes PodGroup, but this cluster does not serve "
                           "podgroups.scheduling.k8s.io/v1beta1 (feature gate GenericWorkload off): this pod is placed "
                           "on its own, not all or nothing;")


def test_a_pod_naming_both_kinds_of_pod_group_joins_the_kubernetes_one_and_is_told() -> None:
    sent = scheduled_member(**{PG_LABEL: "pg"})
    api = K8sApi({"workers-0": k8s_pod_group("workers-0", {"gang": {"minCount": 2}})})
    api.objects[("podgroups", "pg")] = pod_group("pg", 3)
    _, response = run_review(sent, owners=OwnerResolver(api))
    assert apply_response(sent, response)["metadata"]["labels"][GROUP] == "workload_workers-0"
    assert response["warnings"] == [
        "the pod names both a Kubernetes PodGroup (spec.schedulingGroup) and a coscheduling one (label "
        "scheduling.x-k8s.io/pod-group): kube-vgpu reads the Kubernetes one"]


def test_a_pods_own_kueue_pod_group_wins_over_its_kubernetes_pod_group() -> None:
    sent = scheduled_member(**{GROUP: "mine"})
    sent["metadata"].setdefault("annotations", {})[COUNT] = "2"
    api = K8sApi({"workers-0": k8s_pod_group("workers-0", {"gang": {"minCount": 4}})})
    _, response = run_review(sent, owners=OwnerResolver(api))
    assert apply_response(sent, response)["metadata"]["labels"][GROUP] == "mine"
    assert response["warnings"] == [
        "the pod declares Kueue pod group mine of 2 members and PodGroup team-a/workers-0 (scheduling.k8s.io) of "
        "minCount 4: the Kueue declaration wins"]


def test_pod_group_fields_kube_vgpu_does_not_read_are_said() -> None:
    group = pod_group("pg", 2)
    group["spec"].update({"scheduleTimeoutSeconds": 60, "minResources": {"nvidia.com/gpu": "2"}})
    sent = member()
    outcome, response = run_review(sent, WebhookConfig(), owners=OwnerResolver(Api({("podgroups", "pg"): group})))
    assert outcome.result is Result.MUTATED
    assert response["warnings"] == [
        "PodGroup team-a/pg: spec.scheduleTimeoutSeconds, spec.minResources not read by kube-vgpu (a gang's own "
        "timeout is the pod annotation gang.kube-vgpu.io/timeout-seconds)"]
    assert apply_response(sent, response)["metadata"]["annotations"][COUNT] == "2"
