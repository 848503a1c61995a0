"""The share of a GPU model's JPEGs decoded on the host: fixed, or moved by what its batches measure (auto).

Here against a device and a host drawn as numbers (how much of a window the device held images back, at each
share); tests/e2e/test_decode_share.py drives it with the service over the device stand-in, the host's decoding
real CPU work."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence

import pytest
from prometheus_client import CollectorRegistry, Gauge

from app.core.backends.predictor import ImageOutput
from app.core.engine import decode_share
from app.core.engine.decode_share import DecodeShare
from app.telemetry.statistics import BatchTiming


class Inner:
    """The observer behind the share (the model's metrics): it must see every batch."""

    def __init__(self) -> None:
        self.batches = 0

    def batch_done(self, size: int, seconds: float, outputs: Sequence[object]) -> None:
        self.batches += 1

    def dropped(self, reason: str, count: int) -> None: ...
    def queue_depth(self, depth: int) -> None: ...


class Plant:
    """A device and a host around a best share `best`: below it the device holds images back most of each window,
    above it the host's cores do (the device waits), within `band` of it both run out together."""

    def __init__(self, best: float, band: float = 0.06) -> None:
        self.best = best
        self.band = band
        self.images = 64  # a batch's images, at every share unless `served` says otherwise
        self.now = 0.0
        self.bound_s = 0.0
        self.seconds = 0  # whole seconds run so far: the clock is counted from them, exactly

    def bound(self, share: float) -> float:
        if share < self.best - self.band:
            return 0.9
        if share > self.best + self.band:
            return 0.1
        return 0.45

    def served(self, share: float) -> float:
        """The images a second served at `share`, as a share of the most: here the same at every share."""
        return 1.0

    def run(self, share: DecodeShare, seconds: float, batches_per_s: int = 20) -> list[float]:
        """`seconds` of batches, the device held back as `bound` says at the share in force; the share after each
        second."""
        shares = []
        dt = 1.0 / batches_per_s
        for _ in range(int(seconds)):
            for k in range(1, batches_per_s + 1):
                self.now = self.seconds + k / batches_per_s
                self.bound_s += dt * self.bound(share.share)
                decoding = 0.4 * (1 - share.share)  # of the device's time: the JPEGs it still decodes
                size = round(self.images * self.served(share.share))
                timing = BatchTiming(size, self.now, decoding * dt, (1 - decoding) * dt, 0.0)
                share.batch_done(size, dt, [ImageOutput(None, None, None, timing)])  # type: ignore[arg-type]
            self.seconds += 1
            shares.append(share.share)
        return shares


def controller(plant: Plant, setting: float | str = "auto", start: float = 0.0) -> tuple[DecodeShare, Gauge]:
    gauge = Gauge("share", "", registry=CollectorRegistry())
    share = DecodeShare("m", setting, start, Inner(), gauge, lambda: plant.bound_s, lambda: plant.now)  # type: ignore[arg-type]
    return share, gauge


@pytest.mark.parametrize("start", [0.0, 1.0])
def test_auto_reaches_the_best_share_from_either_end_and_stays(start: float) -> None:
    plant = Plant(best=0.4)
    share, gauge = controller(plant, start=start)
    shares = plant.run(share, 60)
    settled = next(t for t, s in enumerate(shares) if abs(s - 0.4) <= plant.band)
    assert settled < 12, shares  # seconds: steps of 0.1, doubling while the direction holds
    assert all(abs(s - 0.4) <= plant.band for s in shares[settled:]), shares  # and it holds there
    assert gauge._value.get() == share.share


def test_auto_moves_again_when_the_best_share_moves() -> None:
    """A faster forward leaves the host's cores less time to decode for: the best share falls, and the share
    follows it down."""
    plant = Plant(best=0.6)
    share, _ = controller(plant)
    plant.run(share, 30)
    assert abs(share.share - 0.6) <= plant.band
    plant.best = 0.25
    shares = plant.run(share, 30)
    assert abs(shares[-1] - 0.25) <= plant.band and all(abs(s - 0.25) <= plant.band for s in shares[-10:]), shares


def test_a_fixed_share_never_moves_and_light_traffic_moves_nothing() -> None:
    plant = Plant(best=0.7)
    fixed, gauge = controller(plant, setting=0.3)
    assert not fixed.auto
    assert plant.run(fixed, 20) == [0.3] * 20 and gauge._value.get() == 0.3
    auto, _ = controller(plant, start=0.1)
    assert decode_share.MIN_BATCHES > 2
    assert plant.run(auto, 10, batches_per_s=2) == [0.1] * 10  # too few batches a window to read anything from


def test_followers_are_told_each_move_and_a_log_line_says_why(caplog: pytest.LogCaptureFixture) -> None:
    plant = Plant(best=1.0)
    share, _ = controller(plant)
    told: list[float] = []
    share.follow(told.append)
    assert told == [0.0]  # the share in force at once
    with caplog.at_level(logging.INFO, logger="app"):
        plant.run(share, 5)
    assert told == [0.0, 0.1, 0.3, 0.7]  # stepping out, doubling; the window after each move not read
    moves = [r.getMessage() for r in caplog.records if "decoded on the host" in r.getMessage()]
    assert moves[0] == (
        "model m: JPEGs decoded on the host's cores 0.00 -> 0.10 of them (the best above): the device held images "
        "back 90% of a second, 40% of its time decoding"
    )


def test_every_batch_reaches_the_observer_behind_it() -> None:
    plant = Plant(best=0.5)
    share, _ = controller(plant)
    plant.run(share, 2)
    assert share.inner.batches == 40  # type: ignore[attr-defined]


def test_a_kept_share_is_probed_upward_and_follows_a_best_share_that_rose() -> None:
    """Below the best share the device holds images back as it does at the best one, so a kept share cannot see
    the best move up: it tries the shares above it every PROBE_S, a small step at a time, and follows."""
    plant = Plant(best=0.3)
    share, _ = controller(plant)
    plant.run(share, 20)
    assert abs(share.share - 0.3) <= plant.band
    plant.best = 0.6  # lighter images, say: the host's cores now keep up with more
    shares = plant.run(share, decode_share.PROBE_S + 20)
    assert abs(shares[-1] - 0.6) <= plant.band, shares
    steps = [round(b - a, 3) for a, b in itertools.pairwise(shares) if b > a]
    assert max(steps) <= decode_share.STEP_MIN, shares  # no leap past the best share and back


def test_one_balanced_window_keeps_nothing() -> None:
    """A window where the device and the host seem to run out together, between windows that say the share is too
    low (the first second of traffic, say), does not stop the search: a share is kept when two in a row say so."""
    plant = Plant(best=0.8)
    share, _ = controller(plant)
    # one balanced window first, then too low at every share
    plant.bound = lambda _: 0.45 if plant.now <= 1.0 else 0.9  # type: ignore[method-assign]
    shares = plant.run(share, 8)
    assert shares[-1] >= 0.7, shares


def test_at_zero_a_device_holding_images_back_a_third_of_each_window_moves_the_share_up() -> None:
    """At 0 the host decodes nothing, so a reading between BOUND_LOW and BOUND_HIGH is not the two running out
    together: the device is the bound, and the share leaves 0 (where, elsewhere, such a reading keeps it)."""
    plant = Plant(best=0.3, band=0.3)  # from 0 to 0.6 the device holds images back 45 % of each window
    share, _ = controller(plant, start=0.0)
    shares = plant.run(share, 10)
    assert shares[-1] > 0.0 and len(set(shares[-4:])) == 1, shares  # left 0, then kept where it went


class Blurred(Plant):
    """As on a 2-core host: where the host's cores are short its threads hand the device its work late, so the
    device reads the same (`reading`) from `best` up to `best + blur`, and only the images served tell the shares
    apart. They peak at the best share, falling slowly below it (the device decodes a little more) and fast above
    it (the host's cores, at their far higher price per image)."""

    def __init__(self, best: float, reading: float, blur: float = 0.25) -> None:
        super().__init__(best)
        self.reading = reading
        self.blur = blur
        self.images = 1000  # fine enough that a share's rate shows in whole images

    def bound(self, share: float) -> float:
        if share < self.best - 0.06:
            return 0.9
        return self.reading if share <= self.best + self.blur else 0.1

    def served(self, share: float) -> float:
        return 1 - 0.5 * (self.best - share) if share <= self.best else 1 - 1.5 * (share - self.best)


def test_where_the_device_reads_the_same_on_both_sides_the_share_that_serves_most_is_kept() -> None:
    """From 0 the search steps to 0.1, then 0.3, where the device reads as running out with the host, as it does at
    the best share (0.2): the readings alone would keep 0.3. It served less there than at 0.1, so 0.3 is too
    high, and the search closes in on 0.2."""
    plant = Blurred(best=0.2, reading=0.45)
    share, _ = controller(plant)
    shares = plant.run(share, 30)
    assert shares[-1] == pytest.approx(0.2) and set(shares[-10:]) == {shares[-1]}, shares


def test_a_probe_above_a_kept_share_that_serves_less_goes_back_at_once() -> None:
    """Where the device reads as holding images back above the best share too, each probe from the kept share
    (every PROBE_S) steps up once, serves less, and comes back: the share neither climbs past the best nor
    leaves it for long."""
    plant = Blurred(best=0.2, reading=0.9)
    share, _ = controller(plant)
    plant.run(share, 20)
    assert share.share == pytest.approx(0.2)
    shares = plant.run(share, 2 * decode_share.PROBE_S + 10)
    assert max(shares) <= 0.2 + decode_share.STEP_MIN + 1e-9, shares
    assert sum(s == pytest.approx(0.2) for s in shares) >= 0.9 * len(shares), shares
