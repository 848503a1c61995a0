"""The engines part's reading of a CUPTI trace, and its report, on traces and results shaped as the device
writes them (the part itself needs a GPU: `bash bench/gpu.sh run engines`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness import cuda_trace as trace

ROOT = Path(__file__).resolve().parents[2]
DECODER, FORWARD, WORKER = 101, 102, 103


def call(tid: int, name: str, ts: float, dur: float, correlation: int | None = None) -> dict[str, object]:
    args = {"correlation": correlation} if correlation is not None else {}
    return {"ph": "X", "cat": "cuda_runtime", "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur, "args": args}


def kernel(name: str, ts: float, dur: float, correlation: int) -> dict[str, object]:
    return {
        "ph": "X",
        "cat": "kernel",
        "name": name,
        "pid": 0,
        "tid": 7,
        "ts": ts,
        "dur": dur,
        "args": {"correlation": correlation},
    }


def two_batches() -> list[dict[str, object]]:
    """Two decoded batches: each a 25 ms cudaFree on a library worker, a colour-conversion kernel launched by
    the decoder's thread that starts 20 ms after its launch call, and the forward's graph launches."""
    events: list[dict[str, object]] = [{"ph": "M", "name": "thread_name", "pid": 1, "tid": "", "args": {}}]
    for b in range(2):
        t = b * 100_000.0
        events += [
            call(WORKER, "cudaFree", t, 25_000),
            call(DECODER, "cudaLaunchKernel", t + 30_000, 10, correlation=10 + b),
            kernel("void nvjpeg::batchedYCbCr2RGB_kernelv2<unsigned char, 3>(args)", t + 50_010, 500, 10 + b),
            call(FORWARD, "cudaGraphLaunch", t, 40, correlation=20 + b),
            kernel("ampere_bf16_gemm", t + 40, 24_000, 20 + b),
        ]
    return events


def test_a_trace_is_summarised_per_batch_by_thread_and_kernel() -> None:
    s = trace.summarize(two_batches(), {DECODER: "decoder's caller", FORWARD: "forward"}, per=2)
    first = s["calls"][0]
    assert (first["thread"], first["call"], first["waits"]) == ("thread 103", "cudaFree", True)  # a library's worker
    assert first["count"] == 1 and first["ms"] == pytest.approx(25) and first["max_ms"] == pytest.approx(25)
    assert s["waiting_calls_ms"] == {"thread 103": pytest.approx(25)}
    [colour] = [w for w in s["gpu_work"] if w["name"] == "void nvjpeg::batchedYCbCr2RGB_kernelv2"]
    assert colour["launched_by"] == "decoder's caller" and colour["count"] == 1
    assert colour["mean_queued_ms"] == pytest.approx(20) and colour["gpu_ms"] == pytest.approx(0.5)
    gemm = s["gpu_work"][0]
    assert gemm["launched_by"] == "forward" and gemm["mean_queued_ms"] == pytest.approx(0)


def test_a_trace_file_as_torch_exports_it_is_read(tmp_path: Path) -> None:
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"schemaVersion": 1, "traceEvents": two_batches()}))
    assert len(trace.load(path)) == len(two_batches())


def test_the_report_shows_every_section_and_each_sections_error() -> None:
    per_batch = trace.summarize(two_batches(), {DECODER: "decoder's caller", FORWARD: "forward"}, per=2)
    host = {"call_ms_per_batch": 240.0, "wait_ms_per_batch": 3.0}
    row = {"forward_img_per_s": 10_200.0, "decode_img_per_s": 1_050.0, "forward_kept": 0.99, **host}
    result = {
        "image": "500x375 JPEG, quality 90, 4:2:0",
        "batch": 256,
        "nvimgcodec": "0.9.0",
        "sms": 132,
        "alone": {
            "forward_img_per_s": 10_300.0,
            "hardware": {"decode_img_per_s": 21_000.0, **host},
            "hardware, preallocated": {"decode_img_per_s": 22_000.0, **host},
            "cuda": {},
        },
        "trace": {"beside the forward": {"decode_img_per_s": 1_000.0, **host, "per_batch": per_batch}},
        "options": {"defaults": row, "one CUDA stream": {"error": "RuntimeError('bad option')"}},
        "starvation": {
            "a spin kernel on every SM instead of the forward": {"spins_per_s": 40.0, "decode_img_per_s": 900.0},
        },
        "green contexts": {
            "forward on 124 of 132 SMs": row,
            "the process": {"error": "ended with exit code -9 (killed after 300 s if negative)"},
        },
        "process": row,
        "dali": {"error": "ModuleNotFoundError(\"No module named 'nvidia.dali'\")"},
    }
    render = "import json, sys; from bench.gpu.engines_report import engines_lines; print('\\n'.join(engines_lines(json.load(sys.stdin))))"
    text = subprocess.run(
        [sys.executable, "-c", render], input=json.dumps(result), capture_output=True, text=True, check=True
    ).stdout
    assert (
        "the engines 21000 img/s; the engines preallocated 22000 img/s" in text
        and "`cudaFree`" in text
        and "nvjpeg::batchedYCbCr2RGB_kernelv2" in text
    )
    assert "| one CUDA stream | RuntimeError('bad option') |" in text
    green = text[text.index("### The forward on fewer SMs") :]
    assert "| forward on 124 of 132 SMs | 1050 | 10200 | 0.99 | 240.0 / 3.0 |" in green
    assert "| the process | ended with exit code -9" in green
    assert "40.0 spins/s" in text and "DALI: not measured (ModuleNotFoundError" in text


ROWS = """
import json, os, time
from pathlib import Path

def rows_then_exit(n, path):
    Path(path).write_text(json.dumps({f"row {i}": {"decode_img_per_s": i} for i in range(n)}))
    os._exit(0)

def one_row_then_hang(path):
    Path(path).write_text(json.dumps({"row 0": {"decode_img_per_s": 0}}))
    time.sleep(120)
"""


@pytest.mark.slow  # a fresh interpreter, and a process left to hang until its time limit
def test_a_section_in_a_process_of_its_own_keeps_its_rows_and_is_stopped_at_its_time_limit(tmp_path: Path) -> None:
    """The green contexts run in a spawned process: what it wrote comes back, and one that hangs is killed at the
    time limit with its rows so far and a row saying how it ended."""
    (tmp_path / "rows_module.py").write_text(ROWS)
    run = (
        "import json, rows_module as m; from bench.gpu.engines import in_own_process; "
        "print(json.dumps(in_own_process(m.rows_then_exit, (2,), timeout=60))); "
        "print(json.dumps(in_own_process(m.one_row_then_hang, (), timeout=5)))"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    out = subprocess.run(
        [sys.executable, "-c", run], capture_output=True, text=True, check=True, cwd=ROOT, env=env
    ).stdout.splitlines()
    assert json.loads(out[0]) == {"row 0": {"decode_img_per_s": 0}, "row 1": {"decode_img_per_s": 1}}
    hung = json.loads(out[1])
    assert hung["row 0"] == {"decode_img_per_s": 0}
    assert hung["the process"]["error"].startswith("ended with exit code -9")
