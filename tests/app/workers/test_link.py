"""The link between front-ends and the engine: messages over ZeroMQ on the event loop, none lost, none
that cannot be handled stopping the ones after it."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import zmq

from app.workers.link import READ_AT_ONCE, Channel
from tests.support.clients import until


def connected(folder: Path) -> tuple[zmq.Context[zmq.Socket[bytes]], zmq.Socket[bytes], zmq.Socket[bytes]]:
    """A context, and an engine's ROUTER socket with a front-end's DEALER connected to it over ipc in `folder`."""
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    address = f"ipc://{folder / 'link.sock'}"
    server_socket, client_socket = context.socket(zmq.ROUTER), context.socket(zmq.DEALER)
    server_socket.bind(address)
    client_socket.connect(address)
    return context, server_socket, client_socket


async def test_a_channel_reads_every_message_though_its_own_sends_take_the_edge(tmp_path: Path) -> None:
    """ZeroMQ's descriptor signals an edge, which a send can take: an echo that answers each message as it
    reads it, many more than one go reads, must still read them all."""
    context, server_socket, client_socket = connected(tmp_path)
    echoed: list[object] = []
    server: Channel | None = None

    def echo(sender: bytes | None, message: object) -> None:
        assert server is not None and sender is not None
        assert server.send(message, sender)

    server = Channel(server_socket, echo, "server")
    client = Channel(client_socket, lambda sender, message: echoed.append(message), "client")
    sent = [(i, "call") for i in range(20 * READ_AT_ONCE)]
    chunk = 3 * READ_AT_ONCE  # each more than one go reads; all of them within ZeroMQ's queues (1,000 messages)
    try:
        for start in range(0, len(sent), chunk):
            for message in sent[start : start + chunk]:
                assert client.send(message)
            await until(lambda: len(echoed) == min(start + chunk, len(sent)), timeout=10)  # noqa: B023
        assert echoed == sent  # in order, none lost
    finally:
        client.close()
        server.close()
        context.term()


async def test_a_message_that_cannot_be_handled_is_logged_and_the_next_one_read(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    context, server_socket, client_socket = connected(tmp_path)
    handled: list[object] = []

    def handle(sender: bytes | None, message: object) -> None:
        if message == "refused":
            raise ValueError("refused")
        handled.append(message)

    server = Channel(server_socket, handle, "engine")
    try:
        with caplog.at_level(logging.ERROR, logger="app"):
            client_socket.send(b"not a pickle")
            client_socket.send_pyobj("refused")
            client_socket.send_pyobj("after")
            await until(lambda: handled == ["after"], timeout=10)
        assert [r.getMessage() for r in caplog.records] == ["engine: a message could not be handled"] * 2
    finally:
        server.close()
        client_socket.close(linger=0)
        context.term()


async def test_a_send_with_no_peer_fails_at_once(tmp_path: Path) -> None:
    context = zmq.Context()
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.IMMEDIATE, 1)
    socket.connect(f"ipc://{tmp_path / 'nobody.sock'}")
    channel = Channel(socket, lambda sender, message: None, "front-end")
    try:
        assert not channel.send("hello")
    finally:
        channel.close()
        context.term()
