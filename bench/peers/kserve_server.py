"""The peer: KServe's Python model server serving the checkpoint as a `kserve.Model` over the Open Inference
Protocol (V2) over REST. Its input `image` is BYTES, each encoded image in base64 in the JSON body: KServe 0.21 turns a
binary BYTES input into UTF-8 text as it parses the request (`InferRequest.from_bytes`), which fails for every image,
so the binary extension cannot carry one. Its output `probabilities` is FP32. KServe batches only through its batcher, a sidecar that KServe injects on Kubernetes: outside
Kubernetes, as here, each request is a batch of its own.

VIT_PEER_WEIGHTS=W python -m bench.peers.kserve_server --port 8001
"""

from __future__ import annotations

import argparse
import base64
import os

import kserve
import numpy as np
from kserve import InferRequest, InferResponse
from kserve.protocol.infer_type import InferOutput

from bench.peers.work import Work

MODEL = "vit"


class ViTModel(kserve.Model):
    def __init__(self) -> None:
        super().__init__(MODEL)
        self.work = Work(os.environ["VIT_PEER_WEIGHTS"], int(os.environ.get("VIT_PEER_THREADS", "1")))
        self.ready = True

    def predict(self, payload: InferRequest, headers: dict[str, str] | None = None) -> InferResponse:  # type: ignore[override]
        uploads = [base64.b64decode(x) for x in payload.inputs[0].data]
        probs = np.asarray(self.work(uploads), dtype=np.float32)
        binary = any(o.parameters and o.parameters.get("binary_data") for o in payload.request_outputs or [])
        out = InferOutput("probabilities", list(probs.shape), "FP32")
        out.set_data_from_numpy(probs, binary_data=bool(binary))
        return InferResponse(model_name=MODEL, infer_outputs=[out], response_id=payload.id or "")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--grpc-port", type=int, default=8081)  # not opened (enable_grpc=False), but not left to chance
    args = p.parse_args()
    kserve.ModelServer(http_port=args.port, grpc_port=args.grpc_port, enable_grpc=False, workers=1).start([ViTModel()])


if __name__ == "__main__":
    main()
