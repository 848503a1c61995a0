"""The Open Inference Protocol's descriptive bodies: server and model metadata, the repository index, and the
statistics extension's report."""

from __future__ import annotations

from typing import Any

from app import __version__
from app.choices import Datatype
from app.codecs.v2_schemas import (
    ATTENTION,
    EMBEDDING,
    IMAGE,
    OOD_SCORE,
    PIXELS,
    PROBABILITIES,
    TEXT,
    TEXT_EMBEDDING,
    V2BatchStats,
    V2Duration,
    V2InferenceStats,
    V2ModelIndex,
    V2ModelMetadata,
    V2ModelStat,
    V2ServerMetadata,
    V2Statistics,
    V2TensorMetadata,
)
from app.core.contract.description import ModelDescription, ModelStatus
from app.core.contract.errors import InvalidInput
from app.telemetry.statistics import Duration, ModelStatistics

SERVER_NAME = "vit-serve"
EXTENSIONS = [
    "binary_tensor_data",
    "classification",
    "model_configuration",
    "model_repository",
    "statistics",
    "system_shared_memory",
]


def statistics_response(stats: list[ModelStatistics]) -> V2Statistics:
    """Triton's statistics extension's JSON, as tritonclient's get_inference_statistics reads it."""

    def duration(d: Duration) -> V2Duration:
        return V2Duration(count=d.count, ns=d.ns)

    return V2Statistics(
        model_stats=[
            V2ModelStat(
                name=s.name,
                version=s.version,
                last_inference=s.last_inference_ms,
                inference_count=s.inference_count,
                execution_count=s.execution_count,
                inference_stats=V2InferenceStats(
                    success=duration(s.success),
                    fail=duration(s.fail),
                    queue=duration(s.queue),
                    compute_input=duration(s.compute_input),
                    compute_infer=duration(s.compute_infer),
                    compute_output=duration(s.compute_output),
                    cache_hit=duration(s.cache_hit),
                    cache_miss=duration(s.cache_miss),
                ),
                batch_stats=[
                    V2BatchStats(
                        batch_size=b.batch_size,
                        compute_input=duration(b.compute_input),
                        compute_infer=duration(b.compute_infer),
                        compute_output=duration(b.compute_output),
                    )
                    for _, b in sorted(s.batches.items())
                ],
            )
            for s in stats
        ]
    )


def server_metadata(shared_memory: bool) -> V2ServerMetadata:
    """The server's name, version and extensions: system shared memory only where clients may register regions."""
    extensions = [e for e in EXTENSIONS if shared_memory or e != "system_shared_memory"]
    return V2ServerMetadata(name=SERVER_NAME, version=__version__, extensions=extensions)


def platform(model: ModelDescription) -> str:
    """Triton's name for what computes the model: pytorch, or onnxruntime_onnx on the ONNX Runtime backends."""
    return "pytorch" if model.backend == "torch" else "onnxruntime_onnx"


def listed_outputs(model: ModelDescription, all_outputs: bool = True) -> tuple[str, ...]:
    """The outputs a model's metadata and configuration list, and a request may name: probabilities; with
    `all_outputs` (VIT_V2_OUTPUTS=all) also attention and embedding, and ood_score where the checkpoint has
    reference statistics, and text_embedding for a zero-shot model."""
    if not all_outputs:
        return (PROBABILITIES,)
    extra = (OOD_SCORE,) if model.reference else (TEXT_EMBEDDING,) if model.zero_shot else ()
    return (PROBABILITIES, ATTENTION, EMBEDDING, *extra)


def every_output(listed: tuple[str, ...]) -> bool:
    """Whether the server lists every output (VIT_V2_OUTPUTS=all), from what it lists for a model."""
    return ATTENTION in listed


def model_metadata(model: ModelDescription, takes_pixels: bool = True, all_outputs: bool = True) -> V2ModelMetadata:
    """A model's version, inputs (image, or pixels where they are taken) and outputs (`listed_outputs`)."""
    c, h, w = model.input_shape
    grid = model.grid_size
    shapes = {
        PROBABILITIES: [-1, -1 if model.zero_shot else len(model.classes)],  # zero-shot: the labels named
        ATTENTION: [-1, grid, grid],
        EMBEDDING: [-1, model.embedding_dim],
        OOD_SCORE: [-1],
        TEXT_EMBEDDING: [-1, model.embedding_dim],
    }
    return V2ModelMetadata(
        name=model.name,
        versions=[model.version],
        platform=platform(model),
        parameters={
            "content_hash": model.content_hash,
            "backend": model.backend,
            "precision": model.precision,
            **({"quantization": model.quantization} if model.quantization else {}),
        },
        inputs=[
            V2TensorMetadata(name=IMAGE, datatype=Datatype.BYTES, shape=[-1, 1]),
            *([V2TensorMetadata(name=PIXELS, datatype=Datatype.FP32, shape=[-1, c, h, w])] if takes_pixels else []),
            *([V2TensorMetadata(name=TEXT, datatype=Datatype.BYTES, shape=[-1])] if model.zero_shot else []),
        ],
        outputs=[
            V2TensorMetadata(name=name, datatype=Datatype.FP32, shape=shapes[name])
            for name in listed_outputs(model, all_outputs)
        ],
    )


def repository_index(statuses: list[ModelStatus]) -> list[V2ModelIndex]:
    return [V2ModelIndex(name=s.name, version=s.version, state=s.state, reason=s.reason) for s in statuses]


def check_load_parameters(parameters: dict[str, Any] | None) -> None:
    """Triton's load takes a config override and model files; here a model is its checkpoint in the repository."""
    for key in parameters or {}:
        if key == "config" or key.startswith("file:"):
            raise InvalidInput(
                f"load parameter {key!r} is not taken: a model is loaded from its checkpoint in VIT_MODEL_REPOSITORY "
                "as it is; replace the file to change it"
            )
