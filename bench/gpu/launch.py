"""The GPU tests under pytest, and a smoke run of every route on VIT_DEVICE=auto."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx

from harness.server import Server


def tests(out: Path) -> dict[str, Any]:
    argv = [
        sys.executable,
        "-m",
        "pytest",
        "tests/app/test_cuda.py",
        "-v",
        "-p",
        "no:cacheprovider",
        "-rA",
        "--tb=short",
        "--show-capture=no",
    ]
    run = subprocess.run(argv, capture_output=True, text=True)
    print(run.stdout, run.stderr)
    return {"returncode": run.returncode, "summary": run.stdout.strip().splitlines()[-1] if run.stdout else ""}


def smoke(folder: Path) -> dict[str, Any]:
    """The service on VIT_DEVICE=auto with the bundled model: what each route answers, verbatim."""
    from app.settings import BUNDLED_WEIGHTS
    from harness.images import encode
    from model.shapes import make_sample

    pngs = [encode(make_sample(7, i).image) for i in range(2)]
    server = Server(BUNDLED_WEIGHTS, VIT_DEVICE="auto", VIT_GRPC_PORT="0")
    out: dict[str, Any] = {}
    try:
        server.wait_ready(300)
        files = [("files", (f"{i}.png", png, "image/png")) for i, png in enumerate(pngs)]
        out["v1_model"] = httpx.get(server.url + "/v1/model").json()
        out["predict"] = httpx.post(server.url + "/predict", files=files, params={"top_k": 2}).json()
        mapped = httpx.post(server.url + "/predict", files=files[:1], params={"attention": "rollout", "top_k": 1})
        out["predict_rollout"] = mapped.json()
        v2 = {
            "inputs": [
                {"name": "image", "datatype": "BYTES", "shape": [1], "data": [base64.b64encode(pngs[0]).decode()]}
            ]
        }
        out["v2"] = httpx.post(server.url + "/v2/models/vit-shapes/infer", json=v2).json()
        out["metrics_batches"] = [
            line
            for line in httpx.get(server.url + "/metrics").text.splitlines()
            if line.startswith("vit_batch_size_count")
        ]
    finally:
        out["log"] = server.stop()[-4000:]
    print(json.dumps({k: v for k, v in out.items() if k != "log"}, indent=1)[:6000])
    print(out["log"])
    return out
