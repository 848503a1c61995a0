"""What the benchmarks share: where results go (each written with the record of its run, `harness.records`), the
sample images, a multipart body."""

from __future__ import annotations

import io
import uuid
from pathlib import Path
from typing import Any

from PIL import Image

from harness import records
from model.shapes import make_sample

RESULTS = Path(__file__).resolve().parent / "results"


def write_results(name: str, report: dict[str, Any], text: str) -> None:
    """bench/results/<name>.json and .md: the run's record, then the figures (`harness.records`)."""
    records.write_results(RESULTS, name, report, text)


def multipart(data: bytes, filename: str, content_type: str) -> tuple[bytes, str]:
    boundary = uuid.uuid4().hex
    body = (
        (
            f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="{filename}"\r\n'
            f"Content-Type: {content_type}\r\n\r\n"
        ).encode()
        + data
        + f"\r\n--{boundary}--\r\n".encode()
    )
    return body, f"multipart/form-data; boundary={boundary}"


# small: the bundled model's own 64 px image; medium: an ImageNet-sized photo
SAMPLE_SIZES: dict[str, tuple[int, int] | None] = {"small": None, "medium": (500, 375), "large": (1024, 768)}


def sample_images() -> dict[str, bytes]:
    """PNG and JPEG at each of SAMPLE_SIZES, named `png-small` to `jpeg-large`."""
    small = make_sample(4242, 0).image
    out = {}
    for name, size in SAMPLE_SIZES.items():
        image = small if size is None else small.resize(size, Image.Resampling.BICUBIC)
        for fmt in ("PNG", "JPEG"):
            buf = io.BytesIO()
            image.save(buf, format=fmt, **({"quality": 90} if fmt == "JPEG" else {}))
            out[f"{fmt.lower()}-{name}"] = buf.getvalue()
    return out


def sample_label(name: str) -> str:
    """A sample image's name in prose: `jpeg-medium` -> `500x375 JPEG`."""
    kind, size = name.split("-")
    dims = SAMPLE_SIZES[size]
    return f"{'64 px' if dims is None else f'{dims[0]}x{dims[1]}'} {kind.upper()}"
