"""Allocation gauges per pod, node, namespace and ClusterQueue, and usage-accounting counters per pod, computed at
scrape time from the state (no cost per bind, nothing accumulated in memory).

Accounting: each bound pod's counters are its allocation times the seconds since its bind-time annotation (written
by our bind, carried by the Binding), read at scrape time:

    kube_vgpu_pod_vgpu_seconds_total            = vGPUs        x (now - bind time)
    kube_vgpu_pod_gpu_memory_mib_seconds_total  = MiB          x (now - bind time)
    kube_vgpu_pod_gpu_core_percent_seconds_total = cores (%)   x (now - bind time)   (100 %-seconds = 1 GPU-second)

each in whole units, rounded down: still monotonic (a pod's value only grows), short of the exact product by less
than one unit, and three times cheaper to write for 40,000 pods every scrape than a float's shortest digits.

A counter is per pod, not per namespace or queue, on purpose: a pod's value depends only on its annotations, so
an extender restart (or the other replica taking over) continues every series where it was, and a pod that ends
ends its series. A per-namespace sum would drop whenever a pod ended, and after a restart would count the running
pods' whole past again. Per team over a period: `sum by (namespace) (increase(kube_vgpu_pod_vgpu_seconds_total[
30d]))` (`kube-vgpu usage` runs this). Allocation is the peak over the moments a pod's containers run at once
(init containers, sidecars), the same figure quota counts.

Cardinality: the per-pod series exist for pods holding GPUs (one per pod and GPU for the gauges, one per pod for
the counters), and go away with the pod; per namespace, per ClusterQueue and per node there is one series each.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kube_vgpu.extender.engine.policies._milli import frag_cpu_free_milli, free_milli_list
from kube_vgpu.extender.engine.policies.fgd import FragPolicyBase
from kube_vgpu.extender.engine.shares import MILLI_PER_GPU
from kube_vgpu.extender.exposition import (
    ROWS_PER_CHUNK,
    Family,
    FamilyGroup,
    GroupedCollector,
    Pause,
    RenderedGroup,
    RowTextCache,
    go_whole,
    label_text,
    no_pause,
    rows_text,
    sorted_labels,
)

if TYPE_CHECKING:
    from kube_vgpu.extender.engine.model import GpuState, GpuUsage, NodeState
    from kube_vgpu.extender.preemption.rules import QueueRules
    from kube_vgpu.extender.scheduler import Scheduler
    from kube_vgpu.extender.state import PodRecord

POD_GPU_LABELS = ["namespace", "pod", "pod_uid", "node", "gpu", "uuid", "cluster_queue"]
POD_LABELS = ["namespace", "pod", "cluster_queue"]

#: (field suffix, help) of the allocation gauges repeated per node, namespace and ClusterQueue
_ALLOCATED = (
    ("gpu_memory_allocated_mib", "GPU memory assigned to pods (MiB)"),
    ("gpu_cores_allocated", "GPU compute assigned to pods (percent of one GPU; 100 = a whole GPU)"),
    ("vgpus_allocated", "vGPUs assigned to pods"),
)


@dataclass(frozen=True, slots=True)
class _PodRow:
    namespace: str
    name: str
    uid: str
    node: str
    cluster_queue: str
    held_s: float | None  # seconds since bound; None when not accounted (no bind time, not confirmed)
    gpus: tuple[tuple[str, str, int, int, int], ...]  # (GPU index, UUID, MiB, cores, vGPUs)


@dataclass(frozen=True, slots=True)
class _NodeRow:
    name: str
    idle_gpus: float
    fragmented_gpus: float | None  # None: the policy has no fragmentation measure


@dataclass(frozen=True, slots=True)
class _PodText:
    """A pod's text as rendered for one scrape, valid while its record, usage, node inventory and queue are the
    ones it was rendered from: the state replaces `record.usage` (a new tuple) whenever it counts the pod again,
    and `node.gpus` (a new list) whenever the node's inventory changes; the queue is looked up every scrape."""

    record: PodRecord
    uid: str
    usage: tuple[GpuUsage, ...]
    gpus: list[GpuState]
    queue: str
    gpu_lines: tuple[bytes, ...]  # its per-pod-and-GPU gauge lines, one piece per family (none when turned off)
    #: the GPU-seconds counters' label set and a space: their values change every scrape, so only this is kept
    #: (one string for the three: ~300 bytes a pod less than a prefix each, at ~0.1 us a line)
    labels: str
    totals: tuple[int, int, int]  # MiB, cores, vGPUs over its GPUs
    scopes: tuple[str, str, str]  # node, namespace, ClusterQueue: the aggregates it counts in


_POD_GPU_FAMILIES = tuple(Family(f"kube_vgpu_pod_{suffix}", "gauge", f"{text}, per pod and GPU")
                          for suffix, text in _ALLOCATED)
_SECONDS_FAMILIES = (
    Family("kube_vgpu_pod_vgpu_seconds", "counter", "vGPUs held times seconds since the pod was bound"),
    Family("kube_vgpu_pod_gpu_memory_mib_seconds", "counter",
           "GPU memory held (MiB) times seconds since the pod was bound"),
    Family("kube_vgpu_pod_gpu_core_percent_seconds", "counter",
           "GPU compute held (percent of a GPU) times seconds since the pod was bound"),
)
_FRAGMENTED = Family("kube_vgpu_node_fragmented_gpus", "gauge",
                     "idle GPU capacity the placement policy counts as fragmented (GPUs; fgd and bfgd only: the FGD "
                     "measure over the workload learned so far)")
_IDLE = Family("kube_vgpu_node_idle_gpus", "gauge",
               "idle GPU capacity (GPUs: each GPU's free share of memory, compute and vGPU slots)")


def _scope_families(scope: str) -> list[Family]:
    families = [Family(f"kube_vgpu_{scope}_{suffix}", "gauge", f"{text}, per {scope}") for suffix, text in _ALLOCATED]
    if scope != "node":
        families.append(Family(f"kube_vgpu_{scope}_gpu_pods", "gauge", f"pods holding GPUs, per {scope}"))
    return families


class UsageCollector(GroupedCollector):
    """`per_pod_gpu`: export the per-pod-and-GPU allocation gauges (a third of /metrics at 5000 nodes; the per-pod
    counters and the per-node, namespace and ClusterQueue gauges are always exported).

    /metrics (render_groups) keeps text between scrapes: each pod's gauge lines and counter labels (_PodText), and
    the per-node lines by their values (RowTextCache); only the counters' values are formatted every scrape.
    groups() (collect(), and the reference the tests compare it with) renders everything afresh."""

    def __init__(self, scheduler: Scheduler, *, per_pod_gpu: bool = True) -> None:
        self.scheduler = scheduler
        self.per_pod_gpu = per_pod_gpu
        #: pod UID -> its text as last rendered (only pods counted at the last scrape)
        self._pod_text: dict[str, _PodText] = {}
        #: scope ("node", "namespace", "cluster_queue") -> key -> [MiB, cores, vGPUs, pods] over the pods in _pod_text
        self._scope_sums = _empty_scope_sums()
        #: scope -> its keys in _scope_sums, sorted (dropped whenever a key is added or removed)
        self._sorted_keys: dict[str, list[str]] = {}
        self._render_lock = threading.Lock()
        #: node name -> (what its _NodeRow was computed from..., the row)
        self._node_row: dict[str, tuple[object, ...]] = {}
        self._node_allocated = RowTextCache(_scope_families("node"), ["node"])
        self._fragmented = RowTextCache([_FRAGMENTED], ["node", "policy"])
        self._idle = RowTextCache([_IDLE], ["node"])

    def _queue_rules(self) -> QueueRules | None:
        for gate in self.scheduler.gates:
            rules = gate.queue_rules()
            if rules is not None:
                return rules
        return None

    def copy_out(self, pause: Pause = no_pause) -> tuple[list[_PodRow], list[_NodeRow]]:
        """What the metrics need, as plain rows, under the state lock. Only this runs under the lock: building the
        samples is most of a scrape's cost (measured at 5000 nodes, 20000 pods: ~0.5 s), and filter waits for it.
        Copied a chunk at a time, the lock released and `pause` called between chunks: at 40,000 pods the copy
        alone is ~0.2 s, which filter would otherwise wait for in one piece. A pod bound or gone between two chunks
        shows in the next scrape."""
        state = self.scheduler.state
        rules = self._queue_rules()
        pods: list[_PodRow] = []
        with state.lock:
            now = state.clock()
            records = list(state.pods.values())
            node_states = list(state.nodes.values())
        for start in range(0, len(records), ROWS_PER_CHUNK):
            pause()
            with state.lock:
                for record in records[start:start + ROWS_PER_CHUNK]:
                    node = state.nodes.get(record.node_name)
                    if not record.applied or node is None:
                        continue  # not counted on a node (its node is not known yet)
                    queue = (rules.queue_of(record.uid, record.namespace, record.labels) if rules else None) or ""
                    gpus = node.gpus
                    held = tuple((str(gpus[u.position].index), gpus[u.position].uuid, u.memory_mib, u.cores, u.vgpus)
                                 for u in record.usage)
                    # a bind time ahead of this clock (skew between replicas) counts as just bound
                    held_s = (max(0.0, now - record.bound_at_s)
                              if record.confirmed and record.bound_at_s is not None else None)
                    pods.append(_PodRow(record.namespace, record.name, record.uid, node.name, queue, held_s, held))
        return pods, self._node_rows(node_states, pause)

    def groups(self, pause: Pause) -> list[FamilyGroup]:
        """The families as groups sharing label rows (kube_vgpu.extender.exposition renders them straight to text)."""
        pods, nodes = self.copy_out(pause)
        groups = self._pod_groups(pods, pause)
        policy = self.scheduler.default_node_policy.name
        fragmented = FamilyGroup([_FRAGMENTED], ["node", "policy"],
                                 [((row.name, policy), (row.fragmented_gpus,)) for row in nodes])
        idle = FamilyGroup([_IDLE], ["node"], [((row.name,), (row.idle_gpus,)) for row in nodes])
        return [*groups, fragmented, idle]

    def _pod_groups(self, pods: list[_PodRow], pause: Pause) -> list[FamilyGroup]:
        pod_gpu = FamilyGroup(_POD_GPU_FAMILIES, POD_GPU_LABELS)
        seconds = FamilyGroup(_SECONDS_FAMILIES, POD_LABELS)
        #: scope -> key -> [MiB, cores, vGPUs, pods]
        totals: dict[str, dict[str, list[int]]] = {"node": {}, "namespace": {}, "cluster_queue": {}}
        for number, row in enumerate(pods):
            if number % ROWS_PER_CHUNK == 0:
                pause()
            memory = cores = vgpus = 0
            for index, uuid, gpu_memory, gpu_cores, gpu_vgpus in row.gpus:
                if self.per_pod_gpu:
                    pod_gpu.rows.append(((row.namespace, row.name, row.uid, row.node, index, uuid, row.cluster_queue),
                                         (gpu_memory, gpu_cores, gpu_vgpus)))
                memory, cores, vgpus = memory + gpu_memory, cores + gpu_cores, vgpus + gpu_vgpus
            for scope, key in (("node", row.node), ("namespace", row.namespace), ("cluster_queue", row.cluster_queue)):
                total = totals[scope].setdefault(key, [0, 0, 0, 0])
                for position, added in enumerate((memory, cores, vgpus, 1)):
                    total[position] += added
            if row.held_s is not None:
                seconds.rows.append(((row.namespace, row.name, row.cluster_queue),
                                     (int(vgpus * row.held_s), int(memory * row.held_s), int(cores * row.held_s))))
        groups = [pod_gpu]
        for scope, by_key in totals.items():
            families = _scope_families(scope)
            groups.append(FamilyGroup(families, [scope], [((key,), sums[:len(families)])
                                                          for key, sums in sorted(by_key.items())]))
        groups.append(seconds)
        return groups

    def _node_rows(self, node_states: list[NodeState], pause: Pause) -> list[_NodeRow]:
        """Each node's idle and fragmented GPUs, a few nodes at a time under the state lock."""
        state = self.scheduler.state
        policy = self.scheduler.default_node_policy
        nodes: list[_NodeRow] = []
        nodes_per_chunk = ROWS_PER_CHUNK // 4  # free shares and the policy's measure: ~10 us a node
        for start in range(0, len(node_states), nodes_per_chunk):
            pause()
            with state.lock:
                for node in node_states[start:start + nodes_per_chunk]:
                    if not node.gpus:
                        continue
                    free = free_milli_list(node)
                    frag = None
                    if isinstance(policy, FragPolicyBase):
                        cpu_free, cpu_known = frag_cpu_free_milli(node)
                        frag = policy.measure(node, cpu_free, cpu_known, free) / MILLI_PER_GPU
                    nodes.append(_NodeRow(node.name, sum(free) / MILLI_PER_GPU, frag))
        return nodes

    def _cached_node_rows(self, node_states: list[NodeState], pause: Pause) -> list[_NodeRow]:
        """_node_rows(), each node's row kept while what it is computed from is unchanged: the node (its version:
        every change of its GPUs' usage or inventory), its host CPU, and the policy's learned model (its epoch:
        the scheduler's own cached placements are keyed by the same)."""
        state = self.scheduler.state
        policy = self.scheduler.default_node_policy
        old = self._node_row
        new: dict[str, tuple[object, ...]] = {}
        nodes: list[_NodeRow] = []
        position = 0
        while position < len(node_states):
            pause()
            # under the lock at a time: 100 kept rows (a look-up and a comparison, ~0.5 us each) or 5 computed
            # ones (free shares and the policy's measure, ~10 us each: all of them after the model changed)
            computed = 0
            with state.lock:
                epoch = policy.epoch()
                for node in node_states[position:position + ROWS_PER_CHUNK * 5]:
                    position += 1
                    if not node.gpus:
                        continue
                    key = (node, node.version, node.cpu_milli_total, node.cpu_milli_used, policy, epoch)
                    kept = old.get(node.name)
                    if kept is None or kept[:-1] != key:
                        free = free_milli_list(node)
                        frag = None
                        if isinstance(policy, FragPolicyBase):
                            cpu_free, cpu_known = frag_cpu_free_milli(node)
                            frag = policy.measure(node, cpu_free, cpu_known, free) / MILLI_PER_GPU
                        kept = (*key, _NodeRow(node.name, sum(free) / MILLI_PER_GPU, frag))
                        computed += 1
                    new[node.name] = kept
                    nodes.append(kept[-1])  # type: ignore[arg-type]
                    if computed:  # bfgd's measure of a node: up to ~0.2 ms
                        break
        self._node_row = new
        return nodes

    def render_groups(self, pause: Pause, numbers: dict[float, str]) -> list[FamilyGroup | RenderedGroup]:
        """groups(), from the text kept since the last scrape where its inputs are unchanged (the same bytes)."""
        with self._render_lock:  # the kept texts and sums change in place: one render at a time
            try:
                return self._render_groups(pause, numbers)
            except BaseException:
                # the sums are kept only together with the texts they add up: start both afresh
                self._pod_text, self._scope_sums = {}, _empty_scope_sums()
                self._sorted_keys.clear()
                raise

    def _count(self, text: _PodText, sign: int) -> None:
        """Add (1) or take away (-1) a pod's allocation in its node's, namespace's and ClusterQueue's sums."""
        memory, cores, vgpus = text.totals
        for sums, key in zip(self._scope_sums.values(), text.scopes, strict=True):
            total = sums.get(key)
            if total is None:
                total = sums[key] = [0, 0, 0, 0]
                self._sorted_keys.clear()
            total[0] += sign * memory
            total[1] += sign * cores
            total[2] += sign * vgpus
            total[3] += sign
            if not total[3]:
                del sums[key]  # its last pod: the series goes away, as it does in groups()
                self._sorted_keys.clear()

    def _render_groups(self, pause: Pause, numbers: dict[float, str]) -> list[FamilyGroup | RenderedGroup]:
        state = self.scheduler.state
        rules = self._queue_rules()
        with state.lock:
            now = state.clock()
            records = list(state.pods.values())
            node_states = list(state.nodes.values())
        kept = self._pod_text
        per_pod_gpu = self.per_pod_gpu
        labels = sorted_labels(POD_GPU_LABELS), sorted_labels(POD_LABELS)
        gpu_parts: list[list[bytes]] = [[] for _ in _POD_GPU_FAMILIES]
        seconds_parts: list[list[bytes]] = [[] for _ in _SECONDS_FAMILIES]
        counted_uids: set[str] = set()
        nodes_get, kept_get = state.nodes.get, kept.get  # the loop below runs 40,000 times a scrape
        # a pod whose text is kept: ~1 us, and its three counter lines formatted: ~2-4 us
        pods_per_chunk = ROWS_PER_CHUNK
        for start in range(0, len(records), pods_per_chunk):
            pause()
            texts: list[_PodText] = []
            held: list[float | None] = []
            changed: list[tuple[int, PodRecord, list[GpuState], _PodRow]] = []
            with state.lock:
                for record in records[start:start + pods_per_chunk]:
                    node = nodes_get(record.node_name)
                    if node is None or not record.applied:
                        continue  # not counted on a node (its node is not known yet)
                    queue = (rules.queue_of(record.uid, record.namespace, record.labels) if rules else None) or ""
                    bound_at_s = record.bound_at_s
                    if bound_at_s is None or not record.confirmed:
                        held.append(None)
                    else:  # a bind time ahead of this clock (skew between replicas) counts as just bound
                        held_s = now - bound_at_s
                        held.append(held_s if held_s > 0 else 0.0)
                    text = kept_get(record.uid)
                    if (text is None or text.record is not record or text.usage is not record.usage
                            or text.gpus is not node.gpus or text.queue != queue):
                        gpus = node.gpus
                        copied = tuple((str(gpus[u.position].index), gpus[u.position].uuid, u.memory_mib, u.cores,
                                        u.vgpus) for u in record.usage)
                        changed.append((len(texts), record, gpus, _PodRow(
                            record.namespace, record.name, record.uid, node.name, queue, None, copied)))
                    texts.append(text)  # type: ignore[arg-type]  # replaced below when changed
            for done, (slot, record, gpus, row) in enumerate(changed):  # rendered outside the lock
                if done % 4 == 3:
                    pause()  # ~20 us a pod
                text = texts[slot] = self._pod_text_of(record, gpus, row, per_pod_gpu, labels, numbers)
                previous = kept.get(text.uid)
                if previous is not None:
                    self._count(previous, -1)
                self._count(text, 1)
                kept[text.uid] = text
            counted_uids.update([text.uid for text in texts])
            if per_pod_gpu:
                for position, parts in enumerate(gpu_parts):
                    parts.extend([text.gpu_lines[position] for text in texts])
            counted = [(text, held_s) for text, held_s in zip(texts, held, strict=True) if held_s is not None]
            for position, parts in enumerate(seconds_parts):
                which, name = _SECONDS_OF[position], _SECONDS_FAMILIES[position].sample_name
                lines = [f"{name}{text.labels}{go_whole(int(text.totals[which] * held_s))}"
                         for text, held_s in counted]
                if lines:
                    parts.append(("\n".join(lines) + "\n").encode())
        self._drop_uncounted(counted_uids, pause)
        groups: list[FamilyGroup | RenderedGroup] = [RenderedGroup(_POD_GPU_FAMILIES, gpu_parts)]
        groups.extend(self._aggregate_groups(pause, numbers))
        groups.append(RenderedGroup(_SECONDS_FAMILIES, seconds_parts))
        nodes = self._cached_node_rows(node_states, pause)
        policy = self.scheduler.default_node_policy.name
        groups.append(self._fragmented.render((((row.name, policy), (row.fragmented_gpus,)) for row in nodes),
                                              pause, numbers))
        groups.append(self._idle.render((((row.name,), (row.idle_gpus,)) for row in nodes), pause, numbers))
        return groups

    def _drop_uncounted(self, counted_uids: set[str], pause: Pause) -> None:
        """Forget the pods gone (or no longer counted on a node) since the last scrape, a chunk at a time."""
        kept = self._pod_text
        uids = list(kept)
        for start in range(0, len(uids), ROWS_PER_CHUNK * 10):
            pause()
            for uid in uids[start:start + ROWS_PER_CHUNK * 10]:
                if uid not in counted_uids:
                    self._count(kept.pop(uid), -1)

    def _aggregate_groups(self, pause: Pause, numbers: dict[float, str]) -> list[FamilyGroup | RenderedGroup]:
        """The per-node, namespace and ClusterQueue allocation groups, from the sums kept with the pods' texts."""
        by_scope = self._scope_sums
        node_sums = by_scope["node"]
        groups: list[FamilyGroup | RenderedGroup] = [self._node_allocated.render(
            (((key,), tuple(node_sums[key][:3])) for key in self._sorted_keys_of("node")), pause, numbers)]
        for scope in ("namespace", "cluster_queue"):
            sums = by_scope[scope]
            groups.append(FamilyGroup(_scope_families(scope), [scope],
                                      [((key,), list(sums[key])) for key in self._sorted_keys_of(scope)]))
        return groups

    def _sorted_keys_of(self, scope: str) -> list[str]:
        """A scope's keys in order, sorted again only after a key came or went (5000 nodes: ~2 ms of sorting that
        would hold the GIL in one piece every scrape)."""
        keys = self._sorted_keys.get(scope)
        if keys is None:
            keys = self._sorted_keys[scope] = sorted(self._scope_sums[scope])
        return keys

    @staticmethod
    def _pod_text_of(record: PodRecord, gpus: list[GpuState], row: _PodRow, per_pod_gpu: bool,
                     labels: tuple[tuple[list[int], list[str]], tuple[list[int], list[str]]],
                     numbers: dict[float, str]) -> _PodText:
        (gpu_order, gpu_names), (pod_order, pod_names) = labels
        gpu_lines: tuple[bytes, ...] = ()
        if per_pod_gpu:
            gpu_labels = [label_text(gpu_names, [(row.namespace, row.name, row.uid, row.node, index, uuid,
                                                  row.cluster_queue)[i] for i in gpu_order])
                          for index, uuid, _, _, _ in row.gpus]
            gpu_lines = rows_text(_POD_GPU_FAMILIES, gpu_labels, [gpu[2:] for gpu in row.gpus], numbers)
        totals = (sum(gpu[2] for gpu in row.gpus), sum(gpu[3] for gpu in row.gpus), sum(gpu[4] for gpu in row.gpus))
        pod_labels = label_text(pod_names, [(row.namespace, row.name, row.cluster_queue)[i] for i in pod_order])
        return _PodText(record, record.uid, record.usage, gpus, row.cluster_queue,
                        gpu_lines, pod_labels + " ", totals, (row.node, row.namespace, row.cluster_queue))


def _empty_scope_sums() -> dict[str, dict[str, list[int]]]:
    return {"node": {}, "namespace": {}, "cluster_queue": {}}


#: which of a pod's totals (MiB, cores, vGPUs) each GPU-seconds counter multiplies: vGPUs, MiB, cores
_SECONDS_OF = (2, 0, 1)
