"""The dev cluster runs the manifests' KubeSchedulerConfiguration: only the connection, the leader election and
the extender's port may differ (so every e2e test exercises exactly what operators deploy)."""

from __future__ import annotations

import copy
from typing import Any
from urllib.parse import urlsplit

import yaml

from kube_vgpu.dev.devcluster.cluster import SCHEDULER_CONFIG_MANIFEST, load_manifest_scheduler_config, scheduler_config
from kube_vgpu.protocol import mig


def _without_allowed_differences(config: dict[str, Any]) -> dict[str, Any]:
    stripped = copy.deepcopy(config)
    stripped.pop("clientConnection", None)
    stripped.pop("leaderElection", None)
    for extender in stripped.get("extenders") or []:
        parts = urlsplit(extender["urlPrefix"])
        extender["urlPrefix"] = f"{parts.scheme}://{parts.hostname}{parts.path}"
    return stripped


def test_dev_cluster_config_differs_from_the_manifest_only_where_allowed() -> None:
    manifest = yaml.safe_load(SCHEDULER_CONFIG_MANIFEST.read_text())
    written = yaml.safe_load(
        yaml.safe_dump(scheduler_config(load_manifest_scheduler_config(), kubeconfig="/x/kubeconfig",
                                        extender_port=45678))
    )
    assert _without_allowed_differences(written) == _without_allowed_differences(manifest)
    # and the allowed differences are what the dev cluster needs
    assert written["clientConnection"]["kubeconfig"] == "/x/kubeconfig"
    assert written["clientConnection"]["qps"] >= 50 and written["clientConnection"]["burst"] >= 100
    assert written["leaderElection"] == {"leaderElect": False}
    assert [urlsplit(e["urlPrefix"]).port for e in written["extenders"]] == [45678]
    assert [urlsplit(e["urlPrefix"]).hostname for e in written["extenders"]] == ["127.0.0.1"]


def test_the_manifest_keeps_what_the_issue_requires_of_the_extender_block() -> None:
    manifest = load_manifest_scheduler_config()
    assert manifest["percentageOfNodesToScore"] == 100
    assert [p["schedulerName"] for p in manifest["profiles"]] == ["kube-vgpu-scheduler"]
    (extender,) = manifest["extenders"]
    verbs = (extender["filterVerb"], extender["prioritizeVerb"], extender["bindVerb"])
    assert verbs == ("filter", "prioritize", "bind")
    assert extender["nodeCacheCapable"] is True
    managed = {r["name"]: r["ignoredByScheduler"] for r in extender["managedResources"]}
    assert managed == {
        "nvidia.com/gpu": False,
        "nvidia.com/gpumem": True,
        "nvidia.com/gpumem-percentage": True,
        "nvidia.com/gpucores": True,
        # static MIG: every profile the webhook admits, so kube-scheduler always asks the extender for MIG pods
        **{f"nvidia.com/mig-{name}": False for name in mig.MIG_PROFILE_NAMES},
    }
    assert len(mig.MIG_PROFILE_NAMES) == 17 and {"3g.20gb", "3g.71gb"} <= set(mig.MIG_PROFILE_NAMES)


def test_the_no_extender_variant_only_drops_the_extenders_block() -> None:
    base = load_manifest_scheduler_config()
    bare = scheduler_config(base, kubeconfig="/x", extender_port=None)
    assert "extenders" not in bare
    expected = _without_allowed_differences(base)
    expected.pop("extenders")
    assert _without_allowed_differences(bare) == expected
