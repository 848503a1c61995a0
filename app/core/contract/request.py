"""What an edge hands the core and gets back: images or pixels, the options, one prediction per image."""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, get_args

from torch import Tensor

from app.core.contract.errors import InvalidInput
from model.rollout import MapMethod
from model.taught_head import HeadError, check_head_name
from model.zero_shot import check_template

AttentionKind = Literal["none", MapMethod]  # the map asked for; "none": probabilities only
ATTENTION_KINDS: tuple[str, ...] = get_args(AttentionKind)
MAX_LABELS = 10_000  # labels one request may name for a zero-shot model


@dataclass(frozen=True)
class EncodedImage:
    """One image file as sent (JPEG, PNG, ...), decoded by the core."""

    filename: str
    data: bytes


@dataclass(frozen=True)
class DecodedImage:
    """An image file already decoded and preprocessed for one model version where it arrived (a serving
    front-end, VIT_WORKERS > 1). The engine batches `pixels` as they are while that version serves; after a
    reload it decodes `data` again for the version then serving."""

    filename: str
    # The file as sent. In the engine process, a view of the front-end's shared memory, valid until the call
    # is answered: what keeps it past that copies it (`owned`).
    data: bytes | memoryview
    version: str  # the model version it was prepared for
    pixels: Tensor | None  # (C, H, W) float32; None: a plain JPEG, checked, that the GPU decodes with its batch
    decode_s: float  # the time it took, counted in the model's compute_input statistics


@dataclass(frozen=True)
class InferOptions:
    """What to compute for every image of a request; checked when built, so no edge repeats the rules."""

    attention: AttentionKind = "none"
    target: str | None = None  # with attention=gradient: the class to explain, label or index (None: top-1)
    overlay: bool = False  # also draw the map over the image as a PNG
    embedding: bool = False  # also return the embedding the classification head receives
    normalize: bool = False  # with embedding: L2-normalised
    ood: bool = False  # also score how far each image lies from the model's reference data
    # A zero-shot model's classes for this request, in answer order (None: the model's default labels)
    labels: tuple[str, ...] | None = None
    template: str | None = None  # a zero-shot model's prompt, `{}` where a label goes (None: the model's own)
    # the probabilities are wanted (False: a V2 request that names other outputs alone, so that a zero-shot model
    # without default labels needs none)
    classify: bool = True
    head: str | None = None  # a head taught by example: its classes, over the model's embeddings (None: its own)

    def __post_init__(self) -> None:
        if self.attention not in ATTENTION_KINDS:
            raise InvalidInput(f"attention must be one of {', '.join(ATTENTION_KINDS)}; got {self.attention!r}")
        if self.overlay and self.attention == "none":
            raise InvalidInput("overlay=true draws an attention map: also pass attention=rollout, last or gradient")
        if self.target is not None and self.attention != "gradient":
            raise InvalidInput("target chooses the class a gradient map explains: also pass attention=gradient")
        if self.normalize and not self.embedding:
            raise InvalidInput("normalize=true L2-normalises the embedding: also pass embedding=true")
        if self.labels is not None:
            check_labels(self.labels)
        if self.template is not None:
            try:
                check_template(self.template)
            except ValueError as e:
                raise InvalidInput(str(e)) from None
        if self.head is not None:
            self.check_head()

    def check_head(self) -> None:
        """A head's name, and what a head cannot be asked with; InvalidInput otherwise."""
        try:
            check_head_name(self.head or "")
        except HeadError as e:
            raise InvalidInput(str(e)) from None
        if self.labels is not None or self.template is not None:
            raise InvalidInput(
                "a head answers with the classes it was taught; labels and a template name a zero-shot model's: "
                "send one or the other"
            )
        if self.ood:
            raise InvalidInput(
                "a head's classes have no reference statistics (they are fitted to the model's own classes): "
                "ask ood=true without a head"
            )
        if self.attention == "gradient":
            raise InvalidInput(
                "a gradient map explains one of the model's own classes; with a head, ask attention=rollout or last"
            )


# how each protocol names a zero-shot request's classes, for messages the core writes once for both
HOW_TO_NAME_LABELS = "/predict: labels=cat,dog or a repeated label=; V2: the request parameter labels"


def check_labels(labels: tuple[str, ...]) -> None:
    """Labels a request names: at least one, at most MAX_LABELS, none empty or repeated; InvalidInput otherwise."""
    if not any(map(str.strip, labels)):  # none, or only empty ones (`labels=`)
        raise InvalidInput(f"the labels name no class: give at least one ({HOW_TO_NAME_LABELS})")
    if len(labels) > MAX_LABELS:
        raise InvalidInput(f"{len(labels)} labels in one request; at most {MAX_LABELS}")
    if not all(map(str.strip, labels)):  # checked whole first: a request of 1,000 labels runs this every time
        raise InvalidInput(f"an empty label among {len(labels)}: each label names a class")
    if len(set(labels)) != len(labels):
        twice = next(label for label, n in Counter(labels).items() if n > 1)
        raise InvalidInput(f"label {twice!r} is named twice: each label is one class of the answer")


def parse_labels(comma_separated: str | None, repeated: list[str] | None = None) -> tuple[str, ...] | None:
    """The labels of `labels=cat,dog` (split on commas, spaces around each dropped) followed by those of
    repeated `label=` parameters (taken whole: a label with a comma); None when neither is given."""
    labels = [] if comma_separated is None else [part.strip() for part in comma_separated.split(",")]
    labels += [label.strip() for label in repeated or []]
    if comma_separated is None and not repeated:
        return None
    return tuple(labels)


@dataclass(frozen=True)
class Prediction:
    """The core's answer for one image; each protocol encodes it its own way."""

    filename: str
    probabilities: Tensor  # (num_classes,) float32 on the CPU
    attention_map: Tensor | None  # (grid, grid) in [0, 1], when asked for
    overlay_png: bytes | None  # the map over the image, when asked for
    embedding: Tensor | None = None  # (dim,) float32 on the CPU, when asked for
    ood_score: float | None = None  # distance from the reference data (higher: further), when asked for
    ood: bool | None = None  # the score above the model's threshold, where one is set


def owned(image: EncodedImage | DecodedImage) -> EncodedImage | DecodedImage:
    """`image` with its own copy of the file where it holds a view of memory another process reuses."""
    if isinstance(image, DecodedImage) and isinstance(image.data, memoryview):
        return dataclasses.replace(image, data=bytes(image.data))
    return image


def pick(
    inputs: Sequence[EncodedImage | DecodedImage] | Tensor, indices: list[int]
) -> list[EncodedImage | DecodedImage] | Tensor:
    """The images at `indices` of a request's inputs: files, or rows of pixels."""
    if isinstance(inputs, Tensor):
        return inputs[indices]
    return [inputs[i] for i in indices]
