"""`plain_jpeg` against PIL's check (`open_image`, then `gpu_decodable`), run on the same files: it never sends
to the GPU a file that PIL's check would not, and it takes the common plain JPEGs itself."""

from __future__ import annotations

import io
import random
import struct
import warnings

import numpy as np
import pytest
from PIL import Image

from app.core.contract.errors import ServiceError
from app.core.images.decode import open_image
from app.core.images.gpu_decode import gpu_decodable
from app.core.images.jpeg_markers import plain_jpeg

LIMIT = 10**8


def photo(size: tuple[int, int] = (120, 90), mode: str = "RGB", seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)).convert(mode)


def jpeg(image: Image.Image | None = None, **kw: object) -> bytes:
    buf = io.BytesIO()
    (image or photo()).save(buf, format="JPEG", quality=90, **kw)
    return buf.getvalue()


def exif(orientation: int | None, order: str = "<", kind: int = 3, extra_tags: int = 1) -> bytes:
    """An EXIF block (APP1's payload): a first directory with private ASCII tags, and an orientation."""
    head = (b"II*\x00" if order == "<" else b"MM\x00*") + struct.pack(order + "I", 8)
    entries = [struct.pack(order + "HHI4s", 0xC000 + i, 2, 4, b"abc\x00") for i in range(extra_tags)]
    if orientation is not None:
        value = (
            struct.pack(order + "H", orientation) + b"\x00\x00" if kind == 3 else struct.pack(order + "I", orientation)
        )
        entries.append(struct.pack(order + "HHI", 0x0112, kind, 1) + value)
    return b"Exif\x00\x00" + head + struct.pack(order + "H", len(entries)) + b"".join(entries) + b"\x00" * 4


def with_segment(data: bytes, marker: int, payload: bytes) -> bytes:
    """`data` with one more segment right after its start-of-image marker."""
    return data[:2] + struct.pack(">BBH", 0xFF, marker, len(payload) + 2) + payload + data[2:]


def pils(data: bytes, limit: int = LIMIT) -> bool:
    """PIL's check, the reference: the file opens within the limit and `gpu_decodable` takes it. PIL's warnings
    about damaged EXIF stay warnings, as in the service (the suite raises them)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        try:
            return gpu_decodable(open_image(data, "x.jpg", limit), data)
        except ServiceError:
            return False


def mpo() -> bytes:
    buf = io.BytesIO()
    photo().save(buf, format="MPO", save_all=True, append_images=[photo(seed=1)])
    return buf.getvalue()


def png() -> bytes:
    buf = io.BytesIO()
    photo().save(buf, format="PNG")
    return buf.getvalue()


PLAIN = {
    "baseline": jpeg(),
    "grayscale": jpeg(photo(mode="L")),
    "4:4:4": jpeg(subsampling=0),
    "optimized Huffman tables": jpeg(optimize=True),
    "an ICC profile": jpeg(icc_profile=b"\x00" * 3000),
    "a comment": jpeg(comment=b"made here"),
    "odd sizes": jpeg(photo((333, 17))),
    "EXIF without an orientation": jpeg(exif=exif(None)),
    "EXIF upright": jpeg(exif=exif(1)),
    "EXIF upright, big-endian": jpeg(exif=exif(1, ">")),
    "zero bytes after the end": jpeg() + b"\x00" * 100,
    "restart markers": jpeg(restart_marker_blocks=4),
}


@pytest.mark.parametrize("data", PLAIN.values(), ids=PLAIN.keys())
def test_a_plain_jpeg_is_told_from_its_markers_as_pil_tells_it(data: bytes) -> None:
    assert pils(data)
    assert plain_jpeg(data, LIMIT)
    assert plain_jpeg(memoryview(data), LIMIT)  # in the engine process: a view of a front-end's memory


OTHERS = {
    "progressive": jpeg(progressive=True),
    "CMYK": jpeg(photo().convert("CMYK")),
    "EXIF rotated": jpeg(exif=exif(6)),
    "EXIF rotated, big-endian": jpeg(exif=exif(3, ">")),
    "cut short": jpeg()[:-300],
    "without its end marker": jpeg()[:-2],
    "MPO": mpo(),
    "PNG": png(),
    "empty": b"",
    "the start marker alone": b"\xff\xd8\xff",
    "XMP rotated": with_segment(jpeg(), 0xE1, b'http://ns.adobe.com/xap/1.0/\x00<x tiff:Orientation="6"/>'),
    "12-bit": (lambda d: d.replace(b"\xff\xc0\x00\x11\x08", b"\xff\xc0\x00\x11\x0c", 1))(jpeg()),
    "a quantization table cut": (lambda d: d.replace(b"\xff\xdb\x00\x43", b"\xff\xdb\x00\x42", 1))(jpeg()),
}


@pytest.mark.parametrize("data", OTHERS.values(), ids=OTHERS.keys())
def test_what_pil_would_not_send_to_the_gpu_is_not_taken(data: bytes) -> None:
    assert not pils(data)
    assert not plain_jpeg(data, LIMIT)


def test_the_pixel_limit_is_pils() -> None:
    data = jpeg(photo((120, 90)))
    assert plain_jpeg(data, 120 * 90) and pils(data, 120 * 90)
    assert not plain_jpeg(data, 120 * 90 - 1) and not pils(data, 120 * 90 - 1)


@pytest.mark.parametrize(
    "data",
    [
        with_segment(jpeg(), 0xE1, b'http://ns.adobe.com/xap/1.0/\x00<x tiff:Orientation="1"/>'),
        jpeg(exif=exif(1, kind=4)),  # an orientation stored as a LONG
        (lambda d: d.replace(b"\xff\xc0", b"\xff\xc9", 1))(jpeg()),  # an arithmetic-coded frame marker
        with_segment(with_segment(jpeg(), 0xE1, exif(1)), 0xE1, exif(None)),  # two EXIF blocks, which PIL joins
    ],
    ids=["XMP upright", "orientation as a LONG", "SOF9", "two EXIF blocks"],
)
def test_what_it_cannot_tell_is_left_to_pil(data: bytes) -> None:
    """Unusual files are PIL's to judge, whatever its verdict."""
    assert not plain_jpeg(data, LIMIT)


def test_no_mutation_of_a_jpeg_is_taken_where_pil_would_not_take_it() -> None:
    """A seeded walk over damaged files: bytes of the header changed, segments cut, files cut short. Whatever
    the markers say, a file is taken only where PIL's check takes it too."""
    rng = random.Random(20261127)
    seeds = [jpeg(), jpeg(exif=exif(1)), jpeg(exif=exif(1, ">"), icc_profile=b"\x01" * 200), jpeg(photo(mode="L"))]
    taken = refused = 0
    for _ in range(3000):
        data = bytearray(rng.choice(seeds))
        header = data.index(b"\xff\xda")  # the bytes before the scan: the markers the check reads
        for _ in range(rng.randint(1, 3)):
            if not data:
                break
            at = rng.randrange(min(header + 8, len(data)))
            match rng.randrange(4):
                case 0:
                    data[at] = rng.randrange(256)
                case 1:
                    data[at] ^= 1 << rng.randrange(8)
                case 2:
                    del data[at : at + rng.randint(1, 8)]
                case 3:
                    data = data[: rng.randrange(len(data))]
        mutated = bytes(data)
        if plain_jpeg(mutated, LIMIT):
            taken += 1
            assert pils(mutated), mutated[:64]
        else:
            refused += 1
    assert taken > 300 and refused > 300  # the walk reaches both verdicts


def test_a_file_of_many_segments_is_left_to_pil() -> None:
    """The markers are read on a serving process's event loop: past what an encoder writes (64 segments, 256
    EXIF entries), the file goes to PIL on the pool, which takes it all the same."""
    many = jpeg()
    for _ in range(60):
        many = with_segment(many, 0xFE, b"a comment")
    assert pils(many) and not plain_jpeg(many, LIMIT)
    fewer = with_segment(jpeg(), 0xFE, b"a comment")
    assert plain_jpeg(fewer, LIMIT)
    crowded = jpeg(exif=exif(1, extra_tags=300))
    assert pils(crowded) and not plain_jpeg(crowded, LIMIT)
    assert plain_jpeg(jpeg(exif=exif(1, extra_tags=200)), LIMIT)
