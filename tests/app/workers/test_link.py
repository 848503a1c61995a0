"""The link between front-ends and the engine: ZeroMQ on the event loop without losing a message, and a
request's outputs through a region of the arena (or inline) as blocks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import zmq

from app.core.contract.request import Prediction
from app.workers.link import READ_AT_ONCE, Channel, RegionWriter, load_predictions, store_outputs
from app.workers.shared_memory import Arena
from tests.support.clients import until


async def test_a_channel_reads_every_message_though_its_own_sends_take_the_edge(tmp_path: Path) -> None:
    """ZeroMQ's descriptor signals an edge, which a send can take: an echo that answers each message as it
    reads it, many more than one go reads, must still read them all."""
    context = zmq.Context()
    address = f"ipc://{tmp_path / 'link.sock'}"
    server_socket, client_socket = context.socket(zmq.ROUTER), context.socket(zmq.DEALER)
    server_socket.bind(address)
    client_socket.connect(address)
    echoed: list[bytes] = []
    server: Channel | None = None

    def echo(frames: list[bytes]) -> None:
        assert server is not None
        assert server.send(frames)

    server = Channel(server_socket, echo)
    client = Channel(client_socket, lambda frames: echoed.extend(frames))
    sent = [str(i).encode() for i in range(20 * READ_AT_ONCE)]
    chunk = 3 * READ_AT_ONCE  # each more than one go reads; all of them within ZeroMQ's queues (1,000 messages)
    try:
        for start in range(0, len(sent), chunk):
            for message in sent[start : start + chunk]:
                assert client.send([message])
            await until(lambda: len(echoed) == min(start + chunk, len(sent)), timeout=10)  # noqa: B023
        assert echoed == sent  # in order, none lost
    finally:
        client.close()
        server.close()
        context.term()


async def test_a_send_with_no_peer_fails_at_once(tmp_path: Path) -> None:
    context = zmq.Context()
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.IMMEDIATE, 1)
    socket.connect(f"ipc://{tmp_path / 'nobody.sock'}")
    channel = Channel(socket, lambda frames: None)
    try:
        assert not channel.send([b"hello"])
    finally:
        channel.close()
        context.term()


def predictions(n: int, maps: bool) -> list[Prediction]:
    return [
        Prediction(
            f"{i}.jpg",
            torch.rand(10),
            torch.rand(3, 3) if maps else None,
            b"png" if maps else None,
            torch.rand(4) if maps else None,
        )
        for i in range(n)
    ]


@pytest.mark.parametrize("room", [1 << 16, 64], ids=["in the arena", "inline: the region is too small"])
def test_outputs_travel_as_blocks_and_come_back_per_image(tmp_path: Path, room: int) -> None:
    arena = Arena.create(tmp_path / "a.shm", 1 << 16)
    try:
        for sent in (predictions(3, maps=True), predictions(2, maps=False), []):
            stored = store_outputs(sent, RegionWriter(arena, (0, room)))
            got = load_predictions(stored, arena)
            assert [p.filename for p in got] == [p.filename for p in sent]
            for g, s in zip(got, sent, strict=True):
                torch.testing.assert_close(g.probabilities, s.probabilities)
                for a, b in ((g.attention_map, s.attention_map), (g.embedding, s.embedding)):
                    assert (a is None) == (b is None)
                    if a is not None:
                        torch.testing.assert_close(a, b)
                assert g.overlay_png == s.overlay_png
    finally:
        arena.close()


def test_images_of_one_request_have_the_same_outputs() -> None:
    mixed = predictions(1, maps=True) + predictions(1, maps=False)
    with pytest.raises(ValueError, match="some images"):
        store_outputs(mixed, RegionWriter(None, None))
