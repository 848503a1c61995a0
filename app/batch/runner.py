"""Classify many files through the serving core: the same decoding, batches, backends and outputs as the service.

Each file is its own request to the data plane's `infer`, so one bad file fails only its own row,
with the message the service would answer. A window of files is in flight at once: their decoding
runs on the core's CPU pool while the batcher fills batches of `--batch-size` for the forward
thread, and rows are written in input order as the window advances.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from app.batch.outputs import Row
from app.core.contract.description import ModelDescription
from app.core.contract.errors import ServiceError
from app.core.contract.inference import Inference, InferenceRequest
from app.core.contract.request import EncodedImage, InferOptions, Prediction
from app.core.data_plane import DataPlane


@dataclass(frozen=True)
class RowOptions:
    """What each row holds beyond the path, the top-k and the error."""

    top_k: int = 5
    probabilities: bool = False  # every class's probability
    embedding: bool = False
    attention: bool = False

    def columns(self) -> list[str]:
        wanted = {"probabilities": self.probabilities, "embedding": self.embedding, "attention": self.attention}
        optional = [name for name, on in wanted.items() if on]
        return ["path", "label", "probability", "top_k_labels", "top_k_probabilities", *optional, "error"]


@dataclass
class Counts:
    images: int = 0
    failed: int = 0
    seconds: float = 0.0

    @property
    def images_per_s(self) -> float:
        return self.images / self.seconds if self.seconds else 0.0


def prediction_row(path: str, p: Prediction, classes: list[str], options: RowOptions) -> Row:
    values, indices = torch.topk(p.probabilities, min(options.top_k, len(classes)))
    labels = [classes[i] for i in indices.tolist()]
    row: Row = {
        "path": path,
        "label": labels[0],
        "probability": float(values[0]),
        "top_k_labels": labels,
        "top_k_probabilities": values.tolist(),
        "error": None,
    }
    if options.probabilities:
        row["probabilities"] = p.probabilities.tolist()
    if options.embedding and p.embedding is not None:
        row["embedding"] = p.embedding.tolist()
    if options.attention and p.attention_map is not None:
        row["attention"] = p.attention_map.tolist()
    return row


def error_row(path: str, message: str) -> Row:
    empty = dict.fromkeys(["label", "probability", "top_k_labels", "top_k_probabilities"])
    return {"path": path, **empty, "error": message}


def read_file(path: str) -> bytes:
    return Path(path).read_bytes()


def predictions(done: Inference) -> list[Prediction]:
    return done.predictions


async def classify_file(
    plane: DataPlane, model: ModelDescription, path: str, infer: InferOptions, options: RowOptions
) -> Row:
    """One file's row: its prediction, or the error the service would answer for it."""
    try:
        data = await asyncio.to_thread(read_file, path)
    except OSError as e:
        return error_row(path, f"{path}: cannot read the file ({e.strerror or e})")
    try:
        asked = InferenceRequest(model, [EncodedImage(path, data)], infer)
        [prediction] = await plane.infer(asked, predictions)
    except ServiceError as e:
        return error_row(path, e.detail)
    return prediction_row(path, prediction, model.classes_for(model.answer_labels(infer)), options)


async def classify_files(
    plane: DataPlane,
    model: ModelDescription,
    paths: list[str],
    infer: InferOptions,
    options: RowOptions,
    write: Callable[[list[Row]], None],
    progress: Callable[[int], None],
    window: int,
) -> Counts:
    """Rows for `paths` handed to `write` in input order, a window of files in flight at once."""
    counts, started = Counts(), time.perf_counter()
    todo = iter(paths)
    pending: deque[asyncio.Task[Row]] = deque()

    def refill() -> None:
        while len(pending) < window and (path := next(todo, None)) is not None:
            pending.append(asyncio.create_task(classify_file(plane, model, path, infer, options)))

    refill()
    done: list[Row] = []
    try:
        while pending:
            row = await pending.popleft()
            refill()
            done.append(row)
            counts.images += 1
            counts.failed += row["error"] is not None
            progress(1)
            if len(done) >= window or not pending:  # one synced write per window of rows
                write(done)
                done = []
    finally:
        for task in pending:
            task.cancel()
        counts.seconds = time.perf_counter() - started
    return counts
