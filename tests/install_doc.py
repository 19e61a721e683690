"""docs/install.md's shell blocks, as tests/e2e/test_install_doc.py runs them (and tests/test_install_doc.py checks
without a cluster).

Every ```bash (or sh, shell, console) block of the page carries a marker on the line just above it:

    <!-- test: run -->                 run as written (bash -euo pipefail), in a scratch copy of charts/ and manifests/
    <!-- test: dry-run -->             each command as a server-side dry run (plan() says how)
    <!-- test: not run: REASON -->     not run, for the reason given

A shell block without a marker, a marker that is not followed by a shell block, or a marker of another form is an
error (DocError), so an edit that drops or breaks a marker fails the fast tests, not only the e2e run.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
INSTALL_DOC = ROOT / "docs" / "install.md"

SHELL_LANGUAGES = {"bash", "sh", "shell", "console"}
MARKER = re.compile(r"^<!-- test: (run|dry-run|not run: (\S.*\S)) -->$")
ANY_MARKER = re.compile(r"<!--\s*test\b")
FENCE = re.compile(r"^(\s*)```\s*([\w-]*)\s*$")
#: the variables a reader sets by hand (docs/install.md, "Variables used below") and the test sets for them
SUBSTITUTED_VARIABLES = ("KUBECONFIG", "PATH", "GPU_NODE", "KUBE_VGPU_EXTENDER")


class DocError(ValueError):
    pass


@dataclass(frozen=True)
class Block:
    line: int  # 1-based line of the opening fence
    mode: str  # run | dry-run | not run
    reason: str  # for "not run"
    text: str
    section: str  # the last heading above it

    def describe(self) -> str:
        return f"docs/install.md line {self.line} ({self.section}, {self.mode}):\n{self.text}"


def parse(text: str) -> list[Block]:
    """Every shell block with its marker, in the page's order; raises DocError on a missing or broken marker."""
    lines = text.splitlines()
    blocks: list[Block] = []
    section = ""
    index = 0
    while index < len(lines):
        line = lines[index]
        if line.startswith("#"):
            section = line.lstrip("#").strip()
        if ANY_MARKER.search(line) and not MARKER.match(line):
            raise DocError(f"line {index + 1}: a test marker of an unknown form: {line!r}")
        fence = FENCE.match(line)
        if MARKER.match(line):
            following = FENCE.match(lines[index + 1]) if index + 1 < len(lines) else None
            if not following or following.group(2) not in SHELL_LANGUAGES:
                raise DocError(f"line {index + 1}: {line!r} is not followed directly by a shell block")
        if not fence:
            index += 1
            continue
        language = fence.group(2)
        end = next((j for j in range(index + 1, len(lines)) if lines[j].strip() == "```"), None)
        if end is None:
            raise DocError(f"line {index + 1}: a code block that is never closed")
        if language in SHELL_LANGUAGES:
            marker = MARKER.match(lines[index - 1]) if index else None
            if not marker:
                raise DocError(f"line {index + 1}: a shell block without a test marker on the line above "
                               "(<!-- test: run -->, <!-- test: dry-run --> or <!-- test: not run: REASON -->)")
            mode = "not run" if marker.group(1).startswith("not run") else marker.group(1)
            blocks.append(Block(index + 1, mode, marker.group(2) or "", "\n".join(lines[index + 1:end]) + "\n",
                                section))
        index = end + 1
    return blocks


def install_blocks() -> list[Block]:
    return parse(INSTALL_DOC.read_text())


def logical_lines(script: str) -> list[str]:
    """The commands of a block: continuation lines joined, comments and blank lines dropped (for dry-run blocks,
    which hold plain commands only: no heredocs, no quotes around a #)."""
    commands = []
    for line in script.replace("\\\n", " ").splitlines():
        line = re.split(r"(?:^|\s)#", line, maxsplit=1)[0].strip()
        if line:
            commands.append(line)
    return commands


@dataclass(frozen=True)
class DryRun:
    how: str  # kustomize: render argv[0] with kubectl kustomize | helm: helm template argv | kubectl: argv as is
    argv: list[str]


#: helm install/upgrade flags that helm template does not take or that mean nothing without a cluster
HELM_DROPPED_FLAGS = {"--create-namespace", "--wait", "--atomic", "--rollback-on-failure", "--install"}


def plan(command: str) -> DryRun:
    """What the e2e test runs for one command of a dry-run block; ValueError for a command it cannot dry-run."""
    argv = shlex.split(command)
    if argv[:2] == ["kubectl", "apply"] and "-k" in argv:
        others = [a for i, a in enumerate(argv[2:], 2) if a != "-k" and argv[i - 1] != "-k"]
        if others:
            raise ValueError(f"kubectl apply -k with other arguments ({others}) cannot be dry-run: {command}")
        return DryRun("kustomize", [argv[argv.index("-k") + 1]])
    if argv[:1] == ["helm"] and len(argv) > 1 and argv[1] in ("install", "upgrade"):
        return DryRun("helm", ["template", *(a for a in argv[2:] if a not in HELM_DROPPED_FLAGS)])
    if argv[:1] == ["kubectl"] and len(argv) > 1 and argv[1] in ("apply", "create", "label", "annotate", "patch",
                                                                  "delete"):
        return DryRun("kubectl", [*argv[1:], "--dry-run=server"])
    raise ValueError(f"no server-side dry run for: {command}")
