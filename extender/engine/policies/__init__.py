"""Placement policies, one module each, registered by name (see base.Policy)."""

from __future__ import annotations

import importlib
import pkgutil

from kube_vgpu.extender.engine.policies.base import Policy, Scratch, make_policy, policy_names, register

__all__ = ["DEFAULT_GPU_POLICY", "DEFAULT_NODE_POLICY", "Policy", "Scratch", "make_policy", "policy_names", "register"]

#: Cluster-wide defaults when neither the command line nor the pod names a policy.
# bfgd: fragmentation-aware (workload learned online, host CPU balance; docs/simulator.md), best-connected GPUs
# and nodes for multi-GPU pods, fuller nodes on ties
DEFAULT_NODE_POLICY = "bfgd"
DEFAULT_GPU_POLICY = "bfgd"

_loaded = False


def _load_all() -> None:
    """Import every policy module in this package so each registers itself."""
    global _loaded
    if _loaded:
        return
    for module in pkgutil.iter_modules(__path__):
        if module.name != "base" and not module.name.startswith("_"):
            importlib.import_module(f"{__name__}.{module.name}")
    _loaded = True
