"""One model version's way from an uploaded file to its batch input, the same in the engine and in a front-end:
plain JPEGs left encoded for the GPU, everything else decoded and preprocessed as the CPU path does it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from app.core.contract.errors import PayloadTooLarge
from app.core.contract.request import DecodedImage, EncodedImage
from app.core.images.decode import decode_image
from app.core.images.gpu_decode import Jpeg
from app.core.images.prepare import ImagePreparer, Preprocessor
from harness.images import encode
from model.preprocessing import Preprocessing

P = Preprocessing(32, 3, (0.5, 0.5, 0.5), (0.25, 0.25, 0.25), "center_crop", 0.875)
LIMIT = 10**8


def photo(width: int = 120, height: int = 90) -> Image.Image:
    rng = np.random.default_rng(0)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def cpu_pixels(data: bytes, draft_to: int | None = None) -> torch.Tensor:
    return Preprocessor(P)(decode_image(data, "x", 3, LIMIT, draft_to))


@pytest.mark.parametrize("gpu_jpegs", [False, True])
def test_a_plain_jpeg_is_left_encoded_only_for_a_gpu_decoding_model(gpu_jpegs: bool) -> None:
    data = encode(photo(), "JPEG", quality=90)
    prepared = ImagePreparer(P, LIMIT, jpeg_draft=False, gpu_jpegs=gpu_jpegs).prepare(
        EncodedImage("a.jpg", data), False
    )
    if gpu_jpegs:
        assert prepared.pixels == Jpeg(data, "a.jpg")
    else:
        assert isinstance(prepared.pixels, torch.Tensor)
        torch.testing.assert_close(prepared.pixels, cpu_pixels(data), atol=0, rtol=0)


@pytest.mark.parametrize(
    "data",
    [
        encode(photo(), "JPEG", quality=90, progressive=True),
        encode(photo(), "PNG"),
        encode(photo().convert("CMYK"), "JPEG"),
    ],
    ids=["progressive", "png", "cmyk"],
)
def test_what_the_gpu_cannot_decode_is_decoded_here(data: bytes) -> None:
    prepared = ImagePreparer(P, LIMIT, jpeg_draft=False, gpu_jpegs=True).prepare(EncodedImage("a", data), False)
    assert isinstance(prepared.pixels, torch.Tensor)
    torch.testing.assert_close(prepared.pixels, cpu_pixels(data), atol=0, rtol=0)


def test_an_overlay_keeps_the_whole_image_and_large_jpegs_are_scaled_otherwise() -> None:
    data = encode(photo(640, 480), "JPEG", quality=90)  # at least twice the resize side (36): drafted
    preparer = ImagePreparer(P, LIMIT, jpeg_draft=True, gpu_jpegs=True)
    kept = preparer.prepare(EncodedImage("a.jpg", data), keep_image=True)
    assert kept.image is not None and kept.image.size == (640, 480)  # decoded in full, not left to the GPU
    torch.testing.assert_close(kept.pixels, cpu_pixels(data), atol=0, rtol=0)
    drafted = ImagePreparer(P, LIMIT, jpeg_draft=True, gpu_jpegs=False).prepare(EncodedImage("a.jpg", data), False)
    assert drafted.image is None
    torch.testing.assert_close(drafted.pixels, cpu_pixels(data, P.resize_size), atol=0, rtol=0)
    assert not torch.equal(drafted.pixels, cpu_pixels(data))  # decoded at a smaller scale inside libjpeg


def test_a_decoded_image_is_prepared_again_from_its_file() -> None:
    data = encode(photo(), "PNG")
    again = DecodedImage("a.png", data, "another-version", torch.zeros(3, 32, 32), 0.0)
    prepared = ImagePreparer(P, LIMIT, jpeg_draft=False, gpu_jpegs=False).prepare(again, False)
    torch.testing.assert_close(prepared.pixels, cpu_pixels(data), atol=0, rtol=0)


def test_the_pixel_limit_is_the_preparers() -> None:
    with pytest.raises(PayloadTooLarge, match=r"big\.png: 120x90 = 10800 pixels is over the limit of 100"):
        ImagePreparer(P, 100, jpeg_draft=False, gpu_jpegs=False).prepare(
            EncodedImage("big.png", encode(photo())), False
        )


async def test_plain_jpegs_for_the_gpu_are_told_without_the_pool_and_the_rest_go_to_it() -> None:
    """A serving process's event loop reads a plain JPEG's markers itself (`plain_jpeg`); only the other files
    cost a hand-off to the pool. The files come back in their order, each as `prepare` makes it."""
    from concurrent.futures import ThreadPoolExecutor

    class CountingPool(ThreadPoolExecutor):
        handed = 0

        def submit(self, *args, **kwargs):  # type: ignore[no-untyped-def,override]
            CountingPool.handed += 1
            return super().submit(*args, **kwargs)

    plain, progressive, png = (
        encode(photo(), "JPEG", quality=90),
        encode(photo(), "JPEG", progressive=True),
        encode(photo()),
    )
    files = [EncodedImage("a.jpg", plain), EncodedImage("b.jpg", progressive), EncodedImage("c.png", png)]
    with CountingPool(2) as pool:
        on_gpu = await ImagePreparer(P, LIMIT, jpeg_draft=False, gpu_jpegs=True).prepare_all(files, False, pool)
        assert CountingPool.handed == 2  # the progressive JPEG and the PNG
        assert on_gpu[0].pixels == Jpeg(plain, "a.jpg")
        for prepared, data in zip(on_gpu[1:], (progressive, png), strict=True):
            assert isinstance(prepared.pixels, torch.Tensor)
            torch.testing.assert_close(prepared.pixels, cpu_pixels(data), atol=0, rtol=0)
        CountingPool.handed = 0
        everything = await ImagePreparer(P, LIMIT, jpeg_draft=False, gpu_jpegs=True).prepare_all(files, True, pool)
        assert CountingPool.handed == 3 and all(p.image is not None for p in everything)  # overlays: decoded here


@pytest.mark.parametrize(("share", "on_cpu"), [(0.0, []), (0.25, [3, 7]), (0.5, [1, 3, 5, 7]), (1.0, list(range(8)))])
async def test_the_cpu_decodes_its_share_of_plain_jpegs_in_turn(share: float, on_cpu: list[int]) -> None:
    """VIT_CPU_DECODE_SHARE: of the plain JPEGs the GPU would decode, that share is decoded on the pool instead,
    every file in turn, to the CPU path's pixels; files the GPU cannot take do not count toward it."""
    from concurrent.futures import ThreadPoolExecutor

    jpegs = [encode(photo(40 + i, 30), "JPEG", quality=90) for i in range(8)]
    png = encode(photo(), "PNG")
    files = [EncodedImage(f"{i}.jpg", data) for i, data in enumerate(jpegs)]
    files.insert(2, EncodedImage("x.png", png))  # decoded on the pool whatever the share
    preparer = ImagePreparer(P, LIMIT, jpeg_draft=False, gpu_jpegs=True, cpu_share=share)
    with ThreadPoolExecutor(2) as pool:
        prepared = await preparer.prepare_all(files, False, pool)
    assert isinstance(prepared.pop(2).pixels, torch.Tensor)
    for i, (p, data) in enumerate(zip(prepared, jpegs, strict=True)):
        if i in on_cpu:
            assert isinstance(p.pixels, torch.Tensor), i
            torch.testing.assert_close(p.pixels, cpu_pixels(data), atol=0, rtol=0)
        else:
            assert p.pixels == Jpeg(data, f"{i}.jpg"), i


async def test_the_cpu_share_carries_over_from_one_request_to_the_next() -> None:
    """A share below one file a request still reaches the CPU: the turn is counted over the preparer's files."""
    from concurrent.futures import ThreadPoolExecutor

    data = encode(photo(), "JPEG", quality=90)
    preparer = ImagePreparer(P, LIMIT, jpeg_draft=False, gpu_jpegs=True, cpu_share=0.25)
    with ThreadPoolExecutor(1) as pool:
        answers = [(await preparer.prepare_all([EncodedImage("a.jpg", data)], False, pool))[0] for _ in range(8)]
    assert [isinstance(a.pixels, torch.Tensor) for a in answers] == [False, False, False, True] * 2


@pytest.mark.parametrize("resize_backend", ["tensor", "pil"])
def test_pixels_for_a_gpu_stop_at_uint8_and_scale_to_the_cpu_paths(resize_backend: str) -> None:
    """With `uint8` (a model on a GPU) the host resizes and crops, and leaves scaling and normalising to the device:
    those pixels, scaled as the predictor scales them, are the CPU path's exactly."""
    from model.preprocessing import EvalTransform

    p = Preprocessing(32, 3, (0.5, 0.5, 0.5), (0.25, 0.25, 0.25), "center_crop", 0.875, resize_backend=resize_backend)  # type: ignore[arg-type]
    data = encode(photo(), "PNG")
    prepared = ImagePreparer(p, LIMIT, jpeg_draft=True, gpu_jpegs=True, uint8=True).prepare(
        EncodedImage("a.png", data), False
    )
    assert isinstance(prepared.pixels, torch.Tensor) and prepared.pixels.dtype == torch.uint8
    assert tuple(prepared.pixels.shape) == (3, 32, 32)
    full = ImagePreparer(p, LIMIT, jpeg_draft=True, gpu_jpegs=True).prepare(EncodedImage("a.png", data), False)
    torch.testing.assert_close(EvalTransform(p).scaled(prepared.pixels), full.pixels, atol=0, rtol=0)


async def test_a_large_jpeg_of_the_cpus_share_is_drafted_before_it_is_decoded() -> None:
    """A plain JPEG the host decodes in the GPU's place is decoded as the CPU path decodes it: a phone-sized one
    scaled inside libjpeg first (VIT_JPEG_DRAFT), then resized; uint8 for the GPU to normalise."""
    from concurrent.futures import ThreadPoolExecutor

    from model.preprocessing import EvalTransform

    data = encode(photo(1600, 1200), "JPEG", quality=90)
    preparer = ImagePreparer(P, LIMIT, jpeg_draft=True, gpu_jpegs=True, cpu_share=1.0, uint8=True)
    with ThreadPoolExecutor(1) as pool:
        [prepared] = await preparer.prepare_all([EncodedImage("big.jpg", data)], False, pool)
    assert isinstance(prepared.pixels, torch.Tensor) and prepared.pixels.dtype == torch.uint8
    drafted, full = cpu_pixels(data, draft_to=P.resize_size), cpu_pixels(data)
    torch.testing.assert_close(EvalTransform(P).scaled(prepared.pixels), drafted, atol=0, rtol=0)
    assert not torch.equal(drafted, full)  # the draft is what made them so, not the full decode
