"""A zero-shot model's label embeddings: each label set in its template, run through the text tower once and kept.

An image's probabilities over the labels a request names are its embedding's scaled cosine similarity with
each label's (`model.zero_shot`). The text pass is the costly part, and clients name the same labels again
and again, so every (template, label) embedding is kept, and each label set's stacked embeddings too, both
bounded by VIT_TEXT_CACHE_LABELS (least recently used evicted). A request whose labels are all known costs a
dictionary lookup; the first with 1,000 new labels costs their text pass, once.
"""

from __future__ import annotations

import asyncio
import threading
from collections import OrderedDict
from collections.abc import Awaitable, Callable

import torch
from prometheus_client import Counter
from torch import Tensor

from model.zero_shot import ZeroShot

PROMPTS_AT_ONCE = 256  # prompts in one pass of the text tower

LabelSet = tuple[str, tuple[str, ...]]  # (template, labels)


class LabelEmbeddings:
    """The text embeddings (L, D), unit length, float32 on the CPU, of labels set in a template."""

    def __init__(self, zero_shot: ZeroShot, max_labels: int, computed: Counter | None = None) -> None:
        self.zero_shot = zero_shot
        self.max_labels = max_labels  # rows kept by each of the two caches
        self.computed = computed  # counts the prompts the text tower embeds
        self.labels: OrderedDict[tuple[str, str], Tensor] = OrderedDict()  # (template, label) -> (D,)
        self.sets: OrderedDict[LabelSet, Tensor] = OrderedDict()  # (template, labels) -> (L, D)
        self.set_rows = 0
        self.lock = asyncio.Lock()  # one text pass at a time: a second request for the same labels finds them kept
        self.guard = threading.Lock()  # the caches, read on the event loop while a pass on the pool fills them

    async def of(self, template: str, labels: tuple[str, ...], run: Callable[..., Awaitable[Tensor]]) -> Tensor:
        """The labels' embeddings (L, D) in order; those not kept computed by `run(function, *args)` (a thread)."""
        if (found := self.kept((template, labels))) is not None:
            return found
        async with self.lock:
            return await run(self.compute, template, labels)

    def kept(self, key: LabelSet) -> Tensor | None:
        with self.guard:
            found = self.sets.get(key)
            if found is not None:
                self.sets.move_to_end(key)
            return found

    def compute(self, template: str, labels: tuple[str, ...]) -> Tensor:
        """The labels' embeddings (L, D): the kept ones looked up, the others run through the text tower now."""
        key = (template, labels)
        if (found := self.kept(key)) is not None:
            return found
        rows: dict[str, Tensor] = {}
        with self.guard:
            for label in labels:
                if (row := self.labels.get((template, label))) is not None:
                    self.labels.move_to_end((template, label))
                    rows[label] = row
        missing = [label for label in labels if label not in rows]
        for start in range(0, len(missing), PROMPTS_AT_ONCE):
            chunk = missing[start : start + PROMPTS_AT_ONCE]
            with torch.inference_mode():
                embedded = self.zero_shot.embed_texts(self.zero_shot.prompts(chunk, template)).float().cpu()
            with self.guard:
                for label, row in zip(chunk, embedded.unbind(), strict=True):
                    rows[label] = row
                    self.keep_label((template, label), row)
        if self.computed is not None and missing:
            self.computed.inc(len(missing))
        stacked = torch.stack([rows[label] for label in labels])
        with self.guard:
            self.keep_set(key, stacked)
        return stacked

    def keep_label(self, key: tuple[str, str], row: Tensor) -> None:
        self.labels[key] = row
        while len(self.labels) > self.max_labels:
            self.labels.popitem(last=False)

    def keep_set(self, key: LabelSet, stacked: Tensor) -> None:
        if len(stacked) > self.max_labels:  # larger than the whole cache: its labels alone are kept
            return
        self.sets[key] = stacked
        self.set_rows += len(stacked)
        while self.set_rows > self.max_labels:
            _, evicted = self.sets.popitem(last=False)
            self.set_rows -= len(evicted)
