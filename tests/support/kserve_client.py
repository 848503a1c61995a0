"""kserve's inference clients against a server, run as their own process:

    python -m tests.support.kserve_client rest|grpc URL_OR_TARGET MODEL PIXELS_SHAPE FILE...

kserve and tritonclient.grpc both register the protobuf package `inference` in protobuf's default pool,
and one process can hold only one of them; the tests use tritonclient.grpc, so kserve runs here. Prints one
JSON object of what the client saw; the tests assert on it.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np

from harness.server import ROOT


def run(protocol: str, url: str, model: str, pixels_shape: list[int], files: list[Path]) -> dict[str, Any]:
    """`session` in a process of its own; what it saw."""
    argv = [sys.executable, "-m", "tests.support.kserve_client", protocol, url, model, json.dumps(pixels_shape)]
    done = subprocess.run([*argv, *map(str, files)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    seen: dict[str, Any] = json.loads(done.stdout)
    return seen


async def session(protocol: str, url: str, model: str, files: list[Path], pixels_shape: list[int]) -> dict[str, Any]:
    # imported here, in the client's own process only (see above)
    from kserve import InferenceGRPCClient, InferenceRESTClient, InferInput, InferRequest, RESTConfig
    from kserve.protocol.infer_type import RequestedOutput

    seen: dict[str, Any] = {}
    rest = protocol == "rest"
    client: Any = (
        InferenceRESTClient(RESTConfig(protocol="v2", timeout=30)) if rest else InferenceGRPCClient(url, timeout=30)
    )
    base = (url,) if rest else ()  # the REST client takes the server's URL with each call
    try:
        seen["live"] = await client.is_server_live(*base)
        seen["ready"] = await client.is_server_ready(*base)
        seen["model_ready"] = await client.is_model_ready(*base, model)
        images = InferInput("image", [len(files)], "BYTES")
        images.set_data_from_numpy(np.array([f.read_bytes() for f in files], dtype=np.object_), binary_data=True)
        request = InferRequest(
            model_name=model, infer_inputs=[images], request_id="k-1", parameters={"attention": "last"}
        )
        response = await (client.infer(url, request, model_name=model) if rest else client.infer(request))
        outputs = {o.name: o.as_numpy() for o in response.outputs}
        seen["id"], seen["model_version"] = response.id, response.model_version
        seen["probabilities"] = outputs["probabilities"].tolist()
        seen["attention_shape"] = list(outputs["attention"].shape)
        pixels = InferInput("pixels", pixels_shape, "FP32")
        pixels.set_data_from_numpy(np.zeros(pixels_shape, np.float32), binary_data=False)
        wanted = [RequestedOutput("probabilities", parameters={"binary_data": True} if rest else None)]
        request = InferRequest(model_name=model, infer_inputs=[pixels], request_outputs=wanted)
        response = await (client.infer(url, request, model_name=model) if rest else client.infer(request))
        seen["pixels_probabilities_shape"] = list(response.outputs[0].as_numpy().shape)
        try:
            request = InferRequest(model_name="nope", infer_inputs=[images])
            await (client.infer(url, request, model_name="nope") if rest else client.infer(request))
        except Exception as e:  # each transport raises its own kind
            code = getattr(e, "code", None)
            seen["unknown_model"] = [code().name if callable(code) else type(e).__name__, str(e)]
    finally:
        await client.close()
    return seen


if __name__ == "__main__":
    protocol, url, model, shape, *paths = sys.argv[1:]
    print(json.dumps(asyncio.run(session(protocol, url, model, [Path(p) for p in paths], json.loads(shape)))))
