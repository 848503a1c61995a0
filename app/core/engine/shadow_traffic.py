"""Shadow traffic (VIT_SHADOW): the images a champion answered, handed to its challenger in the champion's idle
time and compared (`app.core.engine.shadow` keeps each pair's sample, queue and comparison)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from concurrent.futures import Executor
from typing import Protocol

import torch

from app.core.contract.description import ShadowReport
from app.core.contract.errors import ModelNotFound
from app.core.contract.request import DecodedImage, EncodedImage, Prediction, owned, pick
from app.core.engine.served_model import ServedModel, Wanted
from app.core.engine.shadow import Shadow, ShadowPair
from app.settings import Settings
from app.telemetry.metrics import Metrics

log = logging.getLogger("app")


class Serving(Protocol):
    """What shadow traffic reads of the engine: the models serving, whether it takes requests, its CPU pool."""

    @property
    def served(self) -> dict[str, ServedModel]: ...

    @property
    def taking_requests(self) -> bool: ...

    @property
    def cpu_pool(self) -> Executor: ...


class ShadowTraffic:
    """The engine's shadow pairs, by champion, and the tasks that feed each challenger."""

    def __init__(self, engine: Serving, settings: Settings, metrics: Metrics) -> None:
        self.engine = engine
        self.settings = settings
        self.shadows = {c: Shadow(ShadowPair(c, d, f), metrics) for c, d, f in settings.shadow_pairs()}
        self.pumps: dict[str, asyncio.Task[None]] = {}  # by champion: the task feeding its challenger

    def sampling(self, champion: str) -> Shadow | None:
        """The champion's shadow, where it samples any of its images."""
        shadow = self.shadows.get(champion)
        return shadow if shadow is not None and shadow.pair.fraction > 0 else None

    def offer(
        self,
        shadow: Shadow,
        champion: ServedModel,
        inputs: Sequence[EncodedImage | DecodedImage] | torch.Tensor,
        predictions: list[Prediction],
        champion_s: float,
    ) -> None:
        """Queue the picked images of a request the champion has answered for its challenger; shed them when
        a batch of them is already waiting, the challenger is gone, or its input does not fit."""
        picked = shadow.sample(len(predictions))
        if not picked:
            return
        challenger = self.engine.served.get(shadow.pair.challenger)
        full = shadow.waiting + len(picked) > self.settings.max_batch_size
        if challenger is None or challenger.retired or full or not self.engine.taking_requests:
            shadow.shed(len(picked))
            return
        if isinstance(inputs, torch.Tensor) and tuple(inputs.shape[1:]) != challenger.input_shape:
            shadow.shed(len(picked))  # pixels preprocessed for the champion do not fit the challenger
            return
        mine = torch.stack([predictions[i].probabilities for i in picked])
        picked_inputs = pick(inputs, picked)  # computed after this request is answered: owned copies
        if not isinstance(picked_inputs, torch.Tensor):
            picked_inputs = [owned(i) for i in picked_inputs]
        shadow.put(picked_inputs, mine, champion_s)
        if shadow.pair.champion not in self.pumps:
            task = asyncio.create_task(self.pump(shadow), name=f"shadow-{shadow.pair.champion}")
            self.pumps[shadow.pair.champion] = task

    async def pump(self, shadow: Shadow) -> None:
        """Hand the waiting shadow images to the challenger, a request's at a time, each only once the champion
        has nothing queued, arriving or computing: shadow work runs in the champion's idle time."""
        while True:
            inputs, mine, champion_s = await shadow.take()
            while (champion := self.engine.served.get(shadow.pair.champion)) is not None:
                try:  # a second at a time: a champion replaced meanwhile is waited for in its new version
                    await asyncio.wait_for(champion.batcher.wait_idle(), 1.0)
                    break
                except TimeoutError:
                    continue
            challenger = self.engine.served.get(shadow.pair.challenger)
            if challenger is None or challenger.retired or not self.engine.taking_requests:
                shadow.shed(len(inputs))
                continue
            await self.run(shadow, challenger, inputs, mine, champion_s)

    async def run(
        self,
        shadow: Shadow,
        challenger: ServedModel,
        inputs: Sequence[EncodedImage | DecodedImage] | torch.Tensor,
        champion: torch.Tensor,
        champion_s: float,
    ) -> None:
        """The challenger's answers for one request's picked images, compared with the champion's."""
        n = len(inputs)
        # the images the challenger computes count in its drift window too (its batches feed it): its drift over
        # the champion's traffic
        watched = challenger.checkpoint.reference is not None and self.settings.drift_window > 0
        plain = Wanted("none", None, watched)
        deadline = time.monotonic() + self.settings.request_timeout_s
        try:
            started = time.monotonic()
            if isinstance(inputs, torch.Tensor):
                outputs = await challenger.run_pixels(inputs, plain, deadline)
            else:
                _, outputs, started = await challenger.run_images(inputs, plain, False, self.engine.cpu_pool, deadline)
            theirs = torch.stack([o.probabilities for o in outputs])
            shadow.record(champion, theirs, champion_s, time.monotonic() - started)
        except asyncio.CancelledError:
            shadow.shed(n)
            raise
        except Exception as e:  # never the champion's failure: counted, logged, and the shadow goes on
            shadow.shed(n)
            log.debug("shadow %s -> %s: %d images shed: %s", shadow.pair.champion, shadow.pair.challenger, n, e)

    def report(self, champion: str) -> ShadowReport:
        shadow = self.shadows.get(champion)
        if shadow is None and champion not in self.engine.served:
            raise ModelNotFound(f"no model named {champion!r}; this service serves: {', '.join(self.engine.served)}")
        if shadow is None:
            pairs = ", ".join(f"{c}:{s.pair.challenger}" for c, s in self.shadows.items()) or "none (VIT_SHADOW)"
            raise ModelNotFound(f"model {champion!r} has no shadow challenger; the pairs are: {pairs}")
        return shadow.report()

    def stop(self) -> None:
        """Shadow work is never waited for: the champions' answers are what the drain owes."""
        for task in self.pumps.values():
            task.cancel()
        for shadow in self.shadows.values():
            shadow.shed(shadow.waiting)
