"""Shared fixtures: tiny deterministic checkpoints, generated images, converted library models.

The helpers behind them live in `tests/support`. torch and the checkpoint helpers are imported where they are
used: under pytest-xdist this file is also loaded by the controller, which runs no test, and its start is
on the whole run's critical path.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest
from filelock import FileLock
from PIL import Image

from harness.images import encode
from model.shapes import make_sample

if TYPE_CHECKING:
    from tests.support.checkpoints import Pretrained


@pytest.fixture(scope="session", autouse=True)
def onnx_cache(tmp_path_factory: pytest.TempPathFactory, worker_id: str) -> Iterator[Path]:
    """One VIT_ONNX_CACHE for the run's apps and servers, not the user's, shared by its pytest-xdist workers:
    each run exports afresh, and the servers that start the same checkpoint after the first skip the export,
    as a restart would (the cache writes each graph atomically)."""
    folder = run_folder(tmp_path_factory, worker_id, "onnx-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VIT_ONNX_CACHE", str(folder))
        yield folder


@pytest.fixture
def tiny_checkpoint(tmp_path: Path) -> Path:
    from tests.support.checkpoints import write_tiny_checkpoint

    return write_tiny_checkpoint(tmp_path / "tiny.safetensors")


@pytest.fixture
def shape_png() -> bytes:
    return encode(make_sample(123, 0).image)


@pytest.fixture(scope="session")
def photo() -> Image.Image:
    """A non-square RGB image with gradients and noise, so resizing and cropping are not trivial."""
    rng = np.random.default_rng(0)
    ys, xs = np.mgrid[0:203, 0:317]
    channels = [(xs * 0.8) % 256, (ys * 1.2) % 256, ((xs + ys) * 0.5) % 256]
    pixels = np.stack(channels, axis=-1) + rng.normal(0, 20, (203, 317, 3))
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))


def run_folder(tmp_path_factory: pytest.TempPathFactory, worker_id: str, name: str) -> Path:
    """A folder this run's pytest-xdist workers share (each worker's own base folder sits inside the run's)."""
    base = tmp_path_factory.getbasetemp()
    folder = (base.parent if worker_id != "master" else base) / name
    folder.mkdir(exist_ok=True)
    return folder


@pytest.fixture(scope="session")
def pretrained(tmp_path_factory: pytest.TempPathFactory, worker_id: str) -> Callable[[str], Pretrained]:
    """`pretrained("timm" | "torchvision" | "hf")`: converted once per run, whichever worker asks first
    (the others wait on its lock, then take its file)."""
    from tests.support.checkpoints import pretrained_hf, pretrained_timm, pretrained_torchvision

    made: dict[str, Pretrained] = {}
    builders = {"timm": pretrained_timm, "torchvision": pretrained_torchvision, "hf": pretrained_hf}

    def get(source: str) -> Pretrained:
        if source not in made:
            folder = run_folder(tmp_path_factory, worker_id, f"pretrained-{source}")
            with FileLock(folder / ".lock"):
                made[source] = builders[source](folder)
        return made[source]

    return get


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("vit-serve")
    group.addoption("--require-browser", action="store_true", help="fail, not skip, the browser tests without chromium")


def pytest_configure(config: pytest.Config) -> None:
    """The servers the tests start are forked from a process that has imported the service already, where their
    environment allows (`harness.preloaded`): the suite starts about fifty.

    Under pytest-xdist, each worker and every process it starts (servers, command lines) computes on its share
    of the cores: N workers each running torch's and ONNX Runtime's default of one thread per core would keep
    N times as many threads busy as there are cores, and OpenMP threads waiting for a core spin on it (measured
    on 2 cores with 2 workers: tests/model and the ONNX tests took 148 s so, 106 s with a thread per worker)."""
    from harness.server import ServerProcess

    ServerProcess.preloaded = True
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        import torch

        threads = max(1, len(os.sched_getaffinity(0)) // workers)
        os.environ["OMP_NUM_THREADS"] = str(threads)  # read by torch in the processes the tests start
        torch.set_num_threads(threads)


FRESH_IN_WORKERS: list[str] = []


def pytest_sessionfinish(session: pytest.Session) -> None:
    """A pytest-xdist worker hands on which of its starts got a fresh interpreter (`harness.preloaded.FRESH`)."""
    from harness.preloaded import FRESH

    if hasattr(session.config, "workeroutput"):
        session.config.workeroutput["fresh_starts"] = FRESH


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: object) -> None:
    FRESH_IN_WORKERS.extend(getattr(node, "workeroutput", {}).get("fresh_starts", []))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """The starts that could not be forked from the preloaded interpreter, each with the variables why: a test
    that sets another one (or a library that does, in the test process) slows every later start of its worker."""
    from harness.preloaded import FRESH

    fresh = FRESH_IN_WORKERS + FRESH
    if fresh:
        starts = f"{len(fresh)} start" + ("s" if len(fresh) > 1 else "")
        terminalreporter.write_line(f"harness.preloaded: {starts} got a fresh interpreter, for variables set:")
        for line in fresh:
            terminalreporter.write_line(f"  {line}")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Modules holding slow tests run first, each module's tests kept together in their order: pytest-xdist
    (`--dist loadscope`) hands whole modules to the workers in this order, so the many quick modules at the
    end even out the workers' finishing times instead of one slow module running alone."""
    slow = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow)
