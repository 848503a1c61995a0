"""timm `Eva` -> our ViT: EVA-02, the rotary ViTs (RoPE-ViT, RoPE-Mixed, the `*_rope_*` models) and Perception
Encoder, whose blocks are our pre-norm blocks with rotary positions, SwiGLU and sub-LayerNorms."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from model.convert.converted import mlp_ratio, unsupported
from model.convert.timm_parts import (
    block_state,
    check_attention_pool,
    check_patch_embed,
    geometry,
    layer_norm_eps,
    mlp_hidden,
    mlp_kind,
    pool_heads,
    qkv_weight_and_bias,
)
from model.vit import Pool, Rope, ViTConfig

POOLS: dict[str, Pool] = {"token": "cls", "avg": "avg", "map": "map"}  # timm's global_pool -> ours
ROPES: dict[str, Rope] = {  # timm's rotary modules that give one table per model, or one per block and head
    "RotaryEmbeddingCat": "axial",
    "RotaryEmbeddingDinoV3": "axial",
    "RotaryEmbeddingMixed": "mixed",
}


def eva_config(m: Any) -> ViTConfig:
    """Our config for a timm Eva; raises ConversionError naming the first feature we lack."""
    from timm.layers.attention import AttentionRope
    from timm.models.eva import EvaAttention, EvaBlock

    if m.global_pool not in POOLS:
        raise unsupported(f"global_pool={m.global_pool!r} (token, avg and map are supported)")
    if getattr(m, "patch_drop", None) is not None:
        raise unsupported("patch dropout at inference")
    check_patch_embed(m.patch_embed)
    if not isinstance(m.head, nn.Linear):
        raise unsupported("no classification head (num_classes=0)", "convert a model with a head")
    blocks: list[Any] = list(m.blocks)
    for b in blocks:  # before any block's parts are read: other block types have other parts
        if type(b) is not EvaBlock:
            raise unsupported(f"the block type {type(b).__name__} (EVA's pre-norm blocks convert)")
    first = blocks[0]
    dim, heads = int(m.embed_dim), int(first.attn.num_heads)
    norms: list[nn.Module] = [m.norm_pre, m.norm, m.fc_norm]
    for i, b in enumerate(blocks):
        a = b.attn
        if type(a) not in (EvaAttention, AttentionRope):
            raise unsupported(f"block {i}: attention of type {type(a).__name__}")
        if getattr(a, "gate", None) is not None:
            raise unsupported(f"block {i}: gated attention")
        if getattr(a, "num_kv_heads", heads) != heads or a.head_dim * heads != dim or a.num_heads != heads:
            raise unsupported(f"block {i}: grouped-query attention or a head width other than dim / heads")
        if bool(getattr(a, "rotate_half", False)) != bool(getattr(first.attn, "rotate_half", False)):
            raise unsupported("rotary layouts that differ between blocks")
        for part, name in ((a.q_norm, "qk-norm"), (getattr(a, "norm", nn.Identity()), "a norm inside attention")):
            twin = first.attn.q_norm if name == "qk-norm" else getattr(first.attn, "norm", nn.Identity())
            if isinstance(part, nn.Identity) != isinstance(twin, nn.Identity):
                raise unsupported(f"{name} on some blocks only")
            if not isinstance(part, nn.Identity):
                norms.append(part)
        if not isinstance(a.q_norm, nn.Identity):
            norms.append(a.k_norm)
        if (b.gamma_1 is None) != (b.gamma_2 is None) or (b.gamma_1 is None) != (first.gamma_1 is None):
            raise unsupported(f"block {i}: layer scale on one branch or some blocks only")
        if mlp_kind(b.mlp) != mlp_kind(first.mlp) or mlp_hidden(b.mlp) != mlp_hidden(first.mlp):
            raise unsupported("MLPs that differ between blocks")
        if isinstance(b.mlp.norm, nn.Identity) != isinstance(first.mlp.norm, nn.Identity):
            raise unsupported("an MLP norm on some blocks only")
        norms += [b.norm1, b.norm2, b.mlp.norm]
    if not isinstance(m.norm, nn.Identity) and not isinstance(m.fc_norm, nn.Identity):
        raise unsupported("a final norm over all tokens and another after pooling")
    if isinstance(m.norm, nn.Identity) and isinstance(m.fc_norm, nn.Identity):
        raise unsupported("no final norm")
    if m.global_pool == "map":
        norms.append(check_attention_pool(m.attn_pool, mlp_hidden(first.mlp), mlp_kind(first.mlp)))
    rope = rope_kind(m.rope)
    eps = layer_norm_eps([n for n in norms if not isinstance(n, nn.Identity)])
    return ViTConfig(
        **geometry(m),
        dim=dim,
        depth=len(blocks),
        heads=heads,
        mlp_ratio=mlp_ratio(dim, mlp_hidden(first.mlp)),
        pos_embed="learned" if m.pos_embed is not None else "none",
        norm_eps=eps,
        qkv_bias=qkv_weight_and_bias(first.attn)[1] is not None,
        class_token=m.cls_token is not None,
        reg_tokens=int(m.reg_token.shape[1]) if m.reg_token is not None else 0,
        no_embed_class=bool(m.no_embed_class),
        pool=POOLS[m.global_pool],
        pool_heads=pool_heads(m),
        pool_prefix=m.global_pool == "map",  # Eva's attention pooling reads every token
        fc_norm=isinstance(m.fc_norm, nn.LayerNorm),
        layer_scale=first.gamma_1 is not None,
        pre_norm=isinstance(m.norm_pre, nn.LayerNorm),
        activation=mlp_kind(first.mlp),
        mlp_norm=not isinstance(first.mlp.norm, nn.Identity),
        attn_norm=not isinstance(getattr(first.attn, "norm", nn.Identity()), nn.Identity),
        qk_norm=not isinstance(first.attn.q_norm, nn.Identity),
        rope=rope,
        rope_half=bool(getattr(first.attn, "rotate_half", False)),
    )


def rope_kind(rope: nn.Module | None) -> Rope:
    if rope is None:
        return "none"
    kind = ROPES.get(type(rope).__name__)
    if kind is None:
        raise unsupported(f"rotary embeddings of type {type(rope).__name__}")
    return kind


def rope_table(m: Any) -> Tensor:
    """timm's rotary table for the model's own grid: (N, 2 * head_dim), or (depth, heads, N, 2 * head_dim)."""
    if getattr(m.rope, "feat_shape", None) is not None:
        return m.rope.get_embed().float()
    return m.rope.get_embed(shape=list(m.patch_embed.grid_size)).float()


def eva_state(m: Any, config: ViTConfig) -> dict[str, Tensor]:
    """Our state dict from a timm Eva's modules."""
    state: dict[str, Tensor] = {}
    own = m.state_dict()
    for key, value in own.items():  # the parts outside the blocks are named as ours
        if not key.startswith(("blocks.", "rope.")):
            state[key] = value
    if m.patch_embed.proj.bias is None:  # bias-free patch embedding (Perception Encoder): a zero bias is the same
        state["patch_embed.proj.bias"] = torch.zeros(config.dim)
    if config.rope != "none":
        state["rope"] = rope_table(m)
    for i, b in enumerate(m.blocks):
        state |= block_state(b, f"blocks.{i}.", (b.gamma_1, b.gamma_2))
    return state
