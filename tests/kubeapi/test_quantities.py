"""Quantities as k8s.io/apimachinery reads them, and the unit kube-scheduler counts each resource in."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import pytest

from kube_vgpu import kubeapi
from kube_vgpu.kubeapi import InvalidQuantity


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("2", Decimal(2)),
        (2, Decimal(2)),
        (0.25, Decimal("0.25")),
        (Decimal("1.5"), Decimal("1.5")),
        ("500m", Decimal("0.5")),
        ("1.5", Decimal("1.5")),
        (".5", Decimal("0.5")),
        ("1.", Decimal(1)),
        ("+3", Decimal(3)),
        ("-3", Decimal(-3)),
        ("1k", Decimal(1000)),
        ("1M", Decimal(10**6)),
        ("1G", Decimal(10**9)),
        ("1T", Decimal(10**12)),
        ("1P", Decimal(10**15)),
        ("1E", Decimal(10**18)),  # E alone is exa, not an exponent
        ("1Ki", Decimal(1024)),
        ("1.5Gi", Decimal(3 * 2**29)),
        ("1Ei", Decimal(2**60)),
        ("1e3", Decimal(1000)),
        ("1E3", Decimal(1000)),
        ("15e-1", Decimal("1.5")),
        ("2E+2", Decimal(200)),
        (" 4 ", Decimal(4)),
        ("123456789012345678901234567890123456789", Decimal("123456789012345678901234567890123456789")),
    ],
)
def test_parse_quantity(text: Any, expected: Decimal) -> None:
    assert kubeapi.parse_quantity(text) == expected


@pytest.mark.parametrize(
    ("text", "suffix"),
    [("2", ""), ("500m", "m"), ("1Gi", "Gi"), ("1E", "E"), ("1e3", "e3"), (7, "")],
)
def test_suffix_as_written(text: Any, suffix: str) -> None:
    assert kubeapi.parse_quantity_and_suffix(text)[1] == suffix


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("lots", "'lots' is not a Kubernetes quantity"),
        ("", "'' is not a Kubernetes quantity"),
        ("1.2.3", "is not a Kubernetes quantity"),
        ("1 Gi", "is not a Kubernetes quantity"),
        ("1Xi", "is not a Kubernetes quantity"),
        ("--1", "is not a Kubernetes quantity"),
        ("1e", "is not a Kubernetes quantity"),
        ("0x10", "is not a Kubernetes quantity"),
        ("1e999", "exponent out of range"),
        ("9" * 65, "longer than 64"),
        (None, "expected a quantity, got None"),
        (True, "expected a quantity, got True"),
        ([1], "expected a quantity, got [1]"),
        (float("nan"), "'nan' is not a Kubernetes quantity"),
        (float("inf"), "'inf' is not a Kubernetes quantity"),
    ],
)
def test_bad_quantities_are_refused_with_a_reason(value: Any, message: str) -> None:
    with pytest.raises(InvalidQuantity, match=message.replace("[", r"\[").replace("]", r"\]")):
        kubeapi.parse_quantity(value)


@pytest.mark.parametrize(
    ("value", "milli", "whole"),
    [
        ("500m", 500, 1),  # Value() rounds up
        ("0.1", 100, 1),
        ("1", 1000, 1),
        ("0.5m", 1, 1),  # MilliValue() rounds up too
        ("1001m", 1001, 2),
        ("0", 0, 0),
        ("-0.5", -500, 0),  # towards +infinity, as Quantity's ScaledValue
        ("1Gi", 2**30 * 1000, 2**30),
    ],
)
def test_milli_and_whole_values_round_up(value: str, milli: int, whole: int) -> None:
    assert kubeapi.quantity_milli(value) == milli
    assert kubeapi.quantity_value(value) == whole


def test_cpu_counts_in_millicores_everything_else_in_whole_units() -> None:
    assert kubeapi.resource_amount("cpu", "1.5") == 1500
    assert kubeapi.resource_amount("memory", "1.5Ki") == 1536
    assert kubeapi.resource_amount("nvidia.com/gpu", "2") == 2
    assert kubeapi.resource_amount("ephemeral-storage", "100m") == 1


def test_repeated_values_are_parsed_once() -> None:
    # pods repeat a handful of values and parsing sits on the watch-event path
    kubeapi.parse_quantity("777m")
    before = kubeapi._parse_text.cache_info().hits
    kubeapi.parse_quantity("777m")
    assert kubeapi._parse_text.cache_info().hits == before + 1
