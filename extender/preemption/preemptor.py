"""Preemption on GPU shares, wired into filter (issue 14): when a pod fits no node's GPUs, choose victims on one
node (victims.py, allowed by rules.py), nominate the pod there and evict them (executor.py); while nominated, the
freed GPUs are held for it (nominations.py). Called by the Scheduler with the cluster state's lock held; no I/O
here (evictions run on the executor's threads).

What it decides on: the nodes kube-scheduler offered (its own plugins passed them: CPU, memory, taints, affinity)
where the pod failed for GPU reasons only (memory, cores, exclusivity, vGPU slots, topology) and the quota gate
would admit it. Victims: bound pods with an assignment on that node, not terminating, not protected by a recent
PodDisruptionBudget refusal, that the rules allow (plain priority; Kueue's withinClusterQueue for two pods of one
ClusterQueue). A gang victim takes its whole gang.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from kube_vgpu import protocol
from kube_vgpu.extender.engine.fit import place
from kube_vgpu.extender.engine.model import NodeState, Placement, PlacementRequest
from kube_vgpu.extender.engine.policies.base import Policy
from kube_vgpu.extender.gangs import GangKey, GangTracker
from kube_vgpu.extender.gates import Gate
from kube_vgpu.extender.preemption.evict import EvictionRequest
from kube_vgpu.extender.preemption.executor import EvictionExecutor
from kube_vgpu.extender.preemption.fairsharing import DEFAULT_STRATEGIES, borrow_below, fair_quota_victims
from kube_vgpu.extender.preemption.nominations import Nomination, RunningPod, Victim, running_pod
from kube_vgpu.extender.preemption.quota_victims import QuotaCandidate, find_quota_victims
from kube_vgpu.extender.preemption.rules import PodFacts, QueueRules, QueueSnapshot, Verdict, may_preempt
from kube_vgpu.extender.preemption.victims import Candidate, GangMember, Victims, find_victims, pick_node
from kube_vgpu.extender.quota.accounting import FlavorResource, QuotaTree
from kube_vgpu.extender.quota.objects import LOWER_PRIORITY, Preemption
from kube_vgpu.extender.state import ClusterState

log = logging.getLogger(__name__)

#: how many nodes with victims a decision compares, at least, and as a share of the refusing nodes (kube-scheduler's
#: DefaultPreemption defaults: minCandidateNodesAbsolute 100, minCandidateNodesPercentage 10)
MIN_CANDIDATE_NODES = 100
CANDIDATE_NODES_PERCENT = 10


class Preemptor:
    def __init__(self, state: ClusterState, gangs: GangTracker, executor: EvictionExecutor,
                 gates: Sequence[Gate]) -> None:
        self.state = state
        self.gangs = gangs
        self.executor = executor
        self.nominations = executor.nominations
        self.gates = list(gates)
        self._queue_rules: QueueRules | None = next(
            (rules for rules in (gate.queue_rules() for gate in self.gates) if rules is not None), None)
        self.nominations.on_drop = self._dropped
        self._next_start = 0

    def _dropped(self, nomination: Nomination) -> None:
        if nomination.quota_hold and self._queue_rules is not None:
            self._queue_rules.release(nomination.preemptor_uid)
            nomination.quota_hold = False

    def before_filter(self, uid: str) -> None:
        """A nominated preemptor whose victims are gone is about to be filtered: its quota hold goes, so that the
        quota gate admits it on what the victims freed (it binds right after)."""
        nomination = self.nominations.by_preemptor.get(uid)
        if nomination is not None and nomination.quota_hold and not nomination.waiting_for():
            self._dropped(nomination)

    # --- holding a nominated node's GPUs -----------------------------------------------------------------------
    def held(self, node: NodeState, uid: str, priority: int, request: PlacementRequest, gpu_policy: Policy,
             node_policy: Policy) -> str | None:
        """Why the pod may not use this node's GPUs, which are held for nominated preemptors of higher or equal
        priority (None: it fits beside them)."""
        holding = self.nominations.holding(node.name, uid, priority)
        if not holding:
            return None
        work = node.copy()
        for nomination in holding:
            work.apply_usage(nomination.usage, 1)
        if isinstance(place(work, request, gpu_policy, node_policy), Placement):
            return None
        names = ", ".join(f"{n.namespace}/{n.name}" for n in holding[:3])
        return f"GPUs held for {names} (priority {holding[0].priority}), which preempted pods on this node"

    # --- deciding --------------------------------------------------------------------------------------------
    def on_unplaced(self, pod: Mapping[str, Any], uid: str, request: protocol.PodGpuRequest,
                    placement_request: PlacementRequest, gpu_policy: Policy, node_policy: Policy,
                    gpu_failed: Sequence[str], quota_failed: Sequence[tuple[str, Placement]],
                    failed: dict[str, str]) -> None:
        """The pod fits no node: report its nomination's progress in `failed`, or start a preemption."""
        nomination = self.nominations.by_preemptor.get(uid)
        if nomination is not None:
            waiting = nomination.waiting_for()
            if nomination.node_name in failed:
                names = ", ".join(f"{v.namespace}/{v.name} ({v.state.value})" for v in waiting[:5])
                failed[nomination.node_name] = (
                    f"preempting for this pod on this node: waiting for {len(waiting)} victim(s) to leave: {names}; "
                    f"{nomination.rule}" if waiting else
                    f"nominated to this node, its GPUs held for this pod: {nomination.rule}")
            return
        preemptor = running_pod(pod)
        if preemptor.never_preempts:
            return
        if self.executor.room() <= 0:
            log.info("preemption for %s/%s deferred: %d evictions in flight", preemptor.namespace, preemptor.name,
                     self.executor.in_flight)
            return
        metadata = pod.get("metadata") or {}
        queue = (self._queue_rules.queue_of(uid, preemptor.namespace, metadata.get("labels") or {})
                 if self._queue_rules is not None else None)
        snapshot = self._queue_rules.snapshot(queue) if self._queue_rules is not None else QueueSnapshot()
        facts = PodFacts(uid, preemptor.priority, preemptor.created_s, queue, preemptor.never_preempts)
        found: list[tuple[Victims, dict[str, str]]] = []
        # as kube-scheduler (minCandidateNodesPercentage / Absolute): enough nodes with victims to choose well from,
        # not all of them; the start rotates so that successive preemptors spread over the cluster
        wanted = max(MIN_CANDIDATE_NODES, len(gpu_failed) * CANDIDATE_NODES_PERCENT // 100)
        start = self._next_start % len(gpu_failed) if gpu_failed else 0
        self._next_start += 1
        for name in [*gpu_failed[start:], *gpu_failed[:start]]:
            node = self.state.nodes.get(name)
            if node is None or any(gate.check(pod, request, node) for gate in self.gates):
                continue  # quota would refuse it here anyway: evicting for GPUs cannot help
            result = self._victims_on(node, facts, snapshot, placement_request, gpu_policy, node_policy)
            if result is not None:
                found.append(result)
                if len(found) >= wanted:
                    break
        best = pick_node(victims for victims, _rules in found)
        if best is None and quota_failed and queue is not None and self._queue_rules is not None:
            if self._on_quota(pod, uid, preemptor, facts, request, quota_failed, failed):
                return
        if best is None:
            last = self.nominations.last_outcome.get(uid)
            if last:  # why its last preemption ended, beside each node's own reason
                for name in gpu_failed:
                    if name in failed:
                        failed[name] = f"{failed[name]}; preemption: {last}"
            return
        rules = next(rules for victims, rules in found if victims is best)
        self._start(uid, preemptor, best, rules, queue)
        failed[best.node_name] = (f"preempting {best.count} pod(s) on this node for this pod: "
                                  f"{', '.join(sorted(set(rules.values())))[:300]}")

    # --- preemption on quota (Kueue's reclaimWithinCohort / withinClusterQueue) --------------------------------
    def _on_quota(self, pod: Mapping[str, Any], uid: str, preemptor: RunningPod, facts: PodFacts,
                  request: protocol.PodGpuRequest, quota_failed: Sequence[tuple[str, Placement]],
                  failed: dict[str, str]) -> bool:
        """The pod's GPUs fit on these nodes but its ClusterQueue is short: evict pods whose quota it may take.
        True when a preemption started."""
        rules_source = self._queue_rules
        assert rules_source is not None
        for node_name, placement in quota_failed[:8]:  # nodes of one flavor ask the same: a few are enough
            node = self.state.nodes.get(node_name)
            found = rules_source.needs_on(pod, request, node) if node is not None else None
            if node is None or found is None:
                continue
            queue, needs = found
            snapshot = rules_source.snapshot(queue, needs)
            candidates: list[QuotaCandidate] = []
            rules: dict[str, str] = {}
            tree = rules_source.tree().clone()
            leaving = 0
            for charge in rules_source.charges():
                if charge.uid == uid:
                    continue
                running = self.nominations.facts.get(charge.uid)
                if running is None:
                    continue
                if self.nominations.claimed(charge.uid):
                    # being evicted for another preemptor, whose needs its hold already counts
                    tree.add(charge.cluster_queue, charge.amounts, -1)
                    continue
                if running.terminating:
                    # evicted already (before a restart of ours, say): its quota is as good as free, and it is
                    # never evicted twice
                    tree.add(charge.cluster_queue, charge.amounts, -1)
                    leaving += 1
                    continue
                verdict = may_preempt(facts, PodFacts(charge.uid, charge.priority, charge.created_s,
                                                      charge.cluster_queue), snapshot)
                record = self.state.pods.get(charge.uid)
                gang = record.labels.get(protocol.LABEL_KUEUE_POD_GROUP_NAME) if record is not None else None
                allowed = verdict.allowed and not self.nominations.protected(charge.uid)
                candidates.append(QuotaCandidate(charge.uid, charge.cluster_queue, charge.amounts, charge.priority,
                                                 charge.created_s, allowed,
                                                 f"{running.namespace}/{gang}" if gang else None))
                rules[charge.uid] = verdict.rule
            if snapshot.fair_sharing and tree.root_of(queue) is not None:
                victims = self._fair_victims(tree, queue, needs, candidates, rules, facts, snapshot)
            else:
                victims = find_quota_victims(tree, queue, needs, candidates)
            if victims is None or (not victims and not leaving):
                continue  # not enough to take; or it fits already (something else refused it)
            chosen = ({v.uid: rules[v.uid] for v in victims} if victims else
                      {"": f"waiting for {leaving} terminating pod(s) to leave"})
            nomination = self._nominate(uid, preemptor, node, placement, chosen, queue)
            rules_source.hold(uid, queue, needs)
            nomination.quota_hold = True
            failed[node_name] = (f"preempting {len(victims)} pod(s) for this pod's quota in ClusterQueue {queue}: "
                                 f"{', '.join(sorted(set(chosen.values())))[:300]}")
            return True
        return False

    @staticmethod
    def _fair_victims(tree: QuotaTree, queue: str, needs: Mapping[FlavorResource, int],
                      candidates: list[QuotaCandidate], rules: dict[str, str], facts: PodFacts,
                      snapshot: QueueSnapshot) -> list[QuotaCandidate] | None:
        """Kueue's fair-sharing strategies between the cohort's queues (preemption/fairsharing.py); each victim's
        rule becomes the share comparison that chose it."""
        policy = snapshot.preemption.get(queue, Preemption())
        below = borrow_below(facts.priority, policy.borrow_within_cohort == LOWER_PRIORITY,
                             policy.max_priority_threshold)
        found = fair_quota_victims(tree, snapshot.weights, queue, needs, candidates, rules,
                                   borrow_below_priority=below, strategies=snapshot.strategies or DEFAULT_STRATEGIES)
        if found is None:
            return None
        rules.update(found.rules)
        return found.victims

    def _victims_on(self, node: NodeState, preemptor: PodFacts, snapshot: QueueSnapshot,
                    request: PlacementRequest, gpu_policy: Policy,
                    node_policy: Policy) -> tuple[Victims, dict[str, str]] | None:
        """The cheapest victims on this node, with the rule that allowed each; None when none would do."""
        work = node.copy()
        for other in self.nominations.by_node.get(node.name, ()):
            if other.preemptor_uid != preemptor.uid:
                work.apply_usage(other.usage, 1)  # GPUs already promised to another preemptor
        candidates: list[Candidate] = []
        rules: dict[str, str] = {}
        elsewhere: dict[str, list[GangMember]] = {}
        leaving = 0
        for uid in self.state.pods_by_node.get(node.name, ()):
            record = self.state.pods.get(uid)
            facts = self.nominations.facts.get(uid)
            if record is None or not record.applied or facts is None:
                continue
            if self.nominations.claimed(uid):
                work.apply_usage(record.usage, -1)  # being evicted for another preemptor, whose usage is added
                continue
            if facts.terminating:
                # leaving already (evicted before a restart of ours, or deleted): its GPUs are as good as free, and
                # it is never evicted twice
                work.apply_usage(record.usage, -1)
                leaving += 1
                continue
            if not (record.bound and record.confirmed):
                continue  # a bind in flight is nobody's victim yet
            verdict = self._verdict(preemptor, uid, record.labels, facts, snapshot)
            gang = record.labels.get(protocol.LABEL_KUEUE_POD_GROUP_NAME)
            gang_key = f"{record.namespace}/{gang}" if gang else None
            allowed = verdict.allowed and not self.nominations.protected(uid)
            candidates.append(Candidate(uid, facts.priority, facts.started_s, record.usage, gang_key, allowed))
            rules[uid] = verdict.rule
            if gang_key is not None and gang_key not in elsewhere:
                elsewhere[gang_key] = self._gang_elsewhere(gang_key, node.name, preemptor, snapshot, rules)
        if not leaving and not any(c.allowed for c in candidates):
            return None
        result = find_victims(work, request, candidates, gpu_policy, node_policy, gangs=elsewhere)
        if not isinstance(result, Victims) or not (result.count or leaving):
            return None
        if not result.count:
            rules = {"": f"waiting for {leaving} terminating pod(s) to leave"}  # a nomination with no eviction
        chosen = {c.uid for c in result.victims} | {m.uid for m in result.extra} | {""}
        return result, {uid: rule for uid, rule in rules.items() if uid in chosen}

    def _gang_elsewhere(self, gang_key: str, node_name: str, preemptor: PodFacts, snapshot: QueueSnapshot,
                        rules: dict[str, str]) -> list[GangMember]:
        namespace, _, name = gang_key.partition("/")
        gang = self.gangs.gangs.get(GangKey(namespace, name))
        members = []
        for member in gang.members.values() if gang is not None else ():
            if not member.bound_to or member.bound_to == node_name:
                continue
            record = self.state.pods.get(member.uid)
            facts = self.nominations.facts.get(member.uid)
            if record is None or facts is None:
                continue
            verdict = self._verdict(preemptor, member.uid, record.labels, facts, snapshot)
            rules[member.uid] = verdict.rule
            members.append(GangMember(member.uid, facts.priority, facts.started_s,
                                      verdict.allowed and not self.nominations.protected(member.uid)))
        return members

    def _verdict(self, preemptor: PodFacts, uid: str, labels: Mapping[str, str], facts: RunningPod,
                 snapshot: QueueSnapshot) -> Verdict:
        queue = self._queue_rules.queue_of(uid, facts.namespace, labels) if self._queue_rules is not None else None
        candidate = PodFacts(uid, facts.priority, facts.created_s, queue)
        return may_preempt(preemptor, candidate, snapshot)

    def _start(self, uid: str, preemptor: RunningPod, best: Victims, rules: Mapping[str, str],
               queue: str | None) -> None:
        chosen = {victim: rules.get(victim, "") for victim in [c.uid for c in best.victims] +
                  [m.uid for m in best.extra]}
        if not chosen:
            chosen = {"": rules.get("", "")}  # nothing to evict: terminating pods are leaving already
        self._nominate(uid, preemptor, self.state.nodes[best.node_name], best.placement, chosen, queue)

    def _nominate(self, uid: str, preemptor: RunningPod, node: NodeState, placement: Placement,
                  chosen: Mapping[str, str], queue: str | None = None) -> Nomination:
        """Nominate the preemptor to the node (its planned usage held there) and evict the victims (uid -> the
        rule that allowed it; the uid "" stands for "none, waiting": its rule is the nomination's)."""
        victims: dict[str, Victim] = {}
        requests: list[EvictionRequest] = []
        for victim_uid, victim_rule in chosen.items():
            record = self.state.pods.get(victim_uid)
            if record is None:
                continue
            victims[victim_uid] = Victim(victim_uid, record.namespace, record.name)
            requests.append(EvictionRequest(record.namespace, record.name, victim_uid, preemptor.namespace,
                                            preemptor.name, uid, victim_rule, record.node_name, queue or ""))
        rule = "; ".join(sorted(set(chosen.values())))
        nomination = Nomination(uid, preemptor.namespace, preemptor.name, preemptor.priority, node.name,
                                placement.usage, rule, self.state.clock(), victims)
        self.nominations.add(nomination)
        log.info("preemption: %s/%s nominated to %s, evicting %s (%s)", preemptor.namespace, preemptor.name,
                 node.name, ", ".join(f"{r.namespace}/{r.name}" for r in requests) or "nobody", rule)
        self.executor.submit(requests)
        return nomination
