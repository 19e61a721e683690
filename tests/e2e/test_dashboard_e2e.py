"""The dashboard in a real browser (Debian's chromium, tests/browser.py) over the dev cluster's live extender: the
figures on the page are the extender's /state for the same cluster, and a newly bound pod appears on the pods page
within seconds, without a reload."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from kube_vgpu.dev.devcluster.cluster import DevCluster
from kube_vgpu.dev.devcluster.workload import create_pods, gpu_pod, wait_for_pods
from kube_vgpu.extender.dashboard.server import Upstream, create_app
from tests.browser import chromium_page, field_values
from tests.e2e.conftest import NodeSet
from tests.servers import serve

pytestmark = pytest.mark.e2e

WAIT_S = 120.0
APPEAR_S = 8.0  # the dashboard reads the extender once a second; the page polls every 2 s


@pytest.fixture
def board(dev_cluster: DevCluster) -> Iterator[str]:
    with serve(create_app(Upstream(dev_cluster.extender_url, interval_s=1.0))) as url:
        yield url


def _overview_of(state: dict[str, Any]) -> dict[str, str]:
    gpus = [g for n in state["nodes"] for g in n["gpus"]]
    return {"nodes": str(len(state["nodes"])), "gpus": str(len(gpus)),
            "usedMemoryMiB": str(sum(g["usedMemoryMiB"] for g in gpus)),
            "usedCores": str(sum(g["usedCores"] for g in gpus)),
            "usedShares": str(sum(g["usedShares"] for g in gpus)), "pods": str(len(state["assignments"]))}


def test_the_page_shows_the_extenders_state(dev_cluster: DevCluster, e2e_namespace: str,
                                            gpu_nodes: Callable[..., NodeSet], board: str) -> None:
    nodes = gpu_nodes(1, gpus=4)
    pods = [gpu_pod("half", memory_mib=40960, cores=50, node_selector=nodes.selector),
            gpu_pod("quarter", memory_mib=20480, cores=25, node_selector=nodes.selector),
            gpu_pod("pair", gpus=2, memory_mib=8192, cores=10, node_selector=nodes.selector)]
    create_pods(dev_cluster.api, e2e_namespace, pods)
    names = [p["metadata"]["name"] for p in pods]
    outcome = wait_for_pods(dev_cluster.api, e2e_namespace, names, timeout_s=WAIT_S)
    assert sorted(outcome.bound) == sorted(names), outcome.describe()
    with chromium_page() as page:
        page.goto(board)
        page.wait_for_selector("#overview dd[data-field='usedMemoryMiB']", timeout=20_000)
        # the cluster is live (other nodes' heartbeats): compare one page load with the /state read after it,
        # retried until both have seen the same moment
        deadline = time.monotonic() + 20
        while True:
            shown = {f: page.get_attribute(f"#overview dd[data-field='{f}']", "data-value")
                     for f in ("nodes", "gpus", "usedMemoryMiB", "usedCores", "usedShares", "pods")}
            state = httpx.get(f"{dev_cluster.extender_url}/state", timeout=10).json()
            if shown == _overview_of(state) or time.monotonic() > deadline:
                break
            page.wait_for_timeout(1000)
        assert shown == _overview_of(state)
        page.click("nav a[data-page='nodes']")
        page.wait_for_selector(f"tr[data-node='{nodes.names[0]}']", timeout=10_000)
        (node,) = [n for n in state["nodes"] if n["name"] == nodes.names[0]]
        for gpu in node["gpus"]:
            row = f"tr[data-node='{node['name']}'][data-gpu='{gpu['index']}']"
            assert field_values(page, row, "usedMemoryMiB") == [str(gpu["usedMemoryMiB"])]
            assert field_values(page, row, "usedCores") == [str(gpu["usedCores"])]
        page.click("nav a[data-page='pods']")
        for assignment in state["assignments"]:
            if not assignment["pod"].startswith(f"{e2e_namespace}/"):
                continue
            row = f"tr[data-pod='{assignment['pod']}']"
            devices = [d for c in assignment["containers"] for d in c["devices"]]
            assert field_values(page, row, "memoryMiB") == [str(sum(d["memoryMiB"] for d in devices))]
            assert field_values(page, row, "cores") == [str(sum(d["cores"] for d in devices))]
            assert page.inner_text(f"{row} [data-field='node']") == nodes.names[0]


def test_a_newly_bound_pod_appears_without_a_reload(dev_cluster: DevCluster, e2e_namespace: str,
                                                    gpu_nodes: Callable[..., NodeSet], board: str) -> None:
    nodes = gpu_nodes(1, gpus=2)
    with chromium_page() as page:
        page.goto(f"{board}/#pods")
        page.wait_for_selector("#status:has-text('live')", timeout=20_000)
        page.evaluate("window.loadedOnce = true")  # gone if the page reloaded
        row = f"tr[data-pod='{e2e_namespace}/newcomer']"
        assert page.query_selector(row) is None
        create_pods(dev_cluster.api, e2e_namespace,
                    [gpu_pod("newcomer", memory_mib=4096, cores=10, node_selector=nodes.selector)])
        outcome = wait_for_pods(dev_cluster.api, e2e_namespace, ["newcomer"], timeout_s=WAIT_S)
        assert "newcomer" in outcome.bound, outcome.describe()
        bound_seen_s = time.monotonic()
        page.wait_for_selector(row, timeout=APPEAR_S * 1000)
        appeared_after_s = time.monotonic() - bound_seen_s
        assert page.evaluate("window.loadedOnce") is True
        assert page.inner_text(f"{row} [data-field='node']") == nodes.names[0]
        assert field_values(page, row, "memoryMiB") == ["4096"]
        assert appeared_after_s < APPEAR_S
