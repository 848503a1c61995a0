"""Attention maps from a ViT's per-layer attention weights.

`attention_rollout` follows Abnar & Zuidema (2020), "Quantifying Attention Flow in Transformers":
fuse the heads, add the identity for the residual path, renormalise each row, and multiply the
layers together. `last_layer_attention` is the plain CLS-to-patch attention of the final block.
Both return (B, grid_h, grid_w) maps scaled to [0, 1] per image.

Models with register tokens or without a CLS token are read out the way they classify: the
prefix tokens (CLS, registers) are skipped over, and an average-pooled model's map is the mean
relevance over the patch tokens' rows, since its prediction is made from their mean.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

HeadFusion = Literal["mean", "max", "min"]
ATTENTION_METHODS: tuple[str, ...] = ("rollout", "last")


@dataclass(frozen=True)
class Readout:
    """Where a model's prediction is read from: the CLS row, or the mean of the patch rows."""

    prefix_tokens: int = 1  # CLS and register tokens before the patches
    pool: str = "cls"  # "cls" or "avg"

    def row(self, relevance: Tensor) -> Tensor:
        """(B, T, T) token-to-token relevance -> (B, N) relevance of each patch to the prediction."""
        rows = relevance[:, 0] if self.pool == "cls" else relevance[:, self.prefix_tokens :].mean(dim=1)
        return rows[:, self.prefix_tokens :]


CLS = Readout()


def fuse_heads(attention: Tensor, fusion: HeadFusion = "mean") -> Tensor:
    """(B, heads, N, N) -> (B, N, N)."""
    if fusion == "mean":
        return attention.mean(dim=1)
    if fusion == "max":
        return attention.amax(dim=1)
    if fusion == "min":
        return attention.amin(dim=1)
    raise ValueError(f"head fusion must be 'mean', 'max' or 'min', got {fusion!r}")


def discard_lowest(attention: Tensor, ratio: float) -> Tensor:
    """Zero the lowest `ratio` of each sample's (N, N) entries, never the CLS-to-CLS entry."""
    B, N, _ = attention.shape
    k = int(N * N * ratio)
    if k == 0:
        return attention
    flat = attention.reshape(B, N * N).clone()
    candidates = flat.clone()
    candidates[:, 0] = float("inf")  # never chosen, so exactly k entries are discarded
    _, lowest = candidates.topk(k, dim=-1, largest=False)  # (B, k): chosen per sample
    return flat.scatter_(1, lowest, 0.0).reshape(B, N, N)


def scale_to_unit(maps: Tensor) -> Tensor:
    """Min-max scale each map (B, ...) to [0, 1]; a constant map becomes all zeros."""
    flat = maps.reshape(maps.shape[0], -1)
    lo = flat.amin(dim=1, keepdim=True)
    span = (flat.amax(dim=1, keepdim=True) - lo).clamp_min(1e-12)
    return ((flat - lo) / span).reshape(maps.shape)


def to_grid(patches: Tensor) -> Tensor:
    """(B, N) relevance of each patch -> (B, g, g) map over the patch grid, scaled to [0, 1]."""
    grid = math.isqrt(patches.shape[1])
    if grid * grid != patches.shape[1]:
        raise ValueError(f"{patches.shape[1]} patch tokens do not form a square grid")
    return scale_to_unit(patches.reshape(-1, grid, grid))


def attention_rollout(
    attentions: list[Tensor], head_fusion: HeadFusion = "mean", discard_ratio: float = 0.0, readout: Readout = CLS
) -> Tensor:
    """Roll attention out through all layers -> (B, grid, grid) patch relevance in [0, 1]."""
    if not attentions:
        raise ValueError("attention_rollout needs at least one layer of attention weights")
    if not 0.0 <= discard_ratio < 1.0:
        raise ValueError(f"discard_ratio must be in [0, 1), got {discard_ratio}")
    B, _, N, _ = attentions[0].shape
    eye = torch.eye(N, dtype=torch.float32, device=attentions[0].device)
    result = eye.expand(B, N, N)
    for attention in attentions:
        fused = discard_lowest(fuse_heads(attention.float(), head_fusion), discard_ratio)  # (B, N, N)
        a = fused + eye  # the residual connection carries each token to itself
        a = a / a.sum(dim=-1, keepdim=True)
        result = a @ result
    return to_grid(readout.row(result))


def last_layer_attention(attentions: list[Tensor], head_fusion: HeadFusion = "mean", readout: Readout = CLS) -> Tensor:
    """Final layer's attention from the readout token(s) to the patches -> (B, grid, grid) in [0, 1]."""
    if not attentions:
        raise ValueError("last_layer_attention needs at least one layer of attention weights")
    return to_grid(readout.row(fuse_heads(attentions[-1].float(), head_fusion)))


def attention_map(attentions: list[Tensor], method: str, readout: Readout = CLS) -> Tensor:
    """Dispatch by name: 'rollout' or 'last'."""
    if method == "rollout":
        return attention_rollout(attentions, readout=readout)
    if method == "last":
        return last_layer_attention(attentions, readout=readout)
    raise ValueError(f"attention method must be one of {ATTENTION_METHODS}, got {method!r}")
