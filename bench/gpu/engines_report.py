"""The engines part as Markdown: rates alone, the trace tables, and each candidate beside the forward."""

from __future__ import annotations

from typing import Any

from harness import cuda_trace as trace


def rate(row: dict[str, Any], key: str) -> str:
    return f"{row[key]:.0f}" if key in row else ""


def beside_rows(rows: dict[str, Any]) -> list[str]:
    out = [
        "| candidate | decode img/s | forward img/s | forward kept | ms in the call / waiting, per batch |",
        "|---|---:|---:|---:|---|",
    ]
    for name, r in rows.items():
        if not isinstance(r, dict):
            continue
        if "error" in r:
            out.append(f"| {name} | {r['error']} | | | |")
            continue
        forward = rate(r, "forward_img_per_s") or (f"{r['spins_per_s']:.1f} spins/s" if "spins_per_s" in r else "")
        kept = f"{r['forward_kept']:.2f}" if "forward_kept" in r else ""
        host = f"{r['call_ms_per_batch']:.1f} / {r['wait_ms_per_batch']:.1f}" if "call_ms_per_batch" in r else ""
        out.append(f"| {name} | {rate(r, 'decode_img_per_s')} | {forward} | {kept} | {host} |")
    return out


def engines_lines(e: dict[str, Any]) -> list[str]:
    lines = [
        f"## The JPEG engines beside a forward (nvImageCodec {e.get('nvimgcodec')}; {e.get('image')}; batches of "
        f"{e.get('batch')}; {e.get('sms')} SMs)",
        "",
    ]
    if "note" in e:
        lines += [f"*{e['note']}*", ""]
    alone = e.get("alone", {})
    if "forward_img_per_s" in alone:
        names = {
            "hardware": "the engines",
            "hardware, preallocated": "the engines preallocated",
            "cuda": "the CUDA decoder",
        }
        decoders = [f"{names[k]} {rate(alone[k], 'decode_img_per_s')} img/s" for k in names if k in alone]
        lines += [f"Alone: the forward {alone['forward_img_per_s']:.0f} img/s; {'; '.join(decoders)}.", ""]
    for name, t in e.get("trace", {}).items():
        if isinstance(t, dict) and "per_batch" in t:
            lines += [
                f"### Traced, the engines {name}: {t['decode_img_per_s']:.0f} img/s; per batch "
                f"{t['call_ms_per_batch']:.1f} ms in the decoder's call, {t['wait_ms_per_batch']:.1f} ms waiting "
                "for its stream",
                "",
                *trace.lines(t["per_batch"], f"the engines {name}"),
            ]
    for section, title in (
        ("options", "nvImageCodec's options, beside the forward"),
        ("starvation", "SMs or synchronisation: the engines beside other work"),
        ("green contexts", "The forward on fewer SMs (green contexts, a process of their own), beside the engines"),
    ):
        if isinstance(e.get(section), dict):
            lines += [f"### {title}", "", *beside_rows(e[section]), ""]
    if "process" in e:
        lines += ["### The engines in a process of their own", "", *beside_rows({"own process": e["process"]}), ""]
    dali = e.get("dali", {})
    if "version" in dali:
        rows = {}
        for load, r in dali.items():
            if isinstance(r, dict) and "beside_forward" in r:
                rows[f"DALI {dali['version']}, {load}, alone"] = {
                    "decode_img_per_s": r["alone_img_per_s"],
                    **r["alone"],
                }
                rows[f"DALI {dali['version']}, {load}, beside the forward"] = r["beside_forward"]
        lines += ["### DALI's mixed decoder (VIT_DECODE=dali)", "", *beside_rows(rows), ""]
    elif "error" in dali:
        lines += [f"DALI: not measured ({dali['error']}).", ""]
    return lines
