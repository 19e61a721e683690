"""The gate's decision records (Kueue's scheduler side): a pod resolved to a queue that may be admitted, a refusal
with whether waiting can help (StrictFIFO), and the per-filter-call cache of answers."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kube_vgpu.extender.quota.accounting import FlavorResource
from kube_vgpu.extender.quota.objects import ClusterQueue, LocalQueue, Toleration
from kube_vgpu.extender.quota.usage import PodInfo
from kube_vgpu.protocol import PodGpuRequest


@dataclass(frozen=True, slots=True)
class Admission:
    """A pod resolved to a ClusterQueue that may be admitted, subject to the per-node quota check."""

    uid: str
    cluster_queue: ClusterQueue
    local_queue: LocalQueue
    tolerations: tuple[Toleration, ...]
    info: PodInfo
    covered: frozenset[str]  # the queue's covered resources
    host_needs: tuple[tuple[str, int], ...]  # cpu / memory / pods, when covered (node-independent)
    label_keys: tuple[str, ...]  # every node label key the queue's flavors select on


@dataclass(slots=True)
class DecisionCache:
    """filter asks once per node for the same pod. The answer depends on the node only through the values of the
    labels the queue's flavors select on and (for requests in percent or whole GPUs) the sizes of its GPUs, so it
    is computed once per distinct (label values, GPU signature) rather than once per node."""

    pod: Mapping[str, Any]
    version: int
    result: Admission | Refusal | None
    request: PodGpuRequest | None = None
    label_keys: tuple[str, ...] = ()
    single_key: str | None = None  # the one label key, when the flavors select on exactly one (the usual case)
    fixed_needs: tuple[tuple[str, int], ...] | None = None  # when the needs do not depend on the node
    undeclared: Refusal | None = None  # BlockUndeclared: a GPU resource its queue does not cover (every node)
    plain: bool = True  # no GPU type / UUID selectors: GPU eligibility depends on GPU sizes only
    needs_by_signature: dict[Any, tuple[tuple[str, int], ...]] = field(default_factory=dict)
    fits: dict[Any, Refusal | None] = field(default_factory=dict)  # (label values, needs) -> answer
    fast: dict[Any, Refusal | None] = field(default_factory=dict)  # label values [, GPU signature] -> answer


@dataclass(frozen=True, slots=True)
class Refusal:
    reason: str
    #: the pod waits for quota (blocks pods behind it under StrictFIFO); False when waiting cannot help
    waiting: bool
    #: what the pod asked of its queue where it was refused for quota (fair sharing compares shares with it)
    needs: Mapping[FlavorResource, int] | None = None
