"""The device stand-in: its waits use no CPU and release the GIL; its times are the H100's; its outputs have
the model's shapes."""

from __future__ import annotations

import asyncio
import ctypes
import json
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from app.core.backends.predictor import ImageInput
from app.core.contract.request import EncodedImage, InferOptions
from app.core.engine.engine import Engine
from app.core.engine.served_model import ServedModel
from app.core.images.gpu_decode import Jpeg
from harness.images import encode
from harness.stand_in import Device, DeviceTimes, StandInPredictor, engines_beside_forward
from model.checkpoint import load_checkpoint
from model.shapes import make_sample
from tests.support.settings import cpu_settings


def during_a_wait(wait: Callable[[], None]) -> tuple[float, float, int]:
    """`wait()` on a thread of its own while this thread does Python work: the wait's CPU seconds and wall
    seconds, and how often this thread got on with its work well inside the wait (it can only when the wait
    released the GIL)."""
    seen: dict[str, float] = {}

    def waiting() -> None:
        cpu, started = time.thread_time(), time.monotonic()
        wait()
        seen.update(cpu=time.thread_time() - cpu, started=started, ended=time.monotonic())

    thread = threading.Thread(target=waiting)
    thread.start()
    progress = []
    while thread.is_alive():  # work that needs the GIL, noting when it got on
        sum(range(1000))
        progress.append(time.monotonic())
    thread.join()
    inside = [t for t in progress if seen["started"] + 0.02 < t < seen["ended"] - 0.02]
    return seen["cpu"], seen["ended"] - seen["started"], len(inside)


def test_the_waits_use_no_cpu_and_release_the_gil() -> None:
    device = Device(DeviceTimes("vit-b16", 256))
    cpu, wall, worked_meanwhile = during_a_wait(lambda: (device.decode(4000), device.forward(256)))
    assert wall >= 4000 / 13_921 + 256 / 11_199
    assert cpu < 0.1 * wall
    assert worked_meanwhile > 10


def test_both_checks_can_fail() -> None:
    """A sleep that holds the GIL (a C call through PyDLL, which keeps it) and a wait that spins."""
    libc = ctypes.PyDLL(None)
    cpu, wall, worked_meanwhile = during_a_wait(lambda: libc.usleep(300_000))
    assert cpu < 0.1 * wall and worked_meanwhile == 0
    cpu, started = time.thread_time(), time.monotonic()
    while time.monotonic() < started + 0.3:  # a wait that spins: its CPU time is counted
        pass
    assert time.thread_time() - cpu > 0.2 * (time.monotonic() - started)


B16, S16 = 11_199 / 10_313, 28_284 / 25_158  # the H200's forward at batch 256 over the H100's


@pytest.mark.parametrize(
    ("model", "n", "seconds"),
    [
        ("vit-b16", 256, 256 / 11_199),  # the H200's, measured
        ("vit-b16", 200, (128 / 10_355 + (256 / 10_313 - 128 / 10_355) * (224 - 128) / 128) / B16),
        ("vit-s16", 8, 8 / 12_575 / S16),  # a captured size: the H100's curve, scaled
        ("vit-s16", 5, 8 / 12_575 / S16),  # padded to the captured 8
    ],
)
def test_the_forward_lasts_what_the_h200_measured(model: str, n: int, seconds: float) -> None:
    """The H200's forward at batch 256, and the H100's curve over batch sizes scaled to it; a batch padded to its
    CUDA graph's size (200 -> 224), whose time lies on the line between the measured sizes around it."""
    assert DeviceTimes(model, 256).forward_s(n) == pytest.approx(seconds)
    assert DeviceTimes(model, 256).decode_s(64) == pytest.approx(64 / 13_921)  # with the resize on the GPU


def test_outputs_have_the_models_shapes(tiny_checkpoint: Path) -> None:
    checkpoint = load_checkpoint(tiny_checkpoint)
    predictor = StandInPredictor(checkpoint, Device(DeviceTimes("vit-s16", 8)))
    batch = [
        ImageInput(Jpeg(b"\xff\xd8", "a.jpg"), "none"),
        ImageInput(Jpeg(b"\xff\xd8", "b.jpg"), "rollout", None, True),
    ]
    plain, asked = predictor(batch)
    assert plain.probabilities.shape == (len(checkpoint.classes),) and plain.attention_map is None
    assert plain.embedding is None and plain.batch is not None and plain.batch.size == 2
    grid = checkpoint.config.grid_size
    assert asked.attention_map is not None and asked.attention_map.shape == (grid, grid)
    assert asked.embedding is not None and asked.embedding.shape == (checkpoint.config.dim,)
    assert predictor.jpeg_decoder is not None and predictor.decode == "gpu"


class Recorded(Device):
    """A device whose decoding and computing each take 50 ms, noting when each batch's did."""

    def __init__(self) -> None:
        super().__init__(DeviceTimes("vit-s16", 4))
        self.spans: list[tuple[str, float, float]] = []

    def decode(self, n: int) -> None:
        with self.decoder:
            started = time.monotonic()
            time.sleep(0.05)
            self.spans.append(("decode", started, time.monotonic()))

    def forward(self, n: int) -> None:
        with self.compute:
            started = time.monotonic()
            time.sleep(0.05)
            self.spans.append(("forward", started, time.monotonic()))


async def test_the_engine_decodes_a_batch_while_it_computes_another(
    tiny_checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A model whose predictor decodes JPEGs on the device has two batches in flight: the next one's decoding
    overlaps this one's forward pass."""
    device = Recorded()
    monkeypatch.setattr(
        ServedModel,
        "build_predictor",
        staticmethod(lambda name, checkpoint, *a, **k: StandInPredictor(checkpoint, device)),
    )
    async with Engine.serving(cpu_settings(weights=tiny_checkpoint, max_batch_size=4)) as engine:
        model = engine.model(None)
        assert model.batcher.in_flight == 2 and model.description.decode == "gpu"
        jpeg = encode(make_sample(5, 0).image, "JPEG", quality=90)
        files = [EncodedImage(f"{i}.jpg", jpeg) for i in range(4)]
        done = await asyncio.gather(*(engine.lane.run(model, files, InferOptions()) for _ in range(3)))
    assert [len(d.predictions) for d in done] == [4, 4, 4]
    decodes = [(a, b) for kind, a, b in device.spans if kind == "decode"]
    forwards = [(a, b) for kind, a, b in device.spans if kind == "forward"]
    assert len(decodes) == len(forwards) == 3
    assert any(d0 < f1 and f0 < d1 for d0, d1 in decodes for f0, f1 in forwards)  # one decoded while one computed


def test_the_device_rate_with_each_decoder() -> None:
    """The CUDA decoder one batch after another's forward (they share the SMs); the engines beside the SMs at
    the rate they kept beside a forward, which binds."""
    times = DeviceTimes("vit-b16", 256)
    forward, decode = 256 / 11_199, 256 / 13_921
    assert times.images_per_s("cuda") == pytest.approx(256 / (forward + decode))
    assert times.images_per_s("hardware") == pytest.approx(engines_beside_forward())  # the engines bind
    assert engines_beside_forward() < 11_199 / 5  # the H200's runs so far: a tenth of the forward
    # the JPEGs the front-ends decode (VIT_CPU_DECODE_SHARE) leave the device's decoder
    assert times.images_per_s("cuda", 0.25) == pytest.approx(256 / (forward + 0.75 * decode))
    assert times.images_per_s("cuda", 1.0) == pytest.approx(11_199)


@pytest.mark.parametrize("shared", [False, True], ids=["one-process", "over-a-shared-folder"])
def test_decoding_waits_while_the_forward_runs(tmp_path: Path, shared: bool) -> None:
    times = DeviceTimes("vit-b16", 256)
    n = round(0.05 * 13_921)  # 50 ms of decoding alone
    decoding = Device(times, tmp_path if shared else None)
    computing = Device(times, tmp_path) if shared else decoding  # another process's Device, as it would be
    started = time.monotonic()
    decoding.decode(n)
    alone = time.monotonic() - started
    forward = threading.Thread(target=computing.forward, args=(4_000,))  # 0.35 s of compute
    forward.start()
    while not computing.compute.busy():  # the forward holds the compute
        time.sleep(0.001)
    started = time.monotonic()
    decoding.decode(n)  # waits for the forward, then 50 ms
    beside = time.monotonic() - started
    forward_ended = not computing.compute.busy()
    forward.join()
    decoding.close()
    computing.close()
    assert alone >= 0.05 and forward_ended and beside >= 0.3 + 0.05, (alone, beside)


def test_another_devices_rates_replace_the_h100s() -> None:
    """A device given its own forward, CUDA decoder and engine rates is timed by them, not by the H100's."""
    times = DeviceTimes("vit-b16", 256, {256: 11_199.0}, decode_img_s=14_167.0, hardware_img_s=5_000.0)
    forward, decode = 256 / 11_199, 256 / 14_167
    assert times.forward_s(256) == pytest.approx(forward)
    assert times.images_per_s("cuda") == pytest.approx(256 / (forward + decode))
    assert times.images_per_s("hardware") == pytest.approx(5_000)  # engines slower than the forward bound it


def test_the_engines_rate_is_the_latest_h200_run_that_measured_it_beside_a_forward(tmp_path: Path) -> None:
    def run(device: str, beside: float | None) -> dict[str, object]:
        return {"device": device, "jpeg_engines": {"alone_img_per_s": 20_000.0, "beside_forward_img_per_s": beside}}

    summary = tmp_path / "gpu-summary.json"
    summary.write_text(json.dumps([run("NVIDIA H200", 1_000.0), run("NVIDIA H200", 1_200.0), run("NVIDIA H200", None)]))
    assert engines_beside_forward(summary) == 1_200.0
    summary.write_text(json.dumps([run("NVIDIA H100 80GB HBM3", 900.0)]))
    with pytest.raises(RuntimeError, match="no H200 run"):
        engines_beside_forward(summary)
