"""The checkpoint format: safetensors tensors plus JSON metadata in the same file.

A checkpoint is self-describing: the ViTConfig, class names, preprocessing and a training summary
travel in the safetensors header, with a SHA-256 content hash over the model's tensors. Reference
statistics of its embeddings (model/reference/), when present, are tensors of their own with a hash
of their own, so adding them leaves the model's version as it is. A CLIP or SigLIP model also carries its
text tower (`zero_shot.*` tensors, its tokenizer file among them as bytes, and the `zero_shot` config), inside
the content hash; its class names are then the labels it answers with when a request names none (maybe none).
Loading never unpickles anything;
every way a file can be wrong raises `CheckpointError` naming the file.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import Tensor

from model.preprocessing import Preprocessing
from model.reference import PREFIX as REFERENCE_PREFIX
from model.reference import Reference
from model.version import numeric_version
from model.vit import ViT, ViTConfig
from model.zero_shot import ZeroShot, ZeroShotConfig

FORMAT_NAME = "vit-serve-checkpoint"
FORMAT_VERSION = 1
ZERO_SHOT_PREFIX = "zero_shot."
TOKENIZER_TENSOR = "zero_shot.tokenizer"  # the tokenizer file's bytes, uint8


class CheckpointError(Exception):
    """A checkpoint file is missing, truncated, corrupted or does not match its own config."""

    def __init__(self, path: str | Path, reason: str) -> None:
        self.path = str(path)
        self.reason = reason
        super().__init__(f"checkpoint {self.path}: {reason}")


@dataclass
class Checkpoint:
    model: ViT
    config: ViTConfig
    classes: list[str]
    preprocessing: Preprocessing
    training: dict[str, Any] = field(default_factory=dict)
    content_hash: str = ""
    path: str = ""
    reference: Reference | None = None  # statistics of the embeddings, for out-of-distribution scores
    zero_shot: ZeroShot | None = None  # the text tower of a CLIP or SigLIP model: classes named at request time

    @property
    def version(self) -> str:
        """Short content hash: changes whenever the weights change."""
        return self.content_hash[:12]

    @property
    def identity(self) -> str:
        """The checkpoint named as the service names it: `version 19318223149253, content hash 1191dfd418c5`."""
        return f"version {numeric_version(self.content_hash)}, content hash {self.version}"


def content_hash(tensors: dict[str, Tensor]) -> str:
    """SHA-256 over tensor names, dtypes, shapes and bytes, in name order."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def save_checkpoint(
    path: str | Path,
    model: ViT,
    classes: list[str],
    preprocessing: Preprocessing,
    training: dict[str, Any] | None = None,
    reference: Reference | None = None,
    zero_shot: ZeroShot | None = None,
) -> str:
    """Write model weights, metadata, any text tower and any reference statistics to one safetensors file;
    returns the content hash (of the model's tensors, the text tower's included)."""
    extra: dict[str, str] = {}
    tensors = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    if zero_shot is not None:
        if zero_shot.embed_dim != model.config.num_classes:
            raise ValueError(
                f"a text tower of width {zero_shot.embed_dim} for image embeddings of {model.config.num_classes}"
            )
        tensors |= {ZERO_SHOT_PREFIX + k: v.detach().cpu().contiguous() for k, v in zero_shot.state_dict().items()}
        tensors[TOKENIZER_TENSOR] = torch.frombuffer(bytearray(zero_shot.tokenizer.data), dtype=torch.uint8)
        extra["zero_shot"] = json.dumps(zero_shot.config.to_dict())
    elif len(classes) != model.config.num_classes:
        raise ValueError(f"{len(classes)} class names for a model with {model.config.num_classes} classes")
    digest = content_hash(tensors)
    if reference is not None:
        if zero_shot is not None:
            raise ValueError("reference statistics are per class; a zero-shot model's classes are named per request")
        if reference.means.shape != (model.config.num_classes, model.config.dim):
            raise ValueError(f"reference means {tuple(reference.means.shape)} do not fit the model")
        statistics = {k: v.detach().cpu() for k, v in reference.tensors().items()}
        extra["reference_hash"] = content_hash(statistics)
        tensors |= statistics
    metadata = {
        "format": FORMAT_NAME,
        "format_version": str(FORMAT_VERSION),
        "config": json.dumps(model.config.to_dict()),
        "classes": json.dumps(classes),
        "preprocessing": json.dumps(asdict(preprocessing)),
        "training": json.dumps(training or {}),
        "content_hash": digest,
        **extra,
    }
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata=metadata)
    # safetensors writes owner-only files; a checkpoint is no secret, and a server running as
    # another user (the container's non-root user reading a mounted file) must be able to read it.
    tmp.chmod(0o644)
    tmp.replace(path)  # atomic: a reader never sees a half-written checkpoint
    return digest


def read_checkpoint_file(path: Path) -> tuple[dict[str, Tensor], dict[str, str]]:
    """Tensors and metadata of a safetensors file, or CheckpointError."""
    if path.is_dir():
        raise CheckpointError(path, "a folder, not a checkpoint file: name the .safetensors file in it")
    if not path.is_file():
        raise CheckpointError(path, "file not found")
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            metadata = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not iterable)
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise CheckpointError(path, f"not a readable safetensors file (truncated or corrupted?): {e}") from e
    return tensors, metadata


def parse_metadata(path: Path, metadata: dict[str, str]) -> tuple[ViTConfig, list[str], Preprocessing, dict[str, Any]]:
    if metadata.get("format") != FORMAT_NAME:
        raise CheckpointError(path, f"metadata does not say format={FORMAT_NAME!r}; not a checkpoint of this project")
    if metadata.get("format_version") != str(FORMAT_VERSION):
        raise CheckpointError(
            path, f"format version {metadata.get('format_version')!r} is not supported (expected {FORMAT_VERSION})"
        )
    try:
        config = ViTConfig.from_dict(json.loads(metadata["config"]))
        classes = [str(c) for c in json.loads(metadata["classes"])]
        preprocessing = Preprocessing.from_dict(json.loads(metadata["preprocessing"]))
        training = json.loads(metadata.get("training", "{}"))
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(path, f"invalid metadata: {e}") from e
    if "zero_shot" not in metadata and len(classes) != config.num_classes:
        raise CheckpointError(path, f"{len(classes)} class names but config.num_classes={config.num_classes}")
    if preprocessing.image_size != config.image_size or preprocessing.channels != config.in_channels:
        raise CheckpointError(path, "preprocessing image size/channels disagree with the model config")
    return config, classes, preprocessing, training


def load_checkpoint(path: str | Path, device: str | torch.device = "cpu") -> Checkpoint:
    """Rebuild the model from a checkpoint file, verified against its config and content hash."""
    path = Path(path)
    tensors, metadata = read_checkpoint_file(path)
    config, classes, preprocessing, training = parse_metadata(path, metadata)
    statistics = {k: tensors.pop(k) for k in [k for k in tensors if k.startswith(REFERENCE_PREFIX)]}
    reference = None
    if statistics or "reference_hash" in metadata:
        if content_hash(statistics) != metadata.get("reference_hash"):
            raise CheckpointError(path, "reference statistics hash mismatch: modified or corrupted")
        try:
            reference = Reference.from_tensors(statistics)
        except (KeyError, ValueError, IndexError) as e:
            raise CheckpointError(path, f"invalid reference statistics: {e}") from e
        if reference.means.shape != (config.num_classes, config.dim):
            raise CheckpointError(path, f"reference means {tuple(reference.means.shape)} do not fit the model")
    digest = content_hash(tensors)
    if digest != metadata.get("content_hash"):
        raise CheckpointError(path, "content hash mismatch: the tensors were modified or corrupted")
    zero_shot = load_zero_shot(path, metadata, tensors, config) if "zero_shot" in metadata else None
    model = ViT(config)
    expected = model.state_dict()
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise CheckpointError(
            path, f"tensors do not match the config: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    for name, t in tensors.items():
        if t.shape != expected[name].shape:
            raise CheckpointError(
                path, f"tensor {name} has shape {tuple(t.shape)}, config expects {tuple(expected[name].shape)}"
            )
    model.load_state_dict(tensors)
    model.to(device).eval()
    if zero_shot is not None:
        zero_shot.to(device)
    return Checkpoint(model, config, classes, preprocessing, training, digest, str(path), reference, zero_shot)


def load_zero_shot(path: Path, metadata: dict[str, str], tensors: dict[str, Tensor], config: ViTConfig) -> ZeroShot:
    """The text tower: its tensors are taken out of `tensors`."""
    state = {
        k.removeprefix(ZERO_SHOT_PREFIX): tensors.pop(k) for k in [k for k in tensors if k.startswith(ZERO_SHOT_PREFIX)]
    }
    data = state.pop(TOKENIZER_TENSOR.removeprefix(ZERO_SHOT_PREFIX), None)
    if data is None:
        raise CheckpointError(path, f"a zero-shot model without its tokenizer ({TOKENIZER_TENSOR})")
    try:
        tower = ZeroShot(ZeroShotConfig.from_dict(json.loads(metadata["zero_shot"])), data.numpy().tobytes())
        tower.load_state_dict(state)
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise CheckpointError(path, f"invalid text tower: {first_line(e)}") from e
    if tower.embed_dim != config.num_classes:
        raise CheckpointError(
            path, f"a text tower of width {tower.embed_dim} for image embeddings of {config.num_classes}"
        )
    return tower.eval()


def first_line(e: Exception) -> str:
    return (str(e).strip().splitlines() or [""])[0][:300]
