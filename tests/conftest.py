"""Suite-wide options.

`--pause-after-collection=SECONDS` sleeps between collection and the first test: it proves that no test depends on
how much wall-clock time passed since its module was imported (a first run on a fresh machine spends many minutes
building the Kubernetes binaries inside the end-to-end session fixture, after collection). Anything built at import
or collection time with a timestamp of "now" (a node's heartbeat, a bind time, a TTL) must not go stale meanwhile.
"""

from __future__ import annotations

import time

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--pause-after-collection",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="sleep this long after collection, before the first test (proves no test depends on elapsed time)",
    )


def pytest_collection_finish(session: pytest.Session) -> None:
    pause_s: float = session.config.getoption("--pause-after-collection")
    if pause_s > 0:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(f"pausing {pause_s:.0f} s after collection (--pause-after-collection)")
        time.sleep(pause_s)
