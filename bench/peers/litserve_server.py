"""The peer: LitServe serving the same checkpoint with the same decode, preprocessing and batch settings.

python -m bench.peers.litserve_server --weights weights/vit-shapes.safetensors --port 8001 [--backend onnxruntime]
python -m bench.peers.litserve_server --weights W --api-servers 8 --workers-per-device 4 --decode gpu   # on a GPU

With `--decode cpu` each request's image is decoded and preprocessed by PIL in `decode_request`. With
`--decode gpu` (a GPU host, as the service's defaults) `decode_request` keeps the upload's bytes and `batch()`
decodes the batch's JPEGs with the service's own GPU decoder (torchvision's nvJPEG, then the checkpoint's
resize, crop and normalisation on the device), the way LitServe's docs put batch-wide work in `batch()`.
Several API servers (`num_api_servers`) and inference workers per device (`workers_per_device`) with
`fast_queue=True` are LitServe's advice for throughput.
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
from app.core.images.gpu_decode import GpuJpegDecoder, Jpeg, TorchvisionJpeg
from app.core.images.prepare import Preprocessor
from bench.peers.work import BatchCounter
from model.checkpoint import load_checkpoint
from model.device import resolve_device


class ViTLitAPI(ls.LitAPI):
    def __init__(
        self, weights: str, max_batch_size: int, wait_ms: float, threads: int, backend: str, decode: str = "cpu"
    ) -> None:
        super().__init__(max_batch_size=max_batch_size, batch_timeout=wait_ms / 1000.0)
        self.weights = weights
        self.threads = threads
        self.backend = backend
        self.decode = decode

    def setup(self, device: str) -> None:
        # setup() runs in LitServe's inference worker, a process of its own: the thread count must be
        # set here (setting it in the parent leaves the worker at torch's default).
        if self.threads:
            torch.set_num_threads(self.threads)
        self.worker_threads = torch.get_num_threads()
        self.model_device = resolve_device("auto")
        self.dtype = inference_dtype(self.model_device)
        self.ckpt = load_checkpoint(self.weights, self.model_device)
        self.model = self.ckpt.model.to(self.dtype).eval()
        self.logits: Callable[[Tensor], Tensor] = self.model
        if self.backend in ("onnxruntime", "onnxruntime-int8"):  # the service's own ONNX backend, made the same way
            c = self.ckpt.config
            shape = (c.in_channels, c.image_size, c.image_size)
            graph = exported(self.model, shape, self.worker_threads, int8=self.backend == "onnxruntime-int8")
            self.logits = lambda x: graph(x)[0]
        self.pre = Preprocessor(self.ckpt.preprocessing)
        self.count = BatchCounter()  # the batches formed, for python -m bench peers
        self.gpu_decoder = GpuJpegDecoder(
            self.ckpt.preprocessing, self.model_device, self.decode_on_cpu, TorchvisionJpeg(self.model_device)
        )

    def decode_on_cpu(self, file: Jpeg) -> Tensor:
        # a large JPEG drafted to the resize size while decoding, as the service does by default (VIT_JPEG_DRAFT)
        channels, draft_to = self.ckpt.config.in_channels, self.ckpt.preprocessing.resize_size
        return self.pre(decode_image(bytes(file.data), file.filename, channels, 40_000_000, draft_to))

    # The annotation must be the real Request class (no postponed annotations in this module):
    # LitServe reads it to parse the body as a form rather than JSON.
    def decode_request(self, request: Request) -> Tensor | Jpeg:
        upload = request["file"]
        file = Jpeg(upload.file.read(), upload.filename or "file")
        return file if self.decode == "gpu" else self.decode_on_cpu(file)

    def batch(self, inputs: list[Tensor | Jpeg]) -> Tensor:
        if self.decode == "gpu":  # the batch's JPEGs in one decoder call (a file nvJPEG rejects: PIL)
            return self.gpu_decoder([i for i in inputs if isinstance(i, Jpeg)])
        return torch.stack([i for i in inputs if isinstance(i, Tensor)])

    @torch.inference_mode()
    def predict(self, x: Tensor) -> Tensor:
        self.count(len(x))
        return self.logits(x.to(self.model_device, self.dtype)).float().softmax(-1).cpu()

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
            "decode": self.decode,
            "device": self.model_device.type,
        }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--weights", required=True)
    p.add_argument("--port", type=int, default=8001)
    p.add_argument("--max-batch-size", type=int, default=32)
    p.add_argument("--wait-ms", type=float, default=5.0)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--backend", choices=["torch", "onnxruntime", "onnxruntime-int8"], default="torch")
    p.add_argument("--decode", choices=["cpu", "gpu"], default="cpu", help="where each batch's JPEGs are decoded")
    p.add_argument("--api-servers", type=int, default=1, help="LitServe's num_api_servers")
    p.add_argument("--workers-per-device", type=int, default=1, help="LitServe's workers_per_device")
    args = p.parse_args()
    api = ViTLitAPI(args.weights, args.max_batch_size, args.wait_ms, args.threads, args.backend, args.decode)
    several = args.api_servers > 1 or args.workers_per_device > 1
    server = ls.LitServer(
        api, accelerator="auto", workers_per_device=args.workers_per_device, timeout=30, fast_queue=several
    )
    server.run(port=args.port, num_api_servers=args.api_servers, log_level="warning", generate_client_file=False)


if __name__ == "__main__":
    main()
