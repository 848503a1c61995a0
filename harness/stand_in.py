"""A device stand-in: the GPU's part of the serving path replaced by waits of the durations an H200 measured.

For benchmarks and tests only. `install("vit-b16")` makes every model the service loads in this process a
`StandInPredictor`: it takes plain JPEGs encoded, as the predictor does that decodes them on the GPU (so only
their headers are checked, from their markers or by PIL on the CPU pool, and serving front-ends send the bytes
on), and each batch "decodes" them and runs the "forward" as `time.sleep`s, which hold no GIL and use no CPU.
The decoder and the compute each take one batch at a time, and a batch's decoding waits while another batch
computes: with the batcher's two batches in flight, one is decoded as soon as the other's forward ends. The
waits last:

- decoding: nvJPEG's rate with the resize on the GPU (what the service does to each JPEG there), in batches
  of 64, as the H200 run that served the service measured it (docs/performance.md, the device stand-in; a
  later run's figure is in bench/results/gpu-h200.md). The CUDA decoder
  shares the SMs with the forward, so the two run one after the other: that projects the service's own run on
  that device best (docs/performance.md, the stand-in against the GPU run);
- the forward: the compiled + CUDA-graph time per batch size, the batch padded to the captured size as the
  service's CUDA graphs pad it, times between measured sizes interpolated. The H200 run timed batch 256: the
  curve over batch sizes is the H100's (bench/results/gpu-h100.md), scaled to the H200's figure at 256.

It returns outputs of the model's shapes (probabilities over its classes, the embedding, a map's grid).
Everything else is the real code: HTTP, gRPC, codecs, multipart, the engine, the batcher, shared memory,
ZeroMQ, statistics, metrics. What the real GPU path also costs the CPU (kernel launches, the copy back,
nvJPEG's own host work) is not in it: the calibration in docs/performance.md says how far that goes.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import fcntl
import json
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from app.choices import DecodedOn, Precision
from app.core.backends.predictor import ImageInput, ImageOutput, graph_sizes
from app.core.images.gpu_decode import Jpeg
from app.telemetry.statistics import BatchTiming
from harness.server import ROOT, ServerProcess, free_port
from model.checkpoint import Checkpoint

NVJPEG_IMAGES_PER_S = 13_921.0  # decode and resize on the GPU, batches of 64, 500x375 JPEGs (docs/performance.md)


def engines_beside_forward(
    summary: Path = Path(__file__).resolve().parents[1] / "bench/results/gpu-summary.json",
) -> float:
    """The H200's hardware JPEG engines' measured rate beside a CUDA-graphed ViT-B/16 forward: the latest H200 run
    in bench/results/gpu-summary.json that measured it."""
    records = json.loads(summary.read_text())
    rates = [
        r["jpeg_engines"]["beside_forward_img_per_s"]
        for r in records
        if r["device"] == "NVIDIA H200" and r["jpeg_engines"]["beside_forward_img_per_s"]
    ]
    if not rates:
        raise RuntimeError(f"{summary} holds no H200 run that measured the JPEG engines beside a forward")
    return float(rates[-1])


HARDWARE_DECODE_IMAGES_PER_S = engines_beside_forward()
SLICE_S = 0.002  # how often a decode wait looks at whether the compute is busy
# Images per second of the compiled + CUDA-graph bf16 forward by batch size: the H100's curve
# (bench/results/gpu-h100.md), scaled to the H200's at batch 256 (bench/results/gpu-h200.md).
H100_FORWARD_IMAGES_PER_S: dict[str, dict[int, float]] = {
    "vit-s16": {1: 2186, 8: 12575, 32: 22159, 128: 24624, 256: 25158, 512: 25527},
    "vit-b16": {1: 1497, 8: 7391, 32: 9746, 128: 10355, 256: 10313, 512: 10565},
}
H200_FORWARD_256 = {"vit-s16": 28_284.0, "vit-b16": 11_199.0}
FORWARD_IMAGES_PER_S: dict[str, dict[int, float]] = {
    model: {n: rate * H200_FORWARD_256[model] / curve[256] for n, rate in curve.items()}
    for model, curve in H100_FORWARD_IMAGES_PER_S.items()
}
RAW_IMAGES_PER_S = {"vit-s16": 28_284.0, "vit-b16": 11_316.0}  # the H200's best raw forward of each, any variant


@dataclass(frozen=True)
class DeviceTimes:
    """How long the H200 takes for a batch: decoding `n` JPEGs, and the forward of `n` images; another device's
    rates where given (its forward's img/s by batch size, its CUDA decoder's and its JPEG engines' img/s)."""

    model: str
    max_batch_size: int
    forward_img_s: dict[int, float] | None = None
    decode_img_s: float = NVJPEG_IMAGES_PER_S
    hardware_img_s: float = HARDWARE_DECODE_IMAGES_PER_S
    slower: float = 1.0  # every duration this many times longer (`install`'s `slower`)

    def decode_s(self, n: int) -> float:
        return self.slower * n / self.decode_img_s

    def forward_s(self, n: int) -> float:
        """The forward of the captured size `n` is padded to (the service replays CUDA graphs)."""
        sizes = graph_sizes(self.max_batch_size)
        padded = sizes[bisect.bisect_left(sizes, n)] if n <= sizes[-1] else n
        return self.slower * batch_seconds(self.forward_img_s or FORWARD_IMAGES_PER_S[self.model], padded)

    def images_per_s(self, decoder: str = "cuda", cpu_share: float = 0.0) -> float:
        """The device's rate at the largest batch, with two batches in flight (as the predictor keeps them): what it
        could serve if the CPU side never kept it waiting.

        `cuda`: the CUDA decoder, one batch's decoding after another's forward (they share the SMs). `hardware`:
        the JPEG engines beside the SMs at the rate they kept beside a forward (HARDWARE_DECODE_IMAGES_PER_S, the
        H200's, from bench/results/gpu-summary.json). `cpu_share`: the share of the JPEGs decoded on the host's
        CPUs instead (VIT_CPU_DECODE_SHARE), which the device does not decode."""
        n = self.max_batch_size
        forward = self.forward_s(n)
        on_device = n * (1.0 - cpu_share)
        if decoder == "hardware":
            return n / max(forward, self.slower * on_device / self.hardware_img_s)
        return n / (forward + self.decode_s(on_device))


def batch_seconds(rates: dict[int, float], n: int) -> float:
    """Seconds for a batch of `n`: measured, or linear between the measured sizes around it (beyond the
    largest, at its rate)."""
    sizes = sorted(rates)
    if n in rates:
        return n / rates[n]
    if n > sizes[-1]:
        return n / rates[sizes[-1]]
    hi = bisect.bisect_left(sizes, n)
    lo_n, hi_n = sizes[hi - 1], sizes[hi]
    lo_s, hi_s = lo_n / rates[lo_n], hi_n / rates[hi_n]
    return lo_s + (hi_s - lo_s) * (n - lo_n) / (hi_n - lo_n)


class Device:
    """The GPU as waits: a JPEG decoder and the compute, each one batch at a time. With `shared` (a folder),
    every process that makes a `Device` over the same folder shares the one GPU, as processes that share a
    real one take turns on it (file locks: waiting for one uses no CPU either). With `switch` (a file), the
    model it names there (vit-s16 or vit-b16), once written, times the batches from then on: a forward that
    gets faster while the service runs."""

    def __init__(self, times: DeviceTimes, shared: Path | None = None, switch: Path | None = None) -> None:
        self._times = times
        self.switch = switch
        self.decoder = Resource(shared / "decoder.lock" if shared else None)
        self.compute = Resource(shared / "compute.lock" if shared else None)

    @property
    def times(self) -> DeviceTimes:
        """The timings of the model the switch file names now (read at each batch), else those it was made with."""
        if self.switch is not None:
            with contextlib.suppress(OSError):
                named = self.switch.read_text().strip()
                if named in FORWARD_IMAGES_PER_S and named != self._times.model:
                    self._times = dataclasses.replace(self._times, model=named)
        return self._times

    def close(self) -> None:
        """Let go of the lock files (a process's Device otherwise holds them for its life)."""
        self.decoder.close()
        self.compute.close()

    def decode(self, n: int) -> None:
        """Wait out the decoding of `n` JPEGs at the decoder's rate, only while the compute is idle (looked at
        every SLICE_S): the CUDA decoder and the forward share the SMs."""
        if not n:
            return
        with self.decoder:
            left = self.times.decode_s(n)  # seconds of decoding
            while left > 0:
                if self.compute.busy():
                    time.sleep(SLICE_S)
                    continue
                step = min(SLICE_S, left)
                time.sleep(step)
                left -= step

    def forward(self, n: int) -> None:
        with self.compute:
            time.sleep(self.times.forward_s(n))


class Resource:
    """One part of the device, used by one batch at a time: by this process's threads, and with `path` by
    every process that locks the same file."""

    def __init__(self, path: Path | None) -> None:
        self.threads = threading.Lock()
        self.file = open(path, "a+b") if path is not None else None  # noqa: SIM115 (held for the process's life)
        # a second open of the file: its shared lock is refused while any process holds the exclusive one
        self.probe = open(path, "a+b") if path is not None else None  # noqa: SIM115

    def close(self) -> None:
        for f in (self.file, self.probe):
            if f is not None:
                f.close()

    def busy(self) -> bool:
        """Whether a batch holds it now, in this process or (with a path) any other."""
        if self.probe is None:
            return self.threads.locked()
        try:
            fcntl.flock(self.probe, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(self.probe, fcntl.LOCK_UN)
        return False

    def __enter__(self) -> None:
        self.threads.acquire()
        if self.file is not None:
            fcntl.flock(self.file, fcntl.LOCK_EX)

    def __exit__(self, *exc: object) -> None:
        if self.file is not None:
            fcntl.flock(self.file, fcntl.LOCK_UN)
        self.threads.release()


class StandInPredictor:
    """What `app.core.backends.predictor.Predictor` is on a GPU that decodes JPEGs, with the device's work
    replaced by `Device`'s waits. Its outputs are of the model's shapes; their values mean nothing."""

    def __init__(self, checkpoint: Checkpoint, device: Device) -> None:
        config = checkpoint.config
        self.stand_in = device
        self.device = torch.device("cuda")  # what the service reports, as it would on the GPU
        self.dtype = torch.bfloat16
        self.backend = "torch"
        self.quantization = None
        self.input_shape = (config.in_channels, config.image_size, config.image_size)
        self.embedding_dim = config.dim
        self.jpeg_decoder = device  # not None: plain JPEGs reach the batch encoded
        batch = device.times.max_batch_size
        # what the device would hand back for a full batch: one softmax row, one embedding, one map per image
        self.probabilities = torch.full((batch, len(checkpoint.classes)), 1.0 / len(checkpoint.classes))
        self.embeddings = torch.zeros(batch, config.dim)
        self.map = torch.zeros(config.grid_size, config.grid_size)

    @property
    def decode(self) -> DecodedOn:
        return "gpu"

    @property
    def precision(self) -> Precision:
        return "bfloat16"

    def __call__(self, batch: list[ImageInput]) -> list[ImageOutput]:
        started = time.monotonic()
        self.stand_in.decode(sum(isinstance(item.pixels, Jpeg) for item in batch))
        inputs_done = time.monotonic()
        n = len(batch)
        self.stand_in.forward(n)
        probabilities = self.probabilities[:n].clone()  # the copy back to the host
        embeddings = self.embeddings[:n].clone()
        inferred = time.monotonic()
        rows, vectors = probabilities.unbind(), embeddings.unbind()
        parts = [
            (rows[j], None if item.attention == "none" else self.map, vectors[j] if item.embedding else None)
            for j, item in enumerate(batch)
        ]
        done = time.monotonic()
        timing = BatchTiming(n, started, inputs_done - started, inferred - inputs_done, done - inferred)
        return [ImageOutput(row, m, embedding, timing) for row, m, embedding in parts]

    def warm_up(self, max_batch_size: int) -> float:
        return 0.0


def install(
    model: str, max_batch_size: int, slower: float = 1.0, switch: Path | None = None, load_s: float = 0.0
) -> None:
    """Every model this process loads from now on is served by a `StandInPredictor` timed as `model` with
    CUDA graphs captured up to `max_batch_size` (VIT_MAX_BATCH_SIZE); `slower` times as long (a device whose
    balance with this machine's few cores is the H200's with its host's many); `switch`: see `Device`; each
    model's load `load_s` longer (a hub model's download, a large checkpoint read from a slow disk)."""
    if model not in FORWARD_IMAGES_PER_S:
        raise ValueError(f"no device timings for {model!r}; there are: {', '.join(FORWARD_IMAGES_PER_S)}")
    if not slower >= 1.0:
        raise ValueError(f"the stand-in can be slower than the H200, not faster: got {slower}")
    from app.core.engine.served_model import ServedModel

    def build_predictor(name: str, checkpoint: Checkpoint, *args: object, **kwargs: object) -> StandInPredictor:
        time.sleep(load_s)
        return StandInPredictor(checkpoint, Device(DeviceTimes(model, max_batch_size, slower=slower), switch=switch))

    ServedModel.build_predictor = staticmethod(build_predictor)  # type: ignore[method-assign, assignment]


def stand_in_server(
    checkpoint: Path,
    model: str,
    slower: float = 1.0,
    switch: Path | None = None,
    cwd: Path | None = None,
    load_s: float = 0.0,
    uvicorn: bool = False,
    **env: str,
) -> ServerProcess:
    """`python -m harness.stand_in_app` serving `checkpoint` (under its stem) over the stand-in timed as `model`,
    `slower` times as long, its load `load_s` longer, on a free port, with the settings of the GPU benchmark's
    served sweep (batches of up to 256 within 5 ms, room for 8,192 images) and `env` over them; started, not yet
    waited for (`with` waits). With `uvicorn`, `uvicorn harness.stand_in_app:app` serves it (as `uvicorn app.main:app`
    serves the service)."""
    port = free_port()
    settings = {
        "STAND_IN_MODEL": model,
        "STAND_IN_SLOWER": str(slower),
        "STAND_IN_SWITCH": str(switch or ""),
        "STAND_IN_LOAD_S": str(load_s),
        "VIT_WEIGHTS": str(checkpoint),
        "VIT_DEVICE": "cpu",
        "VIT_BACKEND": "torch",
        "VIT_MAX_BATCH_SIZE": "256",
        "VIT_MAX_WAIT_MS": "5",
        "VIT_MAX_QUEUE": "8192",
        "VIT_MAX_FILES": "64",
        "VIT_LOG_LEVEL": "warning",
        "VIT_GRPC_PORT": "0",
        **env,
    }
    argv = [sys.executable, "-m", "harness.stand_in_app", "--host", "127.0.0.1", "--port", str(port)]
    if uvicorn:
        argv = [sys.executable, "-m", "uvicorn", "harness.stand_in_app:app", "--host", "127.0.0.1", "--port", str(port)]
    return ServerProcess(argv, settings, port, cwd=cwd or ROOT)
