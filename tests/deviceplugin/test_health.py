"""XID events and lost GPUs through the fake NVML's event API."""

from __future__ import annotations

import pytest

from kube_vgpu.deviceplugin.discovery import discover
from kube_vgpu.deviceplugin.fakenvml import FakeHandle, FakeNvml, load_profile
from kube_vgpu.deviceplugin.health import APPLICATION_XIDS, HealthMonitor
from kube_vgpu.deviceplugin.nvml import EVENT_XID_CRITICAL_ERROR, Nvml
from kube_vgpu.deviceplugin.state import DeviceState
from tests.deviceplugin.builders import wait_until


@pytest.fixture
def setup() -> tuple[FakeNvml, DeviceState, HealthMonitor]:
    fake = FakeNvml(load_profile("t4-4-pcie", "n1"))
    nvml = Nvml(fake)
    discovery = discover(nvml)
    state = DeviceState(discovery.inventory)
    monitor = HealthMonitor(nvml, state, discovery.handles, poll_seconds=0.05, event_wait_ms=50)
    return fake, state, monitor


def test_critical_xid_marks_the_gpu_unhealthy_and_application_xids_do_not(
    setup: tuple[FakeNvml, DeviceState, HealthMonitor],
) -> None:
    fake, state, monitor = setup
    monitor.start()
    try:
        wait_until(monitor.ready.is_set, "event registration")
        for xid in sorted(APPLICATION_XIDS):
            fake.inject_xid(1, xid)
        fake.inject_xid(2, 79)  # fallen off the bus
        wait_until(lambda: not state.is_healthy(state.uuids()[2]), "GPU 2 unhealthy after XID 79")
        # events are handled in order: the application XIDs on GPU 1 came first and changed nothing
        assert state.is_healthy(state.uuids()[1])
        assert state.unhealthy_reasons() == {state.uuids()[2]: "critical XID 79"}
    finally:
        monitor.stop()


def test_a_lost_gpu_is_noticed_by_the_poll(setup: tuple[FakeNvml, DeviceState, HealthMonitor]) -> None:
    fake, state, monitor = setup
    monitor.start()
    try:
        fake.lose_gpu(3)
        wait_until(lambda: not state.is_healthy(state.uuids()[3]), "GPU 3 unhealthy after it was lost")
    finally:
        monitor.stop()
    assert [d.healthy for d in state.advertised() if d.uuid == state.uuids()[3]] == [False] * 10


def test_an_xid_from_an_unidentified_gpu_distrusts_them_all(setup: tuple[FakeNvml, DeviceState, HealthMonitor]) -> None:
    _fake, state, monitor = setup

    class Event:
        device = FakeHandle(99)
        eventType = EVENT_XID_CRITICAL_ERROR
        eventData = 48

    monitor.handle_event(Event())
    assert not any(state.is_healthy(uuid) for uuid in state.uuids())


def test_without_event_support_lost_gpus_are_still_seen() -> None:
    hardware = load_profile("t4-4-pcie", "n1")
    fake = FakeNvml(hardware.__class__(gpus=hardware.gpus, missing_functions=frozenset({"nvmlEventSetCreate"})))
    nvml = Nvml(fake)
    discovery = discover(nvml)
    state = DeviceState(discovery.inventory)
    monitor = HealthMonitor(nvml, state, discovery.handles, poll_seconds=0.05)
    monitor.start()
    try:
        fake.lose_gpu(0)
        wait_until(lambda: not state.is_healthy(state.uuids()[0]), "lost GPU seen without events")
    finally:
        monitor.stop()
