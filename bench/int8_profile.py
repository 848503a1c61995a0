"""Where the time of an int8 forward goes on this CPU: ONNX Runtime's per-operator profile of ViT-S/16
(random weights, 224 px) in float32, int8 dynamic and int8 static, beside the per-image preprocessing
the service does around it. Writes bench/results/<name>.json and .md.

    python -m bench.int8_profile --name int8-profile

Each variant is the graph the service runs (`exported`, `quantize_int8`, `python -m app.quantize`),
loaded with the service's session options and profiled by ONNX Runtime over `--runs` batches after
two warm-up batches; operator times are summed by operator type, per image.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import torch

from app.core.decode import decode_image
from app.core.onnx_backend import INPUT, OUTPUTS, LogitsAndEmbedding, export, int8_graph_path, quantize_int8
from app.core.preprocess import Preprocessor
from app.quantize import main as quantize_main
from bench.batch import photo_jpeg
from bench.run import RESULTS, vit_s16_checkpoint
from model.checkpoint import load_checkpoint

VARIANTS = ("float32", "int8 dynamic", "int8 static")


def graphs(folder: Path) -> dict[str, Path]:
    """The three graphs of one random ViT-S/16, as the service makes them."""
    checkpoint = vit_s16_checkpoint(folder / "vit-s16.safetensors")
    ckpt = load_checkpoint(checkpoint)
    c = ckpt.config
    plain = folder / "float32.onnx"
    export(LogitsAndEmbedding(ckpt.model.eval()), (c.in_channels, c.image_size, c.image_size), plain)
    dynamic = quantize_int8(plain)
    assert quantize_main([str(checkpoint), "--calibration", "shapes", "--images", "64"]) == 0
    return {"float32": plain, "int8 dynamic": dynamic, "int8 static": int8_graph_path(checkpoint)}


def profile(path: Path, folder: Path, batch: int, runs: int, threads: int) -> dict[str, Any]:
    """Per-image milliseconds by operator type over `runs` batches (after two warm-up batches)."""
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")  # as the service runs it
    options.enable_profiling = True
    options.profile_file_prefix = str(folder / path.stem)
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    x = np.random.default_rng(0).standard_normal((batch, 3, 224, 224), dtype=np.float32)
    for _ in range(2 + runs):
        session.run(OUTPUTS, {INPUT: x})
    events = json.loads(Path(session.end_profiling()).read_text())
    model_runs = sorted((e for e in events if e.get("name") == "model_run"), key=lambda e: e["ts"])
    measured = model_runs[2:]
    start = measured[0]["ts"]
    by_op: dict[str, float] = defaultdict(float)
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time") and e["ts"] >= start:
            by_op[e["args"]["op_name"]] += e["dur"]
    images = runs * batch
    return {
        "ms_per_image": sum(e["dur"] for e in measured) / images / 1e3,
        "ops_ms_per_image": {op: us / images / 1e3 for op, us in sorted(by_op.items(), key=lambda kv: -kv[1])},
    }


def preprocessing_ms(repeats: int = 50) -> float:
    """One 500x375 photo-like JPEG decoded and preprocessed for ViT-S/16, as the service does it, in ms."""
    from bench.run import VIT_S16_PREPROCESSING

    pre, data = Preprocessor(VIT_S16_PREPROCESSING), photo_jpeg(0)
    started = time.perf_counter()
    for _ in range(repeats):
        pre(decode_image(data, "photo.jpg", 3, 10**8))
    return (time.perf_counter() - started) / repeats * 1e3


def markdown(r: dict[str, Any]) -> str:
    variants = r["variants"]
    ops = sorted({op for v in variants.values() for op in v["ops_ms_per_image"]},
                 key=lambda op: -max(v["ops_ms_per_image"].get(op, 0) for v in variants.values()))  # fmt: skip
    lines = [
        f"Started {r['started']}; ViT-S/16 at 224 px, batch {r['batch']}, {r['threads']} ORT threads, "
        f"{r['runs']} profiled batches; `python -m bench.int8_profile --name {r['name']}`.",
        "",
        "| ms per image | " + " | ".join(VARIANTS) + " |",
        "|---|" + "---:|" * len(VARIANTS),
        "| **whole forward** | " + " | ".join(f"**{variants[v]['ms_per_image']:.1f}**" for v in VARIANTS) + " |",
    ]
    for op in ops:
        cells = [variants[v]["ops_ms_per_image"].get(op) for v in VARIANTS]
        if max(c or 0 for c in cells) >= 0.05:
            lines.append(f"| {op} | " + " | ".join("-" if c is None else f"{c:.2f}" for c in cells) + " |")
    f32, dyn, sta = (variants[v]["ms_per_image"] for v in VARIANTS)
    pre = r["preprocessing_ms"]
    lines += [
        "",
        f"Forward speed-up: int8 dynamic {f32 / dyn:.2f}x, int8 static {f32 / sta:.2f}x. Decoding and preprocessing "
        f"one 500x375 JPEG costs {pre:.1f} ms on one core, on the same two cores: with it, the best a served "
        f"request can gain is about {(f32 + pre) / (dyn + pre):.2f}x (dynamic) and {(f32 + pre) / (sta + pre):.2f}x "
        "(static).",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.int8_profile", description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=8, help="images per batch (the served batch at c=8)")
    p.add_argument("--runs", type=int, default=10, help="profiled batches per variant")
    p.add_argument("--name", default="int8-profile")
    args = p.parse_args()
    threads = torch.get_num_threads()
    report: dict[str, Any] = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "name": args.name, "batch": args.batch,
                              "runs": args.runs, "threads": threads, "variants": {}}  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        for variant, path in graphs(folder).items():
            report["variants"][variant] = profile(path, folder, args.batch, args.runs, threads)
            print(f"{variant}: {report['variants'][variant]['ms_per_image']:.1f} ms/image", flush=True)
    report["preprocessing_ms"] = preprocessing_ms()
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.name}.json").write_text(json.dumps(report, indent=2))
    (RESULTS / f"{args.name}.md").write_text(markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()
