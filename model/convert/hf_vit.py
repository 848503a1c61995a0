"""Hugging Face image classifiers of the ViT family (a `save_pretrained` directory) -> our ViT:
`ViTForImageClassification`, DeiT's two (`DeiTForImageClassification`, whose distillation token rides along as a
register token, and `DeiTForImageClassificationWithTeacher`, whose two heads are averaged, as ours) and
`BeitForImageClassification` (layer scale, relative position bias per layer or shared, mean pooling).

transformers loads the directory (model.safetensors or pytorch_model.bin, with its own handling of
older key names); its separate query, key and value projections are stacked into our fused qkv.
The image processor's settings come from preprocessor_config.json or, as transformers 5 saves a processor,
processor_config.json's `image_processor`; a directory with neither is refused, never served on guessed settings.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from torch import Tensor

from model.convert.converted import ConversionError, Converted, Renames, mlp_ratio, rename_key, unsupported
from model.preprocessing import Interpolation, Preprocessing
from model.vit import ViTConfig

MODEL_TYPES = ("vit", "deit", "beit")
BODY = r"^(?:vit|deit|beit)\."
LAYER = BODY + r"layers\.(\d+)\."
RENAMES: Renames = [
    (re.compile(BODY + r"embeddings\.cls_token$"), "cls_token"),
    (re.compile(BODY + r"embeddings\.position_embeddings$"), "pos_embed"),
    (re.compile(BODY + r"embeddings\.patch_embeddings\.projection\."), "patch_embed.proj."),
    (re.compile(LAYER + r"attention\.o_proj\."), r"blocks.\1.attn.proj."),
    (re.compile(LAYER + r"layernorm_before\."), r"blocks.\1.ln_1."),
    (re.compile(LAYER + r"layernorm_after\."), r"blocks.\1.ln_2."),
    (re.compile(LAYER + r"mlp\.(fc\d)\."), r"blocks.\1.mlp.\2."),
    (re.compile(LAYER + r"lambda_(\d)$"), r"blocks.\1.ls_\2.gamma"),  # BEiT's layer scale
    (re.compile(LAYER + r"relative_position_bias\.relative_position_bias_table$"), r"blocks.\1.attn.rel_pos_table"),
    (re.compile(BODY + r"layernorm\."), "norm."),
    (re.compile(BODY + r"pooler\.layernorm\."), "fc_norm."),  # BEiT's mean pooling
    (re.compile(r"^(?:classifier|cls_classifier)\."), "head."),
    (re.compile(r"^distillation_classifier\."), "head_dist."),
]
SHARED_BIAS = re.compile(BODY + r"shared_position_bias\.relative_position_bias_table$")  # one for every layer
QKV = re.compile(LAYER + r"attention\.([qkv])_proj\.(weight|bias)$")
RESAMPLE: dict[int, Interpolation] = {2: "bilinear", 3: "bicubic"}  # PIL's resampling filter numbers
# where a directory keeps its image processor's settings (transformers 5: processor_config.json's image_processor)
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")


def convert_hf(model_dir: Path) -> Converted:
    """Load a ViT, DeiT or BEiT ...ForImageClassification directory with transformers and convert it."""
    import transformers
    from transformers import AutoConfig, AutoModelForImageClassification

    if not (model_dir / "config.json").is_file():
        raise ConversionError(f"{model_dir}: no config.json; pass a directory written by save_pretrained")
    hf_config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    if hf_config.model_type not in MODEL_TYPES:
        raise ConversionError(
            f"{model_dir}: model_type {hf_config.model_type!r} is not a ViT (expected one of {', '.join(MODEL_TYPES)})"
        )
    if hf_config.hidden_act != "gelu":
        raise unsupported(f"the activation {hf_config.hidden_act!r} (only exact GELU, 'gelu')")
    processor = hf_image_processor(model_dir)  # before the weights load: a directory without one fails at once
    try:
        # float32 whatever dtype it was saved in: the checkpoint and the logit check are float32
        model = AutoModelForImageClassification.from_pretrained(model_dir, local_files_only=True).float().eval()
    except (OSError, ValueError) as e:
        raise ConversionError(f"{model_dir}: transformers could not load it ({e})") from e
    config = hf_vit_config(hf_config, model)
    classes = [str(hf_config.id2label[i]) for i in range(config.num_classes)]
    preprocessing = hf_preprocessing(processor, config)

    def reference(x: Tensor) -> Tensor:
        logits: Tensor = model(pixel_values=x).logits
        return logits

    source = {"source": "huggingface", "model_dir": model_dir.name, "transformers_version": transformers.__version__}
    state = map_state_dict(model.state_dict(), config)
    return Converted(config, state, classes, preprocessing, reference, source, preprocess=processor_pixels(processor))


def hf_vit_config(c: Any, model: Any) -> ViTConfig:
    teacher = type(model).__name__ == "DeiTForImageClassificationWithTeacher"  # two heads, averaged
    head = model.cls_classifier if teacher else getattr(model, "classifier", None)
    if not isinstance(head, torch.nn.Linear):
        raise unsupported("no classification head (num_labels=0)")
    if not isinstance(c.image_size, int) or not isinstance(c.patch_size, int):
        raise unsupported(f"a non-square image or patch size ({c.image_size}, {c.patch_size})")
    beit: dict[str, Any] = {}
    if c.model_type == "beit":
        if not (c.use_relative_position_bias or c.use_shared_relative_position_bias):
            raise unsupported("BEiT without relative position bias")
        beit = dict(
            qkv_bias=True,  # query and value biases; the key has none
            pos_embed="learned" if c.use_absolute_position_embeddings else "none",
            layer_scale=c.layer_scale_init_value > 0,
            pool="avg" if c.use_mean_pooling else "cls",
            fc_norm=bool(c.use_mean_pooling),
            rel_pos_bias=True,
        )
    return ViTConfig(
        image_size=c.image_size,
        patch_size=c.patch_size,
        in_channels=int(c.num_channels),
        num_classes=int(c.num_labels),
        dim=int(c.hidden_size),
        depth=int(c.num_hidden_layers),
        heads=int(c.num_attention_heads),
        mlp_ratio=mlp_ratio(int(c.hidden_size), int(c.intermediate_size)),
        norm_eps=float(c.layer_norm_eps),
        dist_token=teacher,
        reg_tokens=int(c.model_type == "deit" and not teacher),  # the distillation token, unread
        **({"qkv_bias": bool(c.qkv_bias)} if c.model_type != "beit" else beit),
    )


def map_state_dict(state: dict[str, Tensor], config: ViTConfig) -> dict[str, Tensor]:
    """Rename to our keys; stack each layer's q, k and v projections into one qkv (a missing key bias is zero);
    DeiT's distillation token goes where the config reads it, a shared relative position table to every layer."""
    out: dict[str, Tensor] = {}
    parts: dict[tuple[str, str], dict[str, Tensor]] = {}
    for key, value in state.items():
        match = QKV.match(key)
        if match:
            layer, which, kind = match.groups()
            parts.setdefault((layer, kind), {})[which] = value
        elif key.endswith("embeddings.distillation_token"):
            out["dist_token" if config.dist_token else "reg_token"] = value
        elif SHARED_BIAS.match(key):
            for layer in range(config.depth):
                out[f"blocks.{layer}.attn.rel_pos_table"] = value
        else:
            out[rename_key(key, RENAMES)] = value
    for (layer, kind), p in parts.items():
        zeros = torch.zeros_like(p["q"])
        out[f"blocks.{layer}.attn.qkv.{kind}"] = torch.cat([p["q"], p.get("k", zeros), p["v"]], dim=0)
    return out


def hf_image_processor(model_dir: Path) -> Any:
    """transformers' image processor for the directory, as its pipelines load it: from preprocessor_config.json or
    processor_config.json's `image_processor` (how transformers 5 saves a processor). Refused without either."""
    from transformers import AutoImageProcessor

    where = " and ".join(PROCESSOR_FILES)
    missing = ConversionError(
        f"{model_dir}: no image processor settings (looked for {where}); save the model's processor beside it, e.g. "
        "AutoProcessor.from_pretrained(SOURCE).save_pretrained(DIR), and convert again"
    )
    if not any((model_dir / name).is_file() for name in PROCESSOR_FILES):
        raise missing
    try:
        return AutoImageProcessor.from_pretrained(model_dir, local_files_only=True)
    except OSError:  # a processor_config.json without an image processor (a tokenizer's alone)
        raise missing from None
    except ValueError as e:
        raise ConversionError(f"{model_dir}: transformers could not load its image processor ({e})") from e


def processor_pixels(processor: Any) -> Callable[[Image.Image], Tensor]:
    """The image processor as a function: a PIL image -> the (C, H, W) pixels it gives the model."""

    def preprocess(image: Image.Image) -> Tensor:
        pixels: Tensor = processor(images=image, return_tensors="pt")["pixel_values"][0]
        return pixels

    return preprocess


def hf_preprocessing(processor: Any, config: ViTConfig) -> Preprocessing:
    """The image processor's resize and normalisation as our Preprocessing (transformers 5 resizes tensors)."""
    p = processor.to_dict()  # the saved settings over the processor class's defaults
    where = type(processor).__name__
    size = config.image_size
    resample = int(p.get("resample", 2))  # PIL.Image.Resampling, or its number
    if resample not in RESAMPLE:
        raise unsupported(f"resample={resample} of {where} (2, bilinear, and 3, bicubic, are supported)")
    if p.get("do_rescale", True) and abs(float(p.get("rescale_factor", 1 / 255)) - 1 / 255) > 1e-9:
        raise unsupported(f"rescale_factor={p['rescale_factor']} of {where} (only 1/255)")
    if not p.get("do_resize", True):
        raise unsupported(f"do_resize=false of {where}: images would have to arrive at {size} px already")
    mean, std = (p.get("image_mean", [0.5] * 3), p.get("image_std", [0.5] * 3))
    if not p.get("do_normalize", True):
        mean, std = [0.0] * 3, [1.0] * 3
    policy, crop_pct = hf_resize_policy(p.get("size", {"height": size, "width": size}), p, size, where)
    return Preprocessing(
        image_size=size,
        channels=config.in_channels,
        mean=tuple(float(x) for x in mean),
        std=tuple(float(x) for x in std),
        resize=policy,
        crop_pct=crop_pct,
        interpolation=RESAMPLE[resample],
        resize_backend="tensor",
        crop_offset="floor",  # transformers' center_crop: (H - S) // 2
    )


def hf_resize_policy(target: Any, p: dict[str, Any], size: int, where: str) -> tuple[Any, float]:
    """(resize policy, crop_pct) from the processor's `size` and optional centre crop."""
    cropped = bool(p.get("do_center_crop", False))
    crop = p.get("crop_size", {}) if cropped else {}
    crop_side = crop.get("height", size) if isinstance(crop, dict) else int(crop)
    if crop_side != size or (isinstance(crop, dict) and crop.get("width", size) != size):
        raise ConversionError(f"{where} crops to {crop}, but the model takes {size} px")
    if isinstance(target, dict) and "shortest_edge" in target:
        if not cropped:
            raise unsupported(f"size={target} of {where} without a centre crop (images keep their aspect ratio)")
        return "center_crop", size / int(target["shortest_edge"])
    if isinstance(target, dict) and target.get("height") == target.get("width") and target.get("height"):
        if not cropped and int(target["height"]) != size:
            raise ConversionError(
                f"{where} resizes to {target['height']} px with no crop, but the model takes {size} px"
            )
        return "squash", size / int(target["height"])
    raise unsupported(f"size={target} of {where} (square height/width or shortest_edge)")
