"""`python -m bench.gpu PARTS...` (see the package's docstring) and `--report`."""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from bench.gpu.common import BATCHES, MODELS, PARTS, VARIANTS, save
from bench.gpu.decoding import decode, hardware
from bench.gpu.engines import engines
from bench.gpu.kernels import ceilings, raw
from bench.gpu.launch import smoke, tests
from bench.gpu.pipeline import pipeline_part
from bench.gpu.report import report
from bench.gpu.serving import profile, served
from bench.gpu.summary import enter


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__.split("\n\n")[0])
    p.add_argument("parts", nargs="*", metavar="PART", help=f"any of {', '.join(PARTS)}")
    p.add_argument("--out", type=Path, default=Path("gpu-out"))
    p.add_argument("--models", nargs="+", choices=sorted(MODELS), default=["vit-s16", "vit-b16"])
    p.add_argument("--batches", type=int, nargs="+", default=BATCHES)
    p.add_argument("--compile-batches", type=int, nargs="+", default=[1, 8, 32, 128, 256, 512])
    p.add_argument("--variants", nargs="+", choices=sorted(VARIANTS), default=list(VARIANTS))
    p.add_argument("--max-batch-size", type=int, default=256)
    p.add_argument("--wait-ms", type=float, default=5.0)
    p.add_argument("--predict-concurrency", type=int, nargs="+", default=[64, 256])
    p.add_argument("--v2-concurrency", type=int, nargs="+", default=[16, 64, 128])
    p.add_argument("--images-per-request", type=int, default=8, help="images in each V2 request")
    p.add_argument("--duration", type=float, default=6.0, help="seconds per load level")
    p.add_argument("--engine-seconds", type=float, default=2.0, help="seconds per measurement of the engines part")
    p.add_argument("--peer", action="store_true", help="also serve with LitServe (the peer)")
    p.add_argument(
        "--peer-models", nargs="+", choices=sorted(MODELS), default=["vit-b16"], help="models LitServe serves"
    )
    p.add_argument(
        "--peer-configs",
        nargs="+",
        default=["4x4", "8x4"],
        help="LitServe configurations, num_api_servers x workers_per_device",
    )
    p.add_argument(
        "--report",
        type=Path,
        nargs="+",
        metavar="DIR",
        help="write bench/results/<name>.json and .md from the parts' JSON in these folders (later wins; served runs "
        "of the same settings are put together)",
    )
    p.add_argument("--name", default="gpu-h100", help="results file name for --report")
    p.add_argument(
        "--summary",
        type=Path,
        metavar="RESULTS_JSON",
        help="enter a results file written earlier into bench/results/gpu-summary.json (with --commit)",
    )
    p.add_argument("--commit", help="the commit the run measured (--report: default, this checkout's HEAD)")
    args = p.parse_args()
    if unknown := [part for part in args.parts if part not in PARTS]:
        p.error(f"unknown part(s) {', '.join(unknown)}; choose from {', '.join(PARTS)}")
    return args


def main() -> None:
    args = parse_args()
    if args.summary:
        if not args.commit:
            raise SystemExit("--summary needs --commit: the commit the run measured")
        enter(args.summary, args.commit)
        return
    if args.report:
        report(args.report, args.name, args.commit)
        return
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for part in args.parts:
            started = time.perf_counter()
            print(f"=== {part}", flush=True)
            try:
                if part == "tests":
                    result = tests(args.out)
                elif part == "smoke":
                    result = smoke(Path(tmp))
                elif part == "ceilings":
                    result = ceilings()
                elif part == "raw":
                    result = raw(args.models, args.batches, args.compile_batches)
                    result["pipeline"] = pipeline_part(args.models)
                elif part == "decode":
                    result = decode()
                elif part == "hwdecode":
                    result = hardware()
                elif part == "engines":
                    result = engines(args.engine_seconds, out=args.out)
                elif part == "profile":
                    result = profile(args, Path(tmp))
                else:
                    result = served(args, Path(tmp))
            except Exception as e:  # a broken part must not cost the others their device time
                import traceback

                traceback.print_exc()
                result = {"error": repr(e)}
            result["seconds"] = time.perf_counter() - started
            save(args.out, part, result)
            print(f"=== {part} done in {result['seconds']:.0f} s", flush=True)


if __name__ == "__main__":
    main()
