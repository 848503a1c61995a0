"""What every timm converter shares: checks of the patch embedding, the attention-pooling head, the activation and
the norms' epsilon, and the parts of blocks that several model classes build alike."""

from __future__ import annotations

from typing import Any, TypedDict

import torch
from torch import Tensor, nn

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
    """The MLP's activation by our name: exact GELU, its tanh approximation (timm's GELUTanh), or QuickGELU."""
    if type(act) is nn.GELU and act.approximate == "none":
        return "gelu"
    if (type(act) is nn.GELU and act.approximate == "tanh") or type(act).__name__ == "GELUTanh":
        return "gelu_tanh"
    if type(act).__name__ == "QuickGELU":
        return "quick_gelu"
    raise unsupported(f"the activation {act!r} (exact GELU, tanh GELU and QuickGELU are supported)")


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


def mlp_kind(mlp: Any) -> Activation:
    """The MLP's activation by our name: GELU or QuickGELU MLPs, and SwiGLU packed or in two layers."""
    from timm.layers import GluMlp, Mlp, SwiGLU

    if type(mlp) is Mlp and isinstance(mlp.fc1, nn.Linear):
        return activation_of(mlp.act)
    if type(mlp) is GluMlp and isinstance(mlp.act, nn.SiLU) and not mlp.gate_last and mlp.chunk_dim == -1:
        return "swiglu"
    if type(mlp) is SwiGLU and isinstance(mlp.act, nn.SiLU):
        return "swiglu"
    raise unsupported(f"an MLP of type {type(mlp).__name__} (GELU, QuickGELU and SwiGLU MLPs convert)")


def mlp_hidden(mlp: Any) -> int:
    """Width of the MLP's hidden units (after the gate)."""
    return int(mlp.fc2.in_features)


def qkv_weight_and_bias(a: Any) -> tuple[Tensor, Tensor | None]:
    """One fused query-key-value projection, from a fused one with EVA's separate q and v biases (the key has
    none), or from three projections."""
    if a.qkv is not None:
        weight = a.qkv.weight
        if getattr(a, "q_bias", None) is not None:
            return weight, torch.cat([a.q_bias, torch.zeros_like(a.q_bias), a.v_bias])
        return weight, a.qkv.bias
    weight = torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])
    projections = (a.q_proj, a.k_proj, a.v_proj)
    if all(p.bias is None for p in projections):
        return weight, None
    return weight, torch.cat([p.bias if p.bias is not None else torch.zeros(p.out_features) for p in projections])


def block_state(b: Any, ours: str, layer_scales: tuple[Tensor | None, Tensor | None]) -> dict[str, Tensor]:
    """Our tensors of one pre-norm or res-post-norm block from a timm block with `norm1`, `attn`, `norm2` and `mlp`
    (VisionTransformer's, Eva's, BEiT's, the relative-position ViT's); `layer_scales` are its two branches' scales."""
    state: dict[str, Tensor] = {}
    for theirs, mine in (("norm1", "ln_1"), ("norm2", "ln_2")):
        for name, p in getattr(b, theirs).state_dict().items():
            state[f"{ours}{mine}.{name}"] = p
    for branch, scale in zip(("ls_1", "ls_2"), layer_scales, strict=True):
        if scale is not None:
            state[f"{ours}{branch}.gamma"] = scale
    a = b.attn
    weight, bias = qkv_weight_and_bias(a)
    state[f"{ours}attn.qkv.weight"] = weight
    if bias is not None:
        state[f"{ours}attn.qkv.bias"] = bias
    for part in ("q_norm", "k_norm", "norm", "proj"):
        for name, p in getattr(a, part, nn.Identity()).state_dict().items():
            state[f"{ours}attn.{part}.{name}"] = p
    mlp = b.mlp
    if hasattr(mlp, "fc1_g"):  # SwiGLU in two layers: packed as [gate, value]
        state[f"{ours}mlp.fc1.weight"] = torch.cat([mlp.fc1_g.weight, mlp.fc1_x.weight])
        state[f"{ours}mlp.fc1.bias"] = torch.cat([mlp.fc1_g.bias, mlp.fc1_x.bias])
    else:
        for name, p in mlp.fc1.state_dict().items():
            state[f"{ours}mlp.fc1.{name}"] = p
    for part in ("norm", "fc2"):
        for name, p in getattr(mlp, part).state_dict().items():
            state[f"{ours}mlp.{part}.{name}"] = p
    return state


def layer_scales(b: Any) -> tuple[Tensor | None, Tensor | None]:
    """A block's two layer scales: BEiT's gamma_1 and gamma_2, or LayerScale modules' gamma (None where absent)."""
    if hasattr(b, "gamma_1"):
        return b.gamma_1, b.gamma_2
    scales = [getattr(b, name, None) for name in ("ls1", "ls2")]
    return tuple(s.gamma if s is not None and hasattr(s, "gamma") else None for s in scales)  # type: ignore[return-value]


class Geometry(TypedDict):
    image_size: int
    patch_size: int
    in_channels: int
    num_classes: int


def geometry(m: Any) -> Geometry:
    """The ViTConfig fields a timm model's patch embedding and head fix: input size, patch size, channels, classes."""
    pe = m.patch_embed
    return Geometry(
        image_size=int(pe.img_size[0]),
        patch_size=int(pe.proj.kernel_size[0]),
        in_channels=int(pe.proj.in_channels),
        num_classes=int(m.head.out_features),
    )
