"""Static MIG through the real control plane (issue 16): a node whose inventory is the device plugin's own discovery
on the fake NVML's `a100-mig` profile (GPU 0: one 3g.20gb, one 2g.10gb, two 1g.5gb; GPU 1: seven 1g.5gb), a pod
asking NVIDIA's mixed-strategy resource `nvidia.com/mig-3g.20gb`: our webhook admits it, kube-scheduler hands it to
our extender (the resource is in its managedResources), the extender binds it with the MIG device's UUID in the
assignment, and a second pod for the only 3g.20gb waits with a reason until the first is gone."""

from __future__ import annotations

from typing import Any

import pytest

from kube_vgpu.dev.devcluster.cluster import DevCluster, NodeGroup
from kube_vgpu.dev.devcluster.workload import PAUSE_IMAGE, assignment_of, create_pods, wait_for_pods
from tests.e2e.checks import read_pod
from tests.e2e.conftest import NODE_GROUP_LABEL

pytestmark = pytest.mark.e2e

PROFILE_RESOURCE = "nvidia.com/mig-3g.20gb"


def mig_pod(name: str, selector: dict[str, str]) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
            "spec": {"nodeSelector": selector, "terminationGracePeriodSeconds": 0,
                     "containers": [{"name": "main", "image": PAUSE_IMAGE,
                                     "resources": {"limits": {PROFILE_RESOURCE: "1"}}}]}}


def test_a_mig_pod_gets_a_free_mig_device_of_its_profile_and_the_next_one_waits(
    dev_cluster: DevCluster, e2e_namespace: str
) -> None:
    label = f"mig-{e2e_namespace}"[:63]
    names = dev_cluster.add_nodes(NodeGroup(count=1, prefix=f"mig-{e2e_namespace}"[:40], fake_profile="a100-mig",
                                            labels=((NODE_GROUP_LABEL, label),)))
    selector = {NODE_GROUP_LABEL: label}
    try:
        create_pods(dev_cluster.api, e2e_namespace, [mig_pod("first", selector)])
        first = wait_for_pods(dev_cluster.api, e2e_namespace, ["first"], timeout_s=60)
        assert first.bound == {"first": names[0]}, first.describe() + dev_cluster.log_tail("extender")
        pod = read_pod(dev_cluster, e2e_namespace, "first")
        assert pod is not None
        assignment = assignment_of(pod)
        assert assignment is not None, pod["metadata"].get("annotations")
        (container,) = assignment.containers
        (device,) = container.devices
        assert device.uuid.startswith("MIG-"), device

        # the node has one 3g.20gb: the second pod waits, with our reason naming the profile
        create_pods(dev_cluster.api, e2e_namespace, [mig_pod("second", selector)])
        waiting = wait_for_pods(dev_cluster.api, e2e_namespace, ["second"], timeout_s=60, expect_refused=["second"])
        assert "3g.20gb" in waiting.refused.get("second", ""), waiting.describe()

        dev_cluster.core.delete_namespaced_pod("first", e2e_namespace, grace_period_seconds=0,
                                               _preload_content=False)
        second = wait_for_pods(dev_cluster.api, e2e_namespace, ["second"], timeout_s=90)
        assert second.bound == {"second": names[0]}, second.describe() + dev_cluster.log_tail("extender")
        again = read_pod(dev_cluster, e2e_namespace, "second")
        assert again is not None
        reassigned = assignment_of(again)
        assert reassigned is not None and reassigned.containers[0].devices[0].uuid == device.uuid
    finally:
        for pod_name in ("first", "second"):
            try:
                dev_cluster.core.delete_namespaced_pod(pod_name, e2e_namespace, grace_period_seconds=0,
                                                       _preload_content=False)
            except Exception:
                pass
        dev_cluster.delete_nodes(names)
