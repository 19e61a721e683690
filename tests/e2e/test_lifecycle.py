"""Start-up failures are reported clearly and leave nothing running; `dev-cluster up` / `down` from the command
line stop exactly what was started. Each test starts its own (partial) control plane with real binaries."""

from __future__ import annotations

import dataclasses
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest

from kube_vgpu.dev.devcluster.binaries import ensure_binaries
from kube_vgpu.dev.devcluster.cluster import ClusterOptions, ComponentError, NodeGroup, read_state, up
from kube_vgpu.dev.devcluster.processes import is_running

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def binaries() -> dict[str, Path]:
    return ensure_binaries(progress=lambda message: print(message, file=sys.stderr))


def _options(state_dir: Path, binaries: dict[str, Path], **changes: object) -> ClusterOptions:
    base = ClusterOptions(
        state_dir=state_dir,
        node_groups=(NodeGroup(count=1, gpus=2),),
        die_with_parent=True,
        binaries=tuple((name, str(path)) for name, path in binaries.items()),
        progress=lambda message: None,
    )
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


def _assert_nothing_left(state_dir: Path, spawned: list[int]) -> None:
    assert read_state(state_dir) == [], "state.json still lists processes after a failed start-up"
    alive = [pid for pid in spawned if Path(f"/proc/{pid}").exists() and _not_zombie(pid)]
    assert not alive, f"processes still running after a failed start-up: {alive}"


def _not_zombie(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] not in "ZX"


@pytest.fixture
def spawned(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """PIDs of every process the dev cluster spawns during the test (recorded at spawn time)."""
    from kube_vgpu.dev.devcluster import cluster as cluster_module

    pids: list[int] = []
    original = cluster_module.spawn

    def recording_spawn(*args: object, **kwargs: object) -> object:
        record, process = original(*args, **kwargs)  # type: ignore[arg-type]
        pids.append(record.pid)
        return record, process

    monkeypatch.setattr(cluster_module, "spawn", recording_spawn)
    yield pids


def test_missing_binary_is_named_and_etcd_is_stopped_again(
    tmp_path: Path, binaries: dict[str, Path], spawned: list[int]
) -> None:
    broken = dict(binaries)
    broken["kube-apiserver"] = tmp_path / "no-such-dir" / "kube-apiserver"
    with pytest.raises(ComponentError) as caught:
        up(_options(tmp_path / "state", broken))
    assert caught.value.component == "kube-apiserver"
    assert "binary not found" in str(caught.value) and str(broken["kube-apiserver"]) in str(caught.value)
    assert len(spawned) == 1, "etcd should have been started before the apiserver was found missing"
    _assert_nothing_left(tmp_path / "state", spawned)


def test_port_taken_is_reported_with_the_port_and_everything_is_torn_down(
    tmp_path: Path, binaries: dict[str, Path], spawned: list[int]
) -> None:
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        with pytest.raises(ComponentError) as caught:
            up(_options(tmp_path / "state", binaries, ports=(("kube-apiserver", port),)))
    message = str(caught.value)
    assert caught.value.component == "kube-apiserver"
    assert f"port {port} is already in use" in message, message
    assert "last lines of" in message  # the component's own words come with it
    assert len(spawned) == 2
    _assert_nothing_left(tmp_path / "state", spawned)


def test_apiserver_not_ready_in_time_is_reported_and_everything_is_torn_down(
    tmp_path: Path, binaries: dict[str, Path], spawned: list[int]
) -> None:
    # 0.2 s is far less than any kube-apiserver needs to bootstrap (RBAC roles, priority levels)
    options = _options(tmp_path / "state", binaries, ready_timeouts=(("kube-apiserver", 0.2),))
    with pytest.raises(ComponentError) as caught:
        up(options)
    assert caught.value.component == "kube-apiserver"
    assert "not ready within 0.2 s" in str(caught.value)
    assert "/readyz" in str(caught.value)
    _assert_nothing_left(tmp_path / "state", spawned)


def test_cli_up_detaches_refuses_a_second_up_and_down_stops_exactly_what_up_started(tmp_path: Path) -> None:
    state_dir = tmp_path / "state"
    command = [sys.executable, "-m", "kube_vgpu.cli", "dev-cluster"]
    env = dict(os.environ)
    started = subprocess.run(
        [*command, "up", "--nodes", "2", "--gpus-per-node", "4", "--topology", "pcie", "--state-dir", str(state_dir)],
        capture_output=True, text=True, timeout=300, env=env, check=False,
    )
    records = read_state(state_dir)
    try:
        assert started.returncode == 0, started.stderr
        kubeconfig = state_dir / "kubeconfig"
        assert f"export KUBECONFIG={kubeconfig}" in started.stdout
        # `up` has exited; its processes live on
        assert {r.name for r in records} == {"etcd", "kube-apiserver", "kube-controller-manager", "webhook",
                                            "extender", "kube-scheduler", "heartbeat", "kwok"}
        assert all(is_running(record) for record in records)
        kubectl = ensure_binaries(progress=lambda message: None)["kubectl"]
        nodes = subprocess.run(
            [str(kubectl), "--kubeconfig", str(kubeconfig), "get", "nodes", "-o", "json"],
            capture_output=True, text=True, timeout=60, check=True,
        )
        items = orjson.loads(nodes.stdout)["items"]
        assert sorted(item["metadata"]["name"] for item in items) == ["gpu-node-0", "gpu-node-1"]

        second = subprocess.run([*command, "up", "--state-dir", str(state_dir)], capture_output=True, text=True,
                                timeout=120, check=False)
        assert second.returncode == 1
        assert "already running" in second.stderr
        assert read_state(state_dir) == records, "a refused `up` must not touch the running cluster's records"

        # a process that `up` did not start, in the same state dir, survives `down`
        bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], cwd=state_dir)
        stopped = subprocess.run([*command, "down", "--state-dir", str(state_dir)], capture_output=True, text=True,
                                 timeout=120, check=False)
        assert stopped.returncode == 0, stopped.stderr
        assert not any(is_running(record) for record in records)
        assert bystander.poll() is None
        bystander.kill()
        bystander.wait()
        assert (state_dir / "logs" / "kube-apiserver.log").exists(), "down must not remove the state dir's files"
        again = subprocess.run([*command, "down", "--state-dir", str(state_dir)], capture_output=True, text=True,
                               timeout=60, check=False)
        assert again.returncode == 0 and "nothing was running" in again.stdout
    finally:
        for record in records:  # never leave a detached cluster behind a failed assertion
            if is_running(record):
                os.killpg(record.pid, 9)


def test_starting_over_an_existing_state_dir_gives_a_fresh_cluster(tmp_path: Path, binaries: dict[str, Path]) -> None:
    state_dir = tmp_path / "state"
    options = _options(state_dir, binaries, webhook=False)
    first = up(options)
    try:
        first.core.create_namespace({"metadata": {"name": "leftover"}}, _preload_content=False)
    finally:
        first.stop()
    # a state dir whose cluster was stopped is reused (a running one is refused: see the CLI test)
    second = up(options)
    try:
        names = {ns.metadata.name for ns in second.core.list_namespace().items}
        assert "leftover" not in names
    finally:
        second.stop()
