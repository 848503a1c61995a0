"""The model configuration extension parses strictly as Triton's `ModelConfig` (tritonclient's own schema),
in its JSON form and on the wire, and says what the service does with the model."""

from __future__ import annotations

import dataclasses

import pytest
from google.protobuf import json_format
from tritonclient.grpc import model_config_pb2

from app.codecs.model_config import model_config, model_config_json
from app.core.contract.inference import Batching
from app.core.engine.engine import Engine


def triton_config(config: dict[str, object]) -> model_config_pb2.ModelConfig:
    """Parsed as model_analyzer parses a configuration: an unknown key or a wrong type is an error."""
    return json_format.ParseDict(config, model_config_pb2.ModelConfig(), ignore_unknown_fields=False)


def test_the_json_form_parses_strictly_and_equals_the_message_on_the_wire(service: Engine) -> None:
    model = service.describe(None)
    parsed = triton_config(model_config_json(model, service.batching, service.limits))
    wire = model_config_pb2.ModelConfig.FromString(
        model_config(model, service.batching, service.limits).SerializeToString()
    )
    assert parsed == wire


def test_it_says_what_the_service_does(service: Engine) -> None:
    model = service.describe(None)
    batching = Batching(max_batch_size=64, max_wait_ms=2.5, max_queue=512, request_timeout_s=30, response_cache=True)
    config = model_config_json(model, batching, service.limits)
    assert config["name"] == model.name and config["max_batch_size"] == service.limits.max_files
    assert config["parameters"]["batcher_max_batch_size"] == {"string_value": "64"}
    assert config["parameters"]["content_hash"] == {"string_value": model.content_hash}
    batcher = config["dynamic_batching"]
    assert batcher["max_queue_delay_microseconds"] == "2500"  # 64-bit integers as strings, as Triton prints them
    assert batcher["default_queue_policy"]["max_queue_size"] == 512
    assert batcher["default_queue_policy"]["default_timeout_microseconds"] == "30000000"
    assert config["response_cache"] == {"enable": True}
    assert config["model_transaction_policy"] == {"decoupled": False}
    inputs = {i["name"]: i for i in config["input"]}
    assert inputs["image"]["data_type"] == "TYPE_STRING" and not inputs["image"]["optional"]
    assert inputs["image"]["dims"] == ["1"]  # one encoded file per batch element, as the metadata's [-1, 1]
    assert inputs["pixels"]["optional"] and inputs["pixels"]["dims"] == [str(d) for d in model.input_shape]
    assert {o["name"]: o["dims"] for o in config["output"]} == {
        "probabilities": [str(len(model.classes))],
        "attention": [str(model.grid_size)] * 2,
        "embedding": [str(model.embedding_dim)],
    }
    for printed in ("is_shape_tensor", "allow_ragged_batch", "label_filename"):  # every field printed
        assert any(printed in tensor for tensor in config["input"] + config["output"])


@pytest.mark.parametrize(
    ("device", "kind", "gpus"), [("cpu", "KIND_CPU", []), ("cuda", "KIND_GPU", [0]), ("cuda:1", "KIND_GPU", [1])]
)
def test_one_instance_on_the_models_device(service: Engine, device: str, kind: str, gpus: list[int]) -> None:
    model = dataclasses.replace(service.describe(None), device=device)
    [group] = model_config_json(model, service.batching, service.limits)["instance_group"]
    assert (group["kind"], group["count"], group["gpus"]) == (kind, 1, gpus)


def test_a_server_that_takes_no_pixels_configures_image_alone(service: Engine) -> None:
    limits = dataclasses.replace(service.limits, takes_pixels=False)
    config = model_config(service.describe(None), service.batching, limits)
    assert [(i.name, i.optional) for i in config.input] == [("image", False)]
