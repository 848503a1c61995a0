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
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import torch

from bench.common import multipart, write_results
from bench.rounds import alternated, loaded, rounds_table
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


def main() -> None:
    args = parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        clip = clip_checkpoint(folder)
        data, content_type = multipart(jpeg(), "photo.jpg", "image/jpeg")
        body = folder / "photo.body"
        body.write_bytes(data)
        servers = {}
        for n in LABEL_COUNTS:
            labels = urlencode({"labels": ",".join(f"c{i}" for i in range(n)), "top_k": 5})
            servers[f"{n}, linear head"] = (linear_head(clip, n, folder / f"linear-{n}.safetensors"), "top_k=5")
            servers[f"{n}, zero-shot"] = (clip, labels)

        def run(name: str) -> dict[str, Any]:
            checkpoint, query = servers[name]
            with Server(checkpoint, VIT_LOG_LEVEL="warning") as server:  # the warm-up runs the labels' text pass
                measured = loaded(server, f"/predict?{query}", body, content_type, CONCURRENCY, args.seconds, warm=3)
            print(name, measured, flush=True)
            return measured

        runs = alternated(list(servers), args.rounds, run)
    report = {"concurrency": CONCURRENCY, "seconds": args.seconds, "runs": runs}
    write_results(args.name, report, markdown(report))


def markdown(report: dict[str, Any]) -> str:
    lines = [
        "# Zero-shot serving on the CPU",
        "",
        "A random-weight CLIP (ViT-Ti-sized image tower at 224 px) beside its own image tower with a linear head of "
        f"as many classes, `/predict` with one 500x375 JPEG at concurrency {report['concurrency']}, "
        f"{report['seconds']:.0f} s per run, rounds alternating; the labels named in the query and kept after the "
        "warm-up. Server CPU per request is user + system time over requests answered.",
    ]
    for n in LABEL_COUNTS:
        runs = {k: v for k, v in report["runs"].items() if k.startswith(f"{n},")}
        lines += ["", *rounds_table(runs, "classes, model")]
    return "\n".join([*lines, ""])


if __name__ == "__main__":
    main()
