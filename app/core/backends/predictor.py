"""The forward step: the only code that touches the device, run on the batcher's worker thread."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from app.choices import ONNX_BACKENDS, Backend, BackendChoice, DecodedOn, Precision, Quantization
from app.core.backends.onnx_runtime import GraphCache, OnnxForward, exported, int8_graph_path, stored_int8
from app.core.contract.request import AttentionKind
from app.core.images.gpu_decode import GpuJpegDecoder, Jpeg, blank_jpeg
from app.telemetry.statistics import BatchTiming
from model.checkpoint import Checkpoint
from model.preprocessing import EvalTransform
from model.rollout import GRADIENT, Readout, attention_map, gradient_attention_map
from model.vit import ViT
from model.zero_shot import ZeroShot

log = logging.getLogger("app.inference")
PRECISIONS: dict[torch.dtype, Precision] = {
    torch.float32: "float32",
    torch.bfloat16: "bfloat16",
    torch.float16: "float16",
}


@dataclass(frozen=True)
class ImageInput:
    # (C, S, S) float32, normalised; uint8, resized but not yet scaled (the device normalises it); or a JPEG the
    # GPU decodes with its batch
    pixels: Tensor | Jpeg
    attention: AttentionKind
    target: int | None = None  # the class a gradient map explains (None: the top-1 class)
    embedding: bool = False  # also return the embedding the head receives
    # a zero-shot model's gradient map: the embeddings (L, D) of the request's labels, which `target` indexes
    texts: Tensor | None = None


@dataclass(frozen=True)
class ImageOutput:
    # (num_classes,) float32 on the CPU; a zero-shot model's image embedding in the joint space (its head's
    # output, not normalised), which the engine compares with each request's labels
    probabilities: Tensor
    attention_map: Tensor | None  # (grid, grid) in [0, 1], when asked for
    embedding: Tensor | None = None  # (dim,) float32 on the CPU, when asked for
    batch: BatchTiming | None = None  # the forward pass that computed it


# One image's (probabilities, map, embedding), before its batch's timing is known.
Parts = tuple[Tensor, Tensor | None, Tensor | None]


def resolve_backend(asked: BackendChoice, device: torch.device) -> Backend:
    """VIT_BACKEND to the backend that computes plain probabilities: auto is ONNX Runtime on the CPU, torch on CUDA."""
    if asked == "auto":
        return "onnxruntime" if device.type == "cpu" else "torch"
    if asked in ONNX_BACKENDS and device.type != "cpu":
        raise ValueError(f"VIT_BACKEND={asked} runs on the CPU, not {device}; use VIT_BACKEND=torch (or auto) on a GPU")
    return asked


def batch_sizes(max_batch_size: int) -> list[int]:
    """1, 2, 4, ... up to and including the maximum: the sizes the batcher will produce most."""
    return sorted({min(2**k, max_batch_size) for k in range(max_batch_size.bit_length() + 1)})


def graph_sizes(max_batch_size: int) -> list[int]:
    """The batch sizes captured as CUDA graphs: powers of two up to 32, then every multiple of 32, and the maximum."""
    return sorted(
        {*(s for s in batch_sizes(max_batch_size) if s <= 32), *range(64, max_batch_size + 1, 32), max_batch_size}
    )


def inference_dtype(device: torch.device) -> torch.dtype:
    """bf16 on GPUs that support it, fp16 on older ones, fp32 on the CPU."""
    if device.type != "cuda":
        return torch.float32
    return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16


def onnx_forward(
    checkpoint: Checkpoint, model: ViT, input_shape: tuple[int, int, int], int8: bool, cache: Path | None = None
) -> OnnxForward:
    """The ONNX Runtime graph: int8 from the static graph stored beside the checkpoint when there is one
    (`python -m app.quantize`), else exported (and, for int8, dynamically quantized) now, or found in the
    `cache` folder from an earlier export."""
    threads = torch.get_num_threads()
    stored = int8_graph_path(Path(checkpoint.path)) if checkpoint.path else None
    if int8 and stored is not None and stored.is_file():
        return stored_int8(stored, checkpoint.content_hash, threads)
    place = None
    if cache is not None and checkpoint.content_hash:
        place = GraphCache(cache, checkpoint.content_hash, checkpoint.config.to_dict(), input_shape, int8)
    return exported(model, input_shape, threads, int8, place)


class Predictor:
    """Runs batches through the checkpoint's model: probabilities for all, attention maps for those asking.

    Plain probabilities and embeddings come from the backend (eager torch, or an ONNX Runtime graph
    exported from the same model), both from one pass; attention maps always come from the torch
    model, which alone returns the weights (and the embeddings of the same pass).
    """

    def __init__(
        self,
        checkpoint: Checkpoint,
        device: torch.device,
        backend: Backend = "torch",
        jpeg_decoder: GpuJpegDecoder | None = None,
        graph_batch_sizes: list[int] | None = None,
        onnx_cache: Path | None = None,
    ) -> None:
        self.device = device
        self.jpeg_decoder = jpeg_decoder  # decodes the `Jpeg` inputs on the GPU, with their batch
        # Two batches may be in flight (the batcher's `in_flight`): one decoding while the other computes.
        # Each stage takes one batch at a time; on a GPU the decoding runs on a stream of its own.
        self.decoding = threading.Lock()
        self.computing = threading.Lock()
        self.decode_stream = torch.cuda.Stream(device) if device.type == "cuda" and jpeg_decoder else None
        self.dtype = inference_dtype(device)
        self.scale = EvalTransform(checkpoint.preprocessing).scaled  # uint8 pixels -> normalised float32
        self.model = checkpoint.model.to(device=device, dtype=self.dtype).eval()
        config = checkpoint.config
        self.input_shape = (config.in_channels, config.image_size, config.image_size)
        self.backend = backend
        self.zero_shot = checkpoint.zero_shot  # the text tower: the head's outputs are an embedding, not logits
        self.embedding_dim = config.num_classes if self.zero_shot is not None else config.dim
        self.forward_plain: Callable[[Tensor], tuple[Tensor, Tensor]] = self.torch_forward
        self.quantization: Quantization | None = None
        self.graphs: GraphedForward | None = None
        if backend in ONNX_BACKENDS:
            int8 = backend == "onnxruntime-int8"
            graph = onnx_forward(checkpoint, self.model, self.input_shape, int8, onnx_cache)
            self.forward_plain, self.quantization = graph, graph.quantization
        elif graph_batch_sizes and device.type == "cuda":
            self.graphs = GraphedForward(self.model, self.input_shape, self.dtype, device, graph_batch_sizes)
            self.forward_plain = self.graphs

    @property
    def decode(self) -> DecodedOn:
        """Where plain JPEGs are decoded: "gpu" (with their batch) or "cpu"."""
        return "cpu" if self.jpeg_decoder is None else "gpu"

    @property
    def precision(self) -> Precision:
        """The arithmetic of plain predictions: int8 on the int8 backend, else the model's dtype."""
        if self.backend == "onnxruntime-int8":
            return "int8"
        return PRECISIONS[self.dtype]

    def torch_forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        logits, embedding, _ = self.model.forward_with_embedding(x)
        return logits, embedding

    def __call__(self, batch: list[ImageInput]) -> list[ImageOutput]:
        try:
            return self.forward(batch)
        except torch.OutOfMemoryError:
            if self.device.type == "cuda":
                torch.cuda.empty_cache()  # give the batcher's smaller retries the memory back
            raise

    def forward(self, batch: list[ImageInput]) -> list[ImageOutput]:
        started = time.monotonic()
        with self.decoding:
            x, decoded = self.staged_inputs(batch)  # (B, C, S, S) on the device
        inputs_done = time.monotonic()
        with self.computing:
            if decoded is not None:  # the compute stream waits for the decoding stream's work on x
                stream = torch.cuda.current_stream(self.device)
                stream.wait_event(decoded)
                x.record_stream(stream)
            return self.computed(batch, x, started, inputs_done)

    def staged_inputs(self, batch: list[ImageInput]) -> tuple[Tensor, torch.cuda.Event | None]:
        """The batch's inputs; on a GPU that decodes, made on the decoding stream, with the event that marks
        them done."""
        if self.decode_stream is None:
            return self.inputs(batch), None
        with torch.cuda.stream(self.decode_stream):
            x = self.inputs(batch)
            decoded = torch.cuda.Event()
            decoded.record(self.decode_stream)
        return x, decoded

    def computed(self, batch: list[ImageInput], x: Tensor, started: float, inputs_done: float) -> list[ImageOutput]:
        """The forward pass (and the maps) of a batch whose inputs are on the device."""
        by_gradient = [i for i, item in enumerate(batch) if item.attention == GRADIENT]
        others = [i for i in range(len(batch)) if batch[i].attention != GRADIENT]
        outputs: dict[int, Parts] = {}
        if others:
            outputs |= self.forward_weights(x[others] if by_gradient else x, [batch[i] for i in others], others)
        if by_gradient and self.zero_shot is not None:
            for group in label_sets(batch, by_gradient):  # each request's labels score its own images
                outputs |= self.label_gradients(x[group], [batch[i] for i in group], group)
        elif by_gradient:  # class-specific maps need a backward pass: their own forward, with gradients
            targets = [batch[i].target for i in by_gradient]
            chosen = None if all(t is None for t in targets) else self.targets(x[by_gradient], targets)
            recording = RecordingEmbedding(self.model)
            logits, maps = gradient_attention_map(recording, x[by_gradient], chosen)
            probabilities = logits.float().softmax(dim=-1).cpu()
            embeddings = embeddings_asked(recording.embedding, [batch[i] for i in by_gradient])
            for j, (i, row, m) in enumerate(zip(by_gradient, probabilities.unbind(), maps.float().cpu(), strict=True)):
                outputs[i] = (row, m, embeddings.get(j))
        inferred = time.monotonic()
        ordered = [outputs[i] for i in range(len(batch))]
        done = time.monotonic()
        timing = BatchTiming(len(batch), started, inputs_done - started, inferred - inputs_done, done - inferred)
        return [ImageOutput(row, m, embedding, timing) for row, m, embedding in ordered]

    def inputs(self, batch: list[ImageInput]) -> Tensor:
        """The batch as one tensor on the device: CPU pixels copied over (uint8 ones scaled and normalised there),
        JPEGs decoded there."""
        jpegs = [i for i, item in enumerate(batch) if isinstance(item.pixels, Jpeg)]
        floats = [i for i, item in enumerate(batch) if is_float(item.pixels)]
        if not jpegs and len(floats) == len(batch):
            return self.copied([batch[i].pixels for i in floats])  # type: ignore[misc]
        uint8s = [i for i, item in enumerate(batch) if isinstance(item.pixels, Tensor) and not is_float(item.pixels)]
        x = torch.empty(len(batch), *self.input_shape, device=self.device, dtype=self.dtype)
        if jpegs:
            if self.jpeg_decoder is None:
                raise RuntimeError("a JPEG reached a predictor without a GPU decoder")
            x[jpegs] = self.jpeg_decoder([batch[i].pixels for i in jpegs]).to(self.dtype)  # type: ignore[misc]
        if floats:
            x[floats] = self.copied([batch[i].pixels for i in floats])  # type: ignore[misc]
        if uint8s:
            x[uint8s] = self.normalized([batch[i].pixels for i in uint8s]).to(self.dtype)  # type: ignore[misc]
        return x

    def copied(self, pixels: list[Tensor]) -> Tensor:
        x = torch.stack(pixels)
        x = x.pin_memory() if self.device.type == "cuda" else x
        return x.to(self.device, self.dtype, non_blocking=True)

    def normalized(self, pixels: list[Tensor]) -> Tensor:
        """(C, S, S) uint8 pixels as the host's preprocessing stopped them -> (N, C, S, S) float32 on the device,
        scaled and normalised there as `EvalTransform` would have on the host."""
        x = torch.stack(pixels)  # (N, C, S, S) uint8: a quarter of float32's bytes to copy
        x = x.pin_memory() if self.device.type == "cuda" else x
        return self.scale(x.to(self.device, non_blocking=True))

    @torch.inference_mode()
    def forward_weights(self, x: Tensor, items: list[ImageInput], index: list[int]) -> dict[int, Parts]:
        """Probabilities, and rollout/last maps and embeddings for the items asking: one pass for all of them."""
        wanted = [j for j, item in enumerate(items) if item.attention != "none"]
        maps: dict[int, Tensor] = {}
        if wanted:  # one pass on the explicit path serves plain and attention requests alike
            logits, embedding, attentions = self.model.forward_with_embedding(x, return_attention=True)
            for method in {items[j].attention for j in wanted}:
                idx = [j for j in wanted if items[j].attention == method]
                rows = torch.tensor(idx, device=self.device)
                found = attention_map([a[rows] for a in attentions], method, self.model.readout)
                for j, m in zip(idx, found.float().cpu(), strict=True):
                    maps[j] = m
        else:
            logits, embedding = self.forward_plain(x)
        probabilities = self.head_rows(logits)  # (B, num_classes)
        embeddings = embeddings_asked(embedding, items)
        per_image = probabilities.unbind()  # one call for every row, not an indexing per image
        return {i: (per_image[j], maps.get(j), embeddings.get(j)) for j, i in enumerate(index)}

    def head_rows(self, logits: Tensor) -> Tensor:
        """The head's outputs as the engine takes them, on the CPU: a classifier's probabilities, a zero-shot
        model's image embeddings (scored against each request's labels by the engine)."""
        return logits.float().cpu() if self.zero_shot is not None else logits.float().softmax(dim=-1).cpu()

    def label_gradients(self, x: Tensor, items: list[ImageInput], index: list[int]) -> dict[int, Parts]:
        """A zero-shot model's gradient maps for images sharing one label set: each for its target label's score
        (default its top-1 label), with the image embeddings of that same pass."""
        assert self.zero_shot is not None and items[0].texts is not None
        scoring = LabelScores(self.model, self.zero_shot, items[0].texts.to(self.device))
        targets = [item.target for item in items]
        chosen = None if all(t is None for t in targets) else self.label_targets(x, scoring, targets)
        _, maps = gradient_attention_map(scoring, x, chosen)
        assert scoring.image_embedding is not None
        rows = scoring.image_embedding.float().cpu().unbind()
        return {i: (row, m, None) for i, row, m in zip(index, rows, maps.float().cpu(), strict=True)}

    def label_targets(self, x: Tensor, scoring: LabelScores, targets: list[int | None]) -> Tensor:
        """The asked-for label per image; the top-1 label where none was asked for."""
        top1: list[int] = []
        if any(t is None for t in targets):
            with torch.inference_mode():
                top1 = scoring.scores(self.forward_plain(x)[0]).argmax(dim=1).tolist()
        chosen = [t if t is not None else top1[j] for j, t in enumerate(targets)]
        return torch.tensor(chosen, device=self.device)

    def targets(self, x: Tensor, targets: list[int | None]) -> Tensor:
        """The asked-for class per image; the top-1 class where none was asked for."""
        top1: list[int] = []
        if any(t is None for t in targets):
            with torch.inference_mode():
                top1 = self.forward_plain(x)[0].argmax(dim=1).tolist()
        chosen = [t if t is not None else top1[j] for j, t in enumerate(targets)]
        return torch.tensor(chosen, device=self.device)  # made outside inference mode: it enters autograd

    def run_blank(self, size: int) -> None:
        """A plain prediction of `size` blank images, as a batch of requests runs it."""
        self([ImageInput(torch.zeros(self.input_shape), "none")] * size)

    def warm_up(self, max_batch_size: int) -> float:
        """Run every power-of-two batch size up to the maximum (and the maximum), both paths; returns seconds."""
        started = time.perf_counter()
        sizes = batch_sizes(max_batch_size)
        blank = torch.zeros(self.input_shape)
        for size in sizes:
            self.run_blank(size)
        texts = (
            None if self.zero_shot is None else torch.ones(1, self.zero_shot.embed_dim) / self.zero_shot.embed_dim**0.5
        )
        self([ImageInput(blank, "rollout"), ImageInput(blank, "last"), ImageInput(blank, "gradient", texts=texts)])
        if self.jpeg_decoder is not None:  # nvJPEG's first call sets it up
            self([ImageInput(Jpeg(blank_jpeg(self.input_shape), "warm-up.jpg"), "none")] * 2)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - started
        log.info("warmed up batch sizes %s in %.2fs", sizes, seconds)
        return seconds


def is_float(pixels: Tensor | Jpeg) -> bool:
    """Pixels the host normalised already (not uint8 ones the device normalises, nor a JPEG)."""
    return isinstance(pixels, Tensor) and pixels.dtype.is_floating_point


def label_sets(batch: list[ImageInput], indices: list[int]) -> list[list[int]]:
    """`indices` grouped by the label set their images are scored against (one per request), in order."""
    groups: dict[int, list[int]] = {}
    for i in indices:
        groups.setdefault(id(batch[i].texts), []).append(i)
    return list(groups.values())


def embeddings_asked(embedding: Tensor | None, items: list[ImageInput]) -> dict[int, Tensor]:
    """Row j's embedding (dim,) as float32 on the CPU, for the items that asked; only those rows are copied."""
    rows = [j for j, item in enumerate(items) if item.embedding]
    if not rows or embedding is None:
        return {}
    return dict(zip(rows, embedding[rows].float().cpu(), strict=True))


class GraphedForward:
    """The plain forward (logits, embedding) replayed from CUDA graphs captured once per batch size.

    A batch runs in the smallest captured size that holds it: its rows are copied into that graph's input,
    the graph replays, and the first rows of its outputs are the answer (a ViT's rows are independent, so
    the padding changes nothing). One replay launches the whole forward: the forward thread needs the GIL
    once per batch instead of once per kernel, which under load the event loop holds most of the time. The
    graphs share one memory pool (they never run at once), taken at startup: a replay allocates nothing.
    """

    def __init__(
        self, model: ViT, input_shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, sizes: list[int]
    ) -> None:
        started = time.perf_counter()
        self.model = model
        self.sizes = sorted(sizes)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, Tensor, Tensor, Tensor]] = {}
        pool = torch.cuda.graph_pool_handle()
        with torch.inference_mode(), torch.cuda.device(device):
            for size in reversed(self.sizes):  # the largest first: the others fit in the memory it took
                x = torch.zeros(size, *input_shape, device=device, dtype=dtype)
                side = torch.cuda.Stream(device)
                side.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(side):  # capture wants the kernels chosen (and loaded) beforehand
                    model.forward_with_embedding(x)
                torch.cuda.current_stream(device).wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    logits, embedding, _ = model.forward_with_embedding(x)
                self.graphs[size] = (graph, x, logits, embedding)
        log.info("captured CUDA graphs for batch sizes %s in %.2fs", self.sizes, time.perf_counter() - started)

    def __call__(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """(logits, embedding) of the batch: views of the graph's outputs, valid until the next replay."""
        n = x.shape[0]
        size = next((s for s in self.sizes if s >= n), None)
        if size is None:  # larger than any captured size (a retry never is): run it eagerly
            logits, embedding, _ = self.model.forward_with_embedding(x)
            return logits, embedding
        graph, static_x, logits, embedding = self.graphs[size]
        static_x[:n].copy_(x)
        graph.replay()
        return logits[:n], embedding[:n]


class RecordingEmbedding:
    """The model as `gradient_attention_map` calls it, keeping the embedding of that same pass."""

    def __init__(self, model: ViT) -> None:
        self.model = model
        self.embedding: Tensor | None = None

    @property
    def readout(self) -> Readout:
        return self.model.readout

    def forward_with_attention(self, x: Tensor) -> tuple[Tensor, list[Tensor]]:
        logits, embedding, attentions = self.model.forward_with_embedding(x, return_attention=True)
        self.embedding = embedding.detach()
        return logits, attentions


class LabelScores:
    """A zero-shot model as `gradient_attention_map` calls it: logits over one request's labels (B, L), keeping
    the image embeddings of that same pass."""

    def __init__(self, model: ViT, zero_shot: ZeroShot, texts: Tensor) -> None:
        self.model = model
        self.zero_shot = zero_shot
        self.texts = texts  # (L, D), unit length, on the device
        self.image_embedding: Tensor | None = None

    @property
    def readout(self) -> Readout:
        return self.model.readout

    def scores(self, image_embedding: Tensor) -> Tensor:
        return self.zero_shot.logits(image_embedding, self.texts)

    def forward_with_attention(self, x: Tensor) -> tuple[Tensor, list[Tensor]]:
        image_embedding, _, attentions = self.model.forward_with_embedding(x, return_attention=True)
        self.image_embedding = image_embedding.detach()
        return self.scores(image_embedding), attentions
