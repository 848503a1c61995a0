"""The peer on the device stand-in: LitServe answering /predict with the same waits for the GPU's work.

python -m bench.peers.litserve_stand_in --model vit-b16 --port 8001 --api-servers 4 --workers-per-device 4

Configured for throughput as LitServe's docs advise: several API server processes (`num_api_servers`),
several inference workers on the device (`workers_per_device`), `fast_queue=True` (ZeroMQ between them),
and a max batch per worker. Each upload's bytes go to an inference worker undecoded; its `batch()` "decodes"
the batch's JPEGs and its `predict` runs the "forward", as the same `harness.stand_in.Device` waits the
service's engine does; the workers of this server share the one device through file locks, as processes
sharing a GPU take turns on it. The answer is the top 5 and every probability, as /predict's is.
"""

# No postponed annotations here: LitServe reads decode_request's annotation, the real Request class, to parse
# the body as a form.

import argparse
import os
import tempfile
from pathlib import Path
from typing import Any

import litserve as ls
import torch
from fastapi import Request
from torch import Tensor

from harness.stand_in import Device, DeviceTimes


class StandInLitAPI(ls.LitAPI):
    def __init__(self, model: str, max_batch_size: int, wait_ms: float, shared: str) -> None:
        super().__init__(max_batch_size=max_batch_size, batch_timeout=wait_ms / 1000.0)
        self.model = model
        self.shared = shared
        self.batch_limit = max_batch_size

    def setup(self, device: str) -> None:
        torch.set_num_threads(1)  # several workers share the host's cores
        self.gpu = Device(DeviceTimes(self.model, self.batch_limit), Path(self.shared))
        self.classes = [f"class_{i}" for i in range(1000)]
        self.probabilities = torch.full((self.batch_limit, len(self.classes)), 1.0 / len(self.classes))
        self.settings = {"pid": os.getpid(), "threads": torch.get_num_threads()}

    def decode_request(self, request: Request) -> bytes:
        upload = request["file"]
        data: bytes = upload.file.read()
        return data

    def batch(self, inputs: list[bytes]) -> int:
        self.gpu.decode(len(inputs))  # the batch's JPEGs decoded on the device
        return len(inputs)

    def predict(self, n: int) -> Tensor:
        self.gpu.forward(n)
        return self.probabilities[:n].clone()

    def unbatch(self, output: Tensor) -> list[Tensor]:
        return list(output)

    def encode_response(self, probabilities: Tensor) -> dict[str, Any]:
        values, indices = probabilities.topk(5)
        top = [
            {"label": self.classes[i], "index": i, "probability": p}
            for p, i in zip(values.tolist(), indices.tolist(), strict=True)
        ]
        return {"top_k": top, "probabilities": probabilities.tolist(), "worker": self.settings}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", choices=["vit-s16", "vit-b16"], default="vit-b16")
    p.add_argument("--port", type=int, default=8001)
    p.add_argument("--api-servers", type=int, default=4)
    p.add_argument("--workers-per-device", type=int, default=4)
    p.add_argument("--max-batch-size", type=int, default=256)
    p.add_argument("--wait-ms", type=float, default=5.0)
    args = p.parse_args()
    shared = tempfile.mkdtemp(prefix="stand-in-device-")
    api = StandInLitAPI(args.model, args.max_batch_size, args.wait_ms, shared)
    server = ls.LitServer(
        api, accelerator="cpu", devices=1, workers_per_device=args.workers_per_device, timeout=60, fast_queue=True
    )
    servers = args.api_servers or None
    server.run(port=args.port, num_api_servers=servers, log_level="warning", generate_client_file=False)


if __name__ == "__main__":
    main()
