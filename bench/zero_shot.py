"""Zero-shot serving: requests/s for a CLIP model with 10 and with 1,000 labels per request, beside the same image
tower with a linear head of as many classes.

    python -m bench.zero_shot --rounds 2 --seconds 10 --name zero-shot-cpu

A CLIP model with random weights (transformers' `CLIPModel`: a ViT-Ti-sized image tower, 224 px, patch 16; a
4-layer text tower; OpenAI's BPE) is converted with `python -m model.convert hf`. Its image tower, with a random
linear head of 10 or 1,000 classes in place of the projection, is the classifier it is measured beside: the
same forward, the same JSON of 10 or 1,000 probabilities per image. Each run starts `python -m app` (defaults:
the ONNX Runtime backend on the CPU) on one checkpoint; `hey` posts one 500x375 JPEG to `/predict` at
concurrency 16, naming the labels in the query (`labels=c0,c1,...`) for the zero-shot model. The labels' text
pass runs once, in the warm-up; what is measured is the served rate once they are kept. Rounds alternate.
"""

from __future__ import annotations

import argparse
import io
import os
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import torch

from bench.cache import rate
from bench.common import multipart, write_results
from harness.load import start_hey
from harness.records import table
from harness.server import Server
from harness.zero_shot import clip_vocabulary
from model.checkpoint import load_checkpoint, save_checkpoint
from model.shapes import make_sample
from model.vit import ViT

CONCURRENCY = 16
LABEL_COUNTS = (10, 1000)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.zero_shot", description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--name", default="zero-shot-cpu")
    return p.parse_args()


def clip_checkpoint(folder: Path) -> Path:
    """A random-weight CLIP with a ViT-Ti-sized image tower, converted to this project's checkpoint."""
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPTokenizer

    from model.convert.__main__ import main as convert_main

    repo = folder / "clip"
    tokenizer = CLIPTokenizer(*(str(p) for p in clip_vocabulary(folder / "bpe")))
    config = CLIPConfig(
        text_config=dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4),
        vision_config=dict(
            image_size=224,
            patch_size=16,
            hidden_size=192,
            intermediate_size=768,
            num_hidden_layers=12,
            num_attention_heads=3,
        ),
        projection_dim=256,
    )
    torch.manual_seed(0)
    for part in (CLIPModel(config).eval(), tokenizer, CLIPImageProcessor()):
        part.save_pretrained(repo)
    return convert_main(["hf", "--model-dir", str(repo), "--output", str(folder / "clip.safetensors")])


def linear_head(zero_shot: Path, classes: int, out: Path) -> Path:
    """The zero-shot checkpoint's image tower with a random linear head of `classes` in place of its projection."""
    source = load_checkpoint(zero_shot)
    model = ViT(replace(source.config, num_classes=classes))
    state = {k: v for k, v in source.model.state_dict().items() if not k.startswith("head.")}
    missing, _ = model.load_state_dict(state, strict=False)
    assert all(k.startswith("head.") for k in missing), missing
    save_checkpoint(out, model, [f"c{i}" for i in range(classes)], source.preprocessing, source.training)
    return out


def jpeg() -> bytes:
    buf = io.BytesIO()
    make_sample(9000, 3).image.resize((500, 375)).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def measure(checkpoint: Path, query: str, body: Path, content_type: str, seconds: float) -> dict[str, Any]:
    with Server(checkpoint, VIT_LOG_LEVEL="warning") as server:
        url = f"{server.url}/predict?{query}"
        start_hey(url, 3, CONCURRENCY, body, content_type).communicate()  # warm: the labels' text pass
        cpu = server.cpu_seconds()
        per_s, errors, answered = rate(start_hey(url, seconds, CONCURRENCY, body, content_type).communicate()[0])
        cpu = server.cpu_seconds() - cpu
    return {"per_s": round(per_s, 1), "errors": errors, "cpu_ms": round(cpu / max(answered, 1) * 1e3, 2)}


def main() -> None:
    args = parse_args()
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        clip = clip_checkpoint(folder)
        data, content_type = multipart(jpeg(), "photo.jpg", "image/jpeg")
        body = folder / "photo.body"
        body.write_bytes(data)
        heads = {n: linear_head(clip, n, folder / f"linear-{n}.safetensors") for n in LABEL_COUNTS}
        for round_ in range(args.rounds):
            for n in LABEL_COUNTS:
                labels = urlencode({"labels": ",".join(f"c{i}" for i in range(n)), "top_k": 5})
                for kind, checkpoint, query in (("linear head", heads[n], "top_k=5"), ("zero-shot", clip, labels)):
                    run = {
                        "round": round_,
                        "classes": n,
                        "kind": kind,
                        **measure(checkpoint, query, body, content_type, args.seconds),
                    }
                    print(run, flush=True)
                    runs.append(run)
    report = {"cpu_count": os.cpu_count(), "concurrency": CONCURRENCY, "seconds": args.seconds, "runs": runs}
    write_results(args.name, report, markdown(report))


def markdown(report: dict[str, Any]) -> str:
    rows = []
    for n in LABEL_COUNTS:
        for kind in ("linear head", "zero-shot"):
            mine = [r for r in report["runs"] if r["classes"] == n and r["kind"] == kind]
            rows.append((n, kind, mine))
    lines = [
        f"# Zero-shot serving on the CPU ({report['cpu_count']} cores)",
        "",
        "`python -m bench.zero_shot`: a random-weight CLIP (ViT-Ti-sized image tower at 224 px) beside its own image "
        "tower with a linear head of as many classes, `/predict` with one 500x375 JPEG at concurrency "
        f"{report['concurrency']}, {report['seconds']:.0f} s per run, rounds alternating; the labels named in the "
        "query and kept after the warm-up. Server CPU per request is user + system time over requests answered.",
        "",
        *table(
            ["classes", "model", "req/s per round", "errors", "server CPU per request", "req/s : linear head"],
            [
                [
                    n,
                    kind,
                    ", ".join(f"{r['per_s']:.1f}" for r in mine),
                    sum(r["errors"] for r in mine),
                    ", ".join(f"{r['cpu_ms']:.2f} ms" for r in mine),
                    ratio(report, n, mine),
                ]
                for n, kind, mine in rows
            ],
        ),
        "",
    ]
    return "\n".join(lines)


def ratio(report: dict[str, Any], n: int, mine: list[dict[str, Any]]) -> str:
    """Each round's rate over the linear head's in the same round."""
    linear = {r["round"]: r["per_s"] for r in report["runs"] if r["classes"] == n and r["kind"] == "linear head"}
    return ", ".join(f"{r['per_s'] / linear[r['round']]:.2f}" for r in mine if linear.get(r["round"]))


if __name__ == "__main__":
    main()
