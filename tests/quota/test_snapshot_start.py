"""A snapshot's bound pods are charged in full (CPU and memory too, and counted at their priority) by the quota gate
of `kube-vgpu extender --snapshot --quota-config`: the gate is built before the snapshot's pods reach the state (it
used to be built after, so those pods were charged GPUs only)."""

from __future__ import annotations

from pathlib import Path

import orjson

from kube_vgpu.extender.cli import build, parse_args
from kube_vgpu.extender.quota.accounting import CQ
from kube_vgpu.extender.quota.gate import QuotaGate
from tests.quota.helpers import FLAVORS, a100_node, local_queue, make_env, queued_pod

QUEUE = FLAVORS + """
---
apiVersion: kueue.x-k8s.io/v1beta1
kind: ClusterQueue
metadata: {name: team-a}
spec:
  namespaceSelector: {}
  resourceGroups:
  - coveredResources: [nvidia.com/gpu, cpu]
    flavors:
    - {name: a100, resources: [{name: nvidia.com/gpu, nominalQuota: 8}, {name: cpu, nominalQuota: 64}]}
""" + local_queue("team-a", "q", "team-a")


def test_a_snapshots_bound_pods_are_charged_cpu_as_well(tmp_path: Path) -> None:
    env = make_env(QUEUE, [a100_node("a100-0")])
    p = queued_pod("q", gpus=2, memory_mib=1000)
    p["spec"]["containers"][0]["resources"]["requests"]["cpu"] = "4"
    assert env.submit(p) == "a100-0"
    assert env.used("team-a", "a100", "cpu") == 4000  # the running extender charged it
    stored = env.cluster.get_pod("team-a", p["metadata"]["name"])
    snapshot = tmp_path / "snapshot.json"
    snapshot.write_bytes(orjson.dumps({"apiVersion": "v1", "kind": "List", "items": [a100_node("a100-0"), stored]}))
    quota = tmp_path / "quota.yaml"
    quota.write_text(QUEUE)
    extender = build(parse_args([f"--snapshot={snapshot}", f"--quota-config={quota}"]))
    [gate] = extender.scheduler.gates
    assert isinstance(gate, QuotaGate)
    assert gate.tree.node_usage((CQ, "team-a"), ("a100", "nvidia.com/gpu")) == 2
    assert gate.tree.node_usage((CQ, "team-a"), ("a100", "cpu")) == 4000


def test_a_gate_built_over_a_state_that_already_holds_pods_is_refused() -> None:
    env = make_env(QUEUE, [a100_node("a100-0")])
    assert env.submit(queued_pod("q", gpus=1, memory_mib=1000)) == "a100-0"
    try:
        QuotaGate(env.state, [])
    except ValueError as exc:
        assert str(exc) == "the quota gate must be built before the cluster state holds pods"
    else:
        raise AssertionError("a gate over a state with pods was built")
