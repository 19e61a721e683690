"""Installs the in-container limiter (HAMi-core's libvgpu.so) shipped in kube-vgpu's image onto a node.

Run by the device-plugin DaemonSet's init container (`kube-vgpu limiter install`). Layout of the host directory:

    <host-dir>/libvgpu.so            symlink -> versions/<name>/libvgpu.so (relative): the path the webhook and the
                                     device plugin mount into GPU containers
    <host-dir>/ld.so.preload         one line, <host-dir>/libvgpu.so (the webhook's ld-so-preload mode mounts it)
    <host-dir>/installed.json        {"name", "version", "sha256"} of the current version, for people and tools
    <host-dir>/versions/<name>/      one directory per installed version, <name> = <version>-<sha256[:12]>:
                                     libvgpu.so, libvgpu.so.sha256, VERSION
    <host-dir>/.lock                 flock: one installer (or rollback) at a time on a node

Why a symlink switched by rename: kubelet checks a hostPath volume's `type: File` with stat (which follows the link)
and the container runtime bind-mounts the path, and mount(2) resolves the link at that moment. A running container
therefore holds the inode of the version that was current when it started; replacing the link (rename(2) of a new
link over it: atomic, a reader sees the old or the new target, never no file) changes only what containers started
afterwards get. The same holds for a version directory deleted later: the bind mount keeps its inode alive, so even
garbage collection cannot take a library from under a running container; it only frees the disk once they end.

"In use": a version is kept while a mount of its library shows in some /proc/<pid>/mountinfo visible to the
installer (world-readable, no capability needed). That sees every container only when the pod shares the host's PID
namespace; without hostPID it sees none, and the last `keep` versions (by the time they were made current) are what
is kept. The current version is never deleted.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import re
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from kube_vgpu import protocol

# The image's contract (the Dockerfile puts these there).
DEFAULT_SOURCE_DIR = Path("/opt/kube-vgpu/limiter")
LIBRARY_NAME = "libvgpu.so"
CHECKSUM_NAME = "libvgpu.so.sha256"  # sha256sum's format: "<hex>  libvgpu.so"
VERSION_NAME = "VERSION"  # one line, e.g. the HAMi-core commit

#: The node directory: where the webhook's and the device plugin's default library path lives.
DEFAULT_HOST_DIR = Path(os.path.dirname(protocol.DEFAULT_LIMITER_LIBRARY_PATH))
VERSIONS_DIR = "versions"
STATUS_NAME = "installed.json"
LD_SO_PRELOAD_NAME = os.path.basename(protocol.DEFAULT_LIMITER_LD_SO_PRELOAD_PATH)
LOCK_NAME = ".lock"
#: Versions kept besides the current one and those in use: room for a rollback without a copy.
DEFAULT_KEEP = 3
DEFAULT_LOCK_TIMEOUT_S = 120.0

_SHA12 = 12
#: A version becomes a directory name and part of a node label value (63 characters at most, with "-" and 12 hex).
_VERSION_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,49}$")
_SHA256_PATTERN = re.compile(r"^[0-9a-f]{64}$")
_TMP_PREFIX = ".tmp-"
_CHUNK_BYTES = 1 << 20


class InstallError(Exception):
    """The install or rollback was refused; the message says why. Nothing was switched."""


@dataclass(frozen=True, slots=True)
class Source:
    library: Path
    version: str
    sha256: str

    @property
    def name(self) -> str:
        return version_name(self.version, self.sha256)


@dataclass(frozen=True, slots=True)
class InstallResult:
    name: str
    copied: bool  # False: that version was already installed intact
    switched: bool  # False: it was already current
    removed: tuple[str, ...]  # versions garbage-collected


def version_name(version: str, sha256: str) -> str:
    return f"{version}-{sha256[:_SHA12]}"


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def _read_checksum(path: Path) -> str:
    try:
        line = path.read_text(encoding="utf-8").strip().splitlines()
    except OSError as exc:
        raise InstallError(f"cannot read checksum file {path}: {exc.strerror}") from None
    parts = line[0].split() if line else []
    if not parts or not _SHA256_PATTERN.match(parts[0].lower()):
        raise InstallError(f"{path} is not in sha256sum format ('<64 hex digits>  {LIBRARY_NAME}')")
    if len(parts) > 1 and os.path.basename(parts[1].lstrip("*")) != LIBRARY_NAME:
        raise InstallError(f"{path} is the checksum of {parts[1]}, not of {LIBRARY_NAME}")
    return parts[0].lower()


def read_source(source_dir: Path) -> Source:
    """The library, version and checksum shipped in `source_dir`, the checksum verified. Raises InstallError."""
    try:
        lines = (source_dir / VERSION_NAME).read_text(encoding="utf-8").split()
    except OSError as exc:
        raise InstallError(f"cannot read {source_dir / VERSION_NAME}: {exc.strerror}") from None
    version = lines[0] if len(lines) == 1 else ""
    if not _VERSION_PATTERN.match(version):
        raise InstallError(
            f"{source_dir / VERSION_NAME} must hold one word of letters, digits, '.', '_' or '-' (at most 50 "
            f"characters), got {' '.join(lines)[:80]!r}"
        )
    expected = _read_checksum(source_dir / CHECKSUM_NAME)
    library = source_dir / LIBRARY_NAME
    try:
        actual = sha256_of(library)
    except OSError as exc:
        raise InstallError(f"cannot read {library}: {exc.strerror}") from None
    if actual != expected:
        raise InstallError(f"checksum mismatch: {library} has sha256 {actual}, {CHECKSUM_NAME} says {expected}")
    return Source(library, version, expected)


# ---------------------------------------------------------------------------------------------------------------
# Small atomic file operations
# ---------------------------------------------------------------------------------------------------------------


def _tmp_name(directory: Path, base: str) -> Path:
    return directory / f"{_TMP_PREFIX}{base}.{os.getpid()}.{time.monotonic_ns()}"


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: Path, data: bytes, mode: int = 0o644) -> None:
    """Temp file, fsync, rename: a reader sees the old content or the new, never a part."""
    tmp = _tmp_name(path.parent, path.name)
    try:
        with open(tmp, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    _fsync_dir(path.parent)


def _copy_atomic(source: Path, path: Path, expected_sha256: str) -> None:
    tmp = _tmp_name(path.parent, path.name)
    try:
        with open(source, "rb") as src, open(tmp, "wb") as dst:
            shutil.copyfileobj(src, dst, _CHUNK_BYTES)
            dst.flush()
            os.fsync(dst.fileno())
        copied = sha256_of(tmp)  # what reached the disk, not what was read
        if copied != expected_sha256:
            raise InstallError(f"copy of {source} to {path} has sha256 {copied}, expected {expected_sha256}")
        os.chmod(tmp, 0o644)  # read-only for everyone but root; containers mount it read-only anyway
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    _fsync_dir(path.parent)


@contextmanager
def host_lock(host_dir: Path, timeout_s: float = DEFAULT_LOCK_TIMEOUT_S) -> Iterator[None]:
    """An exclusive flock on <host-dir>/.lock: installers on one node (two pods of the DaemonSet during a rollout, a
    rollback by hand) run one after the other. The kernel drops it when a holder dies."""
    fd = os.open(host_dir / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.EACCES) or time.monotonic() > deadline:
                    raise InstallError(f"another installer holds {host_dir / LOCK_NAME} ({timeout_s:g} s)") from None
                time.sleep(0.05)
        yield
    finally:
        os.close(fd)  # releases the lock


# ---------------------------------------------------------------------------------------------------------------
# The host directory
# ---------------------------------------------------------------------------------------------------------------


def _link_target(name: str) -> str:
    return f"{VERSIONS_DIR}/{name}/{LIBRARY_NAME}"


def current_name(host_dir: Path) -> str | None:
    """The version <host-dir>/libvgpu.so points to, None when it is no link of ours."""
    try:
        target = os.readlink(host_dir / LIBRARY_NAME)
    except OSError:
        return None
    parts = target.split("/")
    if len(parts) == 3 and parts[0] == VERSIONS_DIR and parts[2] == LIBRARY_NAME and parts[1]:
        return parts[1]
    return None


def installed_versions(host_dir: Path) -> list[str]:
    """Installed version names, the most recently made current first."""
    root = host_dir / VERSIONS_DIR
    try:
        entries = [entry for entry in os.scandir(root) if entry.is_dir(follow_symlinks=False)
                   and not entry.name.startswith(".")]
    except FileNotFoundError:
        return []
    entries.sort(key=lambda entry: (entry.stat(follow_symlinks=False).st_mtime_ns, entry.name), reverse=True)
    return [entry.name for entry in entries]


def verified_name(host_dir: Path) -> str | None:
    """The current version's name when <host-dir>/libvgpu.so leads to an intact library of ours (its sha256 that of
    its version directory's checksum file), else None: what the device plugin's node label says."""
    name = current_name(host_dir)
    if name is None:
        return None
    directory = host_dir / VERSIONS_DIR / name
    try:
        expected = _read_checksum(directory / CHECKSUM_NAME)
        return name if sha256_of(directory / LIBRARY_NAME) == expected else None
    except (InstallError, OSError):
        return None


def _intact(directory: Path, sha256: str) -> bool:
    try:
        return sha256_of(directory / LIBRARY_NAME) == sha256 and _read_checksum(directory / CHECKSUM_NAME) == sha256
    except (InstallError, OSError):
        return False


def _place(source: Source, host_dir: Path) -> bool:
    """versions/<name>/ holding the source's files; True when something had to be (re)written."""
    directory = host_dir / VERSIONS_DIR / source.name
    if _intact(directory, source.sha256):
        return False
    directory.mkdir(parents=True, exist_ok=True)
    _fsync_dir(directory.parent)
    # a present but corrupt library is replaced by rename: a container that mounted it keeps its own inode
    _copy_atomic(source.library, directory / LIBRARY_NAME, source.sha256)
    _write_atomic(directory / CHECKSUM_NAME, f"{source.sha256}  {LIBRARY_NAME}\n".encode())
    _write_atomic(directory / VERSION_NAME, f"{source.version}\n".encode())
    return True


def _switch(host_dir: Path, name: str, sha256: str) -> bool:
    """Point <host-dir>/libvgpu.so at `name` (rename of a new symlink over it) and write the status file. True
    when the link changed."""
    link = host_dir / LIBRARY_NAME
    if link.is_dir() and not link.is_symlink():
        raise InstallError(f"{link} is a directory (created by a hostPath volume of type DirectoryOrCreate?): "
                           "remove it, then install again")
    changed = current_name(host_dir) != name
    if changed:
        tmp = _tmp_name(host_dir, LIBRARY_NAME)
        try:
            os.symlink(_link_target(name), tmp)
            os.replace(tmp, link)
        finally:
            tmp.unlink(missing_ok=True)
        _fsync_dir(host_dir)
    # made current now: the order garbage collection keeps versions in
    os.utime(host_dir / VERSIONS_DIR / name)
    version = name[: -(_SHA12 + 1)]
    status = json.dumps({"name": name, "version": version, "sha256": sha256}, indent=2).encode() + b"\n"
    if _read_bytes(host_dir / STATUS_NAME) != status:
        _write_atomic(host_dir / STATUS_NAME, status)
    return changed


def _read_bytes(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except OSError:
        return None


_MOUNT_ROOT = re.compile(rf"/{VERSIONS_DIR}/([^/]+)/{re.escape(LIBRARY_NAME)}$")


def versions_in_use(proc_dir: Path = Path("/proc")) -> set[str]:
    """Version names whose library is bind-mounted in some mount namespace visible under `proc_dir` (field 4 of
    mountinfo, the mount's root in its filesystem, ends in versions/<name>/libvgpu.so)."""
    found: set[str] = set()
    seen_namespaces: set[str] = set()
    try:
        pids = [entry.name for entry in os.scandir(proc_dir) if entry.name.isdigit()]
    except OSError:
        return found
    for pid in pids:
        try:
            namespace = os.readlink(proc_dir / pid / "ns" / "mnt")
        except OSError:
            namespace = ""  # unreadable: read its mountinfo anyway
        if namespace and namespace in seen_namespaces:
            continue  # every process of a container shares one mount namespace: read it once
        try:
            text = (proc_dir / pid / "mountinfo").read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue  # exited meanwhile
        if namespace:
            seen_namespaces.add(namespace)
        for line in text.splitlines():
            fields = line.split(" ")
            if len(fields) > 4:
                match = _MOUNT_ROOT.search(fields[3].replace("\\040", " "))
                if match:
                    found.add(match.group(1))
    return found


def collect_garbage(host_dir: Path, keep: int, in_use: set[str]) -> tuple[str, ...]:
    """Delete versions that are neither current, among the `keep` most recently current before it, nor in use; and
    leftover temp files of interrupted installers (call under the lock)."""
    current = current_name(host_dir)
    ordered = installed_versions(host_dir)
    previous = [name for name in ordered if name != current]
    kept = {current, *previous[:keep], *in_use}
    removed = []
    for name in ordered:
        if name not in kept:
            shutil.rmtree(host_dir / VERSIONS_DIR / name, ignore_errors=True)
            removed.append(name)
    for directory in (host_dir, host_dir / VERSIONS_DIR, *(host_dir / VERSIONS_DIR / name for name in kept if name)):
        for leftover in directory.glob(_TMP_PREFIX + "*"):
            leftover.unlink(missing_ok=True)
    return tuple(removed)


def install(
    source_dir: Path = DEFAULT_SOURCE_DIR,
    host_dir: Path = DEFAULT_HOST_DIR,
    *,
    keep: int = DEFAULT_KEEP,
    proc_dir: Path = Path("/proc"),
    lock_timeout_s: float = DEFAULT_LOCK_TIMEOUT_S,
) -> InstallResult:
    """Verify the source, install it as versions/<name>, make it current, collect garbage. Raises InstallError
    (then nothing was switched)."""
    if keep < 0:
        raise InstallError(f"keep must be at least 0, got {keep}")
    source = read_source(source_dir)  # before anything is written on the node
    (host_dir / VERSIONS_DIR).mkdir(parents=True, exist_ok=True)
    with host_lock(host_dir, lock_timeout_s):
        copied = _place(source, host_dir)
        switched = _switch(host_dir, source.name, source.sha256)
        # names the link, which never moves: written by install only, where host_dir is the node's own path (a
        # rollback may run with the node's root mounted elsewhere, e.g. kubectl debug node's /host)
        preload = f"{host_dir / LIBRARY_NAME}\n".encode()
        if _read_bytes(host_dir / LD_SO_PRELOAD_NAME) != preload:
            _write_atomic(host_dir / LD_SO_PRELOAD_NAME, preload)
        removed = collect_garbage(host_dir, keep, versions_in_use(proc_dir))
    return InstallResult(source.name, copied, switched, removed)


def rollback(
    host_dir: Path = DEFAULT_HOST_DIR, to: str | None = None, *, lock_timeout_s: float = DEFAULT_LOCK_TIMEOUT_S
) -> str:
    """Make a kept version current again: `to`, or the one current before the present one. Its library is checked
    against its checksum file first. Returns its name; raises InstallError."""
    with host_lock(host_dir, lock_timeout_s):
        current = current_name(host_dir)
        ordered = [name for name in installed_versions(host_dir) if name != current]
        if to is None:
            if not ordered:
                raise InstallError(f"no version to roll back to in {host_dir / VERSIONS_DIR} besides {current}")
            to = ordered[0]
        elif to not in ordered and to != current:
            kept = ", ".join(ordered) or "none"
            raise InstallError(f"version {to} is not installed in {host_dir / VERSIONS_DIR} (kept: {kept})")
        directory = host_dir / VERSIONS_DIR / to
        try:
            sha256 = _read_checksum(directory / CHECKSUM_NAME)
        except InstallError as exc:
            raise InstallError(f"version {to} cannot be verified: {exc}") from None
        if not _intact(directory, sha256):
            raise InstallError(f"version {to} is corrupt ({directory / LIBRARY_NAME} does not match its checksum)")
        _switch(host_dir, to, sha256)
    return to
