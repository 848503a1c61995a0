"""bench/results/gpu-*.json and .md from the parts' JSON files."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

from bench.common import RESULTS
from bench.gpu import summary
from bench.gpu.common import MODELS
from bench.gpu.engines_report import engines_lines
from harness.records import table


def summarize_profile(path: Path, seconds: float = 8.0, rate: int = 250) -> dict[str, float]:
    """Cores each part of the server was sampled running in (py-spy raw output with --subprocesses): samples over
    rate x seconds, summed over threads, so 1.0 is one thread running the whole time. The parts: the engine's
    forward thread, the engine process's other threads (its loop), the CPU pool, the front-end processes, the
    supervisor; one process serving alone counts its own threads as the event loop."""
    samples = []
    for line in path.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        processes = [f.split(":")[0] for f in stack.split(";") if f.startswith("process ")]
        samples.append((stack, processes[-1] if processes else "", len(processes), int(n)))
    engine = {pid for stack, pid, _, _ in samples if "Predictor.__call__" in stack}
    several = len({pid for _, pid, _, _ in samples}) > 1
    counts: dict[str, int] = {}
    for stack, pid, depth, n in samples:
        if "Predictor.__call__" in stack:
            part = "forward thread"
        elif "_WorkItem.run" in stack:
            part = "cpu pool"
        elif not several:
            part = "event loop"
        elif pid in engine:
            part = "engine loop"
        else:
            part = "supervisor" if depth == 1 else "front-ends"
        counts[part] = counts.get(part, 0) + n
    return {k: v / (rate * seconds) for k, v in sorted(counts.items())}


def report(folders: list[Path], name: str, commit: str | None = None) -> None:
    """Each part from the last folder that has it; the served runs of every folder together (a later
    folder's run of the same model and variant wins)."""
    data: dict[str, Any] = {}
    for folder in folders:
        for part in ("ceilings", "decode", "hwdecode", "engines", "raw", "served", "tests"):
            if (folder / f"{part}.json").is_file():
                found = json.loads((folder / f"{part}.json").read_text())
                if part == "served" and "served" in data:  # runs of other variants add theirs, model by model
                    if found["settings"] != data["served"]["settings"]:
                        raise SystemExit(f"{folder}/served.json ran with other settings: {found['settings']}")
                    for model, variants in models_in(found).items():
                        data["served"].setdefault(model, {}).update(variants)
                else:
                    data[part] = found
        if (folder / "gpu.txt").is_file():
            data["machine"] = (folder / "gpu.txt").read_text().strip()
        if (folder / "profile.json").is_file():
            runs = json.loads((folder / "profile.json").read_text())
            timelines = {k: v["timeline"] for k, v in runs.items() if isinstance(v, dict) and "timeline" in v}
            if timelines:
                data["timeline"] = {"model": runs.get("model"), **timelines}
            for kind, run in runs.items():
                if isinstance(run, dict) and run.get("cores"):  # summarised on the device
                    data.setdefault("profile", {})[kind] = run["cores"]
        summarised = set(data.get("profile", {})) if (folder / "profile.json").is_file() else set()
        for kind in ("v2", "predict"):
            for gil in ("", "-gil"):
                found = folder / f"profile-{kind}{gil}.txt"
                if found.is_file() and f"{kind}{gil}" not in summarised:  # from before the device summarised
                    data.setdefault("profile", {})[f"{kind}{gil}"] = summarize_profile(found)
    data["targets"] = targets(data)
    data["commit"] = commit or head()
    (RESULTS / f"{name}.json").write_text(json.dumps(data, indent=2))
    summary.add(summary.record(data, data["commit"], f"{name}.json"))
    (RESULTS / f"{name}.md").write_text(markdown(data))
    print(markdown(data))


def head() -> str:
    """This checkout's commit: the tree a run was sent from, where it reports before committing anything else."""
    return subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()


def models_in(part: dict[str, Any]) -> dict[str, Any]:
    """A part's per-model entries (not its settings or timing)."""
    return {k: v for k, v in part.items() if k in MODELS}


def best_served(model: dict[str, Any], route: str | None = None) -> dict[str, Any]:
    """The service's best load level (not LitServe's), over both routes or on `route`."""
    rows = [
        r
        for variant, runs in model.items()
        if not variant.startswith("litserve") and isinstance(runs, dict)
        for each in ("predict", "v2")
        if route in (None, each)
        for r in runs.get(each, [])
    ]
    return max(rows, key=lambda r: r["images_per_s"])


def targets(data: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, model in models_in(data.get("served", {})).items():
        if against := against_litserve(model):
            out[name] = {"vs_litserve_best": against}
        if name not in data.get("raw", {}):
            continue
        raw_rates = data["raw"][name]["img_per_s"]
        compiled_best = max(raw_rates["compiled"].values())
        served = best_served(model)
        out[name] = {
            **out.get(name, {}),
            "served_best_img_per_s": served["images_per_s"],
            "raw_compiled_best_img_per_s": compiled_best,
            "served_over_raw": served["images_per_s"] / compiled_best,
            "p99_ms_there": served["p99_ms"],
            **{
                f"{route}_over_raw": best_served(model, route)["images_per_s"] / compiled_best
                for route in ("predict", "v2")
            },
        }
        if "litserve" in model:  # LitServe decodes with PIL in its one inference worker, on the CPU
            out[name]["vs_litserve"] = {
                variant: {
                    r["concurrency"]: ours["images_per_s"] / r["images_per_s"]
                    for ours in model[variant]["predict"]
                    for r in model["litserve"]["predict"]
                    if r["concurrency"] == ours["concurrency"]
                }
                for variant in ("cpu-decode", "gpu-decode+graphs")
                if variant in model
            }
    return out


def best_predict(runs: dict[str, Any]) -> dict[int, tuple[float, str]]:
    """Per /predict concurrency, the most images/s any of these servers served, and which server."""
    best: dict[int, tuple[float, str]] = {}
    for server, run in runs.items():
        for r in run.get("predict", []):
            if r["concurrency"] not in best or r["images_per_s"] > best[r["concurrency"]][0]:
                best[r["concurrency"]] = (r["images_per_s"], server)
    return best


def against_litserve(model: dict[str, Any]) -> dict[int, dict[str, Any]]:
    """Best against best on /predict at each concurrency: the service's variants against LitServe's
    configurations (`litserve-APIxWORKERS`, each decoding on the GPU)."""
    peers = {v: r for v, r in model.items() if v.startswith("litserve-") and isinstance(r, dict)}
    ours = {v: r for v, r in model.items() if not v.startswith("litserve") and isinstance(r, dict)}
    theirs, mine = best_predict(peers), best_predict(ours)
    return {
        c: {
            "service": mine[c][1],
            "service_img_per_s": mine[c][0],
            "litserve": theirs[c][1],
            "litserve_img_per_s": theirs[c][0],
            "ratio": mine[c][0] / theirs[c][0],
        }
        for c in sorted(set(mine) & set(theirs))
    }


def timeline_lines(t: dict[str, Any]) -> list[str]:
    """The profile part's per-batch timeline, from the service's statistics under each load."""
    rows = [
        [
            load,
            r["batches"],
            f"{r['mean_batch']:.0f}",
            f"{r['input_ms']:.1f}",
            f"{r['infer_ms']:.1f}",
            f"{r['output_ms']:.1f}",
            f"{r['cycle_ms']:.1f}",
            r["bound"],
        ]
        for load, r in t.items()
        if isinstance(r, dict) and r.get("batches")
    ]
    return [
        "",
        f"## Per batch under load ({t['model']}; the service's statistics, ms)",
        "",
        "*input*: copies, or JPEGs decoded on the GPU; *forward*: with the copy back; *cycle*: wall time per batch. "
        "With two batches in flight the device keeps a cycle near the longer of its stages; a longer cycle waits "
        "on the host.",
        "",
        *table(["load", "batches", "mean batch", "input", "forward", "output", "cycle", "bound"], rows, "lrrrrrrl"),
    ]


def pipeline_lines(pipe: dict[str, Any], raw: dict[str, Any]) -> list[str]:
    """The raw part's JPEG bytes to probabilities, beside each model's best raw forward."""
    rows = []
    for name, decoders in models_in(pipe).items():
        best = max(max(v.values()) for v in raw[name]["img_per_s"].values() if v)
        for label, r in decoders.items():
            if "error" in r:
                rows.append([name, label, r["error"], "", ""])
                continue
            two = r["two_in_flight_img_per_s"]
            rows.append([name, label, f"{r['one_in_flight_img_per_s']:.0f}", f"{two:.0f}", f"{two / best:.2f}"])
    return [
        f"## JPEG bytes to probabilities, no serving ({pipe['image']}; the service's predictor, batches of "
        f"{pipe['batch']}, img/s)",
        "",
        *table(["model", "decoder", "one batch in flight", "two in flight", "two / best raw forward"], rows, "llrrr"),
        "",
    ]


def hardware_decoders(h: dict[str, Any]) -> list[str]:
    """The hwdecode part: nvImageCodec's decoders alone, beside the forward, their pixels, what the engines take."""
    alone = h["alone"]
    batches = list(next(iter(alone.values())))

    def rate(r: dict[str, Any]) -> str:
        return f"{r['img_per_s']:.0f}" if "img_per_s" in r else r.get("error", "")

    beside = h["beside_forward"]
    lines = [
        f"## JPEG decoders on the GPU (nvImageCodec {h['nvimgcodec']}; {h['image']}; decode only, img/s)",
        "",
        "*hardware*: the JPEG engines (`HW_GPU_ONLY`); *cuda*: the CUDA decoder (`HYBRID_CPU_GPU`: Huffman on CPU "
        "threads below 1 MP, the rest on the SMs); *split-x*: share x of each batch to the engines, the rest to "
        "the CUDA decoder; *adaptive*: both with `ADAPTIVE_MINIMIZE_IDLE_TIME`.",
        "",
        *table(
            ["decoder", *(f"batch {b}" for b in batches)],
            [[n, *(rate(r[b]) for b in batches)] for n, r in alone.items()],
        ),
        "",
        f"Beside a CUDA-graphed ViT-B/16 forward (bf16, batch 256; alone {beside['forward_alone_img_per_s']:.0f} img/s), "
        "decoding batches of 256 from a second thread and stream:",
        "",
        *table(
            ["decoder", "forward img/s", "decode img/s"],
            [
                [n, f"{r['forward_img_per_s']:.0f}", f"{r['decode_img_per_s']:.0f}"]
                for n, r in beside.items()
                if isinstance(r, dict) and "forward_img_per_s" in r
            ],
        ),
        "",
        *table(
            ["pixels of 64 images", "uint8 vs torchvision nvJPEG: mean, max", "normalised vs the CPU path: mean, max"],
            [
                [
                    n,
                    f"{p['uint8_vs_nvjpeg_mean']:.2f}, {p['uint8_vs_nvjpeg_max']}",
                    f"{p['normalised_vs_cpu_mean']:.4f}, {p['normalised_vs_cpu_max']:.3f}",
                ]
                for n, p in h["pixels"].items()
                if "decoded" in p
            ],
            "lll",
        ),
        "",
        "Decoded by the engines alone: "
        + ", ".join(f"{kind} {'yes' if t.get('hardware') else 'no'}" for kind, t in h["hardware_takes"].items())
        + ".",
        "",
    ]
    return lines


def markdown(d: dict[str, Any]) -> str:
    c, dec = d.get("ceilings"), d.get("decode")
    lines = [f"{d.get('machine', '')}", ""]
    if c:  # a run may leave the ceilings out
        lines += [
            "## Ceilings",
            "",
            f"bf16 matrix product (8192³): **{c['matmul_bf16_tflops']:.0f} TFLOP/s**; device-to-device copy: "
            f"**{c['copy_tb_per_s']:.2f} TB/s** (bytes read + written).",
            "",
        ]
    if "raw" in d:
        lines += ["## Raw forward, bf16 (img/s; logits and embedding, random input)", ""]
    for name, r in models_in(d.get("raw", {})).items():
        rates = r["img_per_s"]
        best = max(max(v.values()) for v in rates.values() if v)
        tflops = best * r["gflops_per_image"] / 1e3
        share = f" ({tflops / c['matmul_bf16_tflops']:.0%} of the matmul ceiling)" if c else ""
        lines += [
            f"**{name}**: {r['parameters_m']:.1f} M parameters, {r['gflops_per_image']:.2f} GFLOP/image; best "
            f"{best:.0f} img/s = {tflops:.0f} TFLOP/s{share}; "
            f"relative error against fp32: eager {r['relative_error_vs_fp32']['eager']:.4f}, compiled "
            f"{r['relative_error_vs_fp32']['compiled']:.4f}",
            "",
            *table(
                ["batch", "eager", "torch.compile", "eager + CUDA graph", "compiled + CUDA graph"],
                [[bs] + [f"{rates[m][bs]:.0f}" if bs in rates[m] else "" for m in rates] for bs in rates["eager"]],
                "rrrrr",
            ),
            "",
        ]
    if pipe := d.get("raw", {}).get("pipeline"):
        lines += pipeline_lines(pipe, d["raw"])
    if dec:  # a run may leave the preprocessing rates out
        lines += preprocessing_lines(dec)
    if "hwdecode" in d:
        lines += hardware_decoders(d["hwdecode"])
    if "engines" in d:
        lines += engines_lines(d["engines"])
    lines += served_lines(d)
    if "profile" in d:
        lines += profile_lines(d["profile"])
    if "timeline" in d:
        lines += timeline_lines(d["timeline"])
    if "tests" in d:
        lines += ["", f"GPU tests (`tests/app/test_cuda.py`): {d['tests']['summary'].strip('= ')}"]
    return "\n".join(lines) + "\n"


def preprocessing_lines(dec: dict[str, Any]) -> list[str]:
    return [
        "## Preprocessing a 500x375 JPEG (decode, resize to 248, crop 224, normalise)",
        "",
        *table(
            ["where", "img/s"],
            [
                *(
                    [f"PIL on {t} CPU thread{'s' if t != '1' else ''}", f"{v:.0f}"]
                    for t, v in dec["cpu_img_per_s"].items()
                ),
                [f"nvJPEG, batches of {dec['gpu_batch']}: decode only", f"{dec['gpu_decode_img_per_s']:.0f}"],
                ["nvJPEG + resize on the GPU", f"{dec['gpu_decode_resize_img_per_s']:.0f}"],
            ],
        ),
        "",
        f"GPU pixels against the CPU path's (normalised units): mean |diff| {dec['mean_abs_diff_vs_cpu']:.4f}, "
        f"max {dec['max_abs_diff_vs_cpu']:.3f}.",
        "",
    ]


def served_lines(d: dict[str, Any]) -> list[str]:
    if "served" not in d:  # a run of other parts only
        return []
    sv = d["served"]
    st = sv["settings"]
    lines = [
        "## Served (500x375 JPEGs; `hey`; /predict: one image per multipart request; V2: "
        f"{st['images_per_request']} images per binary request)",
        "",
        f"VIT_MAX_BATCH_SIZE={st['max_batch_size']}, VIT_MAX_WAIT_MS={st['wait_ms']}, {st['duration']} s per "
        "level. *server cores*: CPU seconds the server's processes (with VIT_WORKERS, the supervisor, front-ends and "
        "engine together) used per second; *GPU*: nvidia-smi utilisation.",
        "",
    ]
    rows: list[list[object]] = []
    for name, model in models_in(sv).items():
        for variant, runs in model.items():
            if not isinstance(runs, dict):
                continue
            for route in ("predict", "v2"):
                for r in runs.get(route, []):
                    batch = f"{r['mean_batch_size']:.0f}" if r["mean_batch_size"] else "-"
                    rows.append(
                        [
                            name,
                            variant,
                            route,
                            r["concurrency"],
                            f"{r['images_per_s']:.0f}",
                            f"{r['p50_ms']:.0f}",
                            f"{r['p99_ms']:.0f}",
                            batch,
                            f"{r['gpu_util']:.0f}",
                            f"{r['server_cores']:.1f}",
                        ]
                    )
        starts = ", ".join(f"{v} {runs['startup_s']:.1f} s" for v, runs in model.items() if "startup_s" in runs)
        rows.append([name, "startup (process start to ready)", starts, *[""] * 7])
    header = ["model", "server", "route", "concurrency", "img/s", "p50 ms", "p99 ms", "mean batch", "GPU %"]
    lines += table([*header, "server cores"], rows, "lllrrrrrrr")
    lines += litserve_lines(sv, d["targets"])
    if not any("served_over_raw" in t for t in d["targets"].values()):  # no raw forward in these runs
        return lines
    lines += ["", "## Targets", ""]
    if any("vs_litserve" in t for t in d["targets"].values()):
        lines += [
            "LitServe decodes each upload with PIL on the CPU in its one inference worker: the fair ratio is "
            "against the service's own CPU decoding (*cpu-decode*); the defaults decode JPEGs on the GPU (nvJPEG).",
            "",
        ]
    rows = []
    for name, t in d["targets"].items():
        if "served_over_raw" not in t:  # no raw forward in these runs
            continue
        peer = t.get("vs_litserve", {})
        if peer and not isinstance(next(iter(peer.values())), dict):  # a result file from before the split
            peer = {"gpu-decode+graphs": peer}

        def ratios(variant: str, peer: dict[str, Any] = peer) -> str:
            return ", ".join(f"c={k}: {v:.1f}x" for k, v in peer.get(variant, {}).items())

        rows.append(
            [
                name,
                f"{t['served_best_img_per_s']:.0f}",
                f"{t['raw_compiled_best_img_per_s']:.0f}",
                f"{t['served_over_raw']:.2f}",
                f"{t['p99_ms_there']:.0f} ms",
                *(f"{t[k]:.2f}" if k in t else "" for k in ("v2_over_raw", "predict_over_raw")),
                ratios("cpu-decode"),
                ratios("gpu-decode+graphs"),
            ]
        )
    header = ["model", "served best img/s", "raw compiled best", "served / raw", "p99 there", "V2 / raw"]
    header += ["/predict / raw"]
    header += ["/predict vs LitServe, both decoding on the CPU", "/predict vs LitServe, the defaults (GPU decoding)"]
    return lines + table(header, rows, "lrrrrrrll")


def litserve_lines(sv: dict[str, Any], targets: dict[str, Any]) -> list[str]:
    """Each LitServe configuration as the benchmark checked and recorded it, and best against best."""
    lines: list[str] = []
    for name, t in targets.items():
        if not (against := t.get("vs_litserve_best")):
            continue
        lines += ["", f"## /predict against LitServe ({name}, best against best at each concurrency)", ""]
        for variant, run in models_in(sv)[name].items():
            if variant.startswith("litserve-") and "configuration" in run:
                settings = ", ".join(f"{k} {v}" for k, v in run["configuration"].items())
                lines.append(f"- *{variant}*: {settings}; ready in {run['startup_s']:.1f} s")
        lines.append("")
        rows = [
            [
                c,
                a["service"],
                f"{a['service_img_per_s']:.0f}",
                a["litserve"],
                f"{a['litserve_img_per_s']:.0f}",
                f"{a['ratio']:.2f}x",
            ]
            for c, a in against.items()
        ]
        lines += table(["concurrency", "service", "img/s", "LitServe", "img/s", "service / LitServe"], rows, "rlrlrr")
    return lines


def profile_lines(profile: dict[str, Any]) -> list[str]:
    parts = sorted({part for shares in profile.values() for part in shares})
    lines = [
        "",
        "## Where the served processes spend their time (py-spy, 8 s at 250 Hz, vit-b16 with the defaults)",
        "",
        "Cores each part was sampled running (summed over its threads and processes: 1.00 is one thread the whole "
        "time); *holding the GIL*: sampled with `--gil`. *engine loop*: the engine process's threads other than "
        "the forward thread.",
        "",
    ]
    labels = {"-gil": ", holding the GIL", "predict": "/predict c=256", "v2": "V2 x8 c=64"}
    rows = []
    for kind, shares in profile.items():
        label = kind
        for was, becomes in labels.items():
            label = label.replace(was, becomes)
        rows.append([label, *(f"{shares.get(part, 0):.2f}" for part in parts)])
    return lines + table(["load", *parts], rows, "l" + "r" * len(parts))
