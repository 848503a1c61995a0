"""The engine's one lane (`Lane.submit`), reached with calls as every edge builds them."""

from __future__ import annotations

import asyncio
import functools
import gc
import weakref
from collections.abc import Iterator
from typing import Any

import pytest

from app.core.contract.inference import Inference
from app.core.contract.request import DecodedImage, EncodedImage, InferOptions
from app.core.engine.call import Call, settle_future
from app.core.engine.engine import Engine
from harness.images import encode
from model.shapes import make_sample


@pytest.fixture
def no_collector() -> Iterator[None]:
    """The cyclic collector off: what is freed is freed by reference counting alone."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


async def test_answered_calls_are_freed_without_the_collector(
    service: Engine, no_collector: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A call answered, alone or as part of a group, holds nothing that holds it: under load every call left in
    a cycle waited for the collector, whose passes then ran eight times as often."""
    model = service.model(None)
    files = [EncodedImage(f"{i}.png", encode(make_sample(7, i).image)) for i in range(3)]
    prepared = [
        DecodedImage(f.filename, f.data, model.version, model.preparer.prepare(f, keep_image=False).pixels, 0.0)
        for f in files
    ]
    groups: list[int] = []
    submit_group = model.batcher.submit_group

    def spying(*args: Any) -> Any:
        groups.append(len(args[1]))
        return submit_group(*args)

    monkeypatch.setattr(model.batcher, "submit_group", spying)
    for together in ([[image] for image in prepared], [prepared]):  # three calls as one group; one call alone
        futures: list[asyncio.Future[Inference]] = []
        calls = []
        for inputs in together:
            futures.append(asyncio.get_running_loop().create_future())
            calls.append(Call(inputs, InferOptions(), None, functools.partial(settle_future, futures[-1])))
        service.lane.submit(model, calls)
        for done in await asyncio.gather(*futures):
            assert [p.filename for p in done.predictions] != []
        freed = [weakref.ref(c) for c in calls]
        del calls
        await service.lane.run(model, prepared[0].pixels[None], InferOptions())  # the batcher's last batch, replaced
        assert [ref() for ref in freed] == [None] * len(freed)
    assert groups == [3]
