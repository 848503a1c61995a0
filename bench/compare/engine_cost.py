"""What the engine process spends per image on the GPU path, without HTTP: its CPU time while front-ends'
requests reach it over ZeroMQ and shared memory, the device replaced by the stand-in.

    python -m bench.compare.engine_cost --trees . /tmp/before --repeats 3

With `--replay`, each front-end is replaced by a replayer: its requests' files are prepared and written into
its arena once, and each call, whose outputs have a region of their own, is sent again as soon as its answer is
back. A replayer
costs the driver a few µs per call, so the engine, not the driver, is the bound: this is the engine's cost
per image where front-ends outrun it, as on a GPU host with many cores (the busier the engine, the more
calls each go of its loop reads, and what it does per go is shared by more of them).

    python -m bench.compare.engine_cost --replay --images 1 --concurrency 256 --trees . /tmp/before

`python -m bench.stand_in` measures the whole service under `hey`, where the HTTP front-ends, the load
generator and the engine share this machine's two cores and a change of 10 % in the engine's CPU per image
hides in the noise. This keeps only the link: the engine process as `VIT_WORKERS > 1` starts it (the stand-in
timed as `--model`, batches up to 256, 5 ms wait) and, in one driver process, `--front-ends` front-end data
planes (`EngineClient`, each with its arena) sending `--concurrency` requests at a time of `--images` 500x375
JPEGs each, as the V2 route hands them over. The engine's CPU time (all its threads, ZeroMQ's I/O thread
included) over `--seconds`, per image computed, is the figure; the driver's is beside it.

Each tree (a checkout, `git worktree add /tmp/before REV`) runs in its own processes with its own code, the
trees alternating `--repeats` times; the driver, this file, speaks this tree's `app.workers` (the arena's steps,
the channel), so a tree from before a change to those is measured with the driver of its own commit. Each run also gives the engine's CPU per image by thread (the event loop,
the forward threads, ZeroMQ's).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.rounds import alternated
from harness.cpu import own_cpu_s, threads_cpu_s

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
    p.add_argument("--replay", action="store_true", help="replayers instead of front-end data planes (see above)")
    p.add_argument("--name", default="engine-cost-cpu")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--jpegs", type=Path, help=argparse.SUPPRESS)  # a worker's: the files its requests send
    p.add_argument("--engine", nargs=2, metavar=("ADDRESS", "CHECKPOINT"), help=argparse.SUPPRESS)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    if args.engine:
        import uvloop  # as the supervisor runs its children

        uvloop.run(serve_engine(args.engine[0], Path(args.engine[1]), args.model))
        return
    if args.worker:
        print(json.dumps(asyncio.run(drive(args))))
        return
    trees = [t.resolve() for t in args.trees]

    def run(tree: Path) -> dict[str, Any]:
        measured = worker(tree, args)
        print(tree, json.dumps(measured), flush=True)
        return measured

    runs = alternated(trees, args.repeats, run)
    from bench.common import write_results  # the parent only: a worker imports nothing of this tree
    from harness.records import commit

    report = {
        "cpu_count": os.cpu_count(),
        "model": args.model,
        "images_per_request": args.images,
        "front_ends": args.front_ends,
        "concurrency": args.concurrency,
        "seconds": args.seconds,
        "repeats": args.repeats,
        "replay": args.replay,
        "trees": {str(t): commit(t) for t in trees},
        "runs": runs,
    }
    write_results(args.name, report, markdown(report))


def worker(tree: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One run in `tree`'s code: this file run as a script there, so that `app` is that tree's. Every tree is sent
    the same JPEGs, made here."""
    from harness.images import photo_jpeg

    command = [sys.executable, __file__, "--worker", "--model", args.model, "--images", str(args.images)]
    command += ["--front-ends", str(args.front_ends), "--concurrency", str(args.concurrency)]
    command += ["--seconds", str(args.seconds)]
    if args.replay:
        command += ["--replay"]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    with tempfile.TemporaryDirectory() as jpegs:
        for i in range(args.images):
            (Path(jpegs) / f"{i}.jpg").write_bytes(photo_jpeg(i))
        command += ["--jpegs", jpegs]
        out = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True, check=True).stdout
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return result


async def serve_engine(address: str, checkpoint: Path, model: str) -> None:
    """The engine process as the supervisor starts it, over the stand-in, until SIGTERM."""
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
    await host.serve(stop)
    await engine.shutdown()
    host.close()


async def drive(args: argparse.Namespace) -> dict[str, Any]:
    """The engine process started, `--front-ends` data planes over it, loaded for `--seconds`."""
    from app.core.contract.inference import Inference, InferenceRequest
    from app.core.contract.request import InferOptions
    from app.settings import Settings
    from app.telemetry.metrics import Metrics
    from app.workers.arena import Arena
    from app.workers.engine_client import EngineClient
    from bench.gpu.serving import random_checkpoint

    with tempfile.TemporaryDirectory(dir="/dev/shm" if os.access("/dev/shm", os.W_OK) else None) as tmp:
        folder = Path(tmp)
        checkpoint = random_checkpoint(folder, args.model)
        address = f"ipc://{folder / 'engine.sock'}"
        command = [sys.executable, __file__, "--engine", address, str(checkpoint), "--model", args.model]
        engine = subprocess.Popen(command)
        if args.replay:
            try:
                return await replay(args, folder, address, engine)
            finally:
                engine.terminate()
                engine.wait(60)
        settings = Settings(weights=checkpoint, device="cpu", max_files=64)
        planes = []
        try:
            for i in range(args.front_ends):
                plane = EngineClient(settings, Metrics(), address, Arena.create(folder / f"arena{i}.shm", 64 << 20))
                await plane.start()
                planes.append(plane)
            for plane in planes:
                if not await plane.wait_engine(300):
                    raise RuntimeError("the engine did not start")
            files = jpeg_files(args.jpegs)
            request = InferenceRequest(plane.describe(None), files, InferOptions())
            count = Count()

            def counted(done: Inference) -> None:
                count.add(len(done.predictions))

            async def client(plane: EngineClient, until: asyncio.Event) -> None:
                while not until.is_set():
                    await plane.infer(request, counted)

            stop = asyncio.Event()
            clients = [asyncio.create_task(client(planes[c % len(planes)], stop)) for c in range(args.concurrency)]
            result = await measured(args, engine, count)
            stop.set()
            await asyncio.gather(*clients)
        finally:
            for plane in planes:
                await plane.shutdown()
            engine.terminate()
            engine.wait(60)
    return result


async def replay(
    args: argparse.Namespace, folder: Path, address: str, engine: subprocess.Popen[bytes]
) -> dict[str, Any]:
    """`--front-ends` replayers (see the module note) keeping `--concurrency` calls in flight on the engine."""
    import dataclasses
    import itertools

    import zmq

    from app.core.contract.request import DecodedImage, InferOptions
    from app.core.images.gpu_decode import Jpeg
    from app.core.images.prepare import ImagePreparer
    from app.settings import Settings
    from app.workers.arena import Arena, output_bytes, write_inputs
    from app.workers.link import Channel, Hello, InferCall, Reply, State
    from model.preprocessing import Preprocessing

    context = zmq.Context()
    ids = itertools.count()
    count = Count()
    failures = 0
    replayers: list[Replayer] = []

    class Replayer:
        def __init__(self, index: int) -> None:
            self.arena = Arena.create(folder / f"arena{index}.shm", 64 << 20)
            socket = context.socket(zmq.DEALER)
            socket.setsockopt(zmq.LINGER, 0)
            socket.connect(address)
            self.channel = Channel(socket, self.receive, "replayer")
            self.state: State | None = None
            self.calls: dict[int, InferCall] = {}
            self.outbox: list[InferCall] = []

        def receive(self, sender: bytes | None, message: object) -> None:
            nonlocal failures
            if isinstance(message, State):
                self.state = message
                return
            for reply in message if isinstance(message, list) else [message]:
                if not isinstance(reply, Reply) or (call := self.calls.pop(reply.id, None)) is None:
                    continue
                if reply.failure is not None:
                    failures += 1 if count.counting else 0
                elif reply.outputs is not None:
                    count.add(len(reply.outputs.filenames))
                self.post(dataclasses.replace(call, id=next(ids)))

        def post(self, call: InferCall) -> None:
            if not self.outbox:
                asyncio.get_running_loop().call_soon(self.flush)
            self.outbox.append(call)
            self.calls[call.id] = call

        def flush(self) -> None:
            calls, self.outbox = self.outbox, []
            self.channel.send(calls)  # those of one go as one message, as a front-end sends them

    try:
        for i in range(args.front_ends):
            replayers.append(Replayer(i))
        deadline = time.monotonic() + 300
        while any(r.state is None for r in replayers):
            if time.monotonic() > deadline:
                raise RuntimeError("the engine did not start")
            for r in replayers:
                if r.state is None:
                    r.channel.send(Hello(os.getpid(), r.arena.path))
            await asyncio.sleep(0.1)
        state = replayers[0].state
        assert state is not None
        model = state.models[0]
        options = InferOptions()
        limits = Settings.model_fields
        preprocessing = Preprocessing(**model.preprocessing)
        preparer = ImagePreparer(preprocessing, limits["max_image_pixels"].default, True, model.decode == "gpu")
        files = jpeg_files(args.jpegs)
        prepared = [preparer.prepare(f, False) for f in files]  # as a front-end prepares them for this version
        decoded = [
            DecodedImage(f.filename, f.data, model.version, None if isinstance(p.pixels, Jpeg) else p.pixels, 0.001)
            for f, p in zip(files, prepared, strict=True)
        ]
        # each replayer's files written once, where every call of it reads them; each call's outputs in a region
        # of its own (a front-end's call has one region for both: its files in, then its outputs over them)
        stored = {}
        for r in replayers:
            stored[r] = write_inputs(r.arena, decoded, model, options).images
            assert r.arena.in_use, "the arena is too small for the files"
        size = output_bytes(model, options, len(decoded))
        for c in range(args.concurrency):
            r = replayers[c % len(replayers)]
            offset = r.arena.allocate(size)
            assert offset is not None, "the arena is too small for this many calls"
            region = (offset, size)
            r.post(
                InferCall(
                    next(ids), state.incarnation, None, None, options, None, stored[r], None, region, model.version
                )
            )
        result = await measured(args, engine, count)
    finally:
        for r in replayers:
            r.channel.close()
            r.arena.unlink()
        context.term()
    if failures:
        raise RuntimeError(f"{failures} calls failed")
    return result


class Count:
    """Images answered, counted only while `counting`."""

    def __init__(self) -> None:
        self.counting = False
        self.images = 0

    def add(self, images: int) -> None:
        if self.counting:
            self.images += images


async def measured(args: argparse.Namespace, engine: subprocess.Popen[bytes], count: Count) -> dict[str, Any]:
    """After 2 s of warm-up, the engine's CPU (all of it, and by thread) and the driver's per image answered over
    `--seconds`, and the rate."""
    await asyncio.sleep(2.0)
    count.counting = True
    engine_cpu, driver_cpu, started = own_cpu_s(engine.pid), time.process_time(), time.monotonic()
    threads = threads_cpu_s(engine.pid)
    await asyncio.sleep(args.seconds)
    engine_cpu = own_cpu_s(engine.pid) - engine_cpu
    threads = {k: v - threads.get(k, 0.0) for k, v in threads_cpu_s(engine.pid).items()}
    driver_cpu, elapsed = time.process_time() - driver_cpu, time.monotonic() - started
    count.counting = False
    images = count.images
    return {
        "img_s": images / elapsed,
        "engine_us_per_image": engine_cpu / images * 1e6,
        "driver_us_per_image": driver_cpu / images * 1e6,
        "engine_threads_us_per_image": {k: v / images * 1e6 for k, v in sorted(threads.items()) if v > 0},
    }


def jpeg_files(folder: Path) -> list[Any]:
    """The JPEGs the parent wrote into `folder`, as the requests' files."""
    from app.core.contract.request import EncodedImage

    return [EncodedImage(p.name, p.read_bytes()) for p in sorted(folder.glob("*.jpg"))]


def markdown(report: dict[str, Any]) -> str:
    from harness.records import table

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
    return "\n".join(
        [
            f"# What the engine process spends per image over the link ({report['cpu_count']} cores)",
            "",
            f"`python -m bench.compare.engine_cost{' --replay' if report.get('replay') else ''}`: the engine over "
            f"the device stand-in ({report['model']}), {report['front_ends']} "
            f"{'replayers' if report.get('replay') else 'front-end data planes'} in one driver process, {report['concurrency']} requests "
            f"of {report['images_per_request']} JPEGs in flight, {report['seconds']:.0f} s per run, each tree run "
            f"{report['repeats']} times, alternating. CPU time of the engine process (all its threads) per image, "
            "and by thread (medians).",
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
