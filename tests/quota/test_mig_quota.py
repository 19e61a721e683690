"""Static MIG under the quota gate (enforce mode, extender/quota/mig.py): a pod asking nvidia.com/mig-<profile>: N
is charged N of that resource (Kueue's count of the request as written) and the devices' memory as
nvidia.com/gpumem / total-gpumem; never nvidia.com/gpu or gpucores. Checked before placement, counted from the
assignment after; borrowing, lending, BlockUndeclared and the warnings for MIG resources no pod is charged."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from kube_vgpu import protocol
from kube_vgpu.dev.fixtures import node_object
from kube_vgpu.extender.engine.fit import place
from kube_vgpu.extender.engine.model import NodeState, Placement, PlacementRequest, assignment_from_placement
from kube_vgpu.extender.engine.policies import make_policy
from kube_vgpu.extender.quota import cli as quota_cli
from kube_vgpu.extender.quota.accounting import CQ
from kube_vgpu.extender.quota.mig import (
    mig_profiles_by_uuid,
    profile_memory_mib,
    uncountable_reason,
)
from kube_vgpu.extender.quota.objects import TOTAL_GPU_CORES, TOTAL_GPU_MEMORY, build_config
from kube_vgpu.extender.quota.usage import (
    BLOCK_UNDECLARED,
    IGNORE_UNDECLARED,
    assignment_usage,
    gpu_memory_by_uuid,
    named_gpu_resources,
    request_counts,
    request_usage_on,
)
from kube_vgpu.extender.quota.views import quota_view
from kube_vgpu.extender.scheduler import FilterOutcome
from kube_vgpu.extender.sources.snapshot import SnapshotCluster
from kube_vgpu.extender.state import ClusterState
from tests.engine.test_mig_placement import a100_mig, mig_pod
from tests.helpers import gpu_node
from tests.quota.helpers import GPU, GPUCORES, GPUMEM, Env, local_queue, make_env, queued_pod

PRODUCT = "NVIDIA-A100-SXM4-40GB"  # the product label of the a100-mig node
MIG_1G, MIG_2G, MIG_3G = "nvidia.com/mig-1g.5gb", "nvidia.com/mig-2g.10gb", "nvidia.com/mig-3g.20gb"
MIB_1G, MIB_2G, MIB_3G = 4864, 9984, 20096  # what the a100-mig node's devices publish (NVML's memorySizeMB)
FLAVOR = f"""
apiVersion: kueue.x-k8s.io/v1beta1
kind: ResourceFlavor
metadata: {{name: a100-mig}}
spec: {{nodeLabels: {{nvidia.com/gpu.product: {PRODUCT}}}}}
"""
EVERYTHING = {GPU: 100, GPUMEM: 10**6, GPUCORES: 10**4, TOTAL_GPU_MEMORY: 10**6, TOTAL_GPU_CORES: 10**4,
              MIG_1G: 100, MIG_2G: 100, MIG_3G: 100}


def mig_queue(name: str, quotas: dict[str, int], *, cohort: str | None = None,
              borrowing: dict[str, int] | None = None, lending: dict[str, int] | None = None) -> str:
    """A ClusterQueue of one resource group, flavor a100-mig: resource -> nominal (and limits), with a LocalQueue of
    the same name in team-a."""
    resources = []
    for resource, nominal in quotas.items():
        limits = "".join(f", {key}: {value[resource]}" for key, value in
                         (("borrowingLimit", borrowing or {}), ("lendingLimit", lending or {})) if resource in value)
        resources.append(f"{{name: {resource}, nominalQuota: {nominal}{limits}}}")
    return f"""
---
apiVersion: kueue.x-k8s.io/v1beta1
kind: ClusterQueue
metadata: {{name: {name}}}
spec:
  namespaceSelector: {{}}
{f"  cohort: {cohort}" if cohort else ""}
  resourceGroups:
  - coveredResources: [{", ".join(quotas)}]
    flavors:
    - name: a100-mig
      resources: [{", ".join(resources)}]
""" + local_queue("team-a", name, name)


def _queued(name: str, *containers: tuple[str, str, int], queue: str = "research",
            init: tuple[tuple[str, str, int], ...] = ()) -> dict[str, Any]:
    pod = mig_pod(*containers, init=init)
    pod["metadata"].update(name=name, namespace="team-a", uid=f"uid-{name}")
    pod["metadata"].setdefault("labels", {})[protocol.LABEL_KUEUE_QUEUE_NAME] = queue
    return pod


def _env(quota_yaml: str, strategy: str = BLOCK_UNDECLARED) -> Env:
    return make_env(FLAVOR + quota_yaml, [node_object("mig-node", a100_mig())], quota_check_strategy=strategy)


def _usage(env: Env, queue: str = "research") -> dict[str, int]:
    """What the queue uses now, per resource (only resources with usage)."""
    return {resource: used for (flavor, resource) in env.gate.tree.quotas[(CQ, queue)]
            if (used := env.used(queue, flavor, resource))}


# -- what a pod is charged ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("containers", "init", "charged"), [
    # one device: its MIG resource as written and its memory; no vGPU, no cores
    ([("main", "mig-3g.20gb", 1)], (), {MIG_3G: 1, GPUMEM: MIB_3G, TOTAL_GPU_MEMORY: MIB_3G}),
    # two profiles: each its own resource, the memory summed
    ([("main", "mig-3g.20gb", 1), ("side", "mig-1g.5gb", 2)], (),
     {MIG_3G: 1, MIG_1G: 2, GPUMEM: MIB_3G + 2 * MIB_1G, TOTAL_GPU_MEMORY: MIB_3G + 2 * MIB_1G}),
    # Kueue's pod-request rule: the init container's peak against the app containers'
    ([("main", "mig-1g.5gb", 1)], (("prep", "mig-1g.5gb", 3),),
     {MIG_1G: 3, GPUMEM: 3 * MIB_1G, TOTAL_GPU_MEMORY: 3 * MIB_1G}),
    ([("main", "mig-2g.10gb", 1)], (("prep", "mig-1g.5gb", 1),),
     {MIG_2G: 1, MIG_1G: 1, GPUMEM: MIB_2G, TOTAL_GPU_MEMORY: MIB_2G}),
    # a whole vGPU beside a MIG device: the vGPU is nvidia.com/gpu (and 100 total-gpucores), the device is not
    ([("main", "mig-1g.5gb", 1), ("share", "gpu", 1)], (),
     {MIG_1G: 1, GPU: 1, GPUMEM: MIB_1G + 40960, TOTAL_GPU_MEMORY: MIB_1G + 40960, TOTAL_GPU_CORES: 100}),
])
def test_a_mig_pod_is_charged_its_mig_resources_and_memory_never_vgpus_or_cores(
    containers: list[tuple[str, str, int]], init: tuple[tuple[str, str, int], ...], charged: dict[str, int]
) -> None:
    env = _env(mig_queue("research", EVERYTHING))
    pod = _queued("p", *containers, init=init)
    assert env.submit(pod) == "mig-node"
    assert _usage(env) == charged
    # what filter checked is what bind counted (the request on the node vs the assignment written)
    node = env.state.nodes["mig-node"]
    request = protocol.parse_pod_gpu_request(pod)
    record = env.state.pods["uid-p"]
    counted = assignment_usage(record.assignment, gpu_memory_by_uuid(node), mig_profiles_by_uuid(node))
    assert request_usage_on(request, node) == counted
    assert {r: v for r, v in counted.items() if v} == charged
    env.delete(pod)
    assert _usage(env) == {}


def test_an_assignment_whose_node_is_unknown_counts_mig_memory_only_until_the_node_is_known() -> None:
    node = NodeState("n", a100_mig())
    request = protocol.parse_pod_gpu_request(mig_pod(("main", "mig-3g.20gb", 1)))
    bfgd = make_policy("bfgd")
    result = place(node, PlacementRequest(request), bfgd, bfgd)
    assert isinstance(result, Placement)
    assignment = assignment_from_placement(node, result)
    assert {r: v for r, v in assignment_usage(assignment).items() if v} == {
        GPUMEM: MIB_3G, TOTAL_GPU_MEMORY: MIB_3G}  # never a vGPU with 100 cores
    assert assignment_usage(assignment, None, mig_profiles_by_uuid(node))[MIG_3G] == 1


def test_a_pod_bound_before_its_node_is_known_is_charged_its_mig_resource_once_the_node_arrives() -> None:
    quota = FLAVOR + mig_queue("research", {MIG_3G: 1, GPUMEM: 10**5})
    first = _env(quota)
    pod = _queued("early", ("main", "mig-3g.20gb", 1))
    assert first.submit(pod) == "mig-node"
    bound = first.cluster.get_pod("team-a", "early")
    assert bound is not None
    env = make_env(quota, [], pods=[bound], quota_check_strategy=BLOCK_UNDECLARED)
    assert quota_view(env.gate)["clusterQueues"][0]["uncountedPods"][0]["problem"] == "node mig-node not known yet"
    env.state.upsert_node(node_object("mig-node", a100_mig()))
    env.gate.resolve_unresolved()
    assert _usage(env) == {MIG_3G: 1, GPUMEM: MIB_3G}


@pytest.mark.parametrize(("profile", "node", "expected_mib"), [
    ("3g.20gb", "a100-mig", MIB_3G),  # the node publishes such a device: its NVML memory
    ("7g.40gb", "a100-mig", 40448),  # none published: the table of the node's GPU model (A100 40GB)
    ("1g.10gb", "a100-mig", 9984),  # A100 40GB's 1g double-memory profile
    ("1g.10gb", "v100", 9984),  # no MIG model on the node: the largest in any table (A100 40GB, H100: 9984)
    ("7g.80gb", "v100", 81152),  # H100's, larger than A100 80GB's 80384
])
def test_a_profiles_memory_comes_from_the_node_then_its_model_then_every_table(
    profile: str, node: str, expected_mib: int
) -> None:
    if node == "a100-mig":
        state = NodeState("n", a100_mig())
    else:
        cluster = ClusterState()
        SnapshotCluster(cluster, [gpu_node("v", gpus=1, model="Tesla-V100-SXM2-32GB", memory_mib=32768)])
        state = cluster.nodes["v"]
    assert profile_memory_mib(profile, state) == expected_mib


def test_the_resources_a_mig_pod_names_and_counts() -> None:
    request = protocol.parse_pod_gpu_request(mig_pod(("main", "mig-3g.20gb", 1), ("side", "mig-1g.5gb", 2),
                                                     init=(("prep", "mig-1g.5gb", 3),)))
    assert named_gpu_resources(request) == [MIG_1G, MIG_3G]  # no nvidia.com/gpu: the pod does not ask for it
    assert request_counts(request) == {GPU: 0, MIG_3G: 1, MIG_1G: 3}


# -- admission, borrowing and lending ---------------------------------------------------------------------------


@pytest.mark.parametrize(("quotas", "profile", "admitted"), [
    ({MIG_1G: 2}, "mig-1g.5gb", 2),
    ({MIG_1G: 0}, "mig-1g.5gb", 0),
    # an nvidia.com/gpu budget of 0 (no whole GPUs for this team) does not stop its MIG devices
    ({GPU: 0, MIG_1G: 3}, "mig-1g.5gb", 3),
    # the memory budget binds first: 2 x 4864 MiB fit in 10000
    ({MIG_1G: 9, GPUMEM: 10000}, "mig-1g.5gb", 2),
    ({MIG_1G: 9, TOTAL_GPU_MEMORY: 15000}, "mig-1g.5gb", 3),
    # a quota on another profile's resource is no quota for this one
    ({MIG_1G: 5, MIG_2G: 1}, "mig-2g.10gb", 1),
    # more quota than devices: the node's 9 1g.5gb devices are the limit (not quota)
    ({MIG_1G: 20}, "mig-1g.5gb", 9),
])
def test_pods_admitted_by_a_queues_mig_quota(quotas: dict[str, int], profile: str, admitted: int) -> None:
    env = _env(mig_queue("research", quotas))
    results = [env.submit(_queued(f"p{index}", ("main", profile, 1))) for index in range(10)]
    assert sum(isinstance(r, str) for r in results) == admitted


def test_a_refusal_names_the_mig_resource_the_queue_and_the_numbers() -> None:
    env = _env(mig_queue("research", {MIG_1G: 2}))
    for index in range(2):
        assert env.submit(_queued(f"p{index}", ("main", "mig-1g.5gb", 1))) == "mig-node"
    refused = env.submit(_queued("over", ("main", "mig-1g.5gb", 1)))
    assert isinstance(refused, FilterOutcome) and refused.failed == {"mig-node": (
        "quota: ClusterQueue research (LocalQueue team-a/research): flavor a100-mig, nvidia.com/mig-1g.5gb: "
        "needs 1, used 2/2 MIG devices (nominal 2), 0 available now")}
    env.delete(_queued("p0", ("main", "mig-1g.5gb", 1)))
    assert env.retry(_queued("over", ("main", "mig-1g.5gb", 1))) == "mig-node"


def test_a_memory_refusal_of_a_mig_pod_names_gpumem() -> None:
    env = _env(mig_queue("research", {MIG_1G: 9, MIG_2G: 1, MIG_3G: 1, GPUMEM: 30000}))
    assert env.submit(_queued("big", ("main", "mig-3g.20gb", 1))) == "mig-node"
    assert env.submit(_queued("small", ("main", "mig-1g.5gb", 1))) == "mig-node"
    refused = env.submit(_queued("over", ("main", "mig-2g.10gb", 1)))
    assert isinstance(refused, FilterOutcome) and refused.failed == {"mig-node": (
        "quota: ClusterQueue research (LocalQueue team-a/research): flavor a100-mig, nvidia.com/gpumem: needs 9984, "
        "used 24960/30000 MiB (nominal 30000), 5040 available now")}


# research: nominal 1 nvidia.com/mig-1g.5gb; lender: nominal 3, in cohort lab. (research's borrowingLimit,
# lender's lendingLimit) -> research's pods admitted, of which borrowed
@pytest.mark.parametrize(("borrowing_limit", "lending_limit", "admitted", "borrowed"), [
    (None, None, 4, 3),
    (1, None, 2, 1),
    (None, 2, 3, 2),
    (0, None, 1, 0),
])
def test_a_queue_borrows_mig_devices_from_its_cohort_within_the_limits(
    borrowing_limit: int | None, lending_limit: int | None, admitted: int, borrowed: int
) -> None:
    quota = (mig_queue("research", {MIG_1G: 1}, cohort="lab",
                       borrowing={MIG_1G: borrowing_limit} if borrowing_limit is not None else None)
             + mig_queue("lender", {MIG_1G: 3}, cohort="lab",
                         lending={MIG_1G: lending_limit} if lending_limit is not None else None))
    env = _env(quota)
    results = [env.submit(_queued(f"p{index}", ("main", "mig-1g.5gb", 1))) for index in range(6)]
    assert sum(isinstance(r, str) for r in results) == admitted
    status = env.gate.tree.status("research", ("a100-mig", MIG_1G))
    assert (status.used, status.borrowed) == (admitted, borrowed)
    last = results[admitted]
    assert isinstance(last, FilterOutcome) and "nvidia.com/mig-1g.5gb: needs 1" in last.failed["mig-node"]
    # what research borrowed is what lender can no longer use
    lender_results = [env.submit(_queued(f"l{index}", ("main", "mig-1g.5gb", 1), queue="lender"))
                      for index in range(4)]
    assert sum(isinstance(r, str) for r in lender_results) == 3 - borrowed


# -- BlockUndeclared / IgnoreUndeclared -------------------------------------------------------------------------


@pytest.mark.parametrize(("strategy", "quotas", "admitted", "charged"), [
    # a queue budgeting vGPUs and memory only does not cover the MIG resource the pod asks: Kueue's
    # BlockUndeclared gives the pod no quota at all (the same queue under a real Kueue refuses it too)
    (BLOCK_UNDECLARED, {GPU: 4, GPUMEM: 10**5}, False, {}),
    # IgnoreUndeclared: admitted, counted in what the queue covers (the memory), not in nvidia.com/gpu
    (IGNORE_UNDECLARED, {GPU: 4, GPUMEM: 10**5}, True, {GPUMEM: MIB_1G}),
    # another profile's quota does not cover this one
    (BLOCK_UNDECLARED, {MIG_3G: 1}, False, {}),
    (IGNORE_UNDECLARED, {MIG_3G: 1}, True, {}),
    # the MIG resource covered: admitted; the memory is charged only where the queue covers it
    (BLOCK_UNDECLARED, {MIG_1G: 1}, True, {MIG_1G: 1}),
])
def test_a_mig_resource_the_queue_does_not_cover(strategy: str, quotas: dict[str, int], admitted: bool,
                                                  charged: dict[str, int]) -> None:
    env = _env(mig_queue("research", quotas), strategy)
    result = env.submit(_queued("p", ("main", "mig-1g.5gb", 1)))
    assert isinstance(result, str) == admitted, result
    assert _usage(env) == charged
    if not admitted:
        assert isinstance(result, FilterOutcome)
        assert result.failed["mig-node"].startswith(
            "quota: ClusterQueue research (LocalQueue team-a/research) does not cover nvidia.com/mig-1g.5gb, which "
            "the pod requests: resource unavailable in ClusterQueue (Kueue's default quotaCheckStrategy "
            "BlockUndeclared). Add it to a resource group's coveredResources (nvidia.com/mig-1g.5gb: "
            "nvidia.com/mig-1g.5gb)")


def test_a_queue_of_mig_profiles_only_blocks_vgpu_pods() -> None:
    """The other direction: a MIG device is no nvidia.com/gpu, so covering MIG profiles does not cover vGPUs."""
    env = make_env(FLAVOR + mig_queue("research", {MIG_1G: 1}), [node_object("mig-node", a100_mig())],
                   quota_check_strategy=BLOCK_UNDECLARED)
    refused = env.submit(queued_pod("research", gpus=1))
    assert isinstance(refused, FilterOutcome)
    assert "does not cover nvidia.com/gpu" in refused.failed["mig-node"]


# -- MIG resources no pod is ever charged ------------------------------------------------------------------------


@pytest.mark.parametrize(("resource", "problem"), [
    (MIG_1G, None),
    ("nvidia.com/mig-7g.80gb", None),
    ("nvidia.com/mig-3g.71gb", None),  # H200's
    ("nvidia.com/gpu", None),  # not a MIG resource
    ("nvidia.com/mig-1g.5gb+me", "media-extension devices are offered and charged as nvidia.com/mig-1g.5gb"),
    ("nvidia.com/mig-1g.6gb", "kube-vgpu places no MIG profile '1g.6gb'"),  # A30's: not placed by kube-vgpu
    ("nvidia.com/mig-3g.20GB", "kube-vgpu places no MIG profile '3g.20GB'"),  # resource names are case-sensitive
    ("nvidia.com/mig-", "kube-vgpu places no MIG profile ''"),
])
def test_a_mig_resource_the_gate_cannot_charge_is_named(resource: str, problem: str | None) -> None:
    reason = uncountable_reason(resource)
    assert (reason is None) if problem is None else (reason is not None and reason.startswith(problem))


def test_a_queue_naming_an_uncountable_mig_resource_is_warned_about_in_quota_and_quota_status() -> None:
    quota = FLAVOR + mig_queue("research", {MIG_1G: 2, "nvidia.com/mig-1g.6gb": 4})
    config = build_config([("test.yaml", doc) for doc in yaml.safe_load_all(quota) if doc])
    warning = ("ClusterQueue research: nvidia.com/mig-1g.6gb is never counted: kube-vgpu places no MIG profile "
               "'1g.6gb'")
    assert len([w for w in config.warnings if w.startswith(warning)]) == 1
    env = _env(mig_queue("research", {MIG_1G: 2, "nvidia.com/mig-1g.6gb": 4}))
    view = quota_view(env.gate)
    assert any(w.startswith(warning) for w in view["warnings"])
    table = quota_cli.render(view)
    assert f"warning: {warning}" in table
    assert "nvidia.com/mig-1g.5gb (MIG devices)" in table  # its unit in the table
    # the countable resource still works beside it
    assert env.submit(_queued("p", ("main", "mig-1g.5gb", 1))) == "mig-node"


def test_a_pending_mig_gangs_ask_shows_its_mig_devices_and_leaves_the_memory_to_the_node() -> None:
    env = _env(mig_queue("research", {MIG_1G: 1, GPUMEM: 10**5}))
    gang = []
    for index in range(2):
        member = _queued(f"train-{index}", ("main", "mig-1g.5gb", 1))
        member["metadata"]["labels"][protocol.LABEL_KUEUE_POD_GROUP_NAME] = "train"
        member["metadata"].setdefault("annotations", {})[protocol.ANNOTATION_KUEUE_POD_GROUP_TOTAL_COUNT] = "2"
        env.cluster.add_pod(member)
        gang.append(member)
    outcome = env.filter(gang[0])
    assert outcome.passed == []
    [queue] = env.gate.snapshot(env.scheduler.gangs)["clusterQueues"]
    [entry] = queue["gangs"]
    assert entry["quota"] == {"resources": [{"resource": MIG_1G, "unit": "MIG devices", "amount": 2}],
                              "dependsOnNode": [GPUMEM]}
