"""Classes named at request time: a CLIP or SigLIP text tower beside the image tower.

The image tower is this project's ViT, whose head projects into the joint space: its output is the image's
embedding. The text tower embeds each class name set in a template ("a photo of a {}."); an image's logit
for a name is the scaled cosine similarity of the two embeddings, plus SigLIP's bias. Probabilities follow the
model's own rule: CLIP's softmax over the names given, SigLIP's sigmoid of each name alone (its training
treated every image-text pair as its own yes or no).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, get_args

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from model.text import TextConfig, TextTransformer
from model.tokenizer import TextTokenizer, TokenizerConfig

Rule = Literal["softmax", "sigmoid"]
DEFAULT_TEMPLATE = "a photo of a {}."


@dataclass(frozen=True)
class ZeroShotConfig:
    text: TextConfig
    tokenizer: TokenizerConfig
    rule: Rule  # softmax over the names (CLIP), or the sigmoid of each (SigLIP)
    template: str = DEFAULT_TEMPLATE  # a class name goes where {} is

    def __post_init__(self) -> None:
        if self.rule not in get_args(Rule):
            raise ValueError(f"rule must be one of {get_args(Rule)}, got {self.rule!r}")
        check_template(self.template)

    def to_dict(self) -> dict[str, Any]:
        return {
            "text": self.text.to_dict(),
            "tokenizer": self.tokenizer.to_dict(),
            "rule": self.rule,
            "template": self.template,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ZeroShotConfig:
        return cls(
            TextConfig.from_dict(d["text"]),
            TokenizerConfig.from_dict(d["tokenizer"]),
            d["rule"],
            d.get("template", DEFAULT_TEMPLATE),
        )


def check_template(template: str) -> str:
    """A template with one `{}` where the class name goes; ValueError otherwise."""
    try:
        filled = template.format("x")
    except (IndexError, KeyError, ValueError) as e:
        raise ValueError(f"template {template!r} must hold one {{}} for the class name and no other braces") from e
    if template.count("{}") != 1 or filled == template:
        raise ValueError(f"template {template!r} must hold one {{}} for the class name")
    return template


class ZeroShot(nn.Module):
    """The text tower, its tokenizer and the logit scale (and bias) that compare its embeddings with images'."""

    def __init__(self, config: ZeroShotConfig, tokenizer: bytes) -> None:
        super().__init__()
        self.config = config
        self.text = TextTransformer(config.text)
        self.logit_scale = nn.Parameter(torch.zeros(1))  # its exp multiplies the cosine similarities
        self.logit_bias = nn.Parameter(torch.zeros(1))  # SigLIP's; 0 for CLIP
        self.tokenizer = TextTokenizer(config.tokenizer, tokenizer)

    @property
    def embed_dim(self) -> int:
        return self.config.text.embed_dim

    def prompts(self, labels: list[str], template: str | None = None) -> list[str]:
        return [(template or self.config.template).format(label) for label in labels]

    def embed_texts(self, texts: list[str]) -> Tensor:
        """Texts -> their embeddings (L, embed_dim), normalised to unit length."""
        device = self.logit_scale.device
        ids, lengths = self.tokenizer(texts)
        return F.normalize(self.text(ids.to(device), lengths).float(), dim=-1)

    def logits(self, images: Tensor, texts: Tensor) -> Tensor:
        """Image embeddings (B, D), unnormalised as the image tower gives them, and normalised text embeddings
        (L, D) -> logits (B, L)."""
        images = F.normalize(images.float(), dim=-1)
        scale, bias = self.logit_scale.to(images.device).exp(), self.logit_bias.to(images.device)
        # F.linear, not images @ texts.T: on the CPU the transposed product took 3 ms for 1,000 labels, this 25 us
        return F.linear(images, texts.to(images.device)) * scale + bias

    def probabilities(self, logits: Tensor) -> Tensor:
        """Logits (B, L) -> probabilities by the model's rule."""
        return logits.softmax(dim=-1) if self.config.rule == "softmax" else logits.sigmoid()
