"""`kube-vgpu top nodes|gpus|pods` against a real extender over HTTP (snapshot mode), and what it says when the
address is not an extender."""

from __future__ import annotations

import http.server
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import orjson
import pytest

from kube_vgpu.cli import main as kube_vgpu_main
from kube_vgpu.extender.top import StateFormatError, parse_state
from tests.extender.test_usage_metrics import BOUND_AT, T0, bound_pod, serve_extender
from tests.helpers import gpu_node, pod
from tests.servers import free_port, serve_handler


@pytest.fixture()
def url(tmp_path: Path) -> Iterator[str]:
    items = [
        gpu_node("a100-0", gpus=4, memory_mib=81920, heartbeat=BOUND_AT),
        gpu_node("a100-1", gpus=4, memory_mib=81920, heartbeat=BOUND_AT),
        bound_pod("trainer", "research", "a100-0", [(0, 40960, 50), (1, 40960, 50)], queue="research-queue"),
        bound_pod("server", "inference", "a100-0", [(0, 20480, 25)], queue="inference-queue"),
        bound_pod("batch", "production", "a100-1", [(2, 81920, 100)], queue="production-queue"),
    ]
    path = tmp_path / "snapshot.json"
    path.write_bytes(orjson.dumps({"apiVersion": "v1", "kind": "List", "items": items}))
    with serve_extender(path, lambda: T0 + 30) as base:
        # and one bound through the extender's own filter and bind
        fresh = pod("fresh", gpus=1, memory_mib=8192, cores=20, namespace="research")
        reply = httpx.post(f"{base}/filter", json={"Pod": fresh, "NodeNames": ["a100-1"]}, timeout=10).json()
        assert reply["NodeNames"] == ["a100-1"]
        meta = fresh["metadata"]
        assert httpx.post(f"{base}/bind", json={"PodName": "fresh", "PodNamespace": "research", "PodUID": meta["uid"],
                                                "Node": "a100-1"}, timeout=10).json() == {"Error": ""}
        yield base


def top(capsys: pytest.CaptureFixture[str], *words: str) -> list[list[str]]:
    assert kube_vgpu_main(["top", *words]) == 0
    return [line.split() for line in capsys.readouterr().out.splitlines()]


def test_nodes(url: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert top(capsys, "nodes", "--extender-url", url) == [
        ["NODE", "GPUS", "UNHEALTHY", "MEMORY(MiB)", "MEMORY%", "CORES%", "VGPUS", "PODS", "HEARTBEAT"],
        ["a100-0", "4", "0", "102400/327680", "31%", "31%", "3/40", "2", "30s"],
        ["a100-1", "4", "0", "90112/327680", "27%", "30%", "2/40", "2", "30s"],
    ]
    # the most compute assigned first
    assert [row[0] for row in top(capsys, "nodes", "--extender-url", url, "--sort-by", "cores")[1:]] == [
        "a100-0", "a100-1"]


def test_gpus_with_the_pods_sharing_each(url: str, capsys: pytest.CaptureFixture[str]) -> None:
    rows = top(capsys, "gpus", "--extender-url", url)
    assert rows[0] == ["NODE", "GPU", "MODEL", "HEALTH", "MEMORY(MiB)", "MEMORY%", "CORES%", "VGPUS", "PODS"]
    assert rows[1] == ["a100-0", "0", "NVIDIA-A100-SXM4-80GB", "ok", "61440/81920", "75%", "75%", "2/10",
                       "research/trainer,inference/server"]
    assert rows[3] == ["a100-0", "2", "NVIDIA-A100-SXM4-80GB", "ok", "0/81920", "0%", "0%", "0/10", "-"]
    assert len(rows) == 9
    one_node = top(capsys, "gpus", "--extender-url", url, "--node", "a100-1", "--sort-by", "memory")
    assert [(row[1], row[-1]) for row in one_node[1:]] == [
        ("2", "production/batch"), ("0", "research/fresh"), ("1", "-"), ("3", "-")]
    assert top(capsys, "gpus", "--extender-url", url, "--node", "nope") == [["no", "GPUs", "on", "node", "nope"]]


def test_pods(url: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert top(capsys, "pods", "--extender-url", url) == [
        ["NAMESPACE", "POD", "NODE", "GPUS", "VGPUS", "MEMORY(MiB)", "CORES", "STATE"],
        ["inference", "server", "a100-0", "0", "1", "20480", "25%", "bound"],
        ["production", "batch", "a100-1", "2", "1", "81920", "100%", "bound"],
        ["research", "fresh", "a100-1", "0", "1", "8192", "20%", "bound"],
        ["research", "trainer", "a100-0", "0,1", "2", "81920", "100%", "bound"],
    ]
    research = top(capsys, "pods", "--extender-url", url, "-n", "research", "--sort-by", "memory")
    assert [row[1] for row in research[1:]] == ["trainer", "fresh"]
    assert top(capsys, "pods", "--extender-url", url, "-n", "nobody") == [
        ["no", "pods", "hold", "GPUs", "in", "namespace", "nobody"]]


@contextmanager
def plain_server(status: int, body: bytes) -> Iterator[str]:
    """A real HTTP server that is not an extender: answers every GET with `status` and `body`."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            return

    with serve_handler(Handler) as url:
        yield url


@pytest.mark.parametrize(
    ("status", "body", "message"),
    [
        (404, b"not found", "/state answered 404: not found"),
        (200, b"<html>hello</html>", "cannot read http://127.0.0.1:"),
        (200, b'{"nodes": {}, "assignments": []}', "is not an extender's state: state.nodes is {}, expected list"),
        (200, b'{"nodes": [{"name": "n", "gpus": [{"index": "0"}]}], "assignments": []}',
         "state.nodes[0].gpus[0].index is '0', expected int"),
        (200, b"[1, 2]", "state is not an object"),
    ],
)
def test_what_is_not_an_extender_gets_a_clear_error(
    status: int, body: bytes, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with plain_server(status, body) as base:
        assert kube_vgpu_main(["top", "nodes", "--extender-url", base]) == 1
    err = capsys.readouterr().err
    assert err.startswith("kube-vgpu top: ") and message in err


def test_unreachable_extender(capsys: pytest.CaptureFixture[str]) -> None:
    assert kube_vgpu_main(["top", "pods", "--extender-url", f"http://127.0.0.1:{free_port()}",
                           "--timeout-seconds", "5"]) == 1
    assert "kube-vgpu top: cannot read http://127.0.0.1:" in capsys.readouterr().err


def test_parse_state_refuses_booleans_for_numbers() -> None:
    doc = {"nodes": [{"name": "n", "gpus": [{"index": True}]}], "assignments": []}
    with pytest.raises(StateFormatError, match=r"state.nodes\[0\].gpus\[0\].index is True, expected a number"):
        parse_state(doc)
