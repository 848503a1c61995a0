from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence

import pytest

from app.core.batching.batcher import DynamicBatcher
from app.core.contract.errors import InferenceFailed, NotReady, Overloaded, RequestTimeout
from tests.support.clients import until


class Recorder:
    """A run_batch that doubles its inputs and records every batch it was given."""

    def __init__(self, delay: float = 0.0, poison: int | None = None) -> None:
        self.batches: list[list[int]] = []
        self.delay = delay
        self.poison = poison
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()  # set once a batch is under way

    def __call__(self, items: list[int]) -> list[int]:
        self.entered.set()
        self.gate.wait(5)
        if self.poison is not None and self.poison in items:
            raise RuntimeError("poisoned batch")
        self.batches.append(list(items))
        time.sleep(self.delay)
        return [2 * i for i in items]


class Observer:
    def __init__(self) -> None:
        self.sizes: list[int] = []
        self.drops: dict[str, int] = {}

    def batch_done(self, size: int, seconds: float, outputs: Sequence[object]) -> None:
        self.sizes.append(size)

    def dropped(self, reason: str, count: int) -> None:
        self.drops[reason] = self.drops.get(reason, 0) + count

    def queue_depth(self, depth: int) -> None:
        pass


def far() -> float:
    return time.monotonic() + 60


async def outputs(*requests: asyncio.Future[list[int]]) -> list[int]:
    """The outputs of each request, one after another."""
    return [o for request in requests for o in await request]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_batch_size": 0}, "max_batch_size must be an integer >= 1"),
        ({"max_batch_size": 2.5}, "max_batch_size must be an integer >= 1"),
        ({"max_wait_ms": -1}, "max_wait_ms must be a finite number >= 0"),
        ({"max_wait_ms": float("inf")}, "max_wait_ms must be a finite number >= 0"),
        ({"max_queue": 0}, "max_queue must be an integer >= 1"),
        ({"in_flight": 0}, "in_flight must be an integer >= 1"),
    ],
)
def test_settings_are_checked_at_construction(kwargs: dict[str, float], message: str) -> None:
    args = {"max_batch_size": 4, "max_wait_ms": 5.0, "max_queue": 10, **kwargs}
    with pytest.raises(ValueError, match=message):
        DynamicBatcher(Recorder(), **args)  # type: ignore[arg-type]


async def test_concurrent_requests_share_batches_and_each_gets_its_own_output() -> None:
    run = Recorder()
    batcher: DynamicBatcher[int, int] = DynamicBatcher(run, max_batch_size=8, max_wait_ms=50, max_queue=100)
    batcher.start()

    async def one(i: int) -> int:
        (output,) = await batcher.submit([i], far())
        return output

    results = await asyncio.gather(*(one(i) for i in range(20)))
    await batcher.stop()
    assert results == [2 * i for i in range(20)]  # one output per input, in the right place
    assert max(len(b) for b in run.batches) == 8  # full batches formed
    assert all(len(b) <= 8 for b in run.batches)
    assert sorted(i for b in run.batches for i in b) == list(range(20))  # each computed exactly once


async def test_with_two_in_flight_the_next_batch_is_taken_while_one_computes() -> None:
    run = Recorder()
    run.gate.clear()  # the first batch blocks in its worker thread
    batcher: DynamicBatcher[int, int] = DynamicBatcher(run, max_batch_size=2, max_wait_ms=0, max_queue=100, in_flight=2)
    batcher.start()
    first = batcher.submit([0, 1], far())
    await until(run.entered.is_set)
    second = batcher.submit([2, 3], far())
    third = batcher.submit([4, 5], far())
    await until(lambda: batcher.queue_depth == 2)  # the second batch was taken while the first computes
    assert run.batches == []  # both are in the worker threads, the third waits for a free one
    run.gate.set()
    assert await outputs(first, second, third) == [0, 2, 4, 6, 8, 10]
    assert await batcher.drain(5)  # idle only once no batch is in flight
    await batcher.stop()
    assert sorted(map(sorted, run.batches)) == [[0, 1], [2, 3], [4, 5]]


async def test_with_one_in_flight_the_next_batch_waits_for_the_worker() -> None:
    run = Recorder()
    run.gate.clear()
    batcher: DynamicBatcher[int, int] = DynamicBatcher(run, max_batch_size=2, max_wait_ms=0, max_queue=100)
    batcher.start()
    first = batcher.submit([0, 1], far())
    await until(run.entered.is_set)
    second = batcher.submit([2, 3, 4], far())  # fills a batch of 2, and one more
    await asyncio.sleep(0.05)  # time to take another batch, which the loop must not
    assert batcher.queue_depth == 3
    run.gate.set()
    assert await outputs(first, second) == [0, 2, 4, 6, 8]
    await batcher.stop()


async def test_a_lone_request_is_not_held_back() -> None:
    run = Recorder()
    batcher: DynamicBatcher[int, int] = DynamicBatcher(run, max_batch_size=64, max_wait_ms=500, max_queue=100)
    batcher.start()
    started = time.monotonic()
    assert await batcher.submit([1], far()) == [2]
    waited = time.monotonic() - started
    await batcher.stop()
    assert waited < 0.4  # nothing else was coming, so it did not wait out the 500 ms
    assert run.batches == [[1]]


async def test_waits_for_admitted_requests_still_being_prepared() -> None:
    run = Recorder()
    # a wait far longer than the test: the batch is run when the admitted images arrive, not when it ends
    batcher: DynamicBatcher[int, int] = DynamicBatcher(run, max_batch_size=8, max_wait_ms=30_000, max_queue=100)
    batcher.start()
    with batcher.admit(2) as slow:  # a request still decoding its two images
        first = batcher.submit([1], far())
        await asyncio.sleep(0.05)  # time for the loop to take a batch, which it must not
        assert run.batches == []  # the first image waits for the ones on their way
        later = slow.submit([2, 3], far())
    assert await outputs(first, later) == [2, 4, 6]
    assert run.batches == [[1, 2, 3]]


async def test_a_batch_goes_once_as_many_images_are_queued_as_are_still_coming() -> None:
    """Clients in step send their requests together; the first half decoded is computed while the second half
    decodes, rather than the two halves waiting for each other and the worker thread idling meanwhile."""
    run = Recorder()
    batcher: DynamicBatcher[int, int] = DynamicBatcher(run, max_batch_size=8, max_wait_ms=30_000, max_queue=100)
    batcher.start()
    with batcher.admit(2) as slow:  # two images still decoding
        first = batcher.submit([1, 2], far())  # two queued: as many as are coming
        assert await asyncio.wait_for(first, 5) == [2, 4]  # not held for the 30 s wait
        later = slow.submit([3, 4], far())
    assert await later == [6, 8]
    await batcher.stop()
    assert run.batches == [[1, 2], [3, 4]]


async def test_waiting_for_company_is_bounded_by_max_wait() -> None:
    run = Recorder()
    batcher: DynamicBatcher[int, int] = DynamicBatcher(run, max_batch_size=8, max_wait_ms=50, max_queue=100)
    batcher.start()
    with batcher.admit(2):  # more coming than queued, but never submitted within the wait
        started = time.monotonic()
        assert await batcher.submit([1], far()) == [2]
        waited = time.monotonic() - started
    await batcher.stop()
    assert 0.045 <= waited < 1.0


async def test_admitted_work_counts_against_the_queue_and_is_released_on_failure() -> None:
    batcher: DynamicBatcher[int, int] = DynamicBatcher(Recorder(), max_batch_size=2, max_wait_ms=0, max_queue=3)
    batcher.start()
    with pytest.raises(RuntimeError), batcher.admit(3):
        with pytest.raises(Overloaded):
            batcher.submit([9], far())  # 3 admitted + 1 > 3
        raise RuntimeError("decoding failed")
    assert await batcher.submit([1, 2, 3], far()) == [2, 4, 6]  # room is free again
    await batcher.stop()


async def test_drain_waits_for_admitted_requests() -> None:
    batcher: DynamicBatcher[int, int] = DynamicBatcher(Recorder(), max_batch_size=4, max_wait_ms=0, max_queue=100)
    batcher.start()
    with batcher.admit(1) as admission:
        drain = asyncio.create_task(batcher.drain(timeout_s=5))
        await asyncio.sleep(0.05)  # time for the drain to end, which it must not
        assert not drain.done()  # accepted before the drain: it must still be answered
        future = admission.submit([5], far())
    assert await drain and await future == [10]
    await batcher.stop()


async def test_multi_image_request_is_queued_whole_and_shares_batches() -> None:
    run = Recorder()
    batcher: DynamicBatcher[int, int] = DynamicBatcher(run, max_batch_size=4, max_wait_ms=20, max_queue=100)
    batcher.start()
    a = batcher.submit([1, 2, 3], far())
    b = batcher.submit([4, 5], far())
    assert await outputs(a, b) == [2, 4, 6, 8, 10]
    await batcher.stop()
    assert run.batches[0] == [1, 2, 3, 4]  # the second request filled the first batch


async def test_bounded_queue_refuses_with_retry_after() -> None:
    run = Recorder()
    run.gate.clear()  # hold the worker so the queue fills
    batcher: DynamicBatcher[int, int] = DynamicBatcher(run, max_batch_size=2, max_wait_ms=0, max_queue=4)
    batcher.start()
    first = batcher.submit([0, 1], far())
    await until(run.entered.is_set)  # the first batch is taken and blocks on the gate
    queued = batcher.submit([2, 3, 4, 5], far())
    with pytest.raises(Overloaded, match="4 images already waiting") as e:
        batcher.submit([6], far())
    assert e.value.retry_after_s is not None and e.value.retry_after_s >= 1
    run.gate.set()
    assert await outputs(first, queued) == [0, 2, 4, 6, 8, 10]  # accepted work is all answered
    await batcher.stop()


async def test_cancelled_items_are_dropped_not_computed() -> None:
    run = Recorder()
    run.gate.clear()
    observer = Observer()
    batcher: DynamicBatcher[int, int] = DynamicBatcher(run, 2, 0, 100, observer)
    batcher.start()
    busy = batcher.submit([0], far())
    await until(run.entered.is_set)
    gone = batcher.submit([7, 8], far())
    kept = batcher.submit([9], far())
    gone.cancel()  # the client went away
    run.gate.set()
    assert await outputs(busy, kept) == [0, 18]
    await batcher.stop()
    assert all(7 not in b and 8 not in b for b in run.batches)
    assert observer.drops == {"cancelled": 2}


async def test_expired_items_get_a_timeout_and_are_not_computed() -> None:
    run = Recorder()
    run.gate.clear()
    observer = Observer()
    batcher: DynamicBatcher[int, int] = DynamicBatcher(run, 1, 0, 100, observer)
    batcher.start()
    busy = batcher.submit([0], far())
    await until(run.entered.is_set)
    deadline = time.monotonic() + 0.01
    late = batcher.submit([5], deadline)
    await until(lambda: time.monotonic() > deadline)
    run.gate.set()
    with pytest.raises(RequestTimeout):
        await late
    await busy
    await batcher.stop()
    assert [5] not in run.batches and observer.drops == {"expired": 1}


async def test_failing_batch_is_retried_in_halves_and_only_the_bad_items_request_fails() -> None:
    run = Recorder(poison=3)
    batcher: DynamicBatcher[int, int] = DynamicBatcher(run, max_batch_size=8, max_wait_ms=30, max_queue=100)
    batcher.start()
    with batcher.admit(7):  # one batch: the requests wait for each other
        requests = [batcher.submit([i], far()) for i in (0, 1, 2)]
        requests.append(batcher.submit([3, 4], far()))  # the poisoned image's request, with a good one
        requests += [batcher.submit([i], far()) for i in (5, 6, 7)]
    results = await asyncio.gather(*requests, return_exceptions=True)
    await batcher.stop()
    assert len(run.batches) > 1  # retried in parts
    assert isinstance(results[3], InferenceFailed)
    assert [r for i, r in enumerate(results) if i != 3] == [[0], [2], [4], [10], [12], [14]]


async def test_drain_answers_accepted_work_then_refuses_new() -> None:
    run = Recorder(delay=0.02)
    batcher: DynamicBatcher[int, int] = DynamicBatcher(run, max_batch_size=2, max_wait_ms=0, max_queue=100)
    batcher.start()
    request = batcher.submit(list(range(10)), far())
    assert await batcher.drain(timeout_s=5)
    assert request.done() and not request.cancelled()
    assert request.result() == [2 * i for i in range(10)]
    with pytest.raises(NotReady, match="shutting down"):
        batcher.submit([1], far())
    await batcher.stop()


async def test_batcher_keeps_serving_after_a_failure() -> None:
    run = Recorder(poison=-1)
    batcher: DynamicBatcher[int, int] = DynamicBatcher(run, max_batch_size=4, max_wait_ms=0, max_queue=100)
    batcher.start()
    bad = batcher.submit([-1], far())
    with pytest.raises(InferenceFailed):
        await bad
    assert await batcher.submit([21], far()) == [42]
    await batcher.stop()


class Parts:
    """A group's `on_parts`: every delivery, as it came."""

    def __init__(self) -> None:
        self.deliveries: list[list[tuple[int, list[int] | BaseException]]] = []

    def __call__(self, parts: list[tuple[int, list[int] | BaseException]]) -> None:
        self.deliveries.append(list(parts))

    def of(self, k: int) -> list[int] | BaseException:
        (answer,) = [a for delivery in self.deliveries for part, a in delivery if part == k]
        return answer


async def test_a_groups_requests_are_answered_each_with_its_own_outputs_and_together() -> None:
    run = Recorder()
    batcher: DynamicBatcher[int, int] = DynamicBatcher(run, max_batch_size=8, max_wait_ms=0, max_queue=100)
    batcher.start()
    parts = Parts()
    group = batcher.submit_group([1, 2, 3, 4, 5], [1, 3, 0, 1], [far()] * 4, parts)
    await group.future
    await batcher.stop()
    assert run.batches == [[1, 2, 3, 4, 5]]
    assert [parts.of(k) for k in range(4)] == [[2], [4, 6, 8], [], [10]]
    # the request without images is answered at once; the three the batch completed, in one delivery
    assert sorted(len(d) for d in parts.deliveries) == [1, 3]


async def test_a_groups_bad_image_fails_only_its_own_request() -> None:
    run = Recorder(poison=3)
    batcher: DynamicBatcher[int, int] = DynamicBatcher(run, max_batch_size=8, max_wait_ms=0, max_queue=100)
    batcher.start()
    parts = Parts()
    group = batcher.submit_group([0, 1, 2, 3, 4, 5], [2, 2, 2], [far()] * 3, parts)
    await group.future
    await batcher.stop()
    assert parts.of(0) == [0, 2] and parts.of(2) == [8, 10]
    assert isinstance(parts.of(1), InferenceFailed)


async def test_a_groups_request_ended_alone_has_its_queued_images_dropped() -> None:
    run = Recorder()
    run.gate.clear()
    observer = Observer()
    batcher: DynamicBatcher[int, int] = DynamicBatcher(run, 2, 0, 100, observer)
    batcher.start()
    busy = batcher.submit([0], far())
    await until(run.entered.is_set)
    parts = Parts()
    group = batcher.submit_group([7, 8, 9], [2, 1], [far()] * 2, parts)
    group.cancel(0)  # its client went away
    assert len(parts.deliveries) == 1 and isinstance(parts.of(0), asyncio.CancelledError)  # answered at once
    run.gate.set()
    await group.future
    assert await busy == [0]
    await batcher.stop()
    assert parts.of(1) == [18]
    assert all(7 not in b and 8 not in b for b in run.batches)
    assert observer.drops == {"cancelled": 2}


async def test_a_groups_requests_keep_their_own_deadlines() -> None:
    run = Recorder()
    run.gate.clear()
    batcher: DynamicBatcher[int, int] = DynamicBatcher(run, 1, 0, 100)
    batcher.start()
    busy = batcher.submit([0], far())
    await until(run.entered.is_set)
    parts = Parts()
    group = batcher.submit_group([5, 6], [1, 1], [time.monotonic() + 0.05, far()], parts)
    await until(lambda: parts.deliveries != [])  # the timer answers the first, while the worker is held
    assert isinstance(parts.of(0), RequestTimeout)
    run.gate.set()
    await group.future
    await busy
    await batcher.stop()
    assert parts.of(1) == [12]
    assert [5] not in run.batches


async def test_a_group_that_does_not_fit_is_refused_whole() -> None:
    run = Recorder()
    run.gate.clear()
    batcher: DynamicBatcher[int, int] = DynamicBatcher(run, max_batch_size=1, max_wait_ms=0, max_queue=3)
    batcher.start()
    busy = batcher.submit([0], far())
    await until(run.entered.is_set)
    assert batcher.fits(3) and not batcher.fits(4)
    with pytest.raises(Overloaded):
        batcher.submit_group([1, 2, 3, 4], [2, 2], [far()] * 2, Parts())
    run.gate.set()
    await busy
    await batcher.stop()
    assert run.batches == [[0]]


async def test_stopping_fails_every_request_of_a_queued_group() -> None:
    run = Recorder()
    run.gate.clear()
    batcher: DynamicBatcher[int, int] = DynamicBatcher(run, 1, 0, 100)
    batcher.start()
    batcher.submit([0], far())
    await until(run.entered.is_set)
    parts = Parts()
    group = batcher.submit_group([1, 2], [1, 1], [far()] * 2, parts)
    run.gate.set()
    await batcher.stop()
    assert group.future.done()
    assert all(isinstance(parts.of(k), NotReady) for k in range(2))
