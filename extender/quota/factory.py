"""Building the quota gate for `kube-vgpu extender` (the I/O: the --quota-config file, the cluster's watches)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from kube_vgpu.extender.quota.gate import QuotaGate
from kube_vgpu.extender.quota.live import KueueWatcher
from kube_vgpu.extender.quota.objects import load_documents
from kube_vgpu.extender.quota.usage import BLOCK_UNDECLARED
from kube_vgpu.extender.state import ClusterState

log = logging.getLogger(__name__)


def build_gate(
    state: ClusterState,
    *,
    quota_config: str | None = None,
    api_client: Any = None,
    unqueued: str = "admit",
    fair_sharing: bool = False,
    fair_sharing_strategies: tuple[str, ...] = (),
    quota_check_strategy: str = BLOCK_UNDECLARED,
) -> QuotaGate | None:
    """The gate for `kube-vgpu extender`: objects from --quota-config and, in live mode, the cluster's Kueue
    objects (watched while their CRDs exist). None when there is neither a file nor a cluster."""
    if quota_config is None and api_client is None:
        return None
    documents: list[tuple[str, Mapping[str, Any]]] = []
    if quota_config:
        documents = [(quota_config, doc) for doc in load_documents(quota_config)]
    gate = QuotaGate(state, documents, unqueued=unqueued, live=api_client is not None,
                     fair_sharing=fair_sharing, fair_sharing_strategies=fair_sharing_strategies,
                     quota_check_strategy=quota_check_strategy)
    if gate.config.errors:
        log.error("quota: %d invalid object(s) in %s were left out", len(gate.config.errors), quota_config)
    if api_client is not None:
        gate.watcher = KueueWatcher(gate, api_client)
    return gate
