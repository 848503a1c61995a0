"""What waits in the batcher: one request's items (`Request`), several requests' items as one entry (`Group`),
and each queued item (`Pending`)."""

from __future__ import annotations

import asyncio
import bisect
import itertools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar, cast

from opentelemetry.trace import SpanContext

from app.core.contract.errors import TIMED_OUT, RequestTimeout

log = logging.getLogger("app.batcher")

In = TypeVar("In")
Out = TypeVar("Out")


@dataclass(eq=False)
class Request(Generic[Out]):
    """One request's items in the batcher: its outputs, in item order, filled in as its batches finish."""

    future: asyncio.Future[list[Out]]  # its outputs once all are computed; or the first item's error
    outputs: list[Out | None]
    deadline: float  # time.monotonic() after which the result is no longer wanted
    span: SpanContext | None  # the request's span, which its batches' spans link to
    remaining: int

    def answer(self, index: int, output: Out) -> None:
        if self.future.done():
            return
        self.outputs[index] = output
        self.remaining -= 1
        if self.remaining == 0:
            self.future.set_result(cast("list[Out]", self.outputs))

    def fail(self, error: BaseException) -> None:
        if not self.future.done():
            self.future.set_exception(error)

    def fail_item(self, index: int, error: BaseException) -> None:
        """Item `index` cannot be computed: the request fails."""
        self.fail(error)

    def dropped(self, index: int, now: float) -> str | None:
        """Why item `index` is no longer wanted ("cancelled", "expired"), where the request's own future does
        not say so; None while it is (a `Group`'s parts end one by one)."""
        return None


class Group(Request[Out]):
    """Several requests' items as one entry: request k (its part) is items starts[k] to starts[k + 1].

    `on_parts([(k, outputs or error), ...])` is called once for each part, from the event loop: with its outputs
    once the last of them is computed (the parts a batch completes, together, once the batch's items are
    answered), or with what ended it (`fail_item` for one of its items, `end`, the deadline timer, or `fail`
    for all). The future is done (an empty list) once every part has been delivered."""

    def __init__(
        self,
        counts: Sequence[int],
        deadlines: Sequence[float],
        on_parts: Callable[[list[tuple[int, list[Out] | BaseException]]], None],
    ) -> None:
        total = sum(counts)
        future: asyncio.Future[list[Out]] = asyncio.get_running_loop().create_future()
        super().__init__(future, [None] * total, max(deadlines), None, total)
        self.starts = [0, *itertools.accumulate(counts)]
        self.deadlines = list(deadlines)
        self.left = list(counts)
        self.ended = [False] * len(counts)
        self.live = len(counts)
        self.on_parts = on_parts
        self.computed: list[tuple[int, list[Out] | BaseException]] = []  # parts complete, to be delivered
        self.timer: asyncio.TimerHandle | None = None
        for k, count in enumerate(counts):
            if count == 0:
                self.complete(k)
        self.arm(min(deadlines))

    def arm(self, deadline: float | None) -> None:
        """Expire the parts due at `deadline` then (one timer for the group, set again for the next deadline)."""
        if deadline is not None and self.live:
            delay = max(0.0, deadline - time.monotonic())
            self.timer = asyncio.get_running_loop().call_later(delay, self.tick)

    def tick(self) -> None:
        self.timer = None
        self.arm(self.expire(time.monotonic()))

    def part(self, index: int) -> int:
        return bisect.bisect_right(self.starts, index) - 1

    def answer(self, index: int, output: Out) -> None:
        k = self.part(index)
        if self.ended[k]:
            return
        self.outputs[index] = output
        self.left[k] -= 1
        if self.left[k] == 0:
            self.complete(k)

    def complete(self, k: int) -> None:
        """Part `k` computed: delivered with the others complete in this go of the event loop."""
        self.ended[k] = True
        self.live -= 1
        if not self.computed:
            asyncio.get_running_loop().call_soon(self.deliver)
        self.computed.append((k, cast("list[Out]", self.outputs[self.starts[k] : self.starts[k + 1]])))

    def deliver(self) -> None:
        parts, self.computed = self.computed, []
        self.delivered(parts)

    def end(self, k: int, error: BaseException) -> None:
        """Part `k` answered with `error` now; its items not yet computed are dropped."""
        if self.ended[k]:
            return
        self.ended[k] = True
        self.live -= 1
        self.delivered([(k, error)])

    def delivered(self, parts: list[tuple[int, list[Out] | BaseException]]) -> None:
        try:
            if parts:
                self.on_parts(parts)
        except Exception:
            log.exception("a grouped request's answer failed")
        if self.live == 0 and not self.computed and not self.future.done():
            if self.timer is not None:
                self.timer.cancel()
                self.timer = None
            self.future.set_result([])

    def cancel(self, k: int) -> None:
        """Part `k`'s client went away: answered as cancelled now."""
        self.end(k, asyncio.CancelledError())

    def fail(self, error: BaseException) -> None:
        for k in range(len(self.ended)):
            self.end(k, error)

    def fail_item(self, index: int, error: BaseException) -> None:
        self.end(self.part(index), error)

    def expire(self, now: float) -> float | None:
        """End the parts whose deadline has passed (RequestTimeout); the earliest deadline still to come."""
        soonest = None
        for k, deadline in enumerate(self.deadlines):
            if self.ended[k]:
                continue
            if deadline <= now:
                self.end(k, RequestTimeout(TIMED_OUT))
            elif soonest is None or deadline < soonest:
                soonest = deadline
        return soonest

    def dropped(self, index: int, now: float) -> str | None:
        k = self.part(index)
        if self.ended[k]:
            return "cancelled"
        if self.deadlines[k] <= now:
            self.end(k, RequestTimeout("the request timed out before its image was computed"))
            return "expired"
        return None


@dataclass(eq=False)
class Pending(Generic[In, Out]):
    """One queued item."""

    payload: In
    request: Request[Out]
    index: int  # in its request
    enqueued: float = field(default_factory=time.monotonic)
