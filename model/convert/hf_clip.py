"""Hugging Face contrastive image-text models (a `save_pretrained` directory) -> our ViT and text tower:
`CLIPModel` and `SiglipModel` (whose model_type SigLIP 2's fixed-resolution checkpoints share).

The image tower becomes a ViT whose head projects into the joint space (CLIP's `visual_projection`; SigLIP's
pooled output is the embedding itself, so its head is the identity). The text tower becomes a
`model.text.TextTransformer`, its tokenizer travels as bytes (`model.tokenizer`), and the logit scale and bias
come along, so that a class name's probability is computed as the library computes it.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from model.convert.converted import ConversionError, Converted, mlp_ratio, unsupported
from model.convert.hf_vit import hf_image_processor, hf_preprocessing, processor_pixels
from model.text import TextConfig, TextPool
from model.tokenizer import TokenizerConfig
from model.vit import Activation, ViTConfig
from model.zero_shot import ZeroShotConfig

MODEL_TYPES = ("clip", "siglip")
ACTIVATIONS: dict[str, Activation] = {"quick_gelu": "quick_gelu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh"}
LAYER = re.compile(r"^(?:vision|text)_model\.encoder\.layers\.(\d+)\.(.+)$")
LAYER_PARTS = {
    "layer_norm1": "ln_1",
    "layer_norm2": "ln_2",
    "self_attn.out_proj": "attn.proj",
    "mlp.fc1": "mlp.fc1",
    "mlp.fc2": "mlp.fc2",
}
QKV = re.compile(r"^self_attn\.([qkv])_proj\.(weight|bias)$")


def is_zero_shot(model_dir: Path) -> bool:
    """Whether the directory holds a CLIP or SigLIP model (both towers), by its config's model_type."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(model_dir, local_files_only=True).model_type in MODEL_TYPES
    except (OSError, ValueError):
        return False


def convert_hf_clip(model_dir: Path) -> Converted:
    """Load a CLIPModel or SiglipModel directory with transformers and convert both towers and the tokenizer."""
    import transformers
    from transformers import AutoConfig, AutoModel, AutoTokenizer

    hf_config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    if hf_config.model_type not in MODEL_TYPES:
        raise ConversionError(f"{model_dir}: model_type {hf_config.model_type!r} is not CLIP or SigLIP")
    processor = hf_image_processor(model_dir)  # before the weights load: a directory without one fails at once
    try:
        model = AutoModel.from_pretrained(model_dir, local_files_only=True).float().eval()
        tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ConversionError(f"{model_dir}: transformers could not load it ({e})") from e
    siglip = hf_config.model_type == "siglip"
    vision, text = hf_config.vision_config, hf_config.text_config
    if siglip and not getattr(vision, "vision_use_head", True):
        raise unsupported("a SigLIP image tower without its attention pooling head")
    config = image_config(vision, model, siglip)
    state = model.state_dict()
    image = image_state(state, config, siglip)
    tokenizer_config, tokenizer_bytes = tokenizer_of(tokenizer, text, siglip, model_dir)
    zero_shot = ZeroShotConfig(
        text_config(text, model, siglip, tokenizer_config, "attention_mask" in tokenizer.model_input_names),
        tokenizer_config,
        rule="sigmoid" if siglip else "softmax",
    )
    text_state = {f"text.{k}": v for k, v in text_tower_state(state, siglip).items()}
    text_state["logit_scale"] = state["logit_scale"].reshape(1)
    text_state["logit_bias"] = state["logit_bias"].reshape(1) if siglip else torch.zeros(1)
    preprocessing = hf_preprocessing(processor, config)

    def reference(x: Tensor) -> Tensor:
        out = model.get_image_features(pixel_values=x)
        return out if isinstance(out, Tensor) else out.pooler_output

    def reference_text(ids: Tensor) -> Tensor:
        out = model.get_text_features(input_ids=ids)
        return out if isinstance(out, Tensor) else out.pooler_output

    source = {
        "source": "huggingface",
        "model_dir": model_dir.name,
        "model_type": hf_config.model_type,
        "transformers_version": transformers.__version__,
    }
    return Converted(
        config,
        image,
        [],
        preprocessing,
        reference,
        source,
        zero_shot=zero_shot,
        zero_shot_state=text_state,
        tokenizer=tokenizer_bytes,
        reference_text=reference_text,
        preprocess=processor_pixels(processor),
    )


def activation(name: str) -> Activation:
    if name not in ACTIVATIONS:
        raise unsupported(f"the activation {name!r} (quick_gelu, gelu and gelu_pytorch_tanh convert)")
    return ACTIVATIONS[name]


def image_config(v: Any, model: Any, siglip: bool) -> ViTConfig:
    embed = int(model.config.vision_config.hidden_size) if siglip else int(model.visual_projection.out_features)
    common: dict[str, Any] = dict(
        image_size=int(v.image_size),
        patch_size=int(v.patch_size),
        in_channels=int(v.num_channels),
        num_classes=embed,
        dim=int(v.hidden_size),
        depth=int(v.num_hidden_layers),
        heads=int(v.num_attention_heads),
        mlp_ratio=mlp_ratio(int(v.hidden_size), int(v.intermediate_size)),
        norm_eps=float(v.layer_norm_eps),
        activation=activation(v.hidden_act),
    )
    if (
        siglip
    ):  # no CLS token; attention pooling over the patches after the final norm; the pooled vector is the embedding
        return ViTConfig(**common, class_token=False, pool="map")
    # CLIP: a norm before the blocks, the CLS token normalised after them (timm's fc_norm), then the projection
    return ViTConfig(**common, pre_norm=True, fc_norm=True)


def layer_key(key: str, prefix: str) -> str | None:
    """An encoder layer's tensor name in ours (`blocks.N...`), or None for q/k/v (stacked apart)."""
    match = LAYER.match(key)
    assert match is not None
    layer, rest = match.groups()
    for part, ours in LAYER_PARTS.items():
        if rest.startswith(part + "."):
            return f"{prefix}{layer}.{ours}{rest[len(part) :]}"
    if QKV.match(rest):
        return None
    raise ConversionError(f"an encoder tensor this converter does not map: {key}")


def stack_qkv(state: dict[str, Tensor], tower: str, depth: int, out: dict[str, Tensor]) -> None:
    for layer in range(depth):
        for kind in ("weight", "bias"):
            parts = [state[f"{tower}.encoder.layers.{layer}.self_attn.{w}_proj.{kind}"] for w in "qkv"]
            out[f"blocks.{layer}.attn.qkv.{kind}"] = torch.cat(parts, dim=0)


def encoder_state(state: dict[str, Tensor], tower: str) -> dict[str, Tensor]:
    out: dict[str, Tensor] = {}
    depth = 0
    for key, value in state.items():
        if key.startswith(f"{tower}.encoder.layers."):
            name = layer_key(key, "blocks.")
            depth = max(depth, int(key.split(".")[3]) + 1)
            if name is not None:
                out[name] = value
    stack_qkv(state, tower, depth, out)
    return out


def image_state(state: dict[str, Tensor], config: ViTConfig, siglip: bool) -> dict[str, Tensor]:
    v = "vision_model"
    out = encoder_state(state, v)
    out["patch_embed.proj.weight"] = state[f"{v}.embeddings.patch_embedding.weight"]
    out["pos_embed"] = state[f"{v}.embeddings.position_embedding.weight"][None]
    if siglip:
        out["patch_embed.proj.bias"] = state[f"{v}.embeddings.patch_embedding.bias"]
        out |= {f"norm.{k}": state[f"{v}.post_layernorm.{k}"] for k in ("weight", "bias")}
        head = f"{v}.head"
        dim = config.dim
        in_w, in_b = state[f"{head}.attention.in_proj_weight"], state[f"{head}.attention.in_proj_bias"]
        out |= {
            "attn_pool.latent": state[f"{head}.probe"],
            "attn_pool.q.weight": in_w[:dim],
            "attn_pool.q.bias": in_b[:dim],
            "attn_pool.kv.weight": in_w[dim:],
            "attn_pool.kv.bias": in_b[dim:],
        }
        for theirs, ours in (
            ("attention.out_proj", "proj"),
            ("layernorm", "norm"),
            ("mlp.fc1", "mlp.fc1"),
            ("mlp.fc2", "mlp.fc2"),
        ):
            out |= {f"attn_pool.{ours}.{k}": state[f"{head}.{theirs}.{k}"] for k in ("weight", "bias")}
        out["head.weight"] = torch.eye(dim)  # the pooled vector is the embedding
        out["head.bias"] = torch.zeros(dim)
        return out
    out["patch_embed.proj.bias"] = torch.zeros(config.dim)  # CLIP's patch embedding has no bias
    out["cls_token"] = state[f"{v}.embeddings.class_embedding"].reshape(1, 1, -1)
    out |= {f"norm_pre.{k}": state[f"{v}.pre_layrnorm.{k}"] for k in ("weight", "bias")}
    out |= {f"fc_norm.{k}": state[f"{v}.post_layernorm.{k}"] for k in ("weight", "bias")}
    out["head.weight"] = state["visual_projection.weight"]
    out["head.bias"] = torch.zeros(config.num_classes)
    return out


def text_config(t: Any, model: Any, siglip: bool, tokenizer: TokenizerConfig, mask_padding: bool) -> TextConfig:
    pool: TextPool
    if siglip:
        embed, pool, eos = int(model.text_model.head.out_features), "last", tokenizer.eos_token_id
    else:
        eos = int(t.eos_token_id)
        # before transformers' PR 24773 CLIP configs said eos_token_id=2 and the text was read at its highest id
        embed, pool = int(model.text_projection.out_features), "argmax" if eos == 2 else "eos"
    return TextConfig(
        vocab_size=int(t.vocab_size),
        context_length=int(t.max_position_embeddings),
        dim=int(t.hidden_size),
        depth=int(t.num_hidden_layers),
        heads=int(t.num_attention_heads),
        mlp_ratio=mlp_ratio(int(t.hidden_size), int(t.intermediate_size)),
        activation=activation(t.hidden_act),
        norm_eps=float(t.layer_norm_eps),
        causal=not siglip,
        pool=pool,
        eos_token_id=eos,
        embed_dim=embed,
        proj_bias=siglip,
        mask_padding=mask_padding,
    )


def text_tower_state(state: dict[str, Tensor], siglip: bool) -> dict[str, Tensor]:
    t = "text_model"
    out = encoder_state(state, t)
    out["token_embed.weight"] = state[f"{t}.embeddings.token_embedding.weight"]
    out["pos_embed"] = state[f"{t}.embeddings.position_embedding.weight"]
    out |= {f"norm.{k}": state[f"{t}.final_layer_norm.{k}"] for k in ("weight", "bias")}
    if siglip:
        out |= {f"proj.{k}": state[f"{t}.head.{k}"] for k in ("weight", "bias")}
    else:
        out["proj.weight"] = state["text_projection.weight"]
    return out


def tokenizer_of(tokenizer: Any, text: Any, siglip: bool, model_dir: Path) -> tuple[TokenizerConfig, bytes]:
    """The tokenizer's file as bytes and how to use it: a tokenizer.json (tokenizers), or SigLIP's SentencePiece
    model."""
    context = int(text.max_position_embeddings)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else int(getattr(text, "eos_token_id", 0) or 0)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        data = backend.to_str().encode("utf-8")
        return TokenizerConfig("tokenizers", context, int(pad), int(eos), pad_to_context=siglip), data
    vocab = getattr(tokenizer, "vocab_file", None)
    if vocab is None or not Path(vocab).is_file():
        raise ConversionError(f"{model_dir}: its tokenizer ({type(tokenizer).__name__}) has no file to carry")
    config = TokenizerConfig(
        "sentencepiece",
        context,
        int(pad),
        int(eos),
        pad_to_context=siglip,
        canonicalize=siglip,
        lowercase=bool(getattr(tokenizer, "do_lower_case", True)),
        unk_token=str(tokenizer.unk_token),
    )
    return config, Path(vocab).read_bytes()
