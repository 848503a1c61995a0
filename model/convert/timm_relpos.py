"""timm's relative-position ViTs -> our ViT: `Beit` (BEiT, BEiT v2) and `VisionTransformerRelPos` (the `vit_relpos_*`
models, whose bias comes from a table or from a small MLP over log-spaced offsets). Each block's bias is read whole
from timm, (heads, P + N, P + N), and kept as our table of one value per head and relative offset: the conversion
fails unless the bias depends on the offset alone, so the table gives back exactly the bias timm adds."""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from model.convert.converted import mlp_ratio, unsupported
from model.convert.timm_parts import (
    block_state,
    check_patch_embed,
    geometry,
    layer_norm_eps,
    layer_scales,
    mlp_hidden,
    mlp_kind,
    qkv_weight_and_bias,
)
from model.vit import Pool, ViTConfig, rel_pos_index

POOLS: dict[str, Pool] = {"token": "cls", "avg": "avg"}  # timm's global_pool -> ours


def relpos_config(m: Any) -> ViTConfig:
    """Our config for a timm Beit or VisionTransformerRelPos; raises ConversionError naming what we lack."""
    from timm.models.beit import Attention as BeitAttention
    from timm.models.beit import Block as BeitBlock
    from timm.models.vision_transformer_relpos import RelPosAttention, RelPosBlock, ResPostRelPosBlock

    beit = type(m).__name__ == "Beit"
    if m.global_pool not in POOLS:
        raise unsupported(f"global_pool={m.global_pool!r} (token and avg are supported)")
    check_patch_embed(m.patch_embed)
    if not isinstance(m.head, nn.Linear):
        raise unsupported("no classification head (num_classes=0)", "convert a model with a head")
    blocks: list[Any] = list(m.blocks)
    kinds = (BeitBlock,) if beit else (RelPosBlock, ResPostRelPosBlock)
    for b in blocks:  # before any block's parts are read: other block types have other parts
        if type(b) not in kinds or type(b) is not type(blocks[0]):
            raise unsupported(f"the block type {type(b).__name__} among {type(blocks[0]).__name__} blocks")
    first = blocks[0]
    res_post = type(first) is ResPostRelPosBlock
    dim, heads = int(m.embed_dim), int(first.attn.num_heads)
    norms: list[nn.Module] = [m.norm, m.fc_norm]
    for i, b in enumerate(blocks):
        a = b.attn
        if type(a) not in (BeitAttention, RelPosAttention):
            raise unsupported(f"block {i}: attention of type {type(a).__name__}")
        if a.num_heads != heads or a.qkv.out_features != 3 * dim:
            raise unsupported(f"block {i}: a head width other than dim / heads")
        if (qkv_weight_and_bias(a)[1] is None) != (qkv_weight_and_bias(first.attn)[1] is None):
            raise unsupported("query-key-value biases on some blocks only")
        qk = getattr(a, "q_norm", nn.Identity())
        if isinstance(qk, nn.Identity) != isinstance(getattr(first.attn, "q_norm", nn.Identity()), nn.Identity):
            raise unsupported("qk-norm on some blocks only")
        if not isinstance(qk, nn.Identity):
            norms += [a.q_norm, a.k_norm]
        if mlp_kind(b.mlp) != mlp_kind(first.mlp) or mlp_hidden(b.mlp) != mlp_hidden(first.mlp):
            raise unsupported("MLPs that differ between blocks")
        if isinstance(b.mlp.norm, nn.Identity) != isinstance(first.mlp.norm, nn.Identity):
            raise unsupported("an MLP norm on some blocks only")
        if not isinstance(b.mlp.norm, nn.Identity):
            norms.append(b.mlp.norm)
        if layer_scales(b)[0] is not None and any(s is None for s in layer_scales(b)):
            raise unsupported(f"block {i}: layer scale on one branch only")
        if (layer_scales(b)[0] is None) != (layer_scales(first)[0] is None):
            raise unsupported("layer scale on some blocks only")
        norms += [b.norm1, b.norm2]
    if not isinstance(m.norm, nn.Identity) and not isinstance(m.fc_norm, nn.Identity):
        raise unsupported("a final norm over all tokens and another after pooling")
    eps = layer_norm_eps([n for n in norms if not isinstance(n, nn.Identity)])
    return ViTConfig(
        **geometry(m),
        dim=dim,
        depth=len(blocks),
        heads=heads,
        mlp_ratio=mlp_ratio(dim, mlp_hidden(first.mlp)),
        pos_embed="learned" if getattr(m, "pos_embed", None) is not None else "none",
        norm_eps=eps,
        qkv_bias=qkv_weight_and_bias(first.attn)[1] is not None,
        class_token=getattr(m, "cls_token", None) is not None,
        pool=POOLS[m.global_pool],
        fc_norm=isinstance(m.fc_norm, nn.LayerNorm),
        layer_scale=layer_scales(first)[0] is not None,
        norm="res_post" if res_post else "pre",
        activation=mlp_kind(first.mlp),
        mlp_norm=not isinstance(first.mlp.norm, nn.Identity),
        qk_norm=not isinstance(getattr(first.attn, "q_norm", nn.Identity()), nn.Identity),
        rel_pos_bias=True,
    )


def block_biases(m: Any) -> list[Tensor]:
    """Each block's relative position bias as timm adds it to the attention scores: (heads, P + N, P + N)."""
    shared = getattr(m, "rel_pos_bias", None) if type(m).__name__ == "Beit" else getattr(m, "shared_rel_pos", None)
    shared_bias = None
    if shared is not None:
        shared_bias = shared() if type(m).__name__ == "Beit" else shared.get_bias()
    biases = []
    for i, b in enumerate(m.blocks):
        a = b.attn
        if getattr(a, "relative_position_bias_table", None) is not None:  # BEiT's own table
            bias = a._get_rel_pos_bias()
        elif getattr(a, "rel_pos", None) is not None:
            bias = a.rel_pos.get_bias()
        elif shared_bias is not None:
            bias = shared_bias
        else:
            raise unsupported(f"block {i}: no relative position bias (mixed with blocks that have one)")
        biases.append(bias.reshape(bias.shape[-3:]).detach().float())
    return biases


def table_of(bias: Tensor, grid: int, prefix: int) -> Tensor:
    """(heads, T, T) bias -> our (rows, heads) table, read at our index; refused unless the index gives it back."""
    index = rel_pos_index(grid, prefix)
    if bias.shape[-1] != index.shape[0]:
        raise unsupported(f"a relative position bias over {bias.shape[-1]} tokens for {index.shape[0]}")
    heads = bias.shape[0]
    table = bias.new_zeros((2 * grid - 1) ** 2 + 3, heads)
    table[index.flatten()] = bias.permute(1, 2, 0).reshape(-1, heads)
    if not bool((table[index].permute(2, 0, 1) == bias).all()):
        raise unsupported("a relative position bias that depends on more than the offset between two tokens")
    return table


def relpos_state(m: Any, config: ViTConfig) -> dict[str, Tensor]:
    """Our state dict from a timm Beit or VisionTransformerRelPos."""
    state: dict[str, Tensor] = {}
    for key, value in m.state_dict().items():  # the parts outside the blocks are named as ours
        if not key.startswith(("blocks.", "rel_pos_bias.", "shared_rel_pos.")):
            state[key] = value
    biases = block_biases(m)
    for i, b in enumerate(m.blocks):
        state |= block_state(b, f"blocks.{i}.", layer_scales(b))
        state[f"blocks.{i}.attn.rel_pos_table"] = table_of(biases[i], config.grid_size, config.num_prefix_tokens)
    return state
