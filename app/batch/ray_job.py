"""The same batch job past one machine, as a Ray Data pipeline (`python -m app.batch ... --ray`).

    read (paths, or any filesystem URI Ray and pyarrow accept)
      -> decode + preprocess in Ray tasks (the core's decode_image and Preprocessor; Ray Data may fuse
         them into the actors' processes when their resources match, as on a machine without GPUs)
      -> classify in a pool of actors, each loading the checkpoint once (the core's Predictor, any backend;
         one GPU per actor when the cluster has GPUs)
      -> Parquet or JSON Lines shards in a directory

Rows are the single-process runner's rows, errors included. Ray is an optional extra (`.[ray]`).
"""

from __future__ import annotations

import logging
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from app.batch.inputs import expand_inputs
from app.batch.outputs import arrow_schema
from app.batch.runner import RowOptions, error_row, prediction_row
from app.core.decode import decode_image
from app.core.errors import ServiceError
from app.core.inference import ImageInput
from app.core.preprocess import Preprocessor
from app.core.request import InferOptions
from app.core.served_model import ServedModel, class_index
from app.core.service import prediction
from model.checkpoint import load_checkpoint
from model.device import resolve_device
from model.preprocessing import Preprocessing

log = logging.getLogger("app.batch")


def decode_batch(batch: dict[str, np.ndarray], preprocessing: dict[str, Any], max_pixels: int) -> dict[str, Any]:
    """Files (their path, and their bytes where Ray read them) -> preprocessed pixels, or the error for each."""
    p = Preprocessing.from_dict(preprocessing)
    pre = Preprocessor(p)
    pixels, errors = [], []
    for i, path in enumerate(batch["path"]):
        error, x = "", np.zeros((p.channels, p.image_size, p.image_size), np.float32)
        try:
            data = bytes(batch["bytes"][i]) if "bytes" in batch else Path(path).read_bytes()
            x = pre(decode_image(data, str(path), p.channels, max_pixels)).numpy()
        except OSError as e:
            error = f"{path}: cannot read the file ({e.strerror or e})"
        except ServiceError as e:
            error = e.detail
        pixels.append(x)
        errors.append(error)
    # "" for no error: a column of None would not survive Ray's conversions as strings
    return {"path": batch["path"], "pixels": np.stack(pixels), "error": np.array(errors, dtype=object)}


class Classify:
    """A Ray actor: the checkpoint loaded once, then batches of pixels -> rows (an Arrow table)."""

    def __init__(self, checkpoint: str, device: str, backend: str, threads: int, infer: InferOptions,
                 options: RowOptions) -> None:  # fmt: skip
        if threads:
            torch.set_num_threads(threads)
        resolved = resolve_device(device)
        ckpt = load_checkpoint(checkpoint, resolved)
        self.predictor = ServedModel.build_predictor(Path(checkpoint).stem, ckpt, resolved, backend)  # type: ignore[arg-type]
        self.classes = ckpt.classes
        self.infer, self.options = infer, options
        self.target = class_index(Path(checkpoint).stem, self.classes, infer.target)
        self.schema = arrow_schema(options.columns())

    def __call__(self, batch: dict[str, np.ndarray]) -> Any:
        import pyarrow as pa

        ok = [i for i, e in enumerate(batch["error"]) if not e]
        i = self.infer
        inputs = [ImageInput(torch.from_numpy(batch["pixels"][j]), i.attention, self.target, i.embedding) for j in ok]
        outputs = dict(zip(ok, self.predictor(inputs), strict=True)) if ok else {}
        rows = []
        for j, path in enumerate(batch["path"]):
            if j in outputs:
                predicted = prediction(str(path), outputs[j], None, i.normalize)
                rows.append(prediction_row(str(path), predicted, self.classes, self.options))
            else:
                rows.append(error_row(str(path), str(batch["error"][j])))
        columns = self.options.columns()
        return pa.Table.from_pylist([{c: r.get(c) for c in columns} for r in rows], schema=self.schema)


def run_on_ray(
    inputs: list[str], output: str, checkpoint: Path, infer: InferOptions, options: RowOptions, *,
    address: str | None, actors: int, batch_size: int, device: str, backend: str, threads: int, max_pixels: int,
) -> tuple[int, int]:  # fmt: skip
    """Run the job on a Ray cluster (`address`) or a local one; returns (rows, failed rows)."""
    try:
        import pyarrow as pa
        import pyarrow.json as pa_json
        import ray
    except ImportError:
        raise ValueError("--ray needs Ray Data: pip install 'vit-serve[ray]'") from None

    ckpt = load_checkpoint(checkpoint)  # the driver checks the checkpoint and target before any task starts
    class_index(checkpoint.stem, ckpt.classes, infer.target)
    preprocessing = asdict(ckpt.preprocessing)
    ray.init(address=address, ignore_reinit_error=True, log_to_driver=False)
    gpus = 1 if ray.cluster_resources().get("GPU", 0) >= 1 and device != "cpu" else 0
    if any("://" in item for item in inputs):  # a bucket or other filesystem: Ray lists and reads it
        ds = ray.data.read_binary_files(inputs, include_paths=True)
    else:
        ds = ray.data.from_items([{"path": p} for p in expand_inputs(inputs)])
    decode_kwargs = {"preprocessing": preprocessing, "max_pixels": max_pixels}
    ds = ds.map_batches(decode_batch, fn_kwargs=decode_kwargs, batch_size=batch_size, batch_format="numpy")  # type: ignore[arg-type]
    ds = ds.map_batches(
        Classify, fn_constructor_args=(str(checkpoint), device, backend, threads, infer, options),
        batch_size=batch_size, batch_format="numpy", concurrency=actors, num_gpus=gpus,
    )  # fmt: skip
    if Path(output).suffix.lower() in (".jsonl", ".json"):
        ds.write_json(output)  # streamed: rows are written as actors produce them, never all held at once
        only_errors = pa_json.ParseOptions(explicit_schema=pa.schema([("error", pa.string())]),
                                           unexpected_field_behavior="ignore")  # fmt: skip
        written = ray.data.read_json(output, parse_options=only_errors)
    else:
        ds.write_parquet(output)
        written = ray.data.read_parquet(output, columns=["error"])
    tables: list[pa.Table] = list(written.iter_batches(batch_format="pyarrow"))
    return sum(len(t) for t in tables), sum(len(t) - t.column("error").null_count for t in tables)
