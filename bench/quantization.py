"""What int8 (VIT_BACKEND=onnxruntime-int8) costs in accuracy and gains in speed against float32 ONNX Runtime.

    python -m bench.quantization --name quantization

In one run on this machine: (1) the bundled checkpoint's top-1 on its model card's 5,000 held-out
`shapes` images on both backends; (2) a timm ViT-S/16 (random init, converted) on 300 generated
photo-like 224 px images: top-1 agreement with float32 and the cosine similarity of the logits;
(3) the ViT-S/16's raw forward rate at batch 1, 8 and 32 on both backends; (4) the service on both
backends under `hey` posting a 500x375 JPEG at concurrency 8. Attention maps always come from the
torch model, so their pointing game does not change with the backend.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

from app.core.inference import Backend, Predictor
from app.settings import BUNDLED_WEIGHTS
from bench.batch import photo_jpeg
from bench.load import require_hey, run_hey, start_service
from bench.run import RESULTS
from model.checkpoint import load_checkpoint, save_checkpoint
from model.data import ShapesDataset
from model.evaluate import DEFAULT_SHAPES_EVAL_SEED
from model.preprocessing import EvalTransform

BACKENDS: list[Backend] = ["onnxruntime", "onnxruntime-int8"]


@torch.inference_mode()
def logits_of(predictor: Predictor, batches: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([predictor.forward_plain(x)[0] for x in batches])


def shapes_accuracy(samples: int) -> dict[str, float]:
    ckpt = load_checkpoint(BUNDLED_WEIGHTS)
    data = ShapesDataset(samples, DEFAULT_SHAPES_EVAL_SEED, EvalTransform(ckpt.preprocessing))
    pixels, labels = [], []
    for x, y in DataLoader(data, batch_size=256):
        pixels.append(x)
        labels.append(y)
    truth = torch.cat(labels)
    return {b: float((logits_of(Predictor(ckpt, torch.device("cpu"), b), pixels).argmax(1) == truth).float().mean())
            for b in BACKENDS}  # fmt: skip


def timm_vit_s16(folder: Path) -> Path:
    import timm

    from model.convert.timm_vit import from_timm_model

    torch.manual_seed(0)
    converted = from_timm_model(timm.create_model("vit_small_patch16_224", pretrained=False).eval())
    path = folder / "timm-vit-s16.safetensors"
    save_checkpoint(path, converted.build(), [f"class_{i}" for i in range(1000)], converted.preprocessing)
    return path


def agreement(checkpoint: Path, images: int) -> dict[str, float]:
    import io

    from PIL import Image

    ckpt = load_checkpoint(checkpoint)
    transform = EvalTransform(ckpt.preprocessing)
    x = torch.stack([transform(Image.open(io.BytesIO(photo_jpeg(i))).convert("RGB")) for i in range(images)])
    batches = list(x.split(32))
    fp32 = logits_of(Predictor(ckpt, torch.device("cpu"), "onnxruntime"), batches)
    int8 = logits_of(Predictor(ckpt, torch.device("cpu"), "onnxruntime-int8"), batches)
    cosine = torch.nn.functional.cosine_similarity(fp32, int8)
    return {"images": images, "top1_agreement": float((fp32.argmax(1) == int8.argmax(1)).float().mean()),
            "cosine_mean": float(cosine.mean()), "cosine_min": float(cosine.min())}  # fmt: skip


@torch.inference_mode()
def raw_rates(checkpoint: Path, sizes: list[int], seconds: float = 5.0) -> dict[str, dict[int, float]]:
    ckpt = load_checkpoint(checkpoint)
    out: dict[str, dict[int, float]] = {}
    for backend in BACKENDS:
        predictor = Predictor(ckpt, torch.device("cpu"), backend)
        out[backend] = {}
        for bs in sizes:
            x = torch.randn(bs, *predictor.input_shape)
            predictor.forward_plain(x)
            n, started = 0, time.perf_counter()
            while time.perf_counter() - started < seconds or n < 2:
                predictor.forward_plain(x)
                n += 1
            out[backend][bs] = n * bs / (time.perf_counter() - started)
            print(f"  {backend:<17} batch {bs:>3}: {out[backend][bs]:6.1f} img/s", flush=True)
    return out


def served(checkpoint: Path, body: Path, seconds: float) -> dict[str, dict[str, float]]:
    out = {}
    for backend in BACKENDS:
        server = start_service(checkpoint, 32, 5.0, 0, backend)
        try:
            r = run_hey(server.url + "/predict", body, "image/jpeg", 8, seconds)
        finally:
            server.stop()
        out[backend] = {"requests_per_s": r.requests_per_s, "p50_ms": r.p50_ms, "p99_ms": r.p99_ms, "errors": r.errors}
        print(f"  service {backend:<17} {r.requests_per_s:6.1f} req/s, p99 {r.p99_ms:.0f} ms", flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.quantization", description=__doc__.split("\n\n")[0])
    p.add_argument("--samples", type=int, default=5000, help="held-out shapes images")
    p.add_argument("--images", type=int, default=300, help="generated images for the ViT-S/16 agreement")
    p.add_argument("--duration", type=float, default=15.0, help="seconds of hey per backend")
    p.add_argument("--name", default="quantization")
    args = p.parse_args()
    require_hey()
    report: dict[str, Any] = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "threads": torch.get_num_threads()}
    report["shapes_top1"] = shapes_accuracy(args.samples)
    print("bundled top-1 on held-out shapes:", report["shapes_top1"], flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = timm_vit_s16(Path(tmp))
        report["vit_s16_agreement"] = agreement(checkpoint, args.images)
        print("ViT-S/16 int8 vs float32:", report["vit_s16_agreement"], flush=True)
        report["vit_s16_raw"] = raw_rates(checkpoint, [1, 8, 32])
        body = Path(tmp) / "photo.jpg"
        body.write_bytes(photo_jpeg(0))
        report["vit_s16_served"] = served(checkpoint, body, args.duration)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.name}.json").write_text(json.dumps(report, indent=2))
    (RESULTS / f"{args.name}.md").write_text(markdown(report, args.samples))
    print(markdown(report, args.samples))


def markdown(r: dict[str, Any], samples: int) -> str:
    s, a, raw, srv = r["shapes_top1"], r["vit_s16_agreement"], r["vit_s16_raw"], r["vit_s16_served"]
    f, q = BACKENDS
    lines = [
        f"Started {r['started']}, {r['threads']} threads, ONNX Runtime float32 (`onnxruntime`) against int8 (`onnxruntime-int8`).",
        "",
        "| measure | float32 | int8 | int8 / float32 |",
        "|---|---:|---:|---:|",
        f"| bundled model, top-1 on {samples} held-out shapes | {s[f] * 100:.2f} % | {s[q] * 100:.2f} % | {(s[q] - s[f]) * 100:+.2f} points |",
        *[
            f"| ViT-S/16 raw forward, batch {bs}, img/s | {raw[f][bs]:.1f} | {raw[q][bs]:.1f} | {raw[q][bs] / raw[f][bs]:.2f}x |"
            for bs in raw[f]
        ],
        f"| ViT-S/16 served (hey, c=8, 500x375 JPEG), req/s | {srv[f]['requests_per_s']:.1f} | {srv[q]['requests_per_s']:.1f} | "
        f"{srv[q]['requests_per_s'] / srv[f]['requests_per_s']:.2f}x |",
        "",
        f"ViT-S/16 (timm, random init, converted) on {a['images']} generated images: int8 top-1 agrees with float32 on "
        f"{a['top1_agreement'] * 100:.1f} %; logits cosine similarity mean {a['cosine_mean']:.4f}, min {a['cosine_min']:.4f}.",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
