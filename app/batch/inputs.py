"""What a batch job reads: files, directories (recursive), glob patterns and lists of paths, expanded in order."""

from __future__ import annotations

import glob
from pathlib import Path

# What a directory contributes; files named explicitly or matched by a pattern are taken whatever their suffix
IMAGE_SUFFIXES = frozenset({".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif"})


class InputError(ValueError):
    """An input that names nothing: a missing file, an empty pattern or list."""


def expand_inputs(inputs: list[str]) -> list[str]:
    """Paths in the order given, each once: FILE, DIR (its image files, recursively, sorted), a glob
    PATTERN (sorted matches; `**` recurses), or @LIST (a text file of paths or patterns, one a line)."""
    paths: dict[str, None] = {}  # ordered set
    for item in inputs:
        for path in expand_one(item):
            paths.setdefault(path)
    return list(paths)


def expand_one(item: str) -> list[str]:
    if item.startswith("@"):
        listing = Path(item[1:])
        try:
            lines = [line.strip() for line in listing.read_text().splitlines()]
        except OSError as e:
            raise InputError(f"{item}: cannot read the list of paths ({e.strerror})") from None
        return [p for line in lines if line and not line.startswith("#") for p in expand_one(line)]
    path = Path(item)
    if path.is_dir():
        found = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)
        return [str(p) for p in found]
    if glob.has_magic(item):
        matches = sorted(m for m in glob.glob(item, recursive=True) if Path(m).is_file())
        if not matches:
            raise InputError(f"{item}: the pattern matches no file")
        return matches
    if not path.exists():
        raise InputError(f"{item}: no such file or directory")
    return [item]
