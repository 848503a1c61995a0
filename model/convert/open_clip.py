"""open_clip's CLIP models (`open-clip-torch`) -> our ViT and text tower: `python -m model.convert open_clip`.

The image tower is open_clip's own `VisionTransformer` (a CLS token, a norm before the blocks and one after,
then the projection) or a timm ViT (SigLIP's, attention-pooled, with no projection), converted by the timm
converter. The text tower is open_clip's `TextTransformer`, causal or not, read at the end-of-text token (the
highest id), at a given token or at the last position. The tokenizer is carried as a `tokenizers` file: OpenAI's
BPE, which open_clip ships, through transformers' CLIP tokenizer, or a model's Hugging Face tokenizer.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from model.convert.converted import ConversionError, Converted, mlp_ratio, unsupported
from model.convert.timm_parts import activation_of
from model.convert.weights_file import read_state_dict
from model.preprocessing import Preprocessing
from model.text import TextConfig, TextPool
from model.tokenizer import TokenizerConfig
from model.vit import ViTConfig
from model.zero_shot import Rule, ZeroShotConfig

POOLS: dict[str, TextPool] = {"argmax": "argmax", "eos": "eos", "last": "last"}


def convert_open_clip(arch: str, weights: Path | None, pretrained: str | None) -> Converted:
    """open_clip's `arch`, with a weights file or its pretrained tag (downloaded through open_clip's own code)."""
    try:
        import open_clip
    except ImportError as e:  # not in the runtime set: the convert extra brings it
        raise ConversionError(f"open_clip is not installed ({e}); pip install 'vit-serve[convert]'") from e

    if arch not in open_clip.list_models():
        raise ConversionError(f"open_clip has no model {arch!r}; see open_clip.list_models()")
    if pretrained is not None:
        from model.convert.reachable import check_reachable

        check_reachable(f"open_clip's {arch} ({pretrained})")
    try:
        model = open_clip.create_model(arch, pretrained=pretrained)
    except Exception as e:  # network, a tag it does not know: many types
        raise ConversionError(f"open_clip could not create {arch} (pretrained={pretrained}): {e}") from e
    if weights is not None:
        state = read_state_dict(weights)
        missing, unexpected = model.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise ConversionError(
                f"{weights}: not {arch}'s weights (missing {missing[:4]}, unexpected {unexpected[:4]})"
            )
    converted = from_open_clip_model(model.float().eval(), open_clip.get_tokenizer(arch))
    converted.source |= {"arch": arch, "weights": str(weights.name) if weights else f"pretrained:{pretrained}"}
    return converted


def from_open_clip_model(model: Any, tokenizer: Any) -> Converted:
    """An open_clip CLIP or CustomTextCLIP model (float32, eval) and its tokenizer, converted; its preprocessing
    checked against the evaluation transform open_clip.create_model_and_transforms gives."""
    import open_clip
    from open_clip.transform import PreprocessCfg, image_transform_v2

    config, image, preprocessing = image_tower(model)
    text_module = getattr(model, "text", model)  # CustomTextCLIP keeps its text tower apart
    tokenizer_config, tokenizer_bytes = carried_tokenizer(tokenizer)
    text_config, text_state = text_tower(text_module, tokenizer_config)
    state = {f"text.{k}": v for k, v in text_state.items()}
    state["logit_scale"] = model.logit_scale.detach().reshape(1)
    bias = getattr(model, "logit_bias", None)
    state["logit_bias"] = bias.detach().reshape(1) if bias is not None else torch.zeros(1)
    rule: Rule = "sigmoid" if bias is not None else "softmax"
    zero_shot = ZeroShotConfig(text_config, tokenizer_config, rule=rule)

    def reference(x: Tensor) -> Tensor:
        return model.encode_image(x)

    def reference_text(ids: Tensor) -> Tensor:
        return model.encode_text(ids)

    source = {"source": "open_clip", "open_clip_version": open_clip.__version__}
    return Converted(
        config,
        image,
        [],
        preprocessing,
        reference,
        source,
        zero_shot=zero_shot,
        zero_shot_state=state,
        tokenizer=tokenizer_bytes,
        reference_text=reference_text,
        preprocess=image_transform_v2(PreprocessCfg(**model.visual.preprocess_cfg), is_train=False),
    )


def image_tower(model: Any) -> tuple[ViTConfig, dict[str, Tensor], Preprocessing]:
    from open_clip.timm_model import TimmModel
    from open_clip.transformer import VisionTransformer

    visual = model.visual
    if isinstance(visual, TimmModel):
        config, state = timm_image_tower(visual)
    elif isinstance(visual, VisionTransformer):
        config, state = vit_image_tower(visual)
    else:
        raise unsupported(f"an image tower of type {type(visual).__name__} (open_clip's ViT and timm ViTs convert)")
    return config, state, open_clip_preprocessing(getattr(visual, "preprocess_cfg", {}), visual, config.image_size)


def open_clip_preprocessing(cfg: dict[str, Any], visual: Any, size: int) -> Preprocessing:
    """open_clip's evaluation transform (image_transform): the PIL image resized (the shorter side, or squashed),
    centre-cropped and normalised."""
    mode = cfg.get("resize_mode", "shortest")
    if mode not in ("shortest", "squash"):
        raise unsupported(f"resize_mode={mode!r} (shortest and squash convert)")
    interpolation = cfg.get("interpolation", "bicubic")
    if interpolation not in ("bicubic", "bilinear"):
        raise unsupported(f"interpolation={interpolation!r} (bicubic and bilinear convert)")
    mean, std = cfg.get("mean", visual.image_mean), cfg.get("std", visual.image_std)
    return Preprocessing(
        image_size=size,
        channels=3,
        mean=tuple(float(m) for m in mean),
        std=tuple(float(s) for s in std),
        resize="center_crop" if mode == "shortest" else "squash",
        crop_pct=1.0,
        interpolation=interpolation,
        resize_backend="pil",
    )


def vit_image_tower(v: Any) -> tuple[ViTConfig, dict[str, Tensor]]:
    if v.attn_pool is not None or v.pool_type != "tok" or v.final_ln_after_pool or v.proj is None:
        raise unsupported(f"open_clip image pooling {v.pool_type!r} with attention pooling or no projection")
    blocks = list(v.transformer.resblocks)
    first = blocks[0]
    if not isinstance(first.ls_1, nn.Identity) or not isinstance(first.attn, nn.MultiheadAttention):
        raise unsupported("open_clip blocks with layer scale or their own attention")
    width, size = int(v.conv1.out_channels), int(v.image_size[0])
    config = ViTConfig(
        image_size=size,
        patch_size=int(v.patch_size[0]),
        num_classes=int(v.proj.shape[1]),
        dim=width,
        depth=len(blocks),
        heads=int(first.attn.num_heads),
        mlp_ratio=mlp_ratio(width, int(first.mlp.c_fc.out_features)),
        norm_eps=float(v.ln_pre.eps),
        activation=activation_of(first.mlp.gelu),
        pre_norm=True,
        fc_norm=True,  # ln_post over every token, then the CLS token: the same as over the CLS token alone
    )
    state = blocks_state({k: t.detach() for k, t in v.transformer.state_dict().items()})
    state |= {
        "patch_embed.proj.weight": v.conv1.weight.detach(),
        "patch_embed.proj.bias": torch.zeros(width),
        "cls_token": v.class_embedding.detach().reshape(1, 1, -1),
        "pos_embed": v.positional_embedding.detach()[None],
        "head.weight": v.proj.detach().T,
        "head.bias": torch.zeros(config.num_classes),
    }
    state |= {f"norm_pre.{k}": t.detach() for k, t in v.ln_pre.state_dict().items()}
    state |= {f"fc_norm.{k}": t.detach() for k, t in v.ln_post.state_dict().items()}
    return config, state


def timm_image_tower(visual: Any) -> tuple[ViTConfig, dict[str, Tensor]]:
    """A timm trunk with no projection after it: its pooled embedding is the image's, so the head is the identity
    (set on the trunk, which then computes what it did)."""
    from model.convert.timm_vit import from_timm_model

    if any(True for _ in visual.head.parameters()):
        raise unsupported("a timm image tower with a projection head of open_clip's")
    trunk = visual.trunk
    if isinstance(trunk.head, nn.Identity):
        dim = int(trunk.num_features)
        identity = nn.Linear(dim, dim)
        with torch.no_grad():
            identity.weight.copy_(torch.eye(dim))
            identity.bias.zero_()
        trunk.head, trunk.num_classes = identity, dim
    converted = from_timm_model(trunk)
    return converted.config, converted.state_dict


def blocks_state(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """open_clip's resblocks (`resblocks.N.{ln_1, attn.in_proj_*, attn.out_proj, ln_2, mlp.c_fc, mlp.c_proj}`) in
    our block names."""
    names = {
        "ln_1": "ln_1",
        "ln_2": "ln_2",
        "attn.in_proj_weight": "attn.qkv.weight",
        "attn.in_proj_bias": "attn.qkv.bias",
        "attn.out_proj": "attn.proj",
        "mlp.c_fc": "mlp.fc1",
        "mlp.c_proj": "mlp.fc2",
    }
    out: dict[str, Tensor] = {}
    for key, value in state.items():
        if not key.startswith("resblocks."):
            continue
        layer, rest = key.removeprefix("resblocks.").split(".", 1)
        for theirs, ours in names.items():
            if rest == theirs or rest.startswith(theirs + "."):
                out[f"blocks.{layer}.{ours}{rest[len(theirs) :]}"] = value
                break
        else:
            raise unsupported(f"a block tensor this converter does not map: {key}")
    return out


def text_tower(t: Any, tokenizer: TokenizerConfig) -> tuple[TextConfig, dict[str, Tensor]]:
    if getattr(t, "cls_emb", None) is not None:
        raise unsupported("a text tower with a CLS embedding (CoCa)")
    pool = getattr(t, "text_pool_type", None) or getattr(t, "pool_type", "argmax")
    if pool not in POOLS:
        raise unsupported(f"text pooling {pool!r} (argmax, eos and last convert)")
    blocks = list(t.transformer.resblocks)
    first = blocks[0]
    projection = t.text_projection
    proj_bias = isinstance(projection, nn.Linear) and projection.bias is not None
    width = int(t.token_embedding.embedding_dim)
    embed = int(projection.out_features if isinstance(projection, nn.Linear) else projection.shape[1])
    eos = getattr(t, "text_eos_id", None) or getattr(t, "eos_id", None) or tokenizer.eos_token_id
    config = TextConfig(
        vocab_size=int(t.token_embedding.num_embeddings),
        context_length=int(t.positional_embedding.shape[0]),
        dim=width,
        depth=len(blocks),
        heads=int(first.attn.num_heads),
        mlp_ratio=mlp_ratio(width, int(first.mlp.c_fc.out_features)),
        activation=activation_of(first.mlp.gelu),
        norm_eps=float(t.ln_final.eps),
        causal=getattr(t, "attn_mask", None) is not None,
        pool=POOLS[pool],
        eos_token_id=int(eos),
        embed_dim=embed,
        proj_bias=proj_bias,
    )
    state = blocks_state({k: v.detach() for k, v in t.transformer.state_dict().items()})
    state["token_embed.weight"] = t.token_embedding.weight.detach()
    state["pos_embed"] = t.positional_embedding.detach()
    state |= {f"norm.{k}": v.detach() for k, v in t.ln_final.state_dict().items()}
    if isinstance(projection, nn.Linear):
        state |= {f"proj.{k}": v.detach() for k, v in projection.state_dict().items()}
    else:
        state["proj.weight"] = projection.detach().T
    return config, state


def carried_tokenizer(tokenizer: Any) -> tuple[TokenizerConfig, bytes]:
    """open_clip's tokenizer as a `tokenizers` file and its config."""
    import open_clip.tokenizer as open_clip_tokenizer
    from open_clip.tokenizer import HFTokenizer, SimpleTokenizer

    context = int(tokenizer.context_length)
    if isinstance(tokenizer, SimpleTokenizer):
        if tokenizer.clean_fn is not open_clip_tokenizer._clean_lower:
            raise unsupported("an open_clip BPE tokenizer that does not lower-case")
        data = clip_bpe_tokenizer_json(tokenizer)
        eos = int(tokenizer.eot_token_id)
        return TokenizerConfig("tokenizers", context, pad_token_id=0, eos_token_id=eos), data
    if isinstance(tokenizer, HFTokenizer):
        hf = tokenizer.tokenizer
        canonical = tokenizer.clean_fn is open_clip_tokenizer._clean_canonicalize
        config = TokenizerConfig(
            "tokenizers",
            context,
            pad_token_id=int(hf.pad_token_id or 0),
            eos_token_id=int(hf.eos_token_id or 0),
            pad_to_context=True,
            canonicalize=canonical,
            underscores=canonical,
        )
        return config, hf.backend_tokenizer.to_str().encode("utf-8")
    raise unsupported(f"the tokenizer {type(tokenizer).__name__}")


def clip_bpe_tokenizer_json(tokenizer: Any) -> bytes:
    """OpenAI's CLIP BPE, as open_clip's SimpleTokenizer holds it, written as transformers' CLIP tokenizer file."""
    from transformers import CLIPTokenizer

    encoder: dict[str, int] = tokenizer.encoder
    merges = sorted(tokenizer.bpe_ranks.items(), key=lambda item: item[1])
    with tempfile.TemporaryDirectory() as folder:
        vocab, merges_file = Path(folder) / "vocab.json", Path(folder) / "merges.txt"
        vocab.write_text(json.dumps(encoder), encoding="utf-8")
        merges_file.write_text("#version: 0.2\n" + "\n".join(" ".join(m) for m, _ in merges) + "\n", encoding="utf-8")
        sot, eot = tokenizer.decoder[tokenizer.sot_token_id], tokenizer.decoder[tokenizer.eot_token_id]
        hf = CLIPTokenizer(str(vocab), str(merges_file), bos_token=sot, eos_token=eot, unk_token=eot, pad_token=eot)
        return str(hf.backend_tokenizer.to_str()).encode("utf-8")
