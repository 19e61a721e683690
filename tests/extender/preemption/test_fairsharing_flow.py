"""Fair sharing through the real scheduler, gate and preemptor: a queue that would borrow less than another
takes back from it (Kueue's LessThanOrEqualToFinalShare), which the classic cohort rules never allow."""

from __future__ import annotations

from typing import Any

import pytest

from tests.extender.preemption.test_preemption_flow import MemoryEvictor
from tests.quota.helpers import FLAVORS, a100_node, gpu_queue, local_queue, make_env, queued_pod

RECLAIM = "  preemption: {reclaimWithinCohort: Any}\n"


def fair_env(fair_sharing: bool) -> Any:
    # a(4), b(4, reclaims) and c(4) in cohort ai: 12 A100 vGPUs on 3 nodes of 4
    quota = (FLAVORS + gpu_queue("a", {"a100": 4}, cohort="ai") + gpu_queue("b", {"a100": 4}, cohort="ai",
                                                                           extra=RECLAIM)
             + gpu_queue("c", {"a100": 4}, cohort="ai")
             + local_queue("team-a", "q", "a") + local_queue("team-b", "q", "b") + local_queue("team-c", "q", "c"))
    env = make_env(quota, [a100_node(f"n{i}", gpus=4) for i in range(3)], fair_sharing=fair_sharing)
    evictor = MemoryEvictor(env.cluster)
    env.scheduler.enable_preemption(evictor, inline=True)
    return env, evictor


@pytest.mark.parametrize("fair_sharing", [True, False])
def test_a_smaller_borrower_takes_back_from_a_larger_one(fair_sharing: bool) -> None:
    env, evictor = fair_env(fair_sharing)
    for i in range(8):  # a borrows c's 4 (c is idle): 4 of 12, share 333
        assert isinstance(env.submit(queued_pod("q", "team-a", gpus=1, memory_mib=4096, name=f"a-{i}",
                                                created=f"2027-01-15T08:00:{i:02d}Z")), str)
    for i in range(4):
        assert isinstance(env.submit(queued_pod("q", "team-b", gpus=1, memory_mib=4096, name=f"b-{i}")), str)
    # b wants 2 more, one at a time: it would borrow 1 (share 83), then 2 (166); a without one pod borrows 3
    # (250), without two 2 (166): both times a's share after is >= b's
    extra = [queued_pod("q", "team-b", gpus=1, memory_mib=4096, name=f"b-extra-{i}") for i in range(2)]
    outcome = env.submit(extra[0])
    assert not isinstance(outcome, str)
    if not fair_sharing:  # the classic rules: b would borrow, and borrowWithinCohort is Never
        assert evictor.requests == []
        return
    assert [r.name for r in evictor.requests] == ["a-7"]
    assert evictor.requests[0].rule == ("fairSharing: a share 250 without this pod >= b share 83 after admission "
                                        "(LessThanOrEqualToFinalShare)")
    assert isinstance(env.retry(extra[0]), str)
    assert not isinstance(env.submit(extra[1]), str)
    assert [r.name for r in evictor.requests] == ["a-7", "a-6"]
    assert evictor.requests[1].rule == ("fairSharing: a share 166 without this pod >= b share 166 after admission "
                                        "(LessThanOrEqualToFinalShare)")
    assert isinstance(env.retry(extra[1]), str)
    assert env.used("a", "a100") == 6 and env.used("b", "a100") == 6
    # equal shares now (166 each): b's next pod (250 after) may not take from a (a without one: 83)
    more = queued_pod("q", "team-b", gpus=1, memory_mib=4096, name="b-more")
    assert not isinstance(env.submit(more), str)
    assert len(evictor.requests) == 2
