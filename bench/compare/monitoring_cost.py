"""What out-of-distribution scoring, drift gauges and a shadow pair at fraction 0 cost a computed request, timed
directly with the engine's own code.

    python -m bench.compare.monitoring_cost --requests 20000

With VIT_DRIFT_WINDOW on and reference statistics in the checkpoint, every batch of the model does, beside its
work: the embedding rows copied out of it, and its images scored, added to the drift window and both gauges set
(`app.core.engine.drift.Watching`, the batcher's observer); a batch's share is counted for every `--batch`
requests. Every request looks the shadow pair up and passes it over at fraction 0. These are timed here on the
bundled checkpoint, one image a request, against the same loop without them. As with bench.compare.statistics_cost, an A/B of two servers
cannot resolve a share this small on a shared machine (rounds move by 5 to 20 %), so the share is stated of the
server's CPU per computed request in `bench/results/cache-cpu.json` (`python -m bench.cache`, cache off).
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import torch

from app.core.backends.predictor import ImageInput, ImageOutput, embeddings_asked
from app.core.engine.drift import Watching
from app.core.engine.engine import Engine
from app.settings import BUNDLED_WEIGHTS, Settings
from bench.common import write_results
from bench.compare.statistics_cost import server_cpu_us
from harness.records import cpu_model, table


def added_us(engine: Engine, requests: int, batch: int) -> float:
    """CPU µs a request of one image spends in the monitoring calls."""
    model = engine.served["a"]
    reference = model.checkpoint.reference
    assert reference is not None
    g = torch.Generator().manual_seed(0)
    embedding = torch.randn(batch, model.checkpoint.config.dim, generator=g)  # a batch's embeddings, as computed
    probabilities = torch.randn(batch, len(model.classes), generator=g).softmax(-1)
    items = [ImageInput(torch.empty(0), "none", None, True) for _ in range(batch)]
    shadow = engine.shadowing.shadows["a"]
    watching = model.batcher.observer
    assert isinstance(watching, Watching)
    began = time.process_time()
    for i in range(requests):
        j = i % batch
        if j == 0:  # the batch's images into the window, as the batcher's observer takes them
            rows = embeddings_asked(embedding, items)
            watching.watch.add([ImageOutput(probabilities[k], None, rows[k]) for k in range(batch)])
        _ = [ImageOutput(probabilities[j], None, rows[j])]  # the request's outputs, made as in the loop below
        if engine.shadowing.sampling(model.name) is not None:
            raise AssertionError("fraction 0: never shadowed")
    monitored = time.process_time() - began
    began = time.process_time()
    for i in range(requests):  # the same loop's own cost: the outputs made, nothing monitored
        j = i % batch
        _ = [ImageOutput(probabilities[j], None, None)]
    bare = time.process_time() - began
    assert shadow.compared == 0
    return (monitored - bare) / requests * 1e6


def main() -> None:
    p = argparse.ArgumentParser(
        prog="python -m bench.compare.monitoring_cost", description=(__doc__ or "").split("\n\n")[0]
    )
    p.add_argument("--requests", type=int, default=20000)
    p.add_argument("--batch", type=int, default=8, help="requests per batch (one image each)")
    p.add_argument("--repeats", type=int, default=5, help="the best of this many runs is reported")
    p.add_argument("--name", default="monitoring-cost-cpu")
    args = p.parse_args()
    torch.set_num_threads(1)
    models = f"a={BUNDLED_WEIGHTS},b={BUNDLED_WEIGHTS}"
    settings = Settings(models=models, shadow="a:b:0", ood_threshold="0.5", device="cpu", backend="torch", warmup=False)
    engine = Engine.load(settings)
    report: dict[str, Any] = {
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "requests": args.requests,
        "batch": args.batch,
        "repeats": args.repeats,
        "drift_window": settings.drift_window,
        "added_us": min(added_us(engine, args.requests, args.batch) for _ in range(args.repeats)),
        "server_cpu_us": server_cpu_us(),
    }
    write_results(args.name, report, markdown(report))
    print(markdown(report))


def markdown(report: dict[str, Any]) -> str:
    server = report["server_cpu_us"]
    us = report["added_us"]
    share = (
        f"{us / server['computed'] * 100:.2f} % of {server['computed']:,.0f} µs"
        if server
        else "(no bench.cache results)"
    )
    return "\n".join(
        [
            f"# What out-of-distribution scores, drift gauges and a shadow at fraction 0 cost a request ({report['cpu_count']} cores)",
            "",
            f"`python -m bench.compare.monitoring_cost --requests {report['requests']} --batch {report['batch']}`: the "
            "engine's calls for one computed request of one image on the bundled checkpoint (its share of its batch "
            f"of {report['batch']}: the embedding rows copied out, the images scored into the drift window of "
            f"{report['drift_window']} images and both gauges set; the shadow pair passed over), timed directly against "
            f"the same loop without them; CPU time on one thread, the best of {report['repeats']} runs. The share is "
            "of the server's CPU per computed request in `bench/results/cache-cpu.json` (`python -m bench.cache`, "
            f"cache off). On {report['cpu']}.",
            "",
            *table(["request", "µs of CPU", "share of the request"], [["a computed request", f"{us:.1f}", share]]),
            "",
        ]
    )


if __name__ == "__main__":
    main()
