"""The dashboard in a real browser (Debian's chromium, tests/browser.py) against a real extender app: every page
renders, its figures are /state's, text from the cluster stays text, and an unreachable extender is said so."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import orjson
import pytest

from kube_vgpu.extender.dashboard.server import Upstream, create_app
from tests.browser import chromium_page, field_values
from tests.extender.test_dashboard import extender
from tests.extender.test_top import plain_server
from tests.servers import free_port, serve

WAIT_MS = 10_000


def test_every_page_shows_the_figures_of_state(tmp_path: Path) -> None:
    with extender(tmp_path) as (url, _), serve(create_app(Upstream(url))) as board, chromium_page() as page:
        state = httpx.get(f"{url}/state", timeout=10).json()
        gpus = [g for n in state["nodes"] for g in n["gpus"]]
        page.goto(board)
        page.wait_for_selector("#overview [data-field='usedMemoryMiB']", timeout=WAIT_MS)
        assert page.title() == "kube-vgpu dashboard"
        overview = {f: page.get_attribute(f"#overview dd[data-field='{f}']", "data-value")
                    for f in ("nodes", "gpus", "usedMemoryMiB", "usedCores", "usedShares", "pods")}
        assert overview == {"nodes": str(len(state["nodes"])), "gpus": str(len(gpus)),
                            "usedMemoryMiB": str(sum(g["usedMemoryMiB"] for g in gpus)),
                            "usedCores": str(sum(g["usedCores"] for g in gpus)),
                            "usedShares": str(sum(g["usedShares"] for g in gpus)),
                            "pods": str(len(state["assignments"]))}
        assert page.get_attribute("#capacity-table [data-field='memoryMiB']", "data-value") == str(
            sum(g["memoryMiB"] for g in gpus))
        assert page.is_hidden("#alert")

        page.click("nav a[data-page='nodes']")
        page.wait_for_selector("#page-nodes:not([hidden]) tr[data-gpu]", timeout=WAIT_MS)
        for node in state["nodes"]:
            for gpu in node["gpus"]:
                row = f"tr[data-node='{node['name']}'][data-gpu='{gpu['index']}']"
                assert field_values(page, row, "usedMemoryMiB") == [str(gpu["usedMemoryMiB"])]
                assert field_values(page, row, "usedCores") == [str(gpu["usedCores"])]
                assert field_values(page, row, "usedShares") == [str(gpu["usedShares"])]
        shared = page.inner_text("tr[data-node='a100-0'][data-gpu='0'] [data-field='pods']")
        assert shared.split() == ["research/trainer", "inference/server"]
        assert page.get_attribute("nav a[data-page='nodes']", "aria-current") == "page"
        assert page.is_hidden("#page-overview")

        page.click("nav a[data-page='pods']")
        page.wait_for_selector("#pods-table", timeout=WAIT_MS)
        for assignment in state["assignments"]:
            row = f"tr[data-pod='{assignment['pod']}']"
            running = [d for c in assignment["containers"] for d in c["devices"]]
            assert field_values(page, row, "memoryMiB") == [str(sum(d["memoryMiB"] for d in running))]
            assert field_values(page, row, "cores") == [str(sum(d["cores"] for d in running))]
            assert page.inner_text(f"{row} [data-field='node']") == assignment["node"]
            assert page.inner_text(f"{row} [data-field='usedMemoryMiB']") == "—"
        assert "--prometheus" in page.inner_text("#usage-note")
        page.fill("#pod-filter", "research/")
        assert page.eval_on_selector_all("#pods-table tbody tr", "rows => rows.length") == 2

        page.click("nav a[data-page='queues']")
        page.wait_for_selector("#queues section[data-queue]", timeout=WAIT_MS)
        quota = httpx.get(f"{url}/quota", timeout=10).json()
        for queue in quota["clusterQueues"]:
            for flavor in queue["flavors"]:
                for resource in flavor["resources"]:
                    row = f"tr[data-queue='{queue['name']}'][data-resource='{flavor['flavor']}/{resource['resource']}']"
                    assert page.inner_text(f"{row} [data-field='nominal']").replace(",", "") == str(resource["nominal"])
                    assert page.inner_text(f"{row} [data-field='used']").replace(",", "") == str(resource["used"])
        # tables are semantic: column headers and row headers carry their scope
        assert page.eval_on_selector_all("th:not([scope])", "ths => ths.length") == 0


def test_an_unreachable_extender_is_said_so_on_the_page() -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    with serve(create_app(Upstream(dead, timeout_s=2))) as board, chromium_page() as page:
        page.goto(board)
        page.wait_for_selector("#alert:not([hidden])", timeout=WAIT_MS)
        alert = page.inner_text("#alert")
        assert alert.startswith("The extender is unreachable: cannot reach") and dead in alert
        assert "No data" in page.inner_text("#overview")


@pytest.mark.parametrize("hostile", ['<img src=x onerror="window.pwned=1">', "</td><script>window.pwned=1</script>"])
def test_text_from_the_cluster_stays_text(hostile: str) -> None:
    gpu = {"index": 0, "uuid": "GPU-1", "model": hostile, "healthy": True, "memoryMiB": 100, "usedMemoryMiB": 0,
           "cores": 100, "usedCores": 0, "maxShares": 10, "usedShares": 0}
    state = {"synced": True, "nodes": [{"name": "n0", "gpus": [gpu], "inventoryError": hostile}],
             "assignments": [], "gangs": [{"name": hostile, "waiting": hostile}]}
    with plain_server(200, orjson.dumps(state)) as url, serve(create_app(Upstream(url))) as board, \
            chromium_page() as page:
        page.goto(f"{board}/#nodes")
        page.wait_for_selector("tr[data-gpu]", timeout=WAIT_MS)
        assert hostile in page.inner_text("#nodes")
        assert page.evaluate("window.pwned") is None
        assert page.eval_on_selector_all("#main img, #main script", "found => found.length") == 0
        page.goto(f"{board}/#overview")
        page.wait_for_selector("#pending-table", timeout=WAIT_MS)
        assert re.search(re.escape(hostile), page.inner_text("#pending-table"))
        assert page.evaluate("window.pwned") is None
