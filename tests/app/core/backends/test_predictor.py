"""The forward step: the backend rules and the Predictor's outputs against the model itself."""

from __future__ import annotations

import pytest
import torch

from app.core.backends.predictor import ImageInput, Predictor, batch_sizes, inference_dtype, resolve_backend
from model.checkpoint import load_checkpoint
from model.preprocessing import Preprocessing
from model.rollout import attention_map
from tests.support.checkpoints import write_tiny_checkpoint

CPU = torch.device("cpu")


def test_auto_backend_is_onnxruntime_on_the_cpu_and_torch_on_a_gpu() -> None:
    assert resolve_backend("auto", CPU) == "onnxruntime"
    assert resolve_backend("auto", torch.device("cuda")) == "torch"
    assert resolve_backend("torch", CPU) == "torch"
    with pytest.raises(ValueError, match="VIT_BACKEND=onnxruntime runs on the CPU"):
        resolve_backend("onnxruntime", torch.device("cuda"))
    with pytest.raises(ValueError, match="VIT_BACKEND=onnxruntime-int8 runs on the CPU"):
        resolve_backend("onnxruntime-int8", torch.device("cuda"))


def test_batch_sizes_are_powers_of_two_and_the_maximum() -> None:
    assert batch_sizes(1) == [1]
    assert batch_sizes(32) == [1, 2, 4, 8, 16, 32]
    assert batch_sizes(24) == [1, 2, 4, 8, 16, 24]


def test_dtype_is_float32_on_the_cpu() -> None:
    assert inference_dtype(CPU) is torch.float32


@pytest.fixture
def predictor(tmp_path) -> Predictor:  # type: ignore[no-untyped-def]
    return Predictor(load_checkpoint(write_tiny_checkpoint(tmp_path / "tiny.safetensors")), CPU, "torch")


def test_outputs_are_the_models_in_input_order_whatever_each_image_asks(predictor: Predictor) -> None:
    x = torch.randn(5, *predictor.input_shape)
    kinds = ["none", "rollout", "gradient", "last", "none"]
    outputs = predictor([ImageInput(x[i], k) for i, k in enumerate(kinds)])  # type: ignore[arg-type]
    with torch.inference_mode():
        logits, attentions = predictor.model.forward_with_attention(x)
    expected = logits.softmax(-1)
    for i, (out, kind) in enumerate(zip(outputs, kinds, strict=True)):
        torch.testing.assert_close(out.probabilities, expected[i], atol=1e-5, rtol=0)
        assert (out.attention_map is None) == (kind == "none")
        if kind in ("rollout", "last"):
            mine = attention_map([a[i : i + 1] for a in attentions], kind, predictor.model.readout)[0]
            torch.testing.assert_close(out.attention_map, mine, atol=1e-5, rtol=0)


def test_uint8_pixels_are_scaled_and_normalised_with_their_batch_as_the_host_would(predictor: Predictor) -> None:
    """Pixels a host prepared for a GPU model stop at uint8 (a quarter of the bytes to move); the predictor scales
    and normalises them on its device, to the same input as `EvalTransform` on the host, in a batch that also
    holds pixels the host normalised."""
    from model.preprocessing import EvalTransform

    p = Preprocessing(predictor.input_shape[1], 3, (0.5, 0.4, 0.3), (0.2, 0.25, 0.3))
    predictor.scale = EvalTransform(p).scaled
    raw = torch.randint(0, 256, (4, *predictor.input_shape), dtype=torch.uint8)
    on_host = EvalTransform(p).scaled(raw)  # what the host sends when it normalises
    mixed = [ImageInput(raw[0], "none"), ImageInput(on_host[1], "none"), ImageInput(raw[2], "rollout")]
    mixed.append(ImageInput(raw[3], "none"))
    torch.testing.assert_close(predictor.inputs(mixed), on_host, atol=0, rtol=0)
    outputs = predictor(mixed)
    expected = predictor([ImageInput(x, item.attention) for x, item in zip(on_host, mixed, strict=True)])
    for got, want in zip(outputs, expected, strict=True):
        torch.testing.assert_close(got.probabilities, want.probabilities, atol=0, rtol=0)


def test_a_gradient_map_explains_the_asked_class(predictor: Predictor) -> None:
    x = torch.randn(*predictor.input_shape)
    top1 = int(predictor([ImageInput(x, "none")])[0].probabilities.argmax())
    other = (top1 + 1) % 10
    maps = [predictor([ImageInput(x, "gradient", target)])[0].attention_map for target in (top1, other, None)]
    assert all(m is not None and m.shape == (4, 4) for m in maps)
    assert not torch.allclose(maps[0], maps[1])  # type: ignore[arg-type]
    torch.testing.assert_close(maps[2], maps[0])  # no target: the top-1 class
