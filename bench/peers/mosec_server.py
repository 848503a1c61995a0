"""The peer: mosec serving the checkpoint, as its docs build a model service: a CPU stage that decodes each request
(`num` processes) and an inference stage that mosec batches (`max_batch_size`, `max_wait_time`), behind mosec's
Rust HTTP front. The body is the image's bytes (`deserialize` takes them as they come).

VIT_PEER_WEIGHTS=W python -m bench.peers.mosec_server --port 8001 [--decoders 2] [--max-batch-size 32] [--wait-ms 5]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from mosec import Server, Worker

from bench.peers.work import Work

THREADS = int(os.environ.get("VIT_PEER_THREADS", "1"))


class Decode(Worker):
    def __init__(self) -> None:
        super().__init__()
        self.work = Work(os.environ["VIT_PEER_WEIGHTS"], THREADS)

    def deserialize(self, data: bytes) -> bytes:
        return data

    def forward(self, data: bytes) -> Any:
        return self.work.decode(data)


class Classify(Worker):
    def __init__(self) -> None:
        super().__init__()
        self.work = Work(os.environ["VIT_PEER_WEIGHTS"], THREADS)

    def forward(self, data: list[Any]) -> list[dict[str, Any]]:
        import torch

        probs = self.work.forward(torch.stack(data)).tolist()
        return [{"probabilities": p, "worker_threads": self.work.threads} for p in probs]

    def serialize(self, data: dict[str, Any]) -> bytes:
        return json.dumps(data).encode()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--decoders", type=int, default=2)
    p.add_argument("--max-batch-size", type=int, default=32)
    p.add_argument("--wait-ms", type=int, default=5)
    p.add_argument("--timeout-ms", type=int, default=120_000)
    args = p.parse_args()
    # mosec answers 408 to a request not done within --timeout (3 s by default); raised as the other servers' are
    sys.argv = [sys.argv[0], "--port", str(args.port), "--address", "127.0.0.1", "--log-level", "warning"]
    sys.argv += ["--timeout", str(args.timeout_ms)]
    server = Server()
    server.append_worker(Decode, num=args.decoders)
    server.append_worker(Classify, num=1, max_batch_size=args.max_batch_size, max_wait_time=args.wait_ms)
    server.run()


if __name__ == "__main__":
    main()
