"""Watching the connection while a request waits: the work's result, the client leaving, the server stopping."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from starlette.requests import Request

from app.web.disconnects import ClientDisconnected, respond_unless_disconnected, unless_disconnected


def connection() -> tuple[Request, asyncio.Event]:
    """A request whose body was read; setting the event is the client hanging up."""
    hang_up = asyncio.Event()

    async def receive() -> dict[str, Any]:
        await hang_up.wait()
        return {"type": "http.disconnect"}

    return Request({"type": "http", "method": "POST", "path": "/predict", "headers": []}, receive), hang_up


async def test_the_work_answers_while_the_client_stays() -> None:
    request, _ = connection()

    async def at_once() -> str:
        return "done"

    async def after_a_wait() -> str:
        await asyncio.sleep(0.01)
        return "waited"

    assert await unless_disconnected(request, at_once()) == "done"
    assert await unless_disconnected(request, after_a_wait()) == "waited"


async def test_a_client_leaving_cancels_the_work() -> None:
    request, hang_up = connection()
    cancelled = asyncio.Event()

    async def queued() -> str:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return "never"

    asyncio.get_running_loop().call_later(0.01, hang_up.set)
    with pytest.raises(ClientDisconnected):
        await unless_disconnected(request, queued())
    assert cancelled.is_set()
    assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]  # nothing left pending
    response = await respond_unless_disconnected(request, queued())  # type: ignore[arg-type]
    assert response.status_code == 499


async def test_the_servers_cancellation_is_not_a_client_leaving() -> None:
    request, _ = connection()
    started = asyncio.Event()

    async def queued() -> str:
        started.set()
        await asyncio.sleep(3600)
        return "never"

    task = asyncio.ensure_future(unless_disconnected(request, queued()))
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_an_error_of_the_work_is_its_own() -> None:
    request, _ = connection()

    async def failing() -> str:
        await asyncio.sleep(0)
        raise ValueError("bad image")

    with pytest.raises(ValueError, match="bad image"):
        await unless_disconnected(request, failing())


async def test_work_that_swallows_the_cancellation_still_answers_a_client_gone() -> None:
    request, hang_up = connection()

    async def stubborn() -> str:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            return "finished anyway"
        return "never"

    asyncio.get_running_loop().call_later(0.01, hang_up.set)
    with pytest.raises(ClientDisconnected):
        await unless_disconnected(request, stubborn())
    assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]
