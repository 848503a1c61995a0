"""Tiny random-weight CLIP and SigLIP models with real tokenizers, laid out as the hub lays out a repository."""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from harness.zero_shot import clip_vocabulary

LABELS = ["cat", "dog", "a red car", "Hello, World!", "the   number 42", "café au lait", "x"]
CORPUS = [
    "a photo of a cat",
    "a photo of a dog",
    "a red car on a street",
    "hello world, the number forty two",
    "cafe au lait in a cup",
    "this is a photo of something",
    "an image of a small bird",
    "zebra yak owl fox",
]


TEMPLATE = "a photo of a {}."


@dataclass
class Repo:
    path: Path
    model: Any  # the transformers model
    tokenizer: Any
    processor: Any


def clip_repo(folder: Path, seed: int = 0) -> Repo:
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor, CLIPTokenizer

    path = folder / "clip"
    vocab, merges = clip_vocabulary(folder / "clip-bpe")
    tokenizer = CLIPTokenizer(str(vocab), str(merges))
    config = CLIPConfig(
        text_config=dict(
            vocab_size=49408,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=77,
        ),
        vision_config=dict(
            image_size=32,
            patch_size=8,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
        ),
        projection_dim=24,
        logit_scale_init_value=4.0,  # a sharper softmax than random weights give, so the comparison means something
    )
    torch.manual_seed(seed)
    model = CLIPModel(config).eval()
    processor = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    model.save_pretrained(path)
    # as transformers 5 saves a processor: processor_config.json (the image processor's settings nested in it)
    # and the tokenizer's files, no preprocessor_config.json (siglip_repo saves the image processor alone)
    CLIPProcessor(image_processor=processor, tokenizer=tokenizer).save_pretrained(path)
    return Repo(path, model, tokenizer, processor)


def sentencepiece_model() -> bytes:
    """A small unigram SentencePiece model trained here, with SigLIP's special tokens: <pad> 0, </s> 1, <unk> 2."""
    import sentencepiece

    out = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS * 20),
        model_writer=out,
        vocab_size=60,
        model_type="unigram",
        pad_id=0,
        eos_id=1,
        unk_id=2,
        bos_id=-1,
        character_coverage=1.0,
        hard_vocab_limit=False,
        minloglevel=2,
    )
    return out.getvalue()


def siglip_repo(folder: Path, seed: int = 0) -> Repo:
    from transformers import SiglipTokenizer

    folder.mkdir(parents=True, exist_ok=True)
    spiece = folder / "siglip-spiece.model"
    spiece.write_bytes(sentencepiece_model())
    return saved_siglip(folder / "siglip", SiglipTokenizer(str(spiece)), seed)


def saved_siglip(path: Path, tokenizer: Any, seed: int) -> Repo:
    """A tiny random-weight SiglipModel for `tokenizer`'s vocabulary, saved with it and its image processor."""
    from transformers import SiglipConfig, SiglipImageProcessor, SiglipModel

    config = SiglipConfig(
        text_config=dict(
            vocab_size=tokenizer.vocab_size,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=64,  # the pipeline pads every text to 64
        ),
        vision_config=dict(
            image_size=32,
            patch_size=8,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
        ),
    )
    torch.manual_seed(seed)
    model = SiglipModel(config).eval()
    with torch.no_grad():  # a scale and bias that spread the sigmoid's answers over (0, 1)
        model.logit_scale.fill_(2.5)
        model.logit_bias.fill_(-1.0)
    processor = SiglipImageProcessor(size={"height": 32, "width": 32})
    for part in (model, tokenizer, processor):
        part.save_pretrained(path)
    return Repo(path, model, tokenizer, processor)


def open_clip_model(folder: Path, family: str) -> tuple[Any, Any, str]:
    """A tiny open_clip model of `family` (clip: open_clip's own towers and OpenAI's BPE; siglip: a timm image tower,
    a bidirectional text tower read at the last position, and a Hugging Face tokenizer with canonical text),
    registered under a name of its own: (model, tokenizer, name)."""
    import open_clip
    from transformers import CLIPTokenizer

    name = f"tiny-{family}-test"
    if family == "clip":
        config: dict[str, Any] = {
            "embed_dim": 24,
            "quick_gelu": True,
            "vision_cfg": {"image_size": 32, "layers": 2, "width": 32, "patch_size": 8, "head_width": 8},
            "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 32, "heads": 4, "layers": 2},
        }
    else:
        tokenizer_dir = folder / "siglip-tokenizer"
        CLIPTokenizer(*(str(p) for p in clip_vocabulary(folder / "bpe"))).save_pretrained(tokenizer_dir)
        config = {
            "embed_dim": 192,
            "init_logit_bias": -10,
            "custom_text": True,
            "vision_cfg": {
                "image_size": 224,  # the timm trunk's own
                "timm_model_name": "vit_tiny_patch16_224",
                "timm_model_pretrained": False,
                "timm_pool": "map",
                "timm_proj": "none",
            },
            "text_cfg": {
                "context_length": 64,
                "vocab_size": 49408,
                "hf_tokenizer_name": str(tokenizer_dir),
                "tokenizer_kwargs": {"clean": "canonicalize"},
                "width": 64,
                "heads": 4,
                "layers": 2,
                "no_causal_mask": True,
                "proj_bias": True,
                "pool_type": "last",
                "norm_kwargs": {"eps": 1e-6},
            },
        }
    configs = folder / "open_clip-configs"
    configs.mkdir(parents=True, exist_ok=True)
    (configs / f"{name}.json").write_text(json.dumps(config), encoding="utf-8")
    open_clip.add_model_config(configs)
    torch.manual_seed(0)
    model = open_clip.create_model(name, pretrained=None).eval()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():  # away from the zero and near-zero initial values that would hide a wrong mapping
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * 0.02)
        model.logit_scale.fill_(4.0)
        if getattr(model, "logit_bias", None) is not None:
            model.logit_bias.fill_(-1.0)
    return model, open_clip.get_tokenizer(name), name


def pipeline_scores(repo: Repo, image: Image.Image, labels: list[str], template: str = TEMPLATE) -> torch.Tensor:
    """transformers' zero-shot-image-classification pipeline's probability for each label, in their order."""
    from transformers import pipeline

    classify = pipeline(
        "zero-shot-image-classification", model=repo.model, tokenizer=repo.tokenizer, image_processor=repo.processor
    )
    answers = classify(image, candidate_labels=labels, hypothesis_template=template)
    by_label = {a["label"]: a["score"] for a in answers}
    return torch.tensor([by_label[label] for label in labels])


def siglip2_repo(folder: Path, seed: int = 0) -> Repo:
    """A SigLIP as SigLIP 2's fixed-resolution checkpoints lay it out: model_type siglip with a tokenizer.json (a
    byte-fallback BPE that adds <bos> and <eos>, as Gemma's does) instead of a SentencePiece file."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    bpe.pre_tokenizer = pre_tokenizers.Metaspace()
    bpe.decoder = decoders.Metaspace()
    special = ["<pad>", "<eos>", "<bos>", "<unk>"]
    bpe.train_from_iterator(CORPUS * 20, trainers.BpeTrainer(vocab_size=120, special_tokens=special))
    bpe.post_processor = processors.TemplateProcessing(
        single="<bos> $A <eos>", special_tokens=[("<bos>", 2), ("<eos>", 1)]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        pad_token="<pad>",
        eos_token="<eos>",
        bos_token="<bos>",
        unk_token="<unk>",
        model_input_names=["input_ids"],
    )
    return saved_siglip(folder / "siglip2", tokenizer, seed)
