"""docs/install.md without a cluster: every shell block carries a test marker, the markers find the blocks the e2e
test (tests/e2e/test_install_doc.py) must run, every dry-run command has a dry run, and every `kube-vgpu` command
the page names, in its prose as well as in its blocks, is one the CLI has."""

from __future__ import annotations

import re

import pytest

from kube_vgpu.cli import main as kube_vgpu_main
from tests.install_doc import INSTALL_DOC, DocError, logical_lines, parse, plan


def test_every_shell_block_has_a_marker_and_every_marker_a_block() -> None:
    text = INSTALL_DOC.read_text()
    blocks = parse(text)
    markers = re.findall(r"^<!-- test: (run|dry-run|not run: .+) -->$", text, flags=re.M)
    assert len(blocks) == len(markers) == len(re.findall(r"^```(?:bash|sh|shell|console)$", text, flags=re.M))
    modes = [block.mode for block in blocks]
    assert modes.count("run") >= 8 and modes.count("dry-run") >= 4
    assert all(block.reason for block in blocks if block.mode == "not run")


def runnable(mode: str) -> str:
    return "\n".join(block.text for block in parse(INSTALL_DOC.read_text()) if block.mode == mode)


@pytest.mark.parametrize(("mode", "needle"), [
    ("dry-run", "kubectl apply -k manifests/overlays/self-signed"),
    ("dry-run", "kubectl apply -k manifests/overlays/cert-manager"),
    ("dry-run", "helm install kube-vgpu charts/kube-vgpu"),
    ("dry-run", "helm upgrade kube-vgpu charts/kube-vgpu"),
    ("dry-run", "kubectl apply -k my-kube-vgpu"),
    ("run", "cat > my-values.yaml"),
    ("run", "cat > my-kube-vgpu/kustomization.yaml"),
    ("run", 'kubectl label node "$GPU_NODE" kube-vgpu.io/gpu-node=true'),
    ("run", "kubectl -n gpu-demo wait --for=condition=Ready pod/first-gpu"),
    ("run", "annotations.kube-vgpu\\.io/gpu-assignment"),
    ("run", 'kube-vgpu top nodes --extender-url "$KUBE_VGPU_EXTENDER"'),
    ("run", 'kube-vgpu quota status --extender-url "$KUBE_VGPU_EXTENDER"'),
    ("run", "kubectl delete namespace gpu-demo"),
])
def test_the_install_path_is_in_the_blocks_the_test_runs(mode: str, needle: str) -> None:
    assert needle in runnable(mode)


def test_every_dry_run_command_has_a_dry_run() -> None:
    for block in parse(INSTALL_DOC.read_text()):
        if block.mode == "dry-run":
            for command in logical_lines(block.text):
                plan(command)  # raises for a command the e2e test could not dry-run


def test_the_plans() -> None:
    assert plan("kubectl apply -k manifests/overlays/self-signed").argv == ["manifests/overlays/self-signed"]
    helm = plan("helm install kube-vgpu charts/kube-vgpu --namespace kube-vgpu --create-namespace -f v.yaml")
    assert (helm.how, helm.argv) == ("helm", ["template", "kube-vgpu", "charts/kube-vgpu", "--namespace",
                                              "kube-vgpu", "-f", "v.yaml"])
    assert plan("kubectl apply -f ns.yaml").argv == ["apply", "-f", "ns.yaml", "--dry-run=server"]
    for command in ("kubectl apply -k dir --prune", "helm uninstall kube-vgpu", "kubectl get pods", "curl x"):
        with pytest.raises(ValueError):
            plan(command)


@pytest.mark.parametrize(("text", "error"), [
    ("```bash\nls\n```\n", "without a test marker"),
    ("<!-- test: run -->\n\n```bash\nls\n```\n", "not followed directly"),
    ("<!-- test: run -->\n```yaml\na: 1\n```\n", "not followed directly"),
    ("<!-- test: not run -->\n```bash\nls\n```\n", "unknown form"),
    ("<!-- test: runs -->\n```bash\nls\n```\n", "unknown form"),
    ("<!-- test: run -->\n```bash\nls\n", "never closed"),
])
def test_broken_markers_are_refused(text: str, error: str) -> None:
    with pytest.raises(DocError, match=error):
        parse(text)


def test_a_block_keeps_its_text_mode_and_section() -> None:
    [block] = parse("# Title\n## Sub\n<!-- test: not run: needs a GPU -->\n```bash\nnvidia-smi \\\n  -L\n```\n")
    assert (block.mode, block.reason, block.section, block.line) == ("not run", "needs a GPU", "Sub", 4)
    assert logical_lines(block.text) == ["nvidia-smi    -L"]


def named_commands(text: str) -> set[tuple[str, ...]]:
    """The subcommand words of every `kube-vgpu ...` in command position: in a shell block's line, or at the start
    of an inline code span or after `--` (kubectl exec ... -- kube-vgpu ...) in the prose."""
    found = set()
    prose = re.sub(r"^```.*?^```$", "", text, flags=re.S | re.M)
    spans = [" ".join(span.split()) for span in re.findall(r"`([^`]+)`", prose)]
    blocks = [block.text for block in parse(text)]
    for chunk in [*spans, *blocks]:
        for match in re.finditer(r"(?:^\s*|[;|&(]\s*|\s--\s)kube-vgpu((?: [a-z][a-z-]*)+)", chunk, flags=re.M):
            found.add(tuple(match.group(1).split()))
    return found


def test_every_kube_vgpu_command_the_page_names_exists(capsys: pytest.CaptureFixture[str]) -> None:
    named = named_commands(INSTALL_DOC.read_text())
    assert {("top", "nodes"), ("top", "pods"), ("quota", "status"), ("certs",)} <= named
    for words in sorted(named):
        # every word after kube-vgpu up to the first option is a subcommand: the CLI must have them all
        with pytest.raises(SystemExit) as exited:
            kube_vgpu_main([*words, "--help"])
        assert exited.value.code == 0, f"kube-vgpu {' '.join(words)} --help: {capsys.readouterr().err}"
