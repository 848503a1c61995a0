"""The same batch job past one machine, as a Ray Data pipeline (`python -m app.batch ... --ray`).

    read (paths, or any filesystem URI Ray and pyarrow accept)
      -> decode + preprocess in Ray tasks (the core's decode_image and Preprocessor; Ray Data may fuse
         them into the actors' processes when their resources match, as on a machine without GPUs)
      -> classify in a pool of actors, each running the service's own engine (`Engine`, built from the
         same settings as the service: any backend, the ONNX graph cache, int8, the device; one GPU per
         actor when the cluster has GPUs) and asking its data plane for each batch's predictions
      -> Parquet or JSON Lines shards in a directory

Rows are the single-process runner's rows, errors included. Ray is an optional extra (`.[ray]`).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Coroutine
from dataclasses import asdict
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch

from app.batch.inputs import expand_inputs
from app.batch.outputs import arrow_schema
from app.batch.runner import RowOptions, error_row, prediction_row, predictions
from app.core.contract.description import class_index
from app.core.contract.errors import ServiceError
from app.core.contract.inference import InferenceRequest
from app.core.contract.request import InferOptions
from app.core.engine.engine import Engine
from app.core.images.decode import decode_image
from app.core.images.prepare import Preprocessor
from app.settings import Settings
from model.checkpoint import load_checkpoint
from model.preprocessing import Preprocessing

log = logging.getLogger("app.batch")
T = TypeVar("T")


def decode_batch(
    batch: dict[str, np.ndarray], preprocessing: dict[str, Any], max_pixels: int, jpeg_draft: bool
) -> dict[str, Any]:
    """Files (their path, and their bytes where Ray read them) -> preprocessed pixels, or the error for each."""
    p = Preprocessing.from_dict(preprocessing)
    pre = Preprocessor(p)
    draft_to = p.resize_size if jpeg_draft else None  # as the service decodes on the CPU
    pixels, errors = [], []
    for i, path in enumerate(batch["path"]):
        error, x = "", np.zeros((p.channels, p.image_size, p.image_size), np.float32)
        try:
            data = bytes(batch["bytes"][i]) if "bytes" in batch else Path(path).read_bytes()
            x = pre(decode_image(data, str(path), p.channels, max_pixels, draft_to)).numpy()
        except OSError as e:
            error = f"{path}: cannot read the file ({e.strerror or e})"
        except ServiceError as e:
            error = e.detail
        pixels.append(x)
        errors.append(error)
    # "" for no error: a column of None would not survive Ray's conversions as strings
    return {"path": batch["path"], "pixels": np.stack(pixels), "error": np.array(errors, dtype=object)}


class Classify:
    """A Ray actor: the service's engine, loaded once on an event loop of its own, then batches of pixels -> rows."""

    def __init__(self, settings: Settings, infer: InferOptions, options: RowOptions) -> None:
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name="engine", daemon=True).start()
        self.engine = self.call(start_engine(settings))
        self.model = self.engine.describe(None)
        self.model.check_labels(infer.labels, infer.template, head=infer.head)
        self.classes = self.model.classes_for(self.model.answer_labels(infer))
        self.model.class_index(infer.target, self.classes)
        self.infer, self.options = infer, options
        self.schema = arrow_schema(options.columns())

    def call(self, coroutine: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result()

    def __call__(self, batch: dict[str, np.ndarray]) -> Any:
        import pyarrow as pa

        ok = [i for i, e in enumerate(batch["error"]) if not e]
        outputs = {}
        if ok:
            asked = InferenceRequest(self.model, torch.from_numpy(batch["pixels"][ok]), self.infer)
            outputs = dict(zip(ok, self.call(self.engine.infer(asked, predictions)), strict=True))
        rows = []
        for j, path in enumerate(batch["path"]):
            if j in outputs:
                rows.append(prediction_row(str(path), outputs[j], self.classes, self.options))
            else:
                rows.append(error_row(str(path), str(batch["error"][j])))
        columns = self.options.columns()
        return pa.Table.from_pylist([{c: r.get(c) for c in columns} for r in rows], schema=self.schema)


async def start_engine(settings: Settings) -> Engine:
    engine = await asyncio.to_thread(Engine.load, settings)
    engine.start(freeze_heap=True)  # an actor's process is its own
    return engine


def run_on_ray(
    inputs: list[str],
    output: str,
    settings: Settings,
    infer: InferOptions,
    options: RowOptions,
    *,
    address: str | None,
    actors: int,
) -> tuple[int, int]:
    """Run the job on a Ray cluster (`address`) or a local one; returns (rows, failed rows)."""
    try:
        import pyarrow as pa
        import pyarrow.json as pa_json
        import ray
    except ImportError:
        raise ValueError("--ray needs Ray Data: pip install 'vit-serve[ray]'") from None

    # The driver checks the checkpoint and target before any task starts.
    ckpt = load_checkpoint(settings.weights)
    if ckpt.zero_shot is None and (infer.labels is not None or infer.template is not None):
        raise ValueError(
            f"{settings.weights}: --labels and --template name a zero-shot model's classes; it is a classifier"
        )
    if ckpt.zero_shot is not None and infer.labels is None and not ckpt.classes:
        raise ValueError(f"{settings.weights}: a zero-shot model without default labels: pass --labels")
    class_index(settings.weights.stem, ckpt.classes if infer.labels is None else list(infer.labels), infer.target)
    preprocessing = asdict(ckpt.preprocessing)
    ray.init(address=address, ignore_reinit_error=True, log_to_driver=False)
    gpus = 1 if ray.cluster_resources().get("GPU", 0) >= 1 and settings.device != "cpu" else 0
    if any("://" in item for item in inputs):  # a bucket or other filesystem: Ray lists and reads it
        ds = ray.data.read_binary_files(inputs, include_paths=True)
    else:
        ds = ray.data.from_items([{"path": p} for p in expand_inputs(inputs)])
    batch_size = settings.max_batch_size
    decode_kwargs = {
        "preprocessing": preprocessing,
        "max_pixels": settings.max_image_pixels,
        "jpeg_draft": settings.jpeg_draft,
    }
    ds = ds.map_batches(decode_batch, fn_kwargs=decode_kwargs, batch_size=batch_size, batch_format="numpy")
    ds = ds.map_batches(
        Classify,
        fn_constructor_args=(settings, infer, options),
        batch_size=batch_size,
        batch_format="numpy",
        concurrency=actors,
        num_gpus=gpus,
    )
    if Path(output).suffix.lower() in (".jsonl", ".json"):
        ds.write_json(output)  # streamed: rows are written as actors produce them, never all held at once
        only_errors = pa_json.ParseOptions(
            explicit_schema=pa.schema([("error", pa.string())]), unexpected_field_behavior="ignore"
        )
        written = ray.data.read_json(output, parse_options=only_errors)
    else:
        ds.write_parquet(output)
        written = ray.data.read_parquet(output).select_columns(["error"])
    tables: list[pa.Table] = list(written.iter_batches(batch_format="pyarrow"))
    return sum(len(t) for t in tables), sum(len(t) - t.column("error").null_count for t in tables)
