"""Debian's chromium driven by Playwright's Python API (no browser is ever downloaded: `playwright install` is not
run). Without chromium a browser test fails under CI=true and is skipped elsewhere, with the reason."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = Path(os.environ.get("KUBE_VGPU_CHROMIUM", "/usr/bin/chromium"))
#: nothing reaches out: no update checks, no QUIC, no sync (the machine reaches only package mirrors)
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]


def _missing(reason: str) -> None:
    if os.environ.get("CI") == "true":
        pytest.fail(f"browser test under CI=true: {reason}", pytrace=False)
    pytest.skip(reason)


@contextmanager
def chromium_page(width: int = 1280, height: int = 900) -> Iterator[Any]:
    """A fresh page in a headless chromium (a playwright.sync_api.Page)."""
    executable = CHROMIUM if CHROMIUM.exists() else shutil.which("chromium")
    if executable is None:
        _missing(f"no chromium at {CHROMIUM} (scripts/system-deps.sh installs Debian's)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _missing("the playwright package is not installed (requirements-dev.lock)")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(executable), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": width, "height": height})
            yield page
        finally:
            browser.close()


def field_values(page: Any, selector: str, field: str) -> list[str]:
    """data-value of every [data-field=field] under the elements matching `selector`."""
    values: list[str] = page.eval_on_selector_all(
        f"{selector} [data-field='{field}']", "nodes => nodes.map(n => n.dataset.value ?? n.textContent)")
    return values
