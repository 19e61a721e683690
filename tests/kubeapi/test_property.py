"""Hypothesis: pod_requests agrees with a straightforward model of kube-scheduler's rules on any pod.

The model is written from the rules, not from the code: quantities are exact fractions generated together with
their text (so it needs no parser), and the sidecar KEP's formula is applied by index:
  InitContainerUse(i) = sum(sidecars before i) + init container i   (a sidecar's own use includes itself)
  pod = max(sum(app containers) + sum(sidecars), max_i InitContainerUse(i))
then pod-level requests replace cpu / memory, a pod-level limit stands for a missing request where no container
names the resource, the overhead is added, and the total is rounded up once (millicores for cpu).
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from kube_vgpu import kubeapi

RESOURCES = ("cpu", "memory", "nvidia.com/gpu", "ephemeral-storage")
POD_LEVEL = ("cpu", "memory")


@st.composite
def quantities(draw: st.DrawFn) -> tuple[str, Fraction]:
    """(text, exact value) in the forms people write."""
    mantissa = draw(st.integers(0, 5000))
    form = draw(st.sampled_from(["plain", "milli", "decimal", "kilo", "binary", "exponent"]))
    if form == "plain":
        return str(mantissa), Fraction(mantissa)
    if form == "milli":
        return f"{mantissa}m", Fraction(mantissa, 1000)
    if form == "decimal":
        places = draw(st.integers(1, 4))
        whole, part = divmod(mantissa, 10**places)
        return f"{whole}.{part:0{places}d}", Fraction(mantissa, 10**places)
    if form == "kilo":
        return f"{mantissa}k", Fraction(mantissa * 1000)
    if form == "binary":
        suffix, power = draw(st.sampled_from([("Ki", 10), ("Mi", 20), ("Gi", 30)]))
        return f"{mantissa}{suffix}", Fraction(mantissa * 2**power)
    exponent = draw(st.integers(-4, 4))
    return f"{mantissa}e{exponent}", Fraction(mantissa) * Fraction(10) ** exponent


@st.composite
def resource_lists(draw: st.DrawFn, names: tuple[str, ...] = RESOURCES) -> dict[str, tuple[str, Fraction]]:
    chosen = draw(st.lists(st.sampled_from(names), unique=True, max_size=len(names)))
    return {name: draw(quantities()) for name in chosen}


@st.composite
def containers(draw: st.DrawFn, *, init: bool) -> dict[str, Any]:
    requests = draw(resource_lists())
    limits = draw(resource_lists())
    return {
        "requests": requests,
        "limits": limits,
        "sidecar": init and draw(st.booleans()),
    }


@st.composite
def pods(draw: st.DrawFn) -> dict[str, Any]:
    return {
        "containers": draw(st.lists(containers(init=False), max_size=4)),
        "init": draw(st.lists(containers(init=True), max_size=5)),
        "pod_requests": draw(resource_lists(POD_LEVEL)) if draw(st.booleans()) else {},
        "pod_limits": draw(resource_lists(POD_LEVEL)) if draw(st.booleans()) else {},
        "overhead": draw(resource_lists(("cpu", "memory"))) if draw(st.booleans()) else {},
    }


def to_object(shape: dict[str, Any]) -> dict[str, Any]:
    """The Pod object (the texts) for a generated shape."""

    def texts(resources: dict[str, tuple[str, Fraction]]) -> dict[str, str]:
        return {name: text for name, (text, _) in resources.items()}

    def container(index: int, raw: dict[str, Any]) -> dict[str, Any]:
        obj: dict[str, Any] = {"name": f"c{index}", "resources": {}}
        if raw["requests"]:
            obj["resources"]["requests"] = texts(raw["requests"])
        if raw["limits"]:
            obj["resources"]["limits"] = texts(raw["limits"])
        if raw["sidecar"]:
            obj["restartPolicy"] = "Always"
        return obj

    spec: dict[str, Any] = {
        "containers": [container(i, raw) for i, raw in enumerate(shape["containers"])],
        "initContainers": [container(100 + i, raw) for i, raw in enumerate(shape["init"])],
    }
    pod_resources = {}
    if shape["pod_requests"]:
        pod_resources["requests"] = texts(shape["pod_requests"])
    if shape["pod_limits"]:
        pod_resources["limits"] = texts(shape["pod_limits"])
    if pod_resources:
        spec["resources"] = pod_resources
    if shape["overhead"]:
        spec["overhead"] = texts(shape["overhead"])
    return {"spec": spec}


def model(shape: dict[str, Any]) -> dict[str, int]:
    def request(raw: dict[str, Any], name: str) -> Fraction | None:
        if name in raw["requests"]:
            return raw["requests"][name][1]
        if name in raw["limits"]:
            return raw["limits"][name][1]
        return None

    result: dict[str, int] = {}
    everyone = shape["containers"] + shape["init"]
    for name in RESOURCES:
        named = any(request(raw, name) is not None for raw in everyone)
        value = Fraction(0)
        if named:
            sidecar_sum = sum((request(raw, name) or 0 for raw in shape["init"] if raw["sidecar"]), Fraction(0))
            app_phase = sum((request(raw, name) or 0 for raw in shape["containers"]), Fraction(0)) + sidecar_sum
            uses = []
            for i, raw in enumerate(shape["init"]):
                before = sum(
                    (request(shape["init"][j], name) or 0 for j in range(i) if shape["init"][j]["sidecar"]),
                    Fraction(0),
                )
                uses.append(before + (request(raw, name) or 0))
            value = max([app_phase, *uses])
        if name in shape["pod_requests"]:
            value = shape["pod_requests"][name][1]
        elif name in shape["pod_limits"] and not named:
            value = shape["pod_limits"][name][1]
        if name in shape["overhead"]:
            value += shape["overhead"][name][1]
        counted = math.ceil(value * 1000) if name == "cpu" else math.ceil(value)
        if counted:
            result[name] = counted
    return result


@settings(max_examples=400, deadline=None)
@given(pods())
def test_pod_requests_match_the_model(shape: dict[str, Any]) -> None:
    obj = to_object(shape)
    assert kubeapi.pod_requests(obj) == model(shape)


@settings(max_examples=150, deadline=None)
@given(pods(), st.lists(st.sampled_from(RESOURCES), unique=True))
def test_restricting_resources_changes_nothing_else(shape: dict[str, Any], wanted: list[str]) -> None:
    obj = to_object(shape)
    full = kubeapi.pod_requests(obj)
    assert kubeapi.pod_requests(obj, wanted) == {name: full[name] for name in wanted if name in full}
    for name in wanted:
        assert kubeapi.pod_request(obj, name) == full.get(name, 0)
