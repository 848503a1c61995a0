"""A front-end's data plane over an engine served on a ZeroMQ socket (VIT_WORKERS > 1), both in this
process: the same answers as the engine, inputs and outputs through the arena (or inline when it is
full), regions held until the engine has answered, errors rebuilt as the core's types, and a silent
engine turning the front-end unready."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from app.core.contract.errors import (
    ModelNotFound,
    NotReady,
    Overloaded,
    PayloadTooLarge,
    RequestTimeout,
    UnsupportedMediaType,
)
from app.core.contract.inference import Inference, InferenceRequest
from app.core.contract.request import EncodedImage, InferOptions
from app.core.data_plane import DataPlane
from app.core.engine.engine import Engine
from app.settings import Settings
from app.telemetry import spans
from app.telemetry.metrics import Metrics
from app.workers import engine_client, engine_host, link
from app.workers.arena import Arena, StoredImage, read_outputs
from app.workers.engine_client import EngineClient
from app.workers.engine_host import EngineHost
from app.workers.link import Cancel, InferCall, Reply
from harness.images import encode
from model.shapes import make_sample
from tests.support.checkpoints import write_tiny_checkpoint
from tests.support.clients import slow_batches, slow_forward, until

FILES = [EncodedImage(f"{i}.png", encode(make_sample(5, i).image)) for i in range(3)]


@dataclass
class Linked:
    engine: Engine
    host: EngineHost
    plane: EngineClient
    arena: Arena
    stop: asyncio.Event  # set: the engine stops answering


@asynccontextmanager
async def hosted(engine: Engine, folder: Path, front_ends: int = 1) -> AsyncIterator[Callable[..., Awaitable[Linked]]]:
    """`engine` served at an ipc:// address under `folder`, started with `front_ends` front-ends; yields a maker
    of front-end data planes over it."""
    address = f"ipc://{folder / 'engine.sock'}"
    host = EngineHost(engine, address, front_ends)
    stop = asyncio.Event()
    serving = asyncio.create_task(host.serve(stop))
    planes: list[EngineClient] = []

    async def make(arena_bytes: int = 1 << 20) -> Linked:
        arena = Arena.create(folder / f"arena{len(planes)}.shm", arena_bytes)
        plane = EngineClient(engine.settings, Metrics(), address, arena)
        planes.append(plane)
        await plane.start()
        assert await plane.wait_engine(5)
        return Linked(engine, host, plane, arena, stop)

    try:
        yield make
    finally:
        for plane in planes:
            await plane.shutdown()
        stop.set()
        await serving
        host.close()


@pytest.fixture
async def make_linked(service: Engine, tmp_path: Path) -> AsyncIterator[Callable[..., Awaitable[Linked]]]:
    async with hosted(service, tmp_path) as make:
        yield make


def asked(plane: DataPlane, inputs: Any, options: InferOptions, **more: Any) -> InferenceRequest:
    """A request to the default model, as an edge builds it."""
    return InferenceRequest(plane.describe(None), inputs, options, **more)


def identity(done: Inference) -> Inference:
    return done


async def test_the_answers_are_the_engines(make_linked: Callable[..., Awaitable[Linked]]) -> None:
    linked: Linked = await make_linked()
    options = InferOptions("rollout", overlay=True, embedding=True, normalize=True)
    request = asked(linked.engine, FILES, options)
    expected = await linked.engine.infer(request, identity)
    got = await linked.plane.infer(request, identity)
    assert got.model == expected.model
    for g, e in zip(got.predictions, expected.predictions, strict=True):
        assert g.filename == e.filename
        torch.testing.assert_close(g.probabilities, e.probabilities)
        torch.testing.assert_close(g.attention_map, e.attention_map)
        torch.testing.assert_close(g.embedding, e.embedding)
        assert g.overlay_png == e.overlay_png
    assert linked.arena.in_use == 0  # every region given back


async def test_the_front_end_decodes_and_the_engine_only_batches(make_linked: Callable[..., Awaitable[Linked]]) -> None:
    """The engine's own preparer refusing every image shows who decodes: the front-end's pixels are served;
    with the response cache on (the front-end then sends the files), the engine decodes and refuses them."""
    linked: Linked = await make_linked()
    expected = await linked.engine.infer(asked(linked.engine, FILES, InferOptions("last")), identity)
    linked.engine.model(None).preparer.max_pixels = 1
    got = await linked.plane.infer(asked(linked.plane, FILES, InferOptions("last")), identity)
    for g, e in zip(got.predictions, expected.predictions, strict=True):
        assert g.filename == e.filename
        torch.testing.assert_close(g.probabilities, e.probabilities)
        torch.testing.assert_close(g.attention_map, e.attention_map)
    linked.plane.decodes = False
    with pytest.raises(PayloadTooLarge, match=r"0\.png: .* over the limit of 1"):
        await linked.plane.infer(asked(linked.plane, FILES, InferOptions()), identity)
    assert linked.arena.in_use == 0


async def test_pixels_travel_too(make_linked: Callable[..., Awaitable[Linked]]) -> None:
    linked: Linked = await make_linked()
    model = linked.engine.model(None)
    pixels = torch.stack([model.preparer.prepare(f, keep_image=False).pixels for f in FILES])
    expected = await linked.engine.infer(asked(linked.engine, pixels, InferOptions()), identity)
    got = await linked.plane.infer(asked(linked.plane, pixels, InferOptions()), identity)
    for g, e in zip(got.predictions, expected.predictions, strict=True):
        torch.testing.assert_close(g.probabilities, e.probabilities)


async def test_calls_made_together_travel_as_one_message_each_way(
    make_linked: Callable[..., Awaitable[Linked]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Requests that reach the link in one go of the front-end's event loop leave as one message, and the
    replies the engine computes in one go come back as one: the link costs a message per batch, not per
    request. Each request still gets its own answer."""
    linked: Linked = await make_linked()
    model = linked.engine.model(None)
    pixels = torch.stack([model.preparer.prepare(f, keep_image=False).pixels for f in FILES])
    expected = await linked.engine.infer(asked(linked.engine, pixels, InferOptions()), identity)
    to_engine: list[object] = []
    to_front: list[object] = []
    assert linked.plane.channel is not None and linked.host.channel is not None
    for channel, seen in ((linked.plane.channel, to_engine), (linked.host.channel, to_front)):
        monkeypatch.setattr(channel, "send", spy(channel.send, seen))
    slow_forward(model, 0.3)  # the first request's batch computes while the others queue: they form one batch
    requests = [asked(linked.engine, pixels[i : i + 1], InferOptions()) for i in range(len(FILES))] * 2
    got = await asyncio.gather(*(linked.plane.infer(r, identity) for r in requests))
    calls = [m for m in to_engine if isinstance(m, list)]
    assert [len(m) for m in calls] == [len(requests)]  # made in one go: one message
    replies = [m for m in to_front if isinstance(m, list)]
    assert sum(len(m) for m in replies) == len(requests) and len(replies) < len(requests)
    for i, done in enumerate(got):
        torch.testing.assert_close(
            done.predictions[0].probabilities, expected.predictions[i % len(FILES)].probabilities
        )
    assert linked.arena.in_use == 0


def spy(send: Callable[..., bool], seen: list[object]) -> Callable[..., bool]:
    """A channel's `send`, recording each message it carries."""

    def sending(message: object, to: bytes | None = None) -> bool:
        seen.append(message)
        return send(message, to)

    return sending


async def test_requests_larger_than_the_arena_go_inline(make_linked: Callable[..., Awaitable[Linked]]) -> None:
    linked: Linked = await make_linked(arena_bytes=4096)
    assert sum(len(f.data) for f in FILES) > 4096
    expected = await linked.engine.infer(asked(linked.engine, FILES, InferOptions("last")), identity)
    got = await linked.plane.infer(asked(linked.plane, FILES, InferOptions("last")), identity)
    for g, e in zip(got.predictions, expected.predictions, strict=True):
        torch.testing.assert_close(g.probabilities, e.probabilities)
        torch.testing.assert_close(g.attention_map, e.attention_map)


async def test_a_cancelled_call_holds_its_region_until_the_engine_answers(
    make_linked: Callable[..., Awaitable[Linked]],
) -> None:
    linked: Linked = await make_linked()
    slow_forward(linked.engine.model(None), 0.5)
    call = asyncio.create_task(linked.plane.infer(asked(linked.plane, FILES, InferOptions()), identity))
    await until(lambda: linked.arena.in_use > 0)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    assert linked.arena.in_use > 0  # the engine may still write its outputs there
    await until(lambda: linked.arena.in_use == 0, timeout=10)
    assert linked.plane.pending == {}


async def test_a_call_cancelled_while_its_batch_computes_is_answered_once_the_batch_has_ended(
    make_linked: Callable[..., Awaitable[Linked]],
) -> None:
    """The engine batches the files a front-end prepared as views of its arena, not copies: so a call cancelled
    while its images are in a batch under way is answered, and its region given back for reuse, only once
    that batch has ended."""
    linked: Linked = await make_linked()
    under_way, ended = slow_batches(linked.engine.model(None), 0.5)
    call = asyncio.create_task(linked.plane.infer(asked(linked.plane, FILES, InferOptions()), identity))
    await until(under_way.is_set)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    await until(lambda: linked.arena.in_use == 0, timeout=10)
    assert ended.is_set()  # the region came back only after the batch reading it ended


async def test_a_plain_call_is_answered_from_its_batch_without_a_task_and_counted_as_in_one_process(
    make_linked: Callable[..., Awaitable[Linked]],
) -> None:
    """Files the front-end prepared, with no step to take first (no overlay, no trace, no cache): the engine
    queues them in its batcher at once and answers from the batch's callback, with no task of its own. The
    answer and the statistics are what the engine gives in one process."""
    linked: Linked = await make_linked()
    options = InferOptions("rollout", embedding=True, normalize=True)
    expected = await linked.engine.infer(asked(linked.engine, FILES, options), identity)
    [before] = await linked.plane.statistics()
    [peer] = linked.host.peers.values()
    under_way = slow_forward(linked.engine.model(None), 0.3)
    call = asyncio.create_task(linked.plane.infer(asked(linked.plane, FILES, options), identity))
    await until(under_way.is_set)
    [queued] = peer.queued.values()
    assert queued.call.steps is None  # queued at once: no task
    got = await call
    for g, e in zip(got.predictions, expected.predictions, strict=True):
        assert g.filename == e.filename
        torch.testing.assert_close(g.probabilities, e.probabilities)
        torch.testing.assert_close(g.attention_map, e.attention_map)
        torch.testing.assert_close(g.embedding, e.embedding)
    [after] = await linked.plane.statistics()
    assert after.inference_count - before.inference_count == len(FILES)
    assert after.success.count - before.success.count == 1 and after.fail.count == before.fail.count
    for kind in ("queue", "compute_input", "compute_infer", "compute_output"):
        assert getattr(after, kind).count - getattr(before, kind).count == 1, kind
    assert peer.queued == {} and linked.arena.in_use == 0


async def test_calls_read_in_one_go_enter_the_batcher_together_and_are_each_answered_and_counted(
    make_linked: Callable[..., Awaitable[Linked]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The calls the engine reads in one go, from every front-end, to one model with the same options enter the
    batcher as one group. Each still gets its own outputs and is counted as a request of its own; one cancelled
    is answered as cancelled, and not counted."""
    first, second = await make_linked(), await make_linked()
    engine, host = first.engine, first.host
    model = engine.model(None)
    options = InferOptions("rollout")
    expected = await engine.infer(asked(engine, FILES, options), identity)
    [before] = await first.plane.statistics()
    groups: list[int] = []
    submit_group = model.batcher.submit_group

    def spying(*args: Any) -> Any:
        groups.append(len(args[1]))  # the requests' image counts: one per request
        return submit_group(*args)

    monkeypatch.setattr(model.batcher, "submit_group", spying)
    images = [
        StoredImage(f.filename, f.data, model.version, model.preparer.prepare(f, keep_image=False).pixels)
        for f in FILES
    ]
    answers: dict[int, asyncio.Future[Reply]] = {}
    for linked in (first, second):
        [peer] = [p for p in host.peers.values() if p.arena is not None and p.arena.path == linked.arena.path]
        for image in images:
            call_id = 3000 + len(answers)
            answers[call_id] = asyncio.get_running_loop().create_future()
            linked.plane.pending[call_id] = engine_client.Pending(answers[call_id], None)
            host.handle(
                peer.identity, InferCall(call_id, host.incarnation, None, None, options, None, [image], None, None, "")
            )
    assert groups == []  # gathered until the go ends, or until another message comes
    host.handle(peer.identity, Cancel(3004, host.incarnation))  # the second front-end's second call
    assert groups == [6]
    for call_id, answer in answers.items():
        reply = await asyncio.wait_for(answer, 10)
        if call_id == 3004:
            assert reply.failure is not None and reply.failure.kind == "RequestTimeout"
            continue
        assert reply.failure is None and reply.outputs is not None
        [got], _ = read_outputs(None, reply.outputs)
        want = expected.predictions[(call_id - 3000) % len(FILES)]
        assert got.filename == want.filename
        torch.testing.assert_close(got.probabilities, want.probabilities)
        torch.testing.assert_close(got.attention_map, want.attention_map)
    [after] = await first.plane.statistics()
    assert after.success.count - before.success.count == 5 and after.fail.count == before.fail.count
    assert after.inference_count - before.inference_count == 5
    assert after.queue.count - before.queue.count == 5
    assert all(p.queued == {} for p in host.peers.values())


async def test_a_call_that_sampling_left_out_is_queued_at_once_and_a_sampled_one_gets_its_spans(
    make_linked: Callable[..., Awaitable[Linked]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With tracing on, a call carries its request's trace context. One that sampling left out records no span,
    so it is queued at once like an untraced call; a sampled one takes its steps on a task, under which the
    engine's spans are made."""
    monkeypatch.setattr(spans, "recording", True)  # as once a tracer provider is installed
    linked: Linked = await make_linked()
    model = linked.engine.model(None)
    host = linked.host
    [peer] = host.peers.values()
    under_way = slow_forward(model, 0.3)
    images = [
        StoredImage(f.filename, f.data, model.version, model.preparer.prepare(f, keep_image=False).pixels)
        for f in FILES
    ]
    answers: dict[int, asyncio.Future[Reply]] = {}
    for call_id, flags in ((1001, "00"), (1002, "01")):  # not sampled, sampled
        answers[call_id] = asyncio.get_running_loop().create_future()
        linked.plane.pending[call_id] = engine_client.Pending(answers[call_id], None)
        trace = {"traceparent": f"00-{'ab' * 16}-{'cd' * 8}-{flags}"}
        call = InferCall(call_id, host.incarnation, None, None, InferOptions(), None, images, None, None, "", trace)
        host.handle(peer.identity, call)
    await asyncio.sleep(0)  # the calls read in this go enter the engine once it ends
    assert peer.queued[1001].call.steps is None and peer.queued[1002].call.steps is not None
    await until(under_way.is_set)
    for call_id in answers:
        reply = await asyncio.wait_for(answers[call_id], 10)
        assert reply.failure is None and reply.outputs is not None
        assert reply.outputs.filenames == [f.filename for f in FILES]


async def test_a_direct_call_past_its_deadline_in_a_batch_is_answered_once_the_batch_has_ended(
    make_linked: Callable[..., Awaitable[Linked]],
) -> None:
    """A call whose deadline passes while its prepared files are in a batch under way times out, counted as a
    failure, and is answered (its region given back) only after that batch, which reads the files in place."""
    linked: Linked = await make_linked()
    _, ended = slow_batches(linked.engine.model(None), 0.6)
    [before] = await linked.plane.statistics()
    with pytest.raises(RequestTimeout):
        await linked.plane.infer(asked(linked.plane, FILES, InferOptions(), timeout_s=0.2), identity)
    assert ended.is_set()  # the answer waited for the batch reading the call's files
    assert linked.arena.in_use == 0
    [after] = await linked.plane.statistics()
    assert after.fail.count - before.fail.count == 1 and after.success.count == before.success.count


async def test_a_front_end_gone_mid_batch_has_its_arena_unmapped_only_after_that_batch(
    make_linked: Callable[..., Awaitable[Linked]],
) -> None:
    """The engine forgets a front-end that exits with a call in its batcher: the call is dropped, and the
    front-end's arena, which the batch under way reads the call's files from, is unmapped once that batch ends."""
    linked: Linked = await make_linked()
    under_way, ended = slow_batches(linked.engine.model(None), 0.5)
    [peer] = linked.host.peers.values()
    call = asyncio.create_task(linked.plane.infer(asked(linked.plane, FILES, InferOptions()), identity))
    await until(under_way.is_set)
    assert peer.arena is not None and len(peer.queued) == 1
    linked.host.forget(peer)  # as when its pidfd says the process exited
    assert not peer.arena.map.closed
    await until(lambda: peer.arena is not None and peer.arena.map.closed, timeout=10)
    assert ended.is_set()
    call.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await call


async def test_a_call_cancelled_before_the_engine_ran_it_is_answered_all_the_same(
    make_linked: Callable[..., Awaitable[Linked]],
) -> None:
    """The engine may read a call and its Cancel in one go, before the call's steps have run at all: it still
    answers, since the front-end holds the call's region until then."""
    linked: Linked = await make_linked()
    host = linked.host
    [peer] = host.peers.values()
    answer: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()
    linked.plane.pending[999] = engine_client.Pending(answer, None)
    images = [StoredImage(f.filename, f.data) for f in FILES]
    call = InferCall(999, host.incarnation, None, None, InferOptions(), None, images, None, None, "")
    host.handle(peer.identity, call)
    host.handle(peer.identity, Cancel(999, host.incarnation))  # nothing awaited in between: it never ran
    reply = await asyncio.wait_for(answer, 5)
    assert reply.failure is not None and reply.failure.kind == "RequestTimeout"
    assert 999 not in peer.queued


async def test_a_reply_describes_its_version_only_when_the_call_named_another(
    make_linked: Callable[..., Awaitable[Linked]],
) -> None:
    """The description (with every class name) travels only where the front-end lacks it: a version
    replaced between the front-end's lookup and the engine's answer."""
    linked: Linked = await make_linked()
    host = linked.host
    [peer] = host.peers.values()
    version = linked.engine.model(None).version
    images = [StoredImage(f.filename, f.data) for f in FILES]
    for k, (described, expected) in enumerate(((version, None), ("older", linked.engine.model(None).description))):
        answer: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()
        linked.plane.pending[k] = engine_client.Pending(answer, None)
        call = InferCall(k, host.incarnation, None, None, InferOptions(), None, images, None, None, described)
        host.handle(peer.identity, call)
        reply = await asyncio.wait_for(answer, 10)
        assert reply.model == expected
        assert reply.outputs is not None and reply.outputs.filenames == [f.filename for f in FILES]


async def test_core_errors_come_back_as_themselves(make_linked: Callable[..., Awaitable[Linked]]) -> None:
    linked: Linked = await make_linked()
    elsewhere = dataclasses.replace(linked.plane.describe(None), name="nope")  # unloaded since it was looked up
    with pytest.raises(ModelNotFound, match="nope"):
        await linked.plane.infer(InferenceRequest(elsewhere, FILES, InferOptions()), identity)
    bad = [EncodedImage("x.png", b"not an image")]
    with pytest.raises(UnsupportedMediaType, match=r"x\.png"):
        await linked.plane.infer(asked(linked.plane, bad, InferOptions()), identity)
    [stats] = await linked.plane.statistics()  # refused by the front-end's decoding, counted by the engine
    assert (stats.fail.count, stats.success.count) == (1, 0)
    model = linked.engine.model(None)
    model.batcher.max_queue = 1  # a full queue: 503 with a Retry-After, as from one process
    with pytest.raises(Overloaded) as raised:
        await linked.plane.infer(asked(linked.plane, FILES, InferOptions()), identity)
    assert raised.value.retry_after_s is not None
    assert linked.arena.in_use == 0


async def test_a_call_zeromq_cannot_queue_is_refused_as_overload(
    make_linked: Callable[..., Awaitable[Linked]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """ZeroMQ refuses a send when its queue to a connected engine is full (the engine is not reading): a 503
    to retry, and the region given back."""
    linked: Linked = await make_linked()
    assert linked.plane.channel is not None
    monkeypatch.setattr(linked.plane.channel, "send", lambda frames: False)
    with pytest.raises(Overloaded, match="engine has not yet read") as raised:
        await linked.plane.infer(asked(linked.plane, FILES, InferOptions()), identity)
    assert raised.value.retry_after_s == 1 and linked.arena.in_use == 0


async def test_a_call_that_could_not_be_sent_frees_its_region_even_when_its_caller_left(
    make_linked: Callable[..., Awaitable[Linked]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A call is posted, its message refused by ZeroMQ, and its caller cancelled in the same moment: no answer
    will ever come, so the region and the call's entry are given back at once."""
    linked: Linked = await make_linked()
    assert linked.plane.channel is not None
    monkeypatch.setattr(linked.plane.channel, "send", lambda frames: False)
    model = linked.engine.model(None)
    pixels = torch.stack([model.preparer.prepare(f, keep_image=False).pixels for f in FILES])
    call = asyncio.create_task(linked.plane.infer(asked(linked.plane, pixels, InferOptions()), identity))
    await asyncio.sleep(0)  # posted; its message goes in the next go of the loop
    call.cancel()
    with pytest.raises((asyncio.CancelledError, Overloaded)):
        await call
    await until(lambda: linked.arena.in_use == 0)
    assert linked.plane.pending == {} and linked.plane.outbox == []


async def test_a_silent_engine_makes_the_front_end_unready_and_fails_its_calls(
    make_linked: Callable[..., Awaitable[Linked]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(link, "ENGINE_SILENT_S", 0.5)
    linked: Linked = await make_linked()
    assert linked.plane.ready()
    under_way = slow_forward(linked.engine.model(None), 3)
    call = asyncio.create_task(linked.plane.infer(asked(linked.plane, FILES, InferOptions()), identity))
    await until(under_way.is_set)
    linked.stop.set()  # the engine stops answering
    with pytest.raises(NotReady, match="engine"):
        await asyncio.wait_for(call, 5)
    assert not linked.plane.ready()
    with pytest.raises(NotReady):
        linked.plane.check_serving()
    assert linked.arena.in_use == 0


async def test_ready_only_once_every_front_end_has_met_the_engine_and_then_on_all_at_once(
    service: Engine, tmp_path: Path
) -> None:
    """With two front-ends, a client that saw one ready is never refused by the other for not having heard from
    the engine: the engine is ready on neither until both have said hello, then on both in the same go."""
    async with hosted(service, tmp_path, front_ends=2) as make:
        first = await make()
        assert service.ready() and first.plane.state is not None
        assert not first.plane.ready()
        first.plane.check_taking()  # it serves, but does not yet say so
        second = await make()
        await until(lambda: first.plane.ready() and second.plane.ready(), timeout=2)
        assert first.plane.state is not None and second.plane.state is not None
        assert first.plane.state.seq == second.plane.state.seq


async def test_ready_without_a_front_end_that_never_said_hello_after_the_wait(
    service: Engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(engine_host, "FRONT_ENDS_WAIT_S", 0.3)
    async with hosted(service, tmp_path, front_ends=2) as make:
        only = await make()
        assert not only.plane.ready()
        await until(only.plane.ready, timeout=3)


async def test_a_repository_change_reaches_every_front_end_before_it_is_answered(tmp_path: Path) -> None:
    (tmp_path / "models").mkdir()
    for name, seed in (("a", 0), ("b", 1)):
        write_tiny_checkpoint(tmp_path / "models" / f"{name}.safetensors", seed)
    settings = Settings(
        model_repository=tmp_path / "models",
        model_control="explicit",
        models="a",
        device="cpu",
        backend="torch",
        warmup=False,
    )
    async with Engine.serving(settings) as engine, hosted(engine, tmp_path) as make:
        first, second = await make(), await make()
        assert [m.name for m in second.plane.models()] == ["a"]
        await first.plane.load_model("b")
        assert [m.name for m in second.plane.models()] == ["a", "b"]  # no wait: applied before the answer
        assert second.plane.model_ready("b")
        await second.plane.unload_model("a")
        assert [m.name for m in first.plane.models()] == ["b"]
        with pytest.raises(ModelNotFound, match="'a'"):
            first.plane.describe("a")
        index = await first.plane.repository_index()
        assert {m.name: m.state for m in index} == {"a": "UNAVAILABLE", "b": "READY"}
