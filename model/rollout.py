"""Attention maps from a ViT's per-layer attention weights.

`attention_rollout` follows Abnar & Zuidema (2020), "Quantifying Attention Flow in Transformers":
fuse the heads, add the identity for the residual path, renormalise each row, and multiply the
layers together. `last_layer_attention` is the plain CLS-to-patch attention of the final block.
Both return (B, grid_h, grid_w) maps scaled to [0, 1] per image.

Models with register tokens or without a CLS token are read out the way they classify: the
prefix tokens (CLS, registers) are skipped over, and an average-pooled model's map is the mean
relevance over the patch tokens' rows, since its prediction is made from their mean.

Axial models have two attention layers per block, along the rows and then the columns. For `rollout`
and `last` each block's two are composed into one token-to-token matrix, column attention after
row attention (heads fused first: the row and column layers' heads are unrelated): a token reaches
any patch through one row step and one column step, as information flows in the block.

`gradient_attention_map` answers "why this class": gradient-weighted attention rollout (Chefer, Gur
& Wolf, "Generic Attention-model Explainability", ICCV 2021, the gradient form of their CVPR 2021
"Transformer Interpretability Beyond Attention Visualization"). Each attention layer's weights A
are weighted by the gradient of the target class's logit, negatives dropped and heads averaged,
A_bar = mean_h((dy_t/dA * A)^+), and relevance accumulates through the layers as R <- R + A_bar R
from R = I. It costs one forward pass on the explicit attention path plus one backward pass to the
attention weights; every image in a batch gets its own target and its own map.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Protocol, get_args

import torch
from torch import Tensor

HeadFusion = Literal["mean", "max", "min"]
WeightMethod = Literal["rollout", "last"]  # from the attention weights alone: attention_map
MapMethod = Literal[WeightMethod, "gradient"]  # gradient: class-specific, gradient_attention_map
MAP_METHODS: tuple[str, ...] = get_args(MapMethod)
ATTENTION_METHODS: tuple[str, ...] = get_args(WeightMethod)
GRADIENT = "gradient"


@dataclass(frozen=True)
class Readout:
    """Where a model's prediction is read from: the CLS row, the mean of the patch rows, or, with attention
    pooling ("map"), the pooling query's attention over the tokens (the last of a model's attention layers)."""

    prefix_tokens: int = 1  # CLS and register tokens before the patches
    pool: str = "cls"  # "cls", "avg" or "map"
    axial: bool = False  # two attention layers per block (rows, then columns)
    read_tokens: int = 1  # with pool "cls": the leading tokens the heads read (2: CLS and DeiT's distillation token)

    def row(self, relevance: Tensor, pooling: Tensor | None = None) -> Tensor:
        """(B, T, T) token-to-token relevance -> (B, N) relevance of each patch to the prediction; with
        attention pooling, `pooling` (B, 1, K) is the query's row over the last K tokens it reads (the patches, or
        every token)."""
        if self.pool == "map":
            if pooling is None:
                raise ValueError("a model that pools by attention reads its maps through the pooling's weights")
            rows = (pooling @ relevance[:, relevance.shape[1] - pooling.shape[-1] :])[:, 0]
        elif self.pool == "cls":
            rows = relevance[:, 0] if self.read_tokens == 1 else relevance[:, : self.read_tokens].mean(dim=1)
        else:
            rows = relevance[:, self.prefix_tokens :].mean(dim=1)
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


def block_attention(attentions: list[Tensor], head_fusion: HeadFusion, readout: Readout) -> list[Tensor]:
    """Per-layer (B, heads, T, T) weights -> one fused (B, T, T) matrix per block (axial: columns after rows)."""
    fused = [fuse_heads(a.float(), head_fusion) for a in attentions]
    if not readout.axial:  # (with attention pooling its (B, 1, T) weights come last, as they are)
        return fused
    if len(fused) % 2:
        raise ValueError(f"an axial model has two attention layers per block, got {len(fused)}")
    return [col @ row for row, col in zip(fused[0::2], fused[1::2], strict=True)]


def attention_rollout(
    attentions: list[Tensor], head_fusion: HeadFusion = "mean", discard_ratio: float = 0.0, readout: Readout = CLS
) -> Tensor:
    """Roll attention out through all blocks -> (B, grid, grid) patch relevance in [0, 1]."""
    if not attentions:
        raise ValueError("attention_rollout needs at least one layer of attention weights")
    if not 0.0 <= discard_ratio < 1.0:
        raise ValueError(f"discard_ratio must be in [0, 1), got {discard_ratio}")
    B, _, N, _ = attentions[0].shape
    eye = torch.eye(N, dtype=torch.float32, device=attentions[0].device)
    result = eye.expand(B, N, N)
    blocks = block_attention(attentions, head_fusion, readout)
    pooling = blocks.pop() if readout.pool == "map" else None  # the pooling query reads the rolled-out tokens
    for block in blocks:
        a = discard_lowest(block, discard_ratio) + eye  # the residual connection carries each token to itself
        a = a / a.sum(dim=-1, keepdim=True)
        result = a @ result
    return to_grid(readout.row(result, pooling))


def last_layer_attention(attentions: list[Tensor], head_fusion: HeadFusion = "mean", readout: Readout = CLS) -> Tensor:
    """Final block's attention from the readout token(s) to the patches -> (B, grid, grid) in [0, 1]."""
    if not attentions:
        raise ValueError("last_layer_attention needs at least one layer of attention weights")
    last = block_attention(attentions, head_fusion, readout)[-1]
    if readout.pool == "map":  # the pooling's own attention over the tokens
        tokens = attentions[0].shape[-1]
        eye = torch.eye(tokens, dtype=torch.float32, device=last.device).expand(last.shape[0], -1, -1)
        return to_grid(readout.row(eye, last))
    return to_grid(readout.row(last))


def gradient_rollout(attentions: list[Tensor], gradients: list[Tensor], readout: Readout = CLS) -> Tensor:
    """Class-specific relevance from each layer's weights and their gradients -> (B, grid, grid) in [0, 1]."""
    if not attentions or len(attentions) != len(gradients):
        raise ValueError(f"need one gradient per attention layer, got {len(gradients)} for {len(attentions)}")
    B, _, N, _ = attentions[0].shape
    relevance = torch.eye(N, dtype=torch.float32, device=attentions[0].device).expand(B, N, N)
    pooling = None
    for a, g in zip(attentions, gradients, strict=True):  # axial layers one after another, as they run
        weighted = (g.float() * a.float()).clamp_min(0).mean(dim=1)  # (B, N, N); attention pooling's (B, 1, N)
        if weighted.shape[1] != N:
            pooling = weighted
            continue
        relevance = relevance + weighted @ relevance
    return to_grid(readout.row(relevance, pooling))


class AttentionModel(Protocol):
    @property
    def readout(self) -> Readout: ...

    def forward_with_attention(self, x: Tensor) -> tuple[Tensor, list[Tensor]]: ...


def gradient_attention_map(model: AttentionModel, x: Tensor, targets: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Logits (B, classes) and each image's map for its target class (default: its top-1) -> (B, g, g).

    Runs with gradients enabled (outside inference mode); only the attention weights get gradients.
    """
    with torch.enable_grad():
        logits, attentions = model.forward_with_attention(x.detach())
        chosen = logits.argmax(dim=1) if targets is None else targets.to(logits.device)
        score = logits.gather(1, chosen[:, None]).sum()  # images are independent: one backward serves all
        gradients = torch.autograd.grad(score, attentions)
    maps = gradient_rollout([a.detach() for a in attentions], [g.detach() for g in gradients], model.readout)
    return logits.detach(), maps


def attention_map(attentions: list[Tensor], method: str, readout: Readout = CLS) -> Tensor:
    """Dispatch by name: 'rollout' or 'last' (class-specific maps need gradients: gradient_attention_map)."""
    if method == "rollout":
        return attention_rollout(attentions, readout=readout)
    if method == "last":
        return last_layer_attention(attentions, readout=readout)
    raise ValueError(f"attention method must be one of {ATTENTION_METHODS}, got {method!r}")
