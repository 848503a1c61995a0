"""A text tower's tokenizer, carried in its checkpoint as bytes: no network and no transformers at serving time.

Two kinds, as the hub's repositories hold them:
- `tokenizers`: a `tokenizer.json` (CLIP's byte-level BPE; SigLIP 2's Gemma tokenizer), read by the
  `tokenizers` library with its own normaliser and special tokens;
- `sentencepiece`: a SentencePiece model (SigLIP's `spiece.model`), with its end-of-text token after it, as
  transformers' `SiglipTokenizer` uses it.

SigLIP's texts are canonicalised first (big_vision's rule: lower case, punctuation removed, runs of white space
made one space), by transformers' SentencePiece tokenizer and by open_clip alike.

Every text ends with its end-of-text token (cut to `context_length` first). Texts are padded with `pad_token_id`
to the longest of the batch, or to `context_length` for a tower that reads the last position (SigLIP).
"""

from __future__ import annotations

import re
import string
from dataclasses import asdict, dataclass, fields
from typing import Any, Literal, get_args

import torch
from torch import Tensor

TokenizerKind = Literal["tokenizers", "sentencepiece"]
SPIECE_UNDERLINE = "\u2581"  # SentencePiece's word boundary
PUNCTUATION = str.maketrans("", "", string.punctuation)


@dataclass(frozen=True)
class TokenizerConfig:
    kind: TokenizerKind
    context_length: int
    pad_token_id: int
    eos_token_id: int  # sentencepiece: appended to every text (a tokenizer.json adds its own)
    pad_to_context: bool = False  # every text padded to context_length (a tower that reads the last position)
    canonicalize: bool = False  # SigLIP's canonical text first (punctuation removed, white space made one space)
    lowercase: bool = True  # canonical text is lower case too
    underscores: bool = False  # canonical text has "_" made a space first (open_clip's), not dropped (transformers')
    unk_token: str = "<unk>"  # sentencepiece: the prefix transformers encodes each text after, then drops

    def __post_init__(self) -> None:
        if self.kind not in get_args(TokenizerKind):
            raise ValueError(f"tokenizer kind must be one of {get_args(TokenizerKind)}, got {self.kind!r}")
        if self.context_length < 2:
            raise ValueError(f"context_length must be at least 2, got {self.context_length}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TokenizerConfig:
        unknown = set(d) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"unknown TokenizerConfig fields: {sorted(unknown)}")
        return cls(**d)


class TextTokenizer:
    """Texts -> token ids (B, T) for the text tower, from the tokenizer file's bytes and its config."""

    def __init__(self, config: TokenizerConfig, data: bytes) -> None:
        self.config, self.data = config, data
        try:
            if config.kind == "tokenizers":
                from tokenizers import Tokenizer

                self._fast = Tokenizer.from_str(data.decode("utf-8"))
                self._fast.no_padding()
                self._fast.enable_truncation(config.context_length)
            else:
                import sentencepiece

                self._sp = sentencepiece.SentencePieceProcessor(model_proto=data)
                self._unk_pieces = len(self._sp.encode(config.unk_token, out_type=str))
        except Exception as e:  # each library raises its own types for a file it cannot read
            raise ValueError(f"the {config.kind} tokenizer file cannot be read ({type(e).__name__}: {e})") from e

    def ids(self, text: str) -> list[int]:
        """One text's token ids, special tokens included, at most context_length of them."""
        limit = self.config.context_length
        if self.config.kind == "tokenizers":
            return list(self._fast.encode(self.canonical(text) if self.config.canonicalize else text).ids)[:limit]
        # transformers puts a word boundary first, canonicalises, and encodes after a prefix it then drops
        text = SPIECE_UNDERLINE + text.replace(SPIECE_UNDERLINE, " ")
        text = self.canonical(text) if self.config.canonicalize else text
        pieces = self._sp.encode(self.config.unk_token + text, out_type=str)[self._unk_pieces :]
        ids = [self._sp.piece_to_id(p) for p in pieces][: limit - 1]
        return [*ids, self.config.eos_token_id]

    def canonical(self, text: str) -> str:
        """SigLIP's canonical text (big_vision's)."""
        if self.config.underscores:
            text = text.replace("_", " ")
        if self.config.lowercase:
            text = text.lower()
        return re.sub(r"\s+", " ", text.translate(PUNCTUATION)).strip()

    def __call__(self, texts: list[str]) -> tuple[Tensor, Tensor]:
        """Token ids (B, T), padded, and each text's length before its padding (B,)."""
        rows = [self.ids(t) for t in texts]
        width = self.config.context_length if self.config.pad_to_context else max(len(r) for r in rows)
        out = torch.full((len(rows), width), self.config.pad_token_id, dtype=torch.long)
        for i, row in enumerate(rows):
            out[i, : len(row)] = torch.tensor(row, dtype=torch.long)
        return out, torch.tensor([len(r) for r in rows], dtype=torch.long)
