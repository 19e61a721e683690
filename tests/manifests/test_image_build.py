"""The image built from the Dockerfile and exercised: `kube-vgpu --help`, `extender --help`, `webhook --help` and the
device plugin on the fake NVML (serving /healthz and /metrics), as uid 65532, on a read-only root filesystem with a
tmpfs /tmp (what a pod with readOnlyRootFilesystem and an emptyDir on /tmp gets); no compiler in the final image; the
limiter laid out under /opt/kube-vgpu/limiter/; the size reported and kept under a ceiling.

No registry is reachable where this suite runs, so nothing is pulled (--pull=never):
- the base is a Debian bookworm root filesystem made by debootstrap from the mirror apt already uses (python3 and
  python3-venv included; the Dockerfile's BASE_IMAGE build argument points at it instead of python:*-slim-bookworm);
- the limiter is a clearly labelled PLACEHOLDER shared object (LIMITER_STAGE=limiter-prebuilt): the limiter-build
  stage (HAMi-core from GitHub against nvidia/cuda's headers) needs GitHub and the CUDA image, neither reachable here,
  so that stage is NOT executed by this test.

Everything is cached under ${XDG_CACHE_HOME:-~/.cache}/kube-vgpu/image-test/<key>/ (key: mirror, suite, packages and
the recipe below): the base image and buildah's own storage (--root/--runroot: /var/lib/containers is not touched),
behind a lock file so concurrent runs wait for each other. The image itself is rebuilt on every run (--layers: only
what changed is redone). buildah's storage driver is overlay where the kernel allows it, else vfs (which copies the
whole root filesystem at every step: several times slower, several GB). Without buildah, debootstrap or root the test
skips, and fails under CI=true. Measured on the shared 2-core development machine (docs/install.md "Building the
image"): cold 2.5 min (debootstrap + base 64-95 s, build ~60 s), warm ~10 s (build 5 s), overlay; vfs cold 3 min."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.manifests.render import ROOT
from tests.manifests.test_dockerfile import DOCKERFILE, parse, stages

pytestmark = [pytest.mark.image, pytest.mark.timeout(1800)]

SUITE = "bookworm"
BASE_PACKAGES = ("python3", "python3-venv")
#: bump when the way the base is made changes, so old caches are not reused
BASE_RECIPE = "1"
BASE_IMAGE = f"localhost/kube-vgpu-test-base:{SUITE}"
IMAGE = "localhost/kube-vgpu:image-test"
USER = 65532
#: the final image (the Debian base is ~135 MB, python:3.11-slim ~125 MB; the venv ~230 MB, kubernetes 126 MB of it)
SIZE_CEILING_MB = 450
#: what the image adds on top of its base: the venv and the limiter (285 MB since numpy, which bfgd's batch placement
#: needs, came in with its OpenBLAS; its test suite is dropped in the build)
ADDED_CEILING_MB = 300
#: the builder's storage beyond which old builds' layers are pruned before building
STORAGE_CEILING_BYTES = 4 * 1024**3
#: one word, as `kube-vgpu limiter install` requires (it names the node's version directory and label)
PLACEHOLDER_VERSION = "PLACEHOLDER-not-hami-core"
COMPILERS = ("gcc", "cc", "c++", "g++", "clang", "tcc")
#: an unprivileged, read-only container: bind the root read-only, tmpfs on /tmp and /dev (with the usual devices),
#: a private /proc, then chroot and drop to uid/gid 65532 with no supplementary groups
READ_ONLY_RUNNER = r"""
import json, os, subprocess, sys
target, env, argv = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3:]
def mount(*args):
    subprocess.run(["mount", *args], check=True)
mount("--bind", target, target)  # in this private mount namespace only
mount("-t", "tmpfs", "-o", "mode=1777,size=64m,nosuid,nodev", "tmpfs", target + "/tmp")
mount("-t", "proc", "proc", target + "/proc")
mount("-t", "tmpfs", "-o", "mode=755,size=1m,nosuid", "tmpfs", target + "/dev")
for name in ("null", "zero", "random", "urandom"):
    open(f"{target}/dev/{name}", "w").close()
    mount("--bind", f"/dev/{name}", f"{target}/dev/{name}")
mount("-o", "remount,bind,ro", target)
os.chroot(target)
os.chdir("/")
os.setgroups([])
os.setgid(int(os.environ["RUN_AS"]))
os.setuid(int(os.environ["RUN_AS"]))
os.execvpe(argv[0], argv, env)
"""


def _du_bytes(path: Path) -> int:
    return sum(entry.lstat().st_size for entry in path.rglob("*")) if path.is_dir() else 0


def _cache_root() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kube-vgpu" / "image-test"


def debian_mirror() -> str:
    """The Debian mirror apt uses here (deb822 .sources or one-line .list), else deb.debian.org;
    $KUBE_VGPU_DEBIAN_MIRROR overrides."""
    if os.environ.get("KUBE_VGPU_DEBIAN_MIRROR"):
        return os.environ["KUBE_VGPU_DEBIAN_MIRROR"]
    candidates: list[str] = []
    for path in sorted(Path("/etc/apt").glob("sources.list.d/*.sources")):
        for stanza in re.split(r"\n\s*\n", path.read_text(errors="replace")):
            fields = dict(re.findall(r"^(\w[\w-]*):\s*(.*)$", stanza, re.MULTILINE))
            if "deb" in fields.get("Types", "").split() and SUITE in fields.get("Suites", "").split():
                candidates += fields.get("URIs", "").split()
    for path in [Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt").glob("sources.list.d/*.list"))]:
        if path.is_file():
            for line in path.read_text(errors="replace").splitlines():
                match = re.match(r"^deb\s+(?:\[[^]]*\]\s+)?(\S+)\s+(\S+)", line.strip())
                if match and match.group(2) == SUITE:
                    candidates.append(match.group(1))
    for uri in candidates:
        if not uri.rstrip("/").endswith("-security"):
            return uri
    return "http://deb.debian.org/debian"


def _missing_tools() -> str | None:
    missing = [tool for tool in ("buildah", "debootstrap", "unshare", "mount") if shutil.which(tool) is None]
    if missing:
        return f"{', '.join(missing)} not installed (scripts/system-deps.sh installs buildah and debootstrap)"
    if os.geteuid() != 0:
        return "building and running the image here needs root (debootstrap, buildah's chroot isolation, mounts)"
    return None


@dataclass
class Built:
    buildah: list[str]
    container: str
    rootfs: Path
    config: dict[str, object]
    size_mb: float
    base_size_mb: float
    timings: dict[str, float] = field(default_factory=dict)
    cold: bool = False

    def run(self, *argv: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        """argv inside the image with buildah's chroot isolation, as the image's numeric user."""
        return subprocess.run(
            [*self.buildah, "run", "--isolation", "chroot", "--user", f"{USER}:{USER}", self.container, "--", *argv],
            capture_output=True, text=True, timeout=timeout)

    def read_only(self, *argv: str) -> subprocess.Popen[str]:
        """argv inside the image on a read-only root, as uid/gid 65532, in private mount and PID namespaces."""
        image_env = self.config.get("Env")
        assert isinstance(image_env, list)
        environment = dict(item.split("=", 1) for item in image_env)
        environment["HOME"] = "/nonexistent"
        return subprocess.Popen(
            ["unshare", "--mount", "--propagation", "private", "--pid", "--fork", "--kill-child",
             sys.executable, "-c", READ_ONLY_RUNNER, str(self.rootfs), json.dumps(environment), *argv],
            env={**os.environ, "RUN_AS": str(USER)}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _size_mb(buildah: list[str], image: str) -> float:
    [entry] = json.loads(subprocess.run([*buildah, "images", "--json", image], capture_output=True, text=True,
                                        check=True).stdout)
    number, unit = re.fullmatch(r"([\d.]+)\s*([kMG]?B)", entry["size"]).groups()  # type: ignore[union-attr]
    return float(number) * {"B": 1e-6, "kB": 1e-3, "MB": 1.0, "GB": 1e3}[unit]


def _check(command: list[str], what: str, timeout: float = 900) -> str:
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, (
        f"{what} failed ({result.returncode}):\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}")
    return result.stdout


def _make_base(buildah: list[str], workdir: Path, mirror: str) -> None:
    rootfs = workdir / "rootfs"
    shutil.rmtree(rootfs, ignore_errors=True)
    _check(["debootstrap", "--variant=minbase", f"--include={','.join(BASE_PACKAGES)}", SUITE, str(rootfs), mirror],
           f"debootstrap {SUITE} from {mirror}")
    # what Debian's own images leave out: apt's lists and caches, documentation, translations
    for pattern in ("var/lib/apt/lists/*", "var/cache/apt/*.bin", "var/cache/apt/archives/*.deb", "usr/share/doc/*",
                    "usr/share/man/*", "usr/share/info/*", "usr/share/locale/*"):
        for path in rootfs.glob(pattern):
            shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
    container = _check([*buildah, "from", "scratch"], "buildah from scratch").strip()
    try:
        _check([*buildah, "copy", container, f"{rootfs}/", "/"], "buildah copy rootfs")
        _check([*buildah, "commit", "--quiet", container, BASE_IMAGE], "buildah commit base")
    finally:
        subprocess.run([*buildah, "rm", container], capture_output=True)
        shutil.rmtree(rootfs, ignore_errors=True)


def _context(directory: Path) -> None:
    """The build context: what the build stage copies (read from the Dockerfile), .dockerignore, and the placeholder
    limiter at limiter/libvgpu.so."""
    build_stage = next(stage for stage in stages(parse(DOCKERFILE.read_text()))
                       if stage[0].arguments.split()[-1] == "build")
    sources = {part.rstrip("/") for i in build_stage if i.keyword == "COPY"
               for part in i.arguments.split()[:-1] if not part.startswith("--")}
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for name in sorted(sources | {"Dockerfile", ".dockerignore"}):
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, directory / name, symlinks=True, ignore=ignore)
        else:
            shutil.copy2(source, directory / name)
    limiter = directory / "limiter"
    limiter.mkdir()
    compiler = shutil.which("gcc") or shutil.which("cc")
    if compiler:
        source = directory / "placeholder.c"
        source.write_text('const char kube_vgpu_placeholder_limiter[] = "PLACEHOLDER, not HAMi-core";\n')
        _check([compiler, "-shared", "-fPIC", "-o", str(limiter / "libvgpu.so"), str(source)], "placeholder .so")
        source.unlink()
    else:
        (limiter / "libvgpu.so").write_bytes(b"PLACEHOLDER, not HAMi-core: no compiler was found to make an ELF\n")


def _storage_driver() -> str:
    """overlay where the kernel lets buildah mount one (here: yes; ~10x faster and smaller than vfs, which copies the
    whole root filesystem for every build step), else vfs."""
    with tempfile.TemporaryDirectory(prefix="kube-vgpu-overlay-probe-") as directory:
        buildah = ["buildah", "--root", f"{directory}/root", "--runroot", f"{directory}/runroot",
                   "--storage-driver", "overlay"]
        try:
            container = subprocess.run([*buildah, "from", "scratch"], capture_output=True, text=True, timeout=60)
            works = container.returncode == 0 and subprocess.run(
                [*buildah, "mount", container.stdout.strip()], capture_output=True, timeout=60).returncode == 0
            if works:
                subprocess.run([*buildah, "umount", "--all"], capture_output=True, timeout=60)
            subprocess.run([*buildah, "rm", "--all"], capture_output=True, timeout=60)
        except subprocess.TimeoutExpired:
            works = False
        # overlay's own storage leaves mounts behind in some set-ups: buildah unmounts, the directory goes with it
        subprocess.run(["umount", "--recursive", "--lazy", f"{directory}/root/overlay"], capture_output=True)
    return "overlay" if works else "vfs"


def _report(request: pytest.FixtureRequest, text: str) -> None:
    """A line in pytest's output even when output is captured."""
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    if reporter is not None and capture is not None:
        with capture.global_and_fixture_disabled():
            reporter.write_line(f"\n[image] {text}")


@pytest.fixture(scope="module")
def built(request: pytest.FixtureRequest) -> Iterator[Built]:
    missing = _missing_tools()
    if missing:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true but the image cannot be built here: {missing}")
        pytest.skip(missing)
    mirror = debian_mirror()
    driver = os.environ.get("KUBE_VGPU_BUILDAH_DRIVER") or _storage_driver()
    key = hashlib.sha256(f"{mirror}|{SUITE}|{','.join(BASE_PACKAGES)}|{BASE_RECIPE}|{driver}".encode()).hexdigest()
    cache = _cache_root() / key[:16]
    cache.mkdir(parents=True, exist_ok=True)
    (cache / "key.txt").write_text(f"mirror={mirror}\nsuite={SUITE}\npackages={' '.join(BASE_PACKAGES)}\n"
                                   f"recipe={BASE_RECIPE}\ndriver={driver}\n")
    buildah = ["buildah", "--root", str(cache / "storage"), "--runroot", str(cache / "runroot"),
               "--storage-driver", driver]
    timings: dict[str, float] = {}
    with open(cache / "lock", "w") as lock:
        started = time.monotonic()
        fcntl.flock(lock, fcntl.LOCK_EX)
        timings["waited for the lock"] = time.monotonic() - started
        # containers left by an interrupted run are ours (this storage is private to the test): drop them
        subprocess.run([*buildah, "rm", "--all"], capture_output=True)
        if _du_bytes(cache / "storage") > STORAGE_CEILING_BYTES:  # old builds' layers: the next build redoes them
            subprocess.run([*buildah, "rmi", "--prune"], capture_output=True)
        cold = subprocess.run([*buildah, "images", "--quiet", BASE_IMAGE], capture_output=True).returncode != 0
        if cold:
            started = time.monotonic()
            _make_base(buildah, cache, mirror)
            timings["base (debootstrap + commit)"] = time.monotonic() - started
        with tempfile.TemporaryDirectory(prefix="kube-vgpu-context-") as directory:
            _context(Path(directory))
            command = [*buildah, "bud", "--isolation", "chroot", "--pull=never", "--layers",
                       "--build-arg", f"BASE_IMAGE={BASE_IMAGE}",
                       "--build-arg", "LIMITER_STAGE=limiter-prebuilt",
                       "--build-arg", f"LIMITER_VERSION={PLACEHOLDER_VERSION}",
                       "--build-arg", "REVISION=image-test",
                       "--tag", IMAGE, "--file", f"{directory}/Dockerfile"]
            bundle = Path(os.environ.get("PIP_CERT") or os.environ.get("SSL_CERT_FILE") or "")
            if bundle.is_file():  # behind a TLS-intercepting proxy pip needs its CA (a build secret: not kept)
                command += ["--secret", f"id=pip-ca,src={bundle}"]
            started = time.monotonic()
            _check([*command, directory], "buildah bud", timeout=1500)
            timings["image (buildah bud)"] = time.monotonic() - started
        config = json.loads(_check([*buildah, "inspect", "--type", "image", IMAGE], "inspect"))["OCIv1"]["config"]
        container = _check([*buildah, "from", "--pull-never", IMAGE], "buildah from").strip()
        try:
            rootfs = Path(_check([*buildah, "mount", container], "buildah mount").strip())
            result = Built(buildah, container, rootfs, config, _size_mb(buildah, IMAGE),
                           _size_mb(buildah, BASE_IMAGE), timings, cold)
            _report_build(request, result, cache)
            yield result
        finally:
            # ours and the working containers buildah 1.28 leaves behind after a build (still mounted); then the
            # storage's own private mount, which the next run makes again
            subprocess.run([*buildah, "umount", "--all"], capture_output=True)
            subprocess.run([*buildah, "rm", "--all"], capture_output=True)
            if driver == "overlay":
                subprocess.run(["umount", "--lazy", str(cache / "storage" / "overlay")], capture_output=True)


def _report_build(request: pytest.FixtureRequest, result: Built, cache: Path) -> None:
    """Build times (cold: the base made too) and sizes, in pytest's output and in <cache>/last-run.json."""
    timings = result.timings
    total = sum(seconds for what, seconds in timings.items() if what != "waited for the lock")
    _report(request, f"{'cold' if result.cold else 'warm'} build in {total:.0f} s ("
            + ", ".join(f"{what} {seconds:.0f} s" for what, seconds in timings.items())
            + f"); image {result.size_mb:.0f} MB, base {result.base_size_mb:.0f} MB, "
            f"added {result.size_mb - result.base_size_mb:.0f} MB; cache {cache}")
    (cache / "last-run.json").write_text(json.dumps(
        {"cold": result.cold, "timings_s": timings, "image_mb": result.size_mb, "base_mb": result.base_size_mb},
        indent=1))


def test_the_image_runs_as_the_non_root_user_with_kube_vgpu_as_entrypoint(built: Built) -> None:
    assert built.config["User"] == f"{USER}:{USER}"
    assert built.config["Entrypoint"] == ["kube-vgpu"]
    result = built.run("python3", "-c", "import os; print(os.getuid(), os.getgid())")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [str(USER), str(USER)]
    labels = built.config["Labels"]
    assert isinstance(labels, dict) and labels["org.opencontainers.image.base.name"] == BASE_IMAGE


@pytest.mark.parametrize("command", [[], ["extender"], ["webhook"], ["device-plugin"]],
                         ids=["kube-vgpu", "extender", "webhook", "device-plugin"])
def test_help_on_a_read_only_root(built: Built, command: list[str]) -> None:
    process = built.read_only("kube-vgpu", *command, "--help")
    output, _ = process.communicate(timeout=120)
    assert process.returncode == 0, output
    assert output.startswith(f"usage: kube-vgpu {' '.join(command)}".rstrip()), output


def test_the_root_is_read_only_and_tmp_writable_for_uid_65532(built: Built) -> None:
    probe = ("import errno, os\n"
             "assert (os.getuid(), os.getgid(), os.getgroups()) == (65532, 65532, []), (os.getuid(), os.getgroups())\n"
             "for path in ('/opt/kube-vgpu/x', '/x', '/etc/x'):\n"
             "    try:\n"
             "        open(path, 'w')\n"
             "    except OSError as exc:\n"
             "        assert exc.errno == errno.EROFS, (path, exc)\n"
             "    else:\n"
             "        raise SystemExit(f'{path} is writable')\n"
             "open('/tmp/x', 'w').write('ok')\n"
             "print('read-only ok')\n")
    process = built.read_only("python3", "-c", probe)
    output, _ = process.communicate(timeout=60)
    assert process.returncode == 0 and "read-only ok" in output, output


def _free_port() -> int:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        return int(listener.getsockname()[1])


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status, response.read().decode()
    except OSError as exc:
        return getattr(exc, "code", 0) or 0, str(exc)


def test_the_device_plugin_serves_fake_gpus_on_a_read_only_root(built: Built) -> None:
    port = _free_port()
    process = built.read_only(
        "kube-vgpu", "device-plugin", "--node-name", "image-test-node", "--fake-nvml", "t4-4-pcie",
        "--kubelet-dir", "/tmp/device-plugins", "--probe-address", f"127.0.0.1:{port}",
        "--pod-resources-socket", "", "--shared-cache-dir", "")
    try:
        deadline = time.monotonic() + 60
        status, body = 0, ""
        while time.monotonic() < deadline and process.poll() is None:
            status, body = _get(f"http://127.0.0.1:{port}/healthz")
            if status == 200:
                break
            time.sleep(0.5)
        assert status == 200, f"/healthz: {status} {body}"
        status, metrics = _get(f"http://127.0.0.1:{port}/metrics")
        assert status == 200, metrics
        gpu_3 = r'kube_vgpu_gpu_utilization_ratio\{gpu="3",model="Tesla T4",node="image-test-node"'
        assert re.search(gpu_3, metrics), metrics[:2000]
        # the plugin itself (PID 1 of its namespace, a child of unshare) runs as 65532
        children = Path(f"/proc/{process.pid}/task/{process.pid}/children").read_text().split()
        assert children, "unshare has no child"
        uids = re.search(r"^Uid:\s+(.*)$", Path(f"/proc/{children[0]}/status").read_text(), re.MULTILINE)
        assert uids and set(uids.group(1).split()) == {str(USER)}
        os.kill(int(children[0]), signal.SIGTERM)
        output, _ = process.communicate(timeout=30)
        assert process.returncode == 0, output
        assert "serving the device plugin API on /tmp/device-plugins/" in output, output
        assert "shutting down" in output, output
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate(timeout=30)


def test_no_compiler_in_the_final_image(built: Built) -> None:
    found = [f"{directory}/{name}" for directory in ("usr/bin", "usr/local/bin", "bin", "opt/kube-vgpu/venv/bin")
             for name in COMPILERS if os.path.lexists(built.rootfs / directory / name)]
    assert not found, f"compilers in the runtime image: {found}"
    assert not list((built.rootfs / "usr/lib/gcc").glob("*/*/cc1")), "gcc's cc1 is in the runtime image"


def test_the_limiter_layout_for_the_installer(built: Built) -> None:
    limiter = built.rootfs / "opt/kube-vgpu/limiter"
    assert sorted(path.name for path in limiter.iterdir()) == ["VERSION", "libvgpu.so", "libvgpu.so.sha256"]
    digest = hashlib.sha256((limiter / "libvgpu.so").read_bytes()).hexdigest()
    assert (limiter / "libvgpu.so.sha256").read_text() == f"{digest}  libvgpu.so\n"  # sha256sum's own format
    assert (limiter / "VERSION").read_text().strip() == PLACEHOLDER_VERSION


def test_the_default_limiter_is_hami_core_built_in_the_cuda_image_which_is_not_reachable_here(built: Built) -> None:
    """The stage graph with LIMITER_STAGE=limiter-build (the default; named explicitly because buildah 1.28 skips a
    stage that FROM names only through an ARG's default): the first step is NVIDIA's CUDA development image, which
    cannot be pulled here, so the HAMi-core build is not executed by this suite."""
    with tempfile.TemporaryDirectory(prefix="kube-vgpu-context-") as directory:
        _context(Path(directory))
        result = subprocess.run(
            [*built.buildah, "bud", "--isolation", "chroot", "--pull=never", "--layers",
             "--build-arg", f"BASE_IMAGE={BASE_IMAGE}", "--build-arg", "LIMITER_STAGE=limiter-build",
             "--tag", "localhost/kube-vgpu:limiter-build", "--file", f"{directory}/Dockerfile", directory],
            capture_output=True, text=True, timeout=300)
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    assert re.search(r"STEP 1/\d+: FROM nvidia/cuda:[\d.]+-devel-ubuntu22\.04 AS limiter-build", output), output
    assert re.search(r"nvidia/cuda:[\d.]+-devel-ubuntu22\.04: image not known", output), output


def test_the_image_stays_small(built: Built) -> None:
    assert built.size_mb < SIZE_CEILING_MB, f"image {built.size_mb:.0f} MB (ceiling {SIZE_CEILING_MB} MB)"
    added = built.size_mb - built.base_size_mb
    assert added < ADDED_CEILING_MB, f"the image adds {added:.0f} MB to its base (ceiling {ADDED_CEILING_MB} MB)"


def test_the_init_containers_install_runs_from_the_image(built: Built) -> None:
    """What the device plugin's init container runs, from the image's own files (the contract between the
    Dockerfile and `kube-vgpu limiter install`), into a host directory (a tmpfs here), then its status."""
    process = built.read_only(
        "sh", "-c", "kube-vgpu limiter install --host-dir /tmp/host && kube-vgpu limiter status --host-dir /tmp/host")
    output, _ = process.communicate(timeout=120)
    assert process.returncode == 0, output
    assert f"{PLACEHOLDER_VERSION}-" in output, output
