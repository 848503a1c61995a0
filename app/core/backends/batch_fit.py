"""The batch the batcher fills to: for a model whose forward is the bound, the size that serves the most images a
second on this device, timed at warm-up.

The largest batch is not always the fastest per image. One CPU thread computes ViT-S/16's batch of 8 at about 150 ms
an image and its batch of 32 at about 185 (the activations outgrow the caches), so under load a batcher that fills to
32 serves a fifth fewer images than one that stops at 8. A model whose image costs a few milliseconds is left at the
largest batch: there the serving path's own cost per batch weighs, which the forward's timing does not see, and runs
that short time no better than the scheduler's slices on a busy host.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Literal

from app.core.backends.predictor import Predictor, batch_sizes

log = logging.getLogger("app.inference")
# a larger batch within this of the best rate is kept: the timing's noise (a size's two runs differ by a few
# percent), no more, since under load the batcher serves what its batch's rate is
TOLERANCE = 0.05
REPEATS = 2  # timed runs of each size (after the warm-up's); the faster counts
TIMED_FROM_S = 0.02  # a forward of one image at least this long is timed by size; a cheaper one keeps the largest batch


def images_per_second(
    run: Callable[[int], object],
    sizes: list[int],
    repeats: int = REPEATS,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[int, float]:
    """Each size's images a second, the faster of `repeats` runs of `run(size)`, from the smallest size up; it stops
    after two sizes in a row under (1 - TOLERANCE) of the best so far (a larger one would be slower still; one alone
    may be a busy moment)."""
    rates: dict[int, float] = {}
    slow = 0
    for size in sorted(sizes):
        fastest = min(timed(run, size, clock) for _ in range(repeats))
        best = rates[size] = size / fastest
        slow = slow + 1 if best < (1 - TOLERANCE) * max(rates.values()) else 0
        if slow == 2:
            break
    return rates


def timed(run: Callable[[int], object], size: int, clock: Callable[[], float]) -> float:
    started = clock()
    run(size)
    return max(clock() - started, 1e-9)


def preferred(rates: dict[int, float]) -> int:
    """The largest timed size whose rate is within TOLERANCE of the best."""
    top = max(rates.values())
    return max(size for size, rate in rates.items() if rate >= (1 - TOLERANCE) * top)


def fitted_batch_size(
    name: str,
    predictor: Predictor,
    asked: int | Literal["auto"],
    max_batch_size: int,
    warm: bool,
    clock: Callable[[], float] = time.perf_counter,
) -> int:
    """VIT_PREFERRED_BATCH_SIZE for this model: a fixed number as given; auto on the CPU, after the warm-up, for a
    forward of one image of TIMED_FROM_S or more, the size timed to serve the most; else VIT_MAX_BATCH_SIZE."""
    if asked != "auto":
        return asked
    if not warm or predictor.device.type != "cpu":
        return max_batch_size
    one = min(timed(predictor.run_blank, 1, clock) for _ in range(REPEATS))
    if one < TIMED_FROM_S:
        return max_batch_size
    rates = images_per_second(predictor.run_blank, batch_sizes(max_batch_size), clock=clock)
    chosen = preferred(rates)
    timings = ", ".join(f"{size}: {rate:.1f}" for size, rate in rates.items())
    log.info("model %s: batches of up to %d (images a second by batch size at warm-up: %s)", name, chosen, timings)
    return chosen
