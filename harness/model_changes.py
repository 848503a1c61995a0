"""Models changed under load against a real server, driven by `hey`: the experiments behind bench.reload and
tests/e2e/test_model_changes.py (a served file replaced under load; a model loaded and unloaded while another serves)."""

from __future__ import annotations

import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import torch

from app.core.contract.description import numeric_version
from harness.load import parse_hey, require_hey
from harness.server import Server
from model.checkpoint import load_checkpoint, save_checkpoint


@dataclass
class Load:
    """`hey` POSTing one image to `url` until stopped, and a client that reads each answer's version."""

    url: str
    image: Path
    concurrency: int
    hey: subprocess.Popen[str] = field(init=False)
    versions: Counter[str] = field(default_factory=Counter)  # the checking client's answers, by version
    statuses: Counter[int] = field(default_factory=Counter)
    stopping: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        argv = [
            require_hey(),
            "-z",
            "3600s",
            "-c",
            str(self.concurrency),
            "-m",
            "POST",
            "-T",
            "image/png",
            "-D",
            str(self.image),
            self.url,
        ]
        self.hey = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.checker = threading.Thread(target=self.check, daemon=True)
        self.checker.start()

    def check(self) -> None:
        body = self.image.read_bytes()
        with httpx.Client(timeout=60) as client:
            while not self.stopping.is_set():
                r = client.post(self.url, content=body, headers={"content-type": "image/png"})
                self.statuses[r.status_code] += 1
                if r.status_code == 200:
                    self.versions[r.json()["model"]["version"]] += 1

    def stop(self) -> dict[str, object]:
        """hey's figures (statuses, errors, rate, p99) once it has stopped."""
        self.stopping.set()
        self.checker.join()
        self.hey.send_signal(signal.SIGINT)  # hey stops and prints its report
        out, _ = self.hey.communicate(timeout=60)
        result = parse_hey(out, self.concurrency, None)
        return {
            "ok": result.ok,
            "errors": result.errors,
            "requests_per_s": result.requests_per_s,
            "p99_ms": result.p99_ms,
        }


def version_of(path: Path) -> str:
    return numeric_version(load_checkpoint(path).content_hash)


def served_version(server: Server, name: str) -> str | None:
    r = httpx.get(f"{server.url}/v2/models/{name}", timeout=10)
    return r.json()["versions"][0] if r.status_code == 200 else None


def wait_until(condition: object, timeout: float) -> float:
    started = time.monotonic()
    while not condition():  # type: ignore[operator]
        if time.monotonic() - started > timeout:
            raise TimeoutError("the server did not reach the expected state")
        time.sleep(0.05)
    return time.monotonic() - started


def replace(source: Path, target: Path) -> None:
    staged = target.with_name(f".{target.name}.tmp")
    shutil.copyfile(source, staged)
    staged.replace(target)


@dataclass
class ReloadResult:
    reloads: int
    versions: list[str]
    hey: dict[str, object]
    checked: dict[str, object]  # the checking client: statuses and versions seen
    after_last: list[str]  # versions of 20 answers after the last reload
    switch_s: list[float]  # from the file's replacement to the new version answering


def reload_under_load(
    versions: tuple[Path, Path], image: Path, reloads: int, concurrency: int, pause_s: float = 1.0, **env: str
) -> ReloadResult:
    """Serve `versions[0]` as model `m` in poll mode and replace its file `reloads` times under load,
    with `pause_s` of load before the first replacement and after each switch."""
    names = [version_of(v) for v in versions]
    with tempfile.TemporaryDirectory() as folder:
        served = Path(folder) / "m.safetensors"
        shutil.copyfile(versions[0], served)
        server = Server(
            served,
            VIT_LOG_LEVEL="warning",
            VIT_MODEL_REPOSITORY=folder,
            VIT_MODEL_CONTROL="poll",
            VIT_REPOSITORY_POLL_S="0.2",
            VIT_MAX_QUEUE="4096",
            **env,
        )
        try:
            server.wait_ready(300)
            load = Load(f"{server.url}/predict?model=m", image, concurrency)
            switch_s = []
            try:
                time.sleep(2 * pause_s)  # under load before the first change
                for i in range(1, reloads + 1):
                    replace(versions[i % 2], served)
                    switch_s.append(wait_until(lambda i=i: served_version(server, "m") == names[i % 2], 300))
                    time.sleep(pause_s)
            finally:
                hey = load.stop()
            final = names[reloads % 2]
            with httpx.Client(timeout=60) as client:
                after = [
                    client.post(load.url, content=image.read_bytes(), headers={"content-type": "image/png"})
                    for _ in range(20)
                ]
            after_last = [r.json()["model"]["version"] if r.status_code == 200 else str(r.status_code) for r in after]
            assert final == served_version(server, "m")
        finally:
            server.stop()
    checked = {"statuses": dict(load.statuses), "versions": dict(load.versions)}
    return ReloadResult(reloads, names, hey, checked, after_last, switch_s)


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


@dataclass
class CyclesResult:
    cycles: int
    hey: dict[str, object]  # the other model's load meanwhile
    rss_before_mib: float  # before the first load
    rss_mib: list[float]  # after each unload
    load_s: list[float]


def load_unload_cycles(
    serving: Path, cycled: Path, image: Path, cycles: int, concurrency: int, **env: str
) -> CyclesResult:
    """Serve `serving` as model `a` under load, and load and unload `cycled` as model `b` `cycles` times."""
    with tempfile.TemporaryDirectory() as folder:
        shutil.copyfile(serving, Path(folder) / "a.safetensors")
        shutil.copyfile(cycled, Path(folder) / "b.safetensors")
        server = Server(
            serving,
            VIT_LOG_LEVEL="warning",
            VIT_MODEL_REPOSITORY=folder,
            VIT_MODEL_CONTROL="explicit",
            VIT_MODELS="a",
            VIT_MAX_QUEUE="4096",
            **env,
        )
        try:
            server.wait_ready(300)
            load = Load(f"{server.url}/predict?model=a", image, concurrency)
            rss, load_s = [], []
            before = rss_bytes(server.proc.pid) / 2**20
            try:
                with httpx.Client(base_url=server.url, timeout=600) as client:
                    for _ in range(cycles):
                        started = time.monotonic()
                        r = client.post("/v2/repository/models/b/load")
                        assert r.status_code == 200, r.text
                        load_s.append(time.monotonic() - started)
                        r = client.post("/v2/repository/models/b/unload")
                        assert r.status_code == 200, r.text
                        rss.append(rss_bytes(server.proc.pid) / 2**20)
            finally:
                hey = load.stop()
            if load.statuses.keys() - {200}:
                hey["checker_errors"] = {k: v for k, v in load.statuses.items() if k != 200}
        finally:
            server.stop()
    return CyclesResult(cycles, hey, before, rss, load_s)


def another_version(source: Path, target: Path) -> Path:
    """`source` with its head's bias nudged: a new version (content hash) that answers almost the same."""
    checkpoint = load_checkpoint(source)
    with torch.no_grad():
        checkpoint.model.head.bias.add_(1e-3)
    save_checkpoint(target, checkpoint.model, checkpoint.classes, checkpoint.preprocessing, checkpoint.training)
    return target
