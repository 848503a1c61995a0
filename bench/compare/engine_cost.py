"""What the engine process spends per image on the GPU path, without HTTP: its CPU time while front-ends'
requests reach it over ZeroMQ and shared memory, the device replaced by the stand-in.

    python -m bench.compare.engine_cost --trees . /tmp/before --repeats 3
    python -m bench.compare.engine_cost --profile /tmp/engine.pstats

`python -m bench.stand_in` measures the whole service under `hey`, where the HTTP front-ends, the load
generator and the engine share this machine's two cores and a change of 10 % in the engine's CPU per image
hides in the noise. This keeps only the link: the engine process as `VIT_WORKERS > 1` starts it (the stand-in
timed as `--model`, batches up to 256, 5 ms wait) and, in one driver process, `--front-ends` front-end data
planes (`RemoteEngine`, each with its arena) sending `--concurrency` requests at a time of `--images` 500x375
JPEGs each, as the V2 route hands them over. The engine's CPU time (all its threads, ZeroMQ's I/O thread
included) over `--seconds`, per image computed, is the figure; the driver's is beside it.

Each tree (a checkout, `git worktree add /tmp/before REV`) runs in its own processes with its own code, the
trees alternating `--repeats` times. Each run also gives the engine's CPU per image by thread (the event loop,
the forward threads, ZeroMQ's). `--profile PATH` runs the engine's event loop under cProfile, timing its
CPU rather than its waits (the profiler's own cost inflates the figures), and prints where that goes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

MAX_BATCH_SIZE = 256


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.compare.engine_cost", description=__doc__.split("\n\n")[0])
    p.add_argument("--trees", type=Path, nargs="+", default=[Path(".")], help="checkouts to compare")
    p.add_argument("--repeats", type=int, default=3, help="runs of each tree, alternating")
    p.add_argument("--model", choices=["vit-s16", "vit-b16"], default="vit-b16")
    p.add_argument("--images", type=int, default=8, help="JPEGs per request (8: the V2 route's benchmark)")
    p.add_argument("--front-ends", type=int, default=4)
    p.add_argument("--concurrency", type=int, default=16, help="requests in flight, over all front-ends")
    p.add_argument("--seconds", type=float, default=8.0, help="measured, after 2 s of warm-up")
    p.add_argument("--profile", type=Path, help="run the engine under cProfile; its stats go here")
    p.add_argument("--name", default="engine-cost-cpu")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--engine", nargs=2, metavar=("ADDRESS", "CHECKPOINT"), help=argparse.SUPPRESS)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    if args.engine:
        import uvloop  # as the supervisor runs its children

        uvloop.run(serve_engine(args.engine[0], Path(args.engine[1]), args.model, args.profile))
        return
    if args.worker:
        print(json.dumps(asyncio.run(drive(args))))
        return
    trees = [t.resolve() for t in args.trees]
    runs: dict[str, list[dict[str, Any]]] = {str(t): [] for t in trees}
    for repeat in range(args.repeats):
        for tree in trees if repeat % 2 == 0 else trees[::-1]:
            run = worker(tree, args)
            runs[str(tree)].append(run)
            print(tree, json.dumps(run), flush=True)
    if args.profile:
        print_profile(args.profile)
    from bench.common import commit, write_results  # the parent only: a worker imports nothing of this tree

    report = {
        "cpu_count": os.cpu_count(),
        "model": args.model,
        "images_per_request": args.images,
        "front_ends": args.front_ends,
        "concurrency": args.concurrency,
        "seconds": args.seconds,
        "repeats": args.repeats,
        "profiled": bool(args.profile),
        "trees": {str(t): commit(t) for t in trees},
        "runs": runs,
    }
    write_results(args.name, report, markdown(report))


def worker(tree: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One run in `tree`'s code: this file run as a script there, so that `app` is that tree's."""
    command = [sys.executable, __file__, "--worker", "--model", args.model, "--images", str(args.images)]
    command += ["--front-ends", str(args.front_ends), "--concurrency", str(args.concurrency)]
    command += ["--seconds", str(args.seconds)]
    if args.profile:
        command += ["--profile", str(args.profile)]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True, check=True).stdout
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return result


def own_cpu_s(pid: int) -> float:
    """User + system CPU seconds of one process (all its threads)."""
    return cpu_s(Path(f"/proc/{pid}/stat"))


def cpu_s(stat: Path) -> float:
    fields = stat.read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def threads_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds of each kind of thread of a process, by name with its number dropped ("forward_1": "forward")."""
    kinds: dict[str, float] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
            seconds = cpu_s(task / "stat")
        except OSError:  # ended meanwhile
            continue
        kind = (
            "event loop"
            if task.name == str(pid)
            else "other Python threads"
            if name == "python"
            else re.sub(r"/\d+$", "", name)
        )
        kinds[kind] = kinds.get(kind, 0.0) + seconds
    return kinds


async def serve_engine(address: str, checkpoint: Path, model: str, profile: Path | None) -> None:
    """The engine process as the supervisor starts it, over the stand-in, until SIGTERM."""
    import cProfile

    from app.core.engine.engine import Engine
    from app.settings import Settings
    from app.workers.engine_host import EngineHost
    from harness.stand_in import install

    install(model, MAX_BATCH_SIZE)
    settings = Settings(
        weights=checkpoint,
        device="cpu",
        backend="torch",
        warmup=False,
        max_batch_size=MAX_BATCH_SIZE,
        max_wait_ms=5,
        max_queue=8192,
        max_files=64,
    )
    engine = await asyncio.to_thread(Engine.load, settings)
    engine.start(freeze_heap=True)
    host = EngineHost(engine, address)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    profiler = cProfile.Profile(time.thread_time) if profile else None  # the event loop's CPU, not its waits
    if profiler is not None:
        asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, profiler.enable)
    await host.serve(stop)
    if profiler is not None and profile is not None:
        profiler.disable()
        profiler.dump_stats(profile)
    await engine.shutdown()
    host.close()


async def drive(args: argparse.Namespace) -> dict[str, Any]:
    """The engine process started, `--front-ends` data planes over it, loaded for `--seconds`."""
    from app.core.contract.data_plane import Inference, InferenceRequest
    from app.core.contract.request import EncodedImage, InferOptions
    from app.settings import Settings
    from app.telemetry.metrics import Metrics
    from app.workers.remote import RemoteEngine
    from app.workers.shared_memory import Arena
    from bench.gpu.serving import random_checkpoint
    from harness.images import photo_jpeg

    with tempfile.TemporaryDirectory(dir="/dev/shm" if os.access("/dev/shm", os.W_OK) else None) as tmp:
        folder = Path(tmp)
        checkpoint = random_checkpoint(folder, args.model)
        address = f"ipc://{folder / 'engine.sock'}"
        command = [sys.executable, __file__, "--engine", address, str(checkpoint), "--model", args.model]
        if args.profile:
            command += ["--profile", str(args.profile)]
        engine = subprocess.Popen(command)
        settings = Settings(weights=checkpoint, device="cpu", max_files=64)
        planes = []
        try:
            for i in range(args.front_ends):
                plane = RemoteEngine(settings, Metrics(), address, Arena.create(folder / f"arena{i}.shm", 64 << 20))
                await plane.start()
                planes.append(plane)
            for plane in planes:
                if not await plane.wait_engine(300):
                    raise RuntimeError("the engine did not start")
            files = [EncodedImage(f"{i}.jpg", photo_jpeg(i)) for i in range(args.images)]
            request = InferenceRequest(None, files, InferOptions())
            images = 0
            counting = False

            def counted(done: Inference) -> None:
                nonlocal images
                if counting:
                    images += len(done.predictions)

            async def client(plane: RemoteEngine, until: asyncio.Event) -> None:
                while not until.is_set():
                    await plane.infer(request, counted)

            stop = asyncio.Event()
            clients = [asyncio.create_task(client(planes[c % len(planes)], stop)) for c in range(args.concurrency)]
            await asyncio.sleep(2.0)
            if args.profile:
                engine.send_signal(signal.SIGUSR1)
            counting = True
            engine_cpu, driver_cpu, started = own_cpu_s(engine.pid), time.process_time(), time.monotonic()
            threads = threads_cpu_s(engine.pid)
            await asyncio.sleep(args.seconds)
            engine_cpu = own_cpu_s(engine.pid) - engine_cpu
            threads = {k: v - threads.get(k, 0.0) for k, v in threads_cpu_s(engine.pid).items()}
            driver_cpu, elapsed = time.process_time() - driver_cpu, time.monotonic() - started
            counting = False
            stop.set()
            await asyncio.gather(*clients)
        finally:
            for plane in planes:
                await plane.shutdown()
            engine.terminate()
            engine.wait(60)
    return {
        "img_s": images / elapsed,
        "engine_us_per_image": engine_cpu / images * 1e6,
        "driver_us_per_image": driver_cpu / images * 1e6,
        "engine_threads_us_per_image": {k: v / images * 1e6 for k, v in sorted(threads.items()) if v > 0},
    }


def print_profile(path: Path, top: int = 30) -> None:
    import pstats

    stats = pstats.Stats(str(path))
    stats.sort_stats("tottime").print_stats(top)


def markdown(report: dict[str, Any]) -> str:
    from bench.common import table

    kinds = ["event loop", "other Python threads", "ZMQbg/IO"]
    rows = []
    for tree, runs in report["runs"].items():
        engine = [r["engine_us_per_image"] for r in runs]
        threads = [statistics.median(r["engine_threads_us_per_image"].get(k, 0.0) for r in runs) for k in kinds]
        rows.append(
            [
                report["trees"][tree],
                f"{min(engine):.1f}",
                f"{statistics.median(engine):.1f}",
                *(f"{t:.1f}" for t in threads),
                f"{statistics.median(r['driver_us_per_image'] for r in runs):.1f}",
                f"{statistics.median(r['img_s'] for r in runs):.0f}",
            ]
        )
    profiled = " Under cProfile: the figures include its cost." if report["profiled"] else ""
    return "\n".join(
        [
            f"# What the engine process spends per image over the link ({report['cpu_count']} cores)",
            "",
            f"`python -m bench.compare.engine_cost`: the engine over the device stand-in ({report['model']}), "
            f"{report['front_ends']} front-end data planes in one driver process, {report['concurrency']} requests "
            f"of {report['images_per_request']} JPEGs in flight, {report['seconds']:.0f} s per run, each tree run "
            f"{report['repeats']} times, alternating. CPU time of the engine process (all its threads) per image, "
            "and by thread (medians)." + profiled,
            "",
            *table(
                [
                    *("tree", "engine best, µs/img", "engine median, µs/img", "of which: event loop"),
                    *("forward and other threads", "ZeroMQ's I/O thread", "driver median, µs/img", "img/s"),
                ],
                rows,
            ),
            "",
        ]
    )


if __name__ == "__main__":
    main()
