"""The peer: LitServe serving the same checkpoint with the same decode, preprocessing and batch settings.

python -m bench.litserve_server --weights weights/vit-shapes.safetensors --port 8001 [--backend onnxruntime]
"""

import argparse
from collections.abc import Callable
from typing import Any

import litserve as ls
import torch
from fastapi import Request
from torch import Tensor

from app.core.backends.onnx_runtime import exported
from app.core.backends.predictor import inference_dtype
from app.core.images.decode import decode_image
from app.core.images.prepare import Preprocessor
from model.checkpoint import load_checkpoint
from model.device import resolve_device


class ViTLitAPI(ls.LitAPI):
    def __init__(self, weights: str, max_batch_size: int, wait_ms: float, threads: int, backend: str) -> None:
        super().__init__(max_batch_size=max_batch_size, batch_timeout=wait_ms / 1000.0)
        self.weights = weights
        self.threads = threads
        self.backend = backend

    def setup(self, device: str) -> None:
        # setup() runs in LitServe's inference worker, a process of its own: the thread count must be
        # set here (setting it in the parent leaves the worker at torch's default).
        if self.threads:
            torch.set_num_threads(self.threads)
        self.worker_threads = torch.get_num_threads()
        self.device = resolve_device("auto")
        self.dtype = inference_dtype(self.device)
        self.ckpt = load_checkpoint(self.weights, self.device)
        self.model = self.ckpt.model.to(self.dtype).eval()
        self.logits: Callable[[Tensor], Tensor] = self.model
        if self.backend in ("onnxruntime", "onnxruntime-int8"):  # the service's own ONNX backend, made the same way
            c = self.ckpt.config
            shape = (c.in_channels, c.image_size, c.image_size)
            graph = exported(self.model, shape, self.worker_threads, int8=self.backend == "onnxruntime-int8")
            self.logits = lambda x: graph(x)[0]
        self.pre = Preprocessor(self.ckpt.preprocessing)

    # The annotation must be the real Request class (no postponed annotations in this module):
    # LitServe reads it to parse the body as a form rather than JSON.
    def decode_request(self, request: Request) -> Tensor:
        upload = request["file"]
        data = upload.file.read()
        return self.pre(decode_image(data, upload.filename or "file", self.ckpt.config.in_channels, 40_000_000))

    def batch(self, inputs: list[Tensor]) -> Tensor:
        return torch.stack(inputs)

    @torch.inference_mode()
    def predict(self, x: Tensor) -> Tensor:
        return self.logits(x.to(self.device, self.dtype)).float().softmax(-1).cpu()

    def unbatch(self, output: Tensor) -> list[Tensor]:
        return list(output)

    def encode_response(self, probs: Tensor) -> dict[str, Any]:
        values, indices = probs.topk(5)
        top = [
            {"label": self.ckpt.classes[i], "index": i, "probability": p}
            for p, i in zip(values.tolist(), indices.tolist(), strict=True)
        ]
        # worker_threads lets the benchmark check the peer's setting instead of assuming it
        return {
            "top_k": top,
            "probabilities": probs.tolist(),
            "worker_threads": self.worker_threads,
            "backend": self.backend,
        }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--weights", required=True)
    p.add_argument("--port", type=int, default=8001)
    p.add_argument("--max-batch-size", type=int, default=32)
    p.add_argument("--wait-ms", type=float, default=5.0)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--backend", choices=["torch", "onnxruntime", "onnxruntime-int8"], default="torch")
    args = p.parse_args()
    api = ViTLitAPI(args.weights, args.max_batch_size, args.wait_ms, args.threads, args.backend)
    server = ls.LitServer(api, accelerator="auto", workers_per_device=1, timeout=30)
    server.run(port=args.port, log_level="warning", generate_client_file=False)


if __name__ == "__main__":
    main()
