"""A Vision Transformer image classifier (Dosovitskiy et al. 2020), in one file.

Pre-norm encoder blocks over convolutional patch embeddings and a CLS token. Attention runs
through the fused `scaled_dot_product_attention` kernel by default; when attention weights are
asked for, every block computes softmax(QK^T / sqrt(d)) explicitly and hands them back.

The same network as timm's `VisionTransformer`, including the options pretrained ViTs use:
register tokens, no CLS token with average pooling, `fc_norm`, layer scale, a pre-norm over the
embeddings and positions added to patch tokens only. Each defaults to off, as in the original ViT.

Variations pretrained ViTs of other families use are options as well: QuickGELU (OpenAI CLIP), qk-norm
(queries and keys normalised per head), res-post-norm blocks x + LN(f(x)) (Swin V2, timm's ResPostBlock),
DeiT's distillation token, read by a head of its own and averaged with the CLS head's logits, and
attention pooling (SigLIP's MAP head): a learned query attends over the tokens, then a residual MLP.
EVA-02's: rotary position embeddings (2-D, on the patch tokens' queries and keys; one table for every block,
or RoPE-Mixed's table per block and head), SwiGLU MLPs and sub-LayerNorms inside attention and MLP. BEiT's:
a learned relative position bias added to each block's attention scores.

The variants tutorials build are options too: post-norm blocks (the original Transformer's
LN(x + f(x))), the ViT paper's MLP pre-training head, and axial attention (Ho et al. 2019) that
attends along the rows of the patch grid, then along its columns.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any, Literal, get_args

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from model.rollout import Readout

PosEmbed = Literal["learned", "sincos1d", "sincos2d", "none"]
POS_EMBED_KINDS: tuple[str, ...] = get_args(PosEmbed)
Pool = Literal["cls", "avg", "map"]
Norm = Literal["pre", "post", "res_post"]
Activation = Literal["gelu", "gelu_tanh", "quick_gelu", "swiglu"]
Rope = Literal["none", "axial", "mixed"]
Head = Literal["linear", "mlp"]
AttentionPattern = Literal["full", "axial"]


@dataclass(frozen=True)
class ViTConfig:
    image_size: int = 64  # input side in pixels; images are square
    patch_size: int = 8  # side of one patch; the grid is image_size // patch_size per side
    in_channels: int = 3  # 1 (grayscale) or 3 (RGB)
    num_classes: int = 10
    dim: int = 192  # token width
    depth: int = 6  # number of encoder blocks
    heads: int = 3  # attention heads per block; dim must divide evenly
    mlp_ratio: float = 4.0  # hidden width of the MLP as a multiple of dim
    dropout: float = 0.0  # applied after attention/MLP projections and to the embeddings
    pos_embed: PosEmbed = "learned"
    norm_eps: float = 1e-5  # LayerNorm epsilon (timm and torchvision ViTs: 1e-6; Hugging Face: 1e-12)
    qkv_bias: bool = True  # bias on the query/key/value projection
    class_token: bool = True  # prepend a learned CLS token
    reg_tokens: int = 0  # learned register tokens after the CLS token (Darcet et al. 2023)
    no_embed_class: bool = False  # add positions to patch tokens only, not to CLS and registers
    pool: Pool = "cls"  # classify from the CLS token, the mean of the patch tokens, or attention pooling (SigLIP's MAP)
    pool_heads: int = 0  # attention pooling's heads (0: as many as the blocks'; Perception Encoder has its own)
    pool_prefix: bool = False  # attention pooling reads the prefix tokens too, not the patches alone (EVA's)
    fc_norm: bool = False  # final LayerNorm after pooling instead of over all tokens (timm's fc_norm)
    layer_scale: bool = False  # learned per-channel scale on each residual branch (CaiT, DeiT III)
    pre_norm: bool = False  # LayerNorm over the embeddings before the first block (CLIP)
    norm: Norm = "pre"  # pre: x + f(LN(x)) (ViT); post: LN(x + f(x)) (the original Transformer); res_post: x + LN(f(x))
    activation: Activation = "gelu"  # the MLP's: exact GELU, its tanh approximation (SigLIP), QuickGELU
    # x * sigmoid(1.702 x) (OpenAI CLIP), or
    # SwiGLU silu(gate) * value with the first layer giving both (EVA-02); mlp_ratio sets the gated width
    mlp_norm: bool = False  # LayerNorm over the MLP's hidden units before its second layer (EVA-02's sub-LN)
    attn_norm: bool = False  # LayerNorm over the attention's output before its projection (EVA-02 CLIP, BEiT-3)
    rope: Rope = "none"  # rotary positions on the patch tokens' queries and keys: one 2-D table (EVA-02), or one
    # per block and head (RoPE-Mixed); the table is part of the weights
    rope_half: bool = False  # rotate the two halves of each head (DINOv3) instead of neighbouring pairs
    rel_pos_bias: bool = False  # a learned bias per head and relative offset on each block's attention (BEiT)
    parallel: bool = False  # attention and MLP side by side from the same input: x + f(LN(x)) + g(LN'(x)) (ViT-22B)
    qk_norm: bool = False  # LayerNorm over each head's queries and keys before attention (ViT-22B, EVA-02)
    dist_token: bool = False  # DeiT's distillation token after CLS, with its own head; logits: both heads' mean
    head: Head = "linear"  # linear, or the ViT paper's MLP head: LN -> Linear -> GELU -> Dropout -> Linear
    head_hidden: int = 0  # the MLP head's hidden width (0: 4 x num_classes)
    attention_pattern: AttentionPattern = "full"  # full, or axial: rows of the patch grid, then columns

    def __post_init__(self) -> None:
        if self.image_size <= 0 or self.patch_size <= 0:
            raise ValueError(f"image_size and patch_size must be positive, got {self.image_size} and {self.patch_size}")
        if self.image_size % self.patch_size != 0:
            raise ValueError(
                f"image_size {self.image_size} is not divisible by patch_size {self.patch_size}; "
                "pick a patch size that divides the image side"
            )
        if self.in_channels not in (1, 3):
            raise ValueError(f"in_channels must be 1 or 3, got {self.in_channels}")
        if self.num_classes < 2:
            raise ValueError(f"num_classes must be at least 2, got {self.num_classes}")
        if self.dim <= 0 or self.depth <= 0 or self.heads <= 0:
            raise ValueError(f"dim, depth and heads must be positive, got {self.dim}, {self.depth}, {self.heads}")
        if self.dim % self.heads != 0:
            raise ValueError(f"dim {self.dim} is not divisible by heads {self.heads}")
        if self.mlp_ratio <= 0:
            raise ValueError(f"mlp_ratio must be positive, got {self.mlp_ratio}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        if self.pos_embed not in POS_EMBED_KINDS:
            raise ValueError(f"pos_embed must be one of {POS_EMBED_KINDS}, got {self.pos_embed!r}")
        if self.pool not in get_args(Pool):
            raise ValueError(f"pool must be one of {get_args(Pool)}, got {self.pool!r}")
        if self.pool == "cls" and not self.class_token:
            raise ValueError("pool='cls' needs class_token=True; use pool='avg' for a model without a CLS token")
        if self.reg_tokens < 0:
            raise ValueError(f"reg_tokens must be >= 0, got {self.reg_tokens}")
        if self.norm_eps <= 0:
            raise ValueError(f"norm_eps must be positive, got {self.norm_eps}")
        for name, kinds in (
            ("norm", Norm),
            ("head", Head),
            ("attention_pattern", AttentionPattern),
            ("activation", Activation),
        ):
            if getattr(self, name) not in get_args(kinds):
                raise ValueError(f"{name} must be one of {get_args(kinds)}, got {getattr(self, name)!r}")
        if self.head_hidden < 0:
            raise ValueError(f"head_hidden must be >= 0, got {self.head_hidden}")
        if self.qk_norm and self.attention_pattern != "full":
            raise ValueError("qk_norm applies to full attention only")
        if self.pool_heads < 0 or (self.pool_heads and self.dim % self.pool_heads != 0):
            raise ValueError(f"pool_heads must be 0 or divide dim {self.dim}, got {self.pool_heads}")
        if self.pool == "map" and (self.head != "linear" or self.attention_pattern != "full"):
            raise ValueError("pool='map' needs a linear head and full attention")
        if self.dist_token and not (self.pool == "cls" and self.head == "linear" and not self.fc_norm):
            raise ValueError("dist_token needs pool='cls', a linear head and no fc_norm (DeiT's distilled layout)")
        if self.parallel and (self.norm != "pre" or self.attention_pattern != "full"):
            raise ValueError("parallel blocks are pre-norm blocks of full attention")
        if self.rope not in get_args(Rope):
            raise ValueError(f"rope must be one of {get_args(Rope)}, got {self.rope!r}")
        if (self.rope != "none" or self.rel_pos_bias) and self.attention_pattern != "full":
            raise ValueError("rotary positions and relative position bias apply to full attention only")
        if self.rope != "none" and (self.dim // self.heads) % 4 != 0:
            raise ValueError(f"rotary positions need a head width divisible by 4, got {self.dim // self.heads}")

    @property
    def grid_size(self) -> int:
        return self.image_size // self.patch_size

    @property
    def num_patches(self) -> int:
        return self.grid_size**2

    @property
    def head_width(self) -> int:
        """Hidden width of the MLP head."""
        return self.head_hidden or 4 * self.num_classes

    @property
    def num_prefix_tokens(self) -> int:
        """Tokens before the patches: CLS (when present), the distillation token, then the registers."""
        return int(self.class_token) + int(self.dist_token) + self.reg_tokens

    @property
    def num_embedded_prefix_tokens(self) -> int:
        """Prefix tokens that get a position."""
        return 0 if self.no_embed_class else self.num_prefix_tokens

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ViTConfig:
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown ViTConfig fields: {sorted(unknown)}")
        return cls(**d)


# Size presets. `micro` is what the bundled checkpoint uses; the rest follow the ViT paper's widths.
PRESETS: dict[str, dict[str, Any]] = {
    "micro": dict(dim=128, depth=6, heads=8, mlp_ratio=3.0),
    "tiny": dict(dim=192, depth=12, heads=3, mlp_ratio=4.0),
    "small": dict(dim=384, depth=12, heads=6, mlp_ratio=4.0),
    "base": dict(dim=768, depth=12, heads=12, mlp_ratio=4.0),
}


def sincos_1d(positions: Tensor, dim: int) -> Tensor:
    """Fixed sine/cosine embedding of 1-D positions -> (len(positions), dim)."""
    if dim % 2 != 0:
        raise ValueError(f"sincos embeddings need an even dim, got {dim}")
    omega = 1.0 / 10000 ** (torch.arange(dim // 2, dtype=torch.float64) / (dim // 2))
    angles = positions.to(torch.float64)[:, None] * omega[None, :]  # (P, dim/2)
    return torch.cat([angles.sin(), angles.cos()], dim=1).float()


def build_pos_embed(kind: PosEmbed, grid: int, dim: int, prefix: int = 1) -> Tensor:
    """Fixed positional embedding for `prefix` tokens + grid*grid patches -> (1, prefix + grid*grid, dim)."""
    if kind == "sincos1d":
        return sincos_1d(torch.arange(prefix + grid * grid), dim)[None]
    if dim % 4 != 0:
        raise ValueError(f"sincos2d embeddings need dim divisible by 4, got {dim}")
    ys, xs = torch.meshgrid(torch.arange(grid), torch.arange(grid), indexing="ij")
    patches = torch.cat([sincos_1d(ys.flatten(), dim // 2), sincos_1d(xs.flatten(), dim // 2)], dim=1)
    cls = torch.zeros(prefix, dim)  # the CLS token has no position (MoCo v3)
    return torch.cat([cls, patches], dim=0)[None]


def resample_pos_embed(pos_embed: Tensor, new_grid: int, prefix: int) -> Tensor:
    """Resize a learned (1, prefix + g*g, dim) table to a new_grid x new_grid patch grid.

    Bicubic with antialiasing over the 2-D grid, as timm's `resample_abs_pos_embed`; the prefix
    tokens' positions are kept as they are.
    """
    head, patches = pos_embed[:, :prefix], pos_embed[:, prefix:]
    old_grid = math.isqrt(patches.shape[1])
    if old_grid * old_grid != patches.shape[1]:
        raise ValueError(f"{patches.shape[1]} position entries do not form a square grid")
    if old_grid == new_grid:
        return pos_embed
    dim = patches.shape[-1]
    grid = patches.float().reshape(1, old_grid, old_grid, dim).permute(0, 3, 1, 2)  # (1, dim, g, g)
    grid = F.interpolate(grid, size=(new_grid, new_grid), mode="bicubic", antialias=True)
    patches = grid.permute(0, 2, 3, 1).reshape(1, new_grid * new_grid, dim).to(pos_embed.dtype)
    return torch.cat([head, patches], dim=1)


def axial_rope(grid: int, head_dim: int, half: bool = False, temperature: float = 10000.0) -> Tensor:
    """EVA-02's 2-D rotary table for grid x grid patches -> (N, 2 * head_dim): sines, then cosines.

    A quarter of each head's channels turns with the row, a quarter with the column, at frequencies
    temperature^(-j / (head_dim / 4)); each angle is laid out twice, for neighbouring pairs (or both halves).
    """
    bands = 1.0 / temperature ** (torch.arange(head_dim // 4, dtype=torch.float32) / (head_dim // 4))
    ys, xs = torch.meshgrid(
        torch.arange(grid, dtype=torch.float32), torch.arange(grid, dtype=torch.float32), indexing="ij"
    )
    angles = torch.stack([ys, xs], dim=-1)[..., None] * bands  # (g, g, 2, head_dim / 4)
    return rope_table(angles.reshape(grid * grid, head_dim // 2), half)


def mixed_rope(depth: int, heads: int, grid: int, head_dim: int, temperature: float = 10.0) -> Tensor:
    """RoPE-Mixed's tables (Heo et al. 2024) at initialisation -> (depth, heads, N, 2 * head_dim): 2-D frequencies
    of head_dim / 4 magnitudes, turned by a random angle per block and head. RoPE-Mixed learns the frequencies;
    a model trained here keeps these tables as they are, and a converted one carries its source's learned ones."""
    magnitude = 1.0 / temperature ** (torch.arange(0, head_dim, 4, dtype=torch.float32) / head_dim)
    turn = torch.rand(depth, heads, 1) * 2 * math.pi
    fx = torch.cat([magnitude * torch.cos(turn), magnitude * torch.cos(turn + math.pi / 2)], dim=-1)
    fy = torch.cat([magnitude * torch.sin(turn), magnitude * torch.sin(turn + math.pi / 2)], dim=-1)
    ys, xs = torch.meshgrid(
        torch.arange(grid, dtype=torch.float32), torch.arange(grid, dtype=torch.float32), indexing="ij"
    )
    angles = xs.flatten()[:, None] * fx[..., None, :] + ys.flatten()[:, None] * fy[..., None, :]
    return rope_table(angles, half=False)  # (depth, heads, N, head_dim / 2) angles


def rope_table(angles: Tensor, half: bool) -> Tensor:
    """Angles (..., N, head_dim / 2) -> (..., N, 2 * head_dim): their sines, then cosines, each laid out for a head."""

    def layout(t: Tensor) -> Tensor:
        return torch.cat([t, t], dim=-1) if half else t.repeat_interleave(2, dim=-1)

    return torch.cat([layout(angles.sin()), layout(angles.cos())], dim=-1)


def apply_rope(t: Tensor, table: Tensor, prefix: int, half: bool) -> Tensor:
    """Rotate the patch tokens of queries or keys (B, nh, P + N, hs) by the table's angles; prefix tokens stay."""
    sin, cos = table.chunk(2, dim=-1)
    patches = t[:, :, prefix:]
    if half:
        a, b = patches.chunk(2, dim=-1)
        turned = torch.cat([-b, a], dim=-1)
    else:
        turned = torch.stack([-patches[..., 1::2], patches[..., ::2]], dim=-1).reshape(patches.shape)
    return torch.cat([t[:, :, :prefix], (patches * cos + turned * sin).to(t.dtype)], dim=2)


def rel_pos_index(grid: int, prefix: int) -> Tensor:
    """(P + N, P + N) index into a relative position table of (2g - 1)^2 + 3 rows (BEiT's layout): patch pairs by
    their offset; then one row each for a prefix token attending to a patch, a patch to a prefix token, and
    prefix tokens to each other."""
    ys, xs = torch.meshgrid(torch.arange(grid), torch.arange(grid), indexing="ij")
    coords = torch.stack([ys.flatten(), xs.flatten()])  # (2, N)
    offsets = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0) + grid - 1  # (N, N, 2), each in [0, 2g - 2]
    pairs = (2 * grid - 1) ** 2
    index = torch.full((prefix + grid * grid,) * 2, pairs + 2, dtype=torch.long)
    index[prefix:, prefix:] = offsets[..., 0] * (2 * grid - 1) + offsets[..., 1]
    index[:prefix, prefix:] = pairs
    index[prefix:, :prefix] = pairs + 1
    return index


class PatchEmbed(nn.Module):
    """Split the image into non-overlapping patches and project each to `dim` with one conv."""

    def __init__(self, patch_size: int, in_channels: int, dim: int) -> None:
        super().__init__()
        self.proj = nn.Conv2d(in_channels, dim, kernel_size=patch_size, stride=patch_size)

    def forward(self, x: Tensor) -> Tensor:
        x = self.proj(x)  # (B, dim, gh, gw)
        return x.flatten(2).transpose(1, 2)  # (B, gh*gw, dim)


class Attention(nn.Module):
    """Multi-head self-attention: fused kernel by default, explicit softmax when weights are wanted."""

    def __init__(
        self,
        dim: int,
        heads: int,
        dropout: float = 0.0,
        qkv_bias: bool = True,
        qk_norm_eps: float | None = None,
        *,
        out_norm_eps: float | None = None,
        prefix: int = 0,
        rope_half: bool = False,
        rel_pos_rows: int = 0,
    ) -> None:
        super().__init__()
        self.heads = heads
        self.head_dim = dim // heads
        self.scale = self.head_dim**-0.5
        self.qkv = nn.Linear(dim, 3 * dim, bias=qkv_bias)
        # qk-norm: each head's queries and keys normalised before their product
        self.q_norm = nn.LayerNorm(self.head_dim, eps=qk_norm_eps) if qk_norm_eps else nn.Identity()
        self.k_norm = nn.LayerNorm(self.head_dim, eps=qk_norm_eps) if qk_norm_eps else nn.Identity()
        self.norm = nn.LayerNorm(dim, eps=out_norm_eps) if out_norm_eps else nn.Identity()  # EVA-02's sub-LN
        self.proj = nn.Linear(dim, dim)
        self.attn_drop = dropout
        self.proj_drop = nn.Dropout(dropout)
        self.prefix, self.rope_half = prefix, rope_half  # rotary positions turn the patch tokens only
        # relative position bias: one learned value per head and relative offset (rows of rel_pos_index)
        self.rel_pos_table = nn.Parameter(torch.zeros(rel_pos_rows, heads)) if rel_pos_rows else None

    def forward(
        self,
        x: Tensor,
        return_attention: bool = False,
        rope: Tensor | None = None,
        rel_pos: Tensor | None = None,
        mask: Tensor | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """Tokens (B, N, dim) -> (B, N, dim), and the weights when asked for; `rope` is this block's rotary table
        and `rel_pos` the (N, N) index into the relative position table, for the models that have them; `mask`
        is added to the scores, (B, 1, N, N) with -inf where a query may not read a key (a text tower's)."""
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)  # each (B, nh, N, hs)
        q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            q = apply_rope(q, rope, self.prefix, self.rope_half)
            k = apply_rope(k, rope, self.prefix, self.rope_half)
        bias = None
        if self.rel_pos_table is not None and rel_pos is not None:
            bias = self.rel_pos_table[rel_pos].permute(2, 0, 1).to(q.dtype)  # (nh, N, N)
        if mask is not None:
            bias = mask.to(q.dtype) if bias is None else bias + mask.to(q.dtype)
        drop = self.attn_drop if self.training else 0.0
        attn: Tensor | None = None
        if return_attention:
            scores = (q * self.scale) @ k.transpose(-2, -1)
            attn = (scores if bias is None else scores + bias).softmax(dim=-1)  # (B, nh, N, N)
            y = F.dropout(attn, drop, self.training) @ v
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=drop)
        y = self.norm(y.transpose(1, 2).reshape(B, N, C))  # (B, N, nh*hs)
        return self.proj_drop(self.proj(y)), attn


class QuickGELU(nn.Module):
    """x * sigmoid(1.702 x): the GELU approximation OpenAI's CLIP was trained with."""

    def forward(self, x: Tensor) -> Tensor:
        return x * torch.sigmoid(1.702 * x)


class SwiGLU(nn.Module):
    """silu(gate) * value, from the first layer's output laid out as [gate, value] (Shazeer 2020)."""

    def forward(self, x: Tensor) -> Tensor:
        gate, value = x.chunk(2, dim=-1)
        return F.silu(gate) * value


class MLP(nn.Module):
    def __init__(
        self,
        dim: int,
        hidden: int,
        dropout: float = 0.0,
        activation: Activation = "gelu",
        norm_eps: float | None = None,
    ) -> None:
        super().__init__()
        gated = activation == "swiglu"
        approximate = "tanh" if activation == "gelu_tanh" else "none"
        self.fc1 = nn.Linear(dim, 2 * hidden if gated else hidden)
        self.act = (
            SwiGLU() if gated else QuickGELU() if activation == "quick_gelu" else nn.GELU(approximate=approximate)
        )
        self.norm = nn.LayerNorm(hidden, eps=norm_eps) if norm_eps else nn.Identity()  # EVA-02's sub-LN
        self.fc2 = nn.Linear(hidden, dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.drop(self.fc2(self.norm(self.act(self.fc1(x)))))


def axial_mask(grid: int, prefix: int, axis: str) -> Tensor:
    """(P + N, P + N) bool, True where a query may attend to a key under axial attention along `axis`.

    Patch tokens attend to the prefix tokens and to the patches of their own row (or column); the
    prefix tokens (CLS, registers) attend to every token.
    """
    index = torch.arange(grid * grid)
    line = index // grid if axis == "row" else index % grid
    mask = torch.ones(prefix + grid * grid, prefix + grid * grid, dtype=torch.bool)
    mask[prefix:, prefix:] = line[:, None] == line[None, :]
    return mask


class AxialAttention(Attention):
    """Self-attention along one axis of the patch grid (Ho et al. 2019), with global prefix tokens.

    Each patch attends to the patches of its own row (axis="row") or column (axis="col") and to the
    prefix tokens; each prefix token (CLS, registers) attends to every token. The CLS token is global
    because it is the classifier's readout: it must be able to gather from every patch in every block,
    and patches that attend to it receive what it gathered, so information still crosses the grid
    within one layer. The cost is O(N sqrt(N) + P N) in the number of patches N, against O(N^2).
    The fused path runs the rows (or columns) as a batch of short sequences; the explicit path, used
    only for attention maps, computes the same softmax over all tokens with the axial mask.
    """

    def __init__(self, dim: int, heads: int, dropout: float, qkv_bias: bool, grid: int, prefix: int, axis: str) -> None:
        super().__init__(dim, heads, dropout, qkv_bias)
        self.grid, self.prefix, self.axis = grid, prefix, axis
        self.mask: Tensor
        self.register_buffer("mask", axial_mask(grid, prefix, axis), persistent=False)

    def forward(
        self,
        x: Tensor,
        return_attention: bool = False,
        rope: Tensor | None = None,
        rel_pos: Tensor | None = None,
        mask: Tensor | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        if mask is not None:
            raise ValueError("axial attention has its own mask; a text tower's is for full attention")
        B, N, C = x.shape  # (rotary and relative positions are for full attention: the config refuses them here)
        qkv = self.qkv(x).reshape(B, N, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)  # each (B, nh, P + g*g, hs)
        drop = self.attn_drop if self.training else 0.0
        attn: Tensor | None = None
        if return_attention:
            scores = ((q * self.scale) @ k.transpose(-2, -1)).masked_fill(~self.mask, float("-inf"))
            attn = scores.softmax(dim=-1)  # (B, nh, T, T), zero off the axis
            y = F.dropout(attn, drop, self.training) @ v
        else:
            y = self.along_axis(q, k, v, drop)
        y = y.transpose(1, 2).reshape(B, N, C)
        return self.proj_drop(self.proj(y)), attn

    def along_axis(self, q: Tensor, k: Tensor, v: Tensor, drop: float) -> Tensor:
        """(B, nh, T, hs) each -> (B, nh, T, hs): g sequences of g patches (plus the prefix keys) per image."""
        B, nh, _, hs = q.shape
        P, g = self.prefix, self.grid

        def lines(t: Tensor) -> Tensor:  # patches -> (B * g, nh, g, hs), one sequence per row or column
            grid = t[:, :, P:].reshape(B, nh, g, g, hs)
            grid = grid if self.axis == "row" else grid.transpose(2, 3)
            return grid.permute(0, 2, 1, 3, 4).reshape(B * g, nh, g, hs)

        def prefix_for_each_line(t: Tensor) -> Tensor:  # (B, nh, P, hs) -> (B * g, nh, P, hs)
            return t[:, :, :P].unsqueeze(1).expand(B, g, nh, P, hs).reshape(B * g, nh, P, hs)

        keys, values = lines(k), lines(v)
        if P:
            keys = torch.cat([prefix_for_each_line(k), keys], dim=2)
            values = torch.cat([prefix_for_each_line(v), values], dim=2)
        y = F.scaled_dot_product_attention(lines(q), keys, values, dropout_p=drop)  # (B * g, nh, g, hs)
        y = y.reshape(B, g, nh, g, hs).permute(0, 2, 1, 3, 4)  # (B, nh, line, position, hs)
        y = (y if self.axis == "row" else y.transpose(2, 3)).reshape(B, nh, g * g, hs)
        if not P:
            return y
        prefix = F.scaled_dot_product_attention(q[:, :, :P], k, v, dropout_p=drop)  # global: (B, nh, P, hs)
        return torch.cat([prefix, y], dim=2)


class AttentionPool(nn.Module):
    """Multi-head attention pooling (SigLIP's MAP head; timm's `AttentionPoolLatent`): a learned query
    attends over the patch tokens, then a residual MLP over what it gathered -> (B, dim), and its attention
    (B, heads, 1, N) when asked for, the natural map of what the prediction reads."""

    def __init__(self, dim: int, heads: int, mlp_ratio: float, eps: float, activation: Activation) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.scale = self.head_dim**-0.5
        self.latent = nn.Parameter(torch.zeros(1, 1, dim))
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(dim, 2 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim, eps=eps)
        self.mlp = MLP(dim, int(dim * mlp_ratio), activation=activation)

    def forward(self, x: Tensor, return_attention: bool = False) -> tuple[Tensor, Tensor | None]:
        B, N, C = x.shape
        q = self.q(self.latent.expand(B, -1, -1)).reshape(B, 1, self.heads, self.head_dim).transpose(1, 2)
        k, v = self.kv(x).reshape(B, N, 2, self.heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        attn: Tensor | None = None
        if return_attention:
            attn = ((q * self.scale) @ k.transpose(-2, -1)).softmax(dim=-1)  # (B, nh, 1, N)
            y = attn @ v
        else:
            y = F.scaled_dot_product_attention(q, k, v)
        y = self.proj(y.transpose(1, 2).reshape(B, 1, C))
        y = y + self.mlp(self.norm(y))
        return y[:, 0], attn


class LayerScale(nn.Module):
    """Learned per-channel scale of a residual branch (Touvron et al. 2021, CaiT)."""

    def __init__(self, dim: int, init_value: float = 1e-5) -> None:
        super().__init__()
        self.gamma = nn.Parameter(torch.full((dim,), init_value))

    def forward(self, x: Tensor) -> Tensor:
        return x * self.gamma


class Block(nn.Module):
    """Attention then MLP, each a residual branch: pre-norm x + f(LN(x)), post-norm LN(x + f(x)), or
    res-post-norm x + LN(f(x)); or, in a parallel block, both branches on the block's input.

    With axial attention the attention branch is two: along the rows, then along the columns.
    """

    def __init__(self, c: ViTConfig) -> None:
        super().__init__()
        self.norm, self.parallel = c.norm, c.parallel

        def layer_scale() -> nn.Module:
            return LayerScale(c.dim) if c.layer_scale else nn.Identity()

        def attention(axis: str) -> Attention:
            if c.attention_pattern == "full":
                return Attention(
                    c.dim,
                    c.heads,
                    c.dropout,
                    c.qkv_bias,
                    c.norm_eps if c.qk_norm else None,
                    out_norm_eps=c.norm_eps if c.attn_norm else None,
                    prefix=c.num_prefix_tokens,
                    rope_half=c.rope_half,
                    rel_pos_rows=(2 * c.grid_size - 1) ** 2 + 3 if c.rel_pos_bias else 0,
                )
            return AxialAttention(c.dim, c.heads, c.dropout, c.qkv_bias, c.grid_size, c.num_prefix_tokens, axis)

        self.ln_1 = nn.LayerNorm(c.dim, eps=c.norm_eps)
        self.attn = attention("row")
        self.ls_1 = layer_scale()
        self.axial = c.attention_pattern == "axial"
        if self.axial:
            self.ln_col = nn.LayerNorm(c.dim, eps=c.norm_eps)
            self.attn_col = attention("col")
            self.ls_col = layer_scale()
        self.ln_2 = nn.LayerNorm(c.dim, eps=c.norm_eps)
        self.mlp = MLP(c.dim, int(c.dim * c.mlp_ratio), c.dropout, c.activation, c.norm_eps if c.mlp_norm else None)
        self.ls_2 = layer_scale()

    def attention_layers(self) -> list[tuple[Attention, nn.Module, nn.Module]]:
        """(attention, its norm, its layer scale): one, or two for axial blocks (rows, then columns)."""
        layers: list[tuple[Attention, nn.Module, nn.Module]] = [(self.attn, self.ln_1, self.ls_1)]
        if self.axial:
            layers.append((self.attn_col, self.ln_col, self.ls_col))
        return layers

    def branch_input(self, x: Tensor, norm: nn.Module) -> Tensor:
        return norm(x) if self.norm == "pre" else x

    def add_branch(self, x: Tensor, y: Tensor, norm: nn.Module) -> Tensor:
        if self.norm == "post":
            return norm(x + y)
        return x + norm(y) if self.norm == "res_post" else x + y

    def forward(
        self, x: Tensor, return_attention: bool = False, rope: Tensor | None = None, rel_pos: Tensor | None = None
    ) -> tuple[Tensor, list[Tensor]]:
        """Tokens (B, T, dim) -> tokens, and each attention layer's weights when asked for."""
        attentions: list[Tensor] = []
        inputs = x
        for attention, norm, scale in self.attention_layers():
            y, attn = attention(self.branch_input(x, norm), return_attention, rope, rel_pos)
            x = self.add_branch(x, scale(y), norm)
            if attn is not None:
                attentions.append(attn)
        if self.parallel:  # the MLP reads the block's input, beside the attention, not after it
            return x + self.ls_2(self.mlp(self.ln_2(inputs))), attentions
        x = self.add_branch(x, self.ls_2(self.mlp(self.branch_input(x, self.ln_2))), self.ln_2)
        return x, attentions


class MLPHead(nn.Module):
    """The ViT paper's pre-training head: LayerNorm -> Linear -> GELU -> Dropout -> Linear."""

    def __init__(self, dim: int, hidden: int, classes: int, dropout: float, eps: float) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim, eps=eps)
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU()
        self.drop = nn.Dropout(dropout)
        self.fc2 = nn.Linear(hidden, classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.drop(self.act(self.fc1(self.norm(x)))))


class ViT(nn.Module):
    def __init__(self, config: ViTConfig) -> None:
        super().__init__()
        self.config = config
        c = config
        self.patch_embed = PatchEmbed(c.patch_size, c.in_channels, c.dim)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, c.dim)) if c.class_token else None
        self.dist_token = nn.Parameter(torch.zeros(1, 1, c.dim)) if c.dist_token else None
        self.reg_token = nn.Parameter(torch.zeros(1, c.reg_tokens, c.dim)) if c.reg_tokens else None
        embedded = c.num_embedded_prefix_tokens
        self.pos_embed: Tensor | None
        if c.pos_embed == "learned":
            self.pos_embed = nn.Parameter(torch.zeros(1, embedded + c.num_patches, c.dim))
        elif c.pos_embed == "none":  # positions from rotary embeddings or relative bias alone
            self.pos_embed = None
        else:  # fixed tables are rebuilt from the config, so they stay out of the state dict
            table = build_pos_embed(c.pos_embed, c.grid_size, c.dim, embedded)
            self.register_buffer("pos_embed", table, persistent=False)
        self.rope: Tensor | None  # a buffer in the weights: converted models carry their source's exact table
        head_dim = c.dim // c.heads
        if c.rope == "axial":
            self.register_buffer("rope", axial_rope(c.grid_size, head_dim, c.rope_half))
        elif c.rope == "mixed":
            self.register_buffer("rope", mixed_rope(c.depth, c.heads, c.grid_size, head_dim))
        else:
            self.register_buffer("rope", None)
        self.rel_pos: Tensor | None
        index = rel_pos_index(c.grid_size, c.num_prefix_tokens) if c.rel_pos_bias else None
        self.register_buffer("rel_pos", index, persistent=False)
        self.drop = nn.Dropout(c.dropout)
        self.norm_pre = nn.LayerNorm(c.dim, eps=c.norm_eps) if c.pre_norm else nn.Identity()
        self.blocks = nn.ModuleList([Block(c) for _ in range(c.depth)])
        # With fc_norm the final norm moves from all tokens to the pooled vector (timm's layout); a
        # post-norm model's last block already ends in a LayerNorm, as the original Transformer's does
        # (a res-post-norm block's ends in its branch, so that model keeps a final norm, as timm's does).
        final_norm = not c.fc_norm and c.norm != "post"
        self.norm = nn.LayerNorm(c.dim, eps=c.norm_eps) if final_norm else nn.Identity()
        self.fc_norm = nn.LayerNorm(c.dim, eps=c.norm_eps) if c.fc_norm else nn.Identity()
        self.head: nn.Module = (
            nn.Linear(c.dim, c.num_classes)
            if c.head == "linear"
            else MLPHead(c.dim, c.head_width, c.num_classes, c.dropout, c.norm_eps)
        )
        self.head_dist = nn.Linear(c.dim, c.num_classes) if c.dist_token else None
        self.attn_pool = (
            AttentionPool(c.dim, c.pool_heads or c.heads, c.mlp_ratio, c.norm_eps, c.activation)
            if c.pool == "map"
            else None
        )
        self._init_weights()

    @property
    def num_prefix_tokens(self) -> int:
        return self.config.num_prefix_tokens

    @property
    def readout(self) -> Readout:
        """How attention maps are read out of this model: the way it pools for its prediction."""
        c = self.config
        return Readout(c.num_prefix_tokens, c.pool, c.attention_pattern == "axial", 2 if c.dist_token else 1)

    def _init_weights(self) -> None:
        if isinstance(self.pos_embed, nn.Parameter):
            nn.init.trunc_normal_(self.pos_embed, std=0.02)
        for token in (self.cls_token, self.dist_token, self.reg_token):
            if token is not None:
                nn.init.normal_(token, std=1e-6)
        if self.attn_pool is not None:
            nn.init.trunc_normal_(self.attn_pool.latent, std=self.config.dim**-0.5)
        # As timm: linear layers trunc-normal(0.02); the patch-embedding conv keeps PyTorch's
        # fan-in scaled default, so patch content is not drowned by the positional table.
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.trunc_normal_(m.weight, std=0.02)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.LayerNorm):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    @torch.no_grad()
    def mimetic_init_(self, generator: torch.Generator | None = None) -> ViT:
        """Re-initialise attention so that it starts out local, as trained ViTs' attention is.

        Mimetic initialisation (Trockman & Kolter 2023): per head W_q W_k^T ~ a1 Z + b1 I, and
        W_v W_o ~ a2 Z - b2 I, with Z ~ N(0, 1/dim). Together with 2-D sine/cosine positions
        (copied into a learned table, when dim allows) each token first attends mostly to itself
        and its neighbours, which lets a small ViT start learning spatial structure long before
        plain random attention does. Only the initial values change; the architecture is the same.
        """
        c = self.config
        dim, head_dim = c.dim, c.dim // c.heads
        eye = torch.eye(dim)

        def factor(scale: float, shift: float) -> tuple[Tensor, Tensor, Tensor]:
            z = torch.randn(dim, dim, generator=generator) / dim**0.5
            u, s, vh = torch.linalg.svd(scale * z + shift * eye)
            return u, s.sqrt(), vh

        if isinstance(self.pos_embed, nn.Parameter) and dim % 4 == 0:
            self.pos_embed.copy_(build_pos_embed("sincos2d", c.grid_size, dim, c.num_embedded_prefix_tokens))
        for attn in (m for m in self.modules() if isinstance(m, Attention)):
            w = attn.qkv.weight  # (3 * dim, dim); q = x @ w[:dim].T, and so on
            for h in range(c.heads):
                u, s, vh = factor(0.7, 0.7)  # rank-head_dim part of a1 Z + b1 I for this head
                rows = slice(h * head_dim, (h + 1) * head_dim)
                w[rows] = (u[:, :head_dim] * s[:head_dim]).T
                w[dim:][rows] = (vh[:head_dim].T * s[:head_dim]).T
            u, s, vh = factor(0.4, -0.4)
            w[2 * dim :] = (u * s).T  # W_v = U sqrt(S)
            attn.proj.weight.copy_((s[:, None] * vh).T)  # W_o = sqrt(S) V^T
        return self

    def no_weight_decay(self) -> set[str]:
        """Parameter names that AdamW should not decay (besides biases and norm weights)."""
        names = {"pos_embed", "cls_token", "dist_token", "reg_token"}
        return {n for n, _ in self.named_parameters() if n in names or n.endswith(".rel_pos_table")}

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward_features(self, x: Tensor, return_attention: bool = False) -> tuple[Tensor, list[Tensor]]:
        """Encode images (B, C, H, W) -> token features (B, P + N, dim) and per-layer attention.

        P is `num_prefix_tokens`: the CLS token (when present) and the registers come first.
        """
        x = self.patch_embed(x)  # (B, N, dim)
        x = self.norm_pre(self.drop(self.add_prefix_and_positions(x)))  # (B, P + N, dim)
        attentions: list[Tensor] = []
        for i, block in enumerate(self.blocks):
            rope = self.rope[i] if self.rope is not None and self.config.rope == "mixed" else self.rope
            x, attns = block(x, return_attention, rope, self.rel_pos)
            attentions += attns
        return self.norm(x), attentions

    def add_prefix_and_positions(self, x: Tensor) -> Tensor:
        """Patch tokens (B, N, dim) -> CLS, registers and patches with positions (B, P + N, dim)."""
        B = x.shape[0]
        prefix = [t.expand(B, -1, -1) for t in (self.cls_token, self.dist_token, self.reg_token) if t is not None]
        if self.pos_embed is None:
            return torch.cat([*prefix, x], dim=1)
        if self.config.no_embed_class:
            return torch.cat([*prefix, x + self.pos_embed], dim=1)
        return torch.cat([*prefix, x], dim=1) + self.pos_embed

    def forward_head(self, x: Tensor, pre_logits: bool = False) -> Tensor:
        """Token features (B, P + N, dim) -> logits: from the CLS token, or the mean of the patches.

        With `pre_logits`, the embedding (B, dim) the head receives instead: pooled, after `fc_norm`
        (timm's `forward_head(x, pre_logits=True)`). With a distillation token, the CLS and distillation
        tokens each go through their own head and the logits are the mean of the two (timm's DeiT at
        evaluation); the embedding is the mean of the two tokens.
        """
        if self.head_dist is not None:
            cls, dist = x[:, 0], x[:, 1]
            return (cls + dist) / 2 if pre_logits else (self.head(cls) + self.head_dist(dist)) / 2
        embedding = self.fc_norm(self.pool(x)[0])
        return embedding if pre_logits else self.head(embedding)

    def pool(self, x: Tensor, return_attention: bool = False) -> tuple[Tensor, Tensor | None]:
        """Token features (B, P + N, dim) -> (B, dim) as the config pools them, and the attention pooling's
        weights when it pools so and they are asked for: over the patch tokens (B, heads, 1, N), as timm's
        VisionTransformer reads them unless `pool_include_prefix`, or over every token (B, heads, 1, P + N) with
        `pool_prefix`, as timm's Eva does."""
        P = self.num_prefix_tokens
        if self.attn_pool is not None:
            return self.attn_pool(x if self.config.pool_prefix else x[:, P:], return_attention)
        return (x[:, 0] if self.config.pool == "cls" else x[:, P:].mean(dim=1)), None

    def forward(self, x: Tensor) -> Tensor:
        """Images (B, C, H, W) -> logits (B, num_classes), through the fused attention path."""
        features, _ = self.forward_features(x)
        return self.forward_head(features)

    def forward_with_embedding(self, x: Tensor, return_attention: bool = False) -> tuple[Tensor, Tensor, list[Tensor]]:
        """Logits, the embedding (B, dim) and, when asked, every attention layer's weights: one pass."""
        features, attentions = self.forward_features(x, return_attention)
        if self.head_dist is not None:
            return self.forward_head(features), self.forward_head(features, pre_logits=True), attentions
        pooled, pooling = self.pool(features, return_attention)
        embedding = self.fc_norm(pooled)
        if pooling is not None:  # the attention pooling's weights come last: what the prediction reads
            attentions = [*attentions, pooling]
        return self.head(embedding), embedding, attentions

    def forward_with_attention(self, x: Tensor) -> tuple[Tensor, list[Tensor]]:
        """Logits and every attention layer's weights, each (B, heads, P + N, P + N); two per axial block; with
        attention pooling, its weights over the tokens it reads (B, heads, 1, N or P + N) last."""
        logits, _, attentions = self.forward_with_embedding(x, return_attention=True)
        return logits, attentions


def param_count_str(n: int) -> str:
    return f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n / 1e3:.1f}K"
