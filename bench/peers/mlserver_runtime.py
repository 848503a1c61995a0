"""The peer: Seldon's MLServer serving the checkpoint through a custom runtime, with MLServer's adaptive batching
(`max_batch_size`, `max_batch_time` in model-settings.json) and its default parallel inference worker. The input
`image` is BYTES, the encoded image in base64 (`content_type: base64`, MLServer's codec for bytes over REST's JSON:
MLServer's REST has no binary tensor extension); the output `probabilities` FP32.

`write_settings` writes the model repository folder; `mlserver start FOLDER` serves it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
from mlserver import MLModel
from mlserver.codecs import Base64Codec, NumpyCodec
from mlserver.types import InferenceRequest, InferenceResponse

from bench.peers.work import Work

MODEL = "vit"


class ViTRuntime(MLModel):
    async def load(self) -> bool:
        params = self.settings.parameters
        assert params is not None and params.uri
        self.work = Work(params.uri, int(os.environ.get("VIT_PEER_THREADS", "1")))
        return True

    async def predict(self, payload: InferenceRequest) -> InferenceResponse:
        uploads = Base64Codec.decode_input(payload.inputs[0])
        probs = np.asarray(self.work(uploads), dtype=np.float32)
        return InferenceResponse(
            model_name=self.name, outputs=[NumpyCodec.encode_output(name="probabilities", payload=probs)]
        )


def write_settings(folder: Path, weights: Path, ports: list[int], max_batch_size: int, wait_ms: float) -> Path:
    """The server's settings.json (`ports`: HTTP, gRPC, metrics) and the model's model-settings.json in `folder`."""
    (folder / MODEL).mkdir(parents=True, exist_ok=True)
    server = {
        "host": "127.0.0.1",
        "http_port": ports[0],
        "grpc_port": ports[1],
        "metrics_port": ports[2],
        "debug": False,
    }
    model = {
        "name": MODEL,
        "implementation": "bench.peers.mlserver_runtime.ViTRuntime",
        "max_batch_size": max_batch_size,
        "max_batch_time": wait_ms / 1000,
        "parameters": {"uri": str(weights.resolve())},
    }
    (folder / "settings.json").write_text(json.dumps(server))
    (folder / MODEL / "model-settings.json").write_text(json.dumps(model))
    return folder
