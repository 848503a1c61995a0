"""Checks every timm converter shares: the patch embedding, the attention-pooling head, the activation and the
norms' epsilon."""

from __future__ import annotations

from typing import Any

from torch import nn

from model.convert.converted import unsupported
from model.vit import Activation


def check_patch_embed(pe: Any) -> None:
    """One convolution over non-overlapping patches of a square input, as our PatchEmbed."""
    from timm.layers import PatchEmbed

    if type(pe) is not PatchEmbed or not isinstance(pe.norm, nn.Identity) or not isinstance(pe.proj, nn.Conv2d):
        raise unsupported("a patch embedding other than one convolution (embed_layer, embed_norm_layer)")
    if pe.proj.kernel_size != pe.proj.stride or pe.img_size[0] != pe.img_size[1]:
        raise unsupported(f"overlapping patches or a non-square input {tuple(pe.img_size)}")


def check_attention_pool(pool: Any, hidden: int, activation: Activation) -> nn.Module:
    """SigLIP's MAP head as our AttentionPool has it (one learned query, and the blocks' MLP width and activation);
    returns its norm, whose epsilon must be the model's."""
    from timm.layers import AttentionPoolLatent, Mlp

    if type(pool) is not AttentionPoolLatent:
        raise unsupported(f"attention pooling of type {type(pool).__name__}")
    if pool.latent_len != 1 or pool.pos_embed is not None or pool.pool != "token" or not isinstance(pool.q, nn.Linear):
        raise unsupported("attention pooling with several queries, positions or no query projection")
    if not (isinstance(pool.q_norm, nn.Identity) and isinstance(pool.k_norm, nn.Identity)):
        raise unsupported("attention pooling with qk-norm")
    if pool.latent.shape[-1] != pool.kv.in_features or pool.kv.in_features % pool.num_heads:
        raise unsupported("attention pooling with another width than the blocks'")
    mlp = pool.mlp
    if type(mlp) is not Mlp or not isinstance(mlp.norm, nn.Identity) or mlp.fc1.out_features != hidden:
        raise unsupported("attention pooling with another MLP than the blocks'")
    if activation_of(mlp.act) != activation:
        raise unsupported("attention pooling with another activation than the blocks'")
    return pool.norm


def activation_of(act: nn.Module) -> Activation:
    """The MLP's activation by our name: exact GELU, or QuickGELU (OpenAI CLIP)."""
    if type(act) is nn.GELU and act.approximate == "none":
        return "gelu"
    if type(act).__name__ == "QuickGELU":
        return "quick_gelu"
    raise unsupported(f"the activation {act!r} (exact GELU and QuickGELU are supported)")


def layer_norm_eps(norms: list[nn.Module]) -> float:
    """The one epsilon all the model's norms share (each must be an affine LayerNorm)."""
    for n in norms:
        if not isinstance(n, nn.LayerNorm) or not n.elementwise_affine or n.bias is None:
            raise unsupported(f"the norm layer {type(n).__name__} (only affine LayerNorm)")
    eps = {float(n.eps) for n in norms}  # type: ignore[arg-type]
    if len(eps) != 1:
        raise unsupported(f"LayerNorms with different epsilons {sorted(eps)}")
    return eps.pop()


def pool_heads(m: Any) -> int:
    """Attention pooling's heads where they differ from the blocks' (0: the same, or no attention pooling)."""
    pool = getattr(m, "attn_pool", None)
    if pool is None or pool.num_heads == m.blocks[0].attn.num_heads:
        return 0
    return int(pool.num_heads)
