"""spec.fairSharing.weight on ClusterQueues and Cohorts: parsed as Kueue reads it (a quantity, milli-precision,
default 1, 0 allowed), refused with the field named, and a warning when the extender runs without --fair-sharing."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from kube_vgpu.extender.quota.objects import build_config


def docs(text: str) -> list[tuple[str, Any]]:
    return [("test.yaml", doc) for doc in yaml.safe_load_all(text) if doc]


def queue(weight: str, version: str = "v1beta1") -> str:
    cohort = "cohortName" if version == "v1beta2" else "cohort"
    fair = f"  fairSharing: {{weight: {weight}}}\n" if weight else ""
    return (f"apiVersion: kueue.x-k8s.io/{version}\nkind: ClusterQueue\nmetadata: {{name: team}}\nspec:\n"
            f"  {cohort}: ai\n  namespaceSelector: {{}}\n{fair}")


def cohort(weight: str) -> str:
    return (f"apiVersion: kueue.x-k8s.io/v1beta1\nkind: Cohort\nmetadata: {{name: ai}}\nspec:\n"
            f"  fairSharing: {{weight: {weight}}}\n")


@pytest.mark.parametrize(("weight", "milli"), [
    ("", None), ("1", 1000), ("2", 2000), ('"0.5"', 500), ("500m", 500), ("0", 0), ('"1.0005"', 1001),
])
@pytest.mark.parametrize("version", ["v1beta1", "v1beta2"])
def test_weight_parsed_in_thousandths(weight: str, milli: int | None, version: str) -> None:
    config = build_config(docs(queue(weight, version)), fair_sharing=True)
    assert config.errors == [] and config.warnings == []
    parsed = config.cluster_queues["team"]
    assert parsed.fair_weight_milli == milli
    assert parsed.fair_weight == (1000 if milli is None else milli)


def test_cohort_weight_parsed() -> None:
    config = build_config(docs(cohort('"1.5"')), fair_sharing=True)
    assert config.errors == []
    assert config.cohorts["ai"].fair_weight_milli == 1500
    assert build_config(docs(cohort("3")), fair_sharing=True).cohorts["ai"].fair_weight == 3000


@pytest.mark.parametrize(("weight", "message"), [
    ("-1", "spec.fairSharing.weight: '-1' must be greater than or equal to 0"),
    ("abc", "spec.fairSharing.weight: 'abc' is not a Kubernetes quantity"),
    ("true", "spec.fairSharing.weight: expected a quantity, got True"),
])
def test_bad_weight_refused_with_field(weight: str, message: str) -> None:
    config = build_config(docs(queue(weight) + "---\n" + cohort(weight)), fair_sharing=True)
    assert "team" not in config.cluster_queues and "ai" not in config.cohorts
    assert len(config.errors) == 2
    assert all(message in error for error in config.errors), config.errors
    assert "ClusterQueue team: " in config.errors[0] and "Cohort ai: " in config.errors[1]


def test_fair_sharing_not_an_object_refused() -> None:
    text = queue("").replace("namespaceSelector: {}", "namespaceSelector: {}\n  fairSharing: 3")
    config = build_config(docs(text))
    assert config.errors == ["test.yaml: ClusterQueue team: spec.fairSharing: must be an object"]


def test_weight_without_flag_warns_once_per_object() -> None:
    text = queue("2") + "---\n" + cohort("3")
    config = build_config(docs(text + "---\n" + text))  # the same objects twice: the later replaces the earlier
    assert config.errors == []
    assert config.warnings == [
        "ClusterQueue team: spec.fairSharing.weight is read only with --fair-sharing (the extender runs without it)",
        "Cohort ai: spec.fairSharing.weight is read only with --fair-sharing (the extender runs without it)",
    ]
    assert config.cluster_queues["team"].fair_weight_milli == 2000  # still read (the view shows it)
    assert build_config(docs(queue(""))).warnings == []  # no weight, nothing to say
    assert build_config(docs(text), fair_sharing=True).warnings == []
