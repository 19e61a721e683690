"""Building the quota gate for `kube-vgpu extender` (the I/O: the --quota-config file, the cluster's watches), and
choosing the quota mode (docs/quota.md#quota-modes):

* `enforce`: our gate admits pods against Kueue's objects (ClusterQueues, LocalQueues, ...), with no Kueue controller;
* `kueue`: Kueue's controller admits Workloads; we place the pods of admitted ones (kueue_mode.py);
* `off`: no quota at all;
* `auto` (the default): `kueue` when Kueue's controller is installed, else `enforce`.

`enforce` beside a running Kueue controller would be two admission layers with different accounting (each admits
what the other refuses, and neither sees the other's charges): refused unless forced.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import orjson

from kube_vgpu.extender.quota.gate import QuotaGate
from kube_vgpu.extender.quota.kueue_mode import KueueModeGate
from kube_vgpu.extender.quota.live import KUEUE_MODE_KINDS, KueueWatcher
from kube_vgpu.extender.quota.objects import load_documents
from kube_vgpu.extender.quota.usage import BLOCK_UNDECLARED
from kube_vgpu.extender.state import ClusterState

log = logging.getLogger(__name__)

QUOTA_MODES = ("auto", "enforce", "kueue", "off")
KUEUE_GROUP = "kueue.x-k8s.io"


class QuotaModeError(ValueError):
    """A quota mode that cannot run here; the message says what to do."""


def kueue_controller_evidence(webhook_configurations: list[Mapping[str, Any]]) -> str | None:
    """Is Kueue's controller installed? Its admission webhook for Workloads (which every install of Kueue registers,
    and which only its controller serves) says so. Returns what was found, or None."""
    for configuration in webhook_configurations:
        for webhook in configuration.get("webhooks") or []:
            for rule in webhook.get("rules") or []:
                if KUEUE_GROUP in (rule.get("apiGroups") or []) and "workloads" in (rule.get("resources") or []):
                    name = (configuration.get("metadata") or {}).get("name")
                    return f"MutatingWebhookConfiguration {name} (webhook {webhook.get('name')}) admits Kueue Workloads"
    return None


def resolve_quota_mode(requested: str, *, live: bool, evidence: str | None, force: bool) -> str:
    """The mode to run: `auto` resolved, and the combinations that cannot work refused (QuotaModeError)."""
    if requested not in QUOTA_MODES:
        raise QuotaModeError(f"quota mode {requested!r} is not one of {', '.join(QUOTA_MODES)}")
    if requested == "auto":
        return "kueue" if evidence else "enforce"
    if requested == "kueue" and not live:
        raise QuotaModeError("quota mode kueue reads Kueue's Workloads from a live cluster; a --snapshot has none "
                             "(use --quota-mode=enforce with --quota-config, or off)")
    if requested == "enforce" and evidence and not force:
        raise QuotaModeError(
            f"quota mode enforce refused: Kueue's controller is installed ({evidence}). Two admission layers with "
            "different accounting would each admit what the other refuses. Use --quota-mode=kueue (Kueue admits, "
            "kube-vgpu places; or auto), or --force-quota-mode if you really want both (docs/quota.md#quota-modes)")
    return requested


def read_kueue_evidence(api_client: Any) -> str | None:
    """kueue_controller_evidence over the cluster's MutatingWebhookConfigurations; None (with a warning) when they
    cannot be read (then auto means enforce, the behaviour of a cluster without Kueue)."""
    import urllib3
    from kubernetes.client.rest import ApiException

    from kube_vgpu.extender.sources.rawapi import RawApi

    admission = RawApi(api_client)
    try:
        response = admission.list_mutating_webhook_configuration(_preload_content=False, _request_timeout=10)
    except ApiException as exc:
        log.warning("quota: cannot list MutatingWebhookConfigurations (HTTP %s) to find Kueue's controller; "
                    "assuming it is not installed", exc.status)
        return None
    except (OSError, urllib3.exceptions.HTTPError) as exc:
        # the API server is not reachable yet: nothing else works either; the watches retry, and in mode enforce
        # the gate warns once Kueue's controller shows in the ClusterQueues' status
        log.warning("quota: cannot reach the API server to find Kueue's controller (%s); assuming it is not "
                    "installed", exc)
        return None
    items: list[Mapping[str, Any]] = orjson.loads(response.data).get("items") or []
    return kueue_controller_evidence(items)


def build_kueue_mode_gate(state: ClusterState, api_client: Any) -> KueueModeGate:
    gate = KueueModeGate(state, live=True)
    gate.watcher = KueueWatcher(gate, api_client, kinds=KUEUE_MODE_KINDS, namespaces=False)
    return gate


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
