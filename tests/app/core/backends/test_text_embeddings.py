"""A zero-shot model's label embeddings: computed once per (template, label), kept within the bound, least
recently used evicted, equal to the text tower's own."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
import torch
from prometheus_client import CollectorRegistry, Counter

from app.core.backends.text_embeddings import LabelEmbeddings
from model.checkpoint import load_checkpoint
from model.convert.__main__ import main as convert_main
from model.zero_shot import ZeroShot
from tests.support.zero_shot import clip_repo

pytestmark = pytest.mark.slow  # converts a transformers model


@pytest.fixture(scope="module")
def tower(tmp_path_factory: pytest.TempPathFactory) -> ZeroShot:
    folder = tmp_path_factory.mktemp("clip")
    repo = clip_repo(folder)
    checkpoint = convert_main(["hf", "--model-dir", str(repo.path), "--output", str(folder / "clip.safetensors")])
    zero_shot = load_checkpoint(checkpoint).zero_shot
    assert zero_shot is not None
    return zero_shot


def counted() -> Counter:
    return Counter("texts", "texts embedded", registry=CollectorRegistry())


async def inline(fn: Callable[..., Any], *args: Any) -> Any:
    return fn(*args)


def embeddings(tower: ZeroShot, labels: list[str], template: str = "a photo of a {}.") -> torch.Tensor:
    with torch.inference_mode():
        return tower.embed_texts(tower.prompts(labels, template)).float()


def test_labels_are_embedded_once_and_equal_the_towers_own(tower: ZeroShot) -> None:
    computed = counted()
    cache = LabelEmbeddings(tower, max_labels=100, computed=computed)
    first = asyncio.run(cache.of("a photo of a {}.", ("cat", "dog", "x"), inline))
    torch.testing.assert_close(first, embeddings(tower, ["cat", "dog", "x"]))
    again = asyncio.run(cache.of("a photo of a {}.", ("x", "cat"), inline))  # a new set of known labels
    torch.testing.assert_close(again, first[[2, 0]])
    other = asyncio.run(cache.of("{}", ("cat",), inline))  # another template: another prompt
    torch.testing.assert_close(other, embeddings(tower, ["cat"], "{}"))
    assert computed._value.get() == 4


def test_the_caches_stay_within_their_bound_least_recently_used_first(tower: ZeroShot) -> None:
    computed = counted()
    cache = LabelEmbeddings(tower, max_labels=4, computed=computed)
    cache.compute("{}", ("a", "b", "c"))
    cache.compute("{}", ("d", "e"))  # five labels: "a", the least recently used, goes
    assert [label for _, label in cache.labels] == ["b", "c", "d", "e"]
    assert cache.set_rows <= 4 and list(cache.sets) == [("{}", ("d", "e"))]
    cache.compute("{}", ("a",))
    assert computed._value.get() == 6  # "a" embedded again
    big = cache.compute("{}", tuple("fghij"))  # larger than the bound: answered, not kept whole
    assert big.shape[0] == 5 and ("{}", tuple("fghij")) not in cache.sets
