"""The Open Inference Protocol's answer to an inference request: its output tensors, as JSON or in the binary
extension's layout, or written into the client's shared-memory regions."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from app.choices import Datatype
from app.codecs.v2_requests import Decoded
from app.codecs.v2_schemas import (
    ATTENTION,
    EMBEDDING,
    OOD_SCORE,
    PROBABILITIES,
    SHM_BYTE_SIZE,
    SHM_OFFSET,
    SHM_REGION,
    TEXT_EMBEDDING,
    OutputWanted,
)
from app.core.contract.description import ModelDescription
from app.core.contract.regions import SharedMemoryRegions
from app.core.contract.request import (
    Prediction,
)


@dataclass(frozen=True)
class Encoded:
    body: bytes
    header_length: int | None  # set when binary outputs follow the JSON


@dataclass(frozen=True)
class OutputTensor:
    name: str
    datatype: Datatype
    shape: list[int]
    values: np.ndarray | list[str]  # flat, row-major
    parameters: dict[str, Any]  # as requested for this output

    def raw(self) -> bytes:
        return to_bytes(self.datatype, self.values)

    def in_shared_memory(self) -> bool:
        return SHM_REGION in self.parameters

    def write_to_region(self, regions: SharedMemoryRegions | None) -> None:
        """Write the output's bytes (the binary layout) into the region its parameters name. Its entry in the
        response then has a name, datatype and shape and nothing else, as Triton answers it (Triton's own
        C++ client reads any output `parameters` as binary data that follows the JSON)."""
        if regions is None:
            raise AssertionError("an output in shared memory needs the request's regions")
        params = self.parameters
        regions.write(
            params[SHM_REGION], params.get(SHM_OFFSET, 0), params[SHM_BYTE_SIZE], self.raw(), f"output {self.name!r}"
        )


def output_tensors(
    decoded: Decoded, predictions: list[Prediction], classes: list[str], text_embeddings: torch.Tensor | None = None
) -> list[OutputTensor]:
    """The outputs requested, in their order, any transport; with none named, probabilities and each output
    whose parameter asked for it (text_embedding for texts). Every output named was computed (`decode_infer`
    asks for it)."""
    request = decoded.request
    if text_embeddings is not None:
        wanted_texts = request.outputs or [OutputWanted(name=TEXT_EMBEDDING)]
        values = text_embeddings.float()
        return [
            OutputTensor(
                TEXT_EMBEDDING, Datatype.FP32, list(values.shape), values.flatten().numpy(), o.parameters or {}
            )
            for o in wanted_texts
        ]
    computed = {
        PROBABILITIES: True,
        ATTENTION: decoded.options.attention != "none",
        EMBEDDING: decoded.options.embedding,
        OOD_SCORE: decoded.options.ood,
    }
    wanted = request.outputs or [OutputWanted(name=name) for name, done in computed.items() if done]
    tensors = []
    for output in wanted:
        params = output.parameters or {}
        tensors.append(OutputTensor(*output_tensor(output.name, params, predictions, classes), params))
    return tensors


def encode_response(
    decoded: Decoded,
    predictions: list[Prediction],
    model: ModelDescription,
    classes: list[str] | None = None,
    text_embeddings: torch.Tensor | None = None,
) -> Encoded:
    """The REST infer response: JSON, each output in it or (binary_data) after it; `classes`, a zero-shot
    request's labels, name the classification results (default: the model's classes)."""
    request = decoded.request
    binary_default = bool((request.parameters or {}).get("binary_data_output", False))
    tensors: list[dict[str, Any]] = []
    binaries: list[bytes] = []
    for t in output_tensors(decoded, predictions, model.classes if classes is None else classes, text_embeddings):
        if t.in_shared_memory():
            t.write_to_region(decoded.regions)
            tensors.append({"name": t.name, "datatype": t.datatype, "shape": t.shape})
        elif t.parameters.get("binary_data", binary_default):
            raw = t.raw()
            described = {"binary_data_size": len(raw)}
            tensors.append({"name": t.name, "datatype": t.datatype, "shape": t.shape, "parameters": described})
            binaries.append(raw)
        else:
            data = t.values.tolist() if isinstance(t.values, np.ndarray) else t.values
            tensors.append({"name": t.name, "datatype": t.datatype, "shape": t.shape, "data": data})
    response: dict[str, Any] = {"model_name": model.name, "model_version": model.version, "outputs": tensors}
    if request.id is not None:
        response["id"] = request.id
    if how := answer_parameters(decoded, model):
        response["parameters"] = how
    header = json.dumps(response, separators=(",", ":")).encode()
    if not binaries:
        return Encoded(header, None)
    return Encoded(header + b"".join(binaries), len(header))


def answer_parameters(decoded: Decoded, model: ModelDescription) -> dict[str, str]:
    """How a zero-shot model's probabilities were computed, for the response's parameters: its rule, and the
    template the labels were set in; the head taught by example that answered, where one did; nothing for a
    classifier's own classes or a request of texts."""
    if decoded.options.head is not None:
        return {"head": decoded.options.head}
    if model.zero_shot is None or decoded.texts is not None or model.template is None:
        return {}
    return {"zero_shot_rule": model.zero_shot, "zero_shot_template": decoded.options.template or model.template}


def output_tensor(
    name: str, params: dict[str, Any], predictions: list[Prediction], classes: list[str]
) -> tuple[str, Datatype, list[int], np.ndarray | list[str]]:
    """(name, datatype, shape, flat row-major values) of one output."""
    n = len(predictions)
    if name == PROBABILITIES:
        probs = torch.stack([p.probabilities for p in predictions])  # (N, classes)
        k = params.get("classification", 0)
        if k:  # checked by check_outputs
            k = min(k, len(classes))
            values, indices = probs.topk(k, dim=1)
            labels = [
                f"{v:f}:{i}:{classes[i]}"
                for row_v, row_i in zip(values.tolist(), indices.tolist(), strict=True)
                for v, i in zip(row_v, row_i, strict=True)
            ]
            return name, Datatype.BYTES, [n, k], labels
        return name, Datatype.FP32, list(probs.shape), probs.flatten().numpy()
    if name == ATTENTION:
        maps = torch.stack([p.attention_map for p in predictions if p.attention_map is not None])  # (N, g, g)
        return name, Datatype.FP32, list(maps.shape), maps.float().flatten().numpy()
    if name == EMBEDDING:
        embeddings = torch.stack([p.embedding for p in predictions if p.embedding is not None])  # (N, D)
        return name, Datatype.FP32, list(embeddings.shape), embeddings.float().flatten().numpy()
    if name == OOD_SCORE:
        return name, Datatype.FP32, [n], np.array([p.ood_score for p in predictions], dtype=np.float32)
    raise AssertionError(f"unchecked output {name!r}")


def to_bytes(datatype: Datatype, values: np.ndarray | list[str]) -> bytes:
    if isinstance(values, np.ndarray):
        return values.astype("<f4").tobytes()
    return b"".join(len(b).to_bytes(4, "little") + b for b in (v.encode() for v in values))
