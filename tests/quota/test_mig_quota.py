"""Static MIG under the quota gate (enforce mode): a MIG device counts as one nvidia.com/gpu with its memory as
nvidia.com/gpumem, checked before placement and counted from the assignment after."""

from __future__ import annotations

from kube_vgpu import protocol
from kube_vgpu.dev.fixtures import node_object
from kube_vgpu.extender.scheduler import FilterOutcome
from tests.engine.test_mig_placement import a100_mig, mig_pod
from tests.quota.helpers import GPU, GPUMEM, local_queue, make_env

PRODUCT = "NVIDIA-A100-SXM4-40GB"  # the product label of the a100-mig node
QUOTA = f"""
apiVersion: kueue.x-k8s.io/v1beta1
kind: ResourceFlavor
metadata: {{name: a100-mig}}
spec: {{nodeLabels: {{nvidia.com/gpu.product: {PRODUCT}}}}}
---
apiVersion: kueue.x-k8s.io/v1beta1
kind: ClusterQueue
metadata: {{name: research}}
spec:
  namespaceSelector: {{}}
  resourceGroups:
  - coveredResources: [nvidia.com/gpu, nvidia.com/gpumem]
    flavors:
    - name: a100-mig
      resources: [{{name: nvidia.com/gpu, nominalQuota: 3}}, {{name: nvidia.com/gpumem, nominalQuota: 30000}}]
""" + local_queue("team-a", "research", "research")


def _queued(name: str, resource: str) -> dict[str, object]:
    pod = mig_pod(("main", resource, 1))
    pod["metadata"].update(name=name, namespace="team-a", uid=f"uid-{name}")
    pod["metadata"].setdefault("labels", {})[protocol.LABEL_KUEUE_QUEUE_NAME] = "research"
    return pod


def test_mig_devices_use_the_queues_gpus_and_memory() -> None:
    env = make_env(QUOTA, [node_object("mig-node", a100_mig())])
    assert env.submit(_queued("big", "mig-3g.20gb")) == "mig-node"
    assert (env.used("research", "a100-mig"), env.used("research", "a100-mig", GPUMEM)) == (1, 20096)
    assert env.submit(_queued("small", "mig-1g.5gb")) == "mig-node"
    assert (env.used("research", "a100-mig", GPU), env.used("research", "a100-mig", GPUMEM)) == (2, 20096 + 4864)
    # a 2g.10gb (9984 MiB) would take the queue past its 30000 MiB: refused by quota, not by the node
    refused = env.submit(_queued("over", "mig-2g.10gb"))
    assert isinstance(refused, FilterOutcome) and refused.failed == {"mig-node": (
        "quota: ClusterQueue research (LocalQueue team-a/research): flavor a100-mig, nvidia.com/gpumem: needs 9984, "
        "used 24960/30000 MiB (nominal 30000), 5040 available now")}
    env.delete(_queued("big", "mig-3g.20gb"))
    assert env.retry(_queued("over", "mig-2g.10gb")) == "mig-node"
