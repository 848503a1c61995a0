"""`bench/results/gpu-summary.json`: one record per GPU run, so that a script can read where the GPU path stands.

A record gives the device, the commit, the raw compiled forward per model, the JPEG engines alone and beside a
forward (and the share of its own rate the forward kept), and the served img/s with p99 of the three scenarios
the targets name. A value a run did not measure is null. `python -m bench.gpu --report` adds its run's record;
`python -m bench.gpu --summary FILE.json --commit C` enters a results file written earlier.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bench.common import RESULTS

SUMMARY = RESULTS / "gpu-summary.json"
# (model, route, concurrency): the served scenarios of the targets
SCENARIOS = (("vit-b16", "v2", 128), ("vit-b16", "predict", 256), ("vit-s16", "v2", 128))


def device_name(machine: str) -> str | None:
    """The GPU's name from gpu.txt's nvidia-smi lines (its second line's first field)."""
    lines = machine.splitlines()
    return lines[1].split(",")[0].strip() if len(lines) > 1 else None


def raw_forward(data: dict[str, Any]) -> dict[str, float]:
    """The best compiled forward (with or without CUDA graphs) of each model."""
    out = {}
    for model, r in data.get("raw", {}).items():
        if isinstance(r, dict) and "img_per_s" in r:
            rates = [v for kind in ("compiled", "compiled+graphs") for v in r["img_per_s"].get(kind, {}).values()]
            if rates:
                out[model] = max(rates)
    return out


def engine_rates(data: dict[str, Any]) -> dict[str, float | None]:
    """The engines alone and beside the forward, from the engines part, else from the older hwdecode part. The
    engines part's alone rate is the preallocated decoder's where it measured one, else the defaults'."""
    alone = beside = forward = forward_alone = None
    if e := data.get("engines"):  # preallocated, as the service runs them, where the run measured that
        setting = "preallocated" if "decode_img_per_s" in e.get("options", {}).get("preallocated", {}) else "defaults"
        found = e.get("alone", {})
        alone = found.get(f"hardware, {setting}", found.get("hardware", {})).get("decode_img_per_s")
        forward_alone = found.get("forward_img_per_s")
        row = e.get("options", {}).get(setting, {})
        beside, forward = row.get("decode_img_per_s"), row.get("forward_img_per_s")
    elif h := data.get("hwdecode"):
        alone = h.get("alone", {}).get("hardware", {}).get("256", {}).get("img_per_s")
        forward_alone = h.get("beside_forward", {}).get("forward_alone_img_per_s")
        row = h.get("beside_forward", {}).get("hardware", {})
        beside, forward = row.get("decode_img_per_s"), row.get("forward_img_per_s")
    kept = forward / forward_alone if forward and forward_alone else None
    return {"alone_img_per_s": alone, "beside_forward_img_per_s": beside, "forward_kept": kept}


def served(data: dict[str, Any]) -> dict[str, Any]:
    """The best variant at each scenario's concurrency: img/s, p99 ms, and which variant."""
    out: dict[str, Any] = {}
    for model, route, concurrency in SCENARIOS:
        best = None
        for variant, runs in data.get("served", {}).get(model, {}).items():
            for level in runs.get(route, []) if isinstance(runs, dict) else []:
                if level.get("concurrency") == concurrency and (
                    best is None or level["images_per_s"] > best["img_per_s"]
                ):
                    best = {"img_per_s": level["images_per_s"], "p99_ms": level.get("p99_ms"), "variant": variant}
        out[f"{model} {route} c={concurrency}"] = best
    return out


def record(data: dict[str, Any], commit: str, source: str) -> dict[str, Any]:
    return {
        "device": device_name(data.get("machine", "")),
        "commit": commit,
        "source": source,
        "raw_compiled_forward_img_per_s": raw_forward(data),
        "jpeg_engines": engine_rates(data),
        "served": served(data),
    }


def add(entry: dict[str, Any], path: Path = SUMMARY) -> list[dict[str, Any]]:
    """Add a run's record, replacing one of the same source and commit (a report written again)."""
    records = json.loads(path.read_text()) if path.is_file() else []
    records = [r for r in records if (r["source"], r["commit"]) != (entry["source"], entry["commit"])]
    records.append(entry)
    path.write_text(json.dumps(records, indent=2) + "\n")
    return records


def enter(results: Path, commit: str) -> None:
    """A results file written earlier (bench/results/gpu-*.json); one with runs under keys (A, B, ...) gives a
    record per run, each with the commit it names."""
    data = json.loads(results.read_text())
    runs = {k: v for k, v in data.items() if isinstance(v, dict) and "commit" in v}
    if runs:
        for name, run in runs.items():
            add(record({"machine": data.get("machine", ""), **run}, run["commit"], f"{results.name} run {name}"))
    else:
        add(record(data, commit, results.name))
