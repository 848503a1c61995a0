"""What telling a plain JPEG for the GPU costs, per file: PIL's check against the markers' read.

    python -m bench.compare.header_cost

PIL's check is what `ImagePreparer` ran on the CPU pool for each file before `plain_jpeg`: `open_image` (the
header, the pixel limit), then `gpu_decodable` (mode, progressive, the end marker, the EXIF orientation).
`plain_jpeg` reads the same from the markers. Both are timed on the same files, one thread, CPU time per file,
the best of `--rounds` rounds: the benchmarks' 500x375 JPEG, and the same with an upright EXIF block.
"""

from __future__ import annotations

import argparse
import io
import time
from collections.abc import Callable

from app.core.images.decode import open_image
from app.core.images.gpu_decode import gpu_decodable
from app.core.images.jpeg_markers import plain_jpeg
from bench.common import write_results
from harness.images import photo_jpeg
from harness.records import cpu_model, table

LIMIT = 10**8


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.compare.header_cost", description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--calls", type=int, default=5000)
    p.add_argument("--name", default="header-cost-cpu")
    return p.parse_args()


def with_exif(data: bytes) -> bytes:
    from PIL import Image

    image = Image.open(io.BytesIO(data))
    exif = Image.Exif()
    exif[0x0112] = 1  # upright
    exif[0x010F] = "a camera"
    buf = io.BytesIO()
    image.save(buf, format="JPEG", quality=90, exif=exif.tobytes())
    return buf.getvalue()


def best_us(check: Callable[[bytes], bool], data: bytes, rounds: int, calls: int) -> float:
    assert check(data)
    times = []
    for _ in range(rounds):
        started = time.process_time()
        for _ in range(calls):
            check(data)
        times.append((time.process_time() - started) / calls * 1e6)
    return min(times)


def main() -> None:
    args = parse_args()
    checks: dict[str, Callable[[bytes], bool]] = {
        "PIL (open_image, gpu_decodable)": lambda d: gpu_decodable(open_image(d, "x.jpg", LIMIT), d),
        "plain_jpeg": lambda d: plain_jpeg(d, LIMIT),
    }
    plain = photo_jpeg(0)
    files = {"500x375 JPEG": plain, "the same with EXIF": with_exif(plain)}
    figures = {
        f: {c: best_us(check, data, args.rounds, args.calls) for c, check in checks.items()}
        for f, data in files.items()
    }
    rows = [[f, c, f"{us:.1f}"] for f, by_check in figures.items() for c, us in by_check.items()]
    text = "\n".join(
        [
            f"# Telling a plain JPEG for the GPU, per file ({cpu_model()})",
            "",
            f"`python -m bench.compare.header_cost`: one thread, CPU time per file, the best of {args.rounds} rounds "
            f"of {args.calls} calls.",
            "",
            *table(["file", "check", "µs per file"], rows),
            "",
        ]
    )
    write_results(args.name, {"rounds": args.rounds, "calls": args.calls, "us_per_file": figures}, text)


if __name__ == "__main__":
    main()
