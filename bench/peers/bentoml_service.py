"""The peer: BentoML serving the checkpoint as a Service whose API is batchable (BentoML's adaptive batching,
`max_batch_size` and `max_latency_ms`), one worker. The image comes as a multipart upload, which BentoML hands over
as a file (`pathlib.Path`, its type for files); the bytes go through the shared decoder.

VIT_PEER_WEIGHTS=W VIT_PEER_MAX_BATCH=32 bentoml serve bench.peers.bentoml_service:ViT --port 8001
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import bentoml

from bench.peers.work import Work

MAX_BATCH = int(os.environ.get("VIT_PEER_MAX_BATCH", "32"))


@bentoml.service(workers=1, traffic={"timeout": 120})
class ViT:
    def __init__(self) -> None:
        self.work = Work(os.environ["VIT_PEER_WEIGHTS"], int(os.environ.get("VIT_PEER_THREADS", "1")))

    @bentoml.api(batchable=True, max_batch_size=MAX_BATCH, max_latency_ms=60_000)
    def classify(self, image: list[Path]) -> list[dict[str, Any]]:
        probs = self.work([p.read_bytes() for p in image])
        return [{"probabilities": p, "worker_threads": self.work.threads} for p in probs]
