"""InferOptions: the rules every edge shares are checked once, when the options are built."""

from __future__ import annotations

import pytest

from app.core.contract.errors import InvalidInput
from app.core.contract.request import ATTENTION_KINDS, InferOptions


def test_the_attention_kinds() -> None:
    assert ATTENTION_KINDS == ("none", "rollout", "last", "gradient")
    assert InferOptions().attention == "none"


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"attention": "saliency"}, "attention must be one of none, rollout, last, gradient"),
        ({"overlay": True}, "overlay=true draws an attention map"),
        ({"attention": "rollout", "target": "star"}, "target chooses the class a gradient map explains"),
        ({"target": "3"}, "also pass attention=gradient"),
        ({"normalize": True}, "normalize=true L2-normalises the embedding: also pass embedding=true"),
    ],
)
def test_invalid_combinations_are_refused(options: dict[str, object], message: str) -> None:
    with pytest.raises(InvalidInput, match=message):
        InferOptions(**options)  # type: ignore[arg-type]


def test_valid_combinations() -> None:
    assert InferOptions("gradient", "star").target == "star"
    assert InferOptions("last", overlay=True).overlay
