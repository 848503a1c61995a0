"""The ONNX Runtime backend: the model's logits and embeddings from an ONNX graph.

The float32 graph (and the dynamically quantized int8 one) is exported from the checkpoint's model at
startup, or taken from the cache folder where an earlier start of the same checkpoint left it, and
loaded by ONNX Runtime's CPU execution provider. A statically quantized int8 graph needs calibration
images, so `python -m app.quantize` makes it ahead of time and stores it beside the checkpoint, marked
with the checkpoint's content hash; the service loads it only for that checkpoint. One `session.run`
covers the whole batch with the GIL released, where eager torch re-takes it between operators.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
import warnings
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from importlib.metadata import version
from pathlib import Path
from typing import Any, Literal

import numpy as np
import onnx
import onnxruntime as ort
import torch
from torch import Tensor, nn

from app.choices import Quantization
from app.core.backends.onnx_attention import fuse_attention
from model.vit import ViT

log = logging.getLogger("app.inference")

INPUT = "pixels"
OUTPUTS = ["logits", "embedding"]
CHECKPOINT_HASH = "vit_serve.checkpoint_content_hash"  # in a stored graph's metadata: whose graph it is
QUANTIZED_OPS = ["MatMul", "Gemm"]  # the arithmetic; the patch embedding, LayerNorm, softmax and GELU stay float32
CalibrationMethodName = Literal["minmax", "entropy", "percentile"]


class OnnxExportError(ValueError):
    """The model could not be exported to ONNX or loaded by ONNX Runtime."""


class ForeignGraph(OnnxExportError):
    """A stored int8 graph made for another checkpoint."""


class LogitsAndEmbedding(nn.Module):
    """What the graph computes: a ViT's logits and the embedding its head receives, from one pass."""

    def __init__(self, model: ViT) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        logits, embedding, _ = self.model.forward_with_embedding(x)
        return logits, embedding


class OnnxForward:
    """`logits, embedding = forward(pixels)`: float32 (B, C, H, W) -> (B, classes) and (B, dim) on the CPU,
    from an ONNX Runtime session made by `exported` (at startup) or `stored_int8` (made ahead of time)."""

    def __init__(self, session: ort.InferenceSession, quantization: Quantization | None) -> None:
        self.session = session
        self.quantization = quantization

    def __call__(self, pixels: Tensor) -> tuple[Tensor, Tensor]:
        logits, embedding = self.session.run(OUTPUTS, {INPUT: pixels.contiguous().numpy()})
        return torch.from_numpy(logits), torch.from_numpy(embedding)


def exported(
    model: ViT, input_shape: tuple[int, int, int], threads: int, int8: bool = False, cache: GraphCache | None = None
) -> OnnxForward:
    """The model's graph exported now, or taken from `cache` when an earlier export of the same checkpoint
    left it there; with `int8`, its weights quantized to int8 and its matrix products run on int8
    activations quantized per batch (ONNX Runtime's dynamic quantization)."""
    started = time.perf_counter()
    quantization: Quantization | None = "dynamic" if int8 else None
    cached = cache.load() if cache is not None else None
    if cached is not None:
        try:
            forward = OnnxForward(session(cached, threads, fuse=not int8), quantization)
        except OnnxExportError as e:
            log.warning("%s; exporting again", e)
        else:
            log.info(
                "loaded the%s ONNX graph from the cache (%s) and built an ORT session (%d threads) in %.1fs",
                " int8" if int8 else "",
                cached,
                threads,
                time.perf_counter() - started,
            )
            return forward
    float32 = cache.float32() if cache is not None and int8 else None
    kept = float32.load() if float32 is not None else None  # int8 is quantized from the float32 graph
    with export_folder() as folder:
        made = quantized_from(kept, folder, threads) if kept is not None else None
        if made is None:
            kept, path = None, folder / "model.onnx"
            export(LogitsAndEmbedding(model), input_shape, path)
            if float32 is not None:
                float32.store(path)  # a float32 start of the same checkpoint takes it (and a damaged one is replaced)
            if int8:
                path = quantize_int8(path)
            made = OnnxForward(session(path, threads, fuse=not int8), quantization), path
        forward, path = made
        if cache is not None:
            cache.store(path)
    log.info(
        "%s%s and built an ORT session (%d threads) in %.1fs",
        f"quantized the cached ONNX graph ({kept}) to int8" if kept else "exported the model to ONNX",
        " (int8)" if int8 and not kept else "",
        threads,
        time.perf_counter() - started,
    )
    return forward


def quantized_from(kept: Path, folder: Path, threads: int) -> tuple[OnnxForward, Path] | None:
    """The int8 graph quantized from the cached float32 graph `kept` (copied into `folder`), and its session; None,
    with a warning, where that graph cannot be quantized or loaded (then the model is exported again)."""
    try:
        path = folder / "model.onnx"
        shutil.copyfile(kept, path)
        path = quantize_int8(path)
        return OnnxForward(session(path, threads), "dynamic"), path
    except (OnnxExportError, OSError) as e:
        log.warning("could not quantize the cached graph %s (%s); exporting again", kept, e)
        return None


class GraphCache:
    """One exported graph's place in the cache folder (VIT_ONNX_CACHE): a file named by a hash of everything
    that decides the graph (the checkpoint's weights and architecture, the input shape, int8 or not, this
    export's format and the versions of torch, onnxscript and ONNX Runtime), written whole, then renamed.
    The cache only ever saves time: a folder that cannot be written, or a file that cannot be loaded, means
    exporting as if there were none."""

    FORMAT = 1  # raise when the export changes what a graph computes for the same inputs

    def __init__(
        self, folder: Path, content_hash: str, config: dict[str, Any], input_shape: tuple[int, int, int], int8: bool
    ) -> None:
        self.folder, self.content_hash, self.config, self.input_shape = folder, content_hash, config, input_shape
        identity = {
            "format": self.FORMAT,
            "checkpoint": content_hash,
            "config": config,
            "input": list(input_shape),
            "int8": int8,
            "versions": {name: version(name) for name in ("torch", "onnxscript", "onnxruntime")},
        }
        key = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:32]
        self.path = folder / f"{'int8' if int8 else 'float32'}-{key}.onnx"

    def float32(self) -> GraphCache:
        """The place of the same checkpoint's float32 graph, which an int8 graph is quantized from."""
        return GraphCache(self.folder, self.content_hash, self.config, self.input_shape, int8=False)

    def load(self) -> Path | None:
        return self.path if self.path.is_file() else None

    def store(self, graph: Path) -> None:
        if any(p.suffix != ".onnx" for p in graph.parent.iterdir()):
            return  # weights stored beside the graph (over protobuf's 2 GB): exported each time
        staged = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(graph, staged)
            staged.replace(self.path)  # a reader never sees half a graph
        except OSError as e:
            log.warning(
                "could not keep the ONNX graph in the cache %s (%s); the next start exports it again",
                self.path.parent,
                e,
            )
            with contextlib.suppress(OSError):
                staged.unlink(missing_ok=True)


def stored_int8(path: Path, content_hash: str, threads: int) -> OnnxForward:
    """The static int8 graph `python -m app.quantize` stored at `path`, once it is shown to be this checkpoint's."""
    forward = OnnxForward(session(path, threads), "static")
    made_for = forward.session.get_modelmeta().custom_metadata_map.get(CHECKPOINT_HASH, "")
    if made_for != content_hash:
        raise ForeignGraph(
            f"{path} was made for another checkpoint (content hash {made_for[:12] or 'none'}, this one "
            f"{content_hash[:12]}): make it again with python -m app.quantize, or remove it to quantize at startup"
        )
    log.info("loaded the static int8 graph %s (%d threads)", path, threads)
    return forward


def session(path: Path, threads: int, fuse: bool = False) -> ort.InferenceSession:
    """An ONNX Runtime session of the graph at `path`; with `fuse`, its plain attention blocks run as ONNX
    Runtime's fused `Attention` operator (`onnx_attention`: the same outputs in less time). The graph on disk is
    left as exported, so the int8 quantizer always reads that."""
    model: str | bytes = str(path)
    if fuse and (fused := attention_fused(path)) is not None:
        model = fused
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    # Idle ORT threads would spin for work, taking CPU from decoding and the event loop.
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.log_severity_level = 3  # errors only
    try:
        return ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
    except Exception as e:  # ORT raises its own exception types, all with a readable message
        raise OnnxExportError(f"ONNX Runtime could not load the graph {path.name}: {e}") from None


def attention_fused(path: Path) -> bytes | None:
    """The graph at `path` with its plain attention blocks fused, serialised; None where it has none, or keeps its
    weights outside the file (a graph over protobuf's 2 GB limit cannot be serialised whole)."""
    try:
        graph = onnx.load(str(path), load_external_data=False)
    except Exception as e:  # a damaged file: ORT's own load reports it
        log.debug("could not read %s to fuse its attention (%s)", path, e)
        return None
    if any(t.data_location == onnx.TensorProto.EXTERNAL for t in graph.graph.initializer):
        return None
    try:
        fused = fuse_attention(graph)
    except Exception as e:  # a form the matcher did not foresee: the graph runs as exported
        log.warning(
            "could not fuse the attention of %s (%s: %s); running it as exported", path.name, type(e).__name__, e
        )
        return None
    if fused == 0:
        return None
    log.info("ran %d attention blocks of %s as ONNX Runtime's fused Attention operator", fused, path.name)
    return graph.SerializeToString()


@contextmanager
def export_folder() -> Iterator[Path]:
    """A temporary directory for graphs on their way to a session (it also takes weights over protobuf's
    2 GB limit as external data); deleted afterwards, so nothing is left for the user to manage."""
    try:
        tmp = tempfile.TemporaryDirectory(prefix="vit-onnx-")
    except OSError as e:  # a read-only filesystem without a writable temporary directory
        raise OnnxExportError(f"no writable temporary directory for the ONNX export ({e}); set TMPDIR") from None
    with tmp:
        yield Path(tmp.name)


def int8_graph_path(checkpoint: Path) -> Path:
    """Where a checkpoint's static int8 graph is stored: beside it, NAME.int8.onnx for NAME.safetensors."""
    return checkpoint.with_name(checkpoint.name.removesuffix(".safetensors") + ".int8.onnx")


def quantize_static_int8(
    model: ViT,
    input_shape: tuple[int, int, int],
    calibration: Iterable[np.ndarray],
    content_hash: str,
    output: Path,
    method: CalibrationMethodName = "minmax",
) -> None:
    """Export `model`, calibrate its activations' int8 ranges on `calibration` batches (float32, B x C x H x W,
    preprocessed), quantize its matrix products to int8 (QDQ, per-channel weights), and
    store the graph at `output`, marked with the checkpoint's content hash."""
    import onnx
    from onnxruntime.quantization import (
        CalibrationDataReader,
        CalibrationMethod,
        QuantFormat,
        QuantType,
        quantize_static,
    )
    from onnxruntime.quantization.shape_inference import quant_pre_process

    class Batches(CalibrationDataReader):
        def __init__(self) -> None:
            self.batches = iter(calibration)

        def get_next(self) -> dict[str, np.ndarray] | None:
            batch = next(self.batches, None)
            return None if batch is None else {INPUT: batch}

    methods = {
        "minmax": CalibrationMethod.MinMax,
        "entropy": CalibrationMethod.Entropy,
        "percentile": CalibrationMethod.Percentile,
    }
    with export_folder() as folder:
        path, prepared, quantized = folder / "model.onnx", folder / "prepared.onnx", folder / "int8.onnx"
        export(LogitsAndEmbedding(model), input_shape, path)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                quant_pre_process(str(path), str(prepared))
                quantize_static(
                    str(prepared),
                    str(quantized),
                    Batches(),
                    quant_format=QuantFormat.QDQ,
                    per_channel=True,
                    activation_type=QuantType.QUInt8,
                    weight_type=QuantType.QInt8,
                    op_types_to_quantize=QUANTIZED_OPS,
                    calibrate_method=methods[method],
                )
        except Exception as e:  # the quantizer raises many types for graphs it cannot handle
            raise OnnxExportError(f"the graph could not be quantized to int8: {type(e).__name__}: {e}") from None
        graph = onnx.load(str(quantized))
        onnx.helper.set_model_props(graph, {CHECKPOINT_HASH: content_hash, "vit_serve.calibration": method})
        staged = output.with_name(f".{output.name}.tmp")
        onnx.save(graph, str(staged))
        staged.replace(output)  # a reader never sees half a graph


def quantize_int8(path: Path) -> Path:
    """The float32 graph at `path` -> an int8 graph beside it: shape inference and graph optimisation first
    (what ONNX Runtime's quantizer asks for), then int8 weights with dynamic int8 activations."""
    from onnxruntime.quantization import QuantType, quantize_dynamic
    from onnxruntime.quantization.shape_inference import quant_pre_process

    prepared, quantized = path.with_name("prepared.onnx"), path.with_name("int8.onnx")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            quant_pre_process(str(path), str(prepared))
            quantize_dynamic(str(prepared), str(quantized), weight_type=QuantType.QInt8)
    except Exception as e:  # the quantizer raises many types for graphs it cannot handle
        raise OnnxExportError(f"the exported graph could not be quantized to int8: {type(e).__name__}: {e}") from None
    return quantized


def export(model: nn.Module, input_shape: tuple[int, int, int], path: Path) -> None:
    """Export `model` (in eval mode, float32) with a dynamic batch dimension to `path`."""
    example = torch.zeros(2, *input_shape)  # 2, not 1: a batch of one would be specialised as a constant
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the exporter warns about internals the user cannot act on
            program = torch.onnx.export(
                model,
                (example,),
                input_names=[INPUT],
                output_names=OUTPUTS,
                dynamic_shapes=({0: torch.export.Dim.DYNAMIC},),
                dynamo=True,
                verbose=False,
            )
    except Exception as e:  # torch.export and the ONNX translation raise many types for unsupported code
        raise OnnxExportError(f"the model could not be exported to ONNX: {type(e).__name__}: {e}") from None
    assert program is not None
    program.save(path)
