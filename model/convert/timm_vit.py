"""timm's ViTs -> our ViT: `VisionTransformer` and DeiT distilled (the same network, so the weights map almost name
for name) here; `Eva` (timm_eva.py), and `Beit` and `VisionTransformerRelPos` (timm_relpos.py) through theirs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from model.convert.converted import ConversionError, Converted, mlp_ratio, numbered_classes, unsupported
from model.convert.timm_eva import eva_config, eva_state
from model.convert.timm_parallel import parallel_block_state, parallel_blocks
from model.convert.timm_parts import (
    block_state,
    check_attention_pool,
    check_patch_embed,
    geometry,
    layer_norm_eps,
    layer_scales,
    mlp_hidden,
    mlp_kind,
    pool_heads,
)
from model.convert.timm_relpos import relpos_config, relpos_state
from model.convert.weights_file import read_state_dict
from model.preprocessing import Preprocessing
from model.vit import Pool, ViTConfig

CROP_MODES = {"center": "center_crop", "squash": "squash"}
POOLS: dict[str, Pool] = {"token": "cls", "avg": "avg", "map": "map"}  # timm's global_pool -> ours
BLOCK_KINDS = {  # timm's other block types, by what they do
    "DiffParallelScalingBlock": "differential attention and MLP in parallel",
    "ParallelThingsBlock": "several attention and MLP branches in parallel",
}


def convert_timm(arch: str, weights: Path | None, pretrained: bool) -> Converted:
    """Build `arch` in timm with the given weights (a file, or timm's own download) and convert it."""
    import timm

    if arch not in timm.list_models() and arch.split(".")[0] not in timm.list_models():
        raise ConversionError(f"timm has no model {arch!r}; see timm.list_models('vit_*')")
    if pretrained:
        from model.convert.reachable import check_reachable

        check_reachable(f"timm's pretrained {arch}")
        try:
            model = timm.create_model(arch, pretrained=True)
        except Exception as e:  # hub and network errors come in many types
            raise ConversionError(
                f"could not fetch pretrained weights for {arch} ({e}); without internet, download them "
                "elsewhere and pass --weights FILE"
            ) from e
        source = "timm pretrained"
    else:
        assert weights is not None
        model = timm_model_for(arch, read_state_dict(weights), weights)
        source = weights.name
    converted = from_timm_model(model.float().eval())
    converted.source |= {"arch": arch, "weights": source}
    return converted


def timm_model_for(arch: str, state: dict[str, Tensor], path: Path) -> Any:
    """timm's model for `arch`, sized to the file's head and position table, with its weights loaded."""
    import timm

    if "head.weight" not in state:
        raise ConversionError(f"{path}: no classification head (head.weight); a headless backbone cannot classify")
    num_classes = int(state["head.weight"].shape[0])
    model: Any = timm.create_model(arch, pretrained=False, num_classes=num_classes)
    pos = state.get("pos_embed")
    if pos is not None and getattr(model, "pos_embed", None) is not None and pos.shape != model.pos_embed.shape:
        embedded = 0 if model.no_embed_class else model.num_prefix_tokens
        grid = int((pos.shape[1] - embedded) ** 0.5)
        model = timm.create_model(arch, pretrained=False, num_classes=num_classes, img_size=grid * patch_side(model))
    try:
        model.load_state_dict(state)
    except RuntimeError as e:
        raise ConversionError(f"{path}: the weights do not fit timm's {arch}: {str(e).splitlines()[0]}") from e
    return model


def patch_side(model: Any) -> int:
    kernel = model.patch_embed.proj.kernel_size
    return int(kernel[0])


def from_timm_model(m: Any) -> Converted:
    """Convert a built timm model (any weights), refusing what our ViT does not implement."""
    import timm
    from timm.data import create_transform, resolve_data_config

    if type(m).__name__ == "Eva":  # EVA-02 and the rotary ViTs
        config = eva_config(m)
        state = eva_state(m, config)
    elif type(m).__name__ in ("Beit", "VisionTransformerRelPos"):  # relative position bias
        config = relpos_config(m)
        state = relpos_state(m, config)
    else:
        config = timm_config(m)
        state = {k: v for k, v in m.state_dict().items() if not k.startswith("blocks.")}
        for i, b in enumerate(m.blocks):
            ours = f"blocks.{i}."
            state |= parallel_block_state(b, ours) if config.parallel else block_state(b, ours, layer_scales(b))
    if m.patch_embed.proj.bias is None:  # CLIP-style bias-free patch embedding: a zero bias is the same
        state["patch_embed.proj.bias"] = torch.zeros(config.dim)
    data = resolve_data_config(model=m)
    preprocessing = timm_preprocessing(data, config)
    source = {"source": "timm", "timm_version": timm.__version__}
    classes = timm_classes(m, config.num_classes)
    return Converted(config, state, classes, preprocessing, m, source, preprocess=create_transform(**data))


def timm_config(m: Any) -> ViTConfig:
    """Our config for a timm ViT; raises ConversionError naming the first feature we lack."""
    from timm.layers.attention import Attention
    from timm.models.vision_transformer import Block, LayerScale, ParallelScalingBlock, ResPostBlock, VisionTransformer

    distilled = type(m).__name__ == "VisionTransformerDistilled"  # DeiT: a distillation token and its head
    if type(m) is not VisionTransformer and not distilled:
        raise unsupported(
            f"the model class {type(m).__name__} (timm's VisionTransformer, DeiT distilled, Eva, Beit and VisionTransformerRelPos convert)"
        )
    if m.global_pool not in ("token", "avg", "map"):
        raise unsupported(f"global_pool={m.global_pool!r} (token, avg and map are supported)")
    include_prefix = bool(getattr(m, "pool_include_prefix", False))
    if include_prefix and m.global_pool != "map":
        raise unsupported(f"{m.global_pool} pooling over the prefix tokens (pool_include_prefix=True)")
    if m.pos_embed is None:
        raise unsupported("no absolute position embedding (pos_embed='none')")
    pe = m.patch_embed
    check_patch_embed(pe)
    if not isinstance(m.head, nn.Linear):
        raise unsupported("no classification head (num_classes=0)", "convert a model with a head")
    norms: list[nn.Module] = [m.norm_pre, m.norm, m.fc_norm]
    blocks: list[Any] = list(m.blocks)
    first = blocks[0]
    for b in blocks:  # before any block's parts are read: other block types have other parts
        if type(b) not in (Block, ResPostBlock, ParallelScalingBlock):
            raise unsupported(f"the block type {type(b).__name__} ({BLOCK_KINDS.get(type(b).__name__, 'block_fn')})")
        if type(b) is not type(first):
            raise unsupported("blocks of different types")
    dim = m.embed_dim
    parallel = type(first) is ParallelScalingBlock
    if parallel:
        heads, hidden, qkv_bias, qk_norm, layer_scale, activation, block_norms = parallel_blocks(blocks, dim)
        norms += block_norms
        mlp_norm = attn_norm = False
    else:
        heads, hidden, qkv_bias = int(first.attn.num_heads), mlp_hidden(first.mlp), first.attn.qkv.bias is not None
        activation, mlp_norm = mlp_kind(first.mlp), not isinstance(first.mlp.norm, nn.Identity)
        attn_norm = not isinstance(getattr(first.attn, "norm", nn.Identity()), nn.Identity)
    res_post = type(first) is ResPostBlock  # x + LN(f(x)); its init_values set the norms' weights, no layer scale
    if not parallel:
        layer_scale = not res_post and isinstance(first.ls1, LayerScale)
        qk_norm = isinstance(getattr(first.attn, "q_norm", None), nn.LayerNorm)
    for i, b in enumerate([] if parallel else blocks):
        a, mlp = b.attn, b.mlp
        if type(a) is not Attention:
            raise unsupported(f"block {i}: attention of type {type(a).__name__}")
        inner = getattr(a, "norm", nn.Identity())  # a norm before the output projection (BEiT-3's scale_attn_norm)
        if isinstance(inner, nn.Identity) != isinstance(getattr(first.attn, "norm", nn.Identity()), nn.Identity):
            raise unsupported("a norm inside attention on some blocks only")
        norms.append(inner)
        if any(isinstance(n, nn.LayerNorm) != qk_norm for n in (a.q_norm, a.k_norm)):
            raise unsupported(f"block {i}: qk-norm other than a LayerNorm on queries and keys of every block")
        if qk_norm:
            norms += [a.q_norm, a.k_norm]
        if a.proj.bias is None or (a.qkv.bias is None) != (first.attn.qkv.bias is None):
            raise unsupported(f"block {i}: attention projection without bias (proj_bias=False)")
        if mlp_kind(mlp) != mlp_kind(first.mlp) or mlp_hidden(mlp) != mlp_hidden(first.mlp):
            raise unsupported("MLPs that differ between blocks")
        if isinstance(mlp.norm, nn.Identity) != isinstance(first.mlp.norm, nn.Identity):
            raise unsupported("an MLP norm on some blocks only")
        norms.append(mlp.norm)
        if not res_post and (
            isinstance(b.ls1, LayerScale) != layer_scale or isinstance(b.ls2, LayerScale) != layer_scale
        ):
            raise unsupported("layer scale on some blocks only")
        norms += [b.norm1, b.norm2]
    if m.global_pool == "map":
        norms.append(check_attention_pool(m.attn_pool, hidden, activation))
    eps = layer_norm_eps([n for n in norms if not isinstance(n, nn.Identity)])
    if isinstance(m.norm, nn.Identity) and isinstance(m.fc_norm, nn.Identity):
        raise unsupported("no final norm (final_norm=False)")
    return ViTConfig(
        **geometry(m),
        dim=dim,
        depth=len(blocks),
        heads=heads,
        mlp_ratio=mlp_ratio(dim, hidden),
        norm_eps=eps,
        qkv_bias=qkv_bias,
        class_token=m.cls_token is not None,
        reg_tokens=int(m.num_reg_tokens),
        no_embed_class=bool(m.no_embed_class),
        pool=POOLS[m.global_pool],
        pool_heads=pool_heads(m),
        pool_prefix=include_prefix,
        fc_norm=isinstance(m.fc_norm, nn.LayerNorm),
        layer_scale=layer_scale,
        pre_norm=isinstance(m.norm_pre, nn.LayerNorm),
        norm="res_post" if res_post else "pre",
        activation=activation,
        mlp_norm=mlp_norm,
        attn_norm=attn_norm,
        qk_norm=qk_norm,
        dist_token=distilled,
        parallel=parallel,
    )


def timm_classes(m: Any, num_classes: int) -> list[str]:
    """ImageNet class names for the ImageNet heads timm knows, else class_0, class_1, ..."""
    from timm.data import ImageNetInfo, infer_imagenet_subset

    subset = infer_imagenet_subset(m)
    if subset:
        names = [str(d) for d in ImageNetInfo(subset).label_descriptions()]
        if len(names) == num_classes:
            return names
    return numbered_classes(num_classes)


def timm_preprocessing(data: dict[str, Any], config: ViTConfig) -> Preprocessing:
    """timm's evaluation transform (resolve_data_config) as our Preprocessing."""
    channels, height, width = data["input_size"]
    if (height, width) != (config.image_size, config.image_size) or channels != config.in_channels:
        raise ConversionError(
            f"timm's data config wants input {data['input_size']}, the model takes {config.image_size} px"
        )
    if data.get("crop_mode", "center") not in CROP_MODES:
        raise unsupported(f"crop_mode={data['crop_mode']!r} in the data config (center and squash are supported)")
    if data["interpolation"] not in ("bilinear", "bicubic"):
        raise unsupported(f"interpolation={data['interpolation']!r} in the data config (bilinear and bicubic)")
    return Preprocessing(
        image_size=config.image_size,
        channels=channels,
        mean=tuple(float(x) for x in data["mean"]),
        std=tuple(float(x) for x in data["std"]),
        resize=CROP_MODES[data.get("crop_mode", "center")],  # type: ignore[arg-type]
        crop_pct=float(data["crop_pct"]),
        interpolation=data["interpolation"],
        resize_backend="pil",  # timm's eval transform resizes the PIL image
    )
