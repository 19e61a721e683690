"""The suite's pytest settings do what they promise, proven by running pytest on a small suite with them."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

THREADED_TESTS = """
import threading


def run_in_thread(work):
    thread = threading.Thread(target=work)
    thread.start()
    thread.join()


def test_worker_thread_fails():
    def work():
        assert 1 + 1 == 3, "the worker saw a wrong value"

    run_in_thread(work)


def test_worker_thread_succeeds():
    run_in_thread(lambda: None)
"""


def _our_filterwarnings() -> list[str]:
    options = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    filters = options["filterwarnings"]
    assert isinstance(filters, list)
    return [str(item) for item in filters]


def test_an_assertion_failing_in_a_worker_thread_fails_the_test(pytester: pytest.Pytester) -> None:
    pytester.makepyprojecttoml(f"[tool.pytest.ini_options]\nfilterwarnings = {json.dumps(_our_filterwarnings())}\n")
    pytester.makepyfile(test_threads=THREADED_TESTS)
    result = pytester.runpytest_subprocess()
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*AssertionError: the worker saw a wrong value*", "FAILED*test_worker_thread_fails*"])


def test_without_the_setting_the_same_failure_would_pass(pytester: pytest.Pytester) -> None:
    # The control: what the setting guards against is real (pytest alone only warns).
    pytester.makepyfile(test_threads=THREADED_TESTS)
    result = pytester.runpytest_subprocess()
    result.assert_outcomes(passed=2, warnings=1)
