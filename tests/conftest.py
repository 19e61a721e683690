"""Suite-wide options.

`--pause-after-collection=SECONDS` sleeps between collection and the first test: it proves that no test depends on
how much wall-clock time passed since its module was imported (a first run on a fresh machine spends many minutes
building the Kubernetes binaries inside the end-to-end session fixture, after collection). Anything built at import
or collection time with a timestamp of "now" (a node's heartbeat, a bind time, a TTL) must not go stale meanwhile.
"""

from __future__ import annotations

import argparse
import time

import pytest


def _seconds(text: str) -> float:
    """A pause that cannot silently do nothing: "-5" or "nan" would skip the sleep and prove nothing."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value >= 0:  # also refuses NaN
        raise argparse.ArgumentTypeError(f"{text!r} must be >= 0 seconds")
    return value


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--pause-after-collection",
        type=_seconds,
        default=0.0,
        metavar="SECONDS",
        help="sleep this long after collection, before the first test (proves no test depends on elapsed time)",
    )


def pytest_collection_finish(session: pytest.Session) -> None:
    pause_s: float = session.config.getoption("--pause-after-collection")
    if pause_s > 0 and not session.config.option.collectonly:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(f"pausing {pause_s:.0f} s after collection (--pause-after-collection)")
        time.sleep(pause_s)
