"""Where a request's time went, from its batches' timings: what the statistics extension reports."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from app.core.backends.predictor import ImageOutput
from app.core.contract.request import DecodedImage, EncodedImage
from app.telemetry.statistics import RequestTiming


def request_timing(
    started: float, submitted: float, received: float, done: float, outputs: list[ImageOutput]
) -> RequestTiming:
    """Where a request's time went (app.telemetry.statistics): it waits for the slowest of its batches."""
    began = input_s = infer_s = output_s = 0.0
    last = None
    for o in outputs:  # a request's images lie in one batch or a few, in order
        b = o.batch
        if b is None or b is last:
            continue
        last = b
        began = b.started if b.started > began else began
        input_s = b.input_s if b.input_s > input_s else input_s
        infer_s = b.infer_s if b.infer_s > infer_s else infer_s
        output_s = b.output_s if b.output_s > output_s else output_s
    if last is None:
        return RequestTiming(0.0, submitted - started, received - submitted, done - received)
    return RequestTiming(
        queue=max(0.0, began - submitted),
        compute_input=(submitted - started) + input_s,
        compute_infer=infer_s,
        compute_output=output_s + (done - received),
    )


def decoded_before(inputs: Sequence[EncodedImage | DecodedImage] | torch.Tensor) -> float:
    """The time a front-end spent decoding a request's images before it reached the engine (they decode
    together: the longest)."""
    longest = 0.0
    if isinstance(inputs, torch.Tensor):
        return longest
    for i in inputs:
        if isinstance(i, DecodedImage) and i.decode_s > longest:
            longest = i.decode_s
    return longest
