"""The record every benchmark and evaluation result carries, and how a result is written: the commit measured,
the machine, the exact command line, then the figures; a `.md` beside each `.json` with its tables."""

from __future__ import annotations

import json
import os
import platform
import shlex
import subprocess
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def commit(tree: Path) -> str:
    """The short hash of the commit checked out in `tree`, marked "+changes" when its tracked files other than
    results and documentation differ."""
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=tree, capture_output=True, text=True)
    changed = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no", "--", ".", ":!*/results/*", ":!*.md"],
        cwd=tree,
        capture_output=True,
        text=True,
    )
    return head.stdout.strip() + ("+changes" if changed.stdout.strip() else "")


def command_line() -> str:
    """This run's command as it was typed: `python -m MODULE ARGS` for a module run with -m, after the service's
    and OpenTelemetry's variables set in its environment (`VIT_BACKEND=torch python -m ...`), which the servers it
    starts inherit."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    head = ["python", "-m", spec.name.removesuffix(".__main__")] if spec is not None else ["python", sys.argv[0]]
    settings = [f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith(("VIT_", "OTEL_"))]
    return shlex.join(settings + head + sys.argv[1:])


# The vector extensions that move CPU figures: int8 matrix products run several times faster with VNNI or AMX.
VECTOR_EXTENSIONS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_bf16", "amx_int8")


def cpu_field(name: str) -> str | None:
    """The first value of a field in /proc/cpuinfo (`model name`, `flags`), or None where there is none."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.split(":", 1)[0].strip() == name:
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cpu_model() -> str:
    return cpu_field("model name") or platform.machine()


def vector_extensions() -> list[str]:
    """Which of VECTOR_EXTENSIONS this CPU has."""
    flags = set((cpu_field("flags") or "").split())
    return [f for f in VECTOR_EXTENSIONS if f in flags]


def machine() -> dict[str, Any]:
    """The machine a run measured: its CPU and cores, and the GPU and its driver where this process used one."""
    found: dict[str, Any] = {"cpu": cpu_model(), "cores": os.cpu_count(), "vector_extensions": vector_extensions()}
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        found["gpu"] = torch.cuda.get_device_name()
        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, text=True
        )
        found["driver"] = smi.stdout.strip().splitlines()[0] if smi.returncode == 0 and smi.stdout.strip() else None
    return found


def run_record() -> dict[str, Any]:
    """What every result carries: the commit measured (this tree's; a comparison's rows name their own trees),
    the machine, and the command that reproduces it."""
    return {"commit": commit(ROOT), "machine": machine(), "command": command_line()}


def measured_line(record: dict[str, Any]) -> str:
    """The line a results table ends with: the commit, the machine and the command of its run."""
    where = record["machine"]
    extensions = f" ({', '.join(where['vector_extensions'])})" if where["vector_extensions"] else ""
    on = f"{where['cpu']}{extensions}, {where['cores']} cores" + (
        f", {where['gpu']} (driver {where['driver']})" if "gpu" in where else ""
    )
    return f"Measured at {record['commit']} on {on}: `{record['command']}`"


def write_results(folder: Path, name: str, report: dict[str, Any], text: str) -> None:
    """`folder`/<name>.json (the run's record, then the figures) and <name>.md (`text`, their tables, and the
    record in a line); the tables printed too."""
    record = run_record()
    text = text.rstrip("\n") + f"\n\n{measured_line(record)}\n"
    folder.mkdir(exist_ok=True)
    (folder / f"{name}.json").write_text(json.dumps({"record": record, **report}, indent=2) + "\n")
    (folder / f"{name}.md").write_text(text)
    print(text)


def table(header: Sequence[str], rows: Iterable[Sequence[object]], align: str | None = None) -> list[str]:
    """A markdown table's lines: the header, its alignment row and one line per row (each cell as `str`).

    `align` has a letter per column, `l` for text or `r` for numbers; by default the first column is text
    and the others numbers.
    """
    align = align or "l" + "r" * (len(header) - 1)
    if len(align) != len(header):
        raise ValueError(f"{len(header)} columns but {len(align)} alignments ({align!r})")
    lines = ["| " + " | ".join(header) + " |", "|" + "".join("---:|" if a == "r" else "---|" for a in align)]
    for row in rows:
        cells = list(row)
        if len(cells) != len(header):
            raise ValueError(f"a row of {len(cells)} cells in a table of {len(header)} columns: {cells}")
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return lines
