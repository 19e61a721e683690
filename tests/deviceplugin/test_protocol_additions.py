"""The protocol additions the device plugin and the extender share (bind time, allocation record)."""

from __future__ import annotations

import datetime as dt

import pytest

from kube_vgpu import protocol


def test_bind_time_keeps_microseconds_and_reads_whole_seconds() -> None:
    moment = dt.datetime(2026, 1, 31, 12, 0, 0, 123456, tzinfo=dt.UTC)
    text = protocol.format_bind_time(moment)
    assert text == "2026-01-31T12:00:00.123456Z"
    assert protocol.parse_bind_time(text) == moment.timestamp()
    assert protocol.parse_bind_time("2026-01-31T12:00:00Z") == moment.replace(microsecond=0).timestamp()
    later = protocol.format_bind_time(moment + dt.timedelta(microseconds=1))
    assert protocol.parse_bind_time(later) > protocol.parse_bind_time(text)
    with pytest.raises(protocol.ProtocolError, match="bind time"):
        protocol.parse_bind_time("yesterday")


def test_allocation_record_round_trips_deterministically() -> None:
    text = protocol.encode_allocation({"b": ("GPU-2::0",), "a": ["GPU-1::3", "GPU-1::4"]})
    assert text == '{"v":1,"containers":{"a":["GPU-1::3","GPU-1::4"],"b":["GPU-2::0"]}}'
    assert protocol.decode_allocation(text) == {"a": ("GPU-1::3", "GPU-1::4"), "b": ("GPU-2::0",)}
    for bad in ("[]", '{"v":2,"containers":{}}', '{"v":1,"containers":{"a":[1]}}', "{"):
        with pytest.raises(protocol.ProtocolError):
            protocol.decode_allocation(bad)


def test_inventory_external_field_is_validated() -> None:
    with pytest.raises(protocol.ProtocolError, match="external"):
        protocol.decode_inventory(
            '{"v":1,"gpus":[{"uuid":"GPU-1","index":0,"model":"m","memoryMiB":1,"cores":100,"maxShares":1,'
            '"numa":null,"pciBusId":"","healthy":true,"mig":false,"links":[],"external":"ns/p"}]}'
        )
