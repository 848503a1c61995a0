"""The peer: TorchServe serving the checkpoint with a custom handler, batched by TorchServe's frontend
(`batchSize`, `maxBatchDelay` in config.properties), one Python worker. The body is the image's bytes, as its docs
post an image (`curl -T image.jpg .../predictions/NAME`).

`write_store` archives the handler with the checkpoint (torch-model-archiver) and writes config.properties;
`torchserve --start --foreground --model-store STORE --ts-config STORE/config.properties` serves it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

MODEL = "vit"
work = None


def handle(data: list[dict[str, Any]] | None, context: Any) -> list[str] | None:
    """TorchServe's entry point: a batch of requests -> one answer each (None while it only initialises)."""
    global work
    if work is None:
        from bench.peers.work import Work

        weights = Path(context.system_properties["model_dir"]) / context.manifest["model"]["serializedFile"]
        work = Work(weights, int(os.environ.get("VIT_PEER_THREADS", "1")))
    if data is None:
        return None
    uploads = [bytes(row.get("data") or row.get("body")) for row in data]
    return [json.dumps({"probabilities": p, "worker_threads": work.threads}) for p in work(uploads)]


def write_store(folder: Path, weights: Path, ports: list[int], max_batch_size: int, wait_ms: float) -> Path:
    """The model archive and config.properties (`ports`: inference, management, metrics) in `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    archiver = Path(sys.executable).with_name("torch-model-archiver")
    subprocess.run(
        [
            str(archiver),
            "--model-name",
            MODEL,
            "--version",
            "1.0",
            "--serialized-file",
            str(weights.resolve()),
            "--handler",
            str(Path(__file__).resolve()),  # its module-level handle()
            "--export-path",
            str(folder),
            "--force",
        ],
        check=True,
    )
    models = {
        MODEL: {
            "1.0": {
                "marName": f"{MODEL}.mar",
                "minWorkers": 1,
                "maxWorkers": 1,
                "batchSize": max_batch_size,
                "maxBatchDelay": int(wait_ms),
                "responseTimeout": 120,
            }
        }
    }
    config = [
        f"inference_address=http://127.0.0.1:{ports[0]}",
        f"management_address=http://127.0.0.1:{ports[1]}",
        f"metrics_address=http://127.0.0.1:{ports[2]}",
        f"model_store={folder}",
        f"load_models={MODEL}.mar",
        f"models={json.dumps(models)}",
        f"python={sys.executable}",
        "disable_token_authorization=true",
        "enable_envvars_config=false",
        "default_workers_per_model=1",
        "job_queue_size=1000",
        "async_logging=true",
    ]
    (folder / "config.properties").write_text("\n".join(config) + "\n")
    return folder
