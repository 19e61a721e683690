"""Inventory publisher: the node's GPU inventory annotation (written only when it changes), a heartbeat
annotation every interval, and GPU feature discovery style labels (nvidia.com/gpu.product, .count, .memory).

`inventory_annotations` and `node_labels` are the single encoding of a node's GPUs: `kube-vgpu cluster synth`
(node_object) and the dev cluster call them too, so synthetic nodes are byte-identical to published ones.
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
from collections.abc import Callable

from kube_vgpu import protocol
from kube_vgpu.deviceplugin.kube import ApiUnavailable, Conflict, NodeClient, NotFound
from kube_vgpu.deviceplugin.state import DeviceState
from kube_vgpu.protocol import NodeInventory

log = logging.getLogger(__name__)

DEFAULT_HEARTBEAT_SECONDS = 30.0
#: labels this publisher owns (removed when the node has no GPU any more)
OWNED_LABELS = (protocol.LABEL_GPU_PRODUCT, protocol.LABEL_GPU_COUNT, protocol.LABEL_GPU_MEMORY_MIB)


def inventory_annotations(inventory: NodeInventory, moment: dt.datetime) -> dict[str, str]:
    """The node annotations describing `inventory`, heartbeat at `moment`."""
    return {
        protocol.NODE_INVENTORY_ANNOTATION: protocol.encode_inventory(inventory),
        protocol.NODE_HEARTBEAT_ANNOTATION: protocol.format_heartbeat(moment),
    }


def node_labels(inventory: NodeInventory) -> dict[str, str]:
    return protocol.gpu_node_labels(inventory)


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


class Publisher:
    def __init__(
        self,
        node_name: str,
        nodes: NodeClient,
        state: DeviceState,
        *,
        heartbeat_seconds: float = DEFAULT_HEARTBEAT_SECONDS,
        before_publish: list[Callable[[], None]] | None = None,
        clock: Callable[[], dt.datetime] = _now,
        limiter_label: str = "",
        limiter_state: Callable[[], str | None] | None = None,
    ) -> None:
        """`limiter_label`: the node label (protocol.LABEL_LIMITER) set to what `limiter_state` returns, removed when
        it returns None ("" = not managed: a label set by hand stays)."""
        if heartbeat_seconds <= 0:
            raise ValueError(f"heartbeat interval must be positive, got {heartbeat_seconds}")
        self.node_name = node_name
        self.nodes = nodes
        self.state = state
        self.heartbeat_seconds = heartbeat_seconds
        self.before_publish = list(before_publish or ())
        self.clock = clock
        self.limiter_label = limiter_label if limiter_state is not None else ""
        self.limiter_state = limiter_state
        self.owned_labels = OWNED_LABELS + ((self.limiter_label,) if self.limiter_label else ())
        self._published_text: str | None = None  # what the node carries (None: not read yet)
        self._published_labels: dict[str, str | None] | None = None
        self.inventory_writes = 0
        #: set after the first successful publish (readiness)
        self.published = threading.Event()

    def _load_current(self) -> None:
        node = self.nodes.get_node(self.node_name)
        metadata = node.get("metadata") or {}
        self._published_text = (metadata.get("annotations") or {}).get(protocol.NODE_INVENTORY_ANNOTATION, "")
        labels = metadata.get("labels") or {}
        self._published_labels = {key: labels.get(key) for key in self.owned_labels}

    def publish_once(self) -> bool:
        """Write the heartbeat, plus the inventory and labels when they differ from what the node carries.
        Returns True when the inventory annotation was written. Raises ApiUnavailable / NotFound."""
        if self._published_text is None:
            self._load_current()
        inventory = self.state.inventory()
        text = protocol.encode_inventory(inventory)
        annotations = inventory_annotations(inventory, self.clock())
        inventory_changed = text != self._published_text
        if not inventory_changed:
            del annotations[protocol.NODE_INVENTORY_ANNOTATION]
        desired: dict[str, str | None] = {key: None for key in self.owned_labels}
        desired.update(node_labels(inventory))
        if self.limiter_label and self.limiter_state is not None:
            desired[self.limiter_label] = self.limiter_state()
        labels = {} if desired == self._published_labels else desired
        try:
            self.nodes.patch_node_metadata(self.node_name, annotations, labels)
        except (ApiUnavailable, Conflict, NotFound):
            self._published_text = None  # re-read the node before the next attempt
            raise
        if inventory_changed:
            self.inventory_writes += 1
            log.info("published GPU inventory of node %s: %s", self.node_name, text)
        self._published_text = text
        self._published_labels = desired
        self.published.set()
        return inventory_changed

    def run(self, stop: threading.Event) -> None:
        """Publish now, then at every heartbeat and whenever the device state changes (health), until stop."""
        generation = -1
        while not stop.is_set():
            for hook in self.before_publish:
                try:
                    hook()
                except Exception:  # a failing hook must not stop the heartbeat
                    log.exception("pre-publish step failed")
            generation = self.state.generation
            try:
                self.publish_once()
            except (ApiUnavailable, Conflict, NotFound) as exc:
                log.warning("publishing node %s failed (%s); retrying at the next heartbeat", self.node_name, exc)
            # wake early on a device change so an unhealthy GPU is published within one heartbeat
            self.state.wait_for_change(generation, self.heartbeat_seconds, stop)
