"""OpenAI CLIP's tokenizer files made offline, for tests and benchmarks that build CLIP models with random weights."""

from __future__ import annotations

import gzip
import json
from pathlib import Path


def clip_vocabulary(folder: Path) -> tuple[Path, Path]:
    """OpenAI CLIP's own BPE (the file open_clip ships) as vocab.json and merges.txt, as the hub's CLIP repos hold
    them: 49,408 tokens, <|startoftext|> 49406 and <|endoftext|> 49407."""
    import open_clip.tokenizer as oct

    with gzip.open(oct.default_bpe(), "rt", encoding="utf-8") as f:
        lines = f.read().split("\n")[1 : 49152 - 256 - 2 + 1]
    merges = [tuple(line.split()) for line in lines]
    symbols = list(oct.bytes_to_unicode().values())
    vocab = (
        symbols + [s + "</w>" for s in symbols] + ["".join(m) for m in merges] + ["<|startoftext|>", "<|endoftext|>"]
    )
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.json").write_text(json.dumps({t: i for i, t in enumerate(vocab)}), encoding="utf-8")
    (folder / "merges.txt").write_text(
        "#version: 0.2\n" + "\n".join(" ".join(m) for m in merges) + "\n", encoding="utf-8"
    )
    return folder / "vocab.json", folder / "merges.txt"
