"""The /predict codec: core predictions -> the JSON body, a pure function."""

from __future__ import annotations

import base64
import json

import torch

from app.codecs.predict import PredictResponse, encode_predict_response, image_result
from app.core.contract.request import Prediction
from app.core.engine.engine import Engine

CLASSES = ["a", "b", "c", "d"]


def test_top_k_in_descending_order_with_every_probability() -> None:
    p = Prediction("x.png", torch.tensor([0.1, 0.6, 0.2, 0.1]), None, None)
    result = image_result(p, CLASSES, top_k=2, attention="none")
    assert [(t["label"], t["index"]) for t in result["top_k"]] == [("b", 1), ("c", 2)]
    assert result["probabilities"] == p.probabilities.tolist() and "attention" not in result
    assert len(image_result(p, CLASSES, top_k=10, attention="none")["top_k"]) == 4  # capped at the classes


def test_maps_and_overlays_when_there_are_some() -> None:
    grid = torch.rand(3, 3)
    p = Prediction("x.png", torch.full((4,), 0.25), grid, b"\x89PNG...")
    result = image_result(p, CLASSES, top_k=1, attention="rollout")
    assert result["attention"] == {"method": "rollout", "grid": [3, 3], "map": grid.tolist()}
    assert base64.b64decode(result["overlay_png"]) == b"\x89PNG..."


async def test_the_response_body(service: Engine) -> None:
    model = service.describe(None)
    probs = torch.softmax(torch.arange(10.0), 0)
    body = json.loads(encode_predict_response(model, [Prediction("x.png", probs, None, None)] * 2, 3, "none"))
    assert body["model"] == {"name": "tiny", "version": model.version}
    assert len(body["results"]) == 2 and "attention" not in body["results"][0]
    assert [t["index"] for t in body["results"][0]["top_k"]] == [9, 8, 7]


async def test_the_body_is_the_documented_models(service: Engine) -> None:
    """The body validates as PredictResponse (the OpenAPI schema), and is byte for byte what that model
    serializes: the same field order, the same numbers, nothing unset."""
    model = service.describe(None)
    torch.manual_seed(0)
    plain = Prediction("a.png", torch.softmax(torch.randn(10), 0), None, None)
    everything = Prediction("b.png", torch.softmax(torch.randn(10), 0), torch.rand(4, 4), b"\x89PNG", torch.randn(8))
    for predictions, top_k, attention in [([plain], 5, "none"), ([plain, everything], 3, "rollout")]:
        body = encode_predict_response(model, predictions, top_k, attention)  # type: ignore[arg-type]
        parsed = PredictResponse.model_validate_json(body)
        assert parsed.model_dump_json(exclude_none=True).encode() == body
    assert parsed.results[1].attention is not None and parsed.results[1].embedding is not None
    assert parsed.results[0].overlay_png is None and "overlay_png" not in json.loads(body)["results"][0]
