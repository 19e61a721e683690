"""Build (once) and locate the Kubernetes control-plane binaries the dev cluster and the end-to-end tests run.

The binaries (etcd, kube-apiserver, kube-controller-manager, kube-scheduler, kubectl, and KWOK's kwok) are compiled
with the machine's Go from the official Go modules, so nothing but a Go toolchain and the Go module proxy is needed:

* Kubernetes: a throw-away module requires ``k8s.io/kubernetes`` and ``replace``s every staging module
  (``k8s.io/api``, ``k8s.io/client-go``, ...; upstream's go.mod points them at ``./staging/src/...``, which a
  dependency cannot use) with the matching published ``v0.x.y`` release.
* etcd: a throw-away module requires ``go.etcd.io/etcd/server/v3``, whose root package is etcd's ``main``.
* kwok (sigs.k8s.io/kwok, pod and node lifecycle without kubelets): ``go install sigs.k8s.io/kwok/cmd/kwok@<version>``,
  which builds with KWOK's own go.mod and go.sum as released.
* kueue (sigs.k8s.io/kueue, the real Kueue controller, opt-in): ``go install`` is refused (the proxy does not list
  Kueue's versions), so a throw-away module requires ``sigs.k8s.io/kueue`` and carries **Kueue's own go.sum** from the
  module: the checksum database refuses one of its dependencies (``sigs.k8s.io/scheduler-library``), whose hash
  Kueue's go.sum pins. Kueue's CRDs, webhook configurations and RBAC are read from the same module
  (``kueue_source_dir()``), so they always match the binary.
* helm (helm.sh/helm/v3, opt-in: the chart's tests): ``go install helm.sh/helm/v3/cmd/helm@<version>`` with Helm's
  own go.mod and go.sum, and the ``-X`` flags of Helm's Makefile: without them ``helm version`` says ``v3.22`` and
  ``helm lint``/``helm template`` assume Kubernetes 1.20 (``.Capabilities.KubeVersion``, the deprecated-API check)
  instead of the release Helm's client-go is from.
* promtool (github.com/prometheus/prometheus, opt-in: the monitoring manifests' tests check and unit-test the alert
  rules and the dashboard's queries with it): ``go install .../cmd/promtool@<version>`` with Prometheus's own go.mod
  and go.sum, and the ``-X .../common/version`` flags Prometheus's own build (promu) sets.

Results are cached under ``${XDG_CACHE_HOME:-~/.cache}/kube-vgpu/k8s-<version>/bin`` (Kubernetes and etcd) and
``.../kube-vgpu/kwok-<version>/bin`` (kwok, versioned on its own; ``kueue-<version>/bin`` and
``helm-<version>/bin``, ``prometheus-<version>/bin`` too), each with a stamp
file recording what each binary was built from and a build lock, so later calls return at once.
``KUBE_VGPU_BIN_DIR`` points at prebuilt binaries instead (nothing is built then).

Run ``python -m kube_vgpu.dev.devcluster.binaries [NAME...]`` to build and print the paths (default: the
DEFAULT_BINARY_NAMES; e.g. ``... binaries promtool`` for promtool alone).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class KubernetesRelease:
    """One Kubernetes release the dev cluster can run, with the etcd its go.mod pins and the Go it declares."""

    version: str
    etcd_version: str
    min_go: tuple[int, int]

    @property
    def staging_version(self) -> str:
        """The staging modules (k8s.io/api, k8s.io/client-go, ...) are published as v0.<minor>.<patch>."""
        return "v0." + self.version[1:].split(".", 1)[1]

    @property
    def minor(self) -> int:
        return int(self.version[1:].split(".")[1])


# The etcd of each release is the one its go.mod requires (go.etcd.io/etcd/server/v3), which its
# build/dependencies.yaml and kubeadm pin too; min_go is the `go` line of the two go.mod files.
KUBERNETES_RELEASES: dict[str, KubernetesRelease] = {
    release.version: release
    for release in (
        KubernetesRelease("v1.37.2", "v3.7.0", (1, 26)),
        KubernetesRelease("v1.36.3", "v3.6.8", (1, 26)),
        KubernetesRelease("v1.35.4", "v3.6.5", (1, 25)),
    )
}
DEFAULT_KUBERNETES_VERSION = "v1.37.2"
#: The oldest release we claim to support (README); `make test-oldest-k8s` runs the end-to-end tier against it.
OLDEST_SUPPORTED_KUBERNETES_VERSION = "v1.35.4"
KUBERNETES_VERSION_ENV = "KUBE_VGPU_K8S_VERSION"


def selected_release(environ: Mapping[str, str] = os.environ) -> KubernetesRelease:
    """The release named by KUBE_VGPU_K8S_VERSION (default: the newest); an unknown name is refused, not guessed."""
    name = environ.get(KUBERNETES_VERSION_ENV, "").strip() or DEFAULT_KUBERNETES_VERSION
    if not name.startswith("v"):
        name = "v" + name
    try:
        return KUBERNETES_RELEASES[name]
    except KeyError:
        raise SystemExit(
            f"{KUBERNETES_VERSION_ENV}={name} is not a Kubernetes release kube-vgpu's dev cluster knows; "
            f"choose one of {', '.join(KUBERNETES_RELEASES)}"
        ) from None


# Chosen once per process: every binary, cache directory and version check below must agree on it.
KUBERNETES_RELEASE = selected_release()
KUBERNETES_VERSION = KUBERNETES_RELEASE.version
KUBERNETES_STAGING_VERSION = KUBERNETES_RELEASE.staging_version
ETCD_VERSION = KUBERNETES_RELEASE.etcd_version
MIN_GO_VERSION = KUBERNETES_RELEASE.min_go
# The `go` line of our throw-away modules: the release's own, so Go neither refuses nor rewrites it.
_GO_LINE = f"{MIN_GO_VERSION[0]}.{MIN_GO_VERSION[1]}.0"
# KWOK (kubelet-less pod/node lifecycle); v0.7.0 declares `go 1.24`; it only talks to the API (pods, nodes).
KWOK_VERSION = "v0.7.0"
# The Kueue controller (opt-in: ClusterOptions.kueue); v0.19.2 declares `go 1.26.0`.
KUEUE_VERSION = "v0.19.2"
KUEUE_MODULE = "sigs.k8s.io/kueue"
KUEUE_MIN_GO_VERSION = (1, 26)
# Helm (opt-in: the chart's tests, charts/kube-vgpu); v3.22.0 declares `go 1.26.0` and requires k8s.io/client-go
# v0.37.0, the Kubernetes release its Makefile stamps into `.Capabilities.KubeVersion` and the lint rules.
HELM_VERSION = "v3.22.0"
HELM_MODULE = "helm.sh/helm/v3"
HELM_MIN_GO_VERSION = (1, 26)
HELM_KUBERNETES_VERSION = (1, 37)
# promtool (opt-in), from Prometheus 3.16.0, whose Go module versions are v0.3xx (v0.316.0 = 3.16.0); its go.mod
# declares `go 1.26.7`.
PROMETHEUS_VERSION = "v0.316.0"
PROMETHEUS_RELEASE = "3.16.0"
PROMETHEUS_MODULE = "github.com/prometheus/prometheus"
PROMETHEUS_MIN_GO_VERSION = (1, 26)
# The Prometheus Operator whose CRDs (PodMonitor, ServiceMonitor, PrometheusRule) the monitoring manifests are checked
# against: read from its Go module (prometheus_operator_crd_dir()), nothing built.
PROMETHEUS_OPERATOR_VERSION = "v0.85.0"
PROMETHEUS_OPERATOR_MODULE = "github.com/prometheus-operator/prometheus-operator"
# Bump whenever the build recipe (flags, ldflags, module template) changes, so existing caches are rebuilt.
RECIPE_VERSION = 1

BIN_DIR_ENV = "KUBE_VGPU_BIN_DIR"
# Optional override of `go build -p`; the default keeps a 2-core / 24 GiB machine from swapping while linking.
BUILD_PARALLELISM_ENV = "KUBE_VGPU_GO_BUILD_PARALLELISM"
#: The control plane every dev cluster runs.
CORE_BINARY_NAMES: tuple[str, ...] = ("etcd", "kube-apiserver", "kube-scheduler", "kubectl")
#: What ClusterOptions.lifecycle adds: Jobs/Deployments create pods, KWOK runs and finishes them.
LIFECYCLE_BINARY_NAMES: tuple[str, ...] = ("kube-controller-manager", "kwok")
#: What ClusterOptions.kueue adds: the real Kueue controller.
KUEUE_BINARY_NAMES: tuple[str, ...] = ("kueue",)
#: What the Helm chart's tests add: helm.
HELM_BINARY_NAMES: tuple[str, ...] = ("helm",)
#: What the monitoring manifests' tests add: Prometheus's promtool (rules, rule unit tests, PromQL) and the Prometheus
#: server itself (tests/e2e/test_prometheus_e2e.py scrapes the dev cluster with it; `dev-cluster up --prometheus`).
PROMETHEUS_BINARY_NAMES: tuple[str, ...] = ("promtool", "prometheus")
BINARY_NAMES: tuple[str, ...] = (
    CORE_BINARY_NAMES + LIFECYCLE_BINARY_NAMES + KUEUE_BINARY_NAMES + HELM_BINARY_NAMES + PROMETHEUS_BINARY_NAMES
)
#: What ensure_binaries() builds unless told: Kueue, helm and promtool are opt-in (minutes more on a first run).
DEFAULT_BINARY_NAMES: tuple[str, ...] = CORE_BINARY_NAMES + LIFECYCLE_BINARY_NAMES

HEARTBEAT_INTERVAL_S = 30.0
OUTPUT_TAIL_LINES = 40
VERSION_CHECK_TIMEOUT_S = 60.0

_GO_INSTALL_HELP = (
    "The Kubernetes binaries are built from source with Go >= {min_go}. Install it from https://go.dev/doc/install "
    "(a tarball from https://go.dev/dl/ unpacked into /usr/local, then add /usr/local/go/bin to PATH; or the "
    "distribution's golang package if it is new enough), or set {env} to a directory that already holds etcd, "
    "kube-apiserver, kube-scheduler, kubectl, kube-controller-manager and kwok."
)

# Template of the throw-away module for the Kubernetes binaries; {replaces} is filled from upstream's go.mod.
_KUBERNETES_GO_MOD = """\
module kube-vgpu.local/build/kubernetes

go {go_line}

require k8s.io/kubernetes {kubernetes_version}

// Upstream replaces these with ./staging/src/... paths, which only work inside its own repository.
replace (
{replaces}
)
"""

# Kueue's own go.sum sits beside this go.mod (see the module docstring); `go build` resolves the rest from it.
_KUEUE_GO_MOD = """\
module kube-vgpu.local/build/kueue

go {go_line}

require {module} {kueue_version}
"""

_ETCD_GO_MOD = """\
module kube-vgpu.local/build/etcd

go {go_line}

require go.etcd.io/etcd/server/v3 {etcd_version}
"""

_STAGING_REPLACE_RE = re.compile(r"^\s*(k8s\.io/[A-Za-z0-9._-]+)\s+=>\s+\./staging/", re.MULTILINE)


class BinariesError(RuntimeError):
    """Base class of the errors raised while locating or building the binaries."""


class GoNotFoundError(BinariesError):
    """No usable Go toolchain to build the binaries with."""


class BinaryBuildError(BinariesError):
    """`go` failed; the message carries the tail of its output."""


class PrebuiltBinariesError(BinariesError):
    """KUBE_VGPU_BIN_DIR is set but does not hold all the binaries."""


@dataclass(frozen=True)
class _Target:
    name: str
    source: str  # "kubernetes", "etcd", "kueue" (throw-away modules), "kwok", "helm" or "prometheus" (go install of
    # the released module, with its own go.mod and go.sum)
    package: str
    version_args: tuple[str, ...]
    version_text: str  # must appear in the output of `<binary> <version_args>`


_TARGETS: tuple[_Target, ...] = (
    _Target("etcd", "etcd", "go.etcd.io/etcd/server/v3", ("--version",), f"etcd Version: {ETCD_VERSION[1:]}"),
    _Target(
        "kube-apiserver",
        "kubernetes",
        "k8s.io/kubernetes/cmd/kube-apiserver",
        ("--version",),
        f"Kubernetes {KUBERNETES_VERSION}",
    ),
    _Target(
        "kube-scheduler",
        "kubernetes",
        "k8s.io/kubernetes/cmd/kube-scheduler",
        ("--version",),
        f"Kubernetes {KUBERNETES_VERSION}",
    ),
    _Target(
        "kubectl",
        "kubernetes",
        "k8s.io/kubernetes/cmd/kubectl",
        ("version", "--client"),
        f"Client Version: {KUBERNETES_VERSION}",
    ),
    _Target(
        "kube-controller-manager",
        "kubernetes",
        "k8s.io/kubernetes/cmd/kube-controller-manager",
        ("--version",),
        f"Kubernetes {KUBERNETES_VERSION}",
    ),
    # kwok's version is a constant of its source (pkg/consts.Version), printed as "kwok version v0.7.0 ...".
    _Target("kwok", "kwok", "sigs.k8s.io/kwok/cmd/kwok", ("--version",), KWOK_VERSION[1:]),
    # kueue has no version flag (it logs its version when it starts); its usage names its own flags.
    _Target("kueue", "kueue", f"{KUEUE_MODULE}/cmd/kueue", ("--help",), "-feature-gates"),
    # `helm version --short` prints the version the ldflags set ("v3.22.0"; "v3.22" without them)
    _Target("helm", "helm", f"{HELM_MODULE}/cmd/helm", ("version", "--short"), HELM_VERSION),
    # "promtool, version 3.16.0 (branch: ..., revision: ...)", from the -X flags of prometheus_version_ldflags()
    _Target(
        "promtool",
        "prometheus",
        f"{PROMETHEUS_MODULE}/cmd/promtool",
        ("--version",),
        f"promtool, version {PROMETHEUS_RELEASE} ",
    ),
    # the server, same module, version, tag and flags ("prometheus, version 3.16.0 (branch: ...)"); built without
    # the `builtinassets` tag, so it has no web UI (it would serve web/ui/static from its working directory, which
    # is not there): the HTTP API is all the tests and the dev cluster use
    _Target(
        "prometheus",
        "prometheus",
        f"{PROMETHEUS_MODULE}/cmd/prometheus",
        ("--version",),
        f"prometheus, version {PROMETHEUS_RELEASE} ",
    ),
)
#: The version `go install <package>@<version>` names, for the targets built that way.
_GO_INSTALL_VERSIONS = {"kwok": KWOK_VERSION, "helm": HELM_VERSION, "prometheus": PROMETHEUS_VERSION}
#: Go build tags per source. promtool without Prometheus's service-discovery plugins (its own `remove_all_sd` tag):
#: rule checks, rule unit tests and PromQL need none of them, and the cloud SDKs they pull in are most of its build.
#: The server is built with the same tag: the dev cluster's Prometheus scrapes static targets only.
_BUILD_TAGS = {"prometheus": "remove_all_sd"}
assert tuple(t.name for t in _TARGETS) == BINARY_NAMES
_TARGETS_BY_NAME = {target.name: target for target in _TARGETS}
#: Sources built with `go install <package>@<version>` (their own go.mod and go.sum, as released).

ProgressFn = Callable[[str], object]


# ---------------------------------------------------------------------------------------------------------------
# Cache layout and stamp
# ---------------------------------------------------------------------------------------------------------------


def _cache_root() -> Path:
    xdg_cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg_cache) / "kube-vgpu"


def cache_dir() -> Path:
    """Root of this Kubernetes version's cache (read from the environment on every call, for tests)."""
    return _cache_root() / f"k8s-{KUBERNETES_VERSION}"


def kwok_cache_dir() -> Path:
    """Root of this KWOK version's cache: its own versioned directory, so a Kubernetes bump does not rebuild it."""
    return _cache_root() / f"kwok-{KWOK_VERSION}"


def kueue_cache_dir() -> Path:
    """Root of this Kueue version's cache (its own directory, like KWOK's)."""
    return _cache_root() / f"kueue-{KUEUE_VERSION}"


def helm_cache_dir() -> Path:
    """Root of this Helm version's cache (its own directory, like KWOK's)."""
    return _cache_root() / f"helm-{HELM_VERSION}"
def prometheus_cache_dir() -> Path:
    """Root of this Prometheus version's cache (promtool; its own directory, like KWOK's)."""
    return _cache_root() / f"prometheus-{PROMETHEUS_VERSION}"


def home_of(name: str) -> Path:
    """The cache root (bin/, stamp.json, build.lock) a binary belongs to."""
    source = _TARGETS_BY_NAME[name].source
    if source == "kwok":
        return kwok_cache_dir()
    if source == "kueue":
        return kueue_cache_dir()
    if source == "helm":
        return helm_cache_dir()
    if source == "prometheus":
        return prometheus_cache_dir()
    return cache_dir()


def bin_dir(home: Path | None = None) -> Path:
    return (home or cache_dir()) / "bin"


def stamp_path(home: Path | None = None) -> Path:
    return (home or cache_dir()) / "stamp.json"


def binary_path(name: str) -> Path:
    return bin_dir(home_of(name)) / name


def build_keys() -> dict[str, str]:
    """What each binary must have been built from; a cached binary whose stamp differs is rebuilt."""
    keys: dict[str, str] = {}
    for target in _TARGETS:
        if target.source == "etcd":
            source = f"go.etcd.io/etcd/server/v3@{ETCD_VERSION}"
        elif target.source == "kwok":
            source = f"sigs.k8s.io/kwok@{KWOK_VERSION}"
        elif target.source == "kueue":
            source = f"{KUEUE_MODULE}@{KUEUE_VERSION}"
        elif target.source == "helm":
            source = f"{HELM_MODULE}@{HELM_VERSION}"
        elif target.source == "prometheus":
            source = f"{PROMETHEUS_MODULE}@{PROMETHEUS_VERSION} tags={_BUILD_TAGS['prometheus']}"
        else:
            source = f"k8s.io/kubernetes@{KUBERNETES_VERSION}"
        keys[target.name] = f"{source} recipe={RECIPE_VERSION}"
    return keys


def read_stamp(path: Path) -> dict[str, str]:
    """Build keys recorded in the stamp file: binary name -> key. Missing or unreadable stamp -> {} (rebuild)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    binaries = data.get("binaries") if isinstance(data, dict) else None
    if not isinstance(binaries, dict):
        return {}
    keys: dict[str, str] = {}
    for name, entry in binaries.items():
        if isinstance(entry, dict) and isinstance(entry.get("key"), str):
            keys[str(name)] = entry["key"]
    return keys


def _record_built(path: Path, name: str, key: str, go_version: str, build_s: float) -> None:
    """Add one binary to the stamp file, atomically (a reader never sees a half-written stamp)."""
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict) or not isinstance(data.get("binaries"), dict):
            data = {}
    except (OSError, ValueError):
        data = {}
    data.setdefault("binaries", {})[name] = {"key": key, "go_version": go_version, "build_s": round(build_s, 1)}
    source = _TARGETS_BY_NAME[name].source
    if source == "kwok":
        data["kwok_version"] = KWOK_VERSION
    elif source == "kueue":
        data["kueue_version"] = KUEUE_VERSION
    elif source == "helm":
        data["helm_version"] = HELM_VERSION
    elif source == "prometheus":
        data["prometheus_version"] = PROMETHEUS_VERSION
    else:
        data["kubernetes_version"] = KUBERNETES_VERSION
        data["etcd_version"] = ETCD_VERSION
    _atomic_write_text(path, json.dumps(data, indent=2, sort_keys=True) + "\n")


def _atomic_write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def _is_executable_file(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


def stale_binaries(directory: Path, stamp: Mapping[str, str], names: Iterable[str] = CORE_BINARY_NAMES) -> list[str]:
    """Of `names` (kept in `directory`), those that must be (re)built: missing, not executable, or stamped with
    another version/recipe."""
    expected = build_keys()
    return [name for name in names if not _is_executable_file(directory / name) or stamp.get(name) != expected[name]]


# ---------------------------------------------------------------------------------------------------------------
# Public entry point
# ---------------------------------------------------------------------------------------------------------------


def ensure_binaries(progress: ProgressFn = print, names: Iterable[str] = DEFAULT_BINARY_NAMES) -> dict[str, Path]:
    """Return the paths of the binaries named (default: DEFAULT_BINARY_NAMES, all but Kueue and promtool),
    building what is not cached yet.

    The first build takes many minutes (progress is reported through ``progress``); later calls only stat files.
    """
    wanted = [name for name in BINARY_NAMES if name in set(names)]
    unknown = sorted(set(names) - set(BINARY_NAMES))
    if unknown:
        raise BinariesError(f"unknown binaries {', '.join(unknown)} (known: {', '.join(BINARY_NAMES)})")
    override = os.environ.get(BIN_DIR_ENV)
    if override:
        return _prebuilt_binaries(Path(override), wanted)

    paths = {name: binary_path(name) for name in wanted}
    homes = list(dict.fromkeys(home_of(name) for name in wanted))  # k8s first, then kwok, kueue, helm, prometheus
    for home in homes:
        group = [name for name in wanted if home_of(name) == home]
        directory = bin_dir(home)
        if not stale_binaries(directory, read_stamp(stamp_path(home)), group):
            continue
        go = _find_go()
        go_version = _go_version(go, _min_go_of(home))
        home.mkdir(parents=True, exist_ok=True)
        with _exclusive_lock(home / "build.lock", progress):
            # Another process may have built some or all of them while we waited for the lock.
            todo = stale_binaries(directory, read_stamp(stamp_path(home)), group)
            if todo:
                _build(go, go_version, home, todo, progress)
    return paths


def _min_go_of(home: Path) -> tuple[int, int]:
    """The `go` line of the module(s) built into this cache home."""
    if home == kueue_cache_dir():
        return KUEUE_MIN_GO_VERSION
    if home == helm_cache_dir():
        return HELM_MIN_GO_VERSION
    if home == prometheus_cache_dir():
        return PROMETHEUS_MIN_GO_VERSION
    return MIN_GO_VERSION


def _prebuilt_binaries(directory: Path, names: Sequence[str]) -> dict[str, Path]:
    paths = {name: directory / name for name in names}
    missing = [name for name, path in paths.items() if not _is_executable_file(path)]
    if missing:
        raise PrebuiltBinariesError(
            f"{BIN_DIR_ENV}={directory} lacks executable {', '.join(missing)}; it must hold "
            f"{', '.join(names)} (Kubernetes {KUBERNETES_VERSION}, etcd {ETCD_VERSION}, kwok {KWOK_VERSION} "
            f"recommended). Unset {BIN_DIR_ENV} to have them built from source with Go."
        )
    return paths


# ---------------------------------------------------------------------------------------------------------------
# Go toolchain
# ---------------------------------------------------------------------------------------------------------------


def _install_help() -> str:
    return _GO_INSTALL_HELP.format(min_go=".".join(map(str, MIN_GO_VERSION)), env=BIN_DIR_ENV)


def _find_go() -> str:
    go = shutil.which("go")
    if go is None:
        raise GoNotFoundError(f"`go` was not found on PATH. {_install_help()}")
    return go


def _go_version(go: str, minimum: tuple[int, int] = MIN_GO_VERSION) -> str:
    """The toolchain's version (e.g. "go1.26.8"), checked against `minimum` (the module's own `go` line)."""
    try:
        result = subprocess.run(
            [go, "env", "GOVERSION"], env=_go_env(), capture_output=True, text=True, timeout=60, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise GoNotFoundError(f"running `{go} env GOVERSION` failed: {exc}. {_install_help()}") from exc
    version = result.stdout.strip()
    match = re.match(r"go(\d+)\.(\d+)", version)
    if result.returncode != 0 or match is None:
        raise GoNotFoundError(
            f"`{go} env GOVERSION` did not report a Go version (exit {result.returncode}): "
            f"{(result.stdout + result.stderr).strip()[-500:]}. {_install_help()}"
        )
    if (int(match.group(1)), int(match.group(2))) < minimum:
        raise GoNotFoundError(f"{go} is {version}, older than the go{minimum[0]}.{minimum[1]} this build needs. "
                              f"{_install_help()}")
    return version


def _go_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        {
            # The throw-away modules have no go.sum: let go resolve and record checksums itself.
            "GOFLAGS": "-mod=mod",
            "GO111MODULE": "on",
            # A go.work of whatever directory we run in must not leak into the build.
            "GOWORK": "off",
            # Static binaries, and no C compiler needed (upstream builds these binaries with CGO off as well).
            "CGO_ENABLED": "0",
            # Never download another toolchain behind the user's back; the version check above suffices.
            "GOTOOLCHAIN": "local",
        }
    )
    return env


def _build_parallelism() -> int:
    configured = os.environ.get(BUILD_PARALLELISM_ENV)
    if configured:
        try:
            return max(1, int(configured))
        except ValueError:
            raise BinariesError(f"{BUILD_PARALLELISM_ENV}={configured!r} is not a number of jobs") from None
    # Compiling the big Kubernetes packages takes ~1-2 GiB per job; more than 4 jobs buys little.
    return max(1, min(os.cpu_count() or 1, 4))


# ---------------------------------------------------------------------------------------------------------------
# Building
# ---------------------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _exclusive_lock(path: Path, progress: ProgressFn) -> Iterator[None]:
    """Hold an fcntl lock so two concurrent callers do not both spend many minutes building."""
    with path.open("a") as lock_file:
        try:
            fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            progress(f"another process is building the Kubernetes binaries; waiting for the lock on {path}")
            fcntl.flock(lock_file, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)


def _build(go: str, go_version: str, root: Path, names: list[str], progress: ProgressFn) -> None:
    directory = bin_dir(root)
    directory.mkdir(parents=True, exist_ok=True)
    # We hold the lock, so partial outputs and module directories left here are from killed builds.
    for leftover in directory.glob(".*.partial-*"):
        leftover.unlink(missing_ok=True)
    shutil.rmtree(root / "work", ignore_errors=True)
    (root / "work").mkdir()

    targets = [t for t in _TARGETS if t.name in names]
    keys = build_keys()
    total_start_s = time.monotonic()
    if root == kwok_cache_dir():
        versions = f"kwok {KWOK_VERSION}"
    elif root == kueue_cache_dir():
        versions = f"Kueue {KUEUE_VERSION}"
    elif root == helm_cache_dir():
        versions = f"Helm {HELM_VERSION}"
    elif root == prometheus_cache_dir():
        versions = f"Prometheus {PROMETHEUS_RELEASE} ({PROMETHEUS_MODULE}@{PROMETHEUS_VERSION})"
    else:
        versions = f"Kubernetes {KUBERNETES_VERSION}, etcd {ETCD_VERSION}"
    progress(
        f"building {', '.join(names)} ({versions}) with {go_version} into {directory}; the first build takes a while"
    )
    for source in ("etcd", "kubernetes", "kwok", "kueue", "helm", "prometheus"):
        source_targets = [t for t in targets if t.source == source]
        if not source_targets:
            continue
        module_dir = Path(tempfile.mkdtemp(prefix=f"{source}-", dir=root / "work"))
        try:
            if source in _GO_INSTALL_VERSIONS:
                # `go install module/cmd@version` builds with the tool's own go.mod and go.sum, as released (a
                # throw-away module would re-resolve its dependencies); the directory only holds GOBIN.
                # helm and promtool also get the version flags their own builds set (`helm version`, `promtool
                # --version` print them)
                ldflags = "-s -w"
                if source == "helm":
                    ldflags += " " + helm_version_ldflags()
                elif source == "prometheus":
                    ldflags += " " + prometheus_version_ldflags()
                for target in source_targets:
                    build_s = _build_one(go, module_dir, target, ldflags, directory, progress)
                    _record_built(stamp_path(root), target.name, keys[target.name], go_version, build_s)
                continue
            if source == "kueue":
                progress(f"fetching {KUEUE_MODULE}@{KUEUE_VERSION} (the module source, with its go.sum)")
                info = _go_mod_download(go, module_dir, f"{KUEUE_MODULE}@{KUEUE_VERSION}")
                shutil.copyfile(Path(info["Dir"]) / "go.sum", module_dir / "go.sum")
                (module_dir / "go.sum").chmod(0o644)  # the module cache's files are read-only
                go_mod = _KUEUE_GO_MOD.format(module=KUEUE_MODULE, kueue_version=KUEUE_VERSION,
                                              go_line=f"{KUEUE_MIN_GO_VERSION[0]}.{KUEUE_MIN_GO_VERSION[1]}.0")
                ldflags = "-s -w " + kueue_version_ldflags(_read_info_time(Path(info.get("Info", ""))))
            elif source == "etcd":
                go_mod = _ETCD_GO_MOD.format(etcd_version=ETCD_VERSION, go_line=_GO_LINE)
                ldflags = "-s -w"
            else:
                progress(f"fetching k8s.io/kubernetes@{KUBERNETES_VERSION} (the module source)")
                info = _go_mod_download(go, module_dir, f"k8s.io/kubernetes@{KUBERNETES_VERSION}")
                go_mod = kubernetes_go_mod(Path(info["GoMod"]).read_text())
                ldflags = "-s -w " + kubernetes_version_ldflags(_read_info_time(Path(info.get("Info", ""))))
            (module_dir / "go.mod").write_text(go_mod)
            for target in source_targets:
                build_s = _build_one(go, module_dir, target, ldflags, directory, progress)
                _record_built(stamp_path(root), target.name, keys[target.name], go_version, build_s)
        finally:
            shutil.rmtree(module_dir, ignore_errors=True)
    progress(f"all binaries ready in {directory} after {time.monotonic() - total_start_s:.0f} s")


def _go_mod_download(go: str, cwd: Path, module_at_version: str) -> dict[str, str]:
    """`go mod download -json`, returning its JSON (paths of the module's go.mod, zip, info)."""
    result = subprocess.run(
        [go, "mod", "download", "-json", module_at_version],
        cwd=cwd,
        env=_go_env(),
        capture_output=True,
        text=True,
        check=False,
    )
    try:
        info = json.loads(result.stdout) if result.stdout.strip() else {}
    except ValueError:
        info = {}
    if result.returncode != 0 or not isinstance(info, dict) or info.get("Error"):
        detail = info.get("Error") if isinstance(info, dict) and info.get("Error") else ""
        raise BinaryBuildError(
            f"`go mod download {module_at_version}` failed (exit {result.returncode}); is the Go module proxy "
            f"({os.environ.get('GOPROXY', 'https://proxy.golang.org')}) reachable?\n"
            + _tail(f"{detail}\n{result.stderr}\n{result.stdout}".strip().splitlines())
        )
    return {str(k): str(v) for k, v in info.items()}


def kubernetes_go_mod(upstream_go_mod: str) -> str:
    """go.mod of the throw-away module: one replace per staging module that upstream's go.mod points at
    ./staging/src/..., to the published release of the same version."""
    staging_modules = sorted(set(_STAGING_REPLACE_RE.findall(upstream_go_mod)))
    if not staging_modules:
        raise BinaryBuildError("found no `=> ./staging/...` replace directives in k8s.io/kubernetes's go.mod")
    replaces = "\n".join(f"\t{module} => {module} {KUBERNETES_STAGING_VERSION}" for module in staging_modules)
    return _KUBERNETES_GO_MOD.format(kubernetes_version=KUBERNETES_VERSION, replaces=replaces, go_line=_GO_LINE)


def kubernetes_version_ldflags(build_date: str) -> str:
    """The -X flags upstream's hack/lib/version.sh sets. Without them the binaries report v0.0.0-master+$Format...
    and the version-skew checks between kube-scheduler/kubectl and kube-apiserver misbehave."""
    major, minor = KUBERNETES_VERSION[1:].split(".")[:2]
    values = {"gitVersion": KUBERNETES_VERSION, "gitMajor": major, "gitMinor": minor, "gitTreeState": "clean"}
    if build_date:
        values["buildDate"] = build_date
    flags: list[str] = []
    for package in ("k8s.io/component-base/version", "k8s.io/client-go/pkg/version"):
        flags += [f"-X {package}.{key}={value}" for key, value in values.items()]
    return " ".join(flags)


def kueue_version_ldflags(build_date: str) -> str:
    """What Kueue's Makefile sets, so its start-up log names the version it runs."""
    flags = [f"-X {KUEUE_MODULE}/pkg/version.GitVersion={KUEUE_VERSION}"]
    if build_date:
        flags.append(f"-X {KUEUE_MODULE}/pkg/version.BuildDate={build_date}")
    return " ".join(flags)


def helm_version_ldflags() -> str:
    """What Helm's Makefile sets: the version `helm version` reports, and the Kubernetes release (that of the
    client-go Helm is built with) `helm template` and `helm lint` assume when they do not ask a cluster."""
    major, minor = HELM_KUBERNETES_VERSION
    flags = [f"-X {HELM_MODULE}/internal/version.version={HELM_VERSION}",
             f"-X {HELM_MODULE}/internal/version.gitTreeState=clean"]
    for package in ("pkg/lint/rules", "pkg/chartutil"):
        flags += [f"-X {HELM_MODULE}/{package}.k8sVersionMajor={major}",
                  f"-X {HELM_MODULE}/{package}.k8sVersionMinor={minor}"]
    return " ".join(flags)



def prometheus_version_ldflags() -> str:
    """What Prometheus's build (.promu.yml) sets, so `promtool --version` names the release it is."""
    package = "github.com/prometheus/common/version"
    values = {"Version": PROMETHEUS_RELEASE, "Branch": "HEAD", "BuildUser": "kube-vgpu"}
    return " ".join(f"-X {package}.{key}={value}" for key, value in values.items())




def kueue_source_dir(progress: ProgressFn = print) -> Path:
    """The Kueue module's source tree (read-only, in Go's module cache), downloaded if needed: its CRDs
    (config/components/crd/bases), webhook configurations and RBAC. A download of a few MiB; nothing is built."""
    go = _find_go()
    _go_version(go, KUEUE_MIN_GO_VERSION)
    with tempfile.TemporaryDirectory(prefix="kueue-source-") as scratch:
        (Path(scratch) / "go.mod").write_text("module kube-vgpu.local/kueue-source\n")
        info = _go_mod_download(go, Path(scratch), f"{KUEUE_MODULE}@{KUEUE_VERSION}")
    directory = Path(info["Dir"])
    if not (directory / "config" / "components" / "crd" / "bases").is_dir():
        raise BinariesError(f"{KUEUE_MODULE}@{KUEUE_VERSION} in {directory} has no config/components/crd/bases")
    progress(f"Kueue {KUEUE_VERSION} source in {directory}")
    return directory


def prometheus_operator_crd_dir(progress: ProgressFn = print) -> Path:
    """The Prometheus Operator's CRDs (monitoring.coreos.com_*.yaml) from its Go module, downloaded if needed (a few
    MiB into Go's module cache, read-only); nothing is built."""
    go = _find_go()
    _go_version(go, PROMETHEUS_MIN_GO_VERSION)
    with tempfile.TemporaryDirectory(prefix="prometheus-operator-source-") as scratch:
        (Path(scratch) / "go.mod").write_text("module kube-vgpu.local/prometheus-operator-source\n")
        info = _go_mod_download(go, Path(scratch), f"{PROMETHEUS_OPERATOR_MODULE}@{PROMETHEUS_OPERATOR_VERSION}")
    directory = Path(info["Dir"]) / "example" / "prometheus-operator-crd"
    if not (directory / "monitoring.coreos.com_podmonitors.yaml").is_file():
        raise BinariesError(f"{PROMETHEUS_OPERATOR_MODULE}@{PROMETHEUS_OPERATOR_VERSION} has no CRDs in {directory}")
    progress(f"Prometheus Operator {PROMETHEUS_OPERATOR_VERSION} CRDs in {directory}")
    return directory


def _read_info_time(path: Path) -> str:
    """The release's commit time from the module's .info file: a reproducible buildDate (upstream uses
    SOURCE_DATE_EPOCH the same way)."""
    try:
        value = json.loads(path.read_text()).get("Time", "")
    except (OSError, ValueError, AttributeError):
        return ""
    return value if isinstance(value, str) else ""


def _build_one(
    go: str, module_dir: Path, target: _Target, ldflags: str, directory: Path, progress: ProgressFn
) -> float:
    """Build one binary into a temporary name, check it runs, then rename it into place. Returns seconds taken."""
    final = directory / target.name
    partial = directory / f".{target.name}.partial-{os.getpid()}"
    flags = [
        "-v",  # one line per compiled package: the heartbeat counts them
        f"-p={_build_parallelism()}",
        "-trimpath",
        f"-ldflags={ldflags}",
        *([f"-tags={_BUILD_TAGS[target.source]}"] if target.source in _BUILD_TAGS else []),
    ]
    env: dict[str, str] = {}
    if target.source in _GO_INSTALL_VERSIONS:
        # `go install` writes <GOBIN>/<name>; GOBIN is the (otherwise empty) throw-away directory.
        gobin = module_dir / "bin"
        command = [go, "install", *flags, f"{target.package}@{_GO_INSTALL_VERSIONS[target.source]}"]
        env["GOBIN"] = str(gobin)
        verb = "go install"
    else:
        gobin = None
        command = [go, "build", *flags, "-o", str(partial), target.package]
        verb = "go build"
    start_s = time.monotonic()
    progress(f"[{target.name}] {verb} {command[-1]}")
    try:
        _run_go_streaming(command, module_dir, target.name, progress, env)
        if gobin is not None:
            os.replace(gobin / Path(target.package).name, partial)
        _check_version(partial, target)
        os.replace(partial, final)
    finally:
        partial.unlink(missing_ok=True)
    elapsed_s = time.monotonic() - start_s
    size_mib = final.stat().st_size / (1024 * 1024)
    progress(f"[{target.name}] done in {elapsed_s:.0f} s ({size_mib:.0f} MiB)")
    return elapsed_s


@dataclass
class _OutputState:
    """What the reader thread has seen of go's output so far (read by the heartbeat)."""

    packages_compiled: int = 0
    modules_downloaded: int = 0
    last_package: str = ""


def _run_go_streaming(
    command: list[str], cwd: Path, label: str, progress: ProgressFn, extra_env: Mapping[str, str] | None = None
) -> None:
    """Run go, condensing its output into a heartbeat line every HEARTBEAT_INTERVAL_S; raise with the tail on error."""
    tail: deque[str] = deque(maxlen=OUTPUT_TAIL_LINES)
    state = _OutputState()
    lock = threading.Lock()
    start_s = time.monotonic()
    with subprocess.Popen(
        command,
        cwd=cwd,
        env={**_go_env(), **(extra_env or {})},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
    ) as process:
        assert process.stdout is not None

        def read_output() -> None:
            assert process.stdout is not None
            for raw_line in process.stdout:
                line = raw_line.rstrip("\n")
                with lock:
                    tail.append(line)
                    if line.startswith("go: downloading "):
                        state.modules_downloaded += 1
                    elif line and " " not in line and not line.startswith("#"):
                        # `go build -v` prints bare import paths as packages are compiled.
                        state.packages_compiled += 1
                        state.last_package = line

        reader = threading.Thread(target=read_output, name=f"go-output-{label}", daemon=True)
        reader.start()
        try:
            while True:
                try:
                    process.wait(timeout=HEARTBEAT_INTERVAL_S)
                    break
                except subprocess.TimeoutExpired:
                    with lock:
                        progress(
                            f"[{label}] {time.monotonic() - start_s:.0f} s: {state.modules_downloaded} modules "
                            f"downloaded, {state.packages_compiled} packages compiled"
                            + (f" (last: {state.last_package})" if state.last_package else "")
                        )
        except BaseException:
            # Ctrl-C or similar: do not leave go running behind us.
            process.kill()
            raise
        reader.join()
    if process.returncode != 0:
        raise BinaryBuildError(
            f"building {label} failed (exit {process.returncode}) after {time.monotonic() - start_s:.0f} s: "
            f"{' '.join(command)}\n(in {cwd})\n" + _tail(list(tail))
        )


def _check_version(binary: Path, target: _Target) -> None:
    """Run the fresh binary's version command so a broken or mis-stamped build is never cached."""
    try:
        result = subprocess.run(
            [str(binary), *target.version_args],
            capture_output=True,
            text=True,
            timeout=VERSION_CHECK_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise BinaryBuildError(f"the freshly built {target.name} does not run: {exc}") from exc
    output = result.stdout + result.stderr
    if result.returncode != 0 or target.version_text not in output:
        raise BinaryBuildError(
            f"the freshly built {target.name} reports an unexpected version (exit {result.returncode}; expected "
            f"{target.version_text!r}):\n" + _tail(output.splitlines())
        )


def _tail(lines: list[str]) -> str:
    shown = lines[-OUTPUT_TAIL_LINES:]
    return "--- last lines of output ---\n" + "\n".join(shown)


def main(argv: Sequence[str] | None = None) -> int:
    """Build (or find) the binaries named on the command line (default: DEFAULT_BINARY_NAMES) and print their paths."""
    names = list(sys.argv[1:] if argv is None else argv) or list(DEFAULT_BINARY_NAMES)
    start_s = time.monotonic()
    try:
        paths = ensure_binaries(progress=lambda message: print(message, file=sys.stderr, flush=True), names=names)
    except BinariesError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    for name, path in paths.items():
        print(f"{name}: {path}")
    print(f"ready in {time.monotonic() - start_s:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
