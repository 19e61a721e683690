"""The limiter-install init container's logic (deviceplugin/limiter_install.py) against a fake host directory:
versioned install, idempotence, checksum refusals, repair, concurrent installers, rollback, garbage collection."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kube_vgpu.cli import main as kube_vgpu_main
from kube_vgpu.deviceplugin.limiter_install import (
    CHECKSUM_NAME,
    LD_SO_PRELOAD_NAME,
    LIBRARY_NAME,
    LOCK_NAME,
    STATUS_NAME,
    VERSION_NAME,
    VERSIONS_DIR,
    InstallError,
    collect_garbage,
    current_name,
    install,
    installed_versions,
    rollback,
    verified_name,
    versions_in_use,
)

REPO = Path(__file__).resolve().parents[2]


def make_source(directory: Path, version: str, content: bytes, *, checksum: str | None = None) -> Path:
    """What the image carries at /opt/kube-vgpu/limiter."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / LIBRARY_NAME).write_bytes(content)
    digest = checksum or hashlib.sha256(content).hexdigest()
    (directory / CHECKSUM_NAME).write_text(f"{digest}  {LIBRARY_NAME}\n")
    (directory / VERSION_NAME).write_text(f"{version}\n")
    return directory


def name_of(version: str, content: bytes) -> str:
    return f"{version}-{hashlib.sha256(content).hexdigest()[:12]}"


@pytest.fixture
def host(tmp_path: Path) -> Path:
    return tmp_path / "host" / "usr" / "local" / "vgpu"


@pytest.fixture
def no_proc(tmp_path: Path) -> Path:
    """An empty proc directory: no container mounts any version."""
    path = tmp_path / "proc"
    path.mkdir()
    return path


def test_versioned_install_switches_the_link(tmp_path: Path, host: Path, no_proc: Path) -> None:
    source = make_source(tmp_path / "src", "abc123", b"library one")
    result = install(source, host, proc_dir=no_proc)
    name = name_of("abc123", b"library one")
    assert (result.name, result.copied, result.switched, result.removed) == (name, True, True, ())
    link = host / LIBRARY_NAME
    assert link.is_symlink() and os.readlink(link) == f"{VERSIONS_DIR}/{name}/{LIBRARY_NAME}"  # relative
    assert link.read_bytes() == b"library one"
    assert (host / VERSIONS_DIR / name / VERSION_NAME).read_text() == "abc123\n"
    assert json.loads((host / STATUS_NAME).read_text()) == {
        "name": name, "version": "abc123", "sha256": hashlib.sha256(b"library one").hexdigest()}
    assert (host / LD_SO_PRELOAD_NAME).read_text() == f"{host / LIBRARY_NAME}\n"
    assert verified_name(host) == name
    assert oct((host / VERSIONS_DIR / name / LIBRARY_NAME).stat().st_mode & 0o777) == "0o644"


def test_install_is_idempotent(tmp_path: Path, host: Path, no_proc: Path) -> None:
    source = make_source(tmp_path / "src", "v1", b"one")
    install(source, host, proc_dir=no_proc)
    inode = (host / LIBRARY_NAME).stat().st_ino
    again = install(source, host, proc_dir=no_proc)
    assert (again.copied, again.switched) == (False, False)
    assert (host / LIBRARY_NAME).stat().st_ino == inode  # the very same file: nothing rewritten
    assert not [p for p in host.rglob(".tmp-*")]


@pytest.mark.parametrize("breakage", ["wrong-checksum", "library-changed", "bad-format", "no-version", "bad-version"])
def test_a_bad_source_is_refused_and_nothing_switched(tmp_path: Path, host: Path, no_proc: Path, breakage: str) -> None:
    install(make_source(tmp_path / "good", "v1", b"one"), host, proc_dir=no_proc)
    before = sorted(str(p) for p in host.rglob("*"))
    bad = make_source(tmp_path / "bad", "v2", b"two")
    if breakage == "wrong-checksum":
        (bad / CHECKSUM_NAME).write_text(f"{'0' * 64}  {LIBRARY_NAME}\n")
    elif breakage == "library-changed":
        (bad / LIBRARY_NAME).write_bytes(b"two, tampered with")
    elif breakage == "bad-format":
        (bad / CHECKSUM_NAME).write_text("not a checksum\n")
    elif breakage == "no-version":
        (bad / VERSION_NAME).unlink()
    else:
        (bad / VERSION_NAME).write_text("../../etc\n")
    with pytest.raises(InstallError) as refused:
        install(bad, host, proc_dir=no_proc)
    if breakage in ("wrong-checksum", "library-changed"):
        assert "checksum mismatch" in str(refused.value)
    assert current_name(host) == name_of("v1", b"one")
    assert sorted(str(p) for p in host.rglob("*")) == before
    # the command says so and fails (the init container fails: the pod does not start with a half install)
    assert kube_vgpu_main(["limiter", "install", f"--source-dir={bad}", f"--host-dir={host}",
                           f"--proc-dir={no_proc}"]) == 1


def test_a_refused_first_install_writes_nothing(tmp_path: Path, host: Path, no_proc: Path) -> None:
    bad = make_source(tmp_path / "bad", "v1", b"one", checksum="f" * 64)
    with pytest.raises(InstallError):
        install(bad, host, proc_dir=no_proc)
    assert not host.exists()


def test_a_corrupt_installed_copy_is_repaired(tmp_path: Path, host: Path, no_proc: Path) -> None:
    source = make_source(tmp_path / "src", "v1", b"one")
    name = install(source, host, proc_dir=no_proc).name
    installed = host / VERSIONS_DIR / name / LIBRARY_NAME
    held = open(installed, "rb")  # a container that mounted it holds this inode
    try:
        installed.write_bytes(b"bit rot")
        assert verified_name(host) is None  # the device plugin removes its label
        result = install(source, host, proc_dir=no_proc)
        assert (result.copied, result.switched) == (True, False)
        assert installed.read_bytes() == b"one" and verified_name(host) == name
        assert os.fstat(held.fileno()).st_ino != installed.stat().st_ino  # replaced by rename, not rewritten
    finally:
        held.close()


def test_a_missing_checksum_file_in_a_version_is_repaired(tmp_path: Path, host: Path, no_proc: Path) -> None:
    source = make_source(tmp_path / "src", "v1", b"one")
    name = install(source, host, proc_dir=no_proc).name
    (host / VERSIONS_DIR / name / CHECKSUM_NAME).unlink()
    assert verified_name(host) is None
    assert install(source, host, proc_dir=no_proc).copied
    assert verified_name(host) == name


def test_upgrade_keeps_the_old_version_for_running_containers(tmp_path: Path, host: Path, no_proc: Path) -> None:
    install(make_source(tmp_path / "one", "v1", b"one"), host, proc_dir=no_proc)
    # what a container started now gets: the bind mount resolves the link once, so it holds this inode
    started = open(host / LIBRARY_NAME, "rb")
    try:
        install(make_source(tmp_path / "two", "v2", b"two"), host, proc_dir=no_proc)
        assert (host / LIBRARY_NAME).read_bytes() == b"two"
        assert started.read() == b"one"
        assert (host / VERSIONS_DIR / name_of("v1", b"one") / LIBRARY_NAME).read_bytes() == b"one"
    finally:
        started.close()
    assert installed_versions(host) == [name_of("v2", b"two"), name_of("v1", b"one")]


def test_a_hand_installed_library_file_is_replaced_by_the_link(tmp_path: Path, host: Path, no_proc: Path) -> None:
    host.mkdir(parents=True)
    (host / LIBRARY_NAME).write_bytes(b"from HAMi's installer")
    name = install(make_source(tmp_path / "src", "v1", b"one"), host, proc_dir=no_proc).name
    assert current_name(host) == name and (host / LIBRARY_NAME).read_bytes() == b"one"


def test_a_directory_at_the_link_path_is_refused(tmp_path: Path, host: Path, no_proc: Path) -> None:
    (host / LIBRARY_NAME).mkdir(parents=True)
    with pytest.raises(InstallError, match="is a directory"):
        install(make_source(tmp_path / "src", "v1", b"one"), host, proc_dir=no_proc)


def _installer(source: Path, host: Path, proc: Path) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    argv = [sys.executable, "-m", "kube_vgpu.cli", "limiter", "install", f"--source-dir={source}",
            f"--host-dir={host}", f"--proc-dir={proc}"]
    return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_concurrent_installers_on_one_node_wait_for_each_other(tmp_path: Path, host: Path, no_proc: Path) -> None:
    source = make_source(tmp_path / "src", "v1", b"one" * 100_000)
    host.mkdir(parents=True)
    lock = os.open(host / LOCK_NAME, os.O_RDWR | os.O_CREAT)
    fcntl.flock(lock, fcntl.LOCK_EX)  # a third installer holds the node
    try:
        installers = [_installer(source, host, no_proc) for _ in range(3)]
        time.sleep(1.5)
        assert all(proc.poll() is None for proc in installers), "an installer ran without the lock"
        assert not (host / VERSIONS_DIR).exists() or not any((host / VERSIONS_DIR).iterdir())
    finally:
        os.close(lock)
    outputs = [proc.communicate(timeout=60)[0] for proc in installers]
    assert [proc.returncode for proc in installers] == [0, 0, 0], outputs
    assert sum("copied," in out for out in outputs) == 1, outputs  # one copied, the others found it in place
    name = name_of("v1", b"one" * 100_000)
    assert verified_name(host) == name and installed_versions(host) == [name]
    assert not list(host.rglob(".tmp-*"))


def test_concurrent_installers_of_two_versions_end_consistent(tmp_path: Path, host: Path, no_proc: Path) -> None:
    one = make_source(tmp_path / "one", "v1", b"one" * 200_000)
    two = make_source(tmp_path / "two", "v2", b"two" * 200_000)
    installers = [_installer(source, host, no_proc) for source in (one, two, one, two)]
    outputs = [proc.communicate(timeout=60)[0] for proc in installers]
    assert [proc.returncode for proc in installers] == [0, 0, 0, 0], outputs
    current = verified_name(host)
    assert current in (name_of("v1", b"one" * 200_000), name_of("v2", b"two" * 200_000))
    assert json.loads((host / STATUS_NAME).read_text())["name"] == current
    assert sorted(installed_versions(host)) == sorted([name_of("v1", b"one" * 200_000),
                                                        name_of("v2", b"two" * 200_000)])


def test_rollback_to_the_previous_and_to_a_named_version(tmp_path: Path, host: Path, no_proc: Path) -> None:
    for index, content in enumerate((b"one", b"two", b"three"), start=1):
        install(make_source(tmp_path / f"s{index}", f"v{index}", content), host, proc_dir=no_proc)
    assert rollback(host) == name_of("v2", b"two")
    assert (host / LIBRARY_NAME).read_bytes() == b"two" and verified_name(host) == name_of("v2", b"two")
    assert json.loads((host / STATUS_NAME).read_text())["version"] == "v2"
    assert kube_vgpu_main(["limiter", "rollback", f"--host-dir={host}", f"--to={name_of('v1', b'one')}"]) == 0
    assert (host / LIBRARY_NAME).read_bytes() == b"one"
    # a new install of a kept version switches back without a copy
    result = install(make_source(tmp_path / "s3", "v3", b"three"), host, proc_dir=no_proc)
    assert (result.copied, result.switched) == (False, True)


def test_rollback_refuses_unknown_and_corrupt_versions(tmp_path: Path, host: Path, no_proc: Path) -> None:
    install(make_source(tmp_path / "s1", "v1", b"one"), host, proc_dir=no_proc)
    with pytest.raises(InstallError, match="no version to roll back to"):
        rollback(host)
    install(make_source(tmp_path / "s2", "v2", b"two"), host, proc_dir=no_proc)
    with pytest.raises(InstallError, match="not installed"):
        rollback(host, "v9-000000000000")
    (host / VERSIONS_DIR / name_of("v1", b"one") / LIBRARY_NAME).write_bytes(b"rot")
    with pytest.raises(InstallError, match="corrupt"):
        rollback(host)
    assert current_name(host) == name_of("v2", b"two")


def _fake_proc(proc: Path, pid: int, mount_roots: list[str]) -> None:
    (proc / str(pid) / "ns").mkdir(parents=True)
    (proc / str(pid) / "ns" / "mnt").symlink_to(f"mnt:[{4026530000 + pid}]")
    lines = [f"{100 + i} 99 8:1 {root} /usr/local/vgpu/libvgpu.so ro,relatime - ext4 /dev/sda1 rw"
             for i, root in enumerate(mount_roots)]
    (proc / str(pid) / "mountinfo").write_text("\n".join(["1 0 8:1 / / rw - ext4 /dev/sda1 rw", *lines]) + "\n")


def test_garbage_collection_keeps_current_recent_and_in_use(tmp_path: Path, host: Path, no_proc: Path) -> None:
    names = []
    for index in range(1, 6):
        content = f"library {index}".encode()
        install(make_source(tmp_path / f"s{index}", f"v{index}", content), host, keep=10, proc_dir=no_proc)
        names.append(name_of(f"v{index}", content))
        time.sleep(0.01)  # distinct mtimes: the order versions were made current
    proc = tmp_path / "hostproc"
    # v1 is still mounted by a running container (seen through the host's PID namespace)
    _fake_proc(proc, 4242, [f"/usr/local/vgpu/{VERSIONS_DIR}/{names[0]}/{LIBRARY_NAME}"])
    assert versions_in_use(proc) == {names[0]}
    removed = install(make_source(tmp_path / "s5", "v5", b"library 5"), host, keep=1, proc_dir=proc).removed
    assert sorted(removed) == sorted(names[1:3])  # v2, v3: neither current, recent (v4) nor in use (v1)
    assert sorted(installed_versions(host)) == sorted([names[0], names[3], names[4]])
    # keep=0: only the current one and the one in use; never the current one
    assert set(collect_garbage(host, 0, set())) == {names[3], names[0]}
    assert installed_versions(host) == [names[4]]
    assert verified_name(host) == names[4]


def test_status_command(tmp_path: Path, host: Path, no_proc: Path, capsys: pytest.CaptureFixture[str]) -> None:
    name = install(make_source(tmp_path / "s1", "v1", b"one"), host, proc_dir=no_proc).name
    assert kube_vgpu_main(["limiter", "status", f"--host-dir={host}"]) == 0
    assert json.loads(capsys.readouterr().out) == {"current": name, "verified": True, "versions": [name]}
