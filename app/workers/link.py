"""The messages between serving front-ends and the engine process (VIT_WORKERS > 1), and how outputs travel.

They go as pickles over ZeroMQ (a DEALER socket in each front-end, the engine's ROUTER): small headers only.
A request's images (the files, with the pixels the front-end decoded; or pixels) and its outputs travel
through the front-end's shared-memory arena (`app.workers.shared_memory`): the call names the region, the
engine reads the inputs out of it and writes the outputs back into it. A request larger than the arena's
free room goes inline in the message instead.

Every message to the engine names the engine incarnation it was meant for: one sent to an engine that
has since died is ignored by its successor, which could otherwise write into a region already reused.
"""

from __future__ import annotations

import asyncio
import pickle
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch
import zmq

from app.core.contract import errors
from app.core.contract.description import ModelDescription, ModelStatus, ShadowReport
from app.core.contract.request import DecodedImage, EncodedImage, InferOptions, Prediction
from app.telemetry.statistics import ModelStatistics
from app.workers.shared_memory import Arena, aligned, tensor_bytes

READ_AT_ONCE = 64  # messages read in one go before the event loop runs anything else
HEARTBEAT_S = 0.5  # the engine's state goes to every front-end at least this often
ENGINE_SILENT_S = 5.0  # where a process cannot be watched through a pidfd: the engine is gone after this silence


# Where a value lives: an arena offset with its shape and dtype, or the value itself (inline).
Stored = tuple[int, tuple[int, ...], str] | torch.Tensor
StoredBytes = tuple[int, int] | bytes  # (offset, length), or the bytes


@dataclass(frozen=True)
class Hello:
    """A front-end introducing itself (again, until the engine answers): its pid and arena file."""

    pid: int
    arena: Path | None


@dataclass(frozen=True)
class State:
    """What the engine serves, sent to every front-end on each change and as its heartbeat."""

    incarnation: str  # new for every engine process
    pid: int
    seq: int  # grows with every change
    ready: bool
    taking_requests: bool
    models: tuple[ModelDescription, ...]  # the default first


@dataclass(frozen=True)
class Ack:
    """A front-end has applied state `seq`."""

    seq: int


@dataclass(frozen=True)
class StoredImage:
    """One image file of a call, and its pixels when the front-end prepared it (a `DecodedImage`)."""

    filename: str
    data: StoredBytes
    version: str | None = None  # the model version it was prepared for; None: the engine decodes it
    pixels: Stored | None = None  # None with a version: a checked JPEG the GPU decodes
    decode_s: float = 0.0


@dataclass(frozen=True)
class InferCall:
    id: int
    incarnation: str
    model: str | None
    version: str | None
    options: InferOptions
    timeout_s: float | None
    images: list[StoredImage] | None  # None for pixels
    pixels: Stored | None
    region: tuple[int, int] | None  # (offset, size) in the front-end's arena: inputs in, outputs out
    described: str  # the version the front-end looked up: a reply computed by it leaves its description out
    trace: dict[str, str] | None = None  # the request's trace context (W3C headers), when traced
    texts: tuple[str, ...] | None = None  # a zero-shot model's texts to embed (no images then)


@dataclass(frozen=True)
class Cancel:
    """The client went away (or its deadline passed): stop computing call `id`. The engine still answers."""

    id: int
    incarnation: str


@dataclass(frozen=True)
class Refused:
    """A request to `model` whose images the front-end refused while decoding them (a broken file, say),
    never sent: the engine counts it in the version's `fail` statistics, as it counts those it refuses."""

    incarnation: str
    model: str
    version: str
    seconds: float


@dataclass(frozen=True)
class RepositoryCall:
    id: int
    incarnation: str
    op: str  # index, load, unload, statistics or shadow
    name: str | None = None
    ready_only: bool = False
    version: str | None = None  # statistics of one version


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


@dataclass(frozen=True)
class Failure:
    """A core error, rebuilt on the other side as the same exception type."""

    kind: str  # the name of an app.core.contract.errors.ServiceError subclass; "" for an internal fault
    detail: str
    retry_after_s: int | None = None

    @classmethod
    def of(cls, e: BaseException) -> Failure:
        if isinstance(e, errors.ServiceError):
            return cls(type(e).__name__, e.detail, e.retry_after_s)
        return cls("", f"{type(e).__name__}: {e}")

    def exception(self) -> Exception:
        kind = getattr(errors, self.kind, None) if self.kind else None
        if isinstance(kind, type) and issubclass(kind, errors.ServiceError):
            return kind(self.detail, self.retry_after_s)
        return RuntimeError(f"the engine process failed: {self.detail}")


@dataclass(frozen=True)
class Reply:
    id: int
    model: ModelDescription | None = None  # infer: the version that computed it, when not the one the call named
    outputs: StoredOutputs | None = None
    index: list[ModelStatus] | None = None  # repository index
    statistics: list[ModelStatistics] | None = None
    shadow: ShadowReport | None = None
    failure: Failure | None = None


class Channel:
    """A ZeroMQ socket on the running event loop, without a future per message: each message read, as it
    arrives, goes to `on_message` (its frames); a send never waits (it fails at once where ZeroMQ would block).

    ZeroMQ's file descriptor signals edges, not levels: it turns readable when the socket's events may have
    changed, and any call on the socket may take that edge. So every go reads until nothing is left, and a
    send that leaves messages unread schedules a go.
    """

    def __init__(self, socket: zmq.Socket[bytes], on_message: Callable[[list[bytes]], None]) -> None:
        self.socket = socket
        self.on_message = on_message
        self.loop = asyncio.get_running_loop()
        fd = socket.getsockopt(zmq.FD)
        assert isinstance(fd, int)
        self.fd = fd
        self.loop.add_reader(self.fd, self.read)
        self.loop.call_soon(self.read)  # what arrived before the reader was added
        self.closed = False

    def read(self) -> None:
        if self.closed:
            return
        for _ in range(READ_AT_ONCE):
            try:
                frames = self.socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self.on_message(frames)
            if self.closed:
                return
        self.loop.call_soon(self.read)  # more may wait: after what else is ready to run

    def send(self, frames: list[bytes]) -> bool:
        """Whether ZeroMQ took the message (not when no peer is connected, or its queue is full)."""
        try:
            self.socket.send_multipart(frames, zmq.NOBLOCK)
            sent = True
        except zmq.ZMQError:  # Again: no peer, or its queue is full; or the socket is closing
            sent = False
        if not self.closed and self.unread():
            self.loop.call_soon(self.read)  # this call may have taken the edge that said so
        return sent

    def unread(self) -> bool:
        events = self.socket.getsockopt(zmq.EVENTS)
        return isinstance(events, int) and bool(events & zmq.POLLIN)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.loop.remove_reader(self.fd)
            self.socket.close(linger=0)


def dumps(message: object) -> bytes:
    return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)


def loads(data: bytes) -> object:
    return pickle.loads(data)  # from a socket in a directory only this user can enter (mkdtemp: 0700)


def output_bytes(model: ModelDescription, options: InferOptions, images: int, texts: int = 0) -> int:
    """The arena room one request's outputs take (overlays aside: their size is known only once drawn)."""
    room = tensor_bytes((images, len(model.classes_for(options.labels))))
    if texts:
        room += tensor_bytes((texts, model.embedding_dim))
    if options.attention != "none":
        room += tensor_bytes((images, model.grid_size, model.grid_size))
    if options.embedding:
        room += tensor_bytes((images, model.embedding_dim))
    return room


class RegionWriter:
    """Values written one after another into a region of `arena`, (offset, size); each one that does not fit
    (or without an arena or region) stays inline, as itself."""

    def __init__(self, arena: Arena | None, region: tuple[int, int] | None) -> None:
        self.arena = arena if region is not None else None
        self.offset, size = region if region is not None else (0, 0)
        self.end = self.offset + size

    def tensor(self, t: torch.Tensor) -> Stored:
        room = tensor_bytes(tuple(t.shape), t.element_size())
        if self.arena is None or self.offset + room > self.end or t.dtype != torch.float32:
            return t
        stored = (self.offset, tuple(t.shape), "float32")
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


def store_outputs(
    predictions: list[Prediction], into: RegionWriter, text_embeddings: torch.Tensor | None = None
) -> StoredOutputs:
    """The predictions (and a text request's embeddings), each kind as one block of rows, written into the
    region where they fit, inline where they do not."""
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


def viewed(stored: list[StoredImage] | None) -> bool:
    """Whether `load_images` leaves some of these files in the arena."""
    return stored is not None and any(s.version is not None and not isinstance(s.data, bytes) for s in stored)


def read_bytes(arena: Arena | None, stored: StoredBytes) -> bytes:
    if isinstance(stored, bytes):
        return stored
    assert arena is not None
    return arena.read(*stored)


def store_images(images: Sequence[EncodedImage | DecodedImage], into: RegionWriter) -> list[StoredImage]:
    """The files (and the pixels of those decoded) written into the region; inline where they do not fit."""
    return [
        StoredImage(i.filename, into.data(i.data))
        if isinstance(i, EncodedImage)
        else StoredImage(
            i.filename, into.data(i.data), i.version, None if i.pixels is None else into.tensor(i.pixels), i.decode_s
        )
        for i in images
    ]


def input_bytes(images: Sequence[EncodedImage | DecodedImage]) -> int:
    """The arena room `store_images` takes."""
    room = 0
    for i in images:
        room += aligned(len(i.data))
        if isinstance(i, DecodedImage) and i.pixels is not None:
            room += tensor_bytes(tuple(i.pixels.shape), i.pixels.element_size())
    return room


def load_images(stored: list[StoredImage], arena: Arena | None) -> list[EncodedImage | DecodedImage]:
    """The files of a call, and the pixels the front-end decoded. The files the front-end prepared stay in the
    arena, as views (`viewed`): the engine answers such a call only once no batch can still read them. The
    files the engine decodes, and the pixels, are copied out."""
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
        for s in stored
    ]


def load_predictions(stored: StoredOutputs, arena: Arena | None) -> list[Prediction]:
    """The predictions, copied out of the arena (each image's tensors are rows of its request's blocks)."""
    probabilities = read_tensor(arena, stored.probabilities)
    maps = None if stored.attention_maps is None else read_tensor(arena, stored.attention_maps)
    embeddings = None if stored.embeddings is None else read_tensor(arena, stored.embeddings)
    overlays = None if stored.overlays is None else [read_bytes(arena, o) for o in stored.overlays]
    return [
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
