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
        self.now = 0.0
        self.bound_s = 0.0
        self.seconds = 0  # whole seconds run so far: the clock is counted from them, exactly

    def bound(self, share: float) -> float:
        if share < self.best - self.band:
            return 0.9
        if share > self.best + self.band:
            return 0.1
        return 0.45

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
                timing = BatchTiming(64, self.now, decoding * dt, (1 - decoding) * dt, 0.0)
                share.batch_done(64, dt, [ImageOutput(None, None, None, timing)])  # type: ignore[arg-type]
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
