"""The device plugin's /metrics over real HTTP: the values equal what the fake NVML and the shared-region files
say, names follow Prometheus' conventions, and a corrupt region is skipped with one log line."""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from kube_vgpu.deviceplugin.allocate import DeliveryConfig
from kube_vgpu.deviceplugin.app import DevicePluginApp, PluginConfig
from kube_vgpu.deviceplugin.fakenvml import FakeNvml, FakeUsage, load_profile
from kube_vgpu.deviceplugin.nvml import Nvml
from tests.deviceplugin.builders import wait_until
from tests.deviceplugin.kubelet import KubeletStandIn
from tests.deviceplugin.regionfiles import Process, Region
from tests.servers import free_port

NODE = "gpu-node-m"
GIB = 1024**3
MIB = 1024**2


def scrape(port: int) -> dict[str, list[Sample]]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        assert response.headers["Content-Type"].startswith("text/plain")
        text = response.read().decode()
    families: dict[str, list[Sample]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            families.setdefault(sample.name, []).append(sample)
    return families


def values(samples: list[Sample], *keys: str) -> dict[tuple[str, ...], float]:
    return {tuple(sample.labels[key] for key in keys): sample.value for sample in samples}


@pytest.fixture
def app_and_fake(kubelet: KubeletStandIn, tmp_path: Path) -> tuple[DevicePluginApp, FakeNvml, Path]:
    cache = tmp_path / "containers"
    cache.mkdir()
    fake = FakeNvml(load_profile("t4-4-pcie", NODE))
    config = PluginConfig(
        node_name=NODE,
        kubelet_dir=str(kubelet.directory),
        kubelet_poll_seconds=0.05,
        health_event_wait_ms=50,
        probe_address="127.0.0.1:0",
        metrics_address=f"127.0.0.1:{free_port()}",
        kubelet_pods_dir=str(tmp_path / "kubelet-pods"),
        delivery=DeliveryConfig(limiter_library_path="", cache_host_dir=str(cache)),
    )
    return DevicePluginApp(config, Nvml(fake), None), fake, cache


def test_gpu_metrics_equal_the_fake_nvml(app_and_fake: tuple[DevicePluginApp, FakeNvml, Path]) -> None:
    app, fake, _ = app_and_fake
    fake.set_usage(1, FakeUsage(utilization_percent=87, memory_utilization_percent=40, memory_used_mib=9000,
                                temperature_c=71, power_mw=65_500, ecc_corrected=3, ecc_uncorrected=1))
    app.start()
    try:
        port = app.metrics_port
        assert port is not None and port != app.probe_port
        wait_until(app.health.ready.is_set, "XID event registration")
        fake.inject_xid(2, 79)
        fake.inject_xid(2, 13)  # application-level: counted, GPU stays healthy
        wait_until(lambda: "kube_vgpu_gpu_xid_errors_total" in scrape(port), "the XID counter")
        metrics = scrape(port)
    finally:
        app.stop()
    uuids = [gpu.uuid for gpu in app.state.gpus()]
    one = (NODE, "1", uuids[1], "Tesla T4")
    labels = ("node", "gpu", "uuid", "model")
    assert values(metrics["kube_vgpu_gpu_utilization_ratio"], *labels)[one] == 0.87
    assert values(metrics["kube_vgpu_gpu_memory_utilization_ratio"], *labels)[one] == 0.40
    assert values(metrics["kube_vgpu_gpu_memory_used_bytes"], *labels)[one] == 9000 * MIB
    assert values(metrics["kube_vgpu_gpu_memory_total_bytes"], *labels) == {
        (NODE, str(i), uuid, "Tesla T4"): 15360 * MIB for i, uuid in enumerate(uuids)
    }
    assert values(metrics["kube_vgpu_gpu_temperature_celsius"], *labels)[one] == 71
    assert values(metrics["kube_vgpu_gpu_power_watts"], *labels)[one] == 65.5
    ecc = values(metrics["kube_vgpu_gpu_ecc_errors_total"], "uuid", "type")
    assert ecc[(uuids[1], "corrected")] == 3 and ecc[(uuids[1], "uncorrected")] == 1
    assert ecc[(uuids[0], "corrected")] == 0
    assert values(metrics["kube_vgpu_gpu_xid_errors_total"], "gpu", "uuid", "xid") == {
        ("2", uuids[2], "79"): 1, ("2", uuids[2], "13"): 1
    }
    # an idle GPU reads as idle, not as missing
    zero = (NODE, "0", uuids[0], "Tesla T4")
    assert values(metrics["kube_vgpu_gpu_utilization_ratio"], *labels)[zero] == 0


def test_container_use_from_the_shared_regions_and_a_corrupt_one_skipped(
    app_and_fake: tuple[DevicePluginApp, FakeNvml, Path], caplog: pytest.LogCaptureFixture
) -> None:
    app, _, cache = app_and_fake
    pods = cache.parent / "kubelet-pods"
    uuids = [gpu.uuid for gpu in app.state.gpus()]
    Region(
        uuids=[uuids[0], uuids[3]],
        limits_bytes=[4 * GIB, 4 * GIB],
        sm_limits=[25, 25],
        processes=[Process(10, [GIB, 2 * GIB], [20, 5]), Process(11, [512 * MIB, 0], [3, 0])],
    ).write(cache, "pod-uid-1", "trainer")
    Region(uuids=[uuids[0]], limits_bytes=[2 * GIB], sm_limits=[0], minor=1).write(cache, "pod-uid-2", "idle")
    corrupt = Region(uuids=[uuids[1]], limits_bytes=[GIB], sm_limits=[10], major=7).write(cache, "pod-uid-3", "odd")
    # the webhook's layout, through kubelet's pods directory
    Region(uuids=[uuids[2]], limits_bytes=[3 * GIB], sm_limits=[50], processes=[Process(5, [GIB], [40])]
           ).write_pod_volume(pods, "pod-uid-4", "server")
    app.start()
    try:
        port = app.metrics_port
        assert port is not None
        with caplog.at_level(logging.WARNING, logger="kube_vgpu.deviceplugin.metrics"):
            metrics = scrape(port)
            scrape(port)  # the same skip is logged once, not at every scrape
    finally:
        app.stop()
    keys = ("pod_uid", "container", "uuid")
    assert values(metrics["kube_vgpu_container_gpu_memory_used_bytes"], *keys) == {
        ("pod-uid-1", "trainer", uuids[0]): GIB + 512 * MIB,
        ("pod-uid-1", "trainer", uuids[3]): 2 * GIB,
        ("pod-uid-2", "idle", uuids[0]): 0,
        ("pod-uid-4", "server", uuids[2]): GIB,
    }
    assert values(metrics["kube_vgpu_container_gpu_memory_limit_bytes"], *keys)[("pod-uid-2", "idle", uuids[0])] == (
        2 * GIB
    )
    utilization = values(metrics["kube_vgpu_container_gpu_utilization_ratio"], *keys)
    assert utilization[("pod-uid-1", "trainer", uuids[0])] == pytest.approx(0.23)
    assert values(metrics["kube_vgpu_container_gpu_core_limit_ratio"], *keys)[("pod-uid-1", "trainer", uuids[3])] == (
        0.25
    )
    assert values(metrics["kube_vgpu_container_gpu_processes"], "pod_uid", "container") == {
        ("pod-uid-1", "trainer"): 2, ("pod-uid-2", "idle"): 0, ("pod-uid-4", "server"): 1
    }
    assert values(metrics["kube_vgpu_shared_regions"], "result") == {("read",): 3, ("skipped",): 1}
    skips = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert skips == [f"limiter shared region {corrupt} skipped: region version 7.2 is not one this reader knows "
                     "(1.1, 1.2)"]


def test_unsupported_nvml_queries_are_left_out_and_logged_once(
    kubelet: KubeletStandIn, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    profile = tmp_path / "gpus.json"
    profile.write_text('{"gpus": [{"name": "NVIDIA L4", "memoryMiB": 23034, "nvlinkMax": 0,'
                       ' "unsupported": ["nvmlDeviceGetTotalEccErrors", "nvmlDeviceGetPowerUsage"],'
                       ' "usage": {"temperatureC": 44}}]}')
    config = PluginConfig(node_name=NODE, kubelet_dir=str(kubelet.directory), probe_address="127.0.0.1:0",
                          metrics_address="127.0.0.1:0", delivery=DeliveryConfig(limiter_library_path="",
                                                                                  cache_host_dir=""))
    app = DevicePluginApp(config, Nvml(FakeNvml(load_profile(f"from-file:{profile}", NODE))), None)
    app.start()
    try:
        port = app.metrics_port
        assert port is not None and port == app.probe_port  # one listener serves the probes and /metrics
        with caplog.at_level(logging.WARNING, logger="kube_vgpu.deviceplugin.metrics"):
            metrics = scrape(port)
            scrape(port)
    finally:
        app.stop()
    assert [s.value for s in metrics["kube_vgpu_gpu_temperature_celsius"]] == [44]
    assert "kube_vgpu_gpu_power_watts" not in metrics and "kube_vgpu_gpu_ecc_errors_total" not in metrics
    assert "kube_vgpu_container_gpu_memory_used_bytes" not in metrics  # no cache directory configured
    logged = sorted(r.getMessage().split(" not available")[0] for r in caplog.records)
    uuid = app.state.gpus()[0].uuid
    assert logged == [f"GPU {uuid}: corrected ECC errors", f"GPU {uuid}: power", f"GPU {uuid}: uncorrected ECC errors"]


# Prometheus' naming rules (https://prometheus.io/docs/practices/naming/), as `promtool check metrics` applies them
UNIT_SUFFIXES = ("_bytes", "_celsius", "_watts", "_ratio", "_seconds", "_total")
UNITLESS_COUNTS = {"kube_vgpu_container_gpu_processes", "kube_vgpu_shared_regions"}


def test_metric_names_follow_prometheus_conventions(app_and_fake: tuple[DevicePluginApp, FakeNvml, Path]) -> None:
    app, fake, cache = app_and_fake
    Region(uuids=[app.state.gpus()[0].uuid], limits_bytes=[GIB], sm_limits=[50]).write(cache, "u", "c")
    app.start()
    try:
        wait_until(app.health.ready.is_set, "XID event registration")
        fake.inject_xid(0, 48)
        port = app.metrics_port
        assert port is not None
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
            text = response.read().decode()
        wait_until(lambda: "kube_vgpu_gpu_xid_errors_total" in scrape(port), "the XID counter")
    finally:
        app.stop()
    families = list(text_string_to_metric_families(text))
    assert len(families) >= 14
    for family in families:
        assert re.fullmatch(r"kube_vgpu_[a-z0-9_]+", family.name), family.name
        assert family.documentation, family.name
        if family.type == "counter":
            assert all(s.name.endswith(("_total", "_created")) for s in family.samples), family.name
        else:
            assert family.name.endswith(UNIT_SUFFIXES) or family.name in UNITLESS_COUNTS, family.name
            assert not family.name.endswith("_total"), family.name
        for sample in family.samples:
            assert all(re.fullmatch(r"[a-z_][a-z0-9_]*", label) for label in sample.labels), sample


def test_the_device_plugin_process_serves_metrics_beside_its_probes(kubelet: KubeletStandIn) -> None:
    """`kube-vgpu device-plugin` as a process: without --metrics-address, /metrics is on the probe listener."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("KUBERNETES_SERVICE_HOST", "NODE_NAME")}
    process = subprocess.Popen(
        [sys.executable, "-m", "kube_vgpu.cli", "device-plugin", "--node-name", "box", "--fake-nvml", "t4-4-pcie",
         "--kubelet-dir", str(kubelet.directory), "--probe-address", f"127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
    )
    try:
        def scraped() -> dict[str, list[Sample]] | None:
            try:
                return scrape(port)
            except OSError:
                return None

        metrics = wait_until(scraped, "the plugin process's /metrics")
        assert len(metrics["kube_vgpu_gpu_memory_total_bytes"]) == 4
        assert {s.labels["node"] for s in metrics["kube_vgpu_gpu_temperature_celsius"]} == {"box"}
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)


def test_cli_refuses_a_bad_metrics_address(short_dir: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "kube_vgpu.cli", "device-plugin", "--node-name", "n", "--fake-nvml", "t4-4-pcie",
         "--kubelet-dir", str(short_dir), "--metrics-address", "localhost"],
        capture_output=True, timeout=60,
    )
    assert result.returncode == 2
    assert b"--metrics-address: expected HOST:PORT or :PORT, got 'localhost'" in result.stderr


@pytest.mark.parametrize(
    ("usage", "message"),
    [
        ('{"temperature": 40}', "unknown usage keys ['temperature']; choose from utilizationPercent"),
        ('{"powerMilliwatts": -1}', "usage.powerMilliwatts must be a non-negative integer, got -1"),
        ('{"eccCorrected": true}', "usage.eccCorrected must be a non-negative integer, got True"),
        ('[1]', "usage must be an object, got [1]"),
    ],
)
def test_a_fake_profile_with_bad_usage_is_refused(tmp_path: Path, usage: str, message: str) -> None:
    profile = tmp_path / "gpus.json"
    profile.write_text(f'{{"gpus": [{{"name": "NVIDIA L4", "memoryMiB": 23034, "usage": {usage}}}]}}')
    with pytest.raises(ValueError, match="gpus\\[0\\]") as caught:
        load_profile(f"from-file:{profile}", NODE)
    assert message in str(caught.value)
