"""What int8 (VIT_BACKEND=onnxruntime-int8) costs in accuracy and gains in speed against float32 ONNX Runtime.

    python -m evaluation.quantization --name quantization

Variants: float32 (`onnxruntime`); float32 with ONNX Runtime's transformer fusions (its optimizer's
`vit` model type: LayerNorm with the residual add, GELU with its bias, and attention where it
recognises it); int8 dynamic (`onnxruntime-int8` with no stored graph: activations quantized per
batch); int8 static (`onnxruntime-int8` with the graph `python -m app.quantize` stored beside the
checkpoint: activation ranges calibrated ahead of time, on the bundled model's training set, or on
256 generated photo-like images that are not among the evaluated ones for the ViT-S/16).

In one run on this machine: (1) the bundled checkpoint's top-1 on its model card's 5,000 held-out
`shapes` images; (2) a timm ViT-S/16 (random init, converted) on 300 generated photo-like images and on
300 crops of the photographs scikit-image ships (the `bench` extra): top-1 agreement with float32
and the cosine similarity of the logits; (3) the ViT-S/16's raw
forward rate at batch 1, 8 and 32; (4) the service under `hey` posting a 500x375 JPEG at
concurrency 8. Attention maps always come from the torch model, so their pointing game does not
change with the backend.
"""

from __future__ import annotations

import argparse
import io
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader

from app.core.backends.onnx_runtime import LogitsAndEmbedding, OnnxForward, export, session
from app.core.backends.predictor import Backend, Predictor
from app.quantize import main as quantize_main
from app.settings import BUNDLED_WEIGHTS
from evaluation import write_results
from harness.images import photo_jpeg
from harness.load import require_hey, run_hey, start_service
from harness.records import table
from model.checkpoint import Checkpoint, load_checkpoint, save_checkpoint
from model.data import ShapesDataset
from model.evaluate import DEFAULT_SHAPES_EVAL_SEED
from model.preprocessing import EvalTransform

VARIANTS = ["float32", "float32 fused", "int8 dynamic", "int8 static"]
Forward = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@dataclass
class Checkpoints:
    """One model as each variant serves it: a copy alone (exported at startup), and a copy beside its static graph."""

    plain: Path
    static: Path

    @classmethod
    def make(cls, source: Path, folder: Path, calibration: str) -> Checkpoints:
        (folder / "plain").mkdir(parents=True)
        (folder / "static").mkdir()
        plain, static = folder / "plain" / source.name, folder / "static" / source.name
        shutil.copy(source, plain)
        shutil.copy(source, static)
        started = time.perf_counter()
        assert quantize_main([str(static), "--calibration", calibration, "--images", "256"]) == 0
        print(f"  static int8 graph of {source.name} in {time.perf_counter() - started:.0f} s", flush=True)
        return cls(plain, static)

    def forward(self, variant: str) -> Forward:
        if variant == "float32 fused":
            return fused(load_checkpoint(self.plain))
        path = self.static if variant == "int8 static" else self.plain
        backend: Backend = "onnxruntime" if variant == "float32" else "onnxruntime-int8"
        predictor = Predictor(load_checkpoint(path), torch.device("cpu"), backend)
        assert predictor.quantization == {"int8 static": "static", "int8 dynamic": "dynamic"}.get(variant)
        return predictor.forward_plain

    def served(self, variant: str) -> tuple[Path, Backend]:
        return (
            self.static if variant == "int8 static" else self.plain
        ), "onnxruntime-int8" if "int8" in variant else "onnxruntime"


def fused(ckpt: Checkpoint) -> Forward:
    """The float32 graph through ONNX Runtime's transformer optimizer."""
    from onnxruntime.transformers.optimizer import optimize_model

    c = ckpt.config
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model.onnx"
        export(LogitsAndEmbedding(ckpt.model.eval()), (c.in_channels, c.image_size, c.image_size), path)
        optimized = optimize_model(str(path), model_type="vit", num_heads=c.heads, hidden_size=c.dim, opt_level=0)
        print("  fused:", {k: v for k, v in optimized.get_fused_operator_statistics().items() if v}, flush=True)
        optimized.save_model_to_file(str(path))
        return OnnxForward(session(path, torch.get_num_threads()), None)


@torch.inference_mode()
def logits_of(forward: Forward, batches: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([forward(x)[0] for x in batches])


def shapes_accuracy(models: Checkpoints, samples: int) -> dict[str, float]:
    ckpt = load_checkpoint(models.plain)
    data = ShapesDataset(samples, DEFAULT_SHAPES_EVAL_SEED, EvalTransform(ckpt.preprocessing))
    pixels, labels = [], []
    for x, y in DataLoader(data, batch_size=256):
        pixels.append(x)
        labels.append(y)
    truth = torch.cat(labels)
    return {v: float((logits_of(models.forward(v), pixels).argmax(1) == truth).float().mean()) for v in VARIANTS}


def timm_vit_s16(folder: Path) -> Path:
    import timm

    from model.convert.timm_vit import from_timm_model

    torch.manual_seed(0)
    converted = from_timm_model(timm.create_model("vit_small_patch16_224", pretrained=False).eval())
    path = folder / "timm-vit-s16.safetensors"
    save_checkpoint(path, converted.build(), [f"class_{i}" for i in range(1000)], converted.preprocessing)
    return path


def generated_images(count: int) -> list[Image.Image]:
    """Photo-like 500x375 JPEGs with gradients and noise, decoded."""
    return [Image.open(io.BytesIO(photo_jpeg(i))).convert("RGB") for i in range(count)]


def sample_photos(count: int) -> list[Image.Image]:
    """`count` crops of the colour photographs scikit-image ships (astronaut, cat, coffee, rocket, ...): a random
    square of 40 to 100 % of each photo's shorter side, at a random place, flipped half the time."""
    try:
        from skimage import data
    except ImportError:
        raise SystemExit("the photo set needs scikit-image: .venv/bin/pip install -e '.[bench]'") from None
    names = ["astronaut", "chelsea", "coffee", "rocket", "hubble_deep_field", "immunohistochemistry", "retina"]
    photos = [Image.fromarray(getattr(data, n)()).convert("RGB") for n in names]
    left, _, _ = data.stereo_motorcycle()
    photos.append(Image.fromarray(left).convert("RGB"))
    rng = np.random.default_rng(0)
    crops = []
    for i in range(count):
        photo = photos[i % len(photos)]
        side = int(min(photo.size) * rng.uniform(0.4, 1.0))
        x, y = (int(rng.integers(0, d - side + 1)) for d in photo.size)
        crop = photo.crop((x, y, x + side, y + side))
        crops.append(crop.transpose(Image.Transpose.FLIP_LEFT_RIGHT) if rng.random() < 0.5 else crop)
    return crops


def agreement(models: Checkpoints, images: list[Image.Image]) -> dict[str, dict[str, float]]:
    ckpt = load_checkpoint(models.plain)
    transform = EvalTransform(ckpt.preprocessing)
    batches = list(torch.stack([transform(image) for image in images]).split(32))
    fp32 = logits_of(models.forward("float32"), batches)
    out = {}
    for variant in VARIANTS[1:]:
        other = logits_of(models.forward(variant), batches)
        cosine = torch.nn.functional.cosine_similarity(fp32, other)
        out[variant] = {
            "images": len(images),
            "top1_agreement": float((fp32.argmax(1) == other.argmax(1)).float().mean()),
            "cosine_mean": float(cosine.mean()),
            "cosine_min": float(cosine.min()),
        }
    return out


@torch.inference_mode()
def raw_rates(models: Checkpoints, sizes: list[int], seconds: float = 5.0) -> dict[str, dict[int, float]]:
    shape = load_checkpoint(models.plain).config
    out: dict[str, dict[int, float]] = {}
    for variant in VARIANTS:
        forward = models.forward(variant)
        out[variant] = {}
        for bs in sizes:
            x = torch.randn(bs, shape.in_channels, shape.image_size, shape.image_size)
            forward(x)
            n, started = 0, time.perf_counter()
            while time.perf_counter() - started < seconds or n < 2:
                forward(x)
                n += 1
            out[variant][bs] = n * bs / (time.perf_counter() - started)
            print(f"  {variant:<14} batch {bs:>3}: {out[variant][bs]:6.1f} img/s", flush=True)
    return out


def served(models: Checkpoints, body: Path, seconds: float) -> dict[str, dict[str, float]]:
    out = {}
    for variant in ("float32", "int8 dynamic", "int8 static"):  # the fused graph is no backend of the service
        checkpoint, backend = models.served(variant)
        server = start_service(checkpoint, 32, 5.0, 0, backend)
        try:
            r = run_hey(server.url + "/predict", body, "image/jpeg", 8, seconds)
        finally:
            server.stop()
        out[variant] = {"requests_per_s": r.requests_per_s, "p50_ms": r.p50_ms, "p99_ms": r.p99_ms, "errors": r.errors}
        print(f"  service {variant:<14} {r.requests_per_s:6.1f} req/s, p99 {r.p99_ms:.0f} ms", flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m evaluation.quantization", description=__doc__.split("\n\n")[0])
    p.add_argument("--samples", type=int, default=5000, help="held-out shapes images")
    p.add_argument("--images", type=int, default=300, help="generated images for the ViT-S/16 agreement")
    p.add_argument("--duration", type=float, default=15.0, help="seconds of hey per backend")
    p.add_argument("--name", default="quantization")
    args = p.parse_args()
    require_hey()
    report: dict[str, Any] = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "threads": torch.get_num_threads()}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        bundled = Checkpoints.make(BUNDLED_WEIGHTS, folder / "bundled", "shapes")
        report["shapes_top1"] = shapes_accuracy(bundled, args.samples)
        print("bundled top-1 on held-out shapes:", report["shapes_top1"], flush=True)
        calibration = folder / "calibration"
        calibration.mkdir()
        for i in range(256):  # photo-like images, not among the evaluated ones (seeds from 10,000)
            (calibration / f"{i}.jpg").write_bytes(photo_jpeg(10_000 + i))
        vit = Checkpoints.make(timm_vit_s16(folder), folder / "vit-s16", str(calibration))
        report["vit_s16_agreement"] = agreement(vit, generated_images(args.images))
        print("ViT-S/16 against float32, generated images:", report["vit_s16_agreement"], flush=True)
        report["vit_s16_agreement_photos"] = agreement(vit, sample_photos(args.images))
        print("ViT-S/16 against float32, photos:", report["vit_s16_agreement_photos"], flush=True)
        report["vit_s16_raw"] = raw_rates(vit, [1, 8, 32])
        body = folder / "photo.jpg"
        body.write_bytes(photo_jpeg(0))
        report["vit_s16_served"] = served(vit, body, args.duration)
    write_results(args.name, report, markdown(report, args.samples))
    print(markdown(report, args.samples))


def markdown(r: dict[str, Any], samples: int) -> str:
    s, a, raw, srv = r["shapes_top1"], r["vit_s16_agreement"], r["vit_s16_raw"], r["vit_s16_served"]
    ph = r["vit_s16_agreement_photos"]
    f = "float32"

    def row(measure: str, values: dict[str, float], fmt: str) -> list[str]:
        return [measure, *(format(values[v], fmt) if v in values else "-" for v in VARIANTS)]

    rows = [
        row(f"bundled model, top-1 on {samples} held-out shapes, %", {k: v * 100 for k, v in s.items()}, ".2f"),
        *(row(f"ViT-S/16 raw forward, batch {bs}, img/s", {v: raw[v][bs] for v in VARIANTS}, ".1f") for bs in raw[f]),
        *(
            row(f"ViT-S/16 raw forward, batch {bs}, x float32", {v: raw[v][bs] / raw[f][bs] for v in VARIANTS}, ".2f")
            for bs in raw[f]
        ),
        row("ViT-S/16 served (hey, c=8, 500x375 JPEG), req/s", {v: x["requests_per_s"] for v, x in srv.items()}, ".1f"),
        row(
            "ViT-S/16 served, x float32",
            {v: x["requests_per_s"] / srv[f]["requests_per_s"] for v, x in srv.items()},
            ".2f",
        ),
        row(
            f"ViT-S/16 top-1 agreement with float32 on {a['int8 static']['images']} generated images, %",
            {"float32": 100.0, **{v: x["top1_agreement"] * 100 for v, x in a.items()}},
            ".1f",
        ),
        row(
            "ViT-S/16 logits cosine with float32, mean",
            {"float32": 1.0, **{v: x["cosine_mean"] for v, x in a.items()}},
            ".4f",
        ),
        row(
            f"ViT-S/16 top-1 agreement with float32 on {ph['int8 static']['images']} crops of scikit-image's photos, %",
            {"float32": 100.0, **{v: x["top1_agreement"] * 100 for v, x in ph.items()}},
            ".1f",
        ),
        row(
            "the same photos: logits cosine with float32, mean",
            {"float32": 1.0, **{v: x["cosine_mean"] for v, x in ph.items()}},
            ".4f",
        ),
    ]
    lines = [
        f"Started {r['started']}, {r['threads']} threads; `python -m evaluation.quantization --name quantization`.",
        "",
        *table(["measure", *VARIANTS], rows),
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
