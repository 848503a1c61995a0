"""The batched JPEG path: which files take it, and that it makes the CPU path's pixels.

`GpuJpegDecoder` runs on any torch device; here it runs on the CPU (torchvision's batched decoder
there, and DALI's CPU decoder, the `dali` choice without a GPU), so its batching, grouping by size and
fallback are proven without a GPU. tests/app/test_cuda.py
runs the same checks through the service on a real GPU, with nvImageCodec (the JPEG engines and the CUDA
decoder) and with torchvision's nvJPEG.
"""

from __future__ import annotations

import io
import sys
from collections.abc import Callable

import numpy as np
import pytest
import torch
from PIL import Image

from app.core.contract.errors import InvalidInput, ServiceError
from app.core.images.decode import decode_image, open_image
from app.core.images.gpu_decode import (
    DaliJpeg,
    GpuJpegDecoder,
    Jpeg,
    JpegDecode,
    TorchvisionJpeg,
    blank_jpeg,
    decoder_backends,
    gpu_decodable,
    jpeg_decoder_for,
)
from app.core.images.prepare import Preprocessor
from harness.images import encode
from model.preprocessing import Preprocessing

CROP = Preprocessing(48, 3, (0.485, 0.456, 0.406), (0.229, 0.224, 0.225), "center_crop", 0.875, "bicubic")
SQUASH_GRAY = Preprocessing(32, 1, (0.5,), (0.25,))
ON_CPU = torch.device("cpu")


def photo(seed: int, size: tuple[int, int] = (120, 90), mode: str = "RGB") -> Image.Image:
    rng = np.random.default_rng(seed)
    ys, xs = np.mgrid[0 : size[1], 0 : size[0]]
    pixels = np.stack([(xs * 2 + seed) % 256, (ys * 3) % 256, (xs + ys) % 256], -1) + rng.normal(0, 8, (*size[::-1], 3))
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).convert(mode)


def jpeg(image: Image.Image, **kw: object) -> bytes:
    return encode(image, "JPEG", quality=92, **kw)


def decodable(data: bytes) -> bool:
    return gpu_decodable(open_image(data, "x.jpg", 10**8), data)


# The batch decoders that run without a GPU: torchvision's (libjpeg-turbo) and DALI's CPU decoder.
BATCH_DECODERS: dict[str, Callable[[], JpegDecode]] = {
    "torchvision": lambda: TorchvisionJpeg(ON_CPU),
    "dali": lambda: DaliJpeg(ON_CPU, threads=2),
}


@pytest.fixture(params=sorted(BATCH_DECODERS))
def batch_decoder(request: pytest.FixtureRequest) -> JpegDecode:
    return BATCH_DECODERS[request.param]()


def on_cpu(p: Preprocessing):  # type: ignore[no-untyped-def]
    pre = Preprocessor(p)
    return lambda j: pre(decode_image(j.data, j.filename, p.channels, 10**8))


def test_plain_jpegs_take_the_batched_path_and_others_do_not() -> None:
    assert decodable(jpeg(photo(0)))
    assert decodable(jpeg(photo(0, mode="L")))
    assert not decodable(jpeg(photo(0), progressive=True))
    assert not decodable(jpeg(photo(0, mode="CMYK")))
    assert not decodable(encode(photo(0)))  # PNG
    whole = jpeg(photo(0))
    assert not decodable(whole[: len(whole) // 2])  # cut short: PIL reports it
    exif = Image.Exif()
    exif[0x0112] = 6  # rotated 90 degrees: PIL turns it upright
    assert not decodable(jpeg(photo(0), exif=exif.tobytes()))
    exif[0x0112] = 1
    assert decodable(jpeg(photo(0), exif=exif.tobytes()))


@pytest.mark.parametrize("p", [CROP, SQUASH_GRAY], ids=["rgb-center-crop-bicubic", "gray-squash-bilinear"])
def test_a_batch_of_mixed_sizes_gives_the_cpu_paths_pixels(p: Preprocessing, batch_decoder: JpegDecode) -> None:
    sizes = [(120, 90), (90, 120), (120, 90), (64, 64), (300, 200)]
    files = [jpeg(photo(i, size)) for i, size in enumerate(sizes)]
    decoder = GpuJpegDecoder(p, ON_CPU, on_cpu(p), batch_decoder)
    got = decoder([Jpeg(f, f"{i}.jpg") for i, f in enumerate(files)])
    want = torch.stack([on_cpu(p)(Jpeg(f, "x")) for f in files])
    assert got.shape == want.shape == (len(files), p.channels, p.image_size, p.image_size)
    # The same decoder (libjpeg-turbo) and the same tensor resize: equal up to rounding, which is largest for
    # grayscale (the decoder's own luma against PIL's RGB -> L), a few levels of 255 at most.
    diff = (got - want).abs() * torch.tensor(p.std).view(1, -1, 1, 1) * 255  # in levels of 255
    assert diff.max() <= 3.01 and diff.mean() <= 0.5


def test_a_file_the_batched_decoder_rejects_is_decoded_by_the_fallback(batch_decoder: JpegDecode) -> None:
    good = jpeg(photo(1))
    # A valid header over data the batched decoder cannot use; PIL's fallback decides.
    broken = good[:400] + bytes(200) + good[600:]
    calls: list[str] = []
    fallback = on_cpu(CROP)

    def counting(j: Jpeg) -> torch.Tensor:
        calls.append(j.filename)
        return fallback(j)  # type: ignore[no-any-return]

    decoder = GpuJpegDecoder(CROP, ON_CPU, counting, batch_decoder)
    try:
        out = decoder([Jpeg(good, "good.jpg"), Jpeg(broken, "broken.jpg")])
    except InvalidInput as e:  # PIL refuses it too: the client's error, naming the file
        assert "broken.jpg" in e.detail
    else:
        assert out.shape == (2, 3, 48, 48)
        assert torch.isfinite(out).all()
    assert calls in ([], ["broken.jpg"])  # only the broken file ever reaches the fallback


def test_a_file_no_decoder_reads_raises_the_clients_error(batch_decoder: JpegDecode) -> None:
    not_jpeg = b"\xff\xd8" + bytes(64) + b"\xff\xd9"
    decoder = GpuJpegDecoder(CROP, ON_CPU, on_cpu(CROP), batch_decoder)
    with pytest.raises(ServiceError, match="bad.jpg"):
        decoder([Jpeg(jpeg(photo(2)), "good.jpg"), Jpeg(not_jpeg, "bad.jpg")])


def test_the_warm_up_image_is_a_plain_jpeg_of_the_input_shape() -> None:
    for shape in [(3, 224, 224), (1, 64, 64)]:
        data = blank_jpeg(shape)
        image = Image.open(io.BytesIO(data))
        assert image.size == shape[:0:-1] and decodable(data)


def test_nvimagecodec_tries_the_jpeg_engines_with_their_share_then_the_cuda_decoder() -> None:
    """VIT_HW_DECODER_LOAD as nvImageCodec takes it (its own `Backend` objects, built here without a GPU): the
    engines first with that share of a batch, then the CUDA decoder for the rest; without the engines, that
    decoder alone."""
    from nvidia import nvimgcodec

    engines, cuda = decoder_backends(True, 0.6)
    assert engines.backend_kind == nvimgcodec.BackendKind.HW_GPU_ONLY and engines.load_hint == pytest.approx(0.6)
    assert cuda.backend_kind == nvimgcodec.BackendKind.HYBRID_CPU_GPU and cuda.load_hint == 1.0
    [alone] = decoder_backends(False, 0.6)
    assert alone.backend_kind == nvimgcodec.BackendKind.HYBRID_CPU_GPU
    with pytest.raises(ValueError, match="share of a batch"):
        decoder_backends(True, 0)


def test_dalis_cpu_decoder_gives_pils_pixels_and_leaves_what_it_cannot_read() -> None:
    """A batch with a file DALI refuses: the batch is decoded file by file, the good ones exactly as PIL
    decodes them (both are libjpeg-turbo), RGB and grayscale alike, the refused one None for the fallback."""
    rgb, gray = jpeg(photo(3, (75, 40))), jpeg(photo(4, (33, 90), mode="L"))
    shared = memoryview(bytearray(rgb))  # a front-end's shared memory reaches the engine as a writable view
    got = DaliJpeg(ON_CPU, threads=2)([rgb, b"\xff\xd8" + bytes(64) + b"\xff\xd9", gray, shared])
    assert got[1] is None
    for data, image in [(rgb, got[0]), (gray, got[2]), (rgb, got[3])]:
        want = np.asarray(Image.open(io.BytesIO(data)).convert("RGB")).transpose(2, 0, 1)
        assert image is not None and image.dtype == torch.uint8
        assert torch.equal(image, torch.from_numpy(want.copy()))


def test_vit_decode_names_the_batch_decoder() -> None:
    assert isinstance(jpeg_decoder_for("auto", ON_CPU), TorchvisionJpeg)
    dali = jpeg_decoder_for("dali", ON_CPU, 0.5)
    assert isinstance(dali, DaliJpeg) and dali.name == "DALI's CPU decoder"
    with pytest.raises(ValueError, match="share of a batch"):
        DaliJpeg(ON_CPU, load=1.5)


def test_vit_decode_dali_without_dali_installed_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "nvidia.dali.experimental.dynamic", None)  # as if the extra were absent
    with pytest.raises(ValueError, match=r"VIT_DECODE=dali needs DALI: pip install 'vit-serve\[dali\]'"):
        jpeg_decoder_for("dali", ON_CPU)
