"""kserve's InferenceGRPCClient against a server, run as its own process (`python -m tests.app.grpc.kserve_client`).

kserve and tritonclient.grpc both register the protobuf package `inference` in the default descriptor pool,
and a process can hold only one of them: the tests use tritonclient.grpc, so kserve runs here. Prints one
JSON object of what the client saw.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from kserve import InferenceGRPCClient, InferInput, InferRequest
from kserve.protocol.infer_type import RequestedOutput


async def main(target: str, model: str, files: list[Path], pixels_shape: list[int]) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    async with InferenceGRPCClient(target, timeout=30) as client:
        seen["live"] = await client.is_server_live()
        seen["ready"] = await client.is_server_ready()
        seen["model_ready"] = await client.is_model_ready(model)
        images = InferInput("image", [len(files)], "BYTES")
        images.set_data_from_numpy(np.array([f.read_bytes() for f in files], dtype=np.object_))
        request = InferRequest(
            model_name=model, infer_inputs=[images], request_id="k-1", parameters={"attention": "last"}
        )
        response = await client.infer(request)
        outputs = {o.name: o.as_numpy() for o in response.outputs}
        seen["id"], seen["model_version"] = response.id, response.model_version
        seen["probabilities"] = outputs["probabilities"].tolist()
        seen["attention_shape"] = list(outputs["attention"].shape)
        pixels = InferInput("pixels", pixels_shape, "FP32")
        pixels.set_data_from_numpy(np.zeros(pixels_shape, np.float32))
        request = InferRequest(
            model_name=model, infer_inputs=[pixels], request_outputs=[RequestedOutput("probabilities")]
        )
        seen["pixels_probabilities_shape"] = list((await client.infer(request)).outputs[0].as_numpy().shape)
        try:
            await client.infer(InferRequest(model_name="nope", infer_inputs=[images]))
        except grpc.aio.AioRpcError as e:
            seen["unknown_model"] = [e.code().name, e.details()]
    return seen


if __name__ == "__main__":
    target, model, shape, *paths = sys.argv[1:]
    print(json.dumps(asyncio.run(main(target, model, [Path(p) for p in paths], json.loads(shape)))))
