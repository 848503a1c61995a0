"""Where a GPU model's plain JPEGs are decoded: the share the host's cores take, and the controller that finds it.

On a GPU, every decoder (nvJPEG, the JPEG engines' kernels) runs on the SMs the forward fills; the host's cores are
the one decoder that costs the GPU nothing, at a far higher price per image (docs/performance.md, "Where JPEGs are
decoded on a GPU host"). The share that serves the most is where the two run out together: decode less on the host
and the device holds the batches back; decode more and the host's cores do, while the device waits for images.
Which share that is depends on the model (a faster forward leaves the decoders less of the GPU), the host's cores
and what else spends them, and the images, so with VIT_CPU_DECODE_SHARE=auto it is measured, over windows of
`WINDOW_S`, from what the engine sees of its batches:

- how much of the window images waited while every worker thread held a batch (`DynamicBatcher.device_bound_s`):
  the device was the bound for that part;
- how long the batches waited for their decoding (`BatchTiming.input_s` against the forward's `infer_s`): whether
  there is decoding left on the device to move;
- the host's pools, seen in what the device does: when their cores run out, images stop queueing for the device.

A window where the device held images back for more than `BOUND_HIGH` of it, with decoding to move, says the share
is too low (at share 0, for `BOUND_LOW` of it already: the host decodes nothing there, so the two cannot have run
out together); one where it held them back for less than `BOUND_LOW` says it is too high (the host is the bound, or the
traffic is light and the GPU has room to decode); in between, the two ran out together: a share read so
`KEEP_AFTER` windows in a row is kept. The search brackets the best share between the highest share found too low
and the lowest found too high, stepping out (doubling) until it has both and halving the bracket after, and keeps
the bracket's low end once it is narrower than `STEP_MIN`: below the best share each step costs the device a
little, above it each step costs the host's cores, at their far higher price per image, much more. The window after
a move is not read (the queues of the share before it are still draining).

What the search wants is the share that serves the most, and the images each window served say it where the two
readings above blur: where the host's cores are short, its threads are late to hand the device its work, so the
device can read as holding images back on both sides of the best share. So each search also records the images a
second served at every share it read, and a share that served `SERVED_MARGIN` less than the one of the same search
that served the most is on the wrong side of that one, whatever the device read: too high when it lies above it,
too low below (the served rate rises to the best share and falls after it). A share kept is the one of the search's that
served the most, where it served `SERVED_MARGIN` more than the one the readings would keep; within the margin, the
readings decide (a second's images move by a few percent from one second to the next). Rates are compared only
within one search, under the traffic it ran in; a search that starts from a kept share starts with that share's
last `KEPT_WINDOWS` windows. Kept, the share is watched:
`LEAVE_AFTER` windows in a row too high search down from it (a faster forward, lighter traffic); every `PROBE_S` the
shares above it are tried, `STEP_MIN` at a time, since a share too low looks the same as the best one from where it
stands. A fixed number overrides all of this.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal

from app.core.batching.batcher import BatchObserver
from app.telemetry.statistics import BatchTiming

log = logging.getLogger("app")

WINDOW_S = 1.0  # seconds of batches each decision reads
MIN_BATCHES = 4  # fewer batches in a window: too little traffic to read anything from
BOUND_HIGH = 0.6  # the device held images back for more of a window than this: the share is too low
BOUND_LOW = 0.3  # ... for less than this: too high
DECODING_MIN = 0.05  # the batches' decoding, as a share of the device's time, below which none is worth moving
STEP_START = 0.1  # the first step out from where it stands
STEP_MIN = 0.05  # a bracket this narrow is found: its low end is kept
PROBE_S = 30.0  # how often the shares above a kept one are tried, STEP_MIN at a time
LEAVE_AFTER = 2  # windows in a row that read a kept share too high before it is left (one may be noise)
KEEP_AFTER = 2  # windows in a row where the two ran out together before a share is kept (one may be noise)
KEPT_WINDOWS = 3  # a kept share's last windows, what a search from it compares with
SERVED_MARGIN = 0.05  # a share that served this much less than another read in the same search is on the wrong side

ShareSetting = float | Literal["auto"]


class DecodeShare:
    """The share of a model's plain JPEGs decoded on the host's cores, fixed or (`auto`) moved by what its
    batches measure. A batcher's observer (passing each batch on to `inner`); `followers` are told each new share
    (the engine's own `ImagePreparer`), the gauge shows it, and a log line says why it moved."""

    def __init__(
        self,
        model: str,
        setting: ShareSetting,
        start: float,
        inner: BatchObserver,
        gauge: Any,
        device_bound_s: Callable[[], float],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.model = model
        self.auto = setting == "auto"
        self.share = start if setting == "auto" else float(setting)
        self.inner = inner
        self.gauge = gauge
        self.device_bound_s = device_bound_s
        self.clock = clock
        self.followers: list[Callable[[float], None]] = []
        self.low: float | None = None  # the highest share seen too low (the device the bound)
        self.high: float | None = None  # the lowest seen too high (the host the bound)
        self.step = STEP_START
        self.kept_since: float | None = None  # when the share in force was found, while it is kept
        self.kept_too_high = 0  # windows in a row that read the kept share too high
        self.balanced = 0  # windows in a row where the device and the host ran out together
        self.probing = False  # stepping up from a kept share, a small step at a time
        self.settling = False  # the window after a move: not read
        self.gauge.set(self.share)
        self.window_start = clock()
        self.window_bound = 0.0  # the batcher's count, which starts at 0 with it
        self.batches = 0
        self.images = 0
        self.served: dict[float, list[float]] = {}  # this search's windows: share -> images a second, each window
        self.decoding_s = 0.0
        self.device_s = 0.0

    def follow(self, follower: Callable[[float], None]) -> None:
        """`follower` told the share now and at every move."""
        self.followers.append(follower)
        follower(self.share)

    # BatchObserver
    def batch_done(self, size: int, seconds: float, outputs: Sequence[object]) -> None:
        self.inner.batch_done(size, seconds, outputs)
        if not self.auto:
            return
        timing = getattr(outputs[0], "batch", None) if outputs else None
        self.batches += 1
        self.images += size
        if isinstance(timing, BatchTiming):
            self.decoding_s += timing.input_s
            self.device_s += timing.input_s + timing.infer_s
        now = self.clock()
        if now - self.window_start >= WINDOW_S:
            self.decide(now)

    def dropped(self, reason: str, count: int) -> None:
        self.inner.dropped(reason, count)

    def queue_depth(self, depth: int) -> None:
        self.inner.queue_depth(depth)

    def decide(self, now: float) -> None:
        """The window that ends now read, the share moved (or not), and the next window begun."""
        bound_s = self.device_bound_s()
        seconds = now - self.window_start
        bound = (bound_s - self.window_bound) / seconds
        rate = self.images / seconds
        decoding = self.decoding_s / self.device_s if self.device_s > 0 else 0.0
        enough, settling = self.batches >= MIN_BATCHES, self.settling
        self.window_start, self.window_bound = now, bound_s
        self.batches, self.images, self.decoding_s, self.device_s = 0, 0, 0.0, 0.0
        self.settling = False
        if not enough or settling:
            return
        if self.kept_since is not None:  # kept: its last windows, the start of any search from here
            self.served = {self.share: [*self.served.get(self.share, [])[1 - KEPT_WINDOWS :], rate]}
        else:
            self.served.setdefault(self.share, []).append(rate)
        if not bound < BOUND_LOW:
            self.kept_too_high = 0
        # at 0 the host decodes none of them: a device that held images back a share of the window it cannot be
        # said to share with the host is the bound, and only moving decoding relieves it
        held_back = bound > BOUND_HIGH or (self.share == 0.0 and bound >= BOUND_LOW)
        too_low = held_back and decoding >= DECODING_MIN and self.share < 1.0
        too_high = bound < BOUND_LOW and self.share > 0.0
        why = f"the device held images back {bound:.0%} of a second" + (
            f", {decoding:.0%} of its time decoding" if too_low else ""
        )
        beaten = self.beaten_by() if self.kept_since is None else None
        if beaten is not None:  # served less than another share of this search: on its wrong side
            other, other_rate = beaten
            too_low, too_high = other > self.share, other < self.share
            why = f"{self.rate():,.0f} images a second served, against {other_rate:,.0f} at {other:.2f}"
        self.balanced = 0 if too_low or too_high else self.balanced + 1
        if too_low:
            self.too_low(now, why)
        elif too_high:
            self.too_high(why)
        elif self.kept_since is None and self.balanced >= KEEP_AFTER:  # the two ran out together here
            self.keep(now, self.share, why)

    def rate(self, share: float | None = None) -> float:
        """The images a second this search read at `share` (the one in force), the mean of its windows."""
        windows = self.served[self.share if share is None else share]
        return sum(windows) / len(windows)

    def best_served(self) -> tuple[float, float]:
        """The share of this search that served the most, and its rate."""
        best = max(self.served, key=self.rate)
        return best, self.rate(best)

    def beaten_by(self) -> tuple[float, float] | None:
        """The share of this search that served the most, where the share in force served `SERVED_MARGIN` less."""
        best, best_rate = self.best_served()
        return (best, best_rate) if self.rate() < (1 - SERVED_MARGIN) * best_rate else None

    def too_low(self, now: float, why: str) -> None:
        s = self.share
        self.low = s
        if self.high is not None and self.high <= s:
            self.high = None  # the best share has moved up since
        if self.kept_since is not None:  # kept here: a device held back is what it expects of the best share
            if now - self.kept_since < PROBE_S:
                return
            self.high, self.step, self.probing = None, STEP_MIN, True  # the probe: small steps up
        self.next_share(now, why)

    def too_high(self, why: str) -> None:
        s = self.share
        if self.kept_since is not None:  # kept: left once it reads too high twice, a step at a time at first
            self.kept_too_high += 1
            if self.kept_too_high < LEAVE_AFTER:
                return
            self.step = STEP_MIN
        self.high = s
        if self.low is not None and self.low >= s:
            self.low = None  # the best share has moved down since
        self.kept_since = None
        self.next_share(None, why)

    def next_share(self, now: float | None, why: str) -> None:
        """Halve the bracket when there is one; else step out from the share in force, doubling each time."""
        if self.low is not None and self.high is not None:
            if self.high - self.low <= STEP_MIN + 1e-9:
                self.keep(now, self.low, why)
                return
            target = (self.low + self.high) / 2
        else:  # out from here, doubling each step; a probe from a kept share in small steps (it is near the best)
            target = self.share + (self.step if self.low is not None else -self.step)
            self.step = self.step if self.probing else min(1.0, self.step * 2)
        self.kept_since = None
        self.move(round(min(1.0, max(0.0, target)), 3), why)

    def keep(self, now: float | None, share: float, why: str) -> None:
        """`share` found, or the search's share that served `SERVED_MARGIN` more than it: kept from now on
        (watched, and probed a step up every PROBE_S)."""
        if share in self.served:
            best, best_rate = self.best_served()
            if self.rate(share) < (1 - SERVED_MARGIN) * best_rate:
                share, why = best, f"{best_rate:,.0f} images a second served there, against {self.rate(share):,.0f}"
        self.kept_since = now if now is not None else self.clock()
        self.kept_too_high = 0
        self.step, self.probing = STEP_START, False
        if share != self.share:
            self.move(share, why)

    def move(self, share: float, why: str) -> None:
        before, self.share = self.share, share
        self.settling = True
        self.gauge.set(share)
        for follower in self.followers:
            follower(share)
        if self.kept_since is not None:
            where = "kept"
        elif self.low is not None and self.high is not None:
            where = f"the best between {self.low:.2f} and {self.high:.2f}"
        else:
            where = "the best above" if self.low is not None else "the best below"
        log.info(
            "model %s: JPEGs decoded on the host's cores %.2f -> %.2f of them (%s): %s",
            self.model,
            before,
            share,
            where,
            why,
        )
