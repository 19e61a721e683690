"""extender/binding.py through both faces, on a real Scheduler: the async face the HTTP server uses (cancellation
while waiting, cancellation while writing, cancellation while a prepare reads the pod, the wait limit) and the
blocking face (the same rules). tests/extender/test_http.py drives the async face through the server."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from kube_vgpu.extender.binding import BindError, BindOrdering, PreparedBind
from kube_vgpu.extender.scheduler import Scheduler
from kube_vgpu.extender.state import ClusterState
from tests.extender.test_bind_failures import GatedCluster, add, used
from tests.helpers import gpu_node


def gated(**node_kwargs: Any) -> tuple[ClusterState, GatedCluster, Scheduler]:
    """A node whose Binding calls wait for `cluster.gate`: the first bind holds the node's turn until released."""
    state = ClusterState()
    cluster = GatedCluster(state, [gpu_node("n1", gpus=1, memory_mib=10000, **node_kwargs)])
    return state, cluster, Scheduler(state, cluster)


def start_first_bind(cluster: GatedCluster, scheduler: Scheduler) -> tuple[threading.Thread, dict[str, Any]]:
    first = add(cluster, memory_mib=4000)
    writer = threading.Thread(target=scheduler.bind, args=("default", first["name"], first["uid"], "n1"))
    writer.start()
    assert cluster.in_flight.wait(10)  # its Binding is being written: it holds the node's turn
    return writer, first


def test_async_cancelled_while_waiting_releases_its_reservation_and_the_node_goes_on() -> None:
    state, cluster, scheduler = gated()
    writer, first = start_first_bind(cluster, scheduler)
    second = add(cluster, memory_mib=3000)
    prepared = scheduler.prepare_bind("default", second["name"], second["uid"], "n1")
    assert prepared is not None and used(state) == 7000

    async def cancel_while_waiting() -> None:
        task = asyncio.ensure_future(scheduler.ordering.commit_async(scheduler, prepared))
        await asyncio.sleep(0)  # the task is now waiting for the turn
        assert not task.done()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancel_while_waiting())
    assert used(state) == 4000  # the cancelled bind's reservation is gone
    cluster.gate.set()
    writer.join(10)
    assert cluster.order == [first["name"]]  # the cancelled bind was never written
    assert not scheduler.ordering.busy_nodes()
    third = add(cluster, memory_mib=3000)  # and the node takes the next bind at once
    scheduler.bind("default", third["name"], third["uid"], "n1")
    assert cluster.order == [first["name"], third["name"]] and used(state) == 7000


def test_async_cancelled_after_its_turn_came_still_writes_and_passes_the_turn_on() -> None:
    state, cluster, scheduler = gated()
    second = add(cluster, memory_mib=3000)
    prepared = scheduler.prepare_bind("default", second["name"], second["uid"], "n1")
    assert prepared is not None

    async def cancel_while_writing() -> None:
        task = asyncio.ensure_future(scheduler.ordering.commit_async(scheduler, prepared))
        while not cluster.in_flight.is_set():  # its turn came at once: the Binding is being written
            await asyncio.sleep(0.01)
        task.cancel()
        cluster.gate.set()  # the API server answers
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancel_while_writing())
    finished = threading.Event()
    for _ in range(1000):  # the commit goes on in its thread after the caller gave up; wait for it to end
        if not scheduler.ordering.busy_nodes():
            finished.set()
            break
        finished.wait(0.01)
    assert finished.is_set()
    assert cluster.order == [second["name"]]  # a write that reached the API server is not unwound
    assert used(state) == 3000 and state.pods[second["uid"]].node_name == "n1"
    assert not scheduler.ordering.busy_nodes()


@pytest.mark.parametrize("face", ["async", "blocking"])
def test_a_bind_that_waits_past_the_limit_gives_up_with_a_reason_and_frees_everything(face: str) -> None:
    state, cluster, scheduler = gated()
    scheduler.ordering = BindOrdering(turn_wait_limit_s=0.2)
    writer, first = start_first_bind(cluster, scheduler)
    second = add(cluster, memory_mib=3000)
    prepared = scheduler.prepare_bind("default", second["name"], second["uid"], "n1")
    assert prepared is not None
    with pytest.raises(BindError, match="waited more than 0 s for the node's earlier binds"):
        if face == "async":
            asyncio.run(scheduler.ordering.commit_async(scheduler, prepared))
        else:
            scheduler.ordering.commit_blocking(scheduler, prepared)
    assert used(state) == 4000 and second["uid"] not in state.pods
    cluster.gate.set()
    writer.join(10)
    assert cluster.order == [first["name"]] and not scheduler.ordering.busy_nodes()
    scheduler.bind("default", second["name"], second["uid"], "n1")  # kube-scheduler's retry succeeds
    assert used(state) == 7000


@pytest.mark.parametrize("face", ["async", "blocking"])
def test_a_pod_deleted_while_waiting_is_not_bound(face: str) -> None:
    state, cluster, scheduler = gated()
    writer, _ = start_first_bind(cluster, scheduler)
    second = add(cluster, memory_mib=3000)
    prepared = scheduler.prepare_bind("default", second["name"], second["uid"], "n1")
    assert prepared is not None
    cluster.delete_pod("default", second["name"])
    assert used(state) == 4000
    outcome: list[BaseException] = []

    def run() -> None:
        try:
            if face == "async":
                asyncio.run(scheduler.ordering.commit_async(scheduler, prepared))
            else:
                scheduler.ordering.commit_blocking(scheduler, prepared)
        except BaseException as exc:  # the assertion is made in the test's thread
            outcome.append(exc)

    waiter = threading.Thread(target=run)
    waiter.start()
    cluster.gate.set()
    writer.join(10)
    waiter.join(10)
    assert len(outcome) == 1 and isinstance(outcome[0], BindError) and "went away" in str(outcome[0])
    assert not scheduler.ordering.busy_nodes() and used(state) == 4000


@pytest.mark.parametrize("cancelled", ["during the prepare", "after it, before the caller resumed"])
def test_async_prepare_of_a_cancelled_caller_gives_its_reservation_back(cancelled: str) -> None:
    """The async face reads a pod filter did not see in a worker thread: whichever ends second, the prepare or its
    caller's cancellation, releases what the prepare reserved, and the pod's retry is not refused."""
    state, cluster, scheduler = gated()
    cluster.gate.set()
    meta = add(cluster, memory_mib=4000)
    release_prepare = threading.Event()

    async def cancel_the_caller() -> None:
        loop = asyncio.get_running_loop()
        task: asyncio.Task[Any] | None = None

        def prepare() -> PreparedBind | None:
            assert task is not None
            if cancelled == "during the prepare":
                loop.call_soon_threadsafe(task.cancel)
                assert release_prepare.wait(10)  # the caller is gone before the prepare returns
            else:
                loop.call_soon_threadsafe(task.cancel)  # queued ahead of the prepare's result
            return scheduler.prepare_bind("default", meta["name"], meta["uid"], "n1")

        task = asyncio.ensure_future(scheduler.ordering.prepare_async(scheduler, prepare))
        task.add_done_callback(lambda _: release_prepare.set())  # the caller has let go of it by now
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancel_the_caller())
    released = threading.Event()
    for _ in range(1000):  # the prepare may still be finishing in its thread
        if not scheduler._binding:
            released.set()
            break
        released.wait(0.01)
    assert released.is_set()
    assert used(state) == 0 and meta["uid"] not in state.pods
    scheduler.bind("default", meta["name"], meta["uid"], "n1")  # kube-scheduler's retry
    assert used(state) == 4000
