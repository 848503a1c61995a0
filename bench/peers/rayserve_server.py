"""The peer: Ray Serve serving the checkpoint as one replica whose method is batched by `@serve.batch`
(`max_batch_size`, `batch_wait_timeout_s`), with `max_ongoing_requests` raised past the load's concurrency (its
default of 5 caps a replica's batch at 5). The body is the image's bytes. Ray runs locally on the host's cores.

VIT_PEER_WEIGHTS=W python -m bench.peers.rayserve_server --port 8001 [--max-batch-size 32] [--wait-ms 5]
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import ray
from ray import serve
from starlette.requests import Request


@serve.deployment(max_ongoing_requests=512, ray_actor_options={"num_cpus": 1})
class ViT:
    def __init__(self, weights: str, max_batch_size: int, wait_ms: float) -> None:
        from bench.peers.work import Work

        self.work = Work(weights, int(os.environ.get("VIT_PEER_THREADS", "1")))
        self.classify.set_max_batch_size(max_batch_size)
        self.classify.set_batch_wait_timeout_s(wait_ms / 1000)

    @serve.batch(max_batch_size=32, batch_wait_timeout_s=0.005)
    async def classify(self, uploads: list[bytes]) -> list[dict[str, Any]]:
        return [{"probabilities": p, "worker_threads": self.work.threads} for p in self.work(uploads)]

    async def __call__(self, request: Request) -> dict[str, Any]:
        answer: dict[str, Any] = await self.classify(await request.body())
        return answer


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-batch-size", type=int, default=32)
    p.add_argument("--wait-ms", type=float, default=5.0)
    args = p.parse_args()
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, runtime_env={"env_vars": {"PYTHONPATH": here}})
    serve.start(http_options={"host": "127.0.0.1", "port": args.port})
    app = ViT.bind(os.environ["VIT_PEER_WEIGHTS"], args.max_batch_size, args.wait_ms)
    serve.run(app, name="vit", route_prefix="/predict")
    print("ready", flush=True)
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    main()
