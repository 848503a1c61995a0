"""Failing forward passes: a batch too large for memory, an image that always fails (the in-process app)."""

from __future__ import annotations

import asyncio

import torch

from harness.images import encode
from model.shapes import make_sample
from tests.support.clients import ClientFactory

PNG = encode(make_sample(8, 0).image)


async def test_out_of_memory_batches_are_retried_in_halves(make_client: ClientFactory) -> None:
    async with make_client(max_batch_size=8, max_wait_ms=100) as client:
        batcher = client.app.state.data_plane.default.batcher  # type: ignore[attr-defined]
        real = batcher.run_batch
        sizes: list[int] = []

        def small_memory(batch):  # type: ignore[no-untyped-def]
            sizes.append(len(batch))
            if len(batch) > 2:
                raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
            return real(batch)

        batcher.run_batch = small_memory
        files = [("files", (f"{i}.png", PNG, "image/png")) for i in range(8)]  # one request: one batch of 8
        r = await client.post("/predict", files=files)
        assert r.status_code == 200 and len(r.json()["results"]) == 8
        assert sizes[0] == 8 and max(s for s in sizes if s <= 2) == 2  # halved down to what fits
        assert (await client.get("/health/ready")).status_code == 200


async def test_an_image_that_always_fails_fails_only_its_request(make_client: ClientFactory) -> None:
    async with make_client(max_batch_size=8, max_wait_ms=100) as client:
        batcher = client.app.state.data_plane.default.batcher  # type: ignore[attr-defined]
        real = batcher.run_batch

        def one_poisoned(batch):  # type: ignore[no-untyped-def]
            if any(float(item.pixels.std()) == 0 for item in batch):  # the flat grey image
                raise RuntimeError("kernel failure on this input (simulated)")
            return real(batch)

        batcher.run_batch = one_poisoned
        grey = encode(make_sample(0, 0).image.point(lambda _: 128))
        files = [("a.png", PNG), ("grey.png", grey), ("b.png", PNG)]
        rs = await asyncio.gather(*(client.post("/predict", files={"file": (n, d, "image/png")}) for n, d in files))
        assert [r.status_code for r in rs] == [200, 500, 200]
        assert "inference failed" in rs[1].json()["detail"]
        assert "Traceback" not in rs[1].text
        assert (await client.get("/health/ready")).status_code == 200
