"""The messages between serving front-ends and the engine process (VIT_WORKERS > 1), and how outputs travel.

They go as pickles over ZeroMQ (a DEALER socket in each front-end, the engine's ROUTER): small headers only.
A request's images (the files, with the pixels the front-end decoded; or pixels) and its outputs travel
through the front-end's shared-memory arena (`app.workers.arena`): the call names the region, the engine
reads the inputs out of it and writes the outputs back into it. A request larger than the arena's free room
goes inline in the message instead.

Every message to the engine names the engine incarnation it was meant for: one sent to an engine that
has since died is ignored by its successor, which could otherwise write into a region already reused.
"""

from __future__ import annotations

import asyncio
import logging
import pickle
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq

from app.core.contract import errors
from app.core.contract.description import ModelDescription, ModelStatus, ShadowReport
from app.core.contract.request import InferOptions
from app.core.contract.teaching import Embedded
from app.telemetry.statistics import ModelStatistics
from app.workers.arena import Region, Stored, StoredImage, StoredOutputs

log = logging.getLogger("app")

READ_AT_ONCE = 64  # messages read in one go before the event loop runs anything else
HEARTBEAT_S = 0.5  # the engine's state goes to every front-end at least this often
ENGINE_SILENT_S = 5.0  # where a process cannot be watched through a pidfd: the engine is gone after this silence


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
class InferCall:
    id: int
    incarnation: str
    model: str | None
    version: str | None
    options: InferOptions
    timeout_s: float | None
    images: list[StoredImage] | None  # None for pixels
    pixels: Stored | None
    region: Region | None  # in the front-end's arena: inputs in, outputs out
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
    op: str  # index, load, unload, statistics, shadow, teach or delete-head
    name: str | None = None
    ready_only: bool = False
    version: str | None = None  # statistics of one version; teach: the version that embedded the examples
    embedded: Embedded | None = None  # teach: the examples' embeddings, to fit a head on
    head: str | None = None  # delete-head


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
    head: Mapping[str, Any] | None = None  # teach: what a listing says of the head
    # infer, for a head: the classes of the head that answered (one taught again meanwhile may have others)
    labels: tuple[str, ...] | None = None
    # infer, with VIT_CPU_DECODE_SHARE=auto: the share of the model's plain JPEGs the front-ends decode from now on
    cpu_decode_share: float | None = None


class Channel:
    """A ZeroMQ socket on the running event loop, without a future per message: each message read, as it
    arrives, goes unpickled to `on_message` with its sender (a ROUTER's peer; None on a DEALER); a send never
    waits (it fails at once where ZeroMQ would block). A message that cannot be handled is logged as `name`'s,
    and the next one is read.

    ZeroMQ's file descriptor signals edges, not levels: it turns readable when the socket's events may have
    changed, and any call on the socket may take that edge. So every go reads until nothing is left, and a
    send that leaves messages unread schedules a go.
    """

    def __init__(
        self, socket: zmq.Socket[bytes], on_message: Callable[[bytes | None, object], None], name: str
    ) -> None:
        self.socket = socket
        self.on_message = on_message
        self.name = name
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
            try:
                # from a socket in a directory only this user can enter (mkdtemp: 0700)
                self.on_message(frames[0] if len(frames) > 1 else None, pickle.loads(frames[-1]))
            except Exception:  # one bad message never leaves a process deaf
                log.exception("%s: a message could not be handled", self.name)
            if self.closed:
                return
        self.loop.call_soon(self.read)  # more may wait: after what else is ready to run

    def send(self, message: object, to: bytes | None = None) -> bool:
        """`message` pickled, to the peer `to` of a ROUTER; whether ZeroMQ took it (not when no peer is
        connected, or its queue is full)."""
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        try:
            self.socket.send_multipart([data] if to is None else [to, data], zmq.NOBLOCK)
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
