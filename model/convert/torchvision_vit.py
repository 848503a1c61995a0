"""torchvision `VisionTransformer` -> our ViT.

Its `nn.MultiheadAttention` keeps the query, key and value projections stacked in one
`in_proj_weight` (q; k; v rows), which is exactly our fused `qkv` layout.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

from torch import Tensor, nn

from model.convert.converted import (
    ConversionError,
    Converted,
    Renames,
    mlp_ratio,
    numbered_classes,
    rename_key,
    unsupported,
)
from model.convert.weights_file import read_state_dict
from model.preprocessing import Preprocessing
from model.vit import ViTConfig

ARCHS = ("vit_b_16", "vit_b_32", "vit_l_16", "vit_l_32", "vit_h_14")
LAYER = r"^encoder\.layers\.encoder_layer_(\d+)\."
RENAMES: Renames = [
    (re.compile(r"^conv_proj\."), "patch_embed.proj."),
    (re.compile(r"^class_token$"), "cls_token"),
    (re.compile(r"^encoder\.pos_embedding$"), "pos_embed"),
    (re.compile(LAYER + r"ln_(\d)\."), r"blocks.\1.ln_\2."),
    (re.compile(LAYER + r"self_attention\.in_proj_(weight|bias)$"), r"blocks.\1.attn.qkv.\2"),
    (re.compile(LAYER + r"self_attention\.out_proj\."), r"blocks.\1.attn.proj."),
    (re.compile(LAYER + r"mlp\.0\."), r"blocks.\1.mlp.fc1."),
    (re.compile(LAYER + r"mlp\.3\."), r"blocks.\1.mlp.fc2."),
    (re.compile(r"^encoder\.ln\."), "norm."),
    (re.compile(r"^heads\.head\."), "head."),
]


def convert_torchvision(arch: str, weights: Path | None, pretrained: bool, weights_name: str | None) -> Converted:
    """Build torchvision's `arch` with the given weights (a file, or its own download) and convert it."""
    import torchvision
    from torchvision.models import get_model, get_model_weights

    if arch not in ARCHS:
        raise ConversionError(f"torchvision arch must be one of {', '.join(ARCHS)}, got {arch!r}")
    enum: Any = get_model_weights(arch)
    if weights_name is not None and weights_name not in enum.__members__:
        raise ConversionError(f"{arch} has no weights {weights_name!r}; choose one of {', '.join(enum.__members__)}")
    if pretrained:
        recipe = enum[weights_name] if weights_name else enum.DEFAULT
        try:
            model = get_model(arch, weights=recipe)
        except Exception as e:  # network errors come in many types
            raise ConversionError(
                f"could not fetch {arch} {recipe.name} ({e}); without internet, download the weights "
                "elsewhere and pass --weights FILE"
            ) from e
        source = f"torchvision {recipe.name}"
    else:
        assert weights is not None
        model = torchvision_model_for(arch, read_state_dict(weights), weights)
        source = weights.name
        recipe = enum[weights_name] if weights_name else matching_recipe(enum, model.image_size)
    model = model.float().eval()
    config = torchvision_config(model)
    state = {rename_key(k, RENAMES): v for k, v in model.state_dict().items()}
    categories = list(recipe.meta["categories"])
    classes = categories if len(categories) == config.num_classes else numbered_classes(config.num_classes)
    info = {"source": "torchvision", "arch": arch, "weights": source, "recipe": recipe.name}
    info["torchvision_version"] = torchvision.__version__
    preprocessing = torchvision_preprocessing(recipe, config)
    return Converted(config, state, classes, preprocessing, model, info, preprocess=recipe_transform(recipe, config))


def torchvision_model_for(arch: str, state: dict[str, Tensor], path: Path) -> Any:
    """torchvision's `arch`, sized to the file's head and position table, with its weights loaded."""
    from torchvision.models import get_model

    if "heads.pre_logits.weight" in state:
        raise unsupported("a pre-logits layer before the head (representation_size)")
    if "heads.head.weight" not in state or "encoder.pos_embedding" not in state:
        raise ConversionError(
            f"{path}: not a torchvision ViT state dict (no heads.head.weight or encoder.pos_embedding)"
        )
    grid = math.isqrt(state["encoder.pos_embedding"].shape[1] - 1)
    patch = int(arch.rsplit("_", 1)[1])
    num_classes = int(state["heads.head.weight"].shape[0])
    model: Any = get_model(arch, weights=None, image_size=grid * patch, num_classes=num_classes)
    try:
        model.load_state_dict(state)
    except RuntimeError as e:
        raise ConversionError(f"{path}: the weights do not fit torchvision's {arch}: {str(e).splitlines()[0]}") from e
    return model


def matching_recipe(enum: Any, image_size: int) -> Any:
    """The weights recipe whose crop is this image size, preferring the default; else the default."""
    recipes = [enum.DEFAULT, *[w for w in enum if w != enum.DEFAULT]]
    return next((w for w in recipes if w.transforms().crop_size[0] == image_size), enum.DEFAULT)


def torchvision_config(m: Any) -> ViTConfig:
    if not isinstance(m.conv_proj, nn.Conv2d):
        raise unsupported("a convolutional stem (conv_stem_configs)")
    if len(m.heads) != 1:
        raise unsupported("a pre-logits layer before the head (representation_size)")
    layers = list(m.encoder.layers)
    first = layers[0]
    for layer in layers:
        act = layer.mlp[1]
        if type(act) is not nn.GELU or act.approximate != "none":
            raise unsupported(f"the activation {act!r} (only exact GELU)")
    return ViTConfig(
        image_size=int(m.image_size),
        patch_size=int(m.patch_size),
        in_channels=int(m.conv_proj.in_channels),
        num_classes=int(m.heads.head.out_features),
        dim=int(m.hidden_dim),
        depth=len(layers),
        heads=int(first.self_attention.num_heads),
        mlp_ratio=mlp_ratio(int(m.hidden_dim), int(m.mlp_dim)),
        norm_eps=float(first.ln_1.eps),
    )


def recipe_transform(recipe: Any, config: ViTConfig) -> Any:
    """The recipe's own `weights.transforms()`; for weights of another size, torchvision's same transform with the
    recipe's crop ratio at that size (what `torchvision_preprocessing` records)."""
    t = recipe.transforms()
    if int(t.crop_size[0]) == config.image_size:
        return t
    resize = round(config.image_size * int(t.resize_size[0]) / int(t.crop_size[0]))
    return recipe.transforms(crop_size=config.image_size, resize_size=resize)  # the recipe's keywords, two changed


def torchvision_preprocessing(recipe: Any, config: ViTConfig) -> Preprocessing:
    """`weights.transforms()` (ImageClassification: resize shorter side, centre crop) as our Preprocessing."""
    t = recipe.transforms()
    crop, resize = int(t.crop_size[0]), int(t.resize_size[0])
    if crop != config.image_size:  # a recipe for another size: keep its crop ratio at ours
        resize = round(config.image_size * resize / crop)
        crop = config.image_size
    interpolation = t.interpolation.value  # "bilinear" or "bicubic"
    if interpolation not in ("bilinear", "bicubic"):
        raise unsupported(f"{interpolation} resizing in {recipe.name}'s transforms")
    return Preprocessing(
        image_size=crop,
        channels=config.in_channels,
        mean=tuple(float(x) for x in t.mean),
        std=tuple(float(x) for x in t.std),
        resize="center_crop",
        crop_pct=crop / resize,
        interpolation=interpolation,
        resize_backend="pil",  # weights.transforms() resizes a PIL image with PIL
    )
