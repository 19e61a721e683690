"""The operator docs say only what exists: every `kube-vgpu` command in them parses with the real CLI, every
kustomization and object they name is rendered by the manifests, every metric they list is one the code exports,
and the admission messages they quote are the webhook's own (docs/webhook.md, checked word for word by
tests/webhook/test_denials.py)."""

from __future__ import annotations

import asyncio
import re
import shlex
import tempfile
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest

from kube_vgpu import protocol
from kube_vgpu.cli import build_parser
from kube_vgpu.deviceplugin.discovery import discover
from kube_vgpu.deviceplugin.fakenvml import FakeNvml, load_profile
from kube_vgpu.deviceplugin.metrics import DevicePluginCollector
from kube_vgpu.deviceplugin.nvml import Nvml
from kube_vgpu.deviceplugin.state import DeviceState
from kube_vgpu.extender.quota.factory import build_gate
from kube_vgpu.extender.quota.kueue_mode import KueueModeGate
from kube_vgpu.extender.scheduler import Scheduler
from kube_vgpu.extender.server import create_app
from kube_vgpu.extender.sources.metrics import SourceCollector
from kube_vgpu.extender.sources.snapshot import SnapshotCluster
from kube_vgpu.extender.sources.watch import WatchHealth
from kube_vgpu.extender.state import ClusterState
from kube_vgpu.webhook.metrics import WebhookMetrics
from tests.deviceplugin.regionfiles import Region
from tests.manifests.render import INSTALLABLE, KUSTOMIZATIONS, MANIFESTS, ROOT, containers, render, workloads

DOCS = ("architecture.md", "install.md", "user-guide.md", "operations.md", "troubleshooting.md",
        "migrating-from-hami.md", "dashboard.md")
SHORT_KINDS = {"deployment": "Deployment", "daemonset": "DaemonSet", "job": "Job", "cronjob": "CronJob",
               "certificate": "Certificate", "configmap": "ConfigMap", "service": "Service"}
#: Objects made at run time, not rendered: the Lease (kube-scheduler), the Secrets (the Job or cert-manager).
RUNTIME_OBJECTS = {("lease", "kube-vgpu-scheduler"), ("secret", "kube-vgpu-webhook-tls"),
                   ("secret", "kube-vgpu-webhook-ca")}


def text(name: str) -> str:
    return (ROOT / "docs" / name).read_text()


def shell_lines() -> list[tuple[str, str]]:
    """(doc, command line) for every line of every ```bash block, continuations joined, comments dropped."""
    found = []
    for name in DOCS:
        for block in re.findall(r"```bash\n(.*?)```", text(name), flags=re.S):
            for line in block.replace("\\\n", " ").splitlines():
                line = line.split(" # ")[0].strip()
                if line and not line.startswith("#"):
                    found.append((name, line))
    return found


def commands(program: str) -> list[tuple[str, list[str]]]:
    """(doc, arguments) of every invocation of `program`, also inside pipes, lists and $(...)."""
    result = []
    for name, line in shell_lines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars="|&;()")
        lexer.whitespace_split = True
        segment: list[str] = []
        for token in [*lexer, ";"]:
            if set(token) <= set("|&;()"):
                if segment and segment[0] == program:
                    result.append((name, segment[1:]))
                segment = []
            else:
                segment.append(token)
    return result


def test_the_docs_have_shell_commands() -> None:
    assert len(commands("kubectl")) > 30 and commands("kube-vgpu")


def _command_id(value: object) -> str:
    return " ".join(value) if isinstance(value, list) else str(value)


@pytest.mark.parametrize(("doc", "argv"), commands("kube-vgpu"), ids=_command_id)
def test_every_kube_vgpu_command_in_the_docs_parses(doc: str, argv: list[str]) -> None:
    build_parser(argv).parse_args(argv)


def rendered_names() -> set[tuple[str, str, str | None]]:
    names = set()
    for overlay in (*INSTALLABLE, "examples", "dashboard"):
        for obj in render(overlay):
            names.add((obj["kind"], obj["metadata"]["name"], obj["metadata"].get("namespace")))
    return names


def test_every_kustomization_and_object_the_kubectl_commands_name_exists() -> None:
    names = rendered_names()
    labels = {(k, v) for overlay in INSTALLABLE for w in workloads(render(overlay))
              for k, v in w["spec"].get("selector", {}).get("matchLabels", {}).items()}
    container_names = {c["name"] for overlay in INSTALLABLE for w in workloads(render(overlay))
                       for _, c in containers(w)}
    for doc, argv in commands("kubectl"):
        where = f"{doc}: kubectl {' '.join(argv)}"
        namespace = argv[argv.index("-n") + 1] if "-n" in argv else None
        if "-k" in argv:
            target = argv[argv.index("-k") + 1]
            if not target.startswith("my-"):  # the reader's own overlay (install.md)
                assert target.removeprefix("manifests/") in KUSTOMIZATIONS, where
        for word in argv:
            match = re.fullmatch(r"([a-z]+)/([a-z0-9.$()-]+)", word)
            if match and match.group(1) in SHORT_KINDS and "$" not in word and namespace == "kube-vgpu":
                assert (SHORT_KINDS[match.group(1)], match.group(2), "kube-vgpu") in names, where
        if namespace == "kube-vgpu" and len(argv) > 3 and argv[argv.index("-n") + 2] == "get" and argv[-1] in (
                "kube-vgpu-scheduler", "kube-vgpu-webhook-tls"):
            assert (argv[argv.index("-n") + 3], argv[-1]) in RUNTIME_OBJECTS, where
        for flag in ("-l",):
            if flag in argv:
                key, _, value = argv[argv.index(flag) + 1].partition("=")
                assert (key, value) in labels, where
        if "-c" in argv:
            assert argv[argv.index("-c") + 1] in container_names, where


def heredoc(doc: str, path: str) -> str:
    """The text a shell block of the doc writes to `path` with `cat > path <<'EOF'`."""
    (found,) = re.findall(rf"^cat > {re.escape(path)} <<'EOF'\n(.*?)^EOF$", text(doc), flags=re.S | re.M)
    return str(found)


def test_the_overlay_of_install_md_renders_and_its_patches_hit_the_flags_they_mean() -> None:
    kustomization = yaml.safe_load(heredoc("install.md", "my-kube-vgpu/kustomization.yaml"))
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "manifests").symlink_to(MANIFESTS)
        (root / "my-kube-vgpu").mkdir()
        (root / "my-kube-vgpu" / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
        import subprocess

        from tests.manifests.render import kubectl

        result = subprocess.run([str(kubectl()), "kustomize", str(root / "my-kube-vgpu")],
                                capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    objects = [o for o in yaml.safe_load_all(result.stdout) if o]
    images = {c["image"] for w in workloads(objects) for _, c in containers(w)}
    assert "registry.example.com/kube-vgpu:0.1.0" in images and not any(i.startswith("ghcr.io") for i in images)
    [plugin] = [c for w in workloads(objects) if w["kind"] == "DaemonSet" for kind, c in containers(w) if kind == "app"]
    assert "--sharing-count=4" in plugin["args"] and not any(a.startswith("--sharing-count=10") for a in plugin["args"])
    build_parser(plugin["args"]).parse_args(plugin["args"])


def test_the_helm_values_of_install_md_are_the_chart_s() -> None:
    from tests.manifests.test_chart import helm_template

    values = yaml.safe_load(heredoc("install.md", "my-values.yaml"))
    objects = helm_template(values)  # values.schema.json refuses a key the chart does not have
    images = {c["image"] for w in workloads(objects) for _, c in containers(w)}
    assert "registry.example.com/kube-vgpu:0.1.0" in images
    assert not [o for o in objects if o["kind"] == "Namespace"]  # namespace.create: false, as the page says


def device_plugin_exposition() -> str:
    """The device plugin's /metrics on fake GPUs, with an XID seen and one container's shared region to read."""
    fake = FakeNvml(load_profile("t4-4-pcie", "n"))
    nvml = Nvml(fake)
    discovery = discover(nvml)
    state = DeviceState(discovery.inventory)
    with tempfile.TemporaryDirectory() as cache:
        uuid = state.uuids()[0]
        Region(uuids=[uuid], limits_bytes=[1 << 30], sm_limits=[50]).write(Path(cache), "uid", "main")
        registry = CollectorRegistry()
        registry.register(DevicePluginCollector("n", nvml, discovery.handles, state, xid_counts=lambda: {(uuid, 79): 1},
                                                cache_dir=Path(cache)))
        return generate_latest(registry).decode()


def exported_metrics() -> set[str]:
    """Metric names as /metrics writes them (# TYPE lines), from the extender (with a quota gate), the webhook and
    the device plugin."""
    state = ClusterState()
    gate = build_gate(state, quota_config=str(MANIFESTS / "examples" / "kueue" / "quota.yaml"))
    assert gate is not None
    app = create_app(Scheduler(state, SnapshotCluster(state, []), gates=[gate]))
    # as extender/cli.py build() adds it in live mode (with the watches of nodes and pods)
    app.state.registry.register(SourceCollector(state, {"nodes": WatchHealth("nodes", 90.0)}))

    async def scrape() -> str:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://extender") as client:
            return (await client.get("/metrics")).text

    exposition = asyncio.run(scrape())
    # quota mode kueue's gate instead of the enforcing one (extender --quota-mode=kueue)
    kueue_mode = CollectorRegistry()
    kueue_mode.register(KueueModeGate(ClusterState(), live=False).collector())
    exposition += generate_latest(kueue_mode).decode()
    exposition += generate_latest(WebhookMetrics().registry).decode()
    exposition += device_plugin_exposition()
    return set(re.findall(r"^# TYPE (\S+) ", exposition, flags=re.M))


def documented_metrics(doc: str) -> set[str]:
    names = set()
    for token in re.findall(r"\bkube_vgpu_[a-z_]+(?:\{[a-z_,]+\}[a-z_]*)?", text(doc)):
        match = re.fullmatch(r"(kube_vgpu_[a-z_]*)\{([a-z_,]+)\}([a-z_]*)", token)
        if match:  # kube_vgpu_quota_{used,lent}_pods style
            names |= {match.group(1) + part + match.group(3) for part in match.group(2).split(",")}
        else:
            names.add(token)
    return names


@pytest.mark.parametrize("doc", ["operations.md", "architecture.md", "troubleshooting.md"])
def test_every_metric_the_docs_name_is_exported(doc: str) -> None:
    exported = exported_metrics()
    for name in documented_metrics(doc):
        base = re.sub(r"_(bucket|sum|count)$", "", name)
        assert name in exported or base in exported, f"{doc} names {name}, which nothing exports"


def test_the_documented_rejection_reasons_are_the_codes_filter_counts() -> None:
    fit = (ROOT / "extender" / "engine" / "fit.py").read_text()
    scheduler = (ROOT / "extender" / "scheduler.py").read_text()
    codes = set(re.findall(r'code="([a-z-]+)"', fit)) | set(re.findall(r'"([a-z-]+)"\)\s*$', fit, flags=re.M))
    codes |= set(re.findall(r'rejected\["([a-z-]+)"\]', scheduler))  # nomination, quota
    codes |= set(re.findall(r'codes\[name\] = "([a-z-]+)"', scheduler))  # stale inventory
    codes -= {"host"}  # the simulator's CPU/memory check
    row = next(line for line in text("operations.md").splitlines() if "kube_vgpu_extender_rejections_total" in line)
    values = row.split("|")[3].split("(", 1)[1]  # `reason` (`count`, `memory`, ...)
    assert set(re.findall(r"`([a-z-]+)`", values)) == codes


def test_quoted_admission_denials_are_the_webhook_s_own() -> None:
    webhook_doc = text("webhook.md")
    section = text("user-guide.md").split("### Refused at creation")[1].split("### Warnings")[0]
    quoted = [m for m in re.findall(r"\| `([^`]+)` \|$", section, flags=re.M)]
    assert len(quoted) == 19
    for message in quoted:
        assert f"`{message}`" in webhook_doc, message


def _slug(heading: str) -> str:
    """GitHub's heading anchor: lower case, punctuation dropped, spaces to dashes."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("doc", DOCS)
def test_links_between_docs_resolve_to_files_and_headings(doc: str) -> None:
    for target in re.findall(r"\]\(([^)\s]+)\)", text(doc)):
        if re.match(r"https?://", target):
            continue
        path, _, anchor = target.partition("#")
        linked = (ROOT / "docs" / path) if path else ROOT / "docs" / doc
        assert linked.exists(), f"{doc} links to {target}, which does not exist"
        if anchor:
            headings = re.findall(r"^#+ (.+)$", linked.read_text(), flags=re.M)
            assert anchor in {_slug(h) for h in headings}, f"{doc} links to {target}: no such heading"


def test_the_policies_the_user_guide_names_exist() -> None:
    from kube_vgpu.extender.engine.policies import DEFAULT_GPU_POLICY, DEFAULT_NODE_POLICY, policy_names

    guide = text("user-guide.md")
    section = guide.split("Policies:")[1].split("Node labels written")[0]
    named = set(re.findall(r"`([a-z]+)`", section))
    refused = set(protocol.UNSUPPORTED_HAMI_POLICIES)  # HAMi's names the guide says are refused
    assert refused <= named
    assert {"binpack", "spread", "topology"} <= named - refused <= set(policy_names())
    assert f"cluster default: `{DEFAULT_NODE_POLICY}`" in guide and f"cluster default: `{DEFAULT_GPU_POLICY}`" in guide
