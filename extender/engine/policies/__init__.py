"""Placement policies, one module each, registered by name (see base.Policy)."""

from __future__ import annotations

import importlib
import pkgutil

from .base import Policy, Scratch, make_policy, policy_names, register

__all__ = ["DEFAULT_GPU_POLICY", "DEFAULT_NODE_POLICY", "Policy", "Scratch", "make_policy", "policy_names", "register"]

#: Cluster-wide defaults when neither the command line nor the pod names a policy.
DEFAULT_NODE_POLICY = "topology"  # binpack for 1-GPU pods, best-connected node for multi-GPU pods
DEFAULT_GPU_POLICY = "topology"

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
