"""The scheduling reasons user-guide.md quotes are the extender's: each scenario below makes the real
Scheduler.filter refuse a node, and its message (node names and numbers aside) must be one the guide lists."""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Callable

import pytest

from kube_vgpu import protocol
from kube_vgpu.extender.scheduler import Scheduler
from kube_vgpu.extender.sources.snapshot import SnapshotCluster
from kube_vgpu.extender.state import ClusterState
from tests.helpers import gpu_node, pod
from tests.manifests.render import ROOT

GUIDE = (ROOT / "docs" / "user-guide.md").read_text()


def normalize(message: str) -> str:
    message = re.sub(r"node [\w.-]+:", "node N:", message)
    message = re.sub(r"type [a-z0-9/]+", "type T", message)
    return re.sub(r"\d+", "#", message)


QUOTED = {normalize(m) for m in re.findall(r"`([^`\n]+)`", GUIDE)}


class Cluster:
    def __init__(self) -> None:
        old = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=300)
        self.state = ClusterState(heartbeat_ttl_s=120)
        nodes = [gpu_node(f"n{i}", gpus=4) for i in range(8)] + [gpu_node("stale", gpus=4, heartbeat=old)]
        self.cluster = SnapshotCluster(self.state, nodes)
        self.scheduler = Scheduler(self.state, self.cluster)

    def place(self, node: str, **request: object) -> None:
        existing = pod(**request)  # type: ignore[arg-type]
        self.cluster.add_pod(existing)
        metadata = existing["metadata"]
        self.scheduler.bind(metadata["namespace"], metadata["name"], metadata["uid"], node)

    def reason(self, node: str, **request: object) -> str:
        outcome = self.scheduler.filter(pod(**request), [node])  # type: ignore[arg-type]
        assert not outcome.passed
        return outcome.error or {**outcome.failed, **outcome.unresolvable}[node]


def fill(cluster: Cluster, node: str, times: int, **request: object) -> Cluster:
    for _ in range(times):
        cluster.place(node, **request)
    return cluster


SCENARIOS: dict[str, Callable[[Cluster], str]] = {
    "unknown node": lambda c: c.reason("nope", memory_mib=1000),
    "stale inventory": lambda c: c.reason("stale", memory_mib=1000),
    "too few GPUs of a type": lambda c: c.reason("n0", gpus=2, memory_mib=1000,
                                                 annotations={protocol.ANNOTATION_USE_GPU_TYPE: "h100"}),
    "more memory than any GPU": lambda c: c.reason("n0", memory_mib=90000),
    "held exclusively": lambda c: fill(c, "n1", 3, cores=100).reason("n1", gpus=2, memory_mib=1000),
    "no vGPU slot": lambda c: fill(c, "n2", 40, memory_mib=100, cores=1).reason("n2", memory_mib=100),
    "no idle GPUs": lambda c: fill(c, "n3", 3, memory_mib=100, cores=10).reason("n3", gpus=4, cores=100),
    "memory": lambda c: fill(c, "n4", 4, memory_mib=80000).reason("n4", memory_mib=4096),
    "memory, several GPUs": lambda c: fill(c, "n5", 3, memory_mib=80000).reason("n5", gpus=2, memory_mib=20000),
    "cores": lambda c: fill(c, "n6", 4, memory_mib=1000, cores=80).reason("n6", memory_mib=1000, cores=50),
    "unknown policy": lambda c: c.reason("n7", memory_mib=1000,
                                         annotations={protocol.ANNOTATION_GPU_POLICY: "fastest"}),
}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_the_guide_quotes_the_reason_filter_gives(scenario: str) -> None:
    message = SCENARIOS[scenario](Cluster())
    normalized = normalize(message)
    prefixes = [q.removesuffix("...") for q in QUOTED if q.endswith("...")]
    assert normalized in QUOTED or any(normalized.startswith(p) for p in prefixes), (
        f"{scenario}: user-guide.md does not quote {message!r}")
