"""The layer contract of DESIGN.md ("Layout"), enforced on the source: a layer imports only layers below it, the
three components are independent of each other, and no import cycle exists (a function-level import may not hide
one). The checker reads every module of the `kube_vgpu` package as the import system sees it (the component
directories through their symlinks) and counts every import: module level, function level, and `TYPE_CHECKING`
blocks (types are dependencies too, though they cannot make a runtime cycle)."""

from __future__ import annotations

import ast
import os
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "kube_vgpu"

#: (module prefix, layer name, rank). The longest matching prefix decides; a module may import modules of its own
#: group, and of any group whose rank is lower. Groups of equal rank (the components) may not import each other.
GROUPS: tuple[tuple[str, str, int], ...] = (
    ("kube_vgpu", "package root", 0),
    ("kube_vgpu.kubeapi", "kubeapi", 0),
    ("kube_vgpu.probes", "probes", 0),
    ("kube_vgpu.protocol", "protocol", 1),
    ("kube_vgpu.extender", "extender", 2),
    ("kube_vgpu.webhook", "webhook", 2),
    ("kube_vgpu.deviceplugin", "deviceplugin", 2),
    ("kube_vgpu.dev", "dev tools", 3),
    ("kube_vgpu.cli", "cli", 4),
)


@dataclass(frozen=True)
class Import:
    importer: str
    imported: str
    line: int
    runtime: bool  # False inside `if TYPE_CHECKING:`
    nested: bool  # inside a function body


def group_of(module: str) -> tuple[str, str, int]:
    best = GROUPS[0]
    for prefix, name, rank in GROUPS:
        if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > len(best[0]):
            best = (prefix, name, rank)
    return best


def discover(root: Path, package: str = PACKAGE) -> dict[str, Path]:
    """Module name -> file, following symlinked directories as the import system does."""
    modules: dict[str, Path] = {}
    base = root / package
    for directory, _dirs, files in os.walk(base, followlinks=True):
        relative = Path(directory).relative_to(root)
        if "__pycache__" in relative.parts or not (Path(directory) / "__init__.py").exists():
            continue
        for name in files:
            if not name.endswith(".py"):
                continue
            parts = list(relative.parts)
            if name != "__init__.py":
                parts.append(name[:-3])
            modules[".".join(parts)] = Path(directory) / name
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports_of(module: str, path: Path, known: set[str]) -> list[Import]:
    """Every import of a `kube_vgpu` module in `path`, resolved to module names (a `from M import name` where M.name
    is a module counts as importing M.name)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found: list[Import] = []
    is_package = path.name == "__init__.py"

    def visit(node: ast.AST, runtime: bool, nested: bool) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                visit(child, False, nested)
            for child in node.orelse:
                visit(child, runtime, nested)
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == PACKAGE:
                    found.append(Import(module, alias.name, node.lineno, runtime, nested))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = module.split(".") if is_package else module.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                source = ".".join([*anchor, *([node.module] if node.module else [])])
            else:
                source = node.module or ""
            if source.split(".")[0] == PACKAGE:
                for alias in node.names:
                    candidate = f"{source}.{alias.name}"
                    target = candidate if candidate in known else source
                    found.append(Import(module, target, node.lineno, runtime, nested))
        inner = nested or isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
        for child in ast.iter_child_nodes(node):
            visit(child, runtime, inner)

    for top in tree.body:
        visit(top, True, False)
    return found


def layer_violations(edges: list[Import]) -> list[str]:
    problems = []
    for edge in edges:
        importer_prefix, importer_name, importer_rank = group_of(edge.importer)
        imported_prefix, imported_name, imported_rank = group_of(edge.imported)
        if importer_prefix == imported_prefix:
            continue
        if imported_rank >= importer_rank:
            problems.append(f"{edge.importer}:{edge.line} ({importer_name}) imports {edge.imported} "
                            f"({imported_name}): a layer imports only layers below it")
    return problems


def cycles(edges: list[Import]) -> list[list[str]]:
    """Strongly connected components of more than one module in the runtime import graph (Tarjan)."""
    graph: dict[str, set[str]] = {}
    for edge in edges:
        if edge.runtime and edge.imported != edge.importer:
            graph.setdefault(edge.importer, set()).add(edge.imported)
            graph.setdefault(edge.imported, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0

    def connect(node: str) -> None:
        nonlocal counter
        index[node] = low[node] = counter
        counter += 1
        stack.append(node)
        on_stack.add(node)
        for successor in sorted(graph[node]):
            if successor not in index:
                connect(successor)
                low[node] = min(low[node], low[successor])
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return found


def _is_parent_package_edge(edge: Import) -> bool:
    """A package's __init__ importing its own submodules, and a submodule importing its package (Python's own
    package mechanics), are not layering cycles; only edges between distinct siblings or layers count."""
    return edge.imported.startswith(edge.importer + ".") or edge.importer.startswith(edge.imported + ".")


def all_edges(root: Path) -> list[Import]:
    modules = discover(root)
    known = set(modules)
    return [edge for module, path in sorted(modules.items()) for edge in imports_of(module, path, known)]


# --- the contract on this repository -------------------------------------------------------------------------------


def test_every_component_is_seen_through_the_one_import_root() -> None:
    modules = discover(ROOT)
    for expected in ("kube_vgpu.kubeapi", "kube_vgpu.protocol", "kube_vgpu.extender.state",
                     "kube_vgpu.webhook.mutate", "kube_vgpu.deviceplugin.allocate", "kube_vgpu.dev.synth",
                     "kube_vgpu.cli"):
        assert expected in modules


def test_layers_import_only_layers_below_them() -> None:
    assert layer_violations(all_edges(ROOT)) == []


def test_the_bottom_layer_imports_nothing_of_ours_above_it() -> None:
    edges = all_edges(ROOT)
    kubeapi = [e.imported for e in edges if e.importer in ("kube_vgpu.kubeapi", "kube_vgpu.probes")]
    assert kubeapi == []
    protocol = {e.imported for e in edges if group_of(e.importer)[1] == "protocol"}
    assert all(group_of(name)[1] in ("protocol", "kubeapi") for name in protocol), protocol


def test_no_import_cycles_hidden_or_not() -> None:
    edges = [e for e in all_edges(ROOT) if not _is_parent_package_edge(e)]
    assert cycles(edges) == []


# --- the checker catches what it must ------------------------------------------------------------------------------


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    for directory in {p.parent for p in tmp_path.rglob("*.py")}:
        (directory / "__init__.py").touch()
    return tmp_path


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        pytest.param({"kube_vgpu/protocol/x.py": "from kube_vgpu.extender import state\n"},
                     "kube_vgpu.protocol.x:1 (protocol) imports kube_vgpu.extender", id="bottom-imports-middle"),
        pytest.param({"kube_vgpu/kubeapi.py": "import kube_vgpu.protocol\n"},
                     "kube_vgpu.kubeapi:1 (kubeapi) imports kube_vgpu.protocol", id="kubeapi-imports-protocol"),
        pytest.param({"kube_vgpu/extender/a.py": "def f():\n    from kube_vgpu.dev import synth\n"},
                     "kube_vgpu.extender.a:2 (extender) imports kube_vgpu.dev.synth", id="function-level-upward"),
        pytest.param({"kube_vgpu/webhook/a.py": "from kube_vgpu.deviceplugin import kube\n"},
                     "kube_vgpu.webhook.a:1 (webhook) imports kube_vgpu.deviceplugin.kube", id="sibling-components"),
        pytest.param({"kube_vgpu/deviceplugin/a.py": "from typing import TYPE_CHECKING\n"
                                                     "if TYPE_CHECKING:\n    from kube_vgpu.extender import x\n"},
                     "kube_vgpu.deviceplugin.a:3 (deviceplugin) imports kube_vgpu.extender", id="type-checking-only"),
        pytest.param({"kube_vgpu/dev/a.py": "from kube_vgpu import cli\n"},
                     "kube_vgpu.dev.a:1 (dev tools) imports kube_vgpu.cli", id="dev-imports-cli"),
    ],
)
def test_the_checker_refuses_an_upward_import(tmp_path: Path, files: dict[str, str], expected: str) -> None:
    root = _tree(tmp_path, {"kube_vgpu/cli.py": "", "kube_vgpu/dev/synth.py": "", "kube_vgpu/extender/x.py": "",
                            "kube_vgpu/deviceplugin/kube.py": "", "kube_vgpu/extender/state.py": "", **files})
    problems = layer_violations(all_edges(root))
    assert len(problems) == 1 and problems[0].startswith(expected), problems


def test_the_checker_allows_downward_and_own_imports(tmp_path: Path) -> None:
    root = _tree(tmp_path, {
        "kube_vgpu/kubeapi.py": "import re\n",
        "kube_vgpu/protocol/names.py": "from kube_vgpu import kubeapi\n",
        "kube_vgpu/extender/state.py": "from kube_vgpu.protocol import names\nfrom kube_vgpu.extender import b\n",
        "kube_vgpu/extender/b.py": "",
        "kube_vgpu/dev/synth.py": "from kube_vgpu.extender import state\nfrom kube_vgpu.webhook import m\n",
        "kube_vgpu/webhook/m.py": "",
        "kube_vgpu/cli.py": "def main():\n    from kube_vgpu.dev import synth\n",
    })
    assert layer_violations(all_edges(root)) == []


def test_the_checker_finds_a_cycle_hidden_in_a_function(tmp_path: Path) -> None:
    root = _tree(tmp_path, {
        "kube_vgpu/extender/state.py": "def charge():\n    from kube_vgpu.extender.quota import gate\n",
        "kube_vgpu/extender/quota/gate.py": "from kube_vgpu.extender import state\n",
    })
    edges = [e for e in all_edges(root) if not _is_parent_package_edge(e)]
    assert cycles(edges) == [["kube_vgpu.extender.quota.gate", "kube_vgpu.extender.state"]]


def test_no_hook_or_flag_is_looked_up_by_name() -> None:
    """Optional behaviour is declared on an interface (extender/gates.py, engine Policy flags), never found with
    getattr(obj, "literal") at a call site (kube-scheduler's plugin model)."""
    found = []
    for module, path in discover(ROOT).items():
        if not module.startswith(("kube_vgpu.extender", "kube_vgpu.dev.simulator")):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            is_lookup = isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in (
                "getattr", "hasattr")
            if is_lookup and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant):
                found.append(f"{module}:{node.lineno} {node.func.id}(..., {node.args[1].value!r})")
    assert found == []
