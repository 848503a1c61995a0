"""The ONNX Runtime backend: the model's logits and embeddings from an ONNX graph exported at startup.

Nothing is left on disk for the user to manage: the graph is exported from the checkpoint's model
into a temporary directory (which also takes weights over protobuf's 2 GB limit as external data),
loaded by ONNX Runtime's CPU execution provider, and the directory is deleted. One `session.run`
covers the whole batch with the GIL released, where eager torch re-takes it between operators.
"""

from __future__ import annotations

import logging
import tempfile
import time
import warnings
from pathlib import Path

import onnxruntime as ort
import torch
from torch import Tensor, nn

from model.vit import ViT

log = logging.getLogger("app.inference")

INPUT = "pixels"
OUTPUTS = ["logits", "embedding"]


class OnnxExportError(ValueError):
    """The model could not be exported to ONNX or loaded by ONNX Runtime."""


class LogitsAndEmbedding(nn.Module):
    """What the graph computes: a ViT's logits and the embedding its head receives, from one pass."""

    def __init__(self, model: ViT) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        logits, embedding, _ = self.model.forward_with_embedding(x)
        return logits, embedding


class OnnxForward:
    """`logits, embedding = OnnxForward(model, (C, H, W), threads)(pixels)`: float32 (B, C, H, W) ->
    (B, classes) and (B, dim) on the CPU. With `int8`, the graph's weights are quantized to int8 and its
    matrix products run on int8 activations quantized per batch (ONNX Runtime's dynamic quantization)."""

    def __init__(self, model: ViT, input_shape: tuple[int, int, int], threads: int, int8: bool = False) -> None:
        started = time.perf_counter()
        try:
            tmp = tempfile.TemporaryDirectory(prefix="vit-onnx-")
        except OSError as e:  # a read-only filesystem without a writable temporary directory
            raise OnnxExportError(f"no writable temporary directory for the ONNX export ({e}); set TMPDIR") from None
        with tmp:
            path = Path(tmp.name) / "model.onnx"
            export(LogitsAndEmbedding(model), input_shape, path)
            if int8:
                path = quantize_int8(path)
            options = ort.SessionOptions()
            options.intra_op_num_threads = threads
            options.inter_op_num_threads = 1
            # Idle ORT threads would spin for work, taking CPU from decoding and the event loop.
            options.add_session_config_entry("session.intra_op.allow_spinning", "0")
            options.log_severity_level = 3  # errors only
            try:
                self.session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
            except Exception as e:  # ORT raises its own exception types, all with a readable message
                raise OnnxExportError(f"ONNX Runtime could not load the exported graph: {e}") from None
        log.info("exported the model to ONNX%s and built an ORT session (%d threads) in %.1fs",
                 " (int8)" if int8 else "", threads, time.perf_counter() - started)  # fmt: skip

    def __call__(self, pixels: Tensor) -> tuple[Tensor, Tensor]:
        logits, embedding = self.session.run(OUTPUTS, {INPUT: pixels.contiguous().numpy()})
        return torch.from_numpy(logits), torch.from_numpy(embedding)


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
                model, (example,), input_names=[INPUT], output_names=OUTPUTS,
                dynamic_shapes=({0: torch.export.Dim.DYNAMIC},), dynamo=True, verbose=False,
            )  # fmt: skip
    except Exception as e:  # torch.export and the ONNX translation raise many types for unsupported code
        raise OnnxExportError(f"the model could not be exported to ONNX: {type(e).__name__}: {e}") from None
    assert program is not None
    program.save(path)
