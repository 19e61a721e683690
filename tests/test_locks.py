"""The lock files pin every dependency pyproject.toml names, at a version its specifier allows, with hashes; the
bootstrap and the Dockerfile install from them. (No network: `make lock` re-resolves them.)"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PIN = re.compile(r"^([A-Za-z0-9_.-]+)==([^ \\;]+)")


def pins(lock: Path) -> dict[str, Version]:
    found: dict[str, Version] = {}
    for line in lock.read_text().splitlines():
        match = PIN.match(line)
        if match:
            found[canonicalize_name(match.group(1))] = Version(match.group(2))
    return found


def requirements(*extras: str) -> list[Requirement]:
    project = PYPROJECT["project"]
    names = list(project["dependencies"])
    for extra in extras:
        names += project["optional-dependencies"][extra]
    return [Requirement(text) for text in names]


@pytest.mark.parametrize(("lock", "extras"), [("requirements.lock", ()), ("requirements-dev.lock", ("dev", "sim"))])
def test_every_dependency_is_pinned_at_an_allowed_version(lock: str, extras: tuple[str, ...]) -> None:
    pinned = pins(ROOT / lock)
    for requirement in requirements(*extras):
        if requirement.marker is not None and not requirement.marker.evaluate({"sys_platform": "linux"}):
            continue
        name = canonicalize_name(requirement.name)
        assert name in pinned, f"{lock} lacks {name}: run `make lock`"
        assert requirement.specifier.contains(pinned[name], prereleases=True), (
            f"{lock} pins {name}=={pinned[name]}, outside pyproject's {requirement.specifier}: run `make lock`")


@pytest.mark.parametrize("lock", ["requirements.lock", "requirements-dev.lock"])
def test_every_pin_carries_hashes(lock: str) -> None:
    text = (ROOT / lock).read_text()
    blocks = re.split(r"\n(?=[A-Za-z0-9_.-]+==)", text.split("\n", 2)[2])
    assert blocks and all("--hash=sha256:" in block for block in blocks if PIN.match(block))


def test_the_runtime_lock_holds_no_development_tool() -> None:
    runtime = pins(ROOT / "requirements.lock")
    for tool in ("pytest", "mypy", "ruff", "hypothesis", "uv"):
        assert tool not in runtime


def test_the_bootstrap_installs_the_dev_lock_and_keys_its_cache_on_it() -> None:
    script = (ROOT / "scripts" / "bootstrap.sh").read_text()
    assert "--require-hashes -r \"$root/requirements-dev.lock\"" in script
    assert "--no-deps -e \"$root\"" in script
    assert "requirements-dev.lock\"; \"$python\" --version" in script  # the venv's cache key
