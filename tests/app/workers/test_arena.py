"""The shared-memory arena: first-fit regions, bytes and tensors seen alike through a second mapping, and a
call's inputs and outputs through a region (or inline) as the front-end and the engine read them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from app.core.contract.description import ModelDescription
from app.core.contract.request import DecodedImage, EncodedImage, InferOptions, Prediction
from app.workers.arena import ALIGN, Arena, read_inputs, read_outputs, viewed, write_inputs, write_outputs

MODEL = ModelDescription(
    "m", "1", "0" * 64, [f"c{i}" for i in range(10)], (3, 8, 8), 3, 4, "torch", "float32", None, "cpu",
    "torch.float32", "cpu", {}, {}, {},
)  # fmt: skip


def test_regions_are_aligned_first_fit_and_reused(tmp_path: Path) -> None:
    arena = Arena.create(tmp_path / "a.shm", 1024)
    a, b, c = arena.allocate(100), arena.allocate(1), arena.allocate(200)
    assert (a, b, c) == (0, 128, 192)
    assert all(offset % ALIGN == 0 for offset in (a, b, c))
    assert arena.allocate(1024) is None  # no gap that large
    arena.free(b)
    assert arena.allocate(64) == 128  # the first gap that fits
    arena.free(a)
    assert arena.allocate(129) == 448  # the gap at 0 is too small: after the last region
    assert arena.in_use == 64 + 256 + 192
    arena.unlink()
    assert not (tmp_path / "a.shm").exists()


def test_what_one_mapping_writes_the_other_reads(tmp_path: Path) -> None:
    owner = Arena.create(tmp_path / "a.shm", 1 << 16)
    engine = Arena.attach(tmp_path / "a.shm")
    assert engine.size == owner.size
    offset = owner.allocate(4096)
    assert offset is not None
    after = owner.write(offset, b"jpeg bytes")
    assert engine.read(offset, 10) == b"jpeg bytes"
    probabilities = torch.softmax(torch.randn(3, 10), dim=1)
    engine.write_tensor(after, probabilities)
    read = owner.read_tensor(after, (3, 10), "float32")
    torch.testing.assert_close(read, probabilities)
    owner.write(after, b"\0" * 120)  # a copy: later writes do not change it
    torch.testing.assert_close(read, probabilities)
    engine.close()
    owner.unlink()


def test_a_file_system_too_small_is_an_error_at_creation(tmp_path: Path) -> None:
    with pytest.raises(OSError, match="cannot reserve"):
        Arena.create(tmp_path / "a.shm", 1 << 62)
    assert not (tmp_path / "a.shm").exists()


@pytest.mark.parametrize("size", [1 << 16, 256], ids=["in the arena", "inline: no region that large is free"])
def test_inputs_reach_the_engine_as_written_and_the_region_holds_the_outputs(tmp_path: Path, size: int) -> None:
    owner = Arena.create(tmp_path / "a.shm", size)
    engine = Arena.attach(tmp_path / "a.shm")
    try:
        files: list[EncodedImage | DecodedImage] = [
            EncodedImage("a.png", b"png bytes"),
            DecodedImage("b.jpg", b"jpeg bytes" * 20, "1", torch.rand(3, 8, 8), 0.25),
            DecodedImage("c.jpg", b"plain jpeg", "1", None, 0.5),  # a checked JPEG the GPU decodes
            # pixels for a model on a GPU: uint8, normalised there
            DecodedImage("d.jpg", b"jpeg", "1", torch.randint(0, 256, (3, 8, 8), dtype=torch.uint8), 0.5),
        ]
        options = InferOptions("rollout", embedding=True)
        stored = write_inputs(owner, files, MODEL, options)
        assert (stored.region is not None) == (size > 256)
        if stored.region is not None:  # room for the outputs too: probabilities, maps and embeddings of three
            assert stored.region[1] >= ALIGN * 3 and owner.in_use == stored.region[1]
        got = read_inputs(engine, stored.images, stored.pixels)
        assert isinstance(got, list) and [type(g) for g in got] == [type(f) for f in files]
        for g, f in zip(got, files, strict=True):
            assert (g.filename, bytes(g.data)) == (f.filename, bytes(f.data))
            if isinstance(f, DecodedImage):
                assert isinstance(g, DecodedImage) and (g.version, g.decode_s) == (f.version, f.decode_s)
                assert (g.pixels is None) == (f.pixels is None)
                if f.pixels is not None:
                    torch.testing.assert_close(g.pixels, f.pixels, atol=0, rtol=0)  # the dtype too
        assert viewed(stored.images) == (stored.region is not None)  # prepared files stay in the arena
        del got
        pixels = torch.rand(2, 3, 8, 8)
        stored = write_inputs(owner, pixels, MODEL, InferOptions())
        torch.testing.assert_close(read_inputs(engine, stored.images, stored.pixels), pixels)
    finally:
        engine.close()
        owner.unlink()


def predictions(n: int, maps: bool) -> list[Prediction]:
    return [
        Prediction(
            f"{i}.jpg",
            torch.rand(10),
            torch.rand(3, 3) if maps else None,
            b"png" if maps else None,
            torch.rand(4) if maps else None,
        )
        for i in range(n)
    ]


@pytest.mark.parametrize("room", [1 << 16, 64], ids=["in the arena", "inline: the region is too small"])
def test_outputs_travel_as_blocks_and_come_back_per_image(tmp_path: Path, room: int) -> None:
    arena = Arena.create(tmp_path / "a.shm", 1 << 16)
    try:
        for sent in (predictions(3, maps=True), predictions(2, maps=False), []):
            texts = torch.rand(2, 4) if not sent else None
            got, embedded = read_outputs(arena, write_outputs(arena, (0, room), sent, texts))
            assert [p.filename for p in got] == [p.filename for p in sent]
            for g, s in zip(got, sent, strict=True):
                torch.testing.assert_close(g.probabilities, s.probabilities)
                for a, b in ((g.attention_map, s.attention_map), (g.embedding, s.embedding)):
                    assert (a is None) == (b is None)
                    if a is not None:
                        torch.testing.assert_close(a, b)
                assert g.overlay_png == s.overlay_png
            assert (embedded is None) == (texts is None)
            if texts is not None:
                torch.testing.assert_close(embedded, texts)
    finally:
        arena.close()


def test_images_of_one_request_have_the_same_outputs() -> None:
    mixed = predictions(1, maps=True) + predictions(1, maps=False)
    with pytest.raises(ValueError, match="some images"):
        write_outputs(None, None, mixed)
