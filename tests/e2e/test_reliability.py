"""Overload and disconnecting clients, against real servers."""

from __future__ import annotations

import asyncio
import re
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from harness.images import encode
from harness.server import Server
from model.shapes import make_sample
from tests.support.checkpoints import heavy_checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.e2e]
PNG = encode(make_sample(8, 0).image)


def scrape(server: Server, name: str) -> float:
    text = httpx.get(f"{server.url}/metrics").text
    return sum(float(m) for m in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE))


def rss_mb(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1)) / 1024  # type: ignore[union-attr]


async def until(condition: Callable[[], bool], what: str, timeout_s: float = 60) -> None:
    """Wait for `condition` (checked on a thread: it may make a blocking request), at most `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not await asyncio.to_thread(condition):
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout_s:.0f} s for {what}")
        await asyncio.sleep(0.05)


async def closed_loop(url: str, clients: int, seconds: float) -> int:
    """Completed predictions from `clients` back-to-back callers over `seconds`."""
    done = 0
    stop = time.monotonic() + seconds
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:

        async def caller() -> None:
            nonlocal done
            while time.monotonic() < stop:
                r = await client.post("/predict", files={"file": ("a.png", PNG, "image/png")})
                done += r.status_code == 200

        await asyncio.gather(*(caller() for _ in range(clients)))
    return done


async def open_loop(url: str, rate: float, seconds: float) -> list[tuple[int, float, str | None]]:
    """Requests fired at a fixed rate regardless of answers: (status, latency, Retry-After) for each."""
    results: list[tuple[int, float, str | None]] = []
    # A fresh connection per request: no keep-alive reuse racing the server closing an idle connection.
    limits = httpx.Limits(max_connections=2000, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:

        async def one() -> None:
            started = time.monotonic()
            try:
                r = await client.post("/predict", files={"file": ("a.png", PNG, "image/png")})
            except httpx.TransportError as e:  # recorded, so the assertion shows what went wrong
                results.append((0, time.monotonic() - started, type(e).__name__))
                return
            results.append((r.status_code, time.monotonic() - started, r.headers.get("retry-after")))

        tasks = []
        start = time.monotonic()
        for i in range(int(rate * seconds)):
            await asyncio.sleep(max(0.0, start + i / rate - time.monotonic()))
            tasks.append(asyncio.create_task(one()))
        await asyncio.gather(*tasks)
    return results


def test_overload_at_four_times_capacity(tmp_path: Path) -> None:
    with Server(
        heavy_checkpoint(tmp_path / "heavy.safetensors"),
        VIT_THREADS="1",
        VIT_MAX_BATCH_SIZE="8",
        VIT_MAX_WAIT_MS="5",
        VIT_MAX_QUEUE="16",
        VIT_REQUEST_TIMEOUT_S="10",
    ) as server:
        capacity = asyncio.run(closed_loop(server.url, clients=16, seconds=3)) / 3  # requests per second
        rss_before = rss_mb(server.proc.pid)
        results = asyncio.run(open_loop(server.url, rate=4 * capacity, seconds=4))
        statuses = [s for s, _, _ in results]
        assert set(statuses) <= {200, 503}, Counter((s, e) for s, _, e in results if s not in (200, 503))
        ok = [latency for s, latency, _ in results if s == 200]
        refused = [retry for s, _, retry in results if s == 503]
        assert refused, "4x capacity should have been refused in part"
        assert all(r is not None and int(r) >= 1 for r in refused)
        assert len(ok) >= capacity  # the service kept working through the overload
        assert max(ok) < 10  # every accepted request finished within the request timeout
        assert rss_mb(server.proc.pid) - rss_before < 150  # the bounded queue bounds memory
        assert scrape(server, "vit_queue_depth") == 0
        # afterwards it serves normally
        assert httpx.get(f"{server.url}/health/ready").status_code == 200
        r = httpx.post(f"{server.url}/predict", files={"file": ("a.png", PNG, "image/png")}, timeout=30)
        assert r.status_code == 200, r.text


def test_disconnected_clients_are_not_computed(tmp_path: Path) -> None:
    with Server(
        heavy_checkpoint(tmp_path / "heavy.safetensors"),
        VIT_THREADS="1",
        VIT_MAX_BATCH_SIZE="2",
        VIT_MAX_WAIT_MS="0",
        VIT_MAX_QUEUE="256",
    ) as server:
        rss_before = rss_mb(server.proc.pid)

        async def leave_once_queued(n: int) -> int:
            """`n` clients send an image each; once the server holds images of theirs in its queue, every client
            still waiting hangs up. How many hung up."""
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
                sent = [
                    asyncio.create_task(client.post("/predict", files={"file": ("a.png", PNG, "image/png")}))
                    for _ in range(n)
                ]
                await until(lambda: scrape(server, "vit_queue_depth") >= 8, "8 images queued")
                waiting = [task for task in sent if not task.done()]
                for task in waiting:
                    task.cancel()
                await asyncio.gather(*sent, return_exceptions=True)
            return len(waiting)

        gave_up = asyncio.run(leave_once_queued(120))
        assert gave_up > 0
        asyncio.run(until(lambda: scrape(server, "vit_queue_depth") == 0, "an empty queue"))
        processed = scrape(server, "vit_images_processed_total")
        dropped = scrape(server, "vit_images_dropped_total")
        assert dropped > 0, "queued images of clients that left should be dropped"
        assert processed + dropped <= 120 and processed < 120
        assert rss_mb(server.proc.pid) - rss_before < 100
        r = httpx.post(f"{server.url}/predict", files={"file": ("a.png", PNG, "image/png")}, timeout=30)
        assert r.status_code == 200
