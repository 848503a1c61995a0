"""The shared-memory arena: first-fit regions, bytes and tensors seen alike through a second mapping."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from app.workers.shared_memory import ALIGN, Arena


def test_regions_are_aligned_first_fit_and_reused(tmp_path: Path) -> None:
    arena = Arena.create(tmp_path / "a.shm", 1024)
    a, b, c = arena.allocate(100), arena.allocate(1), arena.allocate(200)
    assert (a, b, c) == (0, 128, 192)
    assert all(offset % ALIGN == 0 for offset in (a, b, c))
    assert arena.allocate(1024) is None  # no gap that large
    arena.free(b)
    assert arena.allocate(64) == 128  # the first gap that fits
    arena.free(a)
    assert arena.allocate(129) == 448  # the gap at 0 is too small: after the last region
    assert arena.in_use == 64 + 256 + 192
    arena.unlink()
    assert not (tmp_path / "a.shm").exists()


def test_what_one_mapping_writes_the_other_reads(tmp_path: Path) -> None:
    owner = Arena.create(tmp_path / "a.shm", 1 << 16)
    engine = Arena.attach(tmp_path / "a.shm")
    assert engine.size == owner.size
    offset = owner.allocate(4096)
    assert offset is not None
    after = owner.write(offset, b"jpeg bytes")
    assert engine.read(offset, 10) == b"jpeg bytes"
    probabilities = torch.softmax(torch.randn(3, 10), dim=1)
    engine.write_tensor(after, probabilities)
    read = owner.read_tensor(after, (3, 10), "float32")
    torch.testing.assert_close(read, probabilities)
    owner.write(after, b"\0" * 120)  # a copy: later writes do not change it
    torch.testing.assert_close(read, probabilities)
    engine.close()
    owner.unlink()


def test_a_file_system_too_small_is_an_error_at_creation(tmp_path: Path) -> None:
    with pytest.raises(OSError, match="cannot reserve"):
        Arena.create(tmp_path / "a.shm", 1 << 62)
    assert not (tmp_path / "a.shm").exists()
