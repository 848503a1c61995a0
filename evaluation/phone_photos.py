"""Phone photos: what decoding a 12-megapixel JPEG costs on the CPU in full and scaled inside libjpeg
(`VIT_JPEG_DRAFT`), how far the scaled decode moves the answers, and what the service serves of each.

    python -m evaluation.phone_photos                      # writes evaluation/results/phone-photos.{json,md}
    python -m evaluation.phone_photos --duration 5 --repeats 1

1. Decoding: one 4032x3024 JPEG (scikit-image's astronaut scaled up, with sensor-like noise, quality 92),
   decoded and preprocessed for ViT-S/16 at 224 px (resize 248, bicubic, centre crop) on one thread, in full
   and scaled; the median of many runs.
2. Agreement: each of scikit-image's colour photographs at 12 MP, preprocessed from the full and the scaled
   decode, through the bundled checkpoint and a converted timm ViT-S/16 (random weights with a sharpened
   head: no pretrained weights can be downloaded here): top-1 agreement and the largest probability change.
3. Serving: ViT-S/16 (torch backend) under `hey` posting the 12 MP JPEG, then a 500x375 one, to `/predict`
   with `VIT_JPEG_DRAFT` true and false, alternating rounds.
"""

from __future__ import annotations

import argparse
import io
import platform
import signal
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from app.core.images.decode import decode_image
from app.core.images.prepare import Preprocessor
from app.settings import BUNDLED_WEIGHTS
from evaluation import write_results
from harness.images import photo_jpeg
from harness.load import require_hey, run_hey
from harness.models import VIT_S16_PREPROCESSING, vit_s16_checkpoint
from harness.records import table
from harness.server import Server
from model.checkpoint import load_checkpoint

PHONE = (4032, 3024)
MAX_PIXELS = 40_000_000
PHOTOS = ["astronaut", "chelsea", "coffee", "rocket", "hubble_deep_field", "immunohistochemistry", "retina"]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m evaluation.phone_photos", description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=10.0, help="seconds per load round")
    p.add_argument("--repeats", type=int, default=2, help="rounds of each configuration, alternating")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--name", default="phone-photos", help="results file name")
    return p.parse_args()


def skimage_photos() -> dict[str, Image.Image]:
    try:
        from skimage import data
    except ImportError:
        raise SystemExit("the photo set needs scikit-image: .venv/bin/pip install -e '.[bench]'") from None
    return {name: Image.fromarray(getattr(data, name)()).convert("RGB") for name in PHOTOS}


def as_phone_jpeg(photo: Image.Image, seed: int) -> bytes:
    """`photo` filled into 4032x3024 (scaled, centre-cropped), with sensor-like noise, as a quality-92 JPEG."""
    scale = max(PHONE[0] / photo.width, PHONE[1] / photo.height)
    big = photo.resize((round(photo.width * scale), round(photo.height * scale)), Image.Resampling.BICUBIC)
    left, top = (big.width - PHONE[0]) // 2, (big.height - PHONE[1]) // 2
    pixels = np.asarray(big.crop((left, top, left + PHONE[0], top + PHONE[1])), dtype=np.float32)
    pixels += np.random.default_rng(seed).normal(0, 4, pixels.shape).astype(np.float32)
    buf = io.BytesIO()
    Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(buf, format="JPEG", quality=92)
    return buf.getvalue()


def decode_cost(jpeg: bytes, runs: int = 15) -> dict[str, float]:
    """Median milliseconds on one thread: decode alone, and decode plus the ViT-S/16 preprocessing."""
    torch.set_num_threads(1)
    pre = Preprocessor(VIT_S16_PREPROCESSING)
    draft_to = VIT_S16_PREPROCESSING.resize_size
    out: dict[str, float] = {}
    for name, work in {
        "decode_full_ms": lambda: decode_image(jpeg, "p.jpg", 3, MAX_PIXELS),
        "decode_draft_ms": lambda: decode_image(jpeg, "p.jpg", 3, MAX_PIXELS, draft_to),
        "decode_and_preprocess_full_ms": lambda: pre(decode_image(jpeg, "p.jpg", 3, MAX_PIXELS)),
        "decode_and_preprocess_draft_ms": lambda: pre(decode_image(jpeg, "p.jpg", 3, MAX_PIXELS, draft_to)),
    }.items():
        work()  # warm: first-call allocations are not what a serving process pays
        times = []
        for _ in range(runs):
            started = time.perf_counter()
            work()
            times.append((time.perf_counter() - started) * 1e3)
        out[name] = statistics.median(times)
    out["draft_size"] = list(decode_image(jpeg, "p.jpg", 3, MAX_PIXELS, draft_to).size)  # type: ignore[assignment]
    return out


def agreement(checkpoint: Path, jpegs: dict[str, bytes]) -> dict[str, Any]:
    """Full against scaled decode through one checkpoint: top-1 agreement and probability changes."""
    ckpt = load_checkpoint(checkpoint)
    pre = Preprocessor(ckpt.preprocessing)
    draft_to = ckpt.preprocessing.resize_size
    channels = ckpt.config.in_channels
    full = torch.stack([pre(decode_image(j, n, channels, MAX_PIXELS)) for n, j in jpegs.items()])
    draft = torch.stack([pre(decode_image(j, n, channels, MAX_PIXELS, draft_to)) for n, j in jpegs.items()])
    with torch.no_grad():
        p_full, p_draft = ckpt.model(full).softmax(-1), ckpt.model(draft).softmax(-1)
    change = (p_full - p_draft).abs()
    top1 = p_full.argmax(-1) == p_draft.argmax(-1)
    return {
        "checkpoint": checkpoint.name,
        "image_size": ckpt.preprocessing.image_size,
        "resize_size": draft_to,
        "images": len(jpegs),
        "top1_agree": int(top1.sum()),
        "max_abs_probability_change": float(change.max()),
        "mean_abs_top1_probability_change": float((p_full.max(-1).values - p_draft.max(-1).values).abs().mean()),
        "max_top1_probability": float(p_full.max()),
        "pixel_max_abs_difference": float((full - draft).abs().max()),
    }


def timm_vit_s16(folder: Path) -> Path:
    """timm's vit_small_patch16_224 at random init with a sharpened head, converted through model.convert."""
    import timm
    from safetensors.torch import save_file

    from model.convert.__main__ import main as convert

    torch.manual_seed(0)
    m = timm.create_model("vit_small_patch16_224", pretrained=False).eval()
    with torch.no_grad():
        m.head.weight.copy_(torch.randn(m.head.weight.shape, generator=torch.Generator().manual_seed(0)) * 0.5)
    save_file(m.state_dict(), str(folder / "timm.safetensors"))
    out = folder / "timm-vit-s16.safetensors"
    convert(
        ["timm", "--arch", "vit_small_patch16_224", "--weights", str(folder / "timm.safetensors"), "--output", str(out)]
    )
    return out


def serving(checkpoint: Path, bodies: dict[str, Path], args: argparse.Namespace) -> list[dict[str, Any]]:
    """hey against /predict, one server per setting, rounds alternating between them."""
    servers = {
        draft: Server(checkpoint, VIT_BACKEND="torch", VIT_JPEG_DRAFT=str(draft).lower(), VIT_LOG_LEVEL="warning")
        for draft in (True, False)
    }
    rows = []
    try:
        for server in servers.values():
            server.wait_ready(300)
        for round_ in range(args.repeats):
            for image, body in bodies.items():
                for draft, server in servers.items():
                    other = servers[not draft]
                    other.proc.send_signal(signal.SIGSTOP)  # the idle server takes no CPU from the measured one
                    try:
                        r = run_hey(f"{server.url}/predict", body, "image/jpeg", args.concurrency, args.duration)
                    finally:
                        other.proc.send_signal(signal.SIGCONT)
                    rows.append({"round": round_, "image": image, "jpeg_draft": draft, **r.__dict__})
                    print(rows[-1], flush=True)
    finally:
        for server in servers.values():
            server.stop()
    return rows


def markdown(report: dict[str, Any]) -> str:
    d = report["decode"]
    lines = [
        "# Phone photos: JPEGs scaled while decoding (`VIT_JPEG_DRAFT`)",
        "",
        f"Machine: {report['machine']}. Command: `{report['command']}`.",
        "",
        f"## Decoding one {PHONE[0]}x{PHONE[1]} JPEG ({report['phone_jpeg_bytes'] / 1e6:.1f} MB), one thread",
        "",
        *table(
            ["", "full", f"scaled to {d['draft_size'][0]}x{d['draft_size'][1]}", "full / scaled"],
            [
                [
                    "decode",
                    f"{d['decode_full_ms']:.0f} ms",
                    f"{d['decode_draft_ms']:.0f} ms",
                    f"{d['decode_full_ms'] / d['decode_draft_ms']:.1f}x",
                ],
                [
                    "decode + ViT-S/16 preprocessing",
                    f"{d['decode_and_preprocess_full_ms']:.0f} ms",
                    f"{d['decode_and_preprocess_draft_ms']:.0f} ms",
                    f"{d['decode_and_preprocess_full_ms'] / d['decode_and_preprocess_draft_ms']:.1f}x",
                ],
            ],
        ),
        "",
        "## Agreement with the full decode, scikit-image's photographs at 12 MP",
        "",
        *table(
            ["checkpoint", "resize", "top-1 agree", "largest probability change", "mean top-1 change", "top-1 p max"],
            [
                [
                    a["checkpoint"],
                    str(a["resize_size"]),
                    f"{a['top1_agree']} / {a['images']}",
                    f"{a['max_abs_probability_change']:.4f}",
                    f"{a['mean_abs_top1_probability_change']:.4f}",
                    f"{a['max_top1_probability']:.3f}",
                ]
                for a in report["agreement"]
            ],
        ),
        "",
        f"## Served by `/predict` (ViT-S/16, torch, concurrency {report['concurrency']}, raw JPEG bodies)",
        "",
        *table(
            ["round", "image", "VIT_JPEG_DRAFT", "img/s", "p50 ms", "p99 ms", "errors"],
            [
                [
                    str(r["round"]),
                    r["image"],
                    str(r["jpeg_draft"]).lower(),
                    f"{r['requests_per_s']:.1f}",
                    f"{r['p50_ms']:.0f}",
                    f"{r['p99_ms']:.0f}" if r["p99_ms"] == r["p99_ms"] else "n/a",  # hey: too few requests
                    str(r["errors"]),
                ]
                for r in report["serving"]
            ],
            align="llrrrrr",
        ),
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    args = parse_args()
    require_hey()
    threads = torch.get_num_threads()
    photos = skimage_photos()
    jpegs = {name: as_phone_jpeg(photo, i) for i, (name, photo) in enumerate(photos.items())}
    report: dict[str, Any] = {
        "machine": f"{platform.machine()}, {threads} cores for torch",
        "command": "python -m evaluation.phone_photos"
        + (f" --duration {args.duration:g}" if args.duration != 10 else "")
        + (f" --repeats {args.repeats}" if args.repeats != 2 else ""),
        "phone_jpeg_bytes": len(jpegs["astronaut"]),
        "concurrency": args.concurrency,
        "decode": decode_cost(jpegs["astronaut"]),
    }
    print(report["decode"], flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        torch.set_num_threads(threads)
        report["agreement"] = [agreement(BUNDLED_WEIGHTS, jpegs), agreement(timm_vit_s16(folder), jpegs)]
        print(report["agreement"], flush=True)
        bodies = {"4032x3024": folder / "phone.jpg", "500x375": folder / "small.jpg"}
        bodies["4032x3024"].write_bytes(jpegs["astronaut"])
        bodies["500x375"].write_bytes(photo_jpeg(0))
        report["serving"] = serving(vit_s16_checkpoint(folder / "vit-s16.safetensors"), bodies, args)
    write_results(args.name, report, markdown(report))


if __name__ == "__main__":
    main()
