"""Where the time of an int8 forward goes on this CPU: ONNX Runtime's per-operator profile of ViT-S/16
(random weights, 224 px) in float32, int8 dynamic and int8 static, and float32 and int8 dynamic with
attention fused, beside the per-image preprocessing the service does around it. Writes
bench/results/<name>.json and .md.

    python -m bench.int8_profile --name int8-profile

Each variant is the graph the service runs (`exported`, `quantize_int8`, `python -m app.quantize`) or,
for the fused ones, that graph through onnxscript's ONNX Runtime fusions first;
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

from app.core.backends.onnx_runtime import INPUT, OUTPUTS, LogitsAndEmbedding, export, int8_graph_path, quantize_int8
from app.core.images.decode import decode_image
from app.core.images.prepare import Preprocessor
from app.quantize import main as quantize_main
from bench.common import write_results
from harness.images import photo_jpeg
from harness.models import vit_s16_checkpoint
from harness.records import table
from model.checkpoint import load_checkpoint

VARIANTS = ("float32", "float32 fused", "int8 dynamic", "int8 dynamic fused", "int8 static")


def graphs(folder: Path) -> dict[str, Path]:
    """The three graphs of one random ViT-S/16 as the service makes them, and the float32 and int8 dynamic
    graphs again with onnxscript's ONNX Runtime fusions, which also fuse attention."""
    checkpoint = vit_s16_checkpoint(folder / "vit-s16.safetensors")
    ckpt = load_checkpoint(checkpoint)
    c = ckpt.config
    (folder / "plain").mkdir()
    (folder / "fused").mkdir()
    plain = folder / "plain" / "model.onnx"
    export(LogitsAndEmbedding(ckpt.model.eval()), (c.in_channels, c.image_size, c.image_size), plain)
    fused = ort_fusions(plain, folder / "fused" / "model.onnx")
    assert quantize_main([str(checkpoint), "--calibration", "shapes", "--images", "64"]) == 0
    return {
        "float32": plain,
        "float32 fused": fused,
        "int8 dynamic": quantize_int8(plain),
        "int8 dynamic fused": quantize_int8(fused),
        "int8 static": int8_graph_path(checkpoint),
    }


def ort_fusions(path: Path, output: Path) -> Path:
    """The graph through onnxscript's `optimize_for_ort`: attention into `MultiHeadAttention`, LayerNorm with
    the residual add into `SkipLayerNormalization`, GELU with its bias into `BiasGelu` (ONNX Runtime's
    contrib operators)."""
    import onnx_ir as ir
    from onnxscript.rewriter.ort_fusions import optimize_for_ort

    model, counts = optimize_for_ort(ir.load(str(path)))
    print("  fused:", {k: v for k, v in counts.items() if v}, flush=True)
    ir.save(model, str(output))
    return output


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
        logits = session.run(OUTPUTS, {INPUT: x})[0]
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
        "logits": logits.tolist(),
    }


def preprocessing_ms(repeats: int = 50) -> float:
    """One 500x375 photo-like JPEG decoded and preprocessed for ViT-S/16, as the service does it, in ms."""
    from harness.models import VIT_S16_PREPROCESSING

    pre, data = Preprocessor(VIT_S16_PREPROCESSING), photo_jpeg(0)
    started = time.perf_counter()
    for _ in range(repeats):
        pre(decode_image(data, "photo.jpg", 3, 10**8))
    return (time.perf_counter() - started) / repeats * 1e3


def markdown(r: dict[str, Any]) -> str:
    variants = r["variants"]
    ops = sorted(
        {op for v in variants.values() for op in v["ops_ms_per_image"]},
        key=lambda op: -max(v["ops_ms_per_image"].get(op, 0) for v in variants.values()),
    )
    lines = [
        f"Started {r['started']}; ViT-S/16 at 224 px, batch {r['batch']}, {r['threads']} ORT threads, "
        f"{r['runs']} profiled batches; `python -m bench.int8_profile --name {r['name']}`.",
        "",
    ]
    rows = [
        ["**whole forward**", *(f"**{variants[v]['ms_per_image']:.1f}**" for v in VARIANTS)],
        [
            "logits: largest difference from float32",
            *(f"{variants[v]['max_abs_logit_difference']:.1e}" for v in VARIANTS),
        ],
        ["logits: lowest cosine with float32", *(f"{variants[v]['logits_cosine_min']:.4f}" for v in VARIANTS)],
    ]
    for op in ops:
        cells = [variants[v]["ops_ms_per_image"].get(op) for v in VARIANTS]
        if max(c or 0 for c in cells) >= 0.05:
            rows.append([op, *("-" if c is None else f"{c:.2f}" for c in cells)])
    lines += table(["ms per image", *VARIANTS], rows)
    ms = {v: variants[v]["ms_per_image"] for v in VARIANTS}
    f32, pre = ms["float32"], r["preprocessing_ms"]
    lines += [
        "",
        "Forward speed-up over float32: " + ", ".join(f"{v} {f32 / ms[v]:.2f}x" for v in VARIANTS[1:]) + ". "
        f"Decoding and preprocessing one 500x375 JPEG costs {pre:.1f} ms on one core, on the same two cores: with "
        "it, the best a served request can gain is about "
        + ", ".join(f"{(f32 + pre) / (ms[v] + pre):.2f}x ({v})" for v in VARIANTS[1:])
        + ".",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.int8_profile", description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=8, help="images per batch (the served batch at c=8)")
    p.add_argument("--runs", type=int, default=10, help="profiled batches per variant")
    p.add_argument("--name", default="int8-profile")
    args = p.parse_args()
    threads = torch.get_num_threads()
    report: dict[str, Any] = {
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "name": args.name,
        "batch": args.batch,
        "runs": args.runs,
        "threads": threads,
        "variants": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        for variant, path in graphs(folder).items():
            report["variants"][variant] = profile(path, folder, args.batch, args.runs, threads)
            print(f"{variant}: {report['variants'][variant]['ms_per_image']:.1f} ms/image", flush=True)
    reference = torch.tensor(report["variants"]["float32"]["logits"])
    for result in report["variants"].values():  # the same random batch through each graph
        logits = torch.tensor(result.pop("logits"))
        result["max_abs_logit_difference"] = float((logits - reference).abs().max())
        result["logits_cosine_min"] = float(torch.nn.functional.cosine_similarity(logits, reference).min())
    report["preprocessing_ms"] = preprocessing_ms()
    write_results(args.name, report, markdown(report))


if __name__ == "__main__":
    main()
