"""What an edge may know of the served models: core types that the codecs encode, never the predictor's internals."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from app.choices import Backend, DecodedOn, ModelState, Precision, Quantization
from app.core.contract.errors import InvalidInput, ModelNotFound
from app.core.contract.request import HOW_TO_NAME_LABELS, MAX_LABELS, InferOptions
from model.version import numeric_version


def canonical_version(version: str) -> str:
    """A version as a client asked for it, as the service gives it: the number; or the checkpoint's short
    (12 hex digits, what versions were before) or full content hash, still accepted. All digits is a number."""
    if not version.isdigit() and len(version) in (12, 64) and all(c in "0123456789abcdef" for c in version):
        return numeric_version(version)
    return version


@dataclass(frozen=True)
class ModelDescription:
    """One served model version: its identity, its tensors and how it computes."""

    name: str
    version: str  # numeric_version(content_hash)
    content_hash: str
    classes: list[str]  # the labels, by class index
    input_shape: tuple[int, int, int]  # (channels, height, width) of one preprocessed image
    grid_size: int  # rows (and columns) of the patch grid: an attention map's size
    embedding_dim: int
    backend: Backend
    precision: Precision
    quantization: Quantization | None  # with int8: how the graph was made
    device: str
    dtype: str  # of the model's weights on the device
    decode: DecodedOn  # where plain JPEGs are decoded
    config: dict[str, Any]  # the architecture, as the checkpoint stores it
    preprocessing: dict[str, Any]
    training: dict[str, Any]
    reference: bool = False  # the checkpoint has reference statistics: out-of-distribution scores
    ood_p99: float | None = None  # the score 99 in 100 held-out in-distribution images stay at or below
    ood_method: str | None = None  # what the score is: mahalanobis, or max_softmax (1 - the top probability)
    # A zero-shot model (CLIP, SigLIP): how label scores become probabilities, softmax over the labels or the
    # sigmoid of each; None for a classifier. Its `classes` are the labels used when a request names none.
    zero_shot: str | None = None
    template: str | None = None  # a zero-shot model's own prompt, `{}` where a label goes
    # heads taught by example over its embeddings, by name: each one's classes, rule, examples and estimate
    heads: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)

    def class_index(self, target: str | None, classes: list[str] | None = None) -> int | None:
        """A class label, or its index (among `classes`, default the model's), as the class index a gradient map
        explains; None for None (the top-1)."""
        return class_index(self.name, self.classes if classes is None else classes, target)

    def check_texts(self, texts: tuple[str, ...]) -> None:
        """InvalidInput unless the model is zero-shot and the texts are at least one, none empty, at most MAX_LABELS."""
        if self.zero_shot is None:
            raise InvalidInput(
                f"model {self.name} is a classifier: texts are embedded by a zero-shot model (CLIP, SigLIP)"
            )
        if not texts or len(texts) > MAX_LABELS:
            raise InvalidInput(f"send 1 to {MAX_LABELS} texts to embed; got {len(texts)}")
        if any(not t.strip() for t in texts):
            raise InvalidInput(f"an empty text among {len(texts)}: each text is embedded")

    def answer_labels(self, options: InferOptions) -> tuple[str, ...] | None:
        """What a request's probabilities are over, where it is not the model's own classes: a head's classes, or
        the labels a zero-shot request named; ModelNotFound for a head the model does not have."""
        if options.head is None:
            return options.labels
        if (head := self.heads.get(options.head)) is None:
            known = ", ".join(sorted(self.heads)) or "none; teach one (docs/api.md#heads-taught-by-example)"
            raise ModelNotFound(f"model {self.name} has no head named {options.head!r}; its heads: {known}")
        return tuple(head["classes"])

    def classes_for(self, labels: tuple[str, ...] | None) -> list[str]:
        """The classes a request's probabilities are over: the labels it named (a zero-shot model), else the model's."""
        return self.classes if labels is None else list(labels)

    def check_labels(
        self, labels: tuple[str, ...] | None, template: str | None, classify: bool = True, head: str | None = None
    ) -> None:
        """InvalidInput unless the labels and template fit the model: a classifier takes neither, and a zero-shot
        model without default labels needs labels to answer probabilities (`classify`) over its own labels, which
        a request to a `head` does not."""
        if self.zero_shot is None and (labels is not None or template is not None):
            asked = (
                "labels name the classes of a zero-shot model (CLIP, SigLIP)"
                if labels is not None
                else "a template is the prompt a zero-shot model (CLIP, SigLIP) sets each label in"
            )
            raise InvalidInput(
                f"{asked}; model {self.name} is a classifier with fixed classes, so send neither labels nor a "
                f"template: {', '.join(self.classes[:10])}{', ...' if len(self.classes) > 10 else ''}"
            )
        if self.zero_shot is not None and labels is None and not self.classes and classify and head is None:
            raise InvalidInput(
                f"model {self.name} is zero-shot and has no default labels: name the classes to choose among "
                f"({HOW_TO_NAME_LABELS})"
            )


def class_index(model: str, classes: list[str], target: str | None) -> int | None:
    """A class label, or its index, as the class index a gradient map explains; None for None (the top-1)."""
    if target is None:
        return None
    if target in classes:
        return classes.index(target)
    if target.isdigit() and int(target) < len(classes):
        return int(target)
    n = len(classes)
    shown = ", ".join(classes[:10]) + (f", ... ({n} in all)" if n > 10 else "")
    raise InvalidInput(
        f"target {target!r} names no class of model {model}; give a label or an index 0..{n - 1}: {shown}"
    )


@dataclass(frozen=True)
class ModelStatus:
    """One model's line in the repository index."""

    name: str
    state: ModelState
    version: str = ""  # the version serving (or loading, or last served)
    reason: str = ""  # why it is UNAVAILABLE


@dataclass(frozen=True)
class ShadowReport:
    """What GET /v1/models/{champion}/shadow answers."""

    champion: str
    challenger: str
    fraction: float
    compared: int  # images both models computed
    top1_agreement: float | None  # share of those with the same top-1 class (None before the first)
    mean_tv_distance: float | None  # mean of 0.5 * sum |p_champion - p_challenger| over them
    shed: int  # images picked for the shadow but not computed by the challenger (load, or a failure)
    champion_p50_ms: float | None  # median time from submission to answer, per request
    challenger_p50_ms: float | None
