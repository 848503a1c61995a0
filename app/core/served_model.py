"""One served checkpoint, built whole: its predictor, preprocessing and batcher, and the path of its images.

decode (CPU pool) -> preprocess -> DynamicBatcher -> Predictor (forward thread) -> outputs

Every edge's requests for this model come through `run`, so they share the same decoding, limits,
batches, deadlines and overload answers.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Sequence
from concurrent.futures import Executor
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from opentelemetry import context as otel_context
from opentelemetry.util.types import AttributeValue
from PIL import Image

from app.choices import BackendChoice
from app.core.batcher import DynamicBatcher
from app.core.decode import decode_image, load_image, open_image
from app.core.description import ModelDescription
from app.core.errors import RequestTimeout
from app.core.gpu_decode import GpuJpegDecoder, Jpeg, gpu_decodable
from app.core.inference import ImageInput, ImageOutput, Predictor, graph_sizes, resolve_backend
from app.core.metrics import ModelMetrics
from app.core.onnx_backend import ForeignGraph, OnnxExportError
from app.core.preprocess import Preprocessor
from app.core.request import AttentionKind, EncodedImage
from app.core.tracing import record_span, tracer
from app.settings import Settings
from model.checkpoint import Checkpoint, load_checkpoint

log = logging.getLogger("app")


@dataclass(frozen=True)
class Wanted:
    """What to compute for each image of one request, with the target class resolved."""

    attention: AttentionKind
    target: int | None
    embedding: bool

    def input(self, pixels: torch.Tensor | Jpeg) -> ImageInput:
        return ImageInput(pixels, self.attention, self.target, self.embedding)


@dataclass(frozen=True)
class Prepared:
    filename: str
    image: Image.Image | None  # kept only when an overlay is drawn
    pixels: torch.Tensor | Jpeg  # a plain JPEG stays encoded when the GPU decodes it


@dataclass
class ServedModel:
    name: str
    checkpoint: Checkpoint
    predictor: Predictor
    preprocessor: Preprocessor
    batcher: DynamicBatcher[ImageInput, ImageOutput]
    max_image_pixels: int
    draft_to: int | None = None  # large JPEGs decoded scaled to at least this side on the CPU (VIT_JPEG_DRAFT)
    retired: bool = False  # replaced or unloaded: admits nothing new
    successor: ServedModel | None = None  # the version that replaced it

    @classmethod
    def load(
        cls, name: str, path: Path, settings: Settings, device: torch.device, metrics: ModelMetrics
    ) -> ServedModel:
        """Load the checkpoint onto the device and warm it up (blocking; run off the event loop)."""
        checkpoint = load_checkpoint(path, device)
        preprocessor = Preprocessor(checkpoint.preprocessing)
        draft_to = checkpoint.preprocessing.resize_size if settings.jpeg_draft else None
        jpeg_decoder = None
        if device.type == "cuda" and settings.decode == "auto":
            channels, limit = checkpoint.config.in_channels, settings.max_image_pixels

            def on_cpu(jpeg: Jpeg) -> torch.Tensor:  # what nvJPEG rejects: PIL's pixels, or PIL's error
                return preprocessor(decode_image(jpeg.data, jpeg.filename, channels, limit, draft_to))

            jpeg_decoder = GpuJpegDecoder(checkpoint.preprocessing, device, on_cpu)
        graphs = graph_sizes(settings.max_batch_size) if settings.cuda_graphs else None
        predictor = cls.build_predictor(
            name, checkpoint, device, settings.backend, jpeg_decoder, graphs, settings.onnx_cache
        )
        log.info(
            "model %s: loaded %s (version %s, %d classes) on %s as %s, backend %s, JPEGs decoded on the %s",
            name,
            path,
            checkpoint.version,
            len(checkpoint.classes),
            device,
            predictor.dtype,
            predictor.backend,
            predictor.decode,
        )
        if settings.warmup:
            predictor.warm_up(settings.max_batch_size)
        s = settings
        metrics.bind_version(checkpoint.version)  # loaded and warm: from now on its statistics count
        traced = {
            "vit.model.name": name,
            "vit.model.version": checkpoint.version,
            "vit.backend": predictor.backend,
            "vit.device": str(device),
        }
        batcher = DynamicBatcher(predictor, s.max_batch_size, s.max_wait_ms, s.max_queue, metrics, traced)
        return cls(name, checkpoint, predictor, preprocessor, batcher, s.max_image_pixels, draft_to)

    @staticmethod
    def build_predictor(
        name: str,
        checkpoint: Checkpoint,
        device: torch.device,
        backend: BackendChoice,
        jpeg_decoder: GpuJpegDecoder | None = None,
        graph_batch_sizes: list[int] | None = None,
        onnx_cache: Path | None = None,
    ) -> Predictor:
        """The checkpoint's predictor on the asked backend; with auto, torch where ONNX export fails."""
        try:
            backend_now = resolve_backend(backend, device)
            return Predictor(checkpoint, device, backend_now, jpeg_decoder, graph_batch_sizes, onnx_cache)
        except OnnxExportError as e:
            if backend != "auto":
                hint = "" if isinstance(e, ForeignGraph) else "; VIT_BACKEND=torch serves it without ONNX"
                raise OnnxExportError(f"model {name}: {e}{hint}") from None
            log.warning("model %s: %s; serving it with torch", name, e)
            return Predictor(checkpoint, device, "torch")

    def retire(self, successor: ServedModel | None) -> None:
        """No new requests from now on: they go to `successor`, or find no model when it is None."""
        self.retired = True
        self.successor = successor

    @property
    def version(self) -> str:
        return self.checkpoint.version

    @functools.cached_property
    def description(self) -> ModelDescription:
        """What the edges may know of this version."""
        c, p = self.checkpoint, self.predictor
        return ModelDescription(
            name=self.name,
            version=c.version,
            content_hash=c.content_hash,
            classes=c.classes,
            input_shape=p.input_shape,
            grid_size=c.config.grid_size,
            embedding_dim=p.embedding_dim,
            backend=p.backend,
            precision=p.precision,
            quantization=p.quantization,
            device=str(p.device),
            dtype=str(p.dtype).removeprefix("torch."),
            decode=p.decode,
            config=c.config.to_dict(),
            preprocessing=asdict(c.preprocessing),
            training=c.training,
        )

    @property
    def classes(self) -> list[str]:
        return self.checkpoint.classes

    @property
    def input_shape(self) -> tuple[int, int, int]:
        """(channels, height, width) of one preprocessed image."""
        return self.predictor.input_shape

    @property
    def grid_size(self) -> int:
        """Rows (and columns) of the patch grid, the size of an attention map."""
        return self.checkpoint.config.grid_size

    def prepare(self, image: EncodedImage, keep_image: bool) -> Prepared:
        """Decode, validate and preprocess one image file (runs on the CPU pool); a plain JPEG only has its
        header checked here when the GPU decodes it."""
        header = open_image(image.data, image.filename, self.max_image_pixels)
        if self.predictor.jpeg_decoder is not None and not keep_image and gpu_decodable(header, image.data):
            return Prepared(image.filename, None, Jpeg(image.data, image.filename))
        # An overlay is drawn on the image as sent: decoded in full.
        draft_to = None if keep_image else self.draft_to
        decoded = load_image(header, image.filename, self.checkpoint.config.in_channels, draft_to)
        return Prepared(image.filename, decoded if keep_image else None, self.preprocessor(decoded))

    def prepare_traced(self, context: otel_context.Context, image: EncodedImage, keep_image: bool) -> Prepared:
        """`prepare` in a `decode` span under `context` (it runs on a pool thread, outside the request's)."""
        attributes: dict[str, AttributeValue] = {
            "vit.image.filename": image.filename,
            "vit.image.bytes": len(image.data),
        }
        with tracer.start_as_current_span("decode", context=context, attributes=attributes):
            return self.prepare(image, keep_image)

    def target_index(self, target: str | None) -> int | None:
        """A class label, or its index, as the class index a gradient map explains."""
        return self.description.class_index(target)

    async def run_images(
        self, images: Sequence[EncodedImage], wanted: Wanted, keep_images: bool, pool: Executor, deadline: float
    ) -> tuple[list[Prepared], list[ImageOutput], float]:
        """All of one request's files: decoded first, so a bad one fails the request before any compute.
        Also when they entered the batcher (time.monotonic())."""
        loop = asyncio.get_running_loop()
        asked = time.monotonic()
        with self.batcher.admit(len(images)) as admission:  # refused here, before any CPU is spent on decoding
            record_span("admission", asked, time.monotonic(), {"vit.images": len(images)})
            context = otel_context.get_current()  # each image's decode span goes under this request's
            prepared = await asyncio.gather(
                *(loop.run_in_executor(pool, self.prepare_traced, context, i, keep_images) for i in images)
            )
            futures = admission.submit([wanted.input(p.pixels) for p in prepared], deadline)
            submitted = time.monotonic()
        return list(prepared), await wait_for_outputs(futures, deadline), submitted

    async def run_pixels(self, pixels: torch.Tensor, wanted: Wanted, deadline: float) -> list[ImageOutput]:
        """Already preprocessed images (N, C, H, W) through the same batcher."""
        futures = self.batcher.submit([wanted.input(p) for p in pixels], deadline)
        return await wait_for_outputs(futures, deadline)


async def wait_for_outputs(futures: list[asyncio.Future[ImageOutput]], deadline: float) -> list[ImageOutput]:
    """All outputs of one request. When one image fails, time runs out or the request is cancelled (the
    client left), its other queued images are cancelled too: the batcher skips them, never computing them."""
    try:
        return list(await asyncio.wait_for(asyncio.gather(*futures), max(0.0, deadline - time.monotonic())))
    except TimeoutError:
        raise RequestTimeout(
            "the request was not answered within VIT_REQUEST_TIMEOUT_S; retry or send fewer images"
        ) from None
    finally:
        for f in futures:
            f.cancel()  # a no-op for those already answered
