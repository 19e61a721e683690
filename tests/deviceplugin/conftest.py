from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.deviceplugin.kubelet import KubeletStandIn


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """Unix socket paths are limited to ~107 bytes; pytest's tmp_path can be longer."""
    path = Path(tempfile.mkdtemp(prefix="kvdp-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def kubelet(short_dir: Path) -> Iterator[KubeletStandIn]:
    stand_in = KubeletStandIn(short_dir / "device-plugins")
    stand_in.start()
    yield stand_in
    stand_in.stop()
