"""A front-end's shared-memory arena, and where one call's inputs and outputs lie in a region of it.

Each serving front-end (VIT_WORKERS > 1) creates one file in a memory file system (/dev/shm), maps it and
hands out regions of it, one per call in flight; the engine maps the same file. A call's region is large
enough for its inputs and for its outputs, which the engine writes over them:

1. the front-end writes the call's files (with the pixels it decoded), or its pixels (`write_inputs`);
2. the engine reads them (`read_inputs`): the files the front-end prepared stay in the arena, as views;
3. the engine writes the outputs, each kind as one block of rows (`write_outputs`);
4. the front-end reads them back (`read_outputs`) and frees the region.

The messages carry only where each value lies (`Stored`, `StoredBytes`); a value that does not fit, and every
value of a front-end without an arena, travels inline, as itself, pickled with the message.

Only the front-end allocates and frees, on its event loop, so the allocator needs no lock; a region is freed
once the engine has answered for it. The whole file is reserved when it is created (`posix_fallocate`), so a
memory file system too small for it is an error then, not a crash when a page is first touched.
"""

from __future__ import annotations

import bisect
import contextlib
import math
import mmap
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import numpy as np
import torch

from app.core.contract.description import ModelDescription
from app.core.contract.request import DecodedImage, EncodedImage, InferOptions, Prediction

ALIGN = 64  # a cache line: every region and every tensor written into one starts on one
ARENA_DTYPES = {torch.float32: "float32", torch.uint8: "uint8"}  # tensors written into a region; others inline

# Where a value lives: an arena offset with its shape and dtype, or the value itself (inline).
Stored = tuple[int, tuple[int, ...], str] | torch.Tensor
StoredBytes = tuple[int, int] | bytes  # (offset, length), or the bytes
Region = tuple[int, int]  # (offset, size) in an arena


@dataclass(frozen=True)
class StoredImage:
    """One image file of a call, and its pixels when the front-end prepared it (a `DecodedImage`)."""

    filename: str
    data: StoredBytes
    version: str | None = None  # the model version it was prepared for; None: the engine decodes it
    pixels: Stored | None = None  # None with a version: a checked JPEG the GPU decodes
    decode_s: float = 0.0


@dataclass(frozen=True)
class StoredInputs:
    """A call's inputs as written: its region (None: all inline), and its files or its pixels."""

    region: Region | None
    images: list[StoredImage] | None  # None for pixels
    pixels: Stored | None


@dataclass(frozen=True)
class StoredOutputs:
    """A request's outputs, each kind as one block of all its images (options are the same for every image)."""

    filenames: list[str]
    probabilities: Stored  # (N, classes)
    attention_maps: Stored | None  # (N, grid, grid)
    embeddings: Stored | None  # (N, dim)
    overlays: list[StoredBytes] | None
    ood_scores: list[float] | None = None  # per image, when asked for
    ood: list[bool] | None = None  # per image, where a threshold is set
    text_embeddings: Stored | None = None  # (T, D): a text request's


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


# 1. The front-end: a call's inputs into a region of its arena.
def write_inputs(
    arena: Arena | None,
    inputs: Sequence[EncodedImage | DecodedImage] | torch.Tensor,
    model: ModelDescription,
    options: InferOptions,
    texts: int = 0,
) -> StoredInputs:
    """`inputs` written into a region allocated for them and for the outputs `model` gives them with `options`
    (and `texts` texts embedded); inline without an arena, or where no region that large is free."""
    count = inputs.shape[0] if isinstance(inputs, torch.Tensor) else len(inputs)
    size = max(input_bytes(inputs), output_bytes(model, options, count, texts))
    offset = arena.allocate(size) if arena is not None else None
    region = None if offset is None else (offset, size)
    into = RegionWriter(arena, region)
    if isinstance(inputs, torch.Tensor):
        return StoredInputs(region, None, into.tensor(inputs.detach().cpu().contiguous()))
    images = [
        StoredImage(i.filename, into.data(i.data))
        if isinstance(i, EncodedImage)
        else StoredImage(
            i.filename, into.data(i.data), i.version, None if i.pixels is None else into.tensor(i.pixels), i.decode_s
        )
        for i in inputs
    ]
    return StoredInputs(region, images, None)


def input_bytes(inputs: Sequence[EncodedImage | DecodedImage] | torch.Tensor) -> int:
    """The room `write_inputs` takes for `inputs`."""
    if isinstance(inputs, torch.Tensor):
        return aligned(inputs.numel() * inputs.element_size())
    room = 0
    for i in inputs:
        room += aligned(len(i.data))
        if isinstance(i, DecodedImage) and i.pixels is not None:
            room += tensor_bytes(tuple(i.pixels.shape), i.pixels.element_size())
    return room


def output_bytes(model: ModelDescription, options: InferOptions, images: int, texts: int = 0) -> int:
    """The room one request's outputs take (overlays aside: their size is known only once drawn)."""
    room = tensor_bytes((images, len(model.classes_for(model.answer_labels(options)))))
    if texts:
        room += tensor_bytes((texts, model.embedding_dim))
    if options.attention != "none":
        room += tensor_bytes((images, model.grid_size, model.grid_size))
    if options.embedding:
        room += tensor_bytes((images, model.embedding_dim))
    return room


# 2. The engine: a call's inputs out of the front-end's arena.
def read_inputs(
    arena: Arena | None, images: list[StoredImage] | None, pixels: Stored | None
) -> list[EncodedImage | DecodedImage] | torch.Tensor:
    """A call's files, and the pixels the front-end decoded; or its pixels. The files the front-end prepared stay
    in the arena, as views (`viewed`): the engine answers such a call only once no batch can still read them.
    The files the engine decodes, and the pixels, are copied out."""
    if images is None:
        assert pixels is not None
        return read_tensor(arena, pixels)
    return [
        EncodedImage(s.filename, read_bytes(arena, s.data))
        if s.version is None
        else DecodedImage(
            s.filename,
            view_bytes(arena, s.data),
            s.version,
            None if s.pixels is None else read_tensor(arena, s.pixels),
            s.decode_s,
        )
        for s in images
    ]


def viewed(images: list[StoredImage] | None) -> bool:
    """Whether `read_inputs` leaves some of these files in the arena."""
    return images is not None and any(s.version is not None and not isinstance(s.data, bytes) for s in images)


# 3. The engine: a call's outputs into its region.
def write_outputs(
    arena: Arena | None,
    region: Region | None,
    predictions: list[Prediction],
    text_embeddings: torch.Tensor | None = None,
) -> StoredOutputs:
    """The predictions (and a text request's embeddings), each kind as one block of rows, written into the
    region where they fit, inline where they do not."""
    into = RegionWriter(arena, region)
    if not predictions:
        empty = None if text_embeddings is None else into.tensor(text_embeddings.contiguous())
        return StoredOutputs([], torch.empty(0, 0), None, None, None, text_embeddings=empty)
    first = predictions[0]  # each image has the tensors and scores the first has (its options are theirs); an
    # overlay only where its image could be drawn
    maps = None if first.attention_map is None else every([p.attention_map for p in predictions])
    embeddings = None if first.embedding is None else every([p.embedding for p in predictions])
    return StoredOutputs(
        [p.filename for p in predictions],
        into.rows([p.probabilities for p in predictions]),
        None if maps is None else into.rows(maps),
        None if embeddings is None else into.rows(embeddings),
        None
        if all(p.overlay_png is None for p in predictions)
        else [into.data(p.overlay_png or b"") for p in predictions],
        None if first.ood_score is None else cast("list[float]", [p.ood_score for p in predictions]),
        None if first.ood is None else cast("list[bool]", [p.ood for p in predictions]),
        None if text_embeddings is None else into.tensor(text_embeddings.contiguous()),
    )


def every(tensors: list[torch.Tensor | None]) -> list[torch.Tensor] | None:
    """A request's tensors of one kind, one per image; None when no image has one."""
    if all(t is None for t in tensors):
        return None
    if any(t is None for t in tensors):
        raise ValueError("some images of a request have this output and some do not")
    return cast("list[torch.Tensor]", tensors)


# 4. The front-end: a call's outputs out of its region, before it frees it.
def read_outputs(arena: Arena | None, stored: StoredOutputs) -> tuple[list[Prediction], torch.Tensor | None]:
    """The predictions, copied out of the arena (each image's tensors are rows of its request's blocks), and a
    text request's embeddings."""
    probabilities = read_tensor(arena, stored.probabilities)
    maps = None if stored.attention_maps is None else read_tensor(arena, stored.attention_maps)
    embeddings = None if stored.embeddings is None else read_tensor(arena, stored.embeddings)
    overlays = None if stored.overlays is None else [read_bytes(arena, o) for o in stored.overlays]
    predictions = [
        Prediction(
            filename,
            probabilities[i],
            None if maps is None else maps[i],
            None if overlays is None else overlays[i] or None,
            None if embeddings is None else embeddings[i],
            None if stored.ood_scores is None else stored.ood_scores[i],
            None if stored.ood is None else stored.ood[i],
        )
        for i, filename in enumerate(stored.filenames)
    ]
    texts = None if stored.text_embeddings is None else read_tensor(arena, stored.text_embeddings)
    return predictions, texts


# Both sides: values one after another in a region, or inline.
class RegionWriter:
    """Values written one after another into a region of `arena`, (offset, size); each one that does not fit
    (or without an arena or region) stays inline, as itself."""

    def __init__(self, arena: Arena | None, region: tuple[int, int] | None) -> None:
        self.arena = arena if region is not None else None
        self.offset, size = region if region is not None else (0, 0)
        self.end = self.offset + size

    def tensor(self, t: torch.Tensor) -> Stored:
        """A float32 tensor (outputs, normalised pixels) or a uint8 one (pixels a GPU normalises)."""
        room = tensor_bytes(tuple(t.shape), t.element_size())
        dtype = ARENA_DTYPES.get(t.dtype)
        if self.arena is None or self.offset + room > self.end or dtype is None:
            return t
        stored = (self.offset, tuple(t.shape), dtype)
        self.offset = self.arena.write_tensor(self.offset, t)
        return stored

    def rows(self, rows: list[torch.Tensor]) -> Stored:
        """Tensors of one shape as one (N, ...) block, each written right after the one before (no stack is
        made: a request's rows are written as they are); stacked inline where they do not fit."""
        first = rows[0]
        shape = (len(rows), *first.shape)
        room = tensor_bytes(shape)
        if self.arena is None or self.offset + room > self.end or first.dtype != torch.float32:
            return torch.stack(rows)
        at = self.arena.write_values(self.offset, first)
        for row in rows[1:]:
            if row.shape != first.shape or row.dtype != first.dtype:
                raise ValueError(f"rows of one block differ: {tuple(row.shape)} against {tuple(first.shape)}")
            at = self.arena.write_values(at, row)
        stored = (self.offset, shape, "float32")
        self.offset += room
        return stored

    def data(self, b: bytes | memoryview) -> StoredBytes:
        if self.arena is None or self.offset + aligned(len(b)) > self.end:
            return bytes(b)  # inline: pickled with the message
        stored = (self.offset, len(b))
        self.offset = self.arena.write(self.offset, b)
        return stored


def read_tensor(arena: Arena | None, stored: Stored) -> torch.Tensor:
    if isinstance(stored, torch.Tensor):
        return stored
    assert arena is not None
    offset, shape, dtype = stored
    return arena.read_tensor(offset, shape, dtype)


def view_bytes(arena: Arena | None, stored: StoredBytes) -> bytes | memoryview:
    if isinstance(stored, bytes):
        return stored
    assert arena is not None
    return arena.view_of(*stored)


def read_bytes(arena: Arena | None, stored: StoredBytes) -> bytes:
    if isinstance(stored, bytes):
        return stored
    assert arena is not None
    return arena.read(*stored)
