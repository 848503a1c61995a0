"""A shadow challenger: a fraction of a champion's images computed by another served model as well, after the
champion has answered, to compare the two on live traffic before the challenger takes it (VIT_SHADOW).

The challenger's answers never reach a client. Shadow work is the first to go under load: images are shadowed
only while the champion's queue holds less than a batch and at most a batch of shadow images is in flight;
the rest are counted as shed. Per pair, on the same images: top-1 agreement, the mean total variation distance
between the two probability vectors, each model's median time from submission to answer, and the shed count.
"""

from __future__ import annotations

import asyncio
import statistics
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

from app.core.contract.description import ShadowReport
from app.telemetry.metrics import Metrics

LATENCY_WINDOW = 1000  # requests whose times the medians are taken over


@dataclass(frozen=True)
class ShadowPair:
    champion: str
    challenger: str
    fraction: float  # of the champion's images, in [0, 1]


class Shadow:
    """One pair's sampling, admission and running comparison."""

    def __init__(self, pair: ShadowPair, metrics: Metrics) -> None:
        self.pair = pair
        self.carry = 0.0  # of the fraction: an image is picked each time it reaches 1
        self.queue: deque[tuple[Any, torch.Tensor, float]] = deque()  # (inputs, champion's probabilities, its time)
        self.waiting = 0  # images in the queue
        self.arrived = asyncio.Event()
        self.compared = self.agreed = self.shed_count = 0
        self.tv_sum = 0.0
        self.champion_s: deque[float] = deque(maxlen=LATENCY_WINDOW)
        self.challenger_s: deque[float] = deque(maxlen=LATENCY_WINDOW)
        labels = (pair.champion, pair.challenger)
        self.compared_total = metrics.shadow_compared.labels(*labels)
        self.agreed_total = metrics.shadow_agreed.labels(*labels)
        self.tv_total = metrics.shadow_tv_distance.labels(*labels)
        self.shed_total = metrics.shadow_shed.labels(*labels)

    def sample(self, n: int) -> list[int]:
        """Which of a request's n images to shadow: the fraction of them, spread evenly over the traffic."""
        picked = []
        for i in range(n):
            self.carry += self.pair.fraction
            if self.carry >= 1.0:
                self.carry -= 1.0
                picked.append(i)
        return picked

    def put(self, inputs: Any, champion: torch.Tensor, champion_s: float) -> None:
        """One request's picked images (files or pixels), the champion's probabilities for them and its time."""
        self.queue.append((inputs, champion, champion_s))
        self.waiting += len(champion)
        self.arrived.set()

    async def take(self) -> tuple[Any, torch.Tensor, float]:
        while not self.queue:
            self.arrived.clear()
            await self.arrived.wait()
        item = self.queue.popleft()
        self.waiting -= len(item[1])
        return item

    def shed(self, n: int) -> None:
        self.shed_count += n
        self.shed_total.inc(n)

    def record(self, champion: torch.Tensor, challenger: torch.Tensor, champion_s: float, challenger_s: float) -> None:
        """Probabilities of the same k images (k, classes) from both models, and each request's time."""
        agreed = int((champion.argmax(1) == challenger.argmax(1)).sum())
        tv = float(0.5 * (champion.float() - challenger.float()).abs().sum())
        k = champion.shape[0]
        self.compared += k
        self.agreed += agreed
        self.tv_sum += tv
        self.champion_s.append(champion_s)
        self.challenger_s.append(challenger_s)
        self.compared_total.inc(k)
        self.agreed_total.inc(agreed)
        self.tv_total.inc(tv)

    def report(self) -> ShadowReport:
        def median_ms(times: deque[float]) -> float | None:
            return 1000 * statistics.median(times) if times else None

        return ShadowReport(
            self.pair.champion,
            self.pair.challenger,
            self.pair.fraction,
            self.compared,
            self.agreed / self.compared if self.compared else None,
            self.tv_sum / self.compared if self.compared else None,
            self.shed_count,
            median_ms(self.champion_s),
            median_ms(self.challenger_s),
        )
