"""What a request costs the server over each HTTP protocol: `/predict` and V2 binary with the same image, in one
checkout or several.

    python -m bench.compare.protocols --trees . /tmp/before --rounds 5 --seconds 8

Each checkout's service (`git worktree add /tmp/before REV`) is `python -m app` with the bundled model on the CPU,
set as `python -m bench peers` sets it (one thread, batches of up to 32 with a 5 ms wait, the response cache off),
and started once; `hey` then posts one image at a time at `--concurrency`, as the peers benchmark asks: the image's
bytes to `/predict`, and a V2 binary request (BYTES in, the probabilities out as binary data) to
`/v2/models/NAME/infer`. Every (checkout, protocol) pair is loaded in turn, the order reversed every other round; the
server's CPU time (user + system, from /proc) over the requests it answered is what a request costs it.
"""

from __future__ import annotations

import argparse
import tempfile
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx

from app.settings import BUNDLED_WEIGHTS
from bench.common import sample_images, sample_label, write_results
from bench.peers.servers import v2_binary
from bench.rounds import alternated, loaded, rounds_table
from harness.server import ROOT, Server

PROTOCOLS = ("/predict", "V2 binary")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.compare.protocols", description=__doc__.split("\n\n")[0])
    p.add_argument("--trees", type=Path, nargs="+", default=[ROOT], help="checkouts to compare")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--seconds", type=float, default=8.0)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--image", choices=["png-small", "jpeg-medium"], default="png-small", help="the posted image")
    p.add_argument("--name", default="protocols-cpu")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    image = sample_images()[args.image]
    kind = "image/" + args.image.split("-")[0]
    trees = [tree.resolve() for tree in args.trees]
    settings = {
        "VIT_THREADS": "1",
        "VIT_MAX_BATCH_SIZE": "32",
        "VIT_MAX_WAIT_MS": "5",
        "VIT_MAX_QUEUE": "4096",
        "VIT_CACHE_BYTES": "0",
        "VIT_GRPC_PORT": "0",
        "VIT_LOG_LEVEL": "warning",
    }
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        predict_body, v2_path = Path(tmp) / "image", Path(tmp) / "v2.body"
        predict_body.write_bytes(image)
        servers = {tree: stack.enter_context(Server(BUNDLED_WEIGHTS, None, tree=tree, **settings)) for tree in trees}
        model = httpx.get(next(iter(servers.values())).url + "/v1/models", timeout=10).json()["default"]
        v2 = v2_binary(f"/v2/models/{model}/infer", batch_dim=False, binary_out=True)(image, kind)  # as `bench peers`
        v2_path.write_bytes(v2.body)
        configs = [(tree, protocol) for tree in trees for protocol in PROTOCOLS]

        def label(config: tuple[Path, str]) -> str:
            tree, protocol = config
            return protocol if len(trees) == 1 else f"{tree.name if tree != ROOT else '.'} {protocol}"

        def run(config: tuple[Path, str]) -> dict[str, Any]:
            tree, protocol = config
            server = servers[tree]
            if protocol == "/predict":
                measured = loaded(server, "/predict", predict_body, kind, args.concurrency, args.seconds)
            else:
                measured = loaded(
                    server,
                    v2.path,
                    v2_path,
                    "application/octet-stream",
                    args.concurrency,
                    args.seconds,
                    headers=v2.headers,
                )
            print(label(config), measured, flush=True)
            return measured

        runs = alternated(configs, args.rounds, run)
    report = {
        "image": args.image,
        "concurrency": args.concurrency,
        "seconds": args.seconds,
        "trees": [str(tree) for tree in trees],
        "runs": {label(config): runs[str(config)] for config in configs},
    }
    write_results(args.name, report, markdown(report))


def markdown(report: dict[str, Any]) -> str:
    return "\n".join(
        [
            "# What a request costs the server over each HTTP protocol",
            "",
            f"One {sample_label(report['image'])} a request at concurrency {report['concurrency']}, "
            f"{report['seconds']:.0f} s per run, every (checkout, protocol) pair in turn, the order reversed every other "
            "round; `/predict` with the image's bytes, V2 binary with the image as a BYTES tensor and the probabilities "
            f"back as binary data. Checkouts: {', '.join(f'`{t}`' for t in report['trees'])}. The server's CPU time "
            "(user + system, from /proc) over the requests it answered is what a request costs it, a figure less "
            "shaken than the rate by what else the machine runs.",
            "",
            *rounds_table(report["runs"]),
            "",
        ]
    )


if __name__ == "__main__":
    main()
