"""`python -m bench.compare.engine_cost --replay`: replayers keep calls in flight on a real engine process over the
device stand-in, and the engine's CPU per image is read where it, not the driver, sets the pace; and
`bench.stand_in` takes the engine's ceiling from that figure where it has one."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from bench import stand_in
from bench.stand_in import Load, Measured, summary

ROOT = Path(__file__).resolve().parents[2]


def test_replayers_keep_the_engine_busy_and_its_cpu_per_image_is_read(tmp_path: Path) -> None:
    name = tmp_path / "replayed"
    command = [sys.executable, "-m", "bench.compare.engine_cost", "--replay", "--repeats", "1", "--seconds", "1"]
    command += ["--images", "2", "--concurrency", "8", "--front-ends", "2", "--name", str(name)]
    subprocess.run(command, cwd=ROOT, check=True, capture_output=True, timeout=300)
    report = json.loads(name.with_suffix(".json").read_text())
    assert report["replay"] is True
    [[run]] = report["runs"].values()
    assert run["img_s"] > 0 and run["engine_us_per_image"] > 0
    # the driver only resends: it costs far less per image than the engine it keeps busy
    assert run["driver_us_per_image"] < run["engine_us_per_image"]
    assert "--replay" in name.with_suffix(".md").read_text()


def test_the_engines_ceiling_comes_from_its_cpu_where_front_ends_outrun_it() -> None:
    args = argparse.Namespace(model="vit-b16", route="predict")
    measured = Measured(1000.0, 0, 4.0, {"engine": 0.2, "front-ends": 1.5, "load generator": 0.1}, 1.0)
    load = Load(Path("form"), "multipart/form-data", {}, 64)
    here = stand_in.H100_PIL_ONE_CORE * 2  # a µs here is 2 µs of a host core
    plain = summary("vit-serve", args, 4, load, measured, here)
    assert plain["engine_ceiling_img_s"] == round(1e6 / (200.0 * 2), 1)  # 0.2 s over 1,000 images: 200 µs each
    assert "engine_replayed_cpu_us_per_image" not in plain
    replayed = summary("vit-serve", args, 4, load, measured, here, replayed=50.0)
    assert replayed["engine_replayed_cpu_us_per_image"] == 50.0
    assert replayed["engine_ceiling_img_s"] == round(1e6 / (50.0 * 2), 1)
    assert replayed["engine_cpu_us_per_image"] == 200.0  # what it spent here is still recorded
    one_process = summary("vit-serve", args, 1, load, measured, here, replayed=50.0)  # the engine is the front too
    assert one_process["engine_ceiling_img_s"] == plain["engine_ceiling_img_s"]
