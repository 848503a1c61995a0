"""`python -m bench.stand_in_calibration`: a stand-in row projected onto a GPU run's host and device, beside
what that host served."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROW = {
    "server": "vit-serve",
    "commit": "abc1234",
    "model": "vit-b16",
    "route": "v2",
    "workers": 4,
    "mean_batch": 20.0,
    "engine_cpu_us_per_image": 100.0,
    "frontend_cpu_us_per_image": 380.0,
    "supervisor_cpu_us_per_image": 0.0,
    "load_generator_cpu_us_per_image": 50.0,
    "pil_one_core_here_img_s": 436.0,  # twice the GPU host's: a microsecond here is two there
}
GPU = {
    "machine": "name, driver_version\nNVIDIA H200, 580\n16\nModel name: Intel(R) Xeon(R) Processor",
    "raw": {"vit-b16": {"img_per_s": {"compiled+graphs": {"256": 11_000.0}}}},
    "decode": {
        "cpu_img_per_s": {"1": 218.0},
        "gpu_decode_img_per_s": 12_000.0,
        "gpu_decode_resize_img_per_s": 11_500.0,
    },
    "served": {
        "vit-b16": {
            "workers-4": {
                "v2": [
                    {"concurrency": 32, "images_per_s": 4_000.0, "mean_batch_size": 100.0, "server_cores": 3.0},
                    {"concurrency": 128, "images_per_s": 4_500.0, "mean_batch_size": 200.0, "server_cores": 3.5},
                ]
            }
        }
    },
}


def test_a_row_is_projected_with_the_gpu_runs_host_and_device(tmp_path: Path) -> None:
    rows, gpu = tmp_path / "rows.json", tmp_path / "gpu.json"
    other = {**ROW, "workers": 8}  # no run of 8 front-ends there: left out
    rows.write_text(json.dumps([ROW, other, {**ROW, "server": "litserve"}]))
    gpu.write_text(json.dumps(GPU))
    command = [sys.executable, "-m", "bench.stand_in_calibration", str(rows), "--gpu", str(gpu)]
    subprocess.run([*command, "--out", str(tmp_path), "--name", "c"], check=True, capture_output=True)
    [entry] = json.loads((tmp_path / "c.json").read_text())
    forward, decode = 256 / 11_000, 256 / 11_500  # decoding with the resize, one after the other with the forward
    assert entry["device_img_s"] == pytest.approx(256 / (forward + decode), abs=0.1)
    assert entry["core_scale"] == 2.0
    assert entry["engine_ceiling_img_s"] == 5_000  # one core over 200 µs of it
    assert entry["frontend_ceiling_img_s"] == pytest.approx(4 * 1e6 / 760, abs=0.1)  # four cores, 760 µs each
    assert (entry["projected_img_s"], entry["bound_by"]) == (5_000, "engine")
    # the serving processes' CPU per image in the host's µs: the stand-in's engine and front-ends (200 + 760), and
    # that host's 3.5 cores over the 4,500 img/s they served
    assert entry["server_host_us_per_image"] == 960
    assert entry["measured_server_us_per_image"] == pytest.approx(3.5e6 / 4_500, abs=0.1)
    assert entry["server_cpu_measured_over_projected"] == 0.81
    assert (entry["measured_img_s"], entry["measured_concurrency"], entry["measured_mean_batch"]) == (4_500, 128, 200)
    assert entry["measured_over_projected"] == 0.9
    assert "| vit-b16 | v2 | 4 | abc1234 | 2.00 |" in (tmp_path / "c.md").read_text()


def test_a_rows_engine_replayed_where_front_ends_outrun_it_sets_its_ceiling(tmp_path: Path) -> None:
    """A row with the engine's CPU where front-ends outrun it (`bench.stand_in --replay`) is projected with that
    figure, not with what the engine spent under `hey`, and the page says which it used."""
    rows, gpu = tmp_path / "rows.json", tmp_path / "gpu.json"
    rows.write_text(json.dumps([{**ROW, "engine_replayed_cpu_us_per_image": 50.0}]))
    gpu.write_text(json.dumps(GPU))
    command = [sys.executable, "-m", "bench.stand_in_calibration", str(rows), "--gpu", str(gpu)]
    subprocess.run([*command, "--out", str(tmp_path), "--name", "c"], check=True, capture_output=True)
    [entry] = json.loads((tmp_path / "c.json").read_text())
    assert entry["engine_replayed"] and entry["engine_host_us_per_image"] == 100.0  # 50 µs here, two there
    assert entry["engine_ceiling_img_s"] == 10_000  # one core over 100 µs of it
    assert entry["bound_by"] == "front-ends"
    assert "| 100 (replayed) |" in (tmp_path / "c.md").read_text()


def test_a_rows_device_is_at_most_what_the_replayed_engine_served(tmp_path: Path) -> None:
    """With the rate the replayed engine served over the stand-in's device (the device as the engine's batching
    attains it), the CUDA decoder's device is at most that."""
    rows, gpu = tmp_path / "rows.json", tmp_path / "gpu.json"
    row = {**ROW, "engine_replayed_cpu_us_per_image": 50.0, "device_replayed_img_s": 5_000.0}
    rows.write_text(json.dumps([row]))
    gpu.write_text(json.dumps(GPU))
    command = [sys.executable, "-m", "bench.stand_in_calibration", str(rows), "--gpu", str(gpu)]
    subprocess.run([*command, "--out", str(tmp_path), "--name", "c"], check=True, capture_output=True)
    [entry] = json.loads((tmp_path / "c.json").read_text())
    assert entry["device_img_s"] == 5_000  # below the durations' 256 / (256 / 11,000 + 256 / 11,500)
    assert (entry["projected_img_s"], entry["bound_by"]) == (5_000, "device")
