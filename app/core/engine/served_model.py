"""One served checkpoint, built whole: its predictor, preprocessing and batcher, and the path of its images.

decode (CPU pool, or a front-end's) -> preprocess -> DynamicBatcher -> Predictor (forward thread) -> outputs

Every edge's requests for this model come through `run`, so they share the same decoding, limits,
batches, deadlines and overload answers.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import Executor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import cast

import torch

from app.choices import BackendChoice
from app.core.backends.batch_fit import fitted_batch_size
from app.core.backends.onnx_runtime import ForeignGraph, OnnxExportError
from app.core.backends.predictor import ImageInput, ImageOutput, Predictor, graph_sizes, resolve_backend
from app.core.backends.text_embeddings import LabelEmbeddings
from app.core.batching.batcher import BatchObserver, DynamicBatcher
from app.core.contract.description import ModelDescription, numeric_version
from app.core.contract.errors import TIMED_OUT, InvalidInput, ModelNotFound, RequestTimeout
from app.core.contract.request import AttentionKind, DecodedImage, EncodedImage, InferOptions, owned
from app.core.engine.decode_share import DecodeShare
from app.core.engine.drift import DriftWatch, Watching
from app.core.images.gpu_decode import GpuJpegDecoder, Jpeg, jpeg_decoder_for
from app.core.images.prepare import ImagePreparer, Prepared
from app.settings import Settings
from app.telemetry.metrics import ModelMetrics
from app.telemetry.spans import record_span, sampled
from model.checkpoint import Checkpoint, load_checkpoint
from model.taught_head import HEADS, HeadError, TaughtHead, check_head_name
from model.taught_head import load as load_head

log = logging.getLogger("app")


@dataclass(frozen=True)
class Wanted:
    """What to compute for each image of one request, with the target class resolved."""

    attention: AttentionKind
    target: int | None
    embedding: bool
    texts: torch.Tensor | None = None  # a zero-shot model's gradient maps: the request's label embeddings

    def input(self, pixels: torch.Tensor | Jpeg) -> ImageInput:
        return ImageInput(pixels, self.attention, self.target, self.embedding, self.texts)


@dataclass
class ServedModel:
    name: str
    checkpoint: Checkpoint
    predictor: Predictor
    preparer: ImagePreparer
    batcher: DynamicBatcher[ImageInput, ImageOutput]
    labels: LabelEmbeddings | None = None  # a zero-shot model's text tower, behind its cache
    # the share of its JPEGs decoded on the host's cores (a model whose GPU decodes them)
    decode_share: DecodeShare | None = None
    retired: bool = False  # replaced or unloaded: admits nothing new
    successor: ServedModel | None = None  # the version that replaced it
    heads: dict[str, TaughtHead] = field(default_factory=dict)  # taught by example, by name
    # where its heads are kept (`heads_folder`): None for a checkpoint in a folder removed at stop
    heads_at: Path | None = None

    @classmethod
    def load(
        cls,
        name: str,
        path: Path,
        settings: Settings,
        device: torch.device,
        metrics: ModelMetrics,
        scratch: bool = False,
    ) -> ServedModel:
        """Load the checkpoint onto the device and warm it up (blocking; run off the event loop); `scratch`: its
        folder is removed at stop (a hub model converted without VIT_HUB_CACHE), so no head is taught on it."""
        checkpoint = load_checkpoint(path, device)
        version = numeric_version(checkpoint.content_hash)
        p = checkpoint.preprocessing
        jpeg_decoder = None
        if device.type == "cuda" and settings.decode != "cpu":
            on_cpu = ImagePreparer(p, settings.max_image_pixels, settings.jpeg_draft, gpu_jpegs=False)

            def decode_on_cpu(jpeg: Jpeg) -> torch.Tensor:  # what the GPU rejects: PIL's pixels, or PIL's error
                return cast("torch.Tensor", on_cpu.prepare(EncodedImage(jpeg.filename, bytes(jpeg.data)), False).pixels)

            decode = jpeg_decoder_for(settings.decode, device, settings.hw_decoder_load, settings.max_batch_size)
            jpeg_decoder = GpuJpegDecoder(p, device, decode_on_cpu, decode)
        graphs = graph_sizes(settings.max_batch_size) if settings.cuda_graphs else None
        predictor = cls.build_predictor(
            name, checkpoint, device, settings.backend, jpeg_decoder, graphs, settings.onnx_cache
        )
        # plain JPEGs are left encoded only for a predictor that decodes them (a fallback to torch has none)
        gpu_jpegs = predictor.jpeg_decoder is not None
        on_gpu = predictor.device.type == "cuda"  # pixels made on the host travel as uint8, normalised there
        preparer = ImagePreparer(p, settings.max_image_pixels, settings.jpeg_draft, gpu_jpegs, uint8=on_gpu)
        z = checkpoint.zero_shot
        classes = f"{len(checkpoint.classes)} classes"
        if z is not None:
            classes = f"zero-shot by {z.config.rule}, {len(checkpoint.classes) or 'no'} default labels"
        log.info(
            "model %s: loaded %s (version %s, content hash %s, %s) on %s as %s, backend %s, JPEGs decoded %s",
            name,
            path,
            version,
            checkpoint.version,
            classes,
            device,
            predictor.dtype,
            predictor.backend,
            f"on the GPU by {jpeg_decoder.decode.name}" if jpeg_decoder and gpu_jpegs else f"on the {predictor.decode}",
        )
        if settings.warmup:
            predictor.warm_up(settings.max_batch_size)
        s = settings
        batch = fitted_batch_size(name, predictor, s.preferred_batch_size, s.max_batch_size, s.warmup)
        metrics.preferred_batch_size.set(batch)
        metrics.bind_version(version)  # loaded and warm: from now on its statistics count
        traced = {
            "vit.model.name": name,
            "vit.model.version": version,
            "vit.backend": predictor.backend,
            "vit.device": str(device),
        }
        # a predictor that decodes on the device takes a batch to decode while another computes
        in_flight = 2 if predictor.jpeg_decoder is not None else 1
        observer: BatchObserver = metrics
        if checkpoint.reference is not None and s.drift_window > 0:  # its drift window, fed a batch at a time
            observer = Watching(metrics, DriftWatch(checkpoint.reference, s.drift_window, metrics.drift_gauges))
        decode_share = None
        if gpu_jpegs:  # the host's cores take a share of the JPEGs the GPU would decode: fixed, or found
            decode_share = DecodeShare(
                name,
                s.cpu_decode_share,
                s.cpu_decode_share_start,
                observer,
                metrics.cpu_decode_share,
                lambda: batcher.device_bound_s(),  # the batcher made next: it reports to this share
            )
            decode_share.follow(preparer.set_cpu_share)
            observer = decode_share
        batcher = DynamicBatcher(predictor, batch, s.max_wait_ms, s.max_queue, observer, traced, in_flight)
        labels = None
        if checkpoint.zero_shot is not None:
            labels = LabelEmbeddings(checkpoint.zero_shot, s.text_cache_labels, metrics.text_embeddings)
        folder = heads_folder(path, name)
        heads = load_heads(name, folder, checkpoint.content_hash)
        kept = None if scratch else folder
        return cls(name, checkpoint, predictor, preparer, batcher, labels, decode_share, heads=heads, heads_at=kept)

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

    def keep_head(self, name: str, head: TaughtHead) -> None:
        """`head` answers as `name` from the next request on (replacing one of that name)."""
        self.heads = {**self.heads, name: head}  # a new dict: a request reading the old one reads it whole
        self.__dict__.pop("description", None)

    def drop_head(self, name: str) -> None:
        self.heads = {k: v for k, v in self.heads.items() if k != name}
        self.__dict__.pop("description", None)

    def head(self, name: str) -> TaughtHead:
        """The head called `name`; ModelNotFound once deleted (or never taught)."""
        if (head := self.heads.get(name)) is None:
            self.description.answer_labels(InferOptions(head=name))  # its text, listing the heads there are
            raise ModelNotFound(f"model {self.name} has no head named {name!r}")
        return head

    @functools.cached_property
    def version(self) -> str:
        return numeric_version(self.checkpoint.content_hash)

    @functools.cached_property
    def description(self) -> ModelDescription:
        """What the edges may know of this version."""
        c, p = self.checkpoint, self.predictor
        return ModelDescription(
            name=self.name,
            version=self.version,
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
            reference=c.reference is not None,
            ood_p99=None if c.reference is None else c.reference.held_out_p99,
            ood_method=None if c.reference is None else c.reference.score,
            zero_shot=None if c.zero_shot is None else c.zero_shot.config.rule,
            template=None if c.zero_shot is None else c.zero_shot.config.template,
            heads={name: head.describe() for name, head in self.heads.items()},
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

    def wanted(
        self,
        inputs: Sequence[EncodedImage | DecodedImage] | torch.Tensor,
        options: InferOptions,
        texts: torch.Tensor | None = None,
        watch_drift: bool = False,
    ) -> Wanted:
        """What the batcher computes for each image of a request (a zero-shot model's with its label embeddings
        `texts`; with `watch_drift`, the embedding its drift window takes); InvalidInput for what it cannot."""
        reference = self.checkpoint.reference
        self.check_scores(options)
        self.description.answer_labels(options)  # ModelNotFound for a head this version does not have
        if isinstance(inputs, torch.Tensor):
            if options.overlay:
                raise InvalidInput("an overlay is drawn over the image file: send images, not pixels")
            if tuple(inputs.shape[1:]) != self.input_shape:  # checked by the edge against a replaced version
                raise InvalidInput(
                    f"model {self.name} (version {self.version}) takes pixels of shape "
                    f"[-1, {', '.join(map(str, self.input_shape))}], got {list(inputs.shape)}"
                )
        watched = reference is not None and watch_drift
        headed = options.head is not None and self.checkpoint.zero_shot is None  # a zero-shot model's: the joint
        embedding = (options.embedding or options.ood or watched or headed) and texts is None
        target = self.target_index(options.target, options.labels)
        return Wanted(options.attention, target, embedding, texts if options.attention == "gradient" else None)

    def check_scores(self, options: InferOptions) -> None:
        """InvalidInput for an out-of-distribution score this version cannot give: checked before any work on the
        request (a zero-shot model's labels are embedded after it)."""
        if options.ood and self.labels is not None:
            raise InvalidInput(
                f"model {self.name} is zero-shot (CLIP, SigLIP): it has no out-of-distribution score, whose reference "
                "statistics are fitted to a classifier's fixed classes"
            )
        if options.ood and self.checkpoint.reference is None:
            raise InvalidInput(
                f"model {self.name} (version {self.version}) has no reference statistics to score images by; "
                "add them with: python -m model.reference CHECKPOINT --images DIR (in-distribution images)"
            )

    async def label_embeddings(
        self, options: InferOptions, run_in_pool: Callable[..., Awaitable[torch.Tensor]]
    ) -> torch.Tensor:
        """A zero-shot request's label embeddings (L, D): its labels (or the model's defaults) in its template (or
        the model's), kept from an earlier request or computed now with `run_in_pool`. Checked against this
        version, which may have replaced the one the request was checked against."""
        described = self.description
        described.check_labels(options.labels, options.template, options.classify, options.head)
        assert self.labels is not None and described.template is not None
        labels = options.labels if options.labels is not None else tuple(described.classes)
        if not labels:  # no probabilities asked for, and none to give: the images' embeddings alone
            return torch.empty(0, self.labels.zero_shot.embed_dim)
        return await self.labels.of(options.template or described.template, labels, run_in_pool)

    def target_index(self, target: str | None, labels: tuple[str, ...] | None = None) -> int | None:
        """A class label, or its index (among a zero-shot request's labels), as the class index a gradient map
        explains."""
        return self.description.class_index(target, None if labels is None else list(labels))

    async def run_images(
        self,
        images: Sequence[EncodedImage | DecodedImage],
        wanted: Wanted,
        keep_images: bool,
        pool: Executor,
        deadline: float,
    ) -> tuple[list[Prepared], list[ImageOutput], float]:
        """All of one request's files: decoded first, so a bad one fails the request before any compute.
        Also when they entered the batcher (time.monotonic())."""
        asked = time.monotonic()
        with self.batcher.admit(len(images)) as admission:  # refused here, before any CPU is spent on decoding
            if sampled():
                record_span("admission", asked, time.monotonic(), {"vit.images": len(images)})
            prepared = await self.prepare_all(images, keep_images, pool)
            outputs = admission.submit([wanted.input(p.pixels) for p in prepared], deadline)
            submitted = time.monotonic()
        return prepared, await wait_for_outputs(outputs, deadline), submitted

    async def prepare_all(
        self, images: Sequence[EncodedImage | DecodedImage], keep_images: bool, pool: Executor
    ) -> list[Prepared]:
        """Every file prepared: on the pool, all at once, except those a front-end prepared for this version
        (its pixels; or, for a predictor that decodes JPEGs, its checked JPEG)."""
        prepared: list[Prepared | None] = [None] * len(images)
        if not keep_images:  # an overlay is drawn over the image itself: decoded here whatever the front-end did
            for k, i in enumerate(images):
                if self.prepared_for(i):
                    assert isinstance(i, DecodedImage)
                    prepared[k] = Prepared(i.filename, None, prepared_input(i))
        if todo := [k for k, p in enumerate(prepared) if p is None]:  # decoded on the pool: owned copies
            done = await self.preparer.prepare_all([owned(images[k]) for k in todo], keep_images, pool)
            for k, p in zip(todo, done, strict=True):
                prepared[k] = p
        return [p for p in prepared if p is not None]

    def prepared_for(self, image: EncodedImage | DecodedImage) -> bool:
        """Whether a front-end prepared `image` for this version: its pixels, or a checked JPEG that this
        predictor decodes on the device."""
        return (
            isinstance(image, DecodedImage)
            and image.version == self.version
            and (image.pixels is not None or self.predictor.jpeg_decoder is not None)
        )

    async def run_pixels(self, pixels: torch.Tensor, wanted: Wanted, deadline: float) -> list[ImageOutput]:
        """Already preprocessed images (N, C, H, W) through the same batcher."""
        outputs = self.batcher.submit([wanted.input(p) for p in pixels], deadline)
        return await wait_for_outputs(outputs, deadline)


def heads_folder(checkpoint: Path, name: str) -> Path:
    """Where model `name`'s heads taught by example are kept: `heads/<name>/` beside its checkpoint (in the model
    repository, for a model of one), as `python -m model.train --head DIR --backbone NAME` writes them."""
    return checkpoint.parent / HEADS / name


def load_heads(model: str, folder: Path, backbone: str) -> dict[str, TaughtHead]:
    """Every head in `folder` taught on this backbone, by name; one that cannot serve is left out, with a log line
    saying why."""
    heads: dict[str, TaughtHead] = {}
    for path in sorted(folder.glob("*.safetensors")) if folder.is_dir() else []:
        name = path.name.removesuffix(".safetensors")
        try:
            heads[check_head_name(name)] = load_head(path, backbone)
        except HeadError as e:
            log.warning("model %s: head %s not loaded: %s", model, name, e)
    if heads:
        log.info("model %s: %d heads taught by example (%s)", model, len(heads), ", ".join(heads))
    return heads


async def wait_for_outputs(outputs: asyncio.Future[list[ImageOutput]], deadline: float) -> list[ImageOutput]:
    """All outputs of one request. When one image fails, time runs out or the request is cancelled (the
    client left), its other queued images are dropped: the batcher skips them, never computing them."""
    timer = asyncio.get_running_loop().call_later(max(0.0, deadline - time.monotonic()), expire, outputs)
    try:
        return await outputs  # one timer, no waiter future: this runs for every request
    finally:
        timer.cancel()
        outputs.cancel()  # a no-op once answered


def prepared_input(image: DecodedImage) -> torch.Tensor | Jpeg:
    """What the batcher takes for an image a front-end prepared (`ServedModel.prepared_for`)."""
    return image.pixels if image.pixels is not None else Jpeg(image.data, image.filename)


def expire(outputs: asyncio.Future[list[ImageOutput]]) -> None:
    if not outputs.done():
        outputs.set_exception(RequestTimeout(TIMED_OUT))
