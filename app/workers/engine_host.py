"""The engine served to front-end processes (VIT_WORKERS > 1): one `Engine`, reached over a ZeroMQ socket.

The engine process owns the models and batches the images of every front-end together. It tells each
front-end what it serves (`State`: readiness and the model descriptions) when it first hears from it,
on every change, and every HEARTBEAT_S. It says it is ready only once every front-end started with it has
said hello (or FRONT_ENDS_WAIT_S has passed), and then to all of them at once: a client that saw one
front-end ready is not refused by another that has not heard from the engine yet. A repository change is
answered only once every front-end has applied the new state, so afterwards each process answers with the
new version.

A front-end sends the calls it has ready as one message (a list), and the replies computed in one go of
the event loop (a batch's requests finish together) leave as one message per front-end: the link costs a
message per batch, not per request. Every call enters the engine through its lane (`Lane.submit`); the calls read in
one go of the event loop (from every front-end) to one model with the same options, on files, enter it
together, and the engine queues them as one group where it can: the model looked up, the request checked and
the queue's room taken once for all of them. The busier the engine, the more calls each go reads, and the
less each costs.

A front-end that dies (its pid watched through a pidfd) has its calls cancelled and its arena unmapped.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import time
import uuid
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

import zmq

from app.core.contract.errors import ServiceError
from app.core.contract.inference import Inference
from app.core.contract.request import InferOptions
from app.core.engine.call import Call
from app.core.engine.engine import Engine
from app.core.engine.served_model import ServedModel
from app.workers import link
from app.workers.arena import Arena, read_inputs, viewed, write_outputs

log = logging.getLogger("app")
ACK_TIMEOUT_S = 2.0  # how long a repository change waits for every front-end to apply it
FRONT_ENDS_WAIT_S = 10.0  # how long readiness waits for every front-end to say hello (one may have died starting)


@dataclass(eq=False)
class Queued:
    """A call in the engine: how to cancel it, and the version computing it (whose batches may read its files)."""

    call: Call
    model: ServedModel


@dataclass(eq=False)
class Peer:
    """One front-end process."""

    identity: bytes
    pid: int
    arena: Arena | None
    queued: dict[int, Queued] = field(default_factory=dict)  # calls in the engine, by id
    replies: list[link.Reply] = field(default_factory=list)  # computed, not yet sent: they leave together
    acked: int = -1
    pidfd: int | None = None


class EngineHost:
    """`engine`, answering the front-ends that connect to `address` (an ipc:// endpoint); `front_ends`
    of them were started with it."""

    def __init__(self, engine: Engine, address: str, front_ends: int = 1) -> None:
        self.engine = engine
        self.address = address
        self.front_ends = front_ends
        self.met_all = front_ends <= 0  # every front-end said hello (or FRONT_ENDS_WAIT_S passed): ready may be said
        self.serving_since = time.monotonic()
        self.incarnation = uuid.uuid4().hex
        self.context = zmq.Context()
        self.channel: link.Channel | None = None  # while serving
        self.peers: dict[bytes, Peer] = {}
        self.seq = 0
        self.state = self.current_state()
        self.acked = asyncio.Event()  # set on each front-end's Ack
        self.tasks: set[asyncio.Task[None]] = set()
        self.flushing = False  # a send of the waiting replies is scheduled
        self.gathered: list[tuple[Peer, link.InferCall]] = []  # calls read in this go, to enter the batcher together

    def current_state(self) -> link.State:
        e = self.engine
        ready = e.ready() and self.met_all
        return link.State(self.incarnation, os.getpid(), self.seq, ready, e.taking_requests, tuple(e.models()))

    async def serve(self, stop: asyncio.Event) -> None:
        """Answer the front-ends until `stop` is set."""
        socket = self.context.socket(zmq.ROUTER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.bind(self.address)
        self.channel = link.Channel(socket, self.receive, "engine")
        self.serving_since = time.monotonic()
        beating = asyncio.create_task(self.heartbeat())
        try:
            await stop.wait()
        finally:
            beating.cancel()
            self.channel.close()
            for peer in list(self.peers.values()):
                self.forget(peer)

    def close(self) -> None:
        if self.channel is not None:
            self.channel.close()
        self.context.term()

    def send(self, peer: Peer, message: object) -> None:
        """`message` to a front-end (dropped when it is gone, as ZeroMQ drops what no peer can take), after
        the replies waiting for it."""
        if self.channel is not None:
            self.send_replies(peer)
            self.channel.send(message, peer.identity)

    def reply(self, peer: Peer, reply: link.Reply) -> None:
        """`reply` to a front-end with the others computed in this go of the event loop, as one message."""
        peer.replies.append(reply)
        if not self.flushing:
            self.flushing = True
            asyncio.get_running_loop().call_soon(self.flush)

    def flush(self) -> None:
        self.flushing = False
        for peer in list(self.peers.values()):
            self.send_replies(peer)

    def send_replies(self, peer: Peer) -> None:
        if peer.replies and self.channel is not None:
            replies, peer.replies = peer.replies, []
            self.channel.send(replies, peer.identity)

    def broadcast(self) -> link.State:
        """The current state to every front-end, with a new seq when it changed."""
        state = self.current_state()
        if (state.ready, state.taking_requests, state.models) != (
            self.state.ready,
            self.state.taking_requests,
            self.state.models,
        ):
            self.seq += 1
            state = self.current_state()
        self.state = state
        for peer in list(self.peers.values()):
            self.send(peer, state)
        return state

    async def heartbeat(self) -> None:
        while True:
            if not self.met_all and time.monotonic() - self.serving_since > FRONT_ENDS_WAIT_S:
                log.warning(
                    "engine: %d of %d front-ends said hello within %.0f s; ready without the others",
                    len(self.peers),
                    self.front_ends,
                    FRONT_ENDS_WAIT_S,
                )
                self.met_all = True
            self.broadcast()
            await asyncio.sleep(link.HEARTBEAT_S)

    def receive(self, sender: bytes | None, message: object) -> None:
        assert sender is not None  # a ROUTER's messages name their front-end
        for one in message if isinstance(message, list) else (message,):  # a front-end's calls, in order
            self.handle(sender, one)

    def handle(self, identity: bytes, message: object) -> None:
        if isinstance(message, link.InferCall) and self.gather(identity, message):
            return
        self.queue_gathered()  # what came before this message is queued before it is handled
        if isinstance(message, link.Hello):
            self.hello(identity, message)
            return
        peer = self.peers.get(identity)
        if peer is None:
            return  # from a front-end this engine has not met: it says hello again first
        if isinstance(message, link.Ack):
            peer.acked = max(peer.acked, message.seq)
            self.acked.set()
        elif isinstance(message, link.Cancel) and message.incarnation == self.incarnation:
            if (queued := peer.queued.get(message.id)) is not None:
                queued.call.cancel()
        elif isinstance(message, link.RepositoryCall) and message.incarnation == self.incarnation:
            self.spawn(self.repository(peer, message))
        elif isinstance(message, link.Refused) and message.incarnation == self.incarnation:
            self.engine.book.of(message.model, message.version).fail.add(message.seconds)

    def gather(self, identity: bytes, call: link.InferCall) -> bool:
        """Whether `call` joins the calls read in this go of the event loop, which enter the engine together once
        it ends. Any other message queues the calls gathered before it is handled, so that each front-end's
        messages keep their order."""
        peer = self.peers.get(identity)
        if peer is None or call.incarnation != self.incarnation:
            return False
        if not self.gathered:
            asyncio.get_running_loop().call_soon(self.queue_gathered)
        self.gathered.append((peer, call))
        return True

    def queue_gathered(self) -> None:
        """The calls gathered, into the engine: those on files to one model and version with the same options
        together (the engine queues them as one group where they all can), each other one on its own."""
        gathered, self.gathered = self.gathered, []
        together: dict[tuple[str | None, str | None, InferOptions], list[tuple[Peer, link.InferCall]]] = {}
        for peer, call in gathered:
            if self.peers.get(peer.identity) is not peer:  # gone since
                continue
            if call.images is None or call.texts is not None:
                self.submit([(peer, call)])
            else:
                together.setdefault((call.model, call.version, call.options), []).append((peer, call))
        for calls in together.values():
            self.submit(calls)

    def submit(self, calls: list[tuple[Peer, link.InferCall]]) -> None:
        """Calls to one model into the engine's lane (`Lane.submit`), each answered by `answer`."""
        first = calls[0][1]
        try:  # refused at once, all alike: no model by that name, an arena that cannot be read
            model = self.engine.model(first.model, first.version)
            engine_calls = [
                Call(
                    read_inputs(p.arena, c.images, c.pixels),
                    c.options,
                    c.timeout_s,
                    functools.partial(self.answer, p, c, model),
                    c.trace,
                    c.texts,
                )
                for p, c in calls
            ]
        except Exception as e:
            for peer, call in calls:
                self.reply(peer, failed(call.id, e))
            return
        for (peer, call), engine_call in zip(calls, engine_calls, strict=True):
            peer.queued[call.id] = Queued(engine_call, model)
        self.engine.lane.submit(model, engine_calls)

    def answer(self, peer: Peer, call: link.InferCall, model: ServedModel, done: Inference | BaseException) -> None:
        """A call's answer: its outputs written into its region, or what failed it. A call that failed while its
        files are still in the arena (a batch under way may read them) is answered once that batch has ended
        (and stays among the peer's queued calls until then, so that its arena outlives that batch)."""
        if isinstance(done, BaseException):
            reply = failed(call.id, done)
            if viewed(call.images):
                self.spawn(self.reply_when_settled(peer, call.id, model, reply))
                return
        else:
            try:
                reply = answered(call, done, peer.arena, model)
            except Exception as e:
                reply = failed(call.id, e)
        peer.queued.pop(call.id, None)
        if self.peers.get(peer.identity) is peer:
            self.reply(peer, reply)

    async def reply_when_settled(self, peer: Peer, call_id: int, model: ServedModel, reply: link.Reply) -> None:
        try:
            await settled(model)
        finally:
            peer.queued.pop(call_id, None)
        if self.peers.get(peer.identity) is peer:
            self.reply(peer, reply)

    def spawn(self, coroutine: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.ensure_future(coroutine)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    def hello(self, identity: bytes, hello: link.Hello) -> None:
        if identity not in self.peers:
            arena = Arena.attach(hello.arena) if hello.arena is not None else None
            peer = Peer(identity, hello.pid, arena)
            self.peers[identity] = peer
            self.watch(peer)
            log.info("engine: front-end pid %d connected", hello.pid)
            if not self.met_all and len(self.peers) >= self.front_ends:
                self.met_all = True
                self.broadcast()  # ready, to every front-end in the same go
                return
        self.send(self.peers[identity], self.state)

    def watch(self, peer: Peer) -> None:
        """Forget `peer` when its process exits."""
        try:
            peer.pidfd = os.pidfd_open(peer.pid)
        except (AttributeError, OSError):  # no pidfd (not Linux): its calls end by themselves
            return
        asyncio.get_running_loop().add_reader(peer.pidfd, self.forget, peer)

    def forget(self, peer: Peer) -> None:
        if self.peers.get(peer.identity) is not peer:
            return
        del self.peers[peer.identity]
        if peer.pidfd is not None:
            asyncio.get_running_loop().remove_reader(peer.pidfd)
            os.close(peer.pidfd)
        queued = list(peer.queued.values())
        steps = [q.call.steps for q in queued if q.call.steps is not None]
        for q in queued:
            q.call.cancel()
        log.info("engine: front-end pid %d gone; %d calls of it cancelled", peer.pid, len(queued))
        if peer.arena is not None:
            arena = peer.arena
            if queued:  # unmapped once its calls have stopped touching it
                self.spawn(close_after(steps, arena, [q.model for q in queued]))
            else:
                arena.close()

    async def repository(self, peer: Peer, call: link.RepositoryCall) -> None:
        try:
            if call.op == "index":
                reply = link.Reply(call.id, index=await self.engine.repository_index(call.ready_only))
            elif call.op == "statistics":
                reply = link.Reply(call.id, statistics=await self.engine.statistics(call.name, call.version))
            elif call.op == "shadow":
                assert call.name is not None
                reply = link.Reply(call.id, shadow=await self.engine.shadow_report(call.name))
            elif call.op == "teach":  # known at every front-end before the teacher hears of it
                assert call.name is not None and call.version is not None and call.embedded is not None
                head = await self.engine.keep_head(call.name, call.version, call.embedded)
                await self.applied_everywhere(self.broadcast())
                reply = link.Reply(call.id, head=head)
            elif call.op == "delete-head":
                assert call.name is not None and call.head is not None
                await self.engine.delete_head(call.name, call.head)
                await self.applied_everywhere(self.broadcast())
                reply = link.Reply(call.id)
            else:
                assert call.name is not None
                await (self.engine.load_model if call.op == "load" else self.engine.unload_model)(call.name)
                await self.applied_everywhere(self.broadcast())
                reply = link.Reply(call.id)
        except ServiceError as e:
            reply = link.Reply(call.id, failure=link.Failure.of(e))
        except Exception as e:
            log.exception("engine: unhandled error in a repository call")
            reply = link.Reply(call.id, failure=link.Failure.of(e))
        self.reply(peer, reply)

    async def applied_everywhere(self, state: link.State) -> None:
        """Wait (at most ACK_TIMEOUT_S) until every front-end has applied `state`."""
        deadline = time.monotonic() + ACK_TIMEOUT_S
        while not all(p.acked >= state.seq for p in self.peers.values()):
            self.acked.clear()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.acked.wait(), remaining)


def answered(call: link.InferCall, done: Inference, arena: Arena | None, model: ServedModel) -> link.Reply:
    """A computed call's reply: its outputs in its region, the description (20 KB pickled with 1,000 class
    names) only where the front-end lacks it, and the share of JPEGs the front-ends decode where the engine
    moves it."""
    outputs = write_outputs(arena, call.region, done.predictions, done.text_embeddings)
    share = model.decode_share.share if model.decode_share is not None and model.decode_share.auto else None
    described = None if done.model.version == call.described else done.model
    labels = done.labels if call.options.head is not None else None
    return link.Reply(call.id, described, outputs, cpu_decode_share=share, labels=labels)


def failed(call_id: int, error: BaseException) -> link.Reply:
    """What failed a call, as its reply: a cancelled one as a timeout; a fault that is no core error, logged."""
    if isinstance(error, asyncio.CancelledError):
        return link.Reply(call_id, failure=link.Failure("RequestTimeout", "cancelled"))
    if not isinstance(error, ServiceError):
        log.error("engine: unhandled error computing a request", exc_info=error)
    return link.Reply(call_id, failure=link.Failure.of(error))


async def settled(model: ServedModel) -> None:
    """Until the batches under way now, of `model` and of the versions that replaced it, have finished."""
    while True:
        await model.batcher.settled()
        if model.successor is None:
            return
        model = model.successor


async def close_after(calls: list[asyncio.Task[None]], arena: Arena, models: list[ServedModel] | None = None) -> None:
    """Unmap `arena` once the steps of its calls (`calls`) have ended and the batches under way of `models`
    (whose calls may have left files in it) have settled."""
    if calls:
        await asyncio.wait(calls)
    for model in models or []:
        await settled(model)
    arena.close()
