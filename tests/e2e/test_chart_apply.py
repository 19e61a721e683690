"""The Helm chart against the dev cluster's real kube-apiserver: what `helm template` renders (helm v3.22.0 built
from its Go module) is accepted by a server-side dry-run apply (schema, defaulting, validation, admission) with the
default values, in each certificate mode, and with every value of the chart changed at once. Only cert-manager's
objects are skipped (the dev cluster does not serve its CRDs), and only in that mode."""

from __future__ import annotations

from typing import Any

import pytest

from kube_vgpu.dev.devcluster.cluster import DevCluster
from tests.e2e.test_manifests_apply import CERT_MANAGER_OBJECTS, server_dry_run
from tests.manifests.test_chart import every_value_changed, helm_template

pytestmark = pytest.mark.e2e

CASES: dict[str, dict[str, Any]] = {
    "defaults": {},
    "cert-manager": {"certificates": {"mode": "cert-manager"}},
    "no-certificates": {"certificates": {"mode": "none"}},
    "every-value-changed": every_value_changed(),
}


def by_kind(items: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (found,) = [i for i in items if i["kind"] == kind and i["metadata"]["name"] == name]
    return found


@pytest.mark.parametrize("case", list(CASES))
def test_the_api_server_accepts_every_object_the_chart_renders(dev_cluster: DevCluster, case: str) -> None:
    values = CASES[case]
    rendered = helm_template(values)
    items, skipped = server_dry_run(dev_cluster, rendered)
    assert set(skipped) == (CERT_MANAGER_OBJECTS if case == "cert-manager" else set())
    assert len(items) + len(skipped) == len(rendered)
    # what came back is the chart's objects as the API server would store them (defaults filled in)
    plugin = by_kind(items, "DaemonSet", "kube-vgpu-device-plugin")["spec"]["template"]["spec"]
    sharing = [a for a in plugin["containers"][0]["args"] if a.startswith("--sharing-count=")]
    assert sharing == [f"--sharing-count={values.get('devicePlugin', {}).get('sharingCount', 10)}"]
    assert plugin["dnsPolicy"] == "ClusterFirst"  # defaulted by the server, so this is its answer, not our input
    jobs = [i for i in items if i["kind"] == "Job"]
    if case in ("defaults", "every-value-changed"):
        (job,) = jobs
        assert job["metadata"]["annotations"]["helm.sh/hook"] == "post-install,post-upgrade"
    else:
        assert not jobs
    if case == "every-value-changed":
        assert plugin["runtimeClassName"] == "nvidia"
        assert plugin["imagePullSecrets"] == [{"name": "regcred"}]
        scheduler = by_kind(items, "Deployment", "kube-vgpu-scheduler")
        assert scheduler["spec"]["replicas"] == 1
        assert not [i for i in items if i["kind"] in ("PodDisruptionBudget", "NetworkPolicy", "Namespace")]
