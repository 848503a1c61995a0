"""InferOptions: the rules every edge shares are checked once, when the options are built."""

from __future__ import annotations

import pytest

from app.core.contract.errors import InvalidInput
from app.core.contract.request import ATTENTION_KINDS, DecodedImage, EncodedImage, InferOptions, owned


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


def test_an_image_viewing_shared_memory_is_owned_by_a_copy() -> None:
    """What outlives a call (shadow work, decoding on the pool) takes its own copy of a file the engine
    holds as a view of a front-end's memory, which the front-end reuses once the call is answered."""
    memory = bytearray(b"\xff\xd8 a jpeg \xff\xd9")
    viewing = DecodedImage("x.jpg", memoryview(memory), "1", None, 0.0)
    copy = owned(viewing)
    memory[:] = bytes(len(memory))  # the front-end reuses its region
    assert isinstance(copy.data, bytes) and copy.data == b"\xff\xd8 a jpeg \xff\xd9"
    plain = EncodedImage("y.png", b"png")
    assert owned(plain) is plain
