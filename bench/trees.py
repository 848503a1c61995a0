"""Two or more checkouts measured against each other: each run in its own processes with its own code, the trees
alternating so that whatever else the machine does over the run falls on every tree alike."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


def alternated(trees: Sequence[Path], repeats: int, run: Callable[[Path], T]) -> dict[str, list[T]]:
    """`run(tree)` for every tree, `repeats` times, in the order reversed every other repeat (A B, B A, A B, ...);
    each tree's results under its path, in the order they were measured."""
    runs: dict[str, list[T]] = {str(t): [] for t in trees}
    for repeat in range(repeats):
        for tree in trees if repeat % 2 == 0 else trees[::-1]:
            runs[str(tree)].append(run(tree))
    return runs
