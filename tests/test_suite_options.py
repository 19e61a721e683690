"""tests/conftest.py's --pause-after-collection, run on a throwaway suite by pytest's own pytester."""

from __future__ import annotations

from pathlib import Path

import pytest

CONFTEST = (Path(__file__).parent / "conftest.py").read_text()


@pytest.fixture
def suite(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_one="def test_one() -> None:\n    assert 1 + 1 == 2\n")
    return pytester


def test_the_pause_comes_after_collection_and_the_tests_still_run(suite: pytest.Pytester) -> None:
    result = suite.runpytest("--pause-after-collection=0.01")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["collected 1 item", "pausing 0 s after collection (--pause-after-collection)",
                                 "test_one.py .*"])


def test_no_pause_by_default_nor_when_only_collecting(suite: pytest.Pytester) -> None:
    for args in ((), ("--collect-only", "--pause-after-collection=60")):
        result = suite.runpytest(*args)
        assert result.ret == pytest.ExitCode.OK
        assert "pausing" not in result.stdout.str()


@pytest.mark.parametrize(("value", "message"), [("-1", "must be >= 0"), ("nan", "must be >= 0"),
                                                  ("soon", "is not a number")])
def test_a_pause_that_would_prove_nothing_is_a_usage_error(suite: pytest.Pytester, value: str, message: str) -> None:
    result = suite.runpytest(f"--pause-after-collection={value}")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"*--pause-after-collection*{message}*"])
