"""Cache-key, stamp and prebuilt-directory logic of kube_vgpu.dev.devcluster.binaries, without building anything.

Real files in a tmp dir stand in for the cache; PATH is pointed at a directory without a real `go`, so any
attempt to build shows up as GoNotFoundError (or as the output of a stub `go` script) instead of a long build.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from kube_vgpu.dev.devcluster import binaries
from kube_vgpu.dev.devcluster.binaries import (
    BINARY_NAMES,
    CORE_BINARY_NAMES,
    DEFAULT_BINARY_NAMES,
    ETCD_VERSION,
    KUBERNETES_VERSION,
    KWOK_VERSION,
    BinaryBuildError,
    GoNotFoundError,
    PrebuiltBinariesError,
    ensure_binaries,
)

STUB_SCRIPT = "#!/bin/sh\nexit 0\n"


def _write_executable(path: Path, text: str = STUB_SCRIPT) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


def _write_stamp(keys: dict[str, str]) -> None:
    """Stamp files of both cache homes (each lists the binaries kept there)."""
    for home in (binaries.cache_dir(), binaries.kwok_cache_dir()):
        mine = {name: {"key": key} for name, key in keys.items() if binaries.home_of(name) == home}
        binaries.stamp_path(home).parent.mkdir(parents=True, exist_ok=True)
        binaries.stamp_path(home).write_text(json.dumps({"binaries": mine}))


@pytest.fixture
def no_go_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Fresh cache root, no KUBE_VGPU_BIN_DIR, and a PATH with no `go` on it. Returns the (empty) PATH dir."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv(binaries.BIN_DIR_ENV, raising=False)
    path_dir = tmp_path / "path"
    path_dir.mkdir()
    monkeypatch.setenv("PATH", str(path_dir))
    return path_dir


@pytest.fixture
def cached(no_go_env: Path) -> Path:
    """A cache holding stub executables of every binary and a stamp with the current build keys."""
    for name in BINARY_NAMES:
        _write_executable(binaries.binary_path(name))
    _write_stamp(binaries.build_keys())
    return binaries.bin_dir()


def test_cache_dir_is_keyed_by_kubernetes_version(no_go_env: Path, tmp_path: Path) -> None:
    assert binaries.cache_dir() == tmp_path / "cache" / "kube-vgpu" / f"k8s-{KUBERNETES_VERSION}"
    assert binaries.bin_dir() == binaries.cache_dir() / "bin"


def test_kwok_has_its_own_versioned_cache_dir(no_go_env: Path, tmp_path: Path) -> None:
    assert binaries.kwok_cache_dir() == tmp_path / "cache" / "kube-vgpu" / f"kwok-{KWOK_VERSION}"
    assert binaries.binary_path("kwok") == binaries.kwok_cache_dir() / "bin" / "kwok"
    assert binaries.binary_path("kube-controller-manager") == binaries.bin_dir() / "kube-controller-manager"


def test_build_keys_name_versions_of_every_binary() -> None:
    keys = binaries.build_keys()
    assert set(keys) == set(BINARY_NAMES) == {
        "etcd", "kube-apiserver", "kube-scheduler", "kubectl", "kube-controller-manager", "kwok", "kueue", "helm",
        "promtool", "prometheus",
    }
    assert set(DEFAULT_BINARY_NAMES) == set(BINARY_NAMES) - {"kueue", "helm", "promtool", "prometheus"}  # opt-in
    assert ETCD_VERSION in keys["etcd"]
    for name in ("kube-apiserver", "kube-scheduler", "kubectl", "kube-controller-manager"):
        assert f"k8s.io/kubernetes@{KUBERNETES_VERSION}" in keys[name]
    assert f"sigs.k8s.io/kwok@{KWOK_VERSION}" in keys["kwok"]


def test_cached_binaries_are_returned_without_go(cached: Path) -> None:
    messages: list[str] = []
    paths = ensure_binaries(progress=messages.append)
    assert paths == {name: binaries.binary_path(name) for name in DEFAULT_BINARY_NAMES}
    assert paths["kubectl"] == cached / "kubectl"
    assert messages == []  # nothing was (re)built, nothing to report


def test_only_the_binaries_asked_for_are_needed(cached: Path) -> None:
    # a cluster without lifecycle needs neither kube-controller-manager nor kwok: a stale kwok is not built then
    binaries.binary_path("kwok").unlink()
    assert ensure_binaries(progress=lambda _message: None, names=CORE_BINARY_NAMES) == {
        name: cached / name for name in CORE_BINARY_NAMES
    }
    with pytest.raises(GoNotFoundError):
        ensure_binaries(progress=lambda _message: None)
    with pytest.raises(binaries.BinariesError, match="unknown binaries kubelet"):
        ensure_binaries(progress=lambda _message: None, names=("kubelet",))


def test_stamp_with_other_etcd_version_triggers_rebuild_of_etcd_only(cached: Path) -> None:
    keys = binaries.build_keys()
    keys["etcd"] = keys["etcd"].replace(ETCD_VERSION, "v3.5.21")
    _write_stamp(keys)
    assert binaries.stale_binaries(cached, binaries.read_stamp(binaries.stamp_path())) == ["etcd"]
    with pytest.raises(GoNotFoundError, match=r"go\.dev/doc/install"):
        ensure_binaries(progress=lambda _message: None)


def test_missing_or_non_executable_binary_is_stale(cached: Path) -> None:
    (cached / "kubectl").unlink()
    (cached / "kube-scheduler").chmod(0o644)
    stamp = binaries.read_stamp(binaries.stamp_path())
    assert binaries.stale_binaries(cached, stamp) == ["kube-scheduler", "kubectl"]


@pytest.mark.parametrize("stamp_text", ["", "{not json", "[]", '{"binaries": 3}', '{"binaries": {"etcd": "x"}}'])
def test_missing_or_corrupt_stamp_means_everything_is_rebuilt(cached: Path, stamp_text: str) -> None:
    binaries.stamp_path().write_text(stamp_text)
    stamp = binaries.read_stamp(binaries.stamp_path())
    assert binaries.stale_binaries(cached, stamp) == list(CORE_BINARY_NAMES)
    binaries.stamp_path().unlink()
    assert binaries.read_stamp(binaries.stamp_path()) == {}


def test_bin_dir_env_points_at_prebuilt_binaries(
    no_go_env: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    prebuilt = tmp_path / "prebuilt"
    for name in BINARY_NAMES:
        _write_executable(prebuilt / name)
    monkeypatch.setenv(binaries.BIN_DIR_ENV, str(prebuilt))
    # No stamp and no go needed: the directory is taken as is.
    assert ensure_binaries(progress=lambda _message: None) == {name: prebuilt / name for name in DEFAULT_BINARY_NAMES}
    assert not binaries.cache_dir().exists()


def test_bin_dir_env_missing_binary_is_a_clear_error(
    no_go_env: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    prebuilt = tmp_path / "prebuilt"
    for name in ("etcd", "kube-apiserver", "kube-scheduler"):
        _write_executable(prebuilt / name)
    (prebuilt / "kubectl").write_text("not executable")
    monkeypatch.setenv(binaries.BIN_DIR_ENV, str(prebuilt))
    with pytest.raises(PrebuiltBinariesError, match=r"lacks executable kubectl, kube-controller-manager, kwok"):
        ensure_binaries(progress=lambda _message: None)
    _write_executable(prebuilt / "kubectl")
    assert set(ensure_binaries(progress=lambda _message: None, names=CORE_BINARY_NAMES)) == set(CORE_BINARY_NAMES)


def test_empty_cache_without_go_says_how_to_install_it(no_go_env: Path) -> None:
    with pytest.raises(GoNotFoundError, match="`go` was not found on PATH") as excinfo:
        ensure_binaries(progress=lambda _message: None)
    assert binaries.BIN_DIR_ENV in str(excinfo.value)


def test_too_old_go_is_rejected(no_go_env: Path) -> None:
    _write_executable(
        no_go_env / "go", '#!/bin/sh\n[ "$1 $2" = "env GOVERSION" ] && echo go1.21.13 && exit 0\nexit 2\n'
    )
    with pytest.raises(GoNotFoundError, match=r"go1\.21\.13, older than the go1\.2[0-9] this build needs"):
        ensure_binaries(progress=lambda _message: None)


def test_failed_build_shows_go_output_and_leaves_no_binary(no_go_env: Path) -> None:
    # A stand-in `go` that is new enough but whose every build fails, as a broken proxy or compile error would.
    _write_executable(
        no_go_env / "go",
        "#!/bin/sh\n"
        'if [ "$1 $2" = "env GOVERSION" ]; then echo go1.26.0; exit 0; fi\n'
        "echo 'go: downloading example.com/dep v1.0.0' >&2\n"
        "echo 'cmd/x/main.go:3:2: undefined: somethingBroken' >&2\n"
        'out=""; prev=""\n'
        'for arg; do [ "$prev" = "-o" ] && out="$arg"; prev="$arg"; done\n'
        '[ -n "$out" ] && echo half > "$out"\n'
        "exit 1\n",
    )
    messages: list[str] = []
    with pytest.raises(BinaryBuildError, match="undefined: somethingBroken") as excinfo:
        ensure_binaries(progress=messages.append)
    assert "building etcd failed" in str(excinfo.value)
    assert any("etcd" in message for message in messages)
    # The half-written output was cleaned up, nothing looks built, and the stamp records nothing.
    assert sorted(os.listdir(binaries.bin_dir())) == []
    assert binaries.read_stamp(binaries.stamp_path()) == {}
    assert not (binaries.cache_dir() / "work").exists() or list((binaries.cache_dir() / "work").iterdir()) == []


def test_kubernetes_go_mod_replaces_every_staging_module() -> None:
    upstream = (
        "module k8s.io/kubernetes\n\ngo 1.24.0\n\nrequire (\n\tk8s.io/api v0.0.0\n)\n\n"
        "replace (\n\tk8s.io/api => ./staging/src/k8s.io/api\n"
        "\tk8s.io/client-go => ./staging/src/k8s.io/client-go\n"
        "\tk8s.io/kube-scheduler => ./staging/src/k8s.io/kube-scheduler\n)\n"
    )
    go_mod = binaries.kubernetes_go_mod(upstream)
    assert f"require k8s.io/kubernetes {KUBERNETES_VERSION}" in go_mod
    for module in ("k8s.io/api", "k8s.io/client-go", "k8s.io/kube-scheduler"):
        assert f"\t{module} => {module} {binaries.KUBERNETES_STAGING_VERSION}\n" in go_mod
    assert "=> ./staging" not in go_mod
    with pytest.raises(BinaryBuildError):
        binaries.kubernetes_go_mod("module k8s.io/kubernetes\n")


def test_version_ldflags_set_the_release_version() -> None:
    flags = binaries.kubernetes_version_ldflags("2026-02-10T12:53:36Z")
    assert f"-X k8s.io/component-base/version.gitVersion={KUBERNETES_VERSION}" in flags
    assert f"-X k8s.io/client-go/pkg/version.gitMinor={binaries.KUBERNETES_RELEASE.minor}" in flags
    assert "-X k8s.io/component-base/version.buildDate=2026-02-10T12:53:36Z" in flags


# A stand-in `go` that "builds" tiny scripts printing the right version, so the whole success path (module
# template, version check, atomic rename, stamp, lock) runs for real in well under a second per binary.
FAKE_GO = """#!{python}
import json, os, sys, time
from pathlib import Path

args = sys.argv[1:]
state = Path({state_dir!r})
if args[:2] == ["env", "GOVERSION"]:
    print("go1.26.0")
elif args[:3] == ["mod", "download", "-json"] and args[3].startswith("sigs.k8s.io/kueue@"):
    source = state / "kueue-source"
    source.mkdir(exist_ok=True)
    (source / "go.sum").write_text("sigs.k8s.io/scheduler-library v0.1.0-alpha1 h1:pinned-by-kueue=\\n")
    print(json.dumps({{"Dir": str(source), "Info": ""}}))
elif args[:3] == ["mod", "download", "-json"]:
    (state / "k8s.mod").write_text("replace (\\n\\tk8s.io/api => ./staging/src/k8s.io/api\\n)\\n")
    (state / "k8s.info").write_text(json.dumps({{"Version": "{k8s}", "Time": "2026-02-10T12:53:36Z"}}))
    print(json.dumps({{"GoMod": str(state / "k8s.mod"), "Info": str(state / "k8s.info")}}))
elif args[0] in ("build", "install"):
    if args[0] == "build":
        out = Path(args[args.index("-o") + 1])
        module = Path("go.mod").read_text().splitlines()[0]
        if Path("go.sum").exists():
            module += " with-go.sum:" + Path("go.sum").read_text().split()[0]
    else:  # go install pkg@version: no module of ours, the binary lands in $GOBIN
        out = Path(os.environ["GOBIN"]) / args[-1].split("@")[0].rsplit("/", 1)[-1]
        out.parent.mkdir(parents=True, exist_ok=True)
        module = "install " + args[-1].split("@")[1]
    with (state / "builds.log").open("a") as log:
        log.write(f"{{os.getpid()}} {{args[-1].split('@')[0]}} {{module}}\\n")
    ldflags = next(arg for arg in args if arg.startswith("-ldflags="))
    with (state / "ldflags.log").open("a") as log:
        log.write(f"{{args[-1].split('@')[0]}} {{ldflags}}\\n")
    time.sleep(0.5)  # long enough for a concurrent caller to find the lock taken
    out.write_text(
        "#!/bin/sh\\necho 'etcd Version: {etcd}'; echo 'Kubernetes {k8s}'; echo 'Client Version: {k8s}'\\n"
        "echo 'kwok version v0.7.0 (go1.26.0)'; echo '  -feature-gates string'; echo '{helm}'\\n"
        "echo 'promtool, version {prometheus} (branch: HEAD, revision: )'\\n"
        "echo 'prometheus, version {prometheus} (branch: HEAD, revision: )'\\n"
    )
    out.chmod(0o755)
else:
    sys.exit(f"fake go: unexpected {{args}}")
"""


@pytest.fixture
def fake_go(no_go_env: Path, tmp_path: Path) -> Path:
    """Install the stand-in `go` on PATH; returns the file its builds are logged to."""
    state_dir = tmp_path / "fake-go-state"
    state_dir.mkdir()
    fake = FAKE_GO.format(
        python=sys.executable, state_dir=str(state_dir), k8s=KUBERNETES_VERSION, etcd=ETCD_VERSION[1:],
        helm=binaries.HELM_VERSION,
        prometheus=binaries.PROMETHEUS_RELEASE,
    )
    _write_executable(no_go_env / "go", fake)
    return state_dir / "builds.log"


def test_build_records_stamp_and_second_call_does_not_rebuild(fake_go: Path) -> None:
    # Leftovers of a build that was killed: a half-written binary under its temporary name, a throw-away module.
    _write_executable(binaries.bin_dir() / ".kube-apiserver.partial-99999", "half")
    _write_executable(binaries.cache_dir() / "work" / "kubernetes-killed" / "go.mod", "module x\n")
    messages: list[str] = []
    paths = ensure_binaries(progress=messages.append)
    assert paths == {name: binaries.binary_path(name) for name in DEFAULT_BINARY_NAMES}
    log_lines = fake_go.read_text().splitlines()
    # Etcd and Kubernetes are built from throw-away modules of their own; kwok is `go install`ed as released.
    assert [line.split()[2:] for line in log_lines] == [["module", "kube-vgpu.local/build/etcd"]] + [
        ["module", "kube-vgpu.local/build/kubernetes"]
    ] * 4 + [["install", KWOK_VERSION]]
    built = [line.split()[1] for line in log_lines]
    assert built == [
        "go.etcd.io/etcd/server/v3",
        "k8s.io/kubernetes/cmd/kube-apiserver",
        "k8s.io/kubernetes/cmd/kube-scheduler",
        "k8s.io/kubernetes/cmd/kubectl",
        "k8s.io/kubernetes/cmd/kube-controller-manager",
        "sigs.k8s.io/kwok/cmd/kwok",
    ]
    keys = binaries.build_keys()
    assert binaries.read_stamp(binaries.stamp_path()) == {
        name: keys[name] for name in keys if name not in ("kwok", "kueue", "helm", "promtool", "prometheus")
    }
    assert binaries.read_stamp(binaries.stamp_path(binaries.kwok_cache_dir())) == {"kwok": keys["kwok"]}
    assert any("kube-apiserver" in message and "done in" in message for message in messages)
    # Only the final names are left: no partial outputs, no throw-away modules.
    assert sorted(os.listdir(binaries.bin_dir())) == sorted(set(DEFAULT_BINARY_NAMES) - {"kwok"})
    assert os.listdir(binaries.bin_dir(binaries.kwok_cache_dir())) == ["kwok"]
    for home in (binaries.cache_dir(), binaries.kwok_cache_dir()):
        assert list((home / "work").iterdir()) == []

    ensure_binaries(progress=messages.append)
    assert len(fake_go.read_text().splitlines()) == len(DEFAULT_BINARY_NAMES)


def test_kueue_is_built_on_request_in_a_module_carrying_kueues_own_go_sum(fake_go: Path) -> None:
    # the checksum database refuses one of Kueue's dependencies: its own go.sum must sit beside our go.mod
    messages: list[str] = []
    paths = ensure_binaries(progress=messages.append, names=("kueue",))
    assert paths == {"kueue": binaries.kueue_cache_dir() / "bin" / "kueue"}
    (line,) = fake_go.read_text().splitlines()
    assert line.split()[1:] == ["sigs.k8s.io/kueue/cmd/kueue", "module", "kube-vgpu.local/build/kueue",
                                "with-go.sum:sigs.k8s.io/scheduler-library"]
    stamp = binaries.read_stamp(binaries.stamp_path(binaries.kueue_cache_dir()))
    assert stamp == {"kueue": f"sigs.k8s.io/kueue@{binaries.KUEUE_VERSION} recipe={binaries.RECIPE_VERSION}"}
    ensure_binaries(progress=messages.append, names=("kueue",))  # cached now: not built again
    assert len(fake_go.read_text().splitlines()) == 1
    assert binaries.kueue_version_ldflags("2026-01-01T00:00:00Z") == (
        f"-X sigs.k8s.io/kueue/pkg/version.GitVersion={binaries.KUEUE_VERSION} "
        "-X sigs.k8s.io/kueue/pkg/version.BuildDate=2026-01-01T00:00:00Z")


def test_helm_is_built_on_request_with_go_install_and_the_makefiles_version_flags(fake_go: Path) -> None:
    messages: list[str] = []
    paths = ensure_binaries(progress=messages.append, names=("helm",))
    assert paths == {"helm": binaries.helm_cache_dir() / "bin" / "helm"}
    assert binaries.helm_cache_dir().name == f"helm-{binaries.HELM_VERSION}"
    # Helm's own go.mod and go.sum, as released: `go install <package>@<version>`, no module of ours
    (line,) = fake_go.read_text().splitlines()
    assert line.split()[1:] == ["helm.sh/helm/v3/cmd/helm", "install", binaries.HELM_VERSION]
    (ldflags,) = (fake_go.parent / "ldflags.log").read_text().splitlines()
    # the version `helm version` reports, and the Kubernetes release of Helm's client-go for template and lint
    for flag in (f"-X helm.sh/helm/v3/internal/version.version={binaries.HELM_VERSION}",
                 "-X helm.sh/helm/v3/pkg/chartutil.k8sVersionMajor=1",
                 "-X helm.sh/helm/v3/pkg/chartutil.k8sVersionMinor=37",
                 "-X helm.sh/helm/v3/pkg/lint/rules.k8sVersionMinor=37"):
        assert flag in ldflags
    stamp = binaries.read_stamp(binaries.stamp_path(binaries.helm_cache_dir()))
    assert stamp == {"helm": f"helm.sh/helm/v3@{binaries.HELM_VERSION} recipe={binaries.RECIPE_VERSION}"}
    assert os.listdir(binaries.bin_dir(binaries.helm_cache_dir())) == ["helm"]
    assert any(f"Helm {binaries.HELM_VERSION}" in message for message in messages)
    assert not binaries.cache_dir().exists()  # nothing of the default set was built for it
    ensure_binaries(progress=messages.append, names=("helm",))  # cached now: not built again
    assert len(fake_go.read_text().splitlines()) == 1


def test_promtool_is_installed_on_request_from_prometheus_s_own_module_with_its_version(fake_go: Path) -> None:
    # opt-in like Kueue (only the monitoring manifests' tests need it), cached in a home of its own
    assert "promtool" in BINARY_NAMES and "promtool" not in DEFAULT_BINARY_NAMES
    messages: list[str] = []
    paths = ensure_binaries(progress=messages.append, names=("promtool",))
    home = binaries.prometheus_cache_dir()
    assert home.name == f"prometheus-{binaries.PROMETHEUS_VERSION}"
    assert paths == {"promtool": home / "bin" / "promtool"}
    # `go install module/cmd/promtool@version`: Prometheus's own go.mod and go.sum, no module of ours
    (line,) = fake_go.read_text().splitlines()
    assert line.split()[1:] == ["github.com/prometheus/prometheus/cmd/promtool", "install", "v0.316.0"]
    (flags,) = (fake_go.parent / "ldflags.log").read_text().splitlines()
    assert "-X github.com/prometheus/common/version.Version=3.16.0" in flags
    stamp = binaries.read_stamp(binaries.stamp_path(home))
    assert stamp == {"promtool": f"github.com/prometheus/prometheus@v0.316.0 tags=remove_all_sd "
                                 f"recipe={binaries.RECIPE_VERSION}"}
    assert os.listdir(home / "bin") == ["promtool"] and list((home / "work").iterdir()) == []
    assert any("[promtool] done in" in message for message in messages)
    ensure_binaries(progress=messages.append, names=("promtool",))  # cached now: not built again
    assert len(fake_go.read_text().splitlines()) == 1


def test_the_prometheus_server_is_installed_on_request_beside_promtool_from_the_same_module(fake_go: Path) -> None:
    # opt-in (the Prometheus e2e and `dev-cluster up --prometheus`): same module, version, tag and version flags as
    # promtool, in the same cache home, so the Go build cache serves the packages both share
    assert "prometheus" in BINARY_NAMES and "prometheus" not in DEFAULT_BINARY_NAMES
    messages: list[str] = []
    paths = ensure_binaries(progress=messages.append, names=("promtool", "prometheus"))
    home = binaries.prometheus_cache_dir()
    assert paths == {"promtool": home / "bin" / "promtool", "prometheus": home / "bin" / "prometheus"}
    lines = [line.split()[1:] for line in fake_go.read_text().splitlines()]
    assert lines == [["github.com/prometheus/prometheus/cmd/promtool", "install", "v0.316.0"],
                     ["github.com/prometheus/prometheus/cmd/prometheus", "install", "v0.316.0"]]
    flags = (fake_go.parent / "ldflags.log").read_text().splitlines()
    assert len(flags) == 2 and all("-X github.com/prometheus/common/version.Version=3.16.0" in f for f in flags)
    stamp = binaries.read_stamp(binaries.stamp_path(home))
    assert stamp["prometheus"] == stamp["promtool"] == (f"github.com/prometheus/prometheus@v0.316.0 "
                                                        f"tags=remove_all_sd recipe={binaries.RECIPE_VERSION}")
    assert sorted(os.listdir(home / "bin")) == ["prometheus", "promtool"]
    ensure_binaries(progress=messages.append, names=("prometheus",))  # cached now: not built again
    assert len(fake_go.read_text().splitlines()) == 2


def test_concurrent_callers_build_each_binary_once(fake_go: Path) -> None:
    repo_root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(repo_root), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "kube_vgpu.dev.devcluster.binaries"]
    callers = [
        subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)
    ]
    outputs = [caller.communicate(timeout=60) for caller in callers]
    assert [caller.returncode for caller in callers] == [0, 0], outputs
    print("\n".join(stderr for _stdout, stderr in outputs))  # shows who waited for the lock, with `pytest -s`
    for stdout, _stderr in outputs:
        assert f"kube-apiserver: {binaries.bin_dir() / 'kube-apiserver'}" in stdout
    built = sorted(line.split()[1] for line in fake_go.read_text().splitlines())
    assert built == sorted(
        [
            "go.etcd.io/etcd/server/v3",
            "k8s.io/kubernetes/cmd/kube-apiserver",
            "k8s.io/kubernetes/cmd/kube-scheduler",
            "k8s.io/kubernetes/cmd/kubectl",
            "k8s.io/kubernetes/cmd/kube-controller-manager",
            "sigs.k8s.io/kwok/cmd/kwok",
        ]
    )


# --- which Kubernetes release ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("", binaries.DEFAULT_KUBERNETES_VERSION),
        ("v1.37.2", "v1.37.2"),
        ("1.35.4", "v1.35.4"),  # the leading v is optional
        (" v1.36.3 ", "v1.36.3"),
    ],
)
def test_release_chosen_by_environment(value: str, expected: str) -> None:
    release = binaries.selected_release({binaries.KUBERNETES_VERSION_ENV: value})
    assert release.version == expected


def test_unknown_release_is_refused_with_the_choices() -> None:
    with pytest.raises(SystemExit) as raised:
        binaries.selected_release({binaries.KUBERNETES_VERSION_ENV: "v1.33.0"})
    message = str(raised.value)
    assert "v1.33.0" in message and "v1.37.2" in message and "v1.35.4" in message


@pytest.mark.parametrize(
    ("version", "staging", "etcd", "go_line"),
    [("v1.37.2", "v0.37.2", "v3.7.0", (1, 26)), ("v1.36.3", "v0.36.3", "v3.6.8", (1, 26)),
     ("v1.35.4", "v0.35.4", "v3.6.5", (1, 25))],
)
def test_release_table(version: str, staging: str, etcd: str, go_line: tuple[int, int]) -> None:
    release = binaries.KUBERNETES_RELEASES[version]
    assert (release.staging_version, release.etcd_version, release.min_go) == (staging, etcd, go_line)


def test_oldest_supported_release_is_in_the_table_and_is_the_oldest() -> None:
    oldest = binaries.KUBERNETES_RELEASES[binaries.OLDEST_SUPPORTED_KUBERNETES_VERSION]
    assert all(oldest.minor <= release.minor for release in binaries.KUBERNETES_RELEASES.values())
