"""Allocation gauges per pod, node, namespace and ClusterQueue, and usage-accounting counters per pod, computed at
scrape time from the state (no cost per bind, nothing accumulated in memory).

Accounting: each bound pod's counters are its allocation times the seconds since its bind-time annotation (written
by our bind, carried by the Binding), read at scrape time:

    kube_vgpu_pod_vgpu_seconds_total            = vGPUs        x (now - bind time)
    kube_vgpu_pod_gpu_memory_mib_seconds_total  = MiB          x (now - bind time)
    kube_vgpu_pod_gpu_core_percent_seconds_total = cores (%)   x (now - bind time)   (100 %-seconds = 1 GPU-second)

each in whole units, rounded down: still monotonic (a pod's value only grows), short of the exact product by less
than one unit, and written as integers (`29491200`, where prometheus_client would write `2.94912e+07`: the same
number for any parser), so that a scrape fills 120,000 values at 40,000 pods into kept templates with one `%` per
few nodes instead of formatting each in Python.

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
from itertools import chain, repeat
from operator import mul, sub
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
    label_text,
    no_pause,
    rows_text,
    sorted_labels,
)

if TYPE_CHECKING:
    from kube_vgpu.extender.engine.model import GpuState, GpuUsage, NodeState
    from kube_vgpu.extender.preemption.rules import QueueRules
    from kube_vgpu.extender.scheduler import Scheduler
    from kube_vgpu.extender.state import ClusterState, PodRecord

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
    #: the GPU-seconds counters' line after their name: `{labels} %d` and a newline (`%` in a label doubled), the
    #: value filled in every scrape (one for the three: ~300 bytes a pod less than a line each)
    counter_tail: bytes
    totals: tuple[int, int, int]  # MiB, cores, vGPUs over its GPUs
    scopes: tuple[str, str, str]  # node, namespace, ClusterQueue: the aggregates it counts in


@dataclass(frozen=True, slots=True)
class _NodeText:
    """A node's counted pods' text as rendered for one scrape, valid while the node object, its GPU list, its
    version, the state's pod mark for it (ClusterState.pod_marks: any change of a pod record on it) and, with a
    quota gate, its pods' queues are the ones it was rendered from."""

    node: NodeState
    gpus: list[GpuState]
    version: int
    mark: int
    pods: tuple[_PodText, ...]  # by UID
    #: per family: the pods' per-pod-and-GPU gauge lines, their own pieces (not joined: the pods keep them, and a
    #: copy per node would hold them twice: ~40 MiB at 40,000 pods); empty when turned off
    gpu_lines: tuple[tuple[bytes, ...], ...]
    #: per family: a `name{labels} %d` line for each pod whose GPU use is accounted (confirmed, with a bind time):
    #: the values move with the clock, so each scrape fills them in, with the amount the counter multiplies (per
    #: family, per such pod) and the bind time
    counter_lines: tuple[bytes, ...]
    counter_amounts: tuple[tuple[int, ...], ...]
    bound_at_s: tuple[float, ...]


#: nodes copied under the state lock between two calls of pause() (~8 pods a node: ~50-100 us); five times as many
#: whose text is kept are checked in one step
NODES_PER_CHUNK = 25
#: nodes whose pods' counters are formatted in one step (~80 pods, three lines each)
COUNTER_NODES_PER_STEP = 10


def _counted_pods(state: ClusterState, node: NodeState) -> list[PodRecord]:
    """The pods counted on a node (caller holds the state lock), by UID: the order /metrics writes them in."""
    pods = state.pods
    records = [pods[uid] for uid in state.pods_by_node.get(node.name, ())]
    records = [record for record in records if record.applied]
    records.sort(key=_uid_of)
    return records


def _uid_of(record: PodRecord) -> str:
    return record.uid


def _queue_of(rules: QueueRules | None, record: PodRecord) -> str:
    """A pod's ClusterQueue as of now ("" outside any, or without a quota gate)."""
    return (rules.queue_of(record.uid, record.namespace, record.labels) if rules else None) or ""


def _queues_moved(rules: QueueRules, pods: tuple[_PodText, ...]) -> bool:
    """Whether a quota gate's config or admissions moved any of these pods to another ClusterQueue."""
    return any(_queue_of(rules, text.record) != text.queue for text in pods)


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

    /metrics (render_groups) keeps text between scrapes, node by node (_NodeText: its pods' gauge lines and their
    counters' lines with the values left out, kept while the node's version and the state's pod mark for it are
    the same), and the per-node lines by their values (RowTextCache); only the counters' values are filled in every
    scrape. A scrape of 5000 nodes and 40,000 pods that changed nothing is then ~5000 look-ups and 120,000 integers
    written by C code (bench/render_cost.py: 83-92 ms of CPU, 209 before, when every pod was looked at).
    groups() (collect(), and the reference the tests compare it with) renders everything afresh, in the same order
    (nodes as the state holds them, each node's pods by UID)."""

    def __init__(self, scheduler: Scheduler, *, per_pod_gpu: bool = True) -> None:
        self.scheduler = scheduler
        self.per_pod_gpu = per_pod_gpu
        #: node name -> its pods' text as last rendered (only nodes present at the last scrape)
        self._node_text: dict[str, _NodeText] = {}
        #: scope ("node", "namespace", "cluster_queue") -> key -> [MiB, cores, vGPUs, pods] over the pods in
        #: _node_text
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
        """What the metrics need, as plain rows, under the state lock: node by node in the state's order, each
        node's counted pods by UID (the order render_groups writes them in). Only this runs under the lock:
        building the samples is most of a scrape's cost, and filter waits for it. Copied a few nodes at a time, the
        lock released and `pause` called between them. A pod bound or gone between two chunks shows in the next
        scrape."""
        state = self.scheduler.state
        rules = self._queue_rules()
        pods: list[_PodRow] = []
        with state.lock:
            now = state.clock()
            node_states = list(state.nodes.values())
        for start in range(0, len(node_states), NODES_PER_CHUNK):
            pause()
            with state.lock:
                for node in node_states[start:start + NODES_PER_CHUNK]:
                    if state.nodes.get(node.name) is not node:
                        continue  # deleted (or replaced) since the list was taken
                    gpus = node.gpus
                    for record in _counted_pods(state, node):
                        queue = _queue_of(rules, record)
                        held = tuple((str(gpus[u.position].index), gpus[u.position].uuid, u.memory_mib, u.cores,
                                      u.vgpus) for u in record.usage)
                        # a bind time ahead of this clock (skew between replicas) counts as just bound
                        held_s = (max(0.0, now - record.bound_at_s)
                                  if record.confirmed and record.bound_at_s is not None else None)
                        pods.append(_PodRow(record.namespace, record.name, record.uid, node.name, queue, held_s,
                                            held))
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
        """groups(), from the text kept since the last scrape where its inputs are unchanged (the same samples)."""
        with self._render_lock:  # the kept texts and sums change in place: one render at a time
            try:
                return self._render_groups(pause, numbers)
            except BaseException:
                # the sums are kept only together with the texts they add up: start both afresh
                self._node_text, self._scope_sums = {}, _empty_scope_sums()
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
        """Node by node: a node whose text is kept costs a look-up and four comparisons (with a quota gate, also
        its pods' queues), and its pods' counters are formatted with the others', a batch of nodes at a time, by
        one `%` of a kept template over their values (computed by map(): no Python code per pod)."""
        state = self.scheduler.state
        with state.lock:
            now = state.clock()
            node_states = list(state.nodes.values())
        texts = self._node_texts(node_states, pause, numbers)
        gpu_parts: list[list[bytes]] = [[] for _ in _POD_GPU_FAMILIES]
        seconds_parts: list[list[bytes]] = [[] for _ in _SECONDS_FAMILIES]
        for start in range(0, len(texts), COUNTER_NODES_PER_STEP):
            pause()
            batch = texts[start:start + COUNTER_NODES_PER_STEP]
            if self.per_pod_gpu:
                for position, parts in enumerate(gpu_parts):
                    parts.extend(chain.from_iterable([text.gpu_lines[position] for text in batch]))
            bound_at_s = list(chain.from_iterable([text.bound_at_s for text in batch]))
            if not bound_at_s:
                continue
            # a bind time ahead of this clock (skew between replicas) counts as just bound
            held_s = list(map(max, map(sub, repeat(now, len(bound_at_s)), bound_at_s), repeat(0.0)))
            for position, parts in enumerate(seconds_parts):
                template = b"".join([text.counter_lines[position] for text in batch])
                amounts = chain.from_iterable([text.counter_amounts[position] for text in batch])
                parts.append(template % tuple(map(int, map(mul, amounts, held_s))))
        groups: list[FamilyGroup | RenderedGroup] = [RenderedGroup(_POD_GPU_FAMILIES, gpu_parts)]
        groups.extend(self._aggregate_groups(pause, numbers))
        groups.append(RenderedGroup(_SECONDS_FAMILIES, seconds_parts))
        nodes = self._cached_node_rows(node_states, pause)
        policy = self.scheduler.default_node_policy.name
        groups.append(self._fragmented.render((((row.name, policy), (row.fragmented_gpus,)) for row in nodes),
                                              pause, numbers))
        groups.append(self._idle.render((((row.name,), (row.idle_gpus,)) for row in nodes), pause, numbers))
        return groups

    def _node_texts(self, node_states: list[NodeState], pause: Pause, numbers: dict[float, str]) -> list[_NodeText]:
        """Every node's pods' text, kept where still valid, rendered again where not; the sums follow."""
        state = self.scheduler.state
        rules = self._queue_rules()
        old = self._node_text
        new: dict[str, _NodeText] = {}
        marks = state.pod_marks
        texts: list[_NodeText] = []
        position = 0
        while position < len(node_states):
            pause()
            # under the lock at a time: 125 kept nodes (~0.5 us each) or up to 4 whose pods are copied (~10 us a
            # node), rendered outside it
            changed: list[tuple[int, NodeState, int, int, list[tuple[PodRecord, str, float | None]]]] = []
            with state.lock:
                for node in node_states[position:position + NODES_PER_CHUNK * 5]:
                    position += 1
                    if state.nodes.get(node.name) is not node:
                        continue  # deleted (or replaced) since the list was taken
                    text = old.get(node.name)
                    mark = marks.get(node.name, 0)
                    if (text is not None and text.node is node and text.gpus is node.gpus
                            and text.version == node.version and text.mark == mark
                            and (rules is None or not _queues_moved(rules, text.pods))):
                        texts.append(text)
                        new[node.name] = text
                        continue
                    pods = [(record, _queue_of(rules, record), record.bound_at_s if record.confirmed else None)
                            for record in _counted_pods(state, node)]
                    changed.append((len(texts), node, node.version, mark, pods))
                    texts.append(text)  # type: ignore[arg-type]  # replaced below
                    if len(changed) == 4:
                        break
            for slot, node, version, mark, pods in changed:  # rendered outside the lock
                pause()  # ~20 us a pod
                text = texts[slot] = self._node_text_of(node, version, mark, pods, old.get(node.name), numbers)
                new[node.name] = text
        names = list(old)
        for start in range(0, len(names), NODES_PER_CHUNK * 10):
            pause()
            for name in names[start:start + NODES_PER_CHUNK * 10]:
                if name not in new:  # its node is gone: so are its pods from the sums
                    for pod in old[name].pods:
                        self._count(pod, -1)
        self._node_text = new
        return texts

    def _node_text_of(self, node: NodeState, version: int, mark: int,
                      pods: list[tuple[PodRecord, str, float | None]], previous: _NodeText | None,
                      numbers: dict[float, str]) -> _NodeText:
        """A node's pods' text; a pod's own text is reused from `previous` while its record, usage, GPUs and queue
        are the same. The node's, namespaces' and ClusterQueues' sums follow the pods that came and went."""
        kept = {text.uid: text for text in previous.pods} if previous is not None and previous.node is node else {}
        gpus = node.gpus
        labels = sorted_labels(POD_GPU_LABELS), sorted_labels(POD_LABELS)
        texts: list[_PodText] = []
        for record, queue, _ in pods:
            text = kept.get(record.uid)
            if (text is None or text.record is not record or text.usage is not record.usage or text.gpus is not gpus
                    or text.queue != queue):
                copied = tuple((str(gpus[u.position].index), gpus[u.position].uuid, u.memory_mib, u.cores, u.vgpus)
                               for u in record.usage)
                row = _PodRow(record.namespace, record.name, record.uid, node.name, queue, None, copied)
                text = self._pod_text_of(record, gpus, row, self.per_pod_gpu, labels, numbers)
            texts.append(text)
        # the new pods first, then the old ones taken away: a key's sums never pass through 0 on the way (which
        # would drop it and sort the keys again)
        before = {id(text) for text in previous.pods} if previous is not None else set()
        after = {id(text) for text in texts}
        for text in texts:
            if id(text) not in before:
                self._count(text, 1)
        if previous is not None:
            for text in previous.pods:
                if id(text) not in after:
                    self._count(text, -1)
        accounted = [(text, bound_at_s) for text, (_, _, bound_at_s) in zip(texts, pods, strict=True)
                     if bound_at_s is not None]
        tails = [b"", *[text.counter_tail for text, _ in accounted]]
        counter_lines = tuple(family.sample_name.encode().join(tails) if accounted else b""
                              for family in _SECONDS_FAMILIES)
        counter_amounts = tuple(tuple(text.totals[which] for text, _ in accounted) for which in _SECONDS_OF)
        gpu_lines = tuple(tuple([text.gpu_lines[position] for text in texts if text.gpu_lines[position]])
                          if self.per_pod_gpu else () for position in range(len(_POD_GPU_FAMILIES)))
        return _NodeText(node, gpus, version, mark, tuple(texts), gpu_lines, counter_lines, counter_amounts,
                         tuple(bound_at_s for _, bound_at_s in accounted))

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
                        gpu_lines, (pod_labels.replace("%", "%%") + " %d\n").encode(), totals,
                        (row.node, row.namespace, row.cluster_queue))


def _empty_scope_sums() -> dict[str, dict[str, list[int]]]:
    return {"node": {}, "namespace": {}, "cluster_queue": {}}


#: which of a pod's totals (MiB, cores, vGPUs) each GPU-seconds counter multiplies: vGPUs, MiB, cores
_SECONDS_OF = (2, 0, 1)
