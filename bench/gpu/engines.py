"""The JPEG engines beside a forward: where their time goes, what they keep under each candidate fix, and
whether the cause is the SMs or a synchronisation.

Every measurement decodes batches of 256 500x375 JPEGs from one thread while another replays a CUDA-graphed
ViT-B/16 forward (bf16, batch 256), for `seconds`, and reports both rates and the share of its own rate the
forward kept. Sections of the part's JSON:

- `alone`: each decoder with the GPU to itself, and the forward alone;
- `trace`: a CUPTI trace (`torch.profiler`) of the engines (preallocated) alone and beside the forward, and of
  the defaults beside it, summarised per decoded batch by `harness.cuda_trace`: the host calls of every thread (nvImageCodec's own workers included),
  the ones that wait for the GPU, and each kernel's queueing behind the forward;
- `host`: per batch, the ms spent inside the decoder's call and waiting for its stream afterwards;
- `options`: nvImageCodec's options, beside the forward: buffers preallocated for the batch, one CUDA stream,
  one CPU thread, and together; the decoder's stream at the highest priority;
- `starvation`: the forward at half duty, and a spin kernel in the forward's place, beside the preallocated
  engines: SMs taken away, or a wait on the forward's work;
- `process`: the engines (preallocated) decoding in a process of their own beside this process's forward;
- `dali`: DALI 2.4's mixed decoder (VIT_DECODE=dali's), alone and beside the forward, with `hw_decoder_load` 1
  and 0.65, where DALI is installed;
- `green contexts`: the forward on a green context that leaves SMs free (torch.cuda.green_contexts), at several
  splits, in a process of its own and last: on the H200, after such forwards were freed, the process's CUDA
  context failed with an illegal memory access, and a failed context fails every later section.

A section that fails records its error and the others still run; each is written to `out/engines.json` as it
ends, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import json
import multiprocessing
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from app.core.images.gpu_decode import preallocated
from harness import cuda_trace as trace
from harness.images import photo_jpeg

BATCH = 256
IMAGES = 1024
Work = Callable[[threading.Event, list[int]], None]  # loops until the event is set, counting images in the list


class Forward:
    """A CUDA-graphed ViT-B/16 at batch 256 in bf16, replayed on a stream of its own; `sms` confines it to a green
    context of that many SMs."""

    def __init__(self, sms: int | None = None) -> None:
        from bench.gpu.common import VIT_B16
        from model.vit import ViT

        self.context = green_context(sms) if sms else None
        self.stream = self.context.Stream() if self.context is not None else torch.cuda.Stream()
        model = ViT(VIT_B16).cuda().to(torch.bfloat16).eval()
        x = torch.randn(BATCH, 3, 224, 224, device="cuda", dtype=torch.bfloat16)
        torch.cuda.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.inference_mode():
            with torch.cuda.stream(self.stream):  # warmed and captured on the stream it replays on
                for _ in range(3):
                    model(x)
            self.stream.synchronize()
            with torch.cuda.graph(self.graph, stream=self.stream):
                model(x)
        torch.cuda.synchronize()

    def loop(self, stop: threading.Event, count: list[int], duty: float = 1.0) -> None:
        """Replays back to back; at `duty` < 1 the GPU is left idle between replays for that share of the time."""
        with torch.cuda.stream(self.stream):
            while not stop.is_set():
                started = time.perf_counter()
                self.graph.replay()
                self.stream.synchronize()
                count[0] += BATCH
                if duty < 1:
                    time.sleep((time.perf_counter() - started) * (1 - duty) / duty)


def green_context(sms: int) -> Any:
    """A green context of `sms` SMs (torch.cuda.green_contexts, beta since PyTorch 2.10)."""
    from torch.cuda.green_contexts import GreenContext

    context = GreenContext.create(sms, torch.cuda.current_device())
    if not hasattr(context, "Stream"):
        raise RuntimeError(f"torch {torch.__version__}'s green contexts give no stream of their own")
    return context


class Spin:
    """A Triton kernel that keeps every SM busy with arithmetic for about `ms` a launch, touching no memory
    but its output: the forward's occupancy without its memory traffic or its kernel boundaries."""

    def __init__(self, ms: float = 25.0) -> None:
        from bench.gpu.spin import launch

        self.launch = launch
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        self.blocks = sms * 4
        self.out = torch.empty(self.blocks * 128, device="cuda")
        self.stream = torch.cuda.Stream()
        self.iterations = 1 << 16
        with torch.cuda.stream(self.stream):
            launch(self.out, self.blocks, self.iterations)  # compiled on first launch
            self.stream.synchronize()
            started = time.perf_counter()
            launch(self.out, self.blocks, self.iterations)
            self.stream.synchronize()
        took = (time.perf_counter() - started) * 1e3
        self.iterations = max(1, int(self.iterations * ms / took))

    def loop(self, stop: threading.Event, count: list[int]) -> None:
        with torch.cuda.stream(self.stream):
            while not stop.is_set():
                self.launch(self.out, self.blocks, self.iterations)
                self.stream.synchronize()
                count[0] += 1


def together(work: list[Work], seconds: float) -> list[float]:
    """Each loop on a thread of its own for `seconds`: each one's count per second."""
    stop, counts = threading.Event(), [[0] for _ in work]
    threads = [threading.Thread(target=w, args=(stop, c)) for w, c in zip(work, counts, strict=True)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - started
    return [c[0] / elapsed for c in counts]


class Decoding:
    """Batches of 256 through `decode(files, stream)` on a stream of its own, timing the host's call and the wait
    for the stream after it, and noting the decoding thread's native id (for the trace)."""

    def __init__(
        self, decode: Callable[[list[Any], torch.cuda.Stream], Any], files: list[Any], priority: int = 0
    ) -> None:
        self.decode = decode
        self.files = files
        self.priority = priority  # the stream's; torch maps one beyond the device's range to its end
        self.call_s = self.wait_s = 0.0
        self.batches = 0
        self.thread_id = 0

    def loop(self, stop: threading.Event, count: list[int]) -> None:
        self.thread_id = threading.get_native_id()
        stream = torch.cuda.Stream(priority=self.priority)
        i = 0
        while not stop.is_set():
            chunk = [self.files[(i + k) % len(self.files)] for k in range(BATCH)]
            started = time.perf_counter()
            self.decode(chunk, stream)
            called = time.perf_counter()
            stream.synchronize()
            self.call_s += called - started
            self.wait_s += time.perf_counter() - called
            self.batches += 1
            count[0] += BATCH
            i += BATCH

    def host_ms(self) -> dict[str, float]:
        n = max(self.batches, 1)
        return {"call_ms_per_batch": self.call_s * 1e3 / n, "wait_ms_per_batch": self.wait_s * 1e3 / n}


def nvimgcodec_decoder(options: str = "", threads: int = 0, backend: str = "hardware") -> Callable[..., Any]:
    from nvidia import nvimgcodec as nv

    kind = {"hardware": nv.BackendKind.HW_GPU_ONLY, "cuda": nv.BackendKind.HYBRID_CPU_GPU}[backend]
    decoder = nv.Decoder(device_id=0, max_num_cpu_threads=threads, backends=[nv.Backend(kind)], options=options)
    params = nv.DecodeParams(apply_exif_orientation=False, color_spec=nv.ColorSpec.SRGB)

    def decode(files: list[Any], stream: torch.cuda.Stream) -> Any:
        return decoder.decode(files, params=params, cuda_stream=stream.cuda_stream)

    return decode


def dali_decoder(load: float) -> Callable[..., Any]:
    from app.core.images.gpu_decode import DaliJpeg

    jpeg = DaliJpeg(torch.device("cuda", 0), load=load)

    def decode(files: list[Any], stream: torch.cuda.Stream) -> Any:
        with torch.cuda.stream(stream):
            return jpeg(files)

    return decode


PREALLOCATE = preallocated(BATCH)  # the service's (VIT_DECODE=nvimgcodec) options
HIGHEST = -100  # a stream priority torch maps to the device's highest
OPTIONS: dict[str, tuple[str, int, int]] = {  # name: (nvImageCodec options, CPU threads (0: one per core), priority)
    "defaults": ("", 0, 0),
    "preallocated": (PREALLOCATE, 0, 0),
    "one CUDA stream": (":num_cuda_streams=1", 0, 0),
    "one CPU thread": ("", 1, 0),
    "preallocated, one CUDA stream, one CPU thread": (f"{PREALLOCATE} :num_cuda_streams=1", 1, 0),
    "highest-priority stream": ("", 0, HIGHEST),
    "preallocated, highest-priority stream": (PREALLOCATE, 0, HIGHEST),
}


def engines(seconds: float = 2.0, trace_seconds: float = 1.0, out: Path | None = None) -> dict[str, Any]:
    from nvidia import nvimgcodec as nv

    began = time.perf_counter()
    jpegs = [photo_jpeg(i) for i in range(IMAGES)]
    streams = [nv.CodeStream(f) for f in jpegs]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    result: dict[str, Any] = {
        "image": "500x375 JPEG, quality 90, 4:2:0",
        "batch": BATCH,
        "seconds": seconds,
        "nvimgcodec": nv.__version__,
        "sms": sms,
    }
    forward = Forward()
    hardware = nvimgcodec_decoder()
    preallocated_engines = nvimgcodec_decoder(PREALLOCATE)

    def section(name: str, run: Callable[[], Any]) -> None:
        started = time.perf_counter()
        try:
            result[name] = run()
        except Exception as e:  # a section this machine cannot run: say why, keep the others
            result[name] = {"error": repr(e)}
        if out is not None:  # what a run cut short has measured so far
            (out / "engines.json").write_text(json.dumps(result, indent=2))
        took, since = time.perf_counter() - started, time.perf_counter() - began
        print(f"engines: {name} ({took:.0f} s; {since:.0f} s in):", json.dumps(result[name])[:2000], flush=True)

    def beside(decode: Callable[..., Any], files: list[Any], work: Work | None = None, priority: int = 0) -> dict:
        together([Decoding(decode, files, priority).loop], 0.3)  # a new decoder's first batches set it up (H200: 2 s)
        decoding = Decoding(decode, files, priority)
        other, rate = together([work or forward.loop, decoding.loop], seconds)
        return {"forward_img_per_s": other, "decode_img_per_s": rate, **decoding.host_ms()}

    def alone() -> dict[str, Any]:
        rows: dict[str, Any] = {"forward_img_per_s": together([forward.loop], seconds)[0]}
        decoders = {
            "hardware": hardware,
            "hardware, preallocated": preallocated_engines,
            "cuda": nvimgcodec_decoder(backend="cuda"),
        }
        for name, decode in decoders.items():
            together([Decoding(decode, streams).loop], 0.3)  # its first batches set it up
            decoding = Decoding(decode, streams)
            rows[name] = {"decode_img_per_s": together([decoding.loop], seconds)[0], **decoding.host_ms()}
        return rows

    section("alone", alone)
    forward_alone = result["alone"].get("forward_img_per_s") if "error" not in result["alone"] else None

    def kept(row: dict[str, Any]) -> dict[str, Any]:
        if forward_alone and "forward_img_per_s" in row:
            row["forward_kept"] = row["forward_img_per_s"] / forward_alone
        return row

    traces = {  # a batch beside the forward takes about a quarter of a second (H200): several in each trace
        "alone": (preallocated_engines, False, trace_seconds),
        "beside the forward": (preallocated_engines, True, trace_seconds),
        "beside the forward, defaults": (hardware, True, trace_seconds),
    }
    section("trace", lambda: traced(traces, streams, forward))
    section(
        "options",
        lambda: {n: kept(beside(nvimgcodec_decoder(o, t), streams, priority=p)) for n, (o, t, p) in OPTIONS.items()},
    )

    def starvation() -> dict[str, Any]:
        rows = {
            "forward at half duty": kept(
                beside(preallocated_engines, streams, lambda s, c: forward.loop(s, c, duty=0.5))
            )
        }
        try:
            spin = Spin()
            row = beside(preallocated_engines, streams, spin.loop)
            rows["a spin kernel on every SM instead of the forward"] = {
                "spins_per_s": row.pop("forward_img_per_s"),
                **row,
            }
        except Exception as e:
            rows["a spin kernel on every SM instead of the forward"] = {"error": repr(e)}
        return rows

    section("starvation", starvation)
    section("process", lambda: kept(own_process(forward, seconds)))

    def dali() -> dict[str, Any]:
        rows: dict[str, Any] = {}
        import nvidia.dali as dali_package

        rows["version"] = dali_package.__version__
        for load in (1.0, 0.65):
            decode = dali_decoder(load)
            decoding = Decoding(decode, jpegs)
            together([decoding.loop], 0.5)  # DALI's pools grow on the first batches
            decoding = Decoding(decode, jpegs)
            rows[f"hw_decoder_load={load:g}"] = {
                "alone_img_per_s": together([decoding.loop], seconds)[0],
                "alone": decoding.host_ms(),
                "beside_forward": kept(beside(decode, jpegs)),
            }
        return rows

    section("dali", dali)
    section("green contexts", lambda: in_own_process(confined, (seconds, (8, 16, 32, 48, sms // 2)), timeout=300))
    return result


def in_own_process(target: Callable[..., None], args: tuple[Any, ...], timeout: float) -> dict[str, Any]:
    """`target(*args, path)` in a spawned process that writes its rows to `path` as JSON; what it wrote by the end
    (killed after `timeout` s), and a row saying how the process ended where it did not end well."""
    context = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "rows.json"
        child = context.Process(target=target, args=(*args, str(path)))
        child.start()
        child.join(timeout)
        if child.is_alive():
            child.kill()
            child.join()
        rows: dict[str, Any] = json.loads(path.read_text()) if path.is_file() else {}
    if child.exitcode != 0:
        rows["the process"] = {
            "error": f"ended with exit code {child.exitcode} (killed after {timeout:.0f} s if negative)"
        }
    return rows


def confined(seconds: float, frees: tuple[int, ...], path: str) -> None:
    """In a process of its own: the forward on a green context that leaves each of `frees` SMs to the engines
    (preallocated), beside them and alone, each row written to `path` as it ends. The green contexts' forwards stay
    alive until the process ends, which it does without tearing CUDA down (os._exit)."""
    import os

    from nvidia import nvimgcodec as nv

    streams = [nv.CodeStream(photo_jpeg(i)) for i in range(IMAGES)]
    decode = nvimgcodec_decoder(PREALLOCATE)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows: dict[str, Any] = {}
    forward_alone = together([Forward().loop], seconds)[0]
    forwards = []
    for free in frees:
        name = f"forward on {sms - free} of {sms} SMs"
        try:
            forwards.append(forward := Forward(sms - free))
            decoding = Decoding(decode, streams)
            rate, decoded = together([forward.loop, decoding.loop], seconds)
            rows[name] = {
                "forward_img_per_s": rate,
                "decode_img_per_s": decoded,
                **decoding.host_ms(),
                "forward_alone_img_per_s": together([forward.loop], seconds)[0],
                "forward_kept": rate / forward_alone,
            }
        except Exception as e:
            rows[name] = {"error": repr(e)}
        Path(path).write_text(json.dumps(rows))
    os._exit(0)


def traced(
    cases: dict[str, tuple[Callable[..., Any], bool, float]], files: list[Any], forward: Forward
) -> dict[str, Any]:
    """CUPTI traces of the engines decoding, each case (decoder, beside the forward or alone, seconds) summarised per
    decoded batch."""
    from torch.profiler import ProfilerActivity, profile

    out: dict[str, Any] = {}
    forward_thread: dict[str, int] = {}

    def forward_loop(stop: threading.Event, count: list[int]) -> None:
        forward_thread["id"] = threading.get_native_id()
        forward.loop(stop, count)

    for name, (decode, with_forward, seconds) in cases.items():
        work: list[Work] = [forward_loop] if with_forward else []
        decoding = Decoding(decode, files)
        together([*work, decoding.loop], 0.3)  # warm: the first batches set buffers up
        decoding = Decoding(decode, files)
        with tempfile.TemporaryDirectory() as tmp:
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                rates = together([*work, decoding.loop], seconds)
            path = Path(tmp) / "trace.json"
            prof.export_chrome_trace(str(path))
            roles = {decoding.thread_id: "decoder's caller"}
            if "id" in forward_thread:
                roles[forward_thread["id"]] = "forward"
            summary = trace.summarize(trace.load(path), roles, per=max(decoding.batches, 1))
        threads = {f"thread {tid}": role for tid, role in roles.items()}  # if the trace's ids are not native ones
        out[name] = {"decode_img_per_s": rates[-1], **decoding.host_ms(), "threads": threads, "per_batch": summary}
    return out


def decode_in_child(seconds: float, started: Any, rate: Any) -> None:
    """In a process of its own: the engines (preallocated) decoding batches of 256 for `seconds`; its rate into
    `rate`."""
    from nvidia import nvimgcodec as nv

    streams = [nv.CodeStream(photo_jpeg(i)) for i in range(IMAGES)]
    decoding = Decoding(nvimgcodec_decoder(PREALLOCATE), streams)
    together([decoding.loop], 0.3)
    started.set()
    rate.value = together([decoding.loop], seconds)[0]


def own_process(forward: Forward, seconds: float) -> dict[str, float]:
    """The engines in a spawned process (a CUDA context of its own, time-sliced with this one's) beside this
    process's forward."""
    context = multiprocessing.get_context("spawn")
    started, rate = context.Event(), context.Value("d", 0.0)
    child = context.Process(target=decode_in_child, args=(seconds, started, rate))
    child.start()
    if not started.wait(120):
        child.kill()
        raise RuntimeError("the decoding process did not start in 120 s")
    forward_rate = together([forward.loop], seconds)[0]
    child.join(60)
    return {"forward_img_per_s": forward_rate, "decode_img_per_s": rate.value}
