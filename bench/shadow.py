"""A shadow challenger against real servers: what it reports, and what it costs the champion under overload.

    python -m bench.shadow --challenger runs/short/vit-shapes-1epoch.safetensors [--images 2000] [--seconds 10]

1. Agreement: the bundled model as champion (`a`), with VIT_SHADOW at fraction 1, against the same checkpoint
   under another name and against `--challenger` (a checkpoint trained for fewer steps); `--images` held-out
   shapes sent in requests of 8, then GET /v1/models/a/shadow.
2. Overload: `hey` posting one shape to the champion from `--concurrency` connections for `--seconds`, with the
   shadow pair configured (fraction 1) and without it, alternating over `--rounds`: the champion's requests per
   second and p99, and what the shadow compared and shed meanwhile.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from app.settings import BUNDLED_WEIGHTS
from bench.common import write_results
from bench.rounds import alternated, loaded, rounds_table
from harness.images import encode
from harness.load import require_hey
from harness.records import cpu_model, table
from harness.server import Server
from model.evaluate import DEFAULT_SHAPES_EVAL_SEED
from model.shapes import make_sample


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.shadow", description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--challenger", type=Path, required=True, help="a checkpoint of the same classes (fewer steps)")
    p.add_argument("--images", type=int, default=2000)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--name", default="shadow-cpu")
    return p.parse_args()


def agreement(challenger: Path, images: int) -> dict[str, Any]:
    pngs = [encode(make_sample(DEFAULT_SHAPES_EVAL_SEED, i).image) for i in range(images)]
    models = f"a={BUNDLED_WEIGHTS},b={challenger}"
    with (
        Server(BUNDLED_WEIGHTS, VIT_MODELS=models, VIT_SHADOW="a:b", VIT_MAX_FILES="8") as server,
        httpx.Client(base_url=server.url, timeout=60) as client,
    ):
        for k in range(0, images, 8):
            files = [("files", (f"{i}.png", p, "image/png")) for i, p in enumerate(pngs[k : k + 8])]
            assert client.post("/predict", files=files, params={"model": "a"}).status_code == 200
        for _ in range(600):  # the shadow runs after the answers
            report = client.get("/v1/models/a/shadow").json()
            if report["compared"] + report["shed"] >= images:
                break
            time.sleep(0.05)
    return dict(report)


def overload(seconds: float, concurrency: int, rounds: int) -> dict[str, list[dict[str, Any]]]:
    """The champion under `hey`, the shadow pair configured ("on") or not ("off"), alternating."""
    with tempfile.TemporaryDirectory() as tmp:
        body = Path(tmp) / "shape.png"
        body.write_bytes(encode(make_sample(DEFAULT_SHAPES_EVAL_SEED, 0).image))

        def run(shadow: str) -> dict[str, Any]:
            models = f"a={BUNDLED_WEIGHTS},b={BUNDLED_WEIGHTS}"
            with Server(BUNDLED_WEIGHTS, VIT_MODELS=models, VIT_SHADOW="a:b" if shadow == "on" else "") as server:
                measured = loaded(server, "/predict?model=a", body, "image/png", concurrency, seconds, warm=0)
                report = httpx.get(f"{server.url}/v1/models/a/shadow").json() if shadow == "on" else {}
            print(shadow, measured, report, flush=True)
            return {**measured, "compared": report.get("compared"), "shed": report.get("shed")}

        return alternated(["off", "on"], rounds, run)


def main() -> None:
    args = parse_args()
    require_hey()
    itself = agreement(BUNDLED_WEIGHTS, args.images)
    fewer_steps = agreement(args.challenger, args.images)
    runs = overload(args.seconds, args.concurrency, args.rounds)
    report = {
        "cpu": cpu_model(),
        "images": args.images,
        "challenger": args.challenger.name,
        "against_itself": itself,
        "against_fewer_steps": fewer_steps,
        "overload": runs,
        "seconds": args.seconds,
        "concurrency": args.concurrency,
    }
    write_results(args.name, report, markdown(report))
    print(markdown(report))


def markdown(report: dict[str, Any]) -> str:
    def row(name: str, r: dict[str, Any]) -> list[str]:
        return [
            name,
            str(r["compared"]),
            f"{r['top1_agreement']:.4f}",
            f"{r['mean_tv_distance']:.4f}",
            f"{r['champion_p50_ms']:.1f}",
            f"{r['challenger_p50_ms']:.1f}",
            str(r["shed"]),
        ]

    return "\n".join(
        [
            "# A shadow challenger: its comparison, and the champion under overload",
            "",
            f"`python -m bench.shadow --challenger {report['challenger']} --images {report['images']} --seconds "
            f"{report['seconds']:g} --concurrency {report['concurrency']}` on {report['cpu']}. Champion: the bundled "
            f"checkpoint; {report['images']} held-out shapes in requests of 8, every image shadowed.",
            "",
            *table(
                [
                    "challenger",
                    "compared",
                    "top-1 agreement",
                    "mean TV distance",
                    "champion p50 ms",
                    "challenger p50 ms",
                    "shed",
                ],
                [
                    row("the same checkpoint", report["against_itself"]),
                    row(report["challenger"], report["against_fewer_steps"]),
                ],
            ),
            "",
            f"Overload: `hey`, one shape a request, {report['concurrency']} connections for {report['seconds']:g} s "
            "against the champion, the shadow pair (the same checkpoint, fraction 1) configured or not, alternating:",
            "",
            *rounds_table(report["overload"], "shadow"),
            "",
            "Compared / shed by the shadow, each round: "
            + ", ".join(f"{r['compared']} / {r['shed']}" for r in report["overload"]["on"]),
            "",
        ]
    )


if __name__ == "__main__":
    main()
