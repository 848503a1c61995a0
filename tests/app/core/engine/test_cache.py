"""The response cache (VIT_CACHE_BYTES) through the engine: hits skip the forward and keep the request's
own file names; the key covers the model version, the image and every option; the bytes are bounded
with the least recently used evicted; identical misses under way are computed once."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch

from app.core.contract.errors import UnsupportedMediaType
from app.core.contract.request import EncodedImage, InferOptions
from app.core.engine.cache import prediction_bytes
from app.core.engine.engine import Engine
from app.settings import BUNDLED_WEIGHTS, Settings
from harness.images import encode
from model.shapes import make_sample
from tests.support.checkpoints import replace_checkpoint, write_tiny_checkpoint
from tests.support.clients import slow_forward, until
from tests.support.settings import cpu_settings

FILES = [EncodedImage(f"{i}.png", encode(make_sample(11, i).image)) for i in range(4)]


def settings(checkpoint: Path, **overrides: object) -> Settings:
    return cpu_settings(**{"weights": checkpoint, "cache_bytes": 1 << 20, **overrides})


@pytest.fixture
async def cached(tiny_checkpoint: Path) -> AsyncIterator[Engine]:
    async with Engine.serving(settings(tiny_checkpoint)) as engine:
        yield engine


def computed(engine: Engine) -> float:
    """Images the model has computed so far."""
    return engine.metrics.images.labels(engine.model(None).name)._value.get()


def counted(engine: Engine) -> tuple[float, float]:
    name = engine.model(None).name
    return engine.metrics.cache_hits.labels(name)._value.get(), engine.metrics.cache_misses.labels(name)._value.get()


async def test_a_hit_skips_the_forward_and_keeps_the_requests_file_name(cached: Engine) -> None:
    model = cached.model(None)
    first = await cached.lane.run(model, FILES[:2], InferOptions("rollout"))
    assert computed(cached) == 2
    renamed = [EncodedImage("again.png", FILES[1].data), FILES[0], EncodedImage("new.png", FILES[2].data)]
    second = await cached.lane.run(model, renamed, InferOptions("rollout"))
    assert computed(cached) == 3  # only the image not seen before
    assert counted(cached) == (2, 3)
    assert [p.filename for p in second.predictions] == ["again.png", "0.png", "new.png"]
    torch.testing.assert_close(second.predictions[0].probabilities, first.predictions[1].probabilities)
    torch.testing.assert_close(second.predictions[0].attention_map, first.predictions[1].attention_map)
    assert second.model == first.model


async def test_every_option_that_changes_the_answer_is_in_the_key(cached: Engine) -> None:
    model = cached.model(None)
    variants = [
        InferOptions(),
        InferOptions("rollout"),
        InferOptions("last"),
        InferOptions("gradient", target="0"),
        InferOptions("gradient", target="1"),
        InferOptions("rollout", overlay=True),
        InferOptions(embedding=True),
        InferOptions(embedding=True, normalize=True),
    ]
    answers = [await cached.lane.run(model, FILES[:1], options) for options in variants]
    assert computed(cached) == len(variants)  # each a miss
    assert answers[1].predictions[0].overlay_png is None and answers[5].predictions[0].overlay_png is not None
    embedding, normalized = answers[6].predictions[0].embedding, answers[7].predictions[0].embedding
    assert embedding is not None and normalized is not None
    torch.testing.assert_close(normalized, torch.nn.functional.normalize(embedding, dim=0))
    again = [await cached.lane.run(model, FILES[:1], options) for options in variants]
    assert computed(cached) == len(variants)  # each a hit now
    for a, b in zip(answers, again, strict=True):
        assert a.predictions[0].overlay_png == b.predictions[0].overlay_png
    # a target given as its label is the same class as its index: the same entry
    label = model.classes[1]
    await cached.lane.run(model, FILES[:1], InferOptions("gradient", target=label))
    assert computed(cached) == len(variants)


async def test_an_out_of_distribution_score_asked_for_is_never_answered_from_an_entry_without_one() -> None:
    async with Engine.serving(settings(BUNDLED_WEIGHTS)) as engine:
        model = engine.model(None)
        plain = await engine.lane.run(model, FILES[:1], InferOptions())
        scored = await engine.lane.run(model, FILES[:1], InferOptions(ood=True))
        again = await engine.lane.run(model, FILES[:1], InferOptions(ood=True))
        assert computed(engine) == 2  # the scored request missed; its repeat hit
    assert plain.predictions[0].ood_score is None
    assert scored.predictions[0].ood_score is not None
    assert again.predictions[0].ood_score == scored.predictions[0].ood_score


async def test_pixels_are_kept_by_their_values_and_shape(cached: Engine) -> None:
    model = cached.model(None)
    pixels = torch.stack([model.preparer.prepare(f, keep_image=False).pixels for f in FILES[:2]])
    first = await cached.lane.run(model, pixels, InferOptions())
    second = await cached.lane.run(model, pixels.clone(), InferOptions())
    assert computed(cached) == 2
    assert [p.filename for p in second.predictions] == ["pixels[0]", "pixels[1]"]
    torch.testing.assert_close(first.predictions[1].probabilities, second.predictions[1].probabilities)
    await cached.lane.run(model, pixels + 0.01, InferOptions())
    assert computed(cached) == 4


async def test_a_new_version_never_answers_from_the_old_ones_entries(tmp_path: Path) -> None:
    (tmp_path / "models").mkdir()
    path = write_tiny_checkpoint(tmp_path / "models" / "m.safetensors", seed=0)
    s = settings(path, model_repository=tmp_path / "models", model_control="explicit", models="m", weights=path)
    async with Engine.serving(s) as engine:
        old = await engine.lane.run(engine.model("m"), FILES[:1], InferOptions())
        replace_checkpoint(path, seed=5)
        await engine.load_model("m")
        new = await engine.lane.run(engine.model("m"), FILES[:1], InferOptions())
        assert new.model.version != old.model.version
        assert not torch.allclose(new.predictions[0].probabilities, old.predictions[0].probabilities)
        assert engine.metrics.cache_misses.labels("m")._value.get() == 2


async def test_the_bytes_are_bounded_and_the_least_recently_used_goes(tiny_checkpoint: Path) -> None:
    async with Engine.serving(settings(tiny_checkpoint, cache_bytes=10_000)) as engine:
        model = engine.model(None)
        [p] = (await engine.lane.run(model, FILES[:1], InferOptions())).predictions
        room = 10_000 // prediction_bytes(p)  # entries that fit
        files = [EncodedImage(f"{i}.png", encode(make_sample(50, i).image)) for i in range(room)]
        await engine.lane.run(model, files[:-1], InferOptions())  # full now; FILES[0] the least recently used
        assert engine.cache is not None and len(engine.cache.entries) == room
        before = computed(engine)
        await engine.lane.run(model, files[:1], InferOptions())  # a hit: files[0] becomes the most recent
        await engine.lane.run(model, files[-1:], InferOptions())  # evicts the least recently used: FILES[0]
        assert computed(engine) == before + 1
        await engine.lane.run(model, files[:1], InferOptions())
        assert computed(engine) == before + 1  # still held
        await engine.lane.run(model, FILES[:1], InferOptions())
        assert computed(engine) == before + 2  # evicted, computed again
        assert engine.cache.size <= 10_000
        assert engine.metrics.cache_bytes._value.get() == engine.cache.size


async def test_identical_misses_under_way_are_computed_once(cached: Engine) -> None:
    model = cached.model(None)
    slow_forward(model, 0.3)
    answers = await asyncio.gather(*(cached.lane.run(model, FILES[:2], InferOptions()) for _ in range(5)))
    assert computed(cached) == 2
    assert counted(cached) == (8, 2)
    for a in answers[1:]:
        torch.testing.assert_close(a.predictions[0].probabilities, answers[0].predictions[0].probabilities)


async def test_a_failed_or_abandoned_computation_is_not_kept(cached: Engine) -> None:
    model = cached.model(None)
    bad = [EncodedImage("bad.png", b"not an image")]
    for _ in range(2):
        with pytest.raises(UnsupportedMediaType):
            await cached.lane.run(model, bad, InferOptions())
    assert cached.cache is not None and cached.cache.entries == {} and cached.cache.computing == {}
    under_way = slow_forward(model, 0.5)
    leaving = asyncio.create_task(cached.lane.run(model, FILES[:1], InferOptions()))
    await until(under_way.is_set)
    hits = cached.metrics.cache_hits.labels(model.name)._value.get()
    staying = asyncio.create_task(cached.lane.run(model, FILES[:1], InferOptions()))  # waits for the first
    await until(lambda: cached.metrics.cache_hits.labels(model.name)._value.get() == hits + 1)
    leaving.cancel()  # the client left: the one waiting computes the image itself
    [p] = (await staying).predictions
    assert p.filename == "0.png" and p.probabilities.shape == (len(model.classes),)


async def test_a_hit_is_never_another_models(tmp_path: Path) -> None:
    """The same bytes asked of two models: each model's own answer, the second a miss, never the first's."""
    a = write_tiny_checkpoint(tmp_path / "a.safetensors", seed=0)
    b = write_tiny_checkpoint(tmp_path / "b.safetensors", seed=5)
    async with Engine.serving(settings(a, models=f"a={a},b={b}")) as engine:
        from_a = await engine.lane.run(engine.model("a"), FILES[:1], InferOptions())
        from_b = await engine.lane.run(engine.model("b"), FILES[:1], InferOptions())
        assert (from_a.model.name, from_b.model.name) == ("a", "b")
        assert not torch.allclose(from_a.predictions[0].probabilities, from_b.predictions[0].probabilities)
        assert engine.metrics.cache_hits.labels("b")._value.get() == 0
        assert engine.metrics.cache_misses.labels("b")._value.get() == 1
        again = await engine.lane.run(engine.model("b"), FILES[:1], InferOptions())  # b's own entry, now a hit
        torch.testing.assert_close(again.predictions[0].probabilities, from_b.predictions[0].probabilities)
        assert engine.metrics.cache_hits.labels("b")._value.get() == 1
