"""The one markdown-table writer of every results file in bench/results."""

from __future__ import annotations

from collections.abc import Iterable, Sequence


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
