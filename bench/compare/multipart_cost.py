"""What reading a /predict multipart body costs: this tree (Starlette's `MultiPartParser`) against an older
checkout (3b33d80 and before: a split at the delimiters, python-multipart for any other body), in process.

    git worktree add /tmp/before 3b33d80
    python -m bench.compare.multipart_cost --before /tmp/before --name multipart-cost-cpu

Each tree runs in a child interpreter of its own (its `app` first on the path), on the same bodies: one JPEG
as httpx sends it, at two sizes. The figure is the best of 5 rounds of 2,000 parses.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench.common import commit, cpu_model, table, write_results
from harness.server import ROOT

CHILD = """
import asyncio, io, json, timeit
import httpx, numpy as np
from PIL import Image
from starlette.datastructures import Headers
try:
    from app.web.uploads import read_form
    loop = asyncio.new_event_loop()
    def parser(body, content_type):
        headers = Headers({"content-type": content_type})
        return lambda: loop.run_until_complete(read_form(body, headers, 8))
    floor = min(timeit.repeat(lambda: loop.run_until_complete(asyncio.sleep(0)), number=2000, repeat=5)) / 2000
    kind = "Starlette's MultiPartParser"
except ImportError:
    from app.web.multipart import parse_multipart
    def parser(body, content_type):
        return lambda: parse_multipart(body, content_type, max_files=8, max_fields=24)
    floor = 0.0
    kind = "split at the delimiters"
rng = np.random.default_rng(0)
rows = []
for side in (64, 240):
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (side, side, 3), dtype=np.uint8)).save(buf, "JPEG", quality=90)
    request = httpx.Request("POST", "http://x/predict", files={"file": ("a.jpg", buf.getvalue(), "image/jpeg")})
    body = request.read()
    run = parser(body, request.headers["content-type"])
    best = min(timeit.repeat(run, number=2000, repeat=5)) / 2000
    rows.append({"body_bytes": len(body), "us": round((best - floor) * 1e6, 1)})
print(json.dumps({"parser": kind, "rows": rows}))
"""


def measure(tree: Path) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run([sys.executable, "-c", CHILD], cwd=tree, env=env, capture_output=True, text=True, check=True)
    result: dict[str, Any] = json.loads(out.stdout)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--before", type=Path, required=True, help="a checkout of 3b33d80 or older")
    p.add_argument("--name", default="multipart-cost-cpu")
    args = p.parse_args()
    report = {
        "cpu": cpu_model(),
        "trees": {commit(tree): measure(tree) for tree in (args.before, ROOT)},
    }
    rows = [
        (f"{tree} ({r['parser']})", row["body_bytes"], row["us"])
        for tree, r in report["trees"].items()
        for row in r["rows"]
    ]
    text = "\n".join(
        [
            "# Reading a /predict multipart body",
            "",
            f"`python -m bench.compare.multipart_cost --before {args.before} --name {args.name}` on {report['cpu']}:"
            " the best of 5 rounds of 2,000 parses of one JPEG as httpx sends it.",
            "",
            *table(["tree (parser)", "body bytes", "us per body"], rows),
            "",
        ]
    )
    write_results(args.name, report, text)


if __name__ == "__main__":
    main()
