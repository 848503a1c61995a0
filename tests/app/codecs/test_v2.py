"""The V2 codec: request bodies -> the core's inputs and options, predictions -> output tensors."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from app.codecs.v2_metadata import model_metadata
from app.codecs.v2_requests import Intake, decode_request, split_body
from app.codecs.v2_responses import encode_response
from app.codecs.v2_tensors import split_bytes_elements
from app.core.contract.errors import InvalidInput
from app.core.contract.regions import SharedMemoryRegions
from app.core.contract.request import EncodedImage, Prediction
from app.core.engine.engine import Engine

SHAPE = (3, 32, 32)


def intake(shape: tuple[int, int, int] = SHAPE, max_images: int = 8) -> Intake:
    return Intake(shape, max_images, 10 * 2**20, SharedMemoryRegions(None, 8))


def binary_request(
    files: list[bytes], parameters: dict[str, object] | None = None, outputs: list[dict[str, object]] | None = None
) -> tuple[bytes, bytes]:
    raw = b"".join(len(f).to_bytes(4, "little") + f for f in files)
    tensor = {"name": "image", "datatype": "BYTES", "shape": [len(files)], "parameters": {"binary_data_size": len(raw)}}
    request = {"inputs": [tensor], "parameters": parameters or {}, **({"outputs": outputs} if outputs else {})}
    header = json.dumps(request).encode()
    return split_body(header + raw, str(len(header)))


def test_binary_bytes_elements_become_encoded_images() -> None:
    header, binary = binary_request([b"one", b"", b"three"], {"attention": "gradient", "target": "star"})
    decoded = decode_request(header, binary, intake())
    assert decoded.inputs == [
        EncodedImage("image[0]", b"one"),
        EncodedImage("image[1]", b""),
        EncodedImage("image[2]", b"three"),
    ]
    assert decoded.options.attention == "gradient" and decoded.options.target == "star"


def test_pixels_in_json() -> None:
    x = torch.randn(2, *SHAPE)
    tensor = {"name": "pixels", "datatype": "FP32", "shape": [2, *SHAPE], "data": x.flatten().tolist()}
    decoded = decode_request(json.dumps({"inputs": [tensor]}).encode(), b"", intake())
    assert isinstance(decoded.inputs, torch.Tensor)
    torch.testing.assert_close(decoded.inputs, x)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"{", "not valid JSON"),
        (b'{"inputs": []}', "send exactly one input"),
        (b'{"inputs": [{"name": "pixels", "datatype": "FP32", "shape": [1, 3, 8, 8], "data": []}]}', "must have shape"),
        (b'{"inputs": [{"name": "x", "datatype": "BYTES", "shape": [1], "data": ["AA=="]}]}', "unknown input 'x'"),
        (b'{"inputs": [], "parameters": {"embedding": "yes"}}', "the parameter embedding must be true or false"),
        (b'{"inputs": [], "parameters": {"normalize": true}}', "also pass embedding=true"),
        (
            b'{"inputs": [{"name": "image", "datatype": "BYTES", "shape": [1], "data": ["AA=="]}],'
            b' "outputs": [{"name": "embedding", "parameters": {"classification": 2}}]}',
            "not 'embedding'",
        ),
    ],
)
def test_malformed_requests_say_what_to_fix(body: bytes, message: str) -> None:
    with pytest.raises(InvalidInput, match=message):
        decode_request(body, b"", intake())


def test_a_truncated_bytes_element_is_refused() -> None:
    with pytest.raises(InvalidInput):
        split_bytes_elements((10).to_bytes(4, "little") + b"short")
    with pytest.raises(InvalidInput, match="Inference-Header-Content-Length"):
        split_body(b"{}", "99")


async def test_binary_outputs_and_classification(service: Engine) -> None:
    model = service.describe(None)
    probs = torch.softmax(torch.arange(10.0), 0)
    predictions = [Prediction("image[0]", probs, torch.rand(4, 4), None)]
    wanted = [
        {"name": "probabilities", "parameters": {"classification": 2}},
        {"name": "attention", "parameters": {"binary_data": True}},
    ]
    header, binary = binary_request([b"x"], {"attention": "rollout"}, wanted)
    decoded = decode_request(header, binary, intake(model.input_shape))
    encoded = encode_response(decoded, predictions, model)
    assert encoded.header_length is not None
    response = json.loads(encoded.body[: encoded.header_length])
    labels, attention = response["outputs"]
    assert labels["datatype"] == "BYTES" and labels["shape"] == [1, 2]
    assert labels["data"] == [f"{probs[9]:f}:9:{model.classes[9]}", f"{probs[8]:f}:8:{model.classes[8]}"]
    raw = encoded.body[encoded.header_length :]
    assert attention["parameters"]["binary_data_size"] == len(raw) == 16 * 4
    np.testing.assert_array_equal(np.frombuffer(raw, "<f4").reshape(4, 4), predictions[0].attention_map.numpy())


def test_an_output_named_is_computed_with_its_defaults_and_parameters_still_choose() -> None:
    header, binary = binary_request([b"x"], outputs=[{"name": "embedding"}])  # what perf_analyzer sends
    options = decode_request(header, binary, intake()).options
    assert options.embedding and not options.normalize and options.attention == "none" and not options.ood
    header, binary = binary_request([b"x"], outputs=[{"name": "attention"}, {"name": "ood_score"}])
    options = decode_request(header, binary, intake()).options
    assert options.attention == "rollout" and options.ood and not options.embedding
    header, binary = binary_request(
        [b"x"], {"attention": "last", "normalize": True}, [{"name": "attention"}, {"name": "embedding"}]
    )
    options = decode_request(header, binary, intake()).options
    assert options.attention == "last" and options.embedding and options.normalize
    header, binary = binary_request([b"x"])
    options = decode_request(header, binary, intake()).options
    assert options.attention == "none" and not options.embedding and not options.ood


def test_an_output_that_cannot_be_given_is_refused_with_the_reason() -> None:
    header, binary = binary_request([b"x"], outputs=[{"name": "logits"}])
    with pytest.raises(InvalidInput, match="unknown output 'logits'; this model gives 'probabilities', 'attention'"):
        decode_request(header, binary, intake())
    header, binary = binary_request([b"x"], {"target": "star"}, [{"name": "attention"}])
    with pytest.raises(InvalidInput, match="target chooses the class a gradient map explains"):
        decode_request(header, binary, intake())
    plain = Intake(SHAPE, 8, 10 * 2**20, SharedMemoryRegions(None, 8), outputs=("probabilities",))
    header, binary = binary_request([b"x"], outputs=[{"name": "embedding"}])
    with pytest.raises(InvalidInput, match=r"output 'embedding' is not served here \(VIT_V2_OUTPUTS=probabilities\)"):
        decode_request(header, binary, plain)
    header, binary = binary_request([b"x"], {"attention": "rollout"})
    with pytest.raises(InvalidInput, match="the parameter attention asks for an output this server does not give"):
        decode_request(header, binary, plain)
    header, binary = binary_request([b"x"], outputs=[{"name": "probabilities"}])
    assert decode_request(header, binary, plain).options.attention == "none"


async def test_the_embedding_output(service: Engine) -> None:
    model = service.describe(None)
    header, binary = binary_request([b"x", b"y"], {"embedding": True})
    decoded = decode_request(header, binary, intake(model.input_shape))
    embeddings = torch.randn(2, 32)
    predictions = [Prediction(f"image[{i}]", torch.full((10,), 0.1), None, None, embeddings[i]) for i in range(2)]
    response = json.loads(encode_response(decoded, predictions, model).body)
    assert [o["name"] for o in response["outputs"]] == ["probabilities", "embedding"]
    assert response["outputs"][1]["shape"] == [2, 32]
    torch.testing.assert_close(torch.tensor(response["outputs"][1]["data"]).view(2, 32), embeddings)


async def test_model_metadata_lists_both_inputs(service: Engine) -> None:
    meta = model_metadata(service.describe(None))
    assert [(t.name, t.datatype, t.shape) for t in meta.inputs] == [
        ("image", "BYTES", [-1, 1]),
        ("pixels", "FP32", [-1, 3, 32, 32]),
    ]
    assert [(t.name, t.shape) for t in meta.outputs] == [
        ("probabilities", [-1, 10]),
        ("attention", [-1, 4, 4]),
        ("embedding", [-1, 32]),
    ]


async def test_a_server_that_takes_no_pixels_lists_and_takes_image_alone(service: Engine) -> None:
    meta = model_metadata(service.describe(None), takes_pixels=False)
    assert [t.name for t in meta.inputs] == ["image"]
    tensor = {"name": "pixels", "datatype": "FP32", "shape": [1, *SHAPE], "data": [0.0] * (3 * 32 * 32)}
    no_pixels = Intake(SHAPE, 8, 1 << 20, SharedMemoryRegions(None, 8), takes_pixels=False)
    with pytest.raises(InvalidInput, match="takes no pixels"):
        decode_request(json.dumps({"inputs": [tensor]}).encode(), b"", no_pixels)
    assert decode_request(json.dumps({"inputs": [tensor]}).encode(), b"", intake()).inputs.shape == (1, *SHAPE)


@pytest.mark.parametrize(
    ("tensor_parameters", "outputs", "error"),
    [
        ({"shared_memory_region": "r", "shared_memory_byte_size": 8, "binary_data_size": 3}, None, "send no data"),
        ({"shared_memory_region": "r"}, None, "needs shared_memory_byte_size"),
        ({"shared_memory_region": "r", "shared_memory_byte_size": 8}, None, "no system shared-memory region named 'r'"),
        (
            {"binary_data_size": 7},
            [
                {
                    "name": "probabilities",
                    "parameters": {"shared_memory_region": "r", "shared_memory_byte_size": 64, "classification": 2},
                }
            ],
            "classification results are not written to shared memory",
        ),
        (
            {"binary_data_size": 7},
            [{"name": "probabilities", "parameters": {"shared_memory_region": "r"}}],
            "needs shared_memory_byte_size",
        ),
    ],
)
def test_shared_memory_parameters_are_checked_before_any_compute(
    tensor_parameters: dict[str, object], outputs: list[dict[str, object]] | None, error: str
) -> None:
    tensor = {"name": "image", "datatype": "BYTES", "shape": [1], "parameters": tensor_parameters}
    header = json.dumps({"inputs": [tensor], **({"outputs": outputs} if outputs else {})}).encode()
    binary = b"\x03\x00\x00\x00abc" if "binary_data_size" in tensor_parameters else b""
    with pytest.raises(InvalidInput, match=error):
        decode_request(header, binary, intake())


def labelled(parameters: dict[str, object], outputs: list[str] | None = None) -> bytes:
    body: dict[str, object] = {
        "parameters": parameters,
        "inputs": [{"name": "image", "datatype": "BYTES", "shape": [1], "data": ["aGk="]}],
    }
    if outputs is not None:
        body["outputs"] = [{"name": name} for name in outputs]
    return json.dumps(body).encode()


@pytest.mark.parametrize(
    ("labels", "parsed"),
    [
        ("cat, dog ,a red car", ("cat", "dog", "a red car")),
        ('["Hello, World!", "cat"]', ("Hello, World!", "cat")),  # a JSON array in a string: gRPC's scalar parameters
        (["Hello, World!", " cat "], ("Hello, World!", "cat")),  # a JSON array: REST
    ],
)
def test_the_labels_parameter_is_a_comma_separated_string_or_a_json_array(
    labels: object, parsed: tuple[str, ...]
) -> None:
    decoded = decode_request(labelled({"labels": labels, "template": "a {}"}), b"", intake())
    assert decoded.options.labels == parsed and decoded.options.template == "a {}"
    assert decoded.options.classify


@pytest.mark.parametrize(
    ("parameters", "says"),
    [
        ({"labels": 3}, "comma-separated labels"),
        ({"labels": ["cat", 3]}, "strings alone"),
        ({"labels": "[cat"}, "not a JSON array"),
        ({"labels": "cat,cat"}, "named twice"),
        ({"labels": "cat", "template": 5}, "must be a string"),
        ({"labels": "cat", "template": "nothing"}, "must hold one {}"),
    ],
)
def test_bad_labels_or_templates_are_refused(parameters: dict[str, object], says: str) -> None:
    with pytest.raises(InvalidInput, match=says):
        decode_request(labelled(parameters), b"", intake())


def test_naming_outputs_without_probabilities_asks_for_no_classification() -> None:
    assert not decode_request(labelled({}, ["embedding"]), b"", intake()).options.classify
    assert decode_request(labelled({}, ["embedding", "probabilities"]), b"", intake()).options.classify


def test_a_text_request_is_decoded_only_for_a_zero_shot_model() -> None:
    body = json.dumps({"inputs": [{"name": "text", "datatype": "BYTES", "shape": [2], "data": ["a cat", "café"]}]})
    listed = ("probabilities", "attention", "embedding", "text_embedding")
    zero_shot = Intake(SHAPE, 8, 1 << 20, SharedMemoryRegions(None, 8), outputs=listed, takes_text=True)
    decoded = decode_request(body.encode(), b"", zero_shot)
    assert decoded.texts == ("a cat", "café") and decoded.inputs == []
    plain = Intake(SHAPE, 8, 1 << 20, SharedMemoryRegions(None, 8), outputs=("probabilities",), takes_text=True)
    with pytest.raises(InvalidInput, match="VIT_V2_OUTPUTS=probabilities"):
        decode_request(body.encode(), b"", plain)
    with pytest.raises(InvalidInput, match="unknown input 'text'"):
        decode_request(body.encode(), b"", intake())
