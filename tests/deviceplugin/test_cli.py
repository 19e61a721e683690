"""`kube-vgpu device-plugin` as a process: serves kubelet without a cluster and logs the inventory once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from kube_vgpu import protocol
from tests.deviceplugin.kubelet import KubeletStandIn


def _command(*args: str) -> list[str]:
    return [sys.executable, "-m", "kube_vgpu.cli", "device-plugin", *args]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("KUBERNETES_SERVICE_HOST", "NODE_NAME")}
    env["PYTHONUNBUFFERED"] = "1"
    return env


def test_runs_without_a_cluster_and_stops_on_sigterm(kubelet: KubeletStandIn, short_dir: Path) -> None:
    log_path = short_dir / "plugin.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            _command(
                "--node-name",
                "bare-gpu-box",
                "--fake-nvml",
                "t4-4-pcie",
                "--kubelet-dir",
                str(kubelet.directory),
                "--sharing-count",
                "2",
                "--probe-address",
                "",
            ),
            stdout=log,
            stderr=subprocess.STDOUT,
            env=_env(),
        )
        try:
            connection = kubelet.plugin()
            devices = kubelet.wait_for_devices(connection, lambda d: len(d) == 8, "8 devices from the CLI plugin")
            assert {d.health for d in devices} == {"Healthy"}
            process.send_signal(signal.SIGTERM)
            assert process.wait(timeout=30) == 0
        finally:
            if process.poll() is None:
                process.kill()
                process.wait(10)
    output = log_path.read_text()
    assert "inventory publishing is off" in output
    inventory_lines = [line for line in output.splitlines() if '{"v":1,"gpus":' in line]
    assert len(inventory_lines) == 1  # logged once
    inventory = protocol.decode_inventory(inventory_lines[0][inventory_lines[0].index('{"v":1') :])
    assert [g.model for g in inventory.gpus] == ["Tesla T4"] * 4
    assert not (kubelet.directory / "kube-vgpu-nvidia-gpu.sock").exists()  # cleaned up on exit


def test_bad_arguments_exit_2(short_dir: Path) -> None:
    missing_node = subprocess.run(_command("--fake-nvml", "t4-4-pcie"), capture_output=True, env=_env(), timeout=60)
    assert missing_node.returncode == 2
    assert b"--node-name" in missing_node.stderr
    bad_profile = subprocess.run(
        _command("--node-name", "n", "--fake-nvml", "nope", "--kubelet-dir", str(short_dir)),
        capture_output=True,
        env=_env(),
        timeout=60,
    )
    assert bad_profile.returncode == 2
    assert b"unknown fake NVML profile 'nope'" in bad_profile.stderr
