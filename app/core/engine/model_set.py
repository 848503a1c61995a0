"""The served models by name, and every change to them while serving: load, reload, unload, polling a repository,
and the heads taught on them by example.

A reload builds the new version beside the old one (loaded and warmed on a thread), then switches:
requests already admitted finish on the old version, new ones go to the new one. An unload stops
admitting (new requests get ModelNotFound), answers what it admitted, then frees the model. A load
that fails leaves any serving version in place and shows as UNAVAILABLE, with the reason, in the index.
Changes happen one at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import gc
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import torch

from app.choices import ModelControl
from app.core.contract.description import ModelStatus
from app.core.contract.errors import (
    AlreadyExists,
    InvalidInput,
    LoadFailed,
    ModelNotFound,
    NotAllowed,
    NotReady,
    ServiceError,
)
from app.core.contract.teaching import Embedded
from app.core.engine.repository import FileStamp, Repository, check_name
from app.core.engine.served_model import ServedModel
from app.telemetry.metrics import Metrics
from model.checkpoint import CheckpointError
from model.taught_head import Embedding, HeadError, TaughtHead, check_head_name
from model.taught_head import fit as fit_head
from model.taught_head import save as save_head

log = logging.getLogger("app")
T = TypeVar("T")

Build = Callable[[str, Path], ServedModel]  # loads and warms one checkpoint (blocking)


# an absolute path in an error's text (not a URL's, not a relative one): its folders are dropped, its name kept
ABSOLUTE_PATH = re.compile(r"(?<![\w:/.~-])(?:/[^/\s'\"`:;,()\[\]]+)+/")


def what_failed(e: Exception) -> str:
    """What is wrong with a model's file, for clients: the checkpoint's own reason, or the error's first line, with
    no folder of the server's disk in it."""
    text = e.reason if isinstance(e, CheckpointError) else (str(e).strip().splitlines() or [type(e).__name__])[0]
    return ABSOLUTE_PATH.sub("", text) or type(e).__name__


class ModelSet:
    def __init__(
        self,
        served: dict[str, ServedModel],
        build: Build,
        repository: Repository | None,
        control: ModelControl,
        metrics: Metrics,
        drain_timeout_s: float,
        stamps: dict[str, FileStamp] | None = None,
    ) -> None:
        self.served = served  # what edges look models up in, the default first
        self.status = {name: ModelStatus(name, "READY", m.version) for name, m in served.items()}
        self.build = build
        self.repository = repository
        self.control = control
        self.metrics = metrics
        self.drain_timeout_s = drain_timeout_s
        self.stamps = stamps or {}  # poll mode: each file as it was when last loaded (or tried)
        self.changes = asyncio.Lock()  # one change at a time
        self.changing: set[asyncio.Task[Any]] = set()
        self.closed = False
        self.poller: asyncio.Task[None] | None = None
        # heads are fitted on a thread of their own at the lowest CPU priority: serving's threads come first
        self.fitting = ThreadPoolExecutor(1, thread_name_prefix="fit", initializer=lowest_priority)
        metrics.models_loaded.set(len(served))

    def current(self, model: ServedModel) -> ServedModel:
        """The version that now answers for `model`: itself, or what replaced it; ModelNotFound once unloaded."""
        while model.retired:
            if model.successor is None:
                raise ModelNotFound(f"model {model.name!r} was unloaded; this service serves: {self.names()}")
            model = model.successor
        return model

    def names(self) -> str:
        return ", ".join(self.served) or "no model (load one through the model repository API)"

    def index(self, ready_only: bool = False) -> list[ModelStatus]:
        """Every model known here or held by the repository, by name."""
        known = dict(self.status)
        for name in self.repository.scan() if self.repository else ():
            known.setdefault(name, ModelStatus(name, "UNAVAILABLE", reason="not loaded"))
        rows = [known[name] for name in sorted(known)]
        return [r for r in rows if r.state == "READY"] if ready_only else rows

    # The repository API: explicit mode only, as Triton's --model-control-mode=explicit.
    async def load(self, name: str) -> ServedModel:
        self.check_explicit("load")
        return await self.shielded(self.put(name))

    async def unload(self, name: str) -> None:
        self.check_explicit("unload")
        await self.shielded(self.remove(name))

    async def shielded(self, change: Coroutine[Any, Any, T]) -> T:
        """Run a change to its end even when its caller is cancelled (a client gone, the poller stopped):
        half made, it would leave a model LOADING for ever, or retired with its batcher still running."""
        task = asyncio.get_running_loop().create_task(change)
        self.changing.add(task)
        task.add_done_callback(self.changing.discard)
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # its caller may be gone: no warning
        return await asyncio.shield(task)

    async def close(self) -> None:
        """Stop polling and let a change under way finish; no change starts after this."""
        await self.stop_polling()
        async with self.changes:
            self.closed = True
        self.fitting.shutdown(wait=False, cancel_futures=True)

    def check_explicit(self, change: str) -> None:
        if self.repository is None or self.control != "explicit":
            raise NotAllowed(
                f"models cannot be {change}ed through the API when VIT_MODEL_CONTROL={self.control}; "
                "set VIT_MODEL_REPOSITORY and VIT_MODEL_CONTROL=explicit"
                + (" (poll mode follows the files in the repository)" if self.control == "poll" else "")
            )

    async def put(self, name: str) -> ServedModel:
        """Load `name` from the repository, beside its serving version if any, then switch to it."""
        if self.repository is None:
            raise NotAllowed("no VIT_MODEL_REPOSITORY to load models from")
        path = self.repository.path(name)
        async with self.changes:
            self.check_open()
            old = self.served.get(name)
            serving = old.version if old else ""
            self.status[name] = ModelStatus(name, "LOADING", serving)
            started = time.perf_counter()
            try:
                new = await asyncio.to_thread(self.build, name, path)
            except Exception as e:  # any failure to load must leave the service as it was
                # clients name models, never paths: the file's place on the server goes to the log alone
                log.error("model %s: failed to load %s: %s", name, path, e)
                reason = f"failed to load {path.name}: {what_failed(e)}"
                reason += f"; version {serving} goes on serving" if old else ""
                self.metrics.model_load_failures.labels(name).inc()
                self.status[name] = ModelStatus(name, "UNAVAILABLE", serving, reason)
                raise LoadFailed(reason) from None
            self.metrics.model_load_seconds.observe(time.perf_counter() - started)
            new.batcher.start()
            self.served[name] = new  # a reload keeps the name's place (and the default stays the default)
            self.status[name] = ModelStatus(name, "READY", new.version)
            self.metrics.models_loaded.set(len(self.served))
            if old is None:
                log.info("model %s: version %s loaded", name, new.version)
            else:
                log.info("model %s: version %s replaces %s", name, new.version, old.version)
                old.retire(successor=new)
                await self.drain(old)
                del old
                await asyncio.to_thread(release_memory)
            return new

    async def remove(self, name: str) -> None:
        """Stop admitting requests for `name`, answer those admitted, then free it."""
        check_name(name)
        async with self.changes:
            self.check_open()
            model = self.served.pop(name, None)
            if model is None:
                if name not in self.status and not (self.repository and name in self.repository.scan()):
                    raise ModelNotFound(f"no model named {name!r}; this service serves: {self.names()}")
                return  # known, not loaded: nothing to do
            model.retire(successor=None)
            self.status[name] = ModelStatus(name, "UNLOADING", model.version)
            self.metrics.models_loaded.set(len(self.served))
            await self.drain(model)
            self.status[name] = ModelStatus(name, "UNAVAILABLE", model.version, "unloaded")
            log.info("model %s: version %s unloaded", name, model.version)
            del model
            await asyncio.to_thread(release_memory)

    # Heads taught by example, changed while their model serves (a reload reads them again from its folder).
    async def teach(self, name: str, version: str, embedded: Embedded) -> TaughtHead:
        """A head fitted on `embedded` (on a thread), written into version `version` of model `name`'s heads folder,
        and answering from the next request on."""
        model = self.serving(name, version)
        if model.heads_at is None:
            raise NotAllowed(
                f"model {name} was converted into a folder removed at stop, where a head would not be kept: set "
                "VIT_HUB_CACHE (or serve it from VIT_MODEL_REPOSITORY) to teach it heads"
            )
        kind: Embedding = "joint" if model.checkpoint.zero_shot is not None else "pre-logits"
        backbone = model.checkpoint.content_hash
        e = embedded
        loop = asyncio.get_running_loop()
        try:
            fitted = loop.run_in_executor(
                self.fitting, fit_head, e.embeddings, e.labels, e.classes, backbone, kind, e.rule
            )
            head = await fitted
        except HeadError as error:
            raise InvalidInput(str(error)) from None
        await self.shielded(self.keep_head(name, version, embedded, head))
        return head

    async def keep_head(self, name: str, version: str, embedded: Embedded, head: TaughtHead) -> None:
        async with self.changes:
            self.check_open()
            model = self.serving(name, version)
            if embedded.head in model.heads and not embedded.replace:  # taught meanwhile by another request
                raise AlreadyExists(
                    f"model {name} already has a head named {embedded.head!r}; replace=true replaces it"
                )
            assert model.heads_at is not None
            try:
                await asyncio.to_thread(save_head, head, model.heads_at / f"{embedded.head}.safetensors")
            except OSError as error:
                log.error("model %s: head %s not written into %s: %s", name, embedded.head, model.heads_at, error)
                raise NotAllowed(
                    f"model {name}'s heads folder cannot be written ({error.strerror}); head {embedded.head!r} was "
                    "not kept"
                ) from None
            replaced = embedded.head in model.heads
            model.keep_head(embedded.head, head)
            log.info(
                "model %s: head %s %s (%s, %d classes, %d examples, held-out accuracy %s)",
                name,
                embedded.head,
                "taught again" if replaced else "taught",
                head.rule,
                len(head.classes),
                sum(head.counts),
                "none" if head.estimate is None else f"{head.estimate.accuracy:.3f}",
            )

    async def forget_head(self, name: str, head: str) -> None:
        """Model `name`'s head `head` deleted: its file gone, and requests naming it not found from now on."""
        try:
            check_head_name(head)
        except HeadError as error:
            raise InvalidInput(str(error)) from None
        await self.shielded(self.delete_head(name, head))

    async def delete_head(self, name: str, head: str) -> None:
        async with self.changes:
            self.check_open()
            model = self.serving(name)
            path = None if model.heads_at is None else model.heads_at / f"{head}.safetensors"
            on_disk = path is not None and path.is_file()  # one that did not load (taught on another backbone) too
            if head not in model.heads and not on_disk:
                model.head(head)  # not found, with the heads it has
            if path is not None:
                await asyncio.to_thread(path.unlink, missing_ok=True)
            model.drop_head(head)
            log.info("model %s: head %s deleted", name, head)

    def serving(self, name: str, version: str | None = None) -> ServedModel:
        """Model `name` as it serves now, at `version` where one is given (ModelNotFound otherwise)."""
        model = self.served.get(name)
        if model is None:
            raise ModelNotFound(f"no model named {name!r}; this service serves: {self.names()}")
        if version is not None and model.version != version:
            raise ModelNotFound(
                f"model {name} changed to version {model.version} while the examples were embedded by version "
                f"{version}: teach it again"
            )
        return model

    def check_open(self) -> None:
        if self.closed:
            raise NotReady("the service is shutting down; models no longer change")

    async def drain(self, model: ServedModel) -> None:
        """Answer what `model` admitted, then stop it (the caller drops it and releases the memory)."""
        if not await model.batcher.drain(self.drain_timeout_s):
            log.warning(
                "model %s: drain timed out after %.1fs with %d images queued",
                model.name,
                self.drain_timeout_s,
                model.batcher.queue_depth,
            )
        await model.batcher.stop()

    def start_polling(self, interval_s: float) -> None:
        if self.control == "poll":
            self.poller = asyncio.get_running_loop().create_task(self.poll_forever(interval_s), name="repository-poll")

    async def stop_polling(self) -> None:
        if self.poller is not None:
            self.poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.poller

    async def poll_forever(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self.sync()
            except Exception:  # the next poll tries again; serving goes on
                log.exception("polling the model repository failed")

    async def sync(self) -> None:
        """Load new files, reload changed ones, unload the models whose file is gone."""
        if self.repository is None:
            return
        files = await asyncio.to_thread(self.repository.scan)
        for name, stamp in files.items():
            if self.stamps.get(name) != stamp:
                self.stamps[name] = stamp  # tried once per change: a broken file waits for the next one
                with contextlib.suppress(ServiceError):  # logged, and shown in the index
                    await self.shielded(self.put(name))
        for name in [n for n in self.stamps if n not in files]:
            del self.stamps[name]
            with contextlib.suppress(ServiceError):
                await self.shielded(self.remove(name))


def lowest_priority() -> None:
    """The calling thread at nice 19 (Linux keeps a nice value per thread); left as it is where that is refused."""
    with contextlib.suppress(OSError, AttributeError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)


def release_memory() -> None:
    """Collect what a retired model leaves behind and hand freed pages back to the system."""
    frozen = gc.get_freeze_count() > 0
    if frozen:  # models loaded at startup were frozen with everything else (Engine.start)
        gc.unfreeze()
    gc.collect()
    if frozen:
        gc.freeze()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    if LIBC is not None:
        LIBC.malloc_trim(0)


def load_libc() -> ctypes.CDLL | None:
    """glibc, whose malloc_trim returns freed heap to the system (a model's weights are hundreds of MB)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return libc if libc is not None and hasattr(libc, "malloc_trim") else None


LIBC = load_libc()
