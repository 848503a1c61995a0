"""Attention maps from a ViT's per-layer attention weights.

`attention_rollout` follows Abnar & Zuidema (2020), "Quantifying Attention Flow in Transformers":
fuse the heads, add the identity for the residual path, renormalise each row, and multiply the
layers together. `last_layer_attention` is the plain CLS-to-patch attention of the final block.
Both return (B, grid_h, grid_w) maps scaled to [0, 1] per image.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor

HeadFusion = Literal["mean", "max", "min"]
ATTENTION_METHODS: tuple[str, ...] = ("rollout", "last")


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


def cls_to_grid(cls_row: Tensor) -> Tensor:
    """(B, 1 + N) CLS attention row -> (B, g, g) map over the patch grid, scaled to [0, 1]."""
    patches = cls_row[:, 1:]
    grid = math.isqrt(patches.shape[1])
    if grid * grid != patches.shape[1]:
        raise ValueError(f"{patches.shape[1]} patch tokens do not form a square grid")
    return scale_to_unit(patches.reshape(-1, grid, grid))


def attention_rollout(attentions: list[Tensor], head_fusion: HeadFusion = "mean", discard_ratio: float = 0.0) -> Tensor:
    """Roll attention out through all layers -> (B, grid, grid) CLS-to-patch relevance in [0, 1]."""
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
    return cls_to_grid(result[:, 0])


def last_layer_attention(attentions: list[Tensor], head_fusion: HeadFusion = "mean") -> Tensor:
    """CLS-to-patch attention of the final layer -> (B, grid, grid) in [0, 1]."""
    if not attentions:
        raise ValueError("last_layer_attention needs at least one layer of attention weights")
    return cls_to_grid(fuse_heads(attentions[-1].float(), head_fusion)[:, 0])


def attention_map(attentions: list[Tensor], method: str) -> Tensor:
    """Dispatch by name: 'rollout' or 'last'."""
    if method == "rollout":
        return attention_rollout(attentions)
    if method == "last":
        return last_layer_attention(attentions)
    raise ValueError(f"attention method must be one of {ATTENTION_METHODS}, got {method!r}")
