"""The text tower of a contrastive image-text model (CLIP, SigLIP), in one file.

Token and position embeddings, pre-norm blocks (causal in CLIP, which reads one token at the end of the text;
bidirectional in SigLIP), a final LayerNorm, one token read out, and a projection into the space the image
tower's embeddings share. The blocks are the ViT's (`model.vit.Attention`, `model.vit.MLP`).

Whether padding is read depends on where the weights run: transformers' SigLIP masks the padding its tokenizer
marks, the original (big_vision, open_clip) reads every position; `mask_padding` keeps each source's rule.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any, Literal, get_args

import torch
from torch import Tensor, nn

from model.vit import MLP, Activation, Attention

TextPool = Literal["eos", "argmax", "last"]


@dataclass(frozen=True)
class TextConfig:
    vocab_size: int = 49408
    context_length: int = 77  # positions: the longest token sequence the tower reads
    dim: int = 512  # token width
    depth: int = 12
    heads: int = 8
    mlp_ratio: float = 4.0
    activation: Activation = "quick_gelu"  # OpenAI CLIP's; SigLIP's is gelu_tanh
    norm_eps: float = 1e-5
    causal: bool = True  # each token attends to those before it (CLIP); SigLIP's attend both ways
    pool: TextPool = "eos"  # the token read out: the first `eos_token_id` (CLIP), the highest id (the original
    # CLIP's end-of-text token has the highest id), or the last position (SigLIP, padded to context_length)
    eos_token_id: int = 49407
    embed_dim: int = 512  # width of the joint image-text space
    proj_bias: bool = False  # CLIP's projection has none; SigLIP's head has one
    mask_padding: bool = False  # no token reads the padding after a text (transformers' rule); else every one does

    def __post_init__(self) -> None:
        if min(self.vocab_size, self.context_length, self.dim, self.depth, self.heads, self.embed_dim) <= 0:
            raise ValueError(f"text tower sizes must be positive: {self}")
        if self.dim % self.heads != 0:
            raise ValueError(f"text dim {self.dim} is not divisible by heads {self.heads}")
        if self.pool not in get_args(TextPool):
            raise ValueError(f"pool must be one of {get_args(TextPool)}, got {self.pool!r}")
        if self.activation not in get_args(Activation) or self.activation == "swiglu":
            raise ValueError(
                f"the text tower's activation must be gelu, gelu_tanh or quick_gelu, got {self.activation!r}"
            )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TextConfig:
        unknown = set(d) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"unknown TextConfig fields: {sorted(unknown)}")
        return cls(**d)


class TextBlock(nn.Module):
    """x + attn(LN(x)), then x + MLP(LN(x))."""

    def __init__(self, c: TextConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(c.dim, eps=c.norm_eps)
        self.attn = Attention(c.dim, c.heads)
        self.ln_2 = nn.LayerNorm(c.dim, eps=c.norm_eps)
        self.mlp = MLP(c.dim, int(c.dim * c.mlp_ratio), activation=c.activation)

    def forward(self, x: Tensor, mask: Tensor | None) -> Tensor:
        x = x + self.attn(self.ln_1(x), mask=mask)[0]
        return x + self.mlp(self.ln_2(x))


class TextTransformer(nn.Module):
    def __init__(self, config: TextConfig) -> None:
        super().__init__()
        self.config = c = config
        self.token_embed = nn.Embedding(c.vocab_size, c.dim)
        self.pos_embed = nn.Parameter(torch.zeros(c.context_length, c.dim))
        self.blocks = nn.ModuleList([TextBlock(c) for _ in range(c.depth)])
        self.norm = nn.LayerNorm(c.dim, eps=c.norm_eps)
        self.proj = nn.Linear(c.dim, c.embed_dim, bias=c.proj_bias)
        nn.init.normal_(self.token_embed.weight, std=0.02)
        nn.init.normal_(self.pos_embed, std=0.01)

    def forward(self, ids: Tensor, lengths: Tensor | None = None) -> Tensor:
        """Token ids (B, T), T <= context_length, each row ending as the tokenizer ends it, and each row's length
        before its padding (B,) (None: no padding) -> embeddings (B, embed_dim), not normalised."""
        T = ids.shape[1]
        x = self.token_embed(ids) + self.pos_embed[:T]  # (B, T, dim)
        mask = self.mask(T, lengths, ids.device)
        for block in self.blocks:
            x = block(x, mask)
        x = self.norm(x)
        return self.proj(x[torch.arange(x.shape[0], device=x.device), self.readout(ids)])  # (B, embed_dim)

    def mask(self, T: int, lengths: Tensor | None, device: torch.device) -> Tensor | None:
        """(B or 1, 1, T, T), -inf where a query may not read a key: a later token (causal), or the padding."""
        allowed = torch.ones(1, 1, T, T, dtype=torch.bool, device=device)
        if self.config.causal:
            allowed = allowed.tril()
        if self.config.mask_padding and lengths is not None:
            keys = torch.arange(T, device=device) < lengths.to(device)[:, None]  # (B, T)
            allowed = allowed & keys[:, None, None, :]
        if bool(allowed.all()):
            return None
        return torch.zeros(allowed.shape, device=device).masked_fill(~allowed, float("-inf"))

    def readout(self, ids: Tensor) -> Tensor:
        """(B,) the position each row is read at."""
        c = self.config
        if c.pool == "last":
            return torch.full((ids.shape[0],), ids.shape[1] - 1, dtype=torch.long, device=ids.device)
        if c.pool == "argmax":
            return ids.argmax(dim=-1)
        return (ids == c.eos_token_id).int().argmax(dim=-1)  # the first end-of-text token
