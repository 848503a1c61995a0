"""Converted timm, torchvision and Hugging Face models served through /predict: probabilities equal the
library's own pipeline (its eval transform and model) on the same non-square file."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from PIL import Image

from harness.images import encode
from tests.support.checkpoints import Pretrained
from tests.support.clients import ClientFactory

pytestmark = pytest.mark.slow  # serves converted library models

PROBABILITY_ATOL = 1e-4
EMBEDDING_ATOL = 1e-4  # absolute, per component (fp32; components of order 1)


@pytest.mark.parametrize("source", ["timm", "torchvision", "hf"])
async def test_served_probabilities_equal_the_library(
    make_client: ClientFactory, pretrained: Callable[[str], Pretrained], photo: Image.Image, source: str
) -> None:
    ref = pretrained(source)
    png = encode(photo)
    async with make_client(weights=ref.checkpoint, max_batch_size=2, warmup=False) as client:
        r = await client.post(
            "/predict", files={"file": ("photo.png", png, "image/png")}, params={"top_k": 3, "attention": "rollout"}
        )
        info = (await client.get("/v1/model")).json()
    assert r.status_code == 200, r.text
    result = r.json()["results"][0]
    served = torch.tensor(result["probabilities"])
    with torch.inference_mode():
        pixels = ref.transform(Image.open(io.BytesIO(png)).convert("RGB"))
        expected = ref.model(pixels[None]).float().softmax(dim=-1)[0]
    assert expected.max() > 0.05  # a peaked distribution, so the tolerance means something
    torch.testing.assert_close(served, expected, atol=PROBABILITY_ATOL, rtol=0)
    assert result["top_k"][0]["index"] == int(expected.argmax())
    assert result["top_k"][0]["label"] == info["classes"][int(expected.argmax())]
    assert result["attention"]["grid"] == ([7, 7] if source == "torchvision" else [14, 14])  # ViT-B/32; the others /16
    assert info["input_size"] == [224, 224] and info["training"]["converted_from"]["source"] in (
        "timm",
        "torchvision",
        "huggingface",
    )


@pytest.mark.parametrize("backend", ["torch", "onnxruntime"])
async def test_served_embeddings_equal_timms_pre_logits(
    make_client: ClientFactory, pretrained: Callable[[str], Pretrained], photo: Image.Image, backend: str
) -> None:
    """/predict and V2 embeddings are timm's forward_head(..., pre_logits=True) of the same pixels, alone or batched."""
    ref = pretrained("timm")
    pngs = [
        encode(photo),
        encode(photo.rotate(90, expand=True)),
        encode(photo.transpose(Image.Transpose.FLIP_LEFT_RIGHT)),
    ]
    with torch.inference_mode():
        pixels = torch.stack([ref.transform(Image.open(io.BytesIO(png)).convert("RGB")) for png in pngs])
        expected = ref.model.forward_head(ref.model.forward_features(pixels), pre_logits=True)  # type: ignore[attr-defined]
    files = [("files", (f"{i}.png", png, "image/png")) for i, png in enumerate(pngs)]
    async with make_client(weights=ref.checkpoint, max_batch_size=4, warmup=False, backend=backend) as client:
        together = await client.post("/predict", files=files, params={"embedding": "true"})
        alone = await client.post("/predict", files=files[1:2], params={"embedding": "true", "attention": "rollout"})
        unit = await client.post("/predict", files=files[:1], params={"embedding": "true", "normalize": "true"})
        raw = b"".join(len(p).to_bytes(4, "little") + p for p in pngs)
        tensor = {"name": "image", "datatype": "BYTES", "shape": [3], "parameters": {"binary_data_size": len(raw)}}
        header = json.dumps(
            {"inputs": [tensor], "outputs": [{"name": "embedding"}], "parameters": {"embedding": True}}
        ).encode()
        v2 = await client.post(
            "/v2/models/timm-vit/infer",
            content=header + raw,
            headers={"Inference-Header-Content-Length": str(len(header))},
        )
        info = (await client.get("/v1/model")).json()
    assert together.status_code == alone.status_code == unit.status_code == v2.status_code == 200, v2.text
    assert info["embedding_dim"] == 192
    served = torch.tensor([r["embedding"] for r in together.json()["results"]])
    assert served.shape == (3, 192)
    torch.testing.assert_close(served, expected, atol=EMBEDDING_ATOL, rtol=0)
    alone_embedding = torch.tensor(alone.json()["results"][0]["embedding"])  # the attention path, batch of one
    torch.testing.assert_close(alone_embedding, expected[1], atol=EMBEDDING_ATOL, rtol=0)
    normalised = torch.tensor(unit.json()["results"][0]["embedding"])
    torch.testing.assert_close(normalised, torch.nn.functional.normalize(expected[0], dim=0), atol=1e-5, rtol=0)
    [output] = v2.json()["outputs"]
    assert output["name"] == "embedding" and output["shape"] == [3, 192]
    torch.testing.assert_close(torch.tensor(output["data"]).view(3, 192), expected, atol=EMBEDDING_ATOL, rtol=0)


async def test_average_pooled_model_with_registers_serves_attention_maps(
    make_client: ClientFactory, tmp_path: Path, photo: Image.Image
) -> None:
    import timm

    from model.checkpoint import save_checkpoint
    from model.convert.timm_vit import from_timm_model

    m = timm.create_model("vit_tiny_patch16_224", num_classes=3, class_token=False, global_pool="avg", reg_tokens=4)
    converted = from_timm_model(m.eval())
    path = tmp_path / "gap.safetensors"
    save_checkpoint(path, converted.build(), ["a", "b", "c"], converted.preprocessing)
    async with make_client(weights=path, warmup=False) as client:
        for method in ("rollout", "last"):
            r = await client.post(
                "/predict", files={"file": ("p.png", encode(photo), "image/png")}, params={"attention": method}
            )
            assert r.status_code == 200, r.text
            grid = torch.tensor(r.json()["results"][0]["attention"]["map"])
            assert grid.shape == (14, 14) and float(grid.min()) == 0.0 and float(grid.max()) == 1.0


def test_serving_imports_neither_the_libraries_nor_training_code(pretrained: Callable[[str], Pretrained]) -> None:
    checkpoint = pretrained("hf").checkpoint
    code = f"""
import asyncio, io, sys
import httpx
from PIL import Image
from app.core.engine.engine import Engine
from app.web.app import create_app
from app.settings import Settings

async def main():
    async with Engine.serving(Settings(weights={str(checkpoint)!r}, device="cpu", warmup=False)) as engine:
        transport = httpx.ASGITransport(app=create_app(engine))
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            buf = io.BytesIO()
            Image.new("RGB", (300, 200), (10, 200, 30)).save(buf, "PNG")
            r = await client.post("/predict", files={{"file": ("x.png", buf.getvalue(), "image/png")}})
            assert r.status_code == 200, r.text

asyncio.run(main())
banned = ("timm", "transformers", "huggingface_hub", "torchvision", "model.data", "model.train", "model.shapes",
          "model.convert")
print(sorted(m for m in sys.modules if m.startswith(banned)))
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1] == "[]"


@pytest.mark.parametrize(
    "arch",
    [
        "deit_tiny_distilled_patch16_224",  # distillation token, two heads averaged
        "vit_base_patch16_clip_quickgelu_224",  # QuickGELU, pre-norm over the embeddings
        "vit_base_patch16_rpn_224",  # res-post-norm blocks, average pooling
        "vit_base_patch16_siglip_224",  # SigLIP's attention-pooling (MAP) head, given a classifier
        "eva02_small_patch14_336",  # EVA-02: rotary positions, SwiGLU
        "vit_small_patch16_rope_mixed_224",  # RoPE-Mixed: a rotary table per block and head
        "vit_pe_core_tiny_patch16_384",  # Perception Encoder: attention pooling over every token, its own heads
        "beitv2_base_patch16_224",  # BEiT v2: relative position bias per block, layer scale, mean pooling
        "vit_relpos_small_patch16_rpn_224",  # bias from an MLP over offsets, res-post-norm blocks
        "vit_pwee_patch16_reg1_gap_256",  # parallel blocks (ViT-22B), registers, average pooling
    ],
)
@pytest.mark.parametrize("backend", ["torch", "onnxruntime", "onnxruntime-int8"])
async def test_converted_variations_serve_timms_probabilities_and_maps(
    make_client: ClientFactory, tmp_path: Path, photo: Image.Image, arch: str, backend: str
) -> None:
    """Two blocks of each, random weights jittered so that every branch counts, through /predict on each backend
    (int8: ONNX Runtime's dynamic quantization); rollout, last and gradient maps for each."""
    from timm.data import create_transform, resolve_data_config

    from model.checkpoint import save_checkpoint
    from model.convert.coverage import build
    from model.convert.timm_vit import from_timm_model

    m = build(arch, small=True, num_classes=5)
    converted = from_timm_model(m)
    path = tmp_path / f"{arch}.safetensors"
    save_checkpoint(path, converted.build(), converted.classes, converted.preprocessing)
    png = encode(photo)
    with torch.inference_mode():
        pixels = create_transform(**resolve_data_config(model=m))(Image.open(io.BytesIO(png)).convert("RGB"))
        expected = m(pixels[None]).float().softmax(dim=-1)[0]
    async with make_client(weights=path, warmup=False, backend=backend) as client:
        plain = await client.post("/predict", files={"file": ("p.png", png, "image/png")})
        maps = {
            method: await client.post(
                "/predict", files={"file": ("p.png", png, "image/png")}, params={"attention": method}
            )
            for method in ("rollout", "last", "gradient")
        }
    assert plain.status_code == 200, plain.text
    tolerance = 0.05 if backend == "onnxruntime-int8" else 1e-4  # int8 weights and activations: close, not equal
    served = torch.tensor(plain.json()["results"][0]["probabilities"])
    torch.testing.assert_close(served, expected, atol=tolerance, rtol=0)
    for method, r in maps.items():
        assert r.status_code == 200, (method, r.text)
        grid = torch.tensor(r.json()["results"][0]["attention"]["map"])
        side = converted.config.grid_size
        assert grid.shape == (side, side) and float(grid.max()) == 1.0, method
