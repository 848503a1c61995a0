"""A model's version is a number (Triton's tools parse versions as integers), the same wherever the same
weights serve; the checkpoint's content hash, short or full, still names it."""

from __future__ import annotations

import pytest

from app.core.contract.description import canonical_version, numeric_version
from app.core.contract.errors import ModelNotFound
from app.core.engine.engine import Engine

HASH = "1191dfd418c52de1c8849e9ad26d63d16b309a3d25ba870db0f0897acae09db3"


def test_the_version_is_the_short_content_hash_as_a_number() -> None:
    assert numeric_version(HASH) == str(0x1191DFD418C5) == "19318223149253"
    assert int(numeric_version("f" * 64)) == 2**48 - 1 < 2**53  # exact as a JSON number, and in an int64


@pytest.mark.parametrize(
    ("asked", "version"),
    [
        ("19318223149253", "19318223149253"),
        ("1191dfd418c5", "19318223149253"),  # the short content hash, as versions were before
        (HASH, "19318223149253"),
        ("123456789012", "123456789012"),  # all digits: a number
        ("not-a-version", "not-a-version"),
    ],
)
def test_a_version_asked_for_is_read_as_the_number(asked: str, version: str) -> None:
    assert canonical_version(asked) == version


async def test_every_lookup_takes_the_number_or_the_hash(service: Engine) -> None:
    model = service.describe(None)
    assert model.version == numeric_version(model.content_hash)
    for asked in (model.version, model.content_hash[:12], model.content_hash):
        assert service.describe(model.name, asked) == model
        assert service.model_ready(model.name, asked)
    with pytest.raises(ModelNotFound, match=f"it serves version {model.version}"):
        service.describe(model.name, "1")
    assert not service.model_ready(model.name, "1")
