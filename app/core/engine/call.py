"""One request to one model on its way through the engine: what it asks, and how it is answered.

Every edge's request becomes a `Call` and enters the engine's lane (`Lane.submit`); the call is answered once, through
`answer`, with its `Inference` or with what failed it (CancelledError when it was cancelled).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from app.core.contract.inference import Inference
from app.core.contract.request import DecodedImage, EncodedImage, InferOptions, pick
from app.core.engine.timing import decoded_before

Answer = Callable[[Inference | BaseException], None]


@dataclass(eq=False, slots=True, weakref_slot=True)
class Call:
    inputs: Sequence[EncodedImage | DecodedImage] | torch.Tensor  # files (as sent, or a front-end's), or pixels
    options: InferOptions
    timeout_s: float | None  # shortens VIT_REQUEST_TIMEOUT_S (a gRPC client's deadline)
    answer: Answer
    trace: Mapping[str, str] | None = None  # a front-end's trace context (W3C headers); None: the current one
    texts: tuple[str, ...] | None = None  # a zero-shot model's texts to embed: a request of its own, no images
    started: float = 0.0  # time.monotonic() when it reached the engine, less a front-end's decoding
    pixels: bool = False  # its inputs are pixels (a tensor), not files
    steps: asyncio.Task[None] | None = None  # the steps it takes before the batcher, where it takes any
    queued: Callable[[], object] | None = None  # cancels its images in the batcher
    answered: bool = False

    def __post_init__(self) -> None:
        self.pixels = isinstance(self.inputs, torch.Tensor)

    def settle(self, result: Inference | BaseException) -> None:
        """Answer the call, once, and let go of its inputs (a front-end's files are views of its arena, which
        cannot be unmapped while one is held) and of what would cancel it."""
        if not self.answered:
            self.answered = True
            self.inputs = ()
            self.steps = self.queued = None  # a group's cancel holds its calls: no cycle left for the collector
            self.answer(result)

    def cancel(self) -> None:
        """Stop it: its steps, or its images not yet computed (dropped by the batcher); it is answered as
        cancelled."""
        if self.steps is not None and not self.steps.done():
            self.steps.cancel()
        elif self.queued is not None:
            self.queued()


def settle_future(future: asyncio.Future[Inference], result: Inference | BaseException) -> None:
    """An answer into a future a coroutine awaits (no-op once the awaiting side gave up)."""
    if future.done():
        return
    if isinstance(result, BaseException):
        if isinstance(result, asyncio.CancelledError):
            future.cancel()
        else:
            future.set_exception(result)
    else:
        future.set_result(result)


def part_of(call: Call, indices: list[int]) -> Call:
    """The images at `indices` of `call`, as a call of their own (what the cache leaves to compute)."""
    part = Call(pick(call.inputs, indices), call.options, call.timeout_s, call.answer)
    part.started = time.monotonic() - decoded_before(part.inputs)
    return part


def answer_if_never_run(call: Call, steps: asyncio.Task[None]) -> None:
    """A call cancelled before its steps ran at all is answered all the same (a front-end holds its files
    until then)."""
    if steps.cancelled():
        call.settle(asyncio.CancelledError())
