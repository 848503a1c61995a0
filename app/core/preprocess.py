"""Turn one decoded image into the model's input tensor, exactly as the checkpoint prescribes."""

from __future__ import annotations

from PIL import Image
from torch import Tensor

from model.preprocessing import EvalTransform, Preprocessing


class Preprocessor:
    """Resize per the checkpoint's policy, scale to [0, 1], normalise -> (C, S, S) float32.

    It is the evaluation transform the model was scored with, so served and measured accuracy agree.
    """

    def __init__(self, p: Preprocessing) -> None:
        self.preprocessing = p
        self.transform = EvalTransform(p)

    def __call__(self, image: Image.Image) -> Tensor:
        x: Tensor = self.transform(image)
        return x
