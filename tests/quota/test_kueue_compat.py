"""Kueue compatibility of the gate, case by case from Kueue's published semantics (v0.19): the HAMi guide's
ResourceTransformation resources, v1beta1/v1beta2 Cohort hierarchies, BlockUndeclared, available clamped to 0,
warnings for fields the gate does not implement."""

from __future__ import annotations

import pytest
import yaml

from kube_vgpu.extender.quota import cli as quota_cli
from kube_vgpu.extender.quota.accounting import CQ
from kube_vgpu.extender.quota.objects import TOTAL_GPU_CORES, TOTAL_GPU_MEMORY, QuotaConfigError, parse_object
from kube_vgpu.extender.quota.usage import assignment_usage, request_usage_fixed
from kube_vgpu.extender.quota.views import quota_view
from kube_vgpu.protocol import (
    ContainerAssignment,
    ContainerGpuRequest,
    DeviceShare,
    PodAssignment,
    PodGpuRequest,
)
from tests.quota.helpers import FLAVORS, GPU, a100_node, gpu_queue, local_queue, make_env, queued_pod


def hami_queue(gpus: int, total_gpumem: int, total_gpucores: int, version: str = "v1beta2") -> str:
    """The ClusterQueue of Kueue's HAMi guide: vGPUs, total-gpucores and total-gpumem in one resource group."""
    return FLAVORS + f"""
---
apiVersion: kueue.x-k8s.io/{version}
kind: ClusterQueue
metadata: {{name: hami-queue}}
spec:
  namespaceSelector: {{}}
  resourceGroups:
  - coveredResources: [nvidia.com/gpu, nvidia.com/total-gpucores, nvidia.com/total-gpumem]
    flavors:
    - name: a100
      resources:
      - {{name: nvidia.com/gpu, nominalQuota: {gpus}}}
      - {{name: nvidia.com/total-gpucores, nominalQuota: {total_gpucores}}}
      - {{name: nvidia.com/total-gpumem, nominalQuota: {total_gpumem}}}
""" + local_queue("team-a", "q", "hami-queue")


def admitted(env_quota: str, pods: int, **request: int) -> int:
    env = make_env(env_quota, [a100_node("a100-0", gpus=8), a100_node("a100-1", gpus=8)])
    return sum(isinstance(env.submit(queued_pod("q", **request)), str) for _ in range(pods))


# (gpus, total-gpumem, total-gpucores quota) x pod request -> pods admitted of 10
@pytest.mark.parametrize(("quota", "request_", "expected"), [
    # the numbers: 4096 MiB per vGPU, a total-gpumem budget for 2 pods, plenty of vGPUs
    ((20, 8192, 10000), {"gpus": 1, "memory_mib": 4096}, 2),
    # multiplyBy nvidia.com/gpu: 2 vGPUs x 4096 MiB = 8192 per pod
    ((20, 16384, 10000), {"gpus": 2, "memory_mib": 4096}, 2),
    # total-gpucores: 2 vGPUs x 50 = 100 per pod
    ((20, 10**7, 300), {"gpus": 2, "memory_mib": 1000, "cores": 50}, 3),
    # a whole-GPU pod (no gpumem, no gpucores): 100 cores per GPU (HAMi >= 2.7 with Kueue), its GPU's 81920 MiB
    ((20, 10**7, 250), {"gpus": 1}, 2),
    ((20, 163840, 10**6), {"gpus": 1}, 2),
    # gpucores 0 with gpumem: shares compute, charged 0 cores
    ((20, 10**7, 0), {"gpus": 1, "memory_mib": 1000}, 10),
])
def test_hami_transformation_resources_are_counted(quota: tuple[int, int, int], request_: dict[str, int],
                                                    expected: int) -> None:
    assert admitted(hami_queue(*quota), 10, **request_) == expected


def test_hami_guide_queue_in_v1beta1_refuses_with_the_total_resource() -> None:
    env = make_env(hami_queue(20, 8192, 10000, "v1beta1"), [a100_node("a100-0", gpus=8)])
    for _ in range(2):
        assert env.submit(queued_pod("q", gpus=1, memory_mib=4096)) == "a100-0"
    assert env.used("hami-queue", "a100", TOTAL_GPU_MEMORY) == 8192
    assert env.used("hami-queue", "a100", GPU) == 2
    third = env.submit(queued_pod("q", gpus=1, memory_mib=4096))
    assert not isinstance(third, str)
    assert "nvidia.com/total-gpumem: needs 4096, used 8192/8192 MiB" in third.failed["a100-0"]


def test_usage_functions_give_the_totals() -> None:
    shared = ContainerGpuRequest("c", count=2, memory_mib=4096, cores=30)
    assert request_usage_fixed(PodGpuRequest((shared,))) is not None
    fixed = request_usage_fixed(PodGpuRequest((shared,)))
    assert fixed is not None and (fixed[TOTAL_GPU_MEMORY], fixed[TOTAL_GPU_CORES]) == (8192, 60)
    whole = PodAssignment("n", (ContainerAssignment("c", (DeviceShare("g0", 81920, 0), DeviceShare("g1", 4096, 0))),))
    held = assignment_usage(whole, {"g0": 81920, "g1": 81920})
    assert (held[TOTAL_GPU_MEMORY], held[TOTAL_GPU_CORES]) == (86016, 100)  # only g0 is a whole GPU
    assert assignment_usage(whole)[TOTAL_GPU_CORES] == 0  # GPU sizes unknown: the assigned cores


# --- Cohort parents per API version -------------------------------------------------------------------------


def cohort_doc(version: str, name: str, parent_field: str | None, parent: str | None, gpus: int = 0) -> str:
    spec = f"  {parent_field}: {parent}\n" if parent_field and parent else ""
    if gpus:
        spec += ("  resourceGroups:\n  - coveredResources: [nvidia.com/gpu]\n    flavors:\n"
                 f"    - {{name: a100, resources: [{{name: nvidia.com/gpu, nominalQuota: {gpus}}}]}}\n")
    return f"""
---
apiVersion: kueue.x-k8s.io/{version}
kind: Cohort
metadata: {{name: {name}}}
spec:
{spec or "  {}"}
"""


@pytest.mark.parametrize(("version", "field"), [("v1alpha1", "parent"), ("v1beta1", "parentName"),
                                                ("v1beta2", "parentName")])
def test_queue_gets_quota_from_its_grandparent_cohort(version: str, field: str) -> None:
    """org (20 vGPUs) <- ml (0) <- team-a queue (10 nominal): Kueue lets the queue reach 30."""
    quota = (FLAVORS + gpu_queue("team-a", {"a100": 10}, cohort="ml") + local_queue("team-a", "q", "team-a")
             + cohort_doc(version, "ml", field, "org") + cohort_doc(version, "org", None, None, gpus=20))
    env = make_env(quota, [a100_node(f"a100-{i}", gpus=8) for i in range(5)])
    assert not env.gate.config.errors
    assert sum(isinstance(env.submit(queued_pod("q", gpus=1, memory_mib=1000)), str) for _ in range(32)) == 30


@pytest.mark.parametrize(("version", "wrong", "right"), [("v1alpha1", "parentName", "parent"),
                                                         ("v1beta1", "parent", "parentName"),
                                                         ("v1beta2", "parent", "parentName")])
def test_the_other_versions_parent_field_is_refused_by_name(version: str, wrong: str, right: str) -> None:
    with pytest.raises(QuotaConfigError, match=rf"Cohort ml: spec.{wrong}: does not exist in "
                                               rf"kueue.x-k8s.io/{version}; it calls the parent spec.{right}$"):
        parse_object(yaml.safe_load(cohort_doc(version, "ml", wrong, "org").lstrip("-\n")))


# --- available clamped to 0 ---------------------------------------------------------------------------------


def test_available_of_an_over_admitted_queue_is_0_in_quota_and_status() -> None:
    quota = FLAVORS + gpu_queue("team-a", {"a100": 4}) + local_queue("team-a", "q", "team-a")
    env = make_env(quota, [a100_node("a100-0", gpus=8)])
    for _ in range(4):
        assert env.submit(queued_pod("q", gpus=1, memory_mib=1000)) == "a100-0"
    lowered = yaml.safe_load(gpu_queue("team-a", {"a100": 1}).lstrip("-\n"))
    env.gate.set_cluster_objects("ClusterQueue", {("", "team-a"): lowered})  # the quota is cut under it
    view = quota_view(env.gate)
    [queue] = view["clusterQueues"]
    [resource] = queue["flavors"][0]["resources"]
    assert (resource["used"], resource["nominal"], resource["available"]) == (4, 1, 0)
    assert env.gate.tree.available((CQ, "team-a"), ("a100", GPU)) == -3  # the arithmetic keeps the debt
    assert " -3 " not in quota_cli.render(view)


# --- BlockUndeclared (Kueue's default resources.quotaCheckStrategy) and its opt-out ---------------------------


def queue_covering(*resources: str) -> str:
    quotas = ", ".join(f"{{name: {r}, nominalQuota: 100000}}" for r in resources)
    return FLAVORS + f"""
---
apiVersion: kueue.x-k8s.io/v1beta2
kind: ClusterQueue
metadata: {{name: team-a}}
spec:
  namespaceSelector: {{}}
  resourceGroups:
  - coveredResources: [{", ".join(resources)}]
    flavors:
    - {{name: a100, resources: [{quotas}]}}
""" + local_queue("team-a", "q", "team-a")


MEM, CORES = "nvidia.com/gpumem", "nvidia.com/gpucores"


# covered resources x pod request -> the undeclared resources named in the refusal ("" = admitted)
@pytest.mark.parametrize(("covered", "request_", "undeclared"), [
    (("cpu",), {"gpus": 1, "memory_mib": 1000}, "nvidia.com/gpu, nvidia.com/gpumem"),
    ((GPU,), {"gpus": 1, "memory_mib": 1000}, "nvidia.com/gpumem"),
    ((GPU,), {"gpus": 1, "memory_percent": 50}, "nvidia.com/gpumem-percentage"),
    ((GPU, MEM), {"gpus": 1, "memory_mib": 1000, "cores": 50}, "nvidia.com/gpucores"),
    ((GPU,), {"gpus": 1}, ""),  # a whole GPU names nvidia.com/gpu only
    ((GPU, MEM, CORES), {"gpus": 1, "memory_mib": 1000, "cores": 50}, ""),
    # the HAMi guide's transformation outputs declare the per-vGPU inputs (Replace)
    ((GPU, TOTAL_GPU_MEMORY, TOTAL_GPU_CORES), {"gpus": 1, "memory_mib": 1000, "cores": 50}, ""),
    ((GPU, MEM), {"gpus": 1, "memory_percent": 50}, ""),  # a percentage is counted in MiB
])
def test_block_undeclared(covered: tuple[str, ...], request_: dict[str, int], undeclared: str) -> None:
    env = make_env(queue_covering(*covered), [a100_node("a100-0")], quota_check_strategy="BlockUndeclared")
    outcome = env.submit(queued_pod("q", **request_))
    if not undeclared:
        assert outcome == "a100-0"
        return
    assert not isinstance(outcome, str)
    reason = outcome.failed["a100-0"]
    assert reason.startswith(f"quota: ClusterQueue team-a (LocalQueue team-a/q) does not cover {undeclared}, "
                             "which the pod requests: resource unavailable in ClusterQueue (Kueue's default "
                             "quotaCheckStrategy BlockUndeclared). Add it to a resource group's coveredResources (")
    assert reason.endswith("or run the extender with --quota-check-strategy IgnoreUndeclared")


def test_block_undeclared_is_the_default_and_ignore_undeclared_opts_out() -> None:
    pod_request = {"gpus": 1, "memory_mib": 1000}
    default_gate = make_env(queue_covering(GPU), [a100_node("a100-0")], quota_check_strategy="BlockUndeclared")
    assert default_gate.gate.quota_check_strategy == "BlockUndeclared"
    from kube_vgpu.extender.quota.gate import QuotaGate
    from kube_vgpu.extender.state import ClusterState
    assert QuotaGate(ClusterState()).quota_check_strategy == "BlockUndeclared"
    assert not isinstance(default_gate.submit(queued_pod("q", **pod_request)), str)
    ignoring = make_env(queue_covering(GPU), [a100_node("a100-0")], quota_check_strategy="IgnoreUndeclared")
    assert ignoring.submit(queued_pod("q", **pod_request)) == "a100-0"
    assert ignoring.used("team-a", "a100") == 1  # the covered resource is still counted
    with pytest.raises(ValueError, match="quota check strategy 'Block' is not one of"):
        make_env(queue_covering(GPU), [], quota_check_strategy="Block")


def test_the_flag_reaches_the_gate() -> None:
    from kube_vgpu.extender.cli import parse_args
    assert parse_args([]).quota_check_strategy == "BlockUndeclared"
    assert parse_args(["--quota-check-strategy", "IgnoreUndeclared"]).quota_check_strategy == "IgnoreUndeclared"


# --- warnings for what the gate does not carry out ------------------------------------------------------------


CQ_WITH = """
---
apiVersion: kueue.x-k8s.io/{version}
kind: ClusterQueue
metadata: {{name: team-a}}
spec:
  namespaceSelector: {{}}
  {field}: {value}
  resourceGroups:
  - coveredResources: [nvidia.com/gpu]
    flavors: [{{name: a100, resources: [{{name: nvidia.com/gpu, nominalQuota: 4}}]}}]
"""
NOT_IMPLEMENTED = "is not implemented by the quota gate and is ignored"
UNKNOWN = "is not a field of Kueue's {kind} that the quota gate knows; it is ignored"


@pytest.mark.parametrize(("kind", "field", "value", "expected"), [
    ("ClusterQueue", "admissionChecks", "[prov]", f"ClusterQueue team-a: spec.admissionChecks {NOT_IMPLEMENTED} "
                                                  "(no AdmissionCheck is run: pods are admitted on quota alone)"),
    ("ClusterQueue", "admissionChecksStrategy", "{admissionChecks: [{name: prov}]}",
     f"ClusterQueue team-a: spec.admissionChecksStrategy {NOT_IMPLEMENTED}"),
    ("ClusterQueue", "flavorFungibility", "{whenCanBorrow: TryNextFlavor}",
     f"ClusterQueue team-a: spec.flavorFungibility {NOT_IMPLEMENTED}"),
    ("ClusterQueue", "admissionScope", "{admissionMode: UsageBasedAdmissionFairSharing}",
     f"ClusterQueue team-a: spec.admissionScope {NOT_IMPLEMENTED}"),
    ("ClusterQueue", "concurrentAdmissionPolicy", "{migration: {mode: Never}}",
     f"ClusterQueue team-a: spec.concurrentAdmissionPolicy {NOT_IMPLEMENTED}"),
    ("ClusterQueue", "resourceGroup", "[]", "ClusterQueue team-a: spec.resourceGroup "
                                            + UNKNOWN.format(kind="ClusterQueue")),
    ("ResourceFlavor", "topologyName", "default", f"ResourceFlavor tas: spec.topologyName {NOT_IMPLEMENTED}"),
    ("ResourceFlavor", "nodeLabel", "{a: b}", "ResourceFlavor tas: spec.nodeLabel "
                                              + UNKNOWN.format(kind="ResourceFlavor")),
    ("LocalQueue", "fairSharing", "{weight: 2}", f"LocalQueue team-a/q: spec.fairSharing {NOT_IMPLEMENTED}"),
    ("Cohort", "parentname", "org", "Cohort ml: spec.parentname " + UNKNOWN.format(kind="Cohort")),
    # implemented: no warning (fairSharing warns only without --fair-sharing, tested with it)
    ("ClusterQueue", "preemption", "{withinClusterQueue: LowerPriority}", None),
    ("ClusterQueue", "stopPolicy", "None", None),
    ("ResourceFlavor", "tolerations", "[{key: k, operator: Exists}]", None),
])
def test_warnings_for_fields_the_gate_does_not_carry_out(kind: str, field: str, value: str, expected: str | None,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    extra = {
        "ClusterQueue": FLAVORS + CQ_WITH.format(version="v1beta2", field=field, value=value),
        "ResourceFlavor": (FLAVORS + gpu_queue("team-a", {"a100": 4}) + "\n---\napiVersion: kueue.x-k8s.io/v1beta2\n"
                           f"kind: ResourceFlavor\nmetadata: {{name: tas}}\nspec: {{{field}: {value}}}\n"),
        "LocalQueue": (FLAVORS + gpu_queue("team-a", {"a100": 4}) + "\n---\napiVersion: kueue.x-k8s.io/v1beta1\n"
                       "kind: LocalQueue\nmetadata: {namespace: team-a, name: q}\n"
                       f"spec: {{clusterQueue: team-a, {field}: {value}}}\n"),
        "Cohort": (FLAVORS + gpu_queue("team-a", {"a100": 4}) + "\n---\napiVersion: kueue.x-k8s.io/v1beta1\n"
                   f"kind: Cohort\nmetadata: {{name: ml}}\nspec: {{{field}: {value}}}\n"),
    }[kind]
    with caplog.at_level("WARNING", logger="kube_vgpu.extender.quota.gate"):
        env = make_env(extra + local_queue("other", "q", "team-a"), [a100_node("a100-0")], fair_sharing=True)
    warnings = env.gate.config.warnings
    if expected is None:
        assert warnings == []
        return
    assert len(warnings) == 1 and warnings[0].startswith(expected)
    view = quota_view(env.gate)
    assert view["warnings"] == warnings  # /quota
    assert f"warning: {warnings[0]}" in quota_cli.render(view)  # kube-vgpu quota status
    assert [r.getMessage() for r in caplog.records] == [f"quota: {warnings[0]}"]  # the log, once
    env.gate.set_cluster_objects("LocalQueue", {})  # a reload does not say it again
    assert len(caplog.records) == 1


# --- ResourceFlavor tolerations -------------------------------------------------------------------------------


SPOT = """
apiVersion: kueue.x-k8s.io/v1beta1
kind: ResourceFlavor
metadata: {{name: spot}}
spec:
  nodeLabels: {{nvidia.com/gpu.product: NVIDIA-A100-SXM4-80GB}}
  nodeTaints: [{{key: spot, value: "true", effect: NoSchedule}}]
{tolerations}
---
apiVersion: kueue.x-k8s.io/v1beta1
kind: ResourceFlavor
metadata: {{name: ondemand}}
spec:
  nodeLabels: {{nvidia.com/gpu.product: NVIDIA-A100-SXM4-80GB}}
---
apiVersion: kueue.x-k8s.io/v1beta1
kind: ClusterQueue
metadata: {{name: team-a}}
spec:
  namespaceSelector: {{}}
  resourceGroups:
  - coveredResources: [nvidia.com/gpu]
    flavors:
    - {{name: spot, resources: [{{name: nvidia.com/gpu, nominalQuota: 1}}]}}
    - {{name: ondemand, resources: [{{name: nvidia.com/gpu, nominalQuota: 1}}]}}
"""


# the flavor's nodeTaints are checked against the pod's tolerations plus the flavor's own (Kueue's flavor assigner)
@pytest.mark.parametrize(("flavor_tolerations", "pod_tolerations", "first_flavor"), [
    ("", [], "ondemand"),  # untolerated: the spot flavor is skipped
    ("", [{"key": "spot", "operator": "Exists"}], "spot"),
    ('  tolerations: [{key: spot, operator: Equal, value: "true", effect: NoSchedule}]', [], "spot"),
    ("  tolerations: [{key: other, operator: Exists}]", [], "ondemand"),
    ('  tolerations: [{key: spot, operator: Equal, value: "false"}]', [], "ondemand"),
])
def test_flavor_tolerations_count_with_the_pods(flavor_tolerations: str, pod_tolerations: list[dict[str, str]],
                                                first_flavor: str) -> None:
    quota = SPOT.format(tolerations=flavor_tolerations) + local_queue("team-a", "q", "team-a")
    env = make_env(quota, [a100_node("a100-0")])
    p = queued_pod("q", gpus=1)
    p["spec"]["tolerations"] = pod_tolerations
    assert env.submit(p) == "a100-0"
    assert env.used("team-a", first_flavor) == 1


def test_a_whole_gpu_pod_counted_before_its_node_is_known_is_charged_100_cores() -> None:
    quota = hami_queue(20, 10**7, 10**4)
    env = make_env(quota, [a100_node("a100-0")])
    p = queued_pod("q", gpus=1)
    assert env.submit(p) == "a100-0"
    assert env.used("hami-queue", "a100", TOTAL_GPU_CORES) == 100
    stored = env.cluster.get_pod("team-a", p["metadata"]["name"])
    assert stored is not None
    late = make_env(quota, [], pods=[stored])  # live mode: the pod watch may run ahead of the node watch
    late.state.upsert_node(a100_node("a100-0"))
    late.node_names = ["a100-0"]
    late.filter(queued_pod("q", gpus=1, memory_mib=1000))  # any decision resolves it first
    assert late.used("hami-queue", "a100", TOTAL_GPU_CORES) == 100
    assert late.used("hami-queue", "a100", TOTAL_GPU_MEMORY) == 81920
