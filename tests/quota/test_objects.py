"""Kueue's YAML (v1beta1 and v1beta2) parsed as Kueue reads it; invalid objects named with their field."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from kube_vgpu.extender.quota.objects import (
    BEST_EFFORT_FIFO,
    STRICT_FIFO,
    QuotaConfigError,
    ResourceQuota,
    Taint,
    Toleration,
    build_config,
    load_documents,
    parse_object,
    parse_quantity,
)

EXAMPLES = Path(__file__).resolve().parents[2] / "manifests" / "examples" / "kueue"


def docs(text: str) -> list[tuple[str, Any]]:
    return [("test.yaml", doc) for doc in yaml.safe_load_all(text) if doc]


def cluster_queue(version: str, spec: str, name: str = "team") -> str:
    return f"apiVersion: kueue.x-k8s.io/{version}\nkind: ClusterQueue\nmetadata: {{name: {name}}}\nspec:\n{spec}"


GROUPS = """  resourceGroups:
  - coveredResources: [nvidia.com/gpu, nvidia.com/gpumem]
    flavors:
    - name: a100
      resources:
      - {name: nvidia.com/gpu, nominalQuota: 8, borrowingLimit: 2, lendingLimit: 4}
      - {name: nvidia.com/gpumem, nominalQuota: "327680"}
"""


@pytest.mark.parametrize("path", ["quota.yaml", "quota-v1beta2.yaml"])
def test_example_manifests_parse_without_errors(path: str) -> None:
    config = build_config((path, d) for d in load_documents(EXAMPLES / path))
    assert config.errors == [] and config.warnings == []
    assert set(config.flavors) == {"a100", "v100"}
    assert config.flavors["a100"].node_labels == (("nvidia.com/gpu.product", "NVIDIA-A100-SXM4-80GB"),)
    training = config.cluster_queues["ai-training-queue"]
    assert training.cohort == "ai"
    assert training.quotas()[("a100", "nvidia.com/gpu")] == ResourceQuota(8, 4, None)
    assert training.quotas()[("v100", "nvidia.com/gpumem")] == ResourceQuota(262144)
    assert config.cluster_queues["inference-queue"].quotas()[("a100", "nvidia.com/gpu")].lending_limit == 4
    assert {(q.namespace, q.name, q.cluster_queue) for q in config.local_queues.values()} == {
        ("research", "research-queue", "ai-training-queue"),
        ("production", "production-queue", "ai-training-queue"),
        ("inference", "inference-queue", "inference-queue"),
    }
    assert {n: p.value for n, p in config.priority_classes.items()} == {"high": 1000, "normal": 100}


def test_both_versions_give_the_same_objects() -> None:
    v1 = build_config(("a", d) for d in load_documents(EXAMPLES / "quota.yaml"))
    v2 = build_config(("b", d) for d in load_documents(EXAMPLES / "quota-v1beta2.yaml"))
    assert v1.cluster_queues == v2.cluster_queues and v1.flavors == v2.flavors
    assert v1.local_queues == v2.local_queues


def test_cohort_field_names_per_version() -> None:
    v1 = parse_object(yaml.safe_load(cluster_queue("v1beta1", "  cohort: ai\n" + GROUPS)))
    v2 = parse_object(yaml.safe_load(cluster_queue("v1beta2", "  cohortName: ai\n" + GROUPS)))
    assert v1.cohort == v2.cohort == "ai"
    with pytest.raises(QuotaConfigError, match=r"ClusterQueue team: spec.cohort: is the v1beta1 name.*cohortName"):
        parse_object(yaml.safe_load(cluster_queue("v1beta2", "  cohort: ai\n" + GROUPS)))
    with pytest.raises(QuotaConfigError, match=r"spec.cohortName: is the v1beta2 name"):
        parse_object(yaml.safe_load(cluster_queue("v1beta1", "  cohortName: ai\n" + GROUPS)))
    parent_v2 = parse_object({"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "Cohort",
                              "metadata": {"name": "ml"}, "spec": {"parentName": "org"}})
    parent_v1beta1 = parse_object({"apiVersion": "kueue.x-k8s.io/v1beta1", "kind": "Cohort",
                                   "metadata": {"name": "ml"}, "spec": {"parentName": "org"}})
    parent_v1 = parse_object({"apiVersion": "kueue.x-k8s.io/v1alpha1", "kind": "Cohort",
                              "metadata": {"name": "ml"}, "spec": {"parent": "org"}})
    assert parent_v1 == parent_v2 == parent_v1beta1 and parent_v2.parent == "org"


def test_defaults_and_selectors() -> None:
    queue = parse_object(yaml.safe_load(cluster_queue("v1beta1", "  cohort: ai\n" + GROUPS)))
    assert queue.queueing_strategy == BEST_EFFORT_FIFO and queue.stop_policy == "None"
    assert queue.namespace_selector is None  # null selects no namespace, as in Kueue
    everything = parse_object(yaml.safe_load(cluster_queue(
        "v1beta1", "  namespaceSelector: {}\n  queueingStrategy: StrictFIFO\n  stopPolicy: Hold\n")))
    assert everything.namespace_selector is not None and everything.namespace_selector.matches({"any": "thing"})
    assert everything.queueing_strategy == STRICT_FIFO and everything.stop_policy == "Hold"
    selective = parse_object(yaml.safe_load(cluster_queue("v1beta1", """  namespaceSelector:
    matchLabels: {team: ml}
    matchExpressions:
    - {key: tier, operator: NotIn, values: [scratch]}
    - {key: owner, operator: Exists}
""")))
    selector = selective.namespace_selector
    assert selector.matches({"team": "ml", "owner": "x"})
    assert not selector.matches({"team": "ml", "owner": "x", "tier": "scratch"})
    assert not selector.matches({"team": "ml"})
    assert not selector.matches({"team": "web", "owner": "x"})


def test_flavor_taints_and_tolerations() -> None:
    flavor = parse_object({"apiVersion": "kueue.x-k8s.io/v1beta1", "kind": "ResourceFlavor",
                           "metadata": {"name": "spot"},
                           "spec": {"nodeLabels": {"pool": "spot"},
                                    "nodeTaints": [{"key": "spot", "value": "true", "effect": "NoSchedule"}]}})
    assert flavor.node_taints == (Taint("spot", "true", "NoSchedule"),)
    assert flavor.matches_node({"pool": "spot", "other": "x"}) and not flavor.matches_node({"pool": "ondemand"})
    assert not flavor.tolerated_by(())
    assert flavor.tolerated_by([Toleration("spot", "Equal", "true", "NoSchedule")])
    assert flavor.tolerated_by([Toleration("spot", "Exists")])
    assert flavor.tolerated_by([Toleration("", "Exists")])
    assert not flavor.tolerated_by([Toleration("spot", "Equal", "false")])


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (GROUPS, r"spec.resourceGroups\[0\].flavors\[0\].resources\[0\].borrowingLimit: must be nil when cohort"),
        ("  cohort: ai\n" + GROUPS.replace("lendingLimit: 4", "lendingLimit: 9"),
         r"resources\[0\].lendingLimit: 9 must be less than or equal to the nominalQuota \(8\)"),
        ("  cohort: ai\n" + GROUPS.replace("nominalQuota: 8", "nominalQuota: -1"),
         r"resources\[0\].nominalQuota: '-1' must be greater than or equal to 0"),
        ("  cohort: ai\n" + GROUPS.replace('nominalQuota: "327680"', "nominalQuota: 320Gi"),
         r"resources\[1\].nominalQuota: nvidia.com/gpumem is counted in MiB.*not '320Gi'"),
        ("  cohort: ai\n" + GROUPS.replace("nominalQuota: 8", "nominalQuota: 1.5"),
         r"nominalQuota: '1.5' is not a whole number of vGPUs"),
        ("  cohort: ai\n" + GROUPS.replace("{name: nvidia.com/gpumem", "{name: nvidia.com/gpucores"),
         r"resources\[1\].name: 'nvidia.com/gpucores' must match coveredResources\[1\]"),
        ("  cohort: ai\n" + GROUPS.replace("      - {name: nvidia.com/gpumem, nominalQuota: \"327680\"}\n", ""),
         r"flavors\[0\].resources: must list the 2 coveredResources"),
        ("  queueingStrategy: Lottery\n", r"spec.queueingStrategy: 'Lottery' is not one of StrictFIFO"),
        ("  stopPolicy: Pause\n", r"spec.stopPolicy: 'Pause' is not one of None, Hold, HoldAndDrain"),
        ("  namespaceSelector:\n    matchExpressions: [{key: team, operator: In}]\n",
         r"spec.namespaceSelector.matchExpressions\[0\].values: must be non-empty for operator In"),
        ("  cohort: ai\n" + GROUPS + GROUPS.replace("  resourceGroups:\n", ""),
         r"spec.resourceGroups\[1\].coveredResources\[0\]: duplicate resource 'nvidia.com/gpu'"),
    ],
)
def test_invalid_cluster_queue_named_with_field(spec: str, message: str) -> None:
    config = build_config(docs(cluster_queue("v1beta1", spec, name="broken") + "\n---\n"
                               + cluster_queue("v1beta1", "  cohort: ai\n" + GROUPS, name="fine")))
    assert list(config.cluster_queues) == ["fine"]  # the rest keeps working
    [error] = config.errors
    assert error.startswith("test.yaml: ClusterQueue broken: ")
    assert re.search(message, error), error


def test_other_invalid_objects() -> None:
    config = build_config(docs("""
apiVersion: kueue.x-k8s.io/v1beta1
kind: LocalQueue
metadata: {name: q, namespace: ns}
spec: {}
---
apiVersion: kueue.x-k8s.io/v1
kind: ResourceFlavor
metadata: {name: a100}
---
apiVersion: kueue.x-k8s.io/v1beta1
kind: WorkloadPriorityClass
metadata: {name: high}
value: "1000"
---
apiVersion: kueue.x-k8s.io/v1beta1
kind: ResourceFlavor
metadata: {name: v100}
spec:
  nodeTaints: [{key: gpu, effect: Sometimes}]
---
apiVersion: kueue.x-k8s.io/v1beta1
kind: Cohort
metadata: {name: root}
spec:
  resourceGroups:
  - coveredResources: [nvidia.com/gpu]
    flavors: [{name: a100, resources: [{name: nvidia.com/gpu, nominalQuota: 4, lendingLimit: 1}]}]
---
apiVersion: apps/v1
kind: Deployment
metadata: {name: ignored}
"""))
    assert config.errors == [
        "test.yaml: LocalQueue ns/q: spec.clusterQueue: is required",
        "test.yaml: ResourceFlavor a100: apiVersion 'kueue.x-k8s.io/v1' is not supported for ResourceFlavor "
        "(kueue.x-k8s.io/v1beta1, kueue.x-k8s.io/v1beta2)",
        "test.yaml: WorkloadPriorityClass high: value: must be an integer, got '1000'",
        "test.yaml: ResourceFlavor v100: spec.nodeTaints[0].effect: 'Sometimes' is not one of NoSchedule, "
        "PreferNoSchedule, NoExecute",
        "test.yaml: Cohort root: spec.resourceGroups[0].flavors[0].resources[0].lendingLimit: must be nil when "
        "parent is empty",
    ]
    assert config.empty


def test_quantities_in_counting_units() -> None:
    assert parse_quantity("2", "cpu", "x") == 2000
    assert parse_quantity("500m", "cpu", "x") == 500
    assert parse_quantity("1Gi", "memory", "x") == 2**30
    assert parse_quantity("1e3", "memory", "x") == 1000
    assert parse_quantity(81920, "nvidia.com/gpumem", "x") == 81920
    with pytest.raises(QuotaConfigError, match="not a Kubernetes quantity"):
        parse_quantity("lots", "memory", "x")
    with pytest.raises(QuotaConfigError, match="whole number of millicores"):
        parse_quantity("0.0005", "cpu", "x")


def test_quantities_read_by_kubeapi() -> None:
    """The quota's quantities are kubeapi's (one parser): "E" alone is exa and "Ei" a binary suffix, both refused
    before as exponents without digits; an exact 30-digit quota stays exact."""
    assert parse_quantity("1Ei", "memory", "x") == 2**60
    assert parse_quantity("2E", "memory", "x") == 2 * 10**18
    assert parse_quantity("123456789012345678901234567890", "cpu", "x") == 123456789012345678901234567890 * 1000
    with pytest.raises(QuotaConfigError, match=r"x: 'lots' is not a Kubernetes quantity"):
        parse_quantity("lots", "cpu", "x")
    with pytest.raises(QuotaConfigError, match=r"x: '-1' must be greater than or equal to 0"):
        parse_quantity("-1", "cpu", "x")
    with pytest.raises(QuotaConfigError, match=r"write a plain number, not '1k'"):
        parse_quantity("1k", "nvidia.com/gpu", "x")


def test_unreadable_file_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("kind: [unclosed\n")
    with pytest.raises(ValueError, match="not valid YAML"):
        load_documents(path)
