"""The architecture variants and the class-specific maps, measured in one run on this machine.

    python -m evaluation.architectures                 # writes evaluation/results/architectures.{json,md}
    python -m evaluation.architectures --train 20000 --epochs 3 --eval 2000

(1) Each variant (standard pre-norm ViT, post-norm, MLP head, axial attention) trained on `shapes`
with the same budget (samples, epochs, batch, seed, micro preset, grayscale), then scored by
`model.evaluate` on a fresh held-out set: accuracy and the pointing game of its rollout maps.
(2) Forward time of full against axial attention as the image grows (patch 8, micro widths, one
batch), median of repeated runs. (3) On the bundled checkpoint: the pointing game and the latency of
`gradient` maps against `rollout`, through the service's own Predictor.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from app.core.backends.predictor import ImageInput, Predictor
from app.settings import BUNDLED_WEIGHTS
from evaluation import write_results
from harness.records import table
from model import evaluate, train
from model.checkpoint import load_checkpoint
from model.vit import PRESETS, ViT, ViTConfig

VARIANTS: dict[str, list[str]] = {
    "standard (pre-norm, linear head, full attention)": [],
    "post-norm": ["--norm", "post"],
    "MLP head (hidden 4 x classes)": ["--head", "mlp"],
    "axial attention": ["--attention-pattern", "axial"],
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m evaluation.architectures", description=__doc__.split("\n\n")[0])
    p.add_argument("--train", type=int, default=20_000, help="shapes training samples per epoch")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--eval", type=int, default=2_000, help="held-out samples for accuracy and pointing game")
    p.add_argument("--sizes", type=int, nargs="+", default=[64, 96, 128, 160, 192, 224, 256])
    p.add_argument("--batch", type=int, default=8, help="images per forward in the timing")
    p.add_argument("--threads", type=int, default=1, help="torch threads for the timings")
    p.add_argument("--name", default="architectures", help="evaluation/results/<name>.json and .md")
    p.add_argument("--runs", type=Path, default=Path("runs/architectures"))
    return p.parse_args()


def train_variants(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for name, flags in VARIANTS.items():
        out = args.runs / (name.split(" ")[0].lower() + ".safetensors")
        started = time.monotonic()
        train.main(
            [
                "--dataset",
                "shapes",
                "--channels",
                "1",
                "--shapes-train",
                str(args.train),
                "--shapes-test",
                "1000",
                "--epochs",
                str(args.epochs),
                "--batch-size",
                "64",
                "--warmup-epochs",
                "0.2",
                "--workers",
                "1",
                "--seed",
                "0",
                "--no-progress",
                "--output",
                str(out),
                *flags,
            ]
        )
        seconds = time.monotonic() - started
        result = evaluate.main(["--checkpoint", str(out), "--samples", str(args.eval), "--attention", "rollout"])
        params = load_checkpoint(out).model.num_parameters()
        rows.append(
            {
                "variant": name,
                "flags": " ".join(flags) or "(defaults)",
                "parameters": params,
                "accuracy": result.accuracy,
                "pointing_game": result.pointing_game,
                "train_s": round(seconds),
            }
        )
        print(rows[-1], flush=True)
    return rows


@torch.inference_mode()
def forward_ms(model: ViT, x: torch.Tensor, repeats: int = 7) -> float:
    model(x)  # warm-up
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        model(x)
        times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times)


def time_attention(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for size in args.sizes:
        x = torch.randn(args.batch, 1, size, size)
        row: dict[str, Any] = {"image_size": size, "patches": (size // 8) ** 2}
        for pattern in ("full", "axial"):
            config = ViTConfig(
                image_size=size, patch_size=8, in_channels=1, attention_pattern=pattern, **PRESETS["micro"]
            )
            row[f"{pattern}_ms"] = round(forward_ms(ViT(config).eval(), x), 2)
        row["axial_speedup"] = round(row["full_ms"] / row["axial_ms"], 2)
        rows.append(row)
        print(row, flush=True)
    return rows


def compare_maps(args: argparse.Namespace) -> list[dict[str, Any]]:
    checkpoint = load_checkpoint(BUNDLED_WEIGHTS)
    predictor = Predictor(checkpoint, torch.device("cpu"))
    blank = torch.zeros(predictor.input_shape)
    plain = [ImageInput(blank, "none")]
    rows = []
    for method in ("rollout", "gradient"):
        result = evaluate.main(
            ["--checkpoint", str(BUNDLED_WEIGHTS), "--samples", str(args.eval), "--attention", method]
        )
        latency = {}
        for batch in (1, 8):
            items = [ImageInput(blank, method)] * batch
            predictor(items)
            times = []
            for _ in range(15):
                started = time.perf_counter()
                predictor(items)
                times.append((time.perf_counter() - started) * 1e3)
            latency[batch] = round(statistics.median(times), 2)
        rows.append(
            {
                "method": method,
                "pointing_game": result.pointing_game,
                "accuracy": result.accuracy,
                "ms_batch_1": latency[1],
                "ms_batch_8": latency[8],
            }
        )
        print(rows[-1], flush=True)
    started = time.perf_counter()
    for _ in range(15):
        predictor(plain)
    rows.append(
        {"method": "none (probabilities only)", "ms_batch_1": round((time.perf_counter() - started) / 15 * 1e3, 2)}
    )
    return rows


def markdown(results: dict[str, Any]) -> str:
    a = results["args"]
    lines = [
        "# Architecture variants and class-specific maps",
        "",
        f"`python -m evaluation.architectures` on {results['machine']}, torch {results['torch']}, "
        f"{results['threads']} torch thread(s) for the timings.",
        "",
        f"## Variants on `shapes` (same budget: {a['train']} samples x {a['epochs']} epochs, batch 64, seed 0, "
        f"micro preset, grayscale 64 px; scored on {a['eval']} fresh held-out images)",
        "",
        *table(
            ["variant", "flags", "parameters", "top-1 accuracy", "pointing game (rollout)", "training time"],
            [
                [
                    r["variant"],
                    f"`{r['flags']}`",
                    f"{r['parameters']:,}",
                    f"{r['accuracy']:.2%}",
                    f"{r['pointing_game']:.2%}",
                    f"{r['train_s']} s",
                ]
                for r in results["variants"]
            ],
            "llllll",
        ),
    ]
    lines += [
        "",
        f"## Forward time, full against axial attention (patch 8, micro widths, batch {a['batch']})",
        "",
        *table(
            ["image", "patches", "full", "axial", "full / axial"],
            [
                [
                    f"{r['image_size']} px",
                    r["patches"],
                    f"{r['full_ms']} ms",
                    f"{r['axial_ms']} ms",
                    f"{r['axial_speedup']}x",
                ]
                for r in results["attention"]
            ],
            "lllll",
        ),
    ]
    lines += [
        "",
        "## Maps on the bundled checkpoint (service Predictor, CPU)",
        "",
        *table(
            ["map", "pointing game", "batch of 1", "batch of 8"],
            [
                [
                    r["method"],
                    f"{r['pointing_game']:.2%}" if "pointing_game" in r else "-",
                    f"{r['ms_batch_1']} ms",
                    f"{r['ms_batch_8']} ms" if "ms_batch_8" in r else "-",
                ]
                for r in results["maps"]
            ],
            "llll",
        ),
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    args = parse_args()
    results: dict[str, Any] = {
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "machine": f"{platform.machine()}, {torch.get_num_threads()} cores seen by torch",
        "torch": torch.__version__,
    }
    results["variants"] = train_variants(args)
    torch.set_num_threads(args.threads)
    results["threads"] = args.threads
    results["attention"] = time_attention(args)
    results["maps"] = compare_maps(args)
    write_results(args.name, results, markdown(results))


if __name__ == "__main__":
    main()
