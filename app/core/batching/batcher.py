"""Dynamic batching: images from concurrent requests share one forward pass.

A single loop takes up to `max_batch_size` queued images, waiting at most `max_wait_ms` after the
first one arrived, and runs the batch on a dedicated worker thread so the event loop keeps
accepting requests meanwhile. It waits only while more images are coming (requests admitted and still decoding)
than are queued: a lone request is not held back for company that will not come, and once as many are queued as
are still on their way, the batch goes. Waiting for the rest would leave the worker thread idle while they decode,
then the decoding idle while the batch computes: clients that send their next request as each answer comes back
would stay in step, every batch holding all of them, decoding and forward in turn instead of side by side (at 8
clients on 2 cores that served about 0.8 of the split). Under load, the
task that computed a batch takes the next one as soon as it is ready, so the worker thread does not idle for the
event loop between batches.
Each request gets one future for all its outputs, answered when its last image is computed (a batch
may hold images of many requests, and a request's images may span batches). A `Group` queues several
requests' images at once (the engine process's calls read together, to one model with the same options):
one entry for all of them, whose requests (its parts) are still answered, failed, cancelled and timed out
each on its own. Images whose request was cancelled (client gone, timed out, another of its images failed)
or whose deadline passed are dropped before they are computed. A batch that fails is retried in halves, so one bad image fails only its own
request.

With `in_flight` 2 (a predictor that decodes JPEGs on the device), the next batch is taken and handed to a
second worker thread while one computes, so the device decodes one batch while it computes the other; the
predictor keeps its own decoding and its computing each to one batch at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Generic, Protocol, TypeVar

from opentelemetry.trace import StatusCode
from opentelemetry.util.types import AttributeValue

from app.core.batching.entries import Group, Pending, Request
from app.core.contract.errors import InferenceFailed, NotReady, Overloaded, RequestTimeout, ServiceError
from app.telemetry.spans import ROOT, batch_links, current_span_context, tracer

log = logging.getLogger("app.batcher")

In = TypeVar("In")
Out = TypeVar("Out")


class BatchObserver(Protocol):
    def batch_done(self, size: int, seconds: float, outputs: Sequence[object]) -> None: ...
    def dropped(self, reason: str, count: int) -> None: ...
    def queue_depth(self, depth: int) -> None: ...


class Admission(Generic[In, Out]):
    """Room reserved in a batcher for one request's items; `submit` queues them (at most `count`)."""

    def __init__(self, batcher: DynamicBatcher[In, Out], count: int) -> None:
        self.batcher = batcher
        self.count = count

    def submit(self, payloads: Sequence[In], deadline: float) -> asyncio.Future[list[Out]]:
        if len(payloads) > self.count:
            raise ValueError(f"{len(payloads)} items submitted on an admission for {self.count}")
        return self.batcher._enqueue(payloads, deadline)


class DynamicBatcher(Generic[In, Out]):
    """Gathers submitted items into batches for `run_batch(list[In]) -> list[Out]` (one output per input)."""

    def __init__(
        self,
        run_batch: Callable[[list[In]], Sequence[Out]],
        max_batch_size: int,
        max_wait_ms: float,
        max_queue: int,
        observer: BatchObserver | None = None,
        span_attributes: dict[str, str] | None = None,
        in_flight: int = 1,
    ) -> None:
        if not isinstance(max_batch_size, int) or max_batch_size < 1:
            raise ValueError(f"max_batch_size must be an integer >= 1, got {max_batch_size!r}")
        if not math.isfinite(max_wait_ms) or max_wait_ms < 0:
            raise ValueError(f"max_wait_ms must be a finite number >= 0, got {max_wait_ms!r}")
        if not isinstance(max_queue, int) or max_queue < 1:
            raise ValueError(f"max_queue must be an integer >= 1, got {max_queue!r}")
        if not isinstance(in_flight, int) or in_flight < 1:
            raise ValueError(f"in_flight must be an integer >= 1, got {in_flight!r}")
        self.run_batch = run_batch
        self.max_batch_size = max_batch_size
        self.max_wait_s = max_wait_ms / 1000.0
        self.max_queue = max_queue
        self.observer = observer
        self.span_attributes = span_attributes or {}  # on each batch's span: the model, version, device
        self._queue: deque[Pending[In, Out]] = deque()
        self._arrived = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self.in_flight = in_flight
        self._executor = ThreadPoolExecutor(max_workers=in_flight, thread_name_prefix="forward")
        self._slots = asyncio.Semaphore(in_flight)  # batches handed to the worker threads, at most in_flight
        self._running: set[asyncio.Task[None]] = set()
        self._task: asyncio.Task[None] | None = None
        self._accepting = False
        self._incoming = 0  # images of admitted requests not yet submitted (still decoding)
        self._last_batch_s = 0.0
        self._depth_due = False  # a report of the queue's depth is scheduled
        self._device_bound_s = 0.0  # time images waited while every slot held a batch (`device_bound_s`)
        self._bound_since: float | None = None  # since when they have been waiting so, now

    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    def device_bound_s(self) -> float:
        """Seconds so far during which images waited while every worker thread held a batch: the time the
        device (not the images' arrival) held the batches back. Its growth over a span of time, as a share of
        that span, says how much of it the device was the bound."""
        now = time.monotonic()
        return self._device_bound_s + (now - self._bound_since if self._bound_since is not None else 0.0)

    def _mark_bound(self) -> None:
        """Start or stop counting `device_bound_s` as images wait, or not, with every slot taken."""
        bound = bool(self._queue) and len(self._running) >= self.in_flight
        if bound and self._bound_since is None:
            self._bound_since = time.monotonic()
        elif not bound and self._bound_since is not None:
            self._device_bound_s += time.monotonic() - self._bound_since
            self._bound_since = None

    async def wait_idle(self) -> None:
        """Until nothing is queued, arriving or computing (at once when that is so now)."""
        await self._idle.wait()

    async def settled(self) -> None:
        """Until the batches under way now have finished, their retries included (at once when none is)."""
        if self._running:
            await asyncio.wait(list(self._running))

    def start(self) -> None:
        self._accepting = True
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="dynamic-batcher")

    @contextmanager
    def admit(self, count: int) -> Iterator[Admission[In, Out]]:
        """Reserve room for `count` items still being prepared; submit them through the admission.

        Raises NotReady or Overloaded at once, before the caller spends work on the items. Once
        admitted, the items are accepted: a drain that starts meanwhile still waits for them.
        """
        self._check_room(count)
        self._incoming += count
        self._idle.clear()
        try:
            yield Admission(self, count)
        finally:
            self._incoming -= count
            self._arrived.set()  # the loop may be waiting for these items

    def _check_room(self, count: int) -> None:
        """NotReady while not accepting; Overloaded where `count` more items would pass `max_queue`."""
        if not self._accepting:
            raise NotReady("the service is shutting down; retry on another replica")
        waiting = len(self._queue) + self._incoming
        if waiting + count > self.max_queue:
            raise Overloaded(
                f"server overloaded: {waiting} images already waiting (limit {self.max_queue}); retry shortly",
                retry_after_s=self.retry_after_s(),
            )

    def fits(self, count: int) -> bool:
        """Whether `count` more items would be admitted now."""
        return self._accepting and len(self._queue) + self._incoming + count <= self.max_queue

    def submit(self, payloads: Sequence[In], deadline: float) -> asyncio.Future[list[Out]]:
        """Admit and queue all of one request's items at once, or raise NotReady/Overloaded. The future
        gives their outputs in order; cancelling it drops those not yet computed."""
        self._check_room(len(payloads))
        return self._enqueue(payloads, deadline)

    def submit_group(
        self,
        payloads: Sequence[In],
        counts: Sequence[int],
        deadlines: Sequence[float],
        on_parts: Callable[[list[tuple[int, list[Out] | BaseException]]], None],
    ) -> Group[Out]:
        """Admit and queue several requests' items as one `Group` (request k: the next counts[k] payloads, wanted
        until deadlines[k]), or raise NotReady/Overloaded for all of them."""
        self._check_room(len(payloads))
        group: Group[Out] = Group(counts, deadlines, on_parts)
        self._queue_items(payloads, group)
        return group

    def _enqueue(self, payloads: Sequence[In], deadline: float) -> asyncio.Future[list[Out]]:
        future: asyncio.Future[list[Out]] = asyncio.get_running_loop().create_future()
        outputs: list[Out | None] = [None] * len(payloads)
        request = Request(future, outputs, deadline, current_span_context(), len(payloads))
        if not payloads:
            future.set_result([])
            return future
        self._queue_items(payloads, request)
        return future

    def _queue_items(self, payloads: Sequence[In], request: Request[Out]) -> None:
        now = time.monotonic()
        self._queue.extend(Pending(payload, request, i, now) for i, payload in enumerate(payloads))
        self._mark_bound()
        self._idle.clear()
        self._arrived.set()
        if not self._depth_due:  # the gauge once per go of the event loop, not once per request
            self._depth_due = True
            asyncio.get_running_loop().call_soon(self._report_depth)

    def retry_after_s(self) -> int:
        """Seconds until the current queue has likely cleared, at least 1."""
        batches = math.ceil(len(self._queue) / self.max_batch_size)
        return max(1, math.ceil(batches * self._last_batch_s))

    async def drain(self, timeout_s: float) -> bool:
        """Stop accepting, then wait until every accepted item is answered; False on timeout."""
        self._accepting = False
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
            return True
        except TimeoutError:
            return False

    async def stop(self) -> None:
        self._accepting = False
        for task in [t for t in (self._task, *self._running) if t is not None]:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for item in self._queue:
            item.request.fail(NotReady("the service stopped before this image was computed"))
        self._queue.clear()
        self._executor.shutdown(wait=True)

    async def _loop(self) -> None:
        while True:
            if not self._queue:
                if self._incoming == 0 and not self._running:
                    self._idle.set()
                self._arrived.clear()
                await self._arrived.wait()
                continue
            await self._fill()
            await self._slots.acquire()  # a worker thread is free: the batch is taken now, as full as it got
            batch = self._take_batch()
            self._report_depth()
            if not batch:
                self._slots.release()
                continue
            running = asyncio.create_task(self._run(batch))
            self._running.add(running)
            running.add_done_callback(self._ran)
            self._mark_bound()

    def _ran(self, task: asyncio.Task[None]) -> None:
        self._running.discard(task)
        self._mark_bound()
        self._slots.release()
        self._arrived.set()  # the loop looks again: the batcher may be idle now
        if not task.cancelled() and (e := task.exception()) is not None:
            log.error("a batch's task failed: %r", e)

    async def _fill(self) -> None:
        """While more items are coming, wait until the batch is full or `max_wait` has passed since its first item
        (`_ready`). A batch task that takes the queued items meanwhile leaves the next batch's first item to time."""
        while self._queue and not self._ready():
            self._arrived.clear()
            remaining = self._queue[0].enqueued + self.max_wait_s - time.monotonic()
            try:
                await asyncio.wait_for(self._arrived.wait(), remaining)
            except TimeoutError:
                return

    def _take_batch(self) -> list[Pending[In, Out]]:
        now = time.monotonic()
        batch: list[Pending[In, Out]] = []
        gone = expired = 0
        while self._queue and len(batch) < self.max_batch_size:
            item = self._queue.popleft()
            request = item.request
            if request.deadline <= now:
                expired += 1
                request.fail(RequestTimeout("the request timed out before its image was computed"))
            elif request.future.done():  # cancelled (the client went away), or another of its images failed
                gone += 1
            elif (why := request.dropped(item.index, now)) is not None:  # its part of a group has ended
                if why == "expired":
                    expired += 1
                else:
                    gone += 1
            else:
                batch.append(item)
        if self.observer is not None:
            if gone:
                self.observer.dropped("cancelled", gone)
            if expired:
                self.observer.dropped("expired", expired)
        return batch

    async def _run(self, batch: list[Pending[In, Out]]) -> None:
        """Compute `batch`, then, while a full batch is ready without waiting, the next ones in the same task: under
        load the worker thread goes from one forward to the next without a go of the event loop between them (each
        go also parses every connection's bytes, and the thread would idle meanwhile)."""
        while batch:
            await self._compute(batch)
            batch = self._take_batch() if self._ready() else []
            self._mark_bound()
            if batch:
                self._report_depth()

    def _ready(self) -> bool:
        """Whether a batch can be taken now: it is full, as many images are queued as are still coming (none, or the
        first half of a burst), or its first item's wait is over."""
        return bool(self._queue) and (
            len(self._queue) >= self.max_batch_size
            or len(self._queue) >= self._incoming
            or time.monotonic() >= self._queue[0].enqueued + self.max_wait_s
        )

    async def _compute(self, batch: list[Pending[In, Out]]) -> None:
        loop = asyncio.get_running_loop()
        started = time.perf_counter()
        links = batch_links([i.request.span for i in batch])
        attributes: dict[str, AttributeValue] = {**self.span_attributes, "vit.batch_size": len(batch)}
        span = tracer.start_span("batch", context=ROOT, links=links, attributes=attributes) if links else None
        try:
            outputs = await loop.run_in_executor(self._executor, self.run_batch, [i.payload for i in batch])
            if len(outputs) != len(batch):
                raise RuntimeError(f"run_batch returned {len(outputs)} outputs for {len(batch)} inputs")
        except Exception as e:
            if span is not None:
                span.record_exception(e)
                span.set_status(StatusCode.ERROR, str(e))
                span.end()
            if len(batch) > 1:  # retry in halves: a poisoned image or a too-large batch fails alone
                log.warning("batch of %d failed (%s); retrying in halves", len(batch), e)
                half = len(batch) // 2
                await self._compute(batch[:half])
                await self._compute(batch[half:])
                return
            item = batch[0]
            if isinstance(e, ServiceError):  # the image's own fault (a file only the forward step decodes)
                item.request.fail_item(item.index, e)
                return
            log.error("inference failed for one image: %s", e)
            item.request.fail_item(item.index, InferenceFailed("inference failed for this image; see the server log"))
            return
        if span is not None:
            span.end()
        seconds = time.perf_counter() - started
        self._last_batch_s = seconds
        if self.observer is not None:
            self.observer.batch_done(len(batch), seconds, outputs)
        for item, output in zip(batch, outputs, strict=True):
            item.request.answer(item.index, output)

    def _report_depth(self) -> None:
        self._depth_due = False
        if self.observer is not None:
            self.observer.queue_depth(len(self._queue))
