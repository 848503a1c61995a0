"""Where a batch job's rows go: a journal while it runs, then the output file, written whole or not at all.

Rows are appended to `OUTPUT.partial` (JSON Lines, flushed and synced after every window of images),
so an interrupted run loses at most the window in flight and `--resume` knows what is done. At the
end the output is written in the format its suffix names (`.jsonl`, `.csv` or `.parquet`) to a
temporary file beside it and renamed into place: a reader never sees a half-written output.
"""

from __future__ import annotations

import csv
import json
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

FORMATS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".csv": "csv", ".parquet": "parquet"}
LIST_COLUMNS = {"top_k_labels", "top_k_probabilities", "probabilities", "embedding", "attention"}

Row = dict[str, Any]


class OutputError(ValueError):
    """An output that cannot be written or resumed."""


def output_format(path: Path) -> str:
    """The output's format by its suffix, checked before any image is computed (Parquet needs pyarrow), as is
    the folder it goes in."""
    found = FORMATS.get(path.suffix.lower())
    if found is None:
        raise OutputError(f"{path}: the output's suffix names its format: {', '.join(FORMATS)}")
    if not path.parent.is_dir():
        raise OutputError(f"{path}: there is no folder {path.parent} to write it in")
    if found == "parquet":
        parquet()
    return found


def journal_path(output: Path) -> Path:
    return output.with_name(output.name + ".partial")


def read_journal(path: Path) -> list[Row]:
    """The complete rows of a journal; a torn last line (the process stopped mid-write) is dropped."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines(keepends=True):
        if not line.endswith("\n"):
            break
        rows.append(json.loads(line))
    return rows


class Journal:
    """Rows of a run in progress, one JSON object a line, starting from `rows` (those already done)."""

    def __init__(self, path: Path, rows: list[Row]) -> None:
        self.path = path
        atomic_write(path, "".join(json.dumps(r) + "\n" for r in rows).encode())
        self.file = path.open("a", encoding="utf-8")

    def append(self, rows: list[Row]) -> None:
        self.file.write("".join(json.dumps(r) + "\n" for r in rows))
        self.file.flush()
        os.fsync(self.file.fileno())

    def close(self) -> None:
        self.file.close()


def read_output(path: Path) -> list[Row]:
    """The rows of a finished output (to resume from it)."""
    fmt = output_format(path)
    if fmt == "jsonl":
        return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if fmt == "csv":
        with path.open(newline="", encoding="utf-8") as f:
            return [from_csv(r) for r in csv.DictReader(f)]
    pq = parquet()
    return list(pq.read_table(path).to_pylist())


def write_output(path: Path, rows: list[Row], columns: list[str]) -> None:
    """All rows to `path` in its format, through a temporary file renamed into place."""
    fmt = output_format(path)
    if fmt == "jsonl":
        data = "".join(json.dumps({c: r.get(c) for c in columns}) + "\n" for r in rows).encode()
        atomic_write(path, data)
    elif fmt == "csv":
        with atomic_file(path) as tmp, tmp.open("w", newline="", encoding="utf-8") as f:
            writer = csv.DictWriter(f, fieldnames=columns)
            writer.writeheader()
            writer.writerows(to_csv(r, columns) for r in rows)
    else:
        pq = parquet()
        import pyarrow as pa

        table = pa.Table.from_pylist([{c: r.get(c) for c in columns} for r in rows], schema=arrow_schema(columns))
        with atomic_file(path) as tmp:
            pq.write_table(table, tmp)


def arrow_schema(columns: list[str]) -> Any:
    import pyarrow as pa

    types = {
        "path": pa.string(),
        "label": pa.string(),
        "probability": pa.float64(),
        "error": pa.string(),
        "top_k_labels": pa.list_(pa.string()),
        "top_k_probabilities": pa.list_(pa.float64()),
        "probabilities": pa.list_(pa.float64()),
        "embedding": pa.list_(pa.float64()),
        "attention": pa.list_(pa.list_(pa.float64())),
    }
    return pa.schema([(c, types[c]) for c in columns])


def to_csv(row: Row, columns: list[str]) -> dict[str, str]:
    """Lists as JSON text; a missing value as an empty cell."""
    out = {}
    for c in columns:
        v = row.get(c)
        out[c] = "" if v is None else json.dumps(v) if c in LIST_COLUMNS else str(v)
    return out


def from_csv(row: dict[str, str]) -> Row:
    out: Row = {}
    for c, v in row.items():
        if v == "":
            out[c] = None
        elif c in LIST_COLUMNS:
            out[c] = json.loads(v)
        elif c == "probability":
            out[c] = float(v)
        else:
            out[c] = v
    return out


def parquet() -> Any:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise OutputError("Parquet output needs pyarrow: pip install 'vit-serve[batch]' (or pyarrow)") from None
    return pq


def atomic_write(path: Path, data: bytes) -> None:
    with atomic_file(path) as tmp:
        tmp.write_bytes(data)


@contextmanager
def atomic_file(path: Path) -> Iterator[Path]:
    """`with atomic_file(path) as tmp:` write tmp; on success it replaces `path`, on failure it is removed."""
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        with tmp.open("rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
