"""The peer: NVIDIA Triton Inference Server through PyTriton, serving the checkpoint as a Python model with
Triton's dynamic batcher (`max_batch_size`, `max_queue_delay_microseconds`). Its input `image` is BYTES, one
encoded image per batch row; its output `probabilities` FP32. Clients speak the Open Inference Protocol (V2),
binary tensor extension included.

VIT_PEER_WEIGHTS=W python -m bench.peers.triton_server --port 8000 [--grpc-port 8001] [--metrics-port 8002] [--wait-ms 5]
"""

from __future__ import annotations

import argparse
import os

import numpy as np
from pytriton.decorators import batch
from pytriton.model_config import DynamicBatcher, ModelConfig, Tensor
from pytriton.triton import Triton, TritonConfig

from bench.peers.work import Work

MODEL = "vit"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--grpc-port", type=int, default=8001)
    p.add_argument("--metrics-port", type=int, default=8002)
    p.add_argument("--max-batch-size", type=int, default=32)
    p.add_argument("--wait-ms", type=float, default=5.0)
    args = p.parse_args()
    work = Work(os.environ["VIT_PEER_WEIGHTS"], int(os.environ.get("VIT_PEER_THREADS", "1")))

    @batch
    def infer(image: np.ndarray) -> dict[str, np.ndarray]:
        return {"probabilities": np.asarray(work([bytes(row[0]) for row in image]), dtype=np.float32)}

    config = TritonConfig(
        http_address="127.0.0.1",
        http_port=args.port,
        grpc_address="127.0.0.1",
        grpc_port=args.grpc_port,
        metrics_port=args.metrics_port,
        log_verbose=0,
    )
    with Triton(config=config) as triton:
        triton.bind(
            model_name=MODEL,
            infer_func=infer,
            inputs=[Tensor(name="image", dtype=np.bytes_, shape=(1,))],
            outputs=[Tensor(name="probabilities", dtype=np.float32, shape=(len(work.classes),))],
            config=ModelConfig(
                max_batch_size=args.max_batch_size,
                batcher=DynamicBatcher(max_queue_delay_microseconds=int(args.wait_ms * 1000)),
            ),
            strict=False,
        )
        triton.serve()


if __name__ == "__main__":
    main()
