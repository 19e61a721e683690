"""Screenshots of the dashboard's pages for the docs (docs/dashboard/*.png), taken in Debian's chromium:

    python -m kube_vgpu.dev.screenshots [--out docs/dashboard] [--chromium /usr/bin/chromium]

A small populated cluster, all real parts: a snapshot-mode extender (the example Kueue queues of
manifests/examples/kueue) with three A100 nodes, a T4 node and a MIG node, a few pods bound, and one pod filtered
against a queue it does not fit (so the queues page has a pending pod); the dashboard reads it over HTTP, as it would
in a cluster. Needs the dev extra's `playwright` package (its Python API only: no browser is downloaded).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from importlib import resources
from pathlib import Path
from typing import Any

import uvicorn

from kube_vgpu import protocol
from kube_vgpu.dev.fixtures import gpu_node, gpu_pod_object, node_object, scheduled_pod, synth_uuid
from kube_vgpu.deviceplugin.discovery import discover
from kube_vgpu.deviceplugin.fakenvml import PROFILES, FakeNvml
from kube_vgpu.deviceplugin.nvml import Nvml

PAGES = ("overview", "nodes", "pods", "queues")
MAX_PNG_BYTES = 200 * 1024
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
NOW = dt.datetime(2026, 11, 1, 12, 0, 0, tzinfo=dt.UTC)


def bound_pod(name: str, namespace: str, node: str, shares: list[tuple[int, int, int]], queue: str) -> dict[str, Any]:
    """A running pod as our bind leaves it: assignment and queue annotations. `shares`: (GPU index, MiB, cores)."""
    devices = tuple(protocol.DeviceShare(synth_uuid(node, index), memory, cores) for index, memory, cores in shares)
    assignment = protocol.PodAssignment(node, (protocol.ContainerAssignment("main", devices),))
    pod = gpu_pod_object(name, namespace=namespace, gpus=len(shares), memory_mib=shares[0][1], cores=shares[0][2],
                         node_name=node, assignment=assignment)
    pod["metadata"]["labels"] = {protocol.LABEL_KUEUE_QUEUE_NAME: queue}
    pod["metadata"]["annotations"][protocol.POD_BIND_TIME_ANNOTATION] = protocol.format_bind_time(NOW)
    pod["metadata"]["annotations"][protocol.POD_QUEUE_ANNOTATION] = queue
    return pod


def cluster_items() -> list[dict[str, Any]]:
    mig = discover(Nvml(FakeNvml(PROFILES["a100-mig"]("mig-0"))), sharing_count=protocol.DEFAULT_MAX_VGPUS_PER_GPU)
    return [
        gpu_node("a100-0", gpus=4, memory_mib=81920, heartbeat=NOW),
        node_object("mig-0", mig.inventory, heartbeat=NOW),  # second: in the nodes page's screenshot
        gpu_node("a100-1", gpus=4, memory_mib=81920, heartbeat=NOW),
        gpu_node("a100-2", gpus=4, memory_mib=81920, heartbeat=NOW),
        gpu_node("t4-0", gpus=2, model="Tesla-T4", memory_mib=15360, topology="pcie", heartbeat=NOW),
        bound_pod("trainer-0", "research", "a100-0", [(0, 40960, 50), (1, 40960, 50)], "research-queue"),
        bound_pod("notebook-ana", "research", "a100-0", [(0, 20480, 25)], "research-queue"),
        bound_pod("llm-serve-0", "inference", "a100-1", [(0, 30720, 40)], "inference-queue"),
        bound_pod("llm-serve-1", "inference", "a100-1", [(0, 30720, 40)], "inference-queue"),
        bound_pod("etl-nightly", "production", "a100-1", [(2, 81920, 100)], "production-queue"),
        bound_pod("resnet-eval", "research", "a100-1", [(3, 70000, 10)], "research-queue"),
    ]


@contextmanager
def serve(app: Any) -> Iterator[str]:
    """`app` on a free loopback port, in a thread, until the block ends."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


def post(url: str, doc: Any) -> Any:
    request = urllib.request.Request(url, data=json.dumps(doc).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as reply:
        return json.loads(reply.read())


def take(out: Path, chromium: str) -> list[Path]:
    from playwright.sync_api import sync_playwright

    from kube_vgpu.extender.cli import build, parse_args
    from kube_vgpu.extender.dashboard.server import Upstream, create_app

    quota = resources.files("kube_vgpu").joinpath("manifests", "examples", "kueue", "quota.yaml")
    written: list[Path] = []
    with tempfile.TemporaryDirectory() as tmp:
        snapshot = Path(tmp) / "snapshot.json"
        snapshot.write_text(json.dumps({"apiVersion": "v1", "kind": "List", "items": cluster_items()}))
        extender = build(parse_args(["--snapshot", str(snapshot), "--quota-config", str(quota)]),
                         clock=lambda: NOW.timestamp() + 12)
        with serve(extender.app) as extender_url, serve(create_app(Upstream(extender_url))) as board:
            # fits idle a100-2, but more memory than its queue may borrow: pending, with the gate's reason
            big = scheduled_pod("finetune-70b", gpus=4, memory_mib=81920, cores=100, namespace="research",
                                labels={protocol.LABEL_KUEUE_QUEUE_NAME: "research-queue"})
            post(f"{extender_url}/filter", {"Pod": big, "NodeNames": ["a100-0", "a100-1", "a100-2"]})
            with sync_playwright() as playwright:
                browser = playwright.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
                page = browser.new_page(viewport={"width": 1200, "height": 820})
                page.goto(board)
                page.wait_for_selector("#overview dd[data-field='usedMemoryMiB']", timeout=15_000)
                for name in PAGES:
                    page.click(f"nav a[data-page='{name}']")
                    page.wait_for_selector(f"#page-{name}:not([hidden])", timeout=5_000)
                    path = out / f"{name}.png"
                    # the nodes page is long: its first screen (an A100 node and the MIG node) stays under the size
                    page.set_viewport_size({"width": 1200, "height": 1150 if name == "nodes" else 820})
                    page.screenshot(path=str(path), full_page=name != "nodes")
                    written.append(path)
                browser.close()
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kube_vgpu.dev.screenshots", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("docs/dashboard"))
    parser.add_argument("--chromium", default="/usr/bin/chromium")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    too_big = []
    for path in take(args.out, args.chromium):
        size = path.stat().st_size
        print(f"{path} {size // 1024} KiB")
        if size > MAX_PNG_BYTES:
            too_big.append(path)
    if too_big:
        print(f"over {MAX_PNG_BYTES // 1024} KiB: {', '.join(map(str, too_big))}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
