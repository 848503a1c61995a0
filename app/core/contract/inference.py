"""What an edge hands the data plane (`app.core.data_plane.DataPlane`) and what it gets back: one request and
its answer, and the limits and batching the edges describe."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from app.core.contract.description import ModelDescription
from app.core.contract.request import DecodedImage, EncodedImage, InferOptions, Prediction


@dataclass(frozen=True)
class InferenceRequest:
    """One request for the core: the model the edge looked up (`DataPlane.describe`, which it needs anyway, to
    decode the request or to refuse it before reading its body), the images (files as sent, or decoded by a
    front-end) or pixels (N, C, H, W), the options. Built whole: its labels, template and texts are checked
    against that model here, once (InvalidInput)."""

    model: ModelDescription
    inputs: Sequence[EncodedImage | DecodedImage] | torch.Tensor
    options: InferOptions
    version: str | None = None  # the version asked for; None: whichever serves when it is computed
    timeout_s: float | None = None  # shortens VIT_REQUEST_TIMEOUT_S (a gRPC client's deadline)
    # texts to embed, for a zero-shot model: a request of its own, with no images (`inputs` empty)
    texts: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.texts is not None:
            self.model.check_texts(self.texts)
        o = self.options
        self.model.check_labels(o.labels, o.template, o.classify, o.head)
        self.model.answer_labels(self.options)  # a head the model has


@dataclass(frozen=True)
class Inference:
    """One request's answer: the model version that computed it, and a prediction per image in input order."""

    model: ModelDescription
    predictions: list[Prediction]
    labels: tuple[str, ...] | None = None  # a zero-shot model's labels the request named, or its head's classes
    text_embeddings: torch.Tensor | None = None  # (T, D), unit length: a zero-shot model's embeddings of the texts

    @property
    def classes(self) -> list[str]:
        """What each probability is of, in order: the labels named, else the model's classes."""
        return self.model.classes_for(self.labels)


# Past this many values a response is encoded on the pool: below it, the hop to a thread costs about as much
# as the encoding.
INLINE_ENCODE_MAX_VALUES = 1000


def costly_to_encode(done: Inference) -> bool:
    """Whether an edge's encoding of `done` is worth a hop off the event loop: many values, or attention maps."""
    values = sum(
        p.probabilities.numel() + (0 if p.embedding is None else p.embedding.numel()) for p in done.predictions
    )
    return values > INLINE_ENCODE_MAX_VALUES or any(p.attention_map is not None for p in done.predictions)


@dataclass(frozen=True)
class Limits:
    """What an edge checks before handing a request over."""

    max_upload_bytes: int  # largest request body
    max_files: int  # most images in one request
    takes_pixels: bool = True  # whether V2 takes preprocessed pixels (the input `pixels`) as well as image files
    all_outputs: bool = True  # whether V2 lists (and answers) every output, or probabilities alone


@dataclass(frozen=True)
class Batching:
    """How every model's images are queued and batched (the settings served with), for the edges to describe."""

    max_batch_size: int  # images in one forward pass
    max_wait_ms: float  # longest wait after a batch's first image for more
    max_queue: int  # images waiting before requests are refused
    request_timeout_s: float  # a request's images not computed by then are dropped
    response_cache: bool
