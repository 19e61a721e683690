"""One import root, for real: the wheel holds only `kube_vgpu` (components, manifests and all), it works beside a
user's own `webhook/` package, and mypy checks the components through that root with their real types."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    source = tmp_path_factory.mktemp("source")
    # built from a copy of the files git knows (symlinks kept as links), so a stale build/ directory in the checkout
    # cannot smuggle deleted modules into the wheel
    listed = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            check=True, capture_output=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        origin, target = ROOT / name, source / name
        if not origin.exists() and not origin.is_symlink():
            continue  # deleted in the working tree, not yet committed
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(origin, target, follow_symlinks=False)
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "--wheel-dir", str(out),
         str(source)],
        capture_output=True, text=True, timeout=300, cwd=source, env={**os.environ, "PIP_NO_INPUT": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (found,) = out.glob("kube_vgpu-*.whl")
    return found


def test_the_wheel_holds_only_the_kube_vgpu_package(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    top_level = {name.split("/")[0] for name in names if not name.split("/")[0].endswith(".dist-info")}
    assert top_level == {"kube_vgpu"}
    for expected in ("kube_vgpu/extender/state.py", "kube_vgpu/webhook/mutate.py",
                     "kube_vgpu/deviceplugin/allocate.py", "kube_vgpu/deviceplugin/api/deviceplugin.proto",
                     "kube_vgpu/kubeapi.py", "kube_vgpu/protocol/__init__.py", "kube_vgpu/dev/synth.py",
                     # the dev cluster and demo apply these from the installed package
                     "kube_vgpu/manifests/base/scheduler/kube-scheduler-config.yaml",
                     "kube_vgpu/manifests/base/scheduler/rbac.yaml",
                     "kube_vgpu/manifests/base/deviceplugin/rbac.yaml",
                     # the dashboard serves its page from the installed package
                     "kube_vgpu/extender/dashboard/static/index.html",
                     "kube_vgpu/extender/dashboard/static/app.js",
                     "kube_vgpu/extender/dashboard/static/style.css",
                     "kube_vgpu/manifests/dashboard/deployment.yaml"):
        assert expected in names, expected
    top_level_txt = [n for n in names if n.endswith(".dist-info/top_level.txt")]
    if top_level_txt:
        assert zipfile.ZipFile(wheel).read(top_level_txt[0]).decode().split() == ["kube_vgpu"]


def test_a_users_own_webhook_package_first_on_the_path_does_not_break_the_cli(wheel: Path, tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    clean_env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}  # a checkout on the
    # path (and its kube_vgpu.egg-info) would make pip think kube-vgpu is installed already
    installed = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
                                "--no-index", str(wheel)], capture_output=True, text=True, timeout=300, env=clean_env)
    assert installed.returncode == 0, installed.stderr[-3000:]
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    # the dependencies (fastapi, kubernetes, ...) come from the test's own environment, after the wheel
    (Path(site) / "zz_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    listing = sorted(p.name for p in Path(site).iterdir() if not p.name.endswith((".dist-info", ".pth")))
    assert listing == ["kube_vgpu"]

    user = tmp_path / "user"
    for package in ("webhook", "extender", "deviceplugin"):
        (user / package).mkdir(parents=True)
        (user / package / "__init__.py").write_text("raise RuntimeError('the user package was imported')\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["PYTHONPATH"] = str(user)
    for command in (["webhook", "--help"], ["extender", "--help"], ["device-plugin", "--help"]):
        result = subprocess.run([str(venv / "bin" / "kube-vgpu"), *command], capture_output=True, text=True,
                                timeout=120, cwd=user, env=env)
        assert result.returncode == 0, (command, result.stderr[-2000:])
        assert "usage" in result.stdout.lower()
    # the user's package is still theirs
    theirs = subprocess.run([str(python), "-c", "import webhook"], capture_output=True, text=True, cwd=user, env=env)
    assert "the user package was imported" in theirs.stderr


def test_mypy_has_no_blanket_ignore_of_missing_imports() -> None:
    config = PYPROJECT["tool"]["mypy"]
    assert "ignore_missing_imports" not in config
    assert config["files"] == ["kube_vgpu"]
    for override in config.get("overrides", []):
        if override.get("ignore_missing_imports"):
            modules = override["module"]
            assert not any(str(m).startswith(("kube_vgpu", "extender", "webhook", "deviceplugin")) for m in modules)


def test_mypy_sees_the_components_real_types_through_the_one_import_root(tmp_path: Path) -> None:
    probe = tmp_path / "probe_types.py"
    probe.write_text(
        "from kube_vgpu.extender.engine.model import NodeState\n"
        "from kube_vgpu.webhook.config import WebhookConfig\n"
        "from kube_vgpu.deviceplugin.discovery import discover\n"
        "reveal_type(NodeState)\n"
        "reveal_type(WebhookConfig)\n"
        "reveal_type(discover)\n"
        "WebhookConfig(no_such_field=1)\n"
    )
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"), "--no-error-summary",
         "--cache-dir", str(tmp_path / "cache"), str(probe)],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )
    out = result.stdout
    assert "kube_vgpu.extender.engine.model.NodeState" in out, out
    assert "kube_vgpu.webhook.config.WebhookConfig" in out, out
    assert "def (" in out and "kube_vgpu.protocol.NodeInventory" in out, out
    assert 'Unexpected keyword argument "no_such_field"' in out, out
    assert "Any" not in "".join(line for line in out.splitlines() if "Revealed type" in line), out
