"""Watching the connection while a request waits: an HTTP concern, kept at the edge with the routes."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from fastapi import Request, Response

T = TypeVar("T")

CLIENT_CLOSED_REQUEST = 499  # nginx's status for a request whose client left; never delivered


class ClientDisconnected(Exception):
    """The client went away while its request waited; nothing is sent back."""


async def wait_for_disconnect(request: Request) -> None:
    """Returns when the client closes the connection (the body has been read by then)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """The result of `work`; if the client leaves first, `work` is cancelled and ClientDisconnected raised.

    `work` runs in the request's own task, and a watcher task cancels that task when the client leaves (as
    `asyncio.timeout` cancels on its deadline). Work that finishes without waiting, a cached answer, is
    done before the watcher first runs: no task of its own and no `asyncio.wait`, which cost more than the
    answer itself.
    """
    current = asyncio.current_task()
    assert current is not None
    left = False

    async def watch() -> None:
        nonlocal left
        await wait_for_disconnect(request)
        left = True
        current.cancel()  # cancels the request's queued images: the batcher never computes them

    watcher = asyncio.ensure_future(watch())
    try:
        result = await work
    except asyncio.CancelledError:
        if left and current.uncancel() == 0:  # cancelled for the client alone
            raise ClientDisconnected() from None
        raise  # the server's own cancellation (shutdown) goes on
    finally:
        watcher.cancel()
    if left:  # the work finished all the same (it was done, or it swallowed the cancellation)
        current.uncancel()
        raise ClientDisconnected()
    return result


async def respond_unless_disconnected(request: Request, work: Awaitable[Response]) -> Response:
    """The response `work` makes, or 499 (logged, never delivered) when the client leaves first."""
    try:
        return await unless_disconnected(request, work)
    except ClientDisconnected:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
