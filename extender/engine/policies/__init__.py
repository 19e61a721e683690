"""Placement policies, one module each, listed by name in registry.py (see base.Policy for the interface)."""

from __future__ import annotations

from kube_vgpu.extender.engine.policies.base import Policy, Scratch
from kube_vgpu.extender.engine.policies.registry import REGISTRY, make_policy, policy_names

__all__ = ["DEFAULT_GPU_POLICY", "DEFAULT_NODE_POLICY", "REGISTRY", "Policy", "Scratch", "make_policy", "policy_names"]

#: Cluster-wide defaults when neither the command line nor the pod names a policy.
# bfgd: fragmentation-aware (workload learned online, host CPU balance; docs/simulator.md), best-connected GPUs
# and nodes for multi-GPU pods, fuller nodes on ties
DEFAULT_NODE_POLICY = "bfgd"
DEFAULT_GPU_POLICY = "bfgd"
