"""A batch's outputs made into a request's predictions: a classifier's probabilities with their
out-of-distribution scores where asked for, a zero-shot model's scores against its request's labels, or a head
taught by example over either's embeddings."""

from __future__ import annotations

import torch

from app.core.backends.predictor import ImageOutput
from app.core.contract.request import InferOptions, Prediction
from app.core.engine.served_model import ServedModel


def scored(
    model: ServedModel, names: list[str], outputs: list[ImageOutput], options: InferOptions, threshold: float | None
) -> list[Prediction]:
    """A classifier's predictions, with their out-of-distribution scores where asked for, flagged over `threshold`
    (the drift window scores every image a batch at a time: `app.core.engine.drift.Watching`)."""
    if not options.ood and not options.embedding:  # the common request: its outputs as they came
        return [Prediction(n, o.probabilities, o.attention_map, None) for n, o in zip(names, outputs, strict=True)]
    reference = model.checkpoint.reference
    scores: list[float | None] = [None] * len(outputs)
    if options.ood and reference is not None and outputs:
        embeddings = torch.stack([o.embedding for o in outputs if o.embedding is not None])
        scores = reference.scores(embeddings, torch.stack([o.probabilities for o in outputs])).tolist()
    threshold = threshold if options.ood else None
    return [prediction(n, o, options, score, threshold) for n, o, score in zip(names, outputs, scores, strict=True)]


def labelled_predictions(
    model: ServedModel, names: list[str], outputs: list[ImageOutput], texts: torch.Tensor, options: InferOptions
) -> list[Prediction]:
    """A zero-shot model's predictions: each image's probabilities over the labels by the model's rule, and with
    embedding=true its embedding in the joint space."""
    assert model.checkpoint.zero_shot is not None
    zero_shot = model.checkpoint.zero_shot
    joint = torch.stack([o.probabilities for o in outputs])  # (N, D): the image tower's outputs
    with torch.inference_mode():
        probabilities = zero_shot.probabilities(zero_shot.logits(joint, texts))
    return over_embeddings(names, probabilities, outputs, joint, options)


def headed_predictions(
    model: ServedModel, head: str, names: list[str], outputs: list[ImageOutput], options: InferOptions
) -> list[Prediction]:
    """A head taught by example: each image's probabilities over its classes, from the embeddings the head reads
    (a classifier's pre-logits, a zero-shot model's image in the joint space), one matrix product for them all;
    ModelNotFound for a head deleted since the request was admitted."""
    taught = model.head(head)
    joint = model.checkpoint.zero_shot is not None
    embeddings = torch.stack([o.probabilities if joint else o.embedding for o in outputs])  # type: ignore[misc]
    with torch.inference_mode():
        probabilities = taught.probabilities(embeddings)
    return over_embeddings(names, probabilities, outputs, embeddings, options)


def over_embeddings(
    names: list[str],
    probabilities: torch.Tensor,
    outputs: list[ImageOutput],
    embeddings: torch.Tensor,
    options: InferOptions,
) -> list[Prediction]:
    """Predictions of `probabilities` (N, C) computed over `embeddings` (N, D), which each carries where asked."""
    given: list[torch.Tensor | None] = [None] * len(outputs)
    if options.embedding:
        given = list(torch.nn.functional.normalize(embeddings, dim=1) if options.normalize else embeddings)
    return [
        Prediction(n, p, o.attention_map, None, e)
        for n, p, o, e in zip(names, probabilities.unbind(), outputs, given, strict=True)
    ]


def prediction(
    filename: str, output: ImageOutput, options: InferOptions, ood_score: float | None, threshold: float | None
) -> Prediction:
    embedding = output.embedding if options.embedding else None  # (also computed for an ood score alone)
    if embedding is not None and options.normalize:
        embedding = torch.nn.functional.normalize(embedding, dim=0)
    flagged = None if ood_score is None or threshold is None else ood_score > threshold
    return Prediction(filename, output.probabilities, output.attention_map, None, embedding, ood_score, flagged)
