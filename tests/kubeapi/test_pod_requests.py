"""A pod's requests as kube-scheduler counts them (component-helpers' PodRequests, the sidecar KEP's formula)."""

from __future__ import annotations

from typing import Any

import pytest

from kube_vgpu import kubeapi
from kube_vgpu.kubeapi import InvalidQuantity


def c(
    cpu: str | None = None,
    *,
    memory: str | None = None,
    limits: dict[str, str] | None = None,
    sidecar: bool = False,
    name: str | None = None,
    **requests: str,
) -> dict[str, Any]:
    """A container asking `cpu` / `memory` (requests) and `limits`; sidecar = an init container that keeps running."""
    asked = dict(requests)
    if cpu is not None:
        asked["cpu"] = cpu
    if memory is not None:
        asked["memory"] = memory
    resources: dict[str, Any] = {}
    if asked:
        resources["requests"] = asked
    if limits:
        resources["limits"] = limits
    container: dict[str, Any] = {"name": name or f"c{id(asked)}", "image": "busybox", "resources": resources}
    if sidecar:
        container["restartPolicy"] = "Always"
    return container


def pod(containers: list[dict[str, Any]], init: list[dict[str, Any]] | None = None, **spec: Any) -> dict[str, Any]:
    return {"spec": {"containers": containers, **({"initContainers": init} if init else {}), **spec}}


POD_CPU_3 = {"requests": {"cpu": "3"}}
CPU_CASES = [
    ("one container", pod([c("500m")]), 500),
    ("app containers add up", pod([c("1"), c("1500m")]), 2500),
    ("no CPU asked", pod([c(memory="1Gi")]), 0),
    ("init containers count at their peak", pod([c("1"), c("1")], [c("4"), c("2")]), 4000),
    ("app phase larger than every init container", pod([c("3"), c("2")], [c("4")]), 5000),
    # the case: a 2-CPU sidecar runs beside the 1-CPU app container
    ("a sidecar adds to the app containers", pod([c("1")], [c("2", sidecar=True)]), 3000),
    ("sidecar before an init container runs beside it", pod([c("1")], [c("1", sidecar=True), c("3")]), 4000),
    ("sidecar after an init container does not", pod([c("1")], [c("3"), c("1", sidecar=True)]), 3000),
    (
        "each init container beside the sidecars started before it",
        pod([c("500m")], [c("1", sidecar=True), c("2"), c("1", sidecar=True), c("2500m")]),
        4500,  # 1 + 1 + 2.5 while the last init container runs; app phase 2.5
    ),
    ("sidecars alone", pod([c()], [c("1", sidecar=True), c("2", sidecar=True)]), 3000),
    (
        "restartPolicy other than Always is an ordinary init container",
        pod([c("1")], [{**c("2"), "restartPolicy": "Never"}]),
        2000,
    ),
    ("pod overhead on top", pod([c("1")], overhead={"cpu": "250m"}), 1250),
    ("overhead on top of the init peak", pod([c("1")], [c("3")], overhead={"cpu": "250m"}), 3250),
    ("limit alone: the request defaults to it", pod([c(limits={"cpu": "2"})]), 2000),
    ("request wins over limit", pod([c("1", limits={"cpu": "2"})]), 1000),
    ("sidecar with a limit only", pod([c("1")], [c(limits={"cpu": "2"}, sidecar=True)]), 3000),
    ("pod-level request replaces the containers' sum", pod([c("1"), c("1")], resources=POD_CPU_3), 3000),
    ("pod-level request replaces the init peak too", pod([c("1")], [c("8")], resources=POD_CPU_3), 3000),
    ("pod-level request, then overhead", pod([c("1")], resources=POD_CPU_3, overhead={"cpu": "1"}), 4000),
    ("pod-level limit alone stands for the request", pod([c(memory="1Gi")], resources={"limits": {"cpu": "4"}}), 4000),
    ("pod-level limit leaves the containers' request", pod([c("1")], resources={"limits": {"cpu": "4"}}), 1000),
    ("rounded once on the total", pod([c("0.5m"), c("0.5m")]), 1),
    ("rounded up", pod([c("0.0001")]), 1),
    ("zero", pod([c("0")]), 0),
    ("no containers at all", {"spec": {}}, 0),
    ("no spec", {}, 0),
]


@pytest.mark.parametrize(("case", "obj", "expected_milli"), CPU_CASES, ids=[case[0] for case in CPU_CASES])
def test_cpu_request(case: str, obj: dict[str, Any], expected_milli: int) -> None:
    assert kubeapi.pod_request(obj, "cpu") == expected_milli, case
    assert kubeapi.pod_requests(obj).get("cpu", 0) == expected_milli, case


def test_every_resource_counted_in_its_unit() -> None:
    obj = pod(
        [c("1", memory="1Gi", limits={"nvidia.com/gpu": "2", "ephemeral-storage": "1.5k"})],
        [c("2", memory="512Mi", sidecar=True, **{"nvidia.com/gpu": "1"})],
        overhead={"memory": "100"},
    )
    assert kubeapi.pod_requests(obj) == {
        "cpu": 3000,
        "memory": 2**30 + 2**29 + 100,
        "nvidia.com/gpu": 3,  # the sidecar's GPU runs beside the app container's
        "ephemeral-storage": 1500,
    }


def test_resources_restricts_the_result() -> None:
    obj = pod([c("1", memory="1Gi")])
    assert kubeapi.pod_requests(obj, ["memory"]) == {"memory": 2**30}
    assert kubeapi.pod_requests(obj, []) == {}
    assert kubeapi.pod_request(obj, "nvidia.com/gpu") == 0


def test_zero_requests_are_left_out() -> None:
    assert kubeapi.pod_requests(pod([c("0", memory="0")])) == {}


def test_pod_level_memory_and_hugepages() -> None:
    obj = pod(
        [c("1", memory="1Gi", **{"hugepages-2Mi": "4Mi"}), c("1", memory="1Gi")],
        resources={"requests": {"memory": "3Gi"}, "limits": {"hugepages-2Mi": "8Mi", "nvidia.com/gpu": "9"}},
    )
    requests = kubeapi.pod_requests(obj)
    assert requests["memory"] == 3 * 2**30
    assert requests["cpu"] == 2000  # not set at pod level: the containers' sum
    assert requests["hugepages-2Mi"] == 8 * 2**20  # never overcommitted: the pod-level limit is the request
    assert "nvidia.com/gpu" not in requests  # not a pod-level resource


def test_only_pod_level_resources_replace() -> None:
    obj = pod([c("1", **{"nvidia.com/gpu": "1"})], resources={"requests": {"nvidia.com/gpu": "5"}})
    assert kubeapi.pod_requests(obj) == {"cpu": 1000, "nvidia.com/gpu": 1}


def test_container_requests_default_to_limits_per_resource() -> None:
    container = c("1", limits={"cpu": "2", "memory": "1Gi"})
    assert kubeapi.container_requests(container) == {"cpu": 1000, "memory": 2**30}
    assert kubeapi.container_requests(container, ["memory"]) == {"memory": 2**30}


def test_is_sidecar() -> None:
    assert kubeapi.is_sidecar(c(sidecar=True))
    assert not kubeapi.is_sidecar(c())


@pytest.mark.parametrize(
    "obj",
    [
        pod([c("lots")]),
        pod([c(limits={"memory": "1.2.3"})]),
        pod([c("1")], [c("x", sidecar=True)]),
        pod([c("1")], overhead={"cpu": "fast"}),
        pod([c("1")], resources={"requests": {"cpu": "[]"}}),
    ],
)
def test_bad_quantity_anywhere_raises_invalid_quantity(obj: dict[str, Any]) -> None:
    with pytest.raises(InvalidQuantity, match="is not a Kubernetes quantity"):
        kubeapi.pod_requests(obj)


@pytest.mark.parametrize(
    "obj",
    [
        pod([c("-1")]),
        pod([c("4"), c("-2")], [c("3")]),  # the sum (2) would hide under the init container's peak (3)
        pod([c("1", memory="-1Gi")]),
        pod([c("1")], [c("-500m", sidecar=True)]),
        pod([c("1")], overhead={"cpu": "-100m"}),
    ],
    ids=["container", "hidden-by-init-peak", "memory", "sidecar", "overhead"],
)
def test_a_negative_quantity_anywhere_is_refused(obj: dict[str, Any]) -> None:
    with pytest.raises(InvalidQuantity, match="is negative"):
        kubeapi.pod_requests(obj)


def test_a_bad_quantity_of_another_resource_does_not_matter_when_restricted() -> None:
    assert kubeapi.pod_request(pod([c("1", memory="lots")]), "cpu") == 1000


# --- in-place resize (kube-scheduler's NodeInfo counts bound pods with InPlacePodVerticalScaling) ----------------


def resized(
    obj: dict[str, Any], statuses: list[dict[str, Any]], *, init: bool = False, **status: Any
) -> dict[str, Any]:
    obj["status"] = {("initContainerStatuses" if init else "containerStatuses"): statuses, **status}
    return obj


def status(name: str, cpu: str | None, allocated: str | None = None) -> dict[str, Any]:
    entry: dict[str, Any] = {"name": name, "resources": {"requests": {"cpu": cpu}} if cpu else {}}
    if allocated is not None:
        entry["allocatedResources"] = {"cpu": allocated}
    return entry


STATUS_CASES = [
    ("resize up not applied yet: the spec", resized(pod([c("2", name="app")]), [status("app", "1", "1")]), 2000),
    ("resize down not applied yet: what it runs with", resized(pod([c("1", name="app")]), [status("app", "2")]), 2000),
    ("allocated counts too", resized(pod([c("1", name="app")]), [status("app", "1", "3")]), 3000),
    (
        "infeasible resize: the spec no longer counts",
        resized(
            pod([c("4", name="app")]),
            [status("app", "1", "1")],
            conditions=[{"type": "PodResizePending", "status": "True", "reason": "Infeasible"}],
        ),
        1000,
    ),
    (
        "deferred resize: the spec still counts",
        resized(
            pod([c("4", name="app")]),
            [status("app", "1", "1")],
            conditions=[{"type": "PodResizePending", "status": "True", "reason": "Deferred"}],
        ),
        4000,
    ),
    ("no resources reported: the spec", resized(pod([c("1", name="app")]), [{"name": "app"}]), 1000),
    (
        "a sidecar's status counts",
        resized(pod([c("1", name="app")], [c("1", name="side", sidecar=True)]), [status("side", "2")], init=True),
        3000,
    ),
    (
        "an ordinary init container's status does not",
        resized(pod([c("1", name="app")], [c("1", name="warm")]), [status("warm", "5")], init=True),
        1000,
    ),
]


@pytest.mark.parametrize(("case", "obj", "expected_milli"), STATUS_CASES, ids=[case[0] for case in STATUS_CASES])
def test_status_resources(case: str, obj: dict[str, Any], expected_milli: int) -> None:
    assert kubeapi.pod_request(obj, "cpu", status_resources=True) == expected_milli, case


def test_status_is_ignored_unless_asked() -> None:
    obj = resized(pod([c("1", name="app")]), [status("app", "4")])
    assert kubeapi.pod_request(obj, "cpu") == 1000
