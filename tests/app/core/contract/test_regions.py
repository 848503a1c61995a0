"""The system shared-memory regions: what registering takes and refuses, reads and writes through descriptors
opened for each use (read-only to read), and one directory shared by several processes' registries."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from app.core.contract.errors import AlreadyExists, InvalidInput, NotSupported, PayloadTooLarge, RegionNotFound
from app.core.contract.regions import MAX_U64, SHM_ROOT, SharedMemoryRegions

pytestmark = pytest.mark.skipif(not SHM_ROOT.is_dir(), reason="POSIX shared memory lives in /dev/shm on Linux")


@pytest.fixture
def shm() -> Iterator[tuple[str, Path]]:
    """A 4 KiB shared-memory object, as shm_open makes one: its key and its file."""
    name = f"vit-test-{uuid.uuid4().hex}"
    path = SHM_ROOT / name
    path.write_bytes(bytes(range(256)) * 16)
    yield "/" + name, path
    path.unlink(missing_ok=True)


@pytest.fixture
def regions(tmp_path: Path) -> SharedMemoryRegions:
    return SharedMemoryRegions(tmp_path, limit=3)


def open_descriptors() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def test_a_region_reads_and_writes_its_span_of_the_object(regions: SharedMemoryRegions, shm: tuple[str, Path]) -> None:
    key, path = shm
    region = regions.register("r", key, 256, 1024)
    assert regions.status() == [region] and regions.status("r") == [region]
    before = open_descriptors()
    assert regions.read("r", 16, 4, "input", limit=1 << 20) == bytes([16, 17, 18, 19])  # object bytes 272..275
    regions.write("r", 8, 100, b"abc", "output")
    assert path.read_bytes()[264:267] == b"abc"
    assert open_descriptors() == before  # nothing kept open (or mapped) past the call


def test_the_key_without_its_slash_names_the_same_object(regions: SharedMemoryRegions, shm: tuple[str, Path]) -> None:
    key, _ = shm
    regions.register("r", key.lstrip("/"), 0, 16)
    assert regions.read("r", 0, 2, "input", limit=16) == b"\x00\x01"


@pytest.mark.parametrize("key", ["/etc/passwd", "../etc/passwd", "a/b", "/", "", ".", "..", "x" * 256, "a\0b"])
def test_a_key_that_names_a_path_or_no_object_name_is_refused(regions: SharedMemoryRegions, key: str) -> None:
    with pytest.raises(InvalidInput, match="not the name of a shared-memory object"):
        regions.register("r", key, 0, 1)
    assert regions.status() == []


def test_a_key_that_is_no_object_is_refused(regions: SharedMemoryRegions, shm: tuple[str, Path]) -> None:
    with pytest.raises(InvalidInput, match="there is none of that name"):
        regions.register("r", f"/vit-test-missing-{uuid.uuid4().hex}", 0, 1)
    _, path = shm
    link = SHM_ROOT / f"vit-test-link-{uuid.uuid4().hex}"
    link.symlink_to(path)
    fifo = SHM_ROOT / f"vit-test-fifo-{uuid.uuid4().hex}"
    os.mkfifo(fifo)
    folder = SHM_ROOT / f"vit-test-dir-{uuid.uuid4().hex}"
    folder.mkdir()
    try:
        with pytest.raises(InvalidInput, match="unable to open"):  # never through a link (O_NOFOLLOW)
            regions.register("r", "/" + link.name, 0, 1)
        with pytest.raises(InvalidInput, match="is not a shared-memory object"):  # opened without blocking
            regions.register("r", "/" + fifo.name, 0, 1)
        with pytest.raises(InvalidInput, match="is not a shared-memory object|unable to open"):
            regions.register("r", "/" + folder.name, 0, 1)
    finally:
        link.unlink()
        fifo.unlink()
        folder.rmdir()
    assert regions.status() == []


@pytest.mark.parametrize(
    ("offset", "byte_size"),
    [(0, 4097), (4096, 1), (4000, 100), (MAX_U64, 1), (1, MAX_U64), (MAX_U64 + 1, 0), (-1, 4), (0, -4), (True, 4)],
)
def test_offsets_and_sizes_outside_the_object_or_overflowing_are_refused(
    regions: SharedMemoryRegions, shm: tuple[str, Path], offset: int, byte_size: int
) -> None:
    key, _ = shm
    with pytest.raises(InvalidInput):
        regions.register("r", key, offset, byte_size)
    assert regions.status() == []


def test_spans_outside_the_region_are_refused(regions: SharedMemoryRegions, shm: tuple[str, Path]) -> None:
    key, _ = shm
    regions.register("r", key, 1024, 64)
    for offset, size in [(0, 65), (64, 1), (60, 8), (MAX_U64, 1), (1, MAX_U64), (-1, 1), ("0", 1), (0, None)]:
        with pytest.raises(InvalidInput):
            regions.read("r", offset, size, "input 'image'", limit=1 << 20)
        with pytest.raises(InvalidInput):
            regions.check("r", offset, size, "output 'probabilities'")


def test_an_output_larger_than_its_span_is_refused_and_nothing_is_written(
    regions: SharedMemoryRegions, shm: tuple[str, Path]
) -> None:
    key, path = shm
    regions.register("r", key, 0, 64)
    before = path.read_bytes()
    with pytest.raises(InvalidInput, match="needs 40 bytes; shared_memory_byte_size gives 32"):
        regions.write("r", 0, 32, b"x" * 40, "output 'probabilities'")
    assert path.read_bytes() == before


def test_an_object_shrunk_after_registering_is_neither_read_past_nor_grown(
    regions: SharedMemoryRegions, shm: tuple[str, Path]
) -> None:
    key, path = shm
    regions.register("r", key, 0, 4096)
    os.truncate(path, 100)  # a mapping would now fault past byte 100 (SIGBUS); a read just comes up short
    with pytest.raises(InvalidInput, match="holds fewer bytes"):
        regions.read("r", 0, 200, "input 'image'", limit=1 << 20)
    with pytest.raises(InvalidInput, match="no longer holds"):
        regions.write("r", 0, 4096, b"y" * 200, "output 'probabilities'")
    assert path.stat().st_size == 100


def test_a_read_larger_than_the_upload_limit_is_too_large(regions: SharedMemoryRegions, shm: tuple[str, Path]) -> None:
    key, _ = shm
    regions.register("r", key, 0, 4096)
    with pytest.raises(PayloadTooLarge, match="VIT_MAX_UPLOAD_BYTES"):
        regions.read("r", 0, 4096, "input 'image'", limit=1024)


def test_inputs_are_read_through_a_read_only_descriptor(
    regions: SharedMemoryRegions, shm: tuple[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    key, _ = shm
    regions.register("r", key, 0, 64)
    opened: list[int] = []
    real_open = os.open

    def spy(path: object, flags: int, *args: object) -> int:
        if str(path).startswith(str(SHM_ROOT / key.lstrip("/"))):
            opened.append(flags)
        return real_open(path, flags, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "open", spy)
    regions.read("r", 0, 8, "input", limit=64)
    regions.write("r", 0, 8, b"12345678", "output")
    read_flags, write_flags = opened
    assert read_flags & os.O_ACCMODE == os.O_RDONLY and read_flags & os.O_NOFOLLOW
    assert write_flags & os.O_ACCMODE == os.O_RDWR and write_flags & os.O_NOFOLLOW


def test_a_name_is_taken_once_and_free_again_after_unregister(
    regions: SharedMemoryRegions, shm: tuple[str, Path]
) -> None:
    key, _ = shm
    regions.register("r", key, 0, 16)
    with pytest.raises(AlreadyExists, match="already registered"):
        regions.register("r", key, 16, 16)
    assert regions.status("r")[0].offset == 0
    regions.unregister("r")
    with pytest.raises(InvalidInput, match="no system shared-memory region named 'r'"):
        regions.read("r", 0, 1, "input 'image'", limit=16)
    with pytest.raises(RegionNotFound):
        regions.status("r")
    regions.unregister("r")  # nothing of that name: nothing to do
    regions.register("r", key, 16, 16)
    assert regions.status("r")[0].offset == 16


def test_the_limit_holds_and_unregistering_all_frees_it(regions: SharedMemoryRegions, shm: tuple[str, Path]) -> None:
    key, _ = shm
    for name in ("a", "b", "c"):
        regions.register(name, key, 0, 16)
    with pytest.raises(InvalidInput, match="3 shared-memory regions are registered"):
        regions.register("d", key, 0, 16)
    regions.unregister()
    assert regions.status() == []
    regions.register("d", key, 0, 16)


def test_registries_that_share_a_directory_share_the_regions(tmp_path: Path, shm: tuple[str, Path]) -> None:
    """Serving front-ends (VIT_WORKERS > 1): registered through one, used and unregistered through another."""
    key, _ = shm
    one, other = SharedMemoryRegions(tmp_path, 4), SharedMemoryRegions(tmp_path, 4)
    one.register("r", key, 0, 32)
    assert other.read("r", 0, 4, "input", limit=64) == b"\x00\x01\x02\x03"
    with pytest.raises(AlreadyExists):
        other.register("r", key, 0, 32)
    other.unregister("r")
    assert one.status() == []
    other.close()  # a shared directory is its owner's to remove
    assert tmp_path.is_dir()


def test_a_registry_of_its_own_makes_its_directory_when_first_used_and_removes_it(shm: tuple[str, Path]) -> None:
    key, _ = shm
    regions = SharedMemoryRegions(None, 4)
    assert regions.status() == [] and regions.made is None  # nothing made until a region is registered
    regions.register("r", key, 0, 8)
    made = regions.directory
    assert made.is_dir()
    regions.close()
    assert not made.exists()


def test_off_when_the_limit_is_zero(tmp_path: Path, shm: tuple[str, Path]) -> None:
    key, _ = shm
    with pytest.raises(NotSupported, match="VIT_SHARED_MEMORY_REGIONS=0"):
        SharedMemoryRegions(tmp_path, 0).register("r", key, 0, 8)
