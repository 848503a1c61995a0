"""A front-end's shared-memory arena: where a request's images go to the engine and its outputs come back.

Each serving front-end (VIT_WORKERS > 1) creates one file in a memory file system (/dev/shm), maps it and
hands out regions of it, one per request in flight; the engine maps the same file, reads a request's
inputs out of its region and writes the outputs back into it. Only the front-end allocates and frees, on
its event loop, so the allocator needs no lock; a region is freed once the engine has answered for it.
The whole file is reserved when it is created (`posix_fallocate`), so a memory file system too small for it
is an error then, not a crash when a page is first touched.
"""

from __future__ import annotations

import bisect
import contextlib
import math
import mmap
import os
from pathlib import Path

import numpy as np
import torch

ALIGN = 64  # a cache line: every region and every tensor written into one starts on one


def aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class Arena:
    """A file mapped into memory, `size` bytes; `create`d by its owner, `attach`ed by the engine."""

    def __init__(self, path: Path, size: int, mapping: mmap.mmap) -> None:
        self.path = path
        self.size = size
        self.map = mapping
        self.view = memoryview(mapping)
        self._starts: list[int] = []  # allocated regions, sorted by offset
        self._sizes: dict[int, int] = {}

    @classmethod
    def create(cls, path: Path, size: int) -> Arena:
        """A new arena file of `size` bytes, reserved in full; OSError when the file system cannot hold it."""
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as e:
                os.unlink(path)
                raise OSError(
                    e.errno,
                    f"cannot reserve {size // 2**20} MiB of shared memory in {path.parent} ({e.strerror}); "
                    "give the container more /dev/shm (compose: shm_size; Kubernetes: an emptyDir of medium "
                    "Memory at /dev/shm)",
                ) from None
            return cls(path, size, mmap.mmap(fd, size))
        finally:
            os.close(fd)

    @classmethod
    def attach(cls, path: Path) -> Arena:
        """The arena another process created at `path`."""
        fd = os.open(path, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            return cls(path, size, mmap.mmap(fd, size))
        finally:
            os.close(fd)

    def close(self) -> None:
        self.view.release()
        # Views of it may still be held (a batch under way): then it is unmapped when the last one goes.
        with contextlib.suppress(BufferError):
            self.map.close()

    def unlink(self) -> None:
        self.close()
        self.path.unlink(missing_ok=True)

    # The owner's allocator: first fit over the gaps between regions in use.
    def allocate(self, size: int) -> int | None:
        """The offset of a free region of at least `size` bytes, or None when no gap is that large."""
        size = aligned(max(size, 1))
        previous_end = 0
        for index, start in enumerate(self._starts):
            if start - previous_end >= size:
                return self._take(index, previous_end, size)
            previous_end = start + self._sizes[start]
        if self.size - previous_end >= size:
            return self._take(len(self._starts), previous_end, size)
        return None

    def _take(self, index: int, offset: int, size: int) -> int:
        self._starts.insert(index, offset)
        self._sizes[offset] = size
        return offset

    def free(self, offset: int) -> None:
        del self._sizes[offset]
        del self._starts[bisect.bisect_left(self._starts, offset)]

    @property
    def in_use(self) -> int:
        """Bytes held by regions in use."""
        return sum(self._sizes.values())

    # Both sides: bytes and tensors at offsets.
    def write(self, offset: int, data: bytes | memoryview) -> int:
        """`data` at `offset`; the offset after it, aligned."""
        self.view[offset : offset + len(data)] = data
        return offset + aligned(len(data))

    def read(self, offset: int, length: int) -> bytes:
        return bytes(self.view[offset : offset + length])

    def view_of(self, offset: int, length: int) -> memoryview:
        """The bytes at `offset`, not copied: valid while the region holding them is."""
        return self.view[offset : offset + length]

    def write_tensor(self, offset: int, tensor: torch.Tensor) -> int:
        """A CPU tensor's values at `offset`, row-major; the offset after them, aligned."""
        values = tensor.detach().contiguous().numpy()
        if values.size == 0:
            return offset
        return self.write(offset, values.tobytes() if not values.flags.c_contiguous else values.data.cast("B"))

    def write_values(self, offset: int, tensor: torch.Tensor) -> int:
        """A CPU tensor's values at `offset`, row-major; the offset right after them (not aligned: the next
        row of a block follows at once)."""
        values = (tensor.detach() if tensor.requires_grad else tensor).numpy()
        if values.size == 0:
            return offset
        if not values.flags.c_contiguous:
            values = np.ascontiguousarray(values)
        end = offset + values.nbytes
        self.view[offset:end] = values.data.cast("B")
        return end

    def read_tensor(self, offset: int, shape: tuple[int, ...], dtype: str) -> torch.Tensor:
        """A copy of the tensor `write_tensor` put at `offset`."""
        count = math.prod(shape)
        values = np.frombuffer(self.map, dtype=dtype, count=count, offset=offset)
        return torch.from_numpy(values.copy()).reshape(shape)


def tensor_bytes(shape: tuple[int, ...], itemsize: int = 4) -> int:
    """The aligned room a tensor of `shape` takes in an arena."""
    return aligned(math.prod(shape) * itemsize)
