"""timm's `ParallelScalingBlock` (ViT-22B's parallel block) -> our parallel block: one norm and one fused input
projection feed attention and MLP side by side, whose outputs are summed (or projected together) and scaled."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from model.convert.converted import unsupported
from model.convert.timm_parts import activation_of
from model.vit import Activation


def parallel_blocks(blocks: list[Any], dim: int) -> tuple[int, int, bool, bool, bool, Activation, list[nn.Module]]:
    """(heads, MLP width, qkv bias, qk-norm, layer scale, activation, norms) of parallel blocks alike."""
    from timm.layers import LayerScale

    first = blocks[0]
    norms: list[nn.Module] = []
    for i, b in enumerate(blocks):
        if b.num_heads != first.num_heads or b.in_split != first.in_split or b.in_split[1:] != [dim] * 3:
            raise unsupported(f"block {i}: parallel blocks of different widths")
        if (b.in_proj.bias is None) != (first.in_proj.bias is None):
            raise unsupported("query-key-value biases on some blocks only")
        if isinstance(b.q_norm, nn.Identity) != isinstance(first.q_norm, nn.Identity):
            raise unsupported("qk-norm on some blocks only")
        if isinstance(b.ls, LayerScale) != isinstance(first.ls, LayerScale):
            raise unsupported("layer scale on some blocks only")
        if activation_of(b.mlp_act) != activation_of(first.mlp_act):
            raise unsupported("different activations in different blocks")
        norms += [b.in_norm, b.q_norm, b.k_norm]
    return (
        int(first.num_heads),
        int(first.in_split[0]),
        first.in_proj.bias is not None,
        not isinstance(first.q_norm, nn.Identity),
        isinstance(first.ls, LayerScale),
        activation_of(first.mlp_act),
        norms,
    )


def parallel_block_state(b: Any, ours: str) -> dict[str, Tensor]:
    """Our tensors of one parallel block: its norm serves both branches, its fused projection splits into the MLP's
    first layer and the query-key-value projection, and its output projections (fused or not) into both branches'."""
    hidden, dim = b.in_split[0], b.in_split[1]
    state: dict[str, Tensor] = {}
    for name, p in b.in_norm.state_dict().items():
        state[f"{ours}ln_1.{name}"] = state[f"{ours}ln_2.{name}"] = p
    if hasattr(b.ls, "gamma"):
        state[f"{ours}ls_1.gamma"] = state[f"{ours}ls_2.gamma"] = b.ls.gamma
    weight, bias = b.in_proj.weight, b.in_proj.bias
    state[f"{ours}mlp.fc1.weight"], state[f"{ours}attn.qkv.weight"] = weight[:hidden], weight[hidden:]
    if bias is not None:
        state[f"{ours}mlp.fc1.bias"], state[f"{ours}attn.qkv.bias"] = bias[:hidden], bias[hidden:]
    else:
        state[f"{ours}mlp.fc1.bias"] = b.mlp_bias
    for part in ("q_norm", "k_norm"):
        for name, p in getattr(b, part).state_dict().items():
            state[f"{ours}attn.{part}.{name}"] = p
    if b.out_proj is not None:  # one projection of [attention, MLP]: its columns split, its bias goes to one
        out = b.out_proj
        state[f"{ours}attn.proj.weight"], state[f"{ours}mlp.fc2.weight"] = out.weight[:, :dim], out.weight[:, dim:]
        out_bias = out.bias if out.bias is not None else torch.zeros(dim)
        state[f"{ours}attn.proj.bias"], state[f"{ours}mlp.fc2.bias"] = out_bias, torch.zeros(dim)
    else:
        for theirs, mine in ((b.attn_out_proj, "attn.proj"), (b.mlp_out_proj, "mlp.fc2")):
            state[f"{ours}{mine}.weight"] = theirs.weight
            state[f"{ours}{mine}.bias"] = theirs.bias if theirs.bias is not None else torch.zeros(dim)
    return state
