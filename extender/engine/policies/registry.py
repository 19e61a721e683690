"""Every placement policy by name: an explicit list, as kube-scheduler's in-tree plugin registry. A new policy is a
module of its own plus one entry here; nothing is found by scanning the package."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from kube_vgpu.extender.engine.policies import (
    bestfit,
    bfgd,
    binpack,
    clustering,
    dotprod,
    fgd,
    hostsupply,
    lookahead,
    mutex,
    packing,
    random,
    spread,
    supply,
    topology,
)
from kube_vgpu.extender.engine.policies.base import Policy

_POLICIES: tuple[type[Policy], ...] = (
    binpack.Binpack,
    spread.Spread,
    topology.Topology,
    bfgd.BalancedFGD,
    lookahead.LookaheadFGD,  # bfgd with a look-ahead over the learned workload (docs/simulator.md)
    supply.SupplyLookaheadFGD,  # lafgd with a supply-aware residue (docs/simulator.md)
    hostsupply.HostSupplyFGD,  # safgd whose hole prices know the node's free CPU and memory (docs/simulator.md)
    mutex.Mutex,  # HAMi's GPU policy of that name
    # the reference policies of the FGD paper's simulator (docs/simulator.md)
    fgd.FGD,
    bestfit.BestFit,
    clustering.Clustering,
    dotprod.DotProd,
    packing.Packing,
    random.RandomPolicy,
)

#: name -> policy class (read-only; a caller with policies of its own passes a merged mapping, see make_policy)
REGISTRY: Mapping[str, type[Policy]] = MappingProxyType({cls.name: cls for cls in _POLICIES})
assert len(REGISTRY) == len(_POLICIES) and all(REGISTRY), "every policy has a distinct, non-empty name"


def policy_names(registry: Mapping[str, type[Policy]] = REGISTRY) -> list[str]:
    return sorted(registry)


def make_policy(name: str, registry: Mapping[str, type[Policy]] = REGISTRY, **options: object) -> Policy:
    """A fresh policy instance by name; ValueError lists the known names."""
    try:
        cls = registry[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; known policies: {', '.join(sorted(registry))}") from None
    return cls(**options)
