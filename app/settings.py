"""Runtime settings, read from `VIT_*` environment variables (or an `.env` file) and validated at startup."""

from __future__ import annotations

import difflib
import math
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Literal, NamedTuple

from dotenv import dotenv_values
from pydantic import Field, SecretStr, ValidationInfo, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from app.choices import BackendChoice, DecodeChoice, LogFormat, LogLevel, ModelControl, V2OutputsChoice

BUNDLED_WEIGHTS = Path(__file__).resolve().parent.parent / "weights" / "vit-shapes.safetensors"
MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def is_model_name(name: str) -> bool:
    """A name, never a path: letters, digits, '.', '_', '-' (at most 64), not starting with a dot, no '..'."""
    return MODEL_NAME.fullmatch(name) is not None and ".." not in name


# VIT_WORKERS=auto on a GPU host: front-ends, leaving two cores to the engine process (and fewer where the
# host has fewer cores). Eight is what served best on a 16-core GPU host, measured with python -m bench.gpu
# served (the figures: docs/deployment.md#serving-processes).
AUTO_WORKERS_ON_GPU = 8
DEFAULT_ONNX_CACHE = Path("~/.cache/vit-serve/onnx")  # under $XDG_CACHE_HOME when that is set
DEFAULT_HUB_CACHE = Path("~/.cache/vit-serve/converted")  # likewise
HUBS = ("timm", "hf")


class HubName(NamedTuple):
    """A model named on a hub in VIT_MODELS (`timm:<model name>` or `hf:<repo id>`), converted at startup."""

    hub: str
    id: str

    def __str__(self) -> str:
        return f"{self.hub}:{self.id}"

    @classmethod
    def parse(cls, text: str) -> HubName | None:
        hub, sep, ident = text.partition(":")
        return cls(hub, ident.strip()) if sep and hub in HUBS and ident.strip() else None

    def default_name(self) -> str:
        """The model's name when the entry gives none: the id's last part."""
        return self.id.rsplit("/", 1)[-1][:64]


def parse_thresholds(text: str) -> dict[str, float]:
    """VIT_OOD_THRESHOLD: `4.5` (every model, kept under "*") or `name=4.5,other=6`; ValueError otherwise."""
    out: dict[str, float] = {}
    for part in (p.strip() for p in text.split(",")):
        name, _, value = part.rpartition("=")
        try:
            number = float(value)
        except ValueError:
            raise ValueError(f"VIT_OOD_THRESHOLD: {part!r} is not a number or name=number") from None
        if not math.isfinite(number) or number < 0:
            raise ValueError(f"VIT_OOD_THRESHOLD: {part!r}: a threshold is a non-negative number")
        out[name.strip() or "*"] = number
    return out


def parse_shadow(text: str) -> list[tuple[str, str, float]]:
    """VIT_SHADOW: `champion:challenger[:fraction]`, comma-separated; ValueError otherwise."""
    pairs: list[tuple[str, str, float]] = []
    for part in (p.strip() for p in text.split(",")):
        fields = part.split(":")
        if len(fields) not in (2, 3) or not all(f.strip() for f in fields[:2]):
            raise ValueError(f"VIT_SHADOW: {part!r} is not champion:challenger or champion:challenger:fraction")
        champion, challenger = fields[0].strip(), fields[1].strip()
        try:
            fraction = float(fields[2]) if len(fields) == 3 else 1.0
        except ValueError:
            raise ValueError(f"VIT_SHADOW: {part!r}: the fraction must be a number from 0 to 1") from None
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"VIT_SHADOW: {part!r}: the fraction must be from 0 to 1")
        if champion == challenger:
            raise ValueError(f"VIT_SHADOW: {part!r}: a model cannot shadow itself")
        if champion in (c for c, _, _ in pairs):
            raise ValueError(f"VIT_SHADOW: {champion!r} has more than one challenger")
        pairs.append((champion, challenger, fraction))
    return pairs


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="VIT_", env_file=".env", extra="ignore")

    weights: Path = Field(BUNDLED_WEIGHTS, description="Checkpoint to serve; its name is the file's stem")
    models: str | None = Field(
        None,
        description="Several checkpoints: name=path,name=path (the first is the default); when set, VIT_WEIGHTS is not used. "
        "With VIT_MODEL_REPOSITORY: names of its models, loaded first (explicit: the only ones loaded at startup)",
    )
    model_repository: Path | None = Field(
        None, description="A directory of checkpoints, each a model named by its file (NAME.safetensors)"
    )
    model_control: ModelControl = Field(
        "none",
        description="none: every model loaded at startup, fixed; explicit: VIT_MODELS at startup, then loaded and "
        "unloaded through the repository API; poll: the repository's files followed as they appear, change and go",
    )
    repository_poll_s: float = Field(5.0, gt=0, description="With VIT_MODEL_CONTROL=poll: seconds between scans")
    device: str = Field("auto", description="auto, cpu, cuda or cuda:N")
    backend: BackendChoice = Field(
        "auto",
        description="What computes probabilities: onnxruntime (a graph exported at startup; CPU only), "
        "onnxruntime-int8 (that graph quantized to int8; faster, slightly different results), torch, "
        "or auto (onnxruntime on the CPU, torch on a GPU); attention maps always use torch",
    )
    hub_cache: Path | None = Field(
        DEFAULT_HUB_CACHE,
        validate_default=True,
        description="A directory where models named by hub in VIT_MODELS (timm:NAME, hf:REPO) are kept once "
        "converted, one per hub revision, so a restart converts nothing; empty turns it off",
    )
    onnx_cache: Path | None = Field(
        DEFAULT_ONNX_CACHE,
        validate_default=True,
        description="A directory where the ONNX backends keep the graphs they export (and quantize), one per "
        "checkpoint content, settings and library versions, so a restart or reload of the same file skips "
        "the export; empty turns it off",
    )
    decode: DecodeChoice = Field(
        "auto",
        description="auto: on a GPU, plain JPEGs are decoded and resized there, a batch at a time (the CUDA "
        "decoder, torchvision's nvJPEG); nvimgcodec: the same with nvImageCodec, the GPU's hardware JPEG engines "
        "first and its CUDA decoder for the rest; dali: the same with DALI's mixed decoder (the [dali] extra; "
        "not measured on a GPU yet); cpu: every image is decoded on the CPU",
    )
    hw_decoder_load: float = Field(
        1.0,
        gt=0,
        le=1,
        description="With VIT_DECODE=nvimgcodec or dali: the share of each batch's plain JPEGs given to the GPU's hardware "
        "JPEG engines, the rest to its CUDA decoder (DALI's hw_decoder_load). 1: the engines take every file they "
        "can, the CUDA decoder what they leave",
    )
    cpu_decode_share: float | Literal["auto"] = Field(
        "auto",
        description="With JPEGs decoded on the GPU: the share of plain JPEGs that the serving processes decode on "
        "their CPU pools instead (with VIT_WORKERS, in the front-ends), every file in turn (1 in 4 at 0.25), to take "
        "decoding off the SMs where the host has cores to spare. auto: the engine moves it, per model, to where the "
        "GPU and the host's cores run out together, from what its batches measure (the vit_cpu_decode_share gauge, "
        "a log line at each move); a number fixes it; 0: the GPU decodes every plain JPEG",
    )
    cpu_decode_share_start: float = Field(
        0.0,
        ge=0,
        le=1,
        description="With VIT_CPU_DECODE_SHARE=auto: the share it starts from (a share an earlier run settled on "
        "gets there sooner)",
    )
    jpeg_draft: bool = Field(
        True,
        description="On the CPU, a JPEG whose shorter side is at least twice the checkpoint's resize size is "
        "decoded at 1/2, 1/4 or 1/8 scale by libjpeg (the smallest still at least that size) before the resize; "
        "false: every image is decoded in full",
    )
    cuda_graphs: bool = Field(
        True,
        description="On a GPU with the torch backend, replay plain predictions from CUDA graphs captured at startup "
        "(one per batch size; attention maps run eagerly)",
    )
    max_batch_size: int = Field(32, ge=1, le=1024, description="Most images in one forward pass")
    preferred_batch_size: int | Literal["auto"] = Field(
        "auto",
        description="The batch the batcher fills to, at most VIT_MAX_BATCH_SIZE. auto: on the CPU, for a model whose "
        "forward of one image takes 20 ms or more, the size that serves the most images a second when the warm-up "
        "times each power of two (the largest within 5 % of the best: one thread computes ViT-S/16's batch of 8 "
        "faster per image than one of 32); else VIT_MAX_BATCH_SIZE. The vit_preferred_batch_size gauge says which. "
        "A number fixes it",
    )
    max_wait_ms: float = Field(5.0, ge=0, le=1000, description="Longest wait after the first image to fill a batch")
    max_queue: int = Field(256, ge=1, description="Images waiting for a batch before new requests get 503")
    request_timeout_s: float = Field(30.0, gt=0, description="Requests not answered by then get 504")
    max_upload_bytes: int = Field(10 * 1024 * 1024, ge=1, description="Largest request body accepted")
    max_image_pixels: int = Field(40_000_000, ge=1, description="Largest decoded image (width x height)")
    max_files: int = Field(16, ge=1, description="Most images in one request")
    teach_max_examples: int = Field(
        1000,
        ge=0,
        description="Most example images one head is taught from over the API (POST /v1/models/{name}/heads/{head}); "
        "0: teaching over the API is off",
    )
    teach_max_bytes: int = Field(
        256 * 1024 * 1024, ge=1, description="Largest request body that teaches a head (its example images together)"
    )
    v2_pixels: bool = Field(
        True,
        description="V2 takes preprocessed pixels (the FP32 input `pixels`) as well as image files; false: only "
        "`image`, which the metadata and configuration then list alone",
    )
    v2_outputs: V2OutputsChoice = Field(
        "all",
        description="The outputs V2's metadata and configuration list and a request may ask for: all "
        "(probabilities, attention, embedding, and ood_score for models with reference statistics), or "
        "probabilities alone, so that a tool that asks for every output listed (perf_analyzer) measures a plain "
        "classification",
    )
    shared_memory_regions: int = Field(
        64,
        ge=0,
        description="Most system shared-memory regions clients may register at once (V2's shared-memory "
        "extension; 0: off)",
    )
    ood_threshold: str | None = Field(
        None,
        description='Out-of-distribution scores above this are flagged ("ood": true) where clients ask for scores: '
        "a number for every model, or name=number,name=number; unset: scores only, no flag",
    )
    drift_window: int = Field(
        1000,
        ge=0,
        description="Images per model the drift gauges (vit_drift_score) are taken over, for models with reference "
        "statistics (0: off)",
    )
    shadow: str | None = Field(
        None,
        description="Shadow challengers: champion:challenger[:fraction],... of served models; that fraction (default "
        "1.0) of the champion's images is also computed by the challenger after the champion answers, and compared",
    )
    warmup: bool = Field(True, description="Run each batch size once before reporting ready")
    cache_bytes: int = Field(
        0,
        ge=0,
        description="Response cache: up to this many bytes of predictions, each kept by model version, image "
        "content and options, least recently used evicted (0: off)",
    )
    text_cache_labels: int = Field(
        20_000,
        ge=1,
        description="Zero-shot models (CLIP, SigLIP): label embeddings kept per model version, by template and "
        "label, least recently used evicted; a request whose labels are all kept runs no text pass",
    )
    drain_timeout_s: float = Field(
        30.0,
        ge=0,
        description="On shutdown, how long HTTP and gRPC (together) and then the engine may answer what they accepted",
    )
    api_keys: SecretStr | None = Field(
        None, description="Comma-separated keys; when set, inference and model loading need X-API-Key"
    )
    grpc_port: int = Field(8001, ge=0, le=65535, description="Port of the Open Inference Protocol over gRPC (0: off)")
    grpc_max_message_bytes: int | None = Field(
        None, ge=1, description="Largest gRPC request message (default: VIT_MAX_UPLOAD_BYTES)"
    )
    threads: int = Field(0, ge=0, description="torch CPU threads (0: torch's default)")
    workers: str = Field(
        "auto",
        description="Serving processes: 1 serves from this one process; N > 1 runs N front-end processes "
        "(HTTP and gRPC on the same ports, all per-request work) over one engine process (the models, "
        "batching and the forward); auto: 1 without a GPU, on a GPU the number in docs/deployment.md",
    )
    log_level: LogLevel = Field("info", description="Log level of the app's loggers")
    log_format: LogFormat = Field(
        "text",
        description="text: one readable line per record; json: one JSON object per line (timestamp, level, "
        "logger, message, and request_id on a request's lines), uvicorn's lines too",
    )

    @field_validator("workers")
    @classmethod
    def check_workers(cls, v: str) -> str:
        v = v.strip().lower()
        if v != "auto" and not (v.isdigit() and 1 <= int(v) <= 64):
            raise ValueError(f"VIT_WORKERS must be auto or a number of processes from 1 to 64, got {v!r}")
        return v

    @field_validator("api_keys")
    @classmethod
    def check_api_keys(cls, v: SecretStr | None) -> SecretStr | None:
        """Empty (as compose passes it unset) turns keys off; commas with no key between them are a mistake that
        would leave the service open, and are refused (without saying the value: it is a secret)."""
        given = v.get_secret_value() if v is not None else ""
        if given.strip() and not any(k.strip() for k in given.split(",")):
            raise ValueError(
                "VIT_API_KEYS holds no key, only commas: give the keys (key1,key2), or leave it unset or empty to "
                "turn keys off"
            )
        return v

    @field_validator("cpu_decode_share", mode="before")
    @classmethod
    def check_cpu_decode_share(cls, v: object) -> float | str:
        if isinstance(v, str) and v.strip().lower() == "auto":
            return "auto"
        try:
            share = float(v)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            share = math.nan
        if not 0 <= share <= 1:
            raise ValueError(f"VIT_CPU_DECODE_SHARE must be auto or a share from 0 to 1, got {v!r}")
        return share

    @field_validator("preferred_batch_size", mode="before")
    @classmethod
    def check_preferred_batch_size(cls, v: object) -> int | str:
        if isinstance(v, str) and v.strip().lower() == "auto":
            return "auto"
        try:
            size = int(v)  # type: ignore[call-overload]
        except (TypeError, ValueError):
            size = 0
        if size < 1:
            raise ValueError(f"VIT_PREFERRED_BATCH_SIZE must be auto or a whole number from 1, got {v!r}")
        return size

    @model_validator(mode="after")
    def check_preferred_within_max(self) -> Settings:
        if isinstance(self.preferred_batch_size, int) and self.preferred_batch_size > self.max_batch_size:
            raise ValueError(
                f"VIT_PREFERRED_BATCH_SIZE ({self.preferred_batch_size}) must be at most VIT_MAX_BATCH_SIZE "
                f"({self.max_batch_size})"
            )
        return self

    @field_validator("device")
    @classmethod
    def check_device(cls, v: str) -> str:
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", v):
            raise ValueError(f"VIT_DEVICE must be auto, cpu, cuda or cuda:N, got {v!r}")
        return v

    @model_validator(mode="after")
    def check_queue(self) -> Settings:
        if self.max_queue < self.max_files:
            raise ValueError(
                f"VIT_MAX_QUEUE ({self.max_queue}) must be at least VIT_MAX_FILES ({self.max_files}), "
                "or a full-size request could never be accepted"
            )
        return self

    @field_validator("ood_threshold", "shadow")
    @classmethod
    def check_pairs(cls, v: str | None, info: ValidationInfo) -> str | None:
        """VIT_OOD_THRESHOLD's and VIT_SHADOW's lists parsed once at startup; empty is unset."""
        if v is None or not v.strip():
            return None
        (parse_thresholds if info.field_name == "ood_threshold" else parse_shadow)(v)
        return v

    def shadow_pairs(self) -> list[tuple[str, str, float]]:
        """VIT_SHADOW as (champion, challenger, fraction) triples."""
        return parse_shadow(self.shadow) if self.shadow else []

    def ood_threshold_for(self, model: str) -> float | None:
        """The out-of-distribution threshold of one model, or None (no flag)."""
        if self.ood_threshold is None:
            return None
        thresholds = parse_thresholds(self.ood_threshold)
        return thresholds.get(model, thresholds.get("*"))

    @field_validator("models")
    @classmethod
    def empty_models_means_unset(cls, v: str | None) -> str | None:
        return v if v and v.strip() else None  # compose passes VIT_MODELS= when it is not set

    @field_validator("model_repository", "grpc_max_message_bytes", "onnx_cache", "hub_cache", mode="before")
    @classmethod
    def empty_means_unset(cls, v: object) -> object:
        return None if isinstance(v, str) and not v.strip() else v  # compose passes VIT_X= when it is not set

    @field_validator("onnx_cache", "hub_cache")
    @classmethod
    def expand_cache(cls, v: Path | None) -> Path | None:
        if v in (DEFAULT_ONNX_CACHE, DEFAULT_HUB_CACHE) and os.environ.get("XDG_CACHE_HOME"):
            return Path(os.environ["XDG_CACHE_HOME"]) / "vit-serve" / v.name
        try:
            return None if v is None else v.expanduser()
        except RuntimeError:  # `~` for a user with no home directory: no cache
            return None

    @model_validator(mode="after")
    def check_models(self) -> Settings:
        if self.model_repository is None:  # a malformed list fails at startup, with what to fix
            self.model_paths()
        else:
            self.model_names()
        return self

    @model_validator(mode="after")
    def check_control(self) -> Settings:
        if self.model_control != "none" and self.model_repository is None:
            raise ValueError(
                f"VIT_MODEL_CONTROL={self.model_control} needs VIT_MODEL_REPOSITORY, the directory of models"
            )
        if self.model_repository is not None and not self.model_repository.is_dir():
            raise ValueError(f"VIT_MODEL_REPOSITORY {self.model_repository} is not a directory")
        return self

    def serving_workers(self, gpu: bool) -> int:
        """The front-end processes to run: VIT_WORKERS, with auto resolved for a host with or without a GPU."""
        if self.workers != "auto":
            return int(self.workers)
        if not gpu:
            return 1
        return max(2, min(AUTO_WORKERS_ON_GPU, available_cpus() - 2))

    def grpc_message_limit(self) -> int:
        return self.grpc_max_message_bytes or self.max_upload_bytes

    def model_names(self) -> list[str]:
        """With a repository: the models VIT_MODELS names, in its order."""
        names = [e.strip() for e in (self.models or "").split(",") if e.strip()]
        for name in names:
            if not is_model_name(name):
                raise ValueError(
                    f"VIT_MODELS entry {name!r}: with VIT_MODEL_REPOSITORY, list model names (files in the repository)"
                )
        if len(set(names)) != len(names):
            raise ValueError("VIT_MODELS names a model twice")
        return names

    def model_paths(self) -> dict[str, Path | HubName]:
        """Model name -> checkpoint, or a model on a hub to convert, in VIT_MODELS order (the first is the
        default); not used with a repository. An entry is name=path, name=timm:NAME or name=hf:REPO, or a hub
        name alone (named after its last part)."""
        if self.model_repository is not None:
            return {}
        if self.models is None:
            return {self.weights.stem: self.weights}
        paths: dict[str, Path | HubName] = {}
        for entry in (e.strip() for e in self.models.split(",")):
            alone = HubName.parse(entry)
            name, sep, path = (alone.default_name(), "=", entry) if alone else entry.partition("=")
            name, path = name.strip(), path.strip()
            if not sep or not path or not MODEL_NAME.fullmatch(name):
                raise ValueError(
                    f"VIT_MODELS entry {entry!r} is not name=path, name=timm:NAME, name=hf:REPO or a hub name "
                    "(names: letters, digits, '.', '_', '-')"
                )
            if name in paths:
                raise ValueError(f"VIT_MODELS names {name!r} twice")
            paths[name] = HubName.parse(path) or Path(path)
        return paths

    def time_limit(self, timeout_s: float | None) -> float:
        """VIT_REQUEST_TIMEOUT_S, shortened to `timeout_s` (a gRPC client's deadline) where one is given."""
        return self.request_timeout_s if timeout_s is None else min(timeout_s, self.request_timeout_s)

    def api_key_set(self) -> frozenset[str]:
        if self.api_keys is None:
            return frozenset()
        return frozenset(k.strip() for k in self.api_keys.get_secret_value().split(",") if k.strip())


def available_cpus(cgroup: Path = Path("/sys/fs/cgroup/cpu.max")) -> int:
    """The cores this process may use: its affinity, capped by a container's CPU limit (cgroup v2)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    try:
        quota, period = cgroup.read_text().split()
    except (OSError, ValueError):
        return cpus
    if quota == "max":
        return cpus
    return max(1, min(cpus, -(-int(quota) // int(period))))


# Read by docker compose when it starts the container, never by the service.
COMPOSE_VARIABLES = frozenset({"VIT_PORT", "VIT_GRPC_HOST_PORT", "VIT_MODELS_DIR"})
# What Kubernetes injects for a Service named vit-... (vit-serve: VIT_SERVE_SERVICE_HOST, VIT_SERVE_PORT, ...).
SERVICE_LINK = re.compile(r"VIT_\w+?_(SERVICE_HOST|SERVICE_PORT(_\w+)?|PORT(_\d+_(TCP|UDP|SCTP)(_\w+)?)?)")


def configured_names(env_file: Path = Path(".env")) -> set[str]:
    """Every variable name settings are read from: the environment and the .env file."""
    names = set(os.environ)
    if env_file.is_file():
        names |= set(dotenv_values(env_file))
    return names


def unknown_variables(names: Mapping[str, object] | set[str]) -> list[str]:
    """One message per VIT_ name that is no setting (a typo would otherwise be ignored), with the closest setting."""
    known = sorted(f"VIT_{field.upper()}" for field in Settings.model_fields)
    messages = []
    for name in sorted(n for n in names if n.upper().startswith("VIT_")):
        upper = name.upper()
        if upper in known or upper in COMPOSE_VARIABLES or SERVICE_LINK.fullmatch(upper):
            continue
        close = difflib.get_close_matches(upper, known, n=1, cutoff=0.6)
        hint = f"; did you mean {close[0]}?" if close else f"; the settings are {', '.join(known)}"
        messages.append(f"{name} is not a setting and is ignored{hint}")
    return messages
