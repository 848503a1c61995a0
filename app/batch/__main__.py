"""Offline batch inference: classify files, directories or lists of paths without HTTP, into JSON Lines, CSV or Parquet.

    python -m app.batch photos/ --output labels.jsonl
    python -m app.batch 'data/**/*.jpg' @more.txt --output out.parquet --checkpoint runs/mine.safetensors \\
        --top-k 3 --embedding --normalize --attention rollout --batch-size 64
    python -m app.batch photos/ --output labels.jsonl --resume      # after an interruption
    python -m app.batch s3://bucket/images/ --output s3://bucket/labels/ --ray --ray-address auto --actors 8

One row per image: path, top-1 label and probability, the top-k labels and probabilities, and on
request every probability, the embedding and the attention map; a file that cannot be read or
decoded gets an `error` (the service's own message) and the run goes on. Exit code 0 when every
image was classified, 1 when any failed, 2 for bad arguments.

With --ray the job runs as a Ray Data pipeline, on the cluster at --ray-address or a local Ray:
decoding in Ray tasks, the model in --actors actors (one GPU each when the cluster has GPUs), and
--output is a directory (a local path or a filesystem URI) of Parquet shards, or JSON Lines shards
when its name ends in .jsonl or .json.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from pathlib import Path

from opentelemetry import trace
from tqdm import tqdm

from app.batch.inputs import InputError, expand_inputs
from app.batch.outputs import (
    Journal,
    OutputError,
    Row,
    journal_path,
    output_format,
    read_journal,
    read_output,
    write_output,
)
from app.batch.runner import Counts, RowOptions, classify_files
from app.choices import BACKENDS
from app.core.contract.errors import ServiceError
from app.core.contract.request import ATTENTION_KINDS, InferOptions, parse_labels
from app.core.engine.engine import Engine
from app.settings import BUNDLED_WEIGHTS, Settings
from app.telemetry.tracing import configure_tracing, shutdown_tracing
from model.arguments import at_least
from model.checkpoint import CheckpointError

USAGE_ERROR, SOME_FAILED, INTERRUPTED = 2, 1, 130


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m app.batch",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n\n".join(__doc__.split("\n\n")[1:]),
    )
    p.add_argument("inputs", nargs="+", help="files, directories (recursive), glob patterns, or @FILE listing paths")
    p.add_argument("-o", "--output", type=Path, required=True, help="results file: .jsonl, .csv or .parquet")
    p.add_argument("--checkpoint", type=Path, default=BUNDLED_WEIGHTS, help="default: the bundled checkpoint")
    p.add_argument("--top-k", type=at_least(1), default=5, help="top classes per row (default 5)")
    p.add_argument("--probabilities", action="store_true", help="also every class's probability")
    p.add_argument("--embedding", action="store_true", help="also the embedding the classification head receives")
    p.add_argument("--normalize", action="store_true", help="with --embedding: L2-normalised")
    p.add_argument("--attention", choices=ATTENTION_KINDS, default="none", help="also this attention map")
    p.add_argument("--target", help="with --attention gradient: the class to explain (default: each image's top-1)")
    p.add_argument(
        "--labels", help="a zero-shot model (CLIP, SigLIP): the classes, comma-separated (default: the model's own)"
    )
    p.add_argument("--label", action="append", help="a zero-shot model: one more class, taken whole; repeatable")
    p.add_argument("--template", help="a zero-shot model: the prompt each label is set in, {} where it goes")
    p.add_argument(
        "--head", help="a head taught by example on the model (heads/<model>/HEAD.safetensors beside it): its classes"
    )
    p.add_argument("--batch-size", type=at_least(1), default=32, help="images per forward pass (default 32)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument("--backend", choices=("auto", *BACKENDS), default="auto")
    p.add_argument("--threads", type=at_least(0), default=0, help="torch and ONNX Runtime threads (0: all cores)")
    p.add_argument("--resume", action="store_true", help="continue an interrupted run from what the output holds")
    ray = p.add_argument_group("Ray Data (pip install 'vit-serve[ray]')")
    ray.add_argument("--ray", action="store_true", help="run as a Ray Data job; --output is a directory of shards")
    ray.add_argument(
        "--ray-address", help="the cluster to join (auto: the one this node belongs to); default: a local Ray"
    )
    ray.add_argument(
        "--actors", type=at_least(1), default=1, help="model actors, each loading the checkpoint once (default 1)"
    )
    args = p.parse_args(argv)
    if args.ray and args.resume:
        p.error("--resume continues a single-process run; a Ray job writes its shards anew")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    options = RowOptions(args.top_k, args.probabilities, args.embedding, args.attention != "none")
    if args.ray:
        return run_ray(args, options)
    try:
        output_format(args.output)
        paths = expand_inputs(args.inputs)
        infer = infer_options(args)
        settings = batch_settings(args.checkpoint, args.device, args.backend, args.batch_size, args.threads)
        done = previous_rows(args.output, args.resume)
    except (InputError, OutputError, ServiceError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return USAGE_ERROR
    todo = [p for p in paths if p not in done]
    try:
        counts = asyncio.run(run(settings, todo, infer, options, args.output, list(done.values())))
    except (CheckpointError, ServiceError, ValueError, OSError) as e:  # the model could not be loaded or served
        print(f"error: {e}", file=sys.stderr)
        return USAGE_ERROR
    except KeyboardInterrupt:
        journal = journal_path(args.output)
        print(
            f"interrupted: the rows so far are in {journal}; the same command with --resume continues", file=sys.stderr
        )
        return INTERRUPTED
    rows = {r["path"]: r for r in read_journal(journal_path(args.output))}
    given = set(paths)
    ordered = [rows[p] for p in paths if p in rows] + [r for p, r in rows.items() if p not in given]
    write_output(args.output, ordered, options.columns())
    journal_path(args.output).unlink()
    failed = sum(rows[p]["error"] is not None for p in paths if p in rows)
    speed = f"{counts.seconds:.1f} s ({counts.images_per_s:.1f} images/s)"
    summary = f"{counts.images} images classified in {speed}, {counts.failed} failed; {len(done)} already done"
    summary += f"; {len(ordered)} rows in {args.output}" + (f"; {failed} with an error" if failed else "")
    print(summary, file=sys.stderr)
    return SOME_FAILED if failed else 0


def run_ray(args: argparse.Namespace, options: RowOptions) -> int:
    from app.batch.ray_job import run_on_ray

    try:
        infer = infer_options(args)
        settings = batch_settings(args.checkpoint, args.device, args.backend, args.batch_size, args.threads)
        rows, failed = run_on_ray(
            args.inputs, str(args.output), settings, infer, options, address=args.ray_address, actors=args.actors
        )
    except (InputError, CheckpointError, ServiceError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return USAGE_ERROR
    print(f"{rows} rows in {args.output}" + (f"; {failed} with an error" if failed else ""), file=sys.stderr)
    return SOME_FAILED if failed else 0


def infer_options(args: argparse.Namespace) -> InferOptions:
    """What to compute for every file; InvalidInput (a ServiceError) where the flags do not go together."""
    labels = parse_labels(args.labels, args.label)
    return InferOptions(
        args.attention, args.target, False, args.embedding, args.normalize, False, labels, args.template, head=args.head
    )


def batch_settings(checkpoint: Path, device: str, backend: str, batch_size: int, threads: int) -> Settings:
    """The service's settings for one checkpoint run offline: batches of `batch_size`, no deadline, no gRPC."""
    return Settings(
        weights=checkpoint,
        models=None,
        model_repository=None,
        model_control="none",
        device=device,
        backend=backend,
        max_batch_size=batch_size,
        max_queue=max(256, 8 * batch_size),
        max_files=1,
        request_timeout_s=7 * 24 * 3600,
        threads=threads,
        grpc_port=0,
    )


def previous_rows(output: Path, resume: bool) -> dict[str, Row]:
    """Rows a resumed run keeps (from the finished output and the journal); an error to overwrite without --resume."""
    journal = journal_path(output)
    if not (output.exists() or journal.exists()):
        return {}
    if not resume:
        raise OutputError(f"{output} (or its journal {journal.name}) exists: pass --resume to continue, or remove it")
    rows = {r["path"]: r for r in read_output(output)} if output.exists() else {}
    return rows | {r["path"]: r for r in read_journal(journal)}


async def run(
    settings: Settings, paths: list[str], infer: InferOptions, options: RowOptions, output: Path, kept: list[Row]
) -> Counts:
    """The engine on this event loop, every path through it, the rows into the journal after those `kept`;
    with OTEL_EXPORTER_OTLP_ENDPOINT set, one trace for the run (its forward passes link to it)."""
    traced = configure_tracing()
    try:
        with trace.get_tracer("vit-serve").start_as_current_span("batch run", attributes={"vit.files": len(paths)}):
            return await classify(settings, paths, infer, options, output, kept)
    finally:
        if traced:
            shutdown_tracing()


async def classify(
    settings: Settings, paths: list[str], infer: InferOptions, options: RowOptions, output: Path, kept: list[Row]
) -> Counts:
    async with Engine.serving(settings, freeze_heap=True) as plane:
        model = plane.describe(None)
        model.check_labels(
            infer.labels, infer.template, head=infer.head
        )  # labels that do not fit the model fail before any image
        classes = model.classes_for(model.answer_labels(infer))  # a head the model lacks fails before any image
        model.class_index(infer.target, classes)  # and so does a bad --target
        journal = Journal(journal_path(output), kept)
        try:
            with tqdm(total=len(paths), unit="img", desc="classify", disable=None) as bar:
                window = 4 * settings.max_batch_size
                return await classify_files(plane, model, paths, infer, options, journal.append, bar.update, window)
        finally:
            journal.close()


if __name__ == "__main__":
    sys.exit(main())
