"""The wire side of native sidecars: the request parser, the phase rule, the assignment codec (old texts too),
and whole-number GPU quantities read through kubeapi."""

from __future__ import annotations

import re
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kube_vgpu import protocol
from kube_vgpu.protocol import ContainerAssignment, DeviceShare, InvalidGpuRequest, PodAssignment
from tests.helpers import pod


def sidecar_pod(app_gpus: int, sidecar_gpus: int, init_gpus: int | None = None) -> dict[str, Any]:
    obj = pod(gpus=app_gpus)
    side_limits = {protocol.RESOURCE_GPU: str(sidecar_gpus)}
    init = [{"name": "side", "restartPolicy": "Always", "resources": {"limits": side_limits}}]
    if init_gpus is not None:
        init.append({"name": "warm", "resources": {"limits": {protocol.RESOURCE_GPU: str(init_gpus)}}})
    obj["spec"]["initContainers"] = init
    return obj


def test_total_vgpus_counts_sidecars_with_the_app_and_before_later_init_containers() -> None:
    assert protocol.parse_pod_gpu_request(sidecar_pod(2, 1)).total_vgpus == 3
    assert protocol.parse_pod_gpu_request(sidecar_pod(1, 1, init_gpus=3)).total_vgpus == 4  # sidecar + warm-up
    plain = sidecar_pod(1, 1, init_gpus=3)
    plain["spec"]["initContainers"][0]["restartPolicy"] = "OnFailure"  # not a sidecar: each alone
    assert protocol.parse_pod_gpu_request(plain).total_vgpus == 3


def test_restart_policy_always_on_an_app_container_is_not_a_sidecar() -> None:
    obj = pod(gpus=1)
    obj["spec"]["containers"][0]["restartPolicy"] = "Always"
    (container,) = protocol.parse_pod_gpu_request(obj).containers
    assert not container.init and not container.sidecar


def a(name: str, *, init: bool = False, sidecar: bool = False) -> ContainerAssignment:
    return ContainerAssignment(name, (DeviceShare("GPU-a", 1000, 10),), init=init, sidecar=sidecar)


def test_container_phases() -> None:
    app, app2 = a("app"), a("app2")
    s1, s2 = a("s1", init=True, sidecar=True), a("s2", init=True, sidecar=True)
    i1, i2 = a("i1", init=True), a("i2", init=True)
    names = [[c.name for c in phase] for phase in protocol.container_phases([app, i1, s1, i2, s2, app2])]
    assert names == [["i1"], ["s1", "i2"], ["s1", "s2", "app", "app2"]]
    assert protocol.container_phases([]) == ()
    assert protocol.container_phases([i1]) == ((i1,),)  # no app moment when nothing runs then
    assert protocol.container_phases([s1]) == ((s1,),)  # a sidecar alone still runs beside the (GPU-less) app


def test_assignment_round_trip_with_a_sidecar_and_deterministic_text() -> None:
    assignment = PodAssignment("n1", (a("app"), a("side", init=True, sidecar=True), a("warm", init=True)))
    text = protocol.encode_assignment(assignment)
    assert protocol.decode_assignment(text) == assignment
    assert '"name":"side","init":true,"sidecar":true,"devices"' in text
    assert '"sidecar"' not in protocol.encode_assignment(PodAssignment("n1", (a("app"), a("warm", init=True))))


def test_assignments_written_before_sidecars_were_counted_still_decode() -> None:
    # byte for byte what earlier extenders wrote: no "sidecar" field, version 1
    old = (
        '{"v":1,"node":"n1","containers":[{"name":"main","init":false,"devices":[["GPU-a",40960,0]]},'
        '{"name":"warmup","init":true,"devices":[["GPU-a",40960,0]]}]}'
    )
    decoded = protocol.decode_assignment(old)
    kinds = [(c.name, c.init, c.sidecar) for c in decoded.containers]
    assert kinds == [("main", False, False), ("warmup", True, False)]
    assert protocol.encode_assignment(decoded) == old  # re-encoding changes nothing
    assert [[c.name for c in phase] for phase in decoded.phases] == [["warmup"], ["main"]]


@pytest.mark.parametrize(
    ("container", "message"),
    [
        ('{"name":"s","init":true,"sidecar":"yes","devices":[]}', "field 'sidecar' must be true or false"),
        ('{"name":"s","init":false,"sidecar":true,"devices":[]}', "a sidecar is an init container"),
    ],
)
def test_bad_sidecar_field_names_it(container: str, message: str) -> None:
    with pytest.raises(protocol.ProtocolError, match=re.escape(message)):
        protocol.decode_assignment('{"v":1,"node":"n1","containers":[' + container + "]}")


@pytest.mark.parametrize(
    ("value", "expected"),
    [("2", 2), (2, 2), (2.0, 2), ("1k", 1000), ("1Ki", 1024), ("81920", 81920), ("2000m", 2), ("1e3", 1000), ("+3", 3)],
)
def test_whole_count_quantities(value: Any, expected: int) -> None:
    assert protocol.parse_count_quantity(value, what="x") == expected


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("0.5", "x must be a non-negative whole number, got '0.5'"),
        ("500m", "x must be a non-negative whole number, got '500m'"),
        ("lots", "x must be a non-negative whole number, got 'lots'"),
        ("-1", "x must not be negative, got '-1'"),
        ("-0.5", "x must not be negative, got '-0.5'"),
        ("--1", "x must not be negative, got '--1'"),
        (-1, "x must not be negative, got -1"),
        (0.5, "x must be a non-negative whole number, got 0.5"),
        (True, "x must be a whole number, got True"),
    ],
)
def test_count_quantities_refused(value: Any, message: str) -> None:
    with pytest.raises(InvalidGpuRequest, match=re.escape(message)):
        protocol.parse_count_quantity(value, what="x")


@given(st.integers(0, 10**9), st.sampled_from([("", 1), ("k", 10**3), ("M", 10**6), ("Ki", 2**10), ("Mi", 2**20)]))
def test_whole_counts_with_suffixes(number: int, suffix: tuple[str, int]) -> None:
    assert protocol.parse_count_quantity(f"{number}{suffix[0]}", what="x") == number * suffix[1]
