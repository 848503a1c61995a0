"""System shared-memory regions that clients register (the Open Inference Protocol's extension, as Triton has it).

A client creates a POSIX shared-memory object (`shm_open`), registers a region of it by name (its key, an
offset and a byte size), then sends inputs that point into a region instead of carrying their bytes, and
asks for outputs to be written into one. Every edge (V2 REST and gRPC) and every serving front-end sees the
same regions: each is a small record file in one directory, created whole (a link, which fails when the name
is taken) under a lock that also holds the count to its limit.

The objects are never mapped. Inputs are read with `pread` on a descriptor opened read-only, outputs written
with `pwrite`, each through a descriptor opened for that use and closed after it, with `O_NOFOLLOW` on a
regular file directly in /dev/shm. So nothing of a client's stays open or mapped past its request, an object
shrunk under a mapping cannot crash the server (SIGBUS), and an unregistered region is gone for every
process at once. The front-end copies the bytes in, so the engine process never sees a region.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import stat
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from app.core.contract.errors import (
    AlreadyExists,
    InvalidInput,
    NotSupported,
    PayloadTooLarge,
    RegionNotFound,
)

SHM_ROOT = Path("/dev/shm")  # where Linux keeps POSIX shared-memory objects
MAX_KEY_BYTES = 255  # NAME_MAX
MAX_U64 = 2**64 - 1
CUDA_NOT_SUPPORTED = (
    "CUDA shared memory is not supported by this server; register system shared memory (/v2/systemsharedmemory) instead"
)


@dataclass(frozen=True)
class Region:
    """A registered region: `byte_size` bytes of the object `key`, from `offset`."""

    name: str
    key: str
    offset: int
    byte_size: int


def object_path(key: str) -> Path:
    """The file of shared-memory object `key` (`/name` or `name`, as shm_open takes it); InvalidInput for
    anything else, such as a path."""
    name = key[1:] if key.startswith("/") else key
    if not name or "/" in name or name in (".", "..") or "\0" in name or len(name.encode()) > MAX_KEY_BYTES:
        raise InvalidInput(
            f"shared-memory key {key!r} is not the name of a shared-memory object: send the key given to "
            "shm_open, such as '/my_region' (one leading slash at most, no other, and no path)"
        )
    return SHM_ROOT / name


def open_object(key: str, writable: bool) -> int:
    """A descriptor of the object `key` (read-only unless `writable`): never through a link, only a regular file."""
    path = object_path(key)
    flags = (os.O_RDWR if writable else os.O_RDONLY) | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise InvalidInput(f"unable to open shared-memory object {key!r}: there is none of that name") from None
    except OSError as e:
        raise InvalidInput(f"unable to open shared-memory object {key!r}: {e.strerror}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise InvalidInput(f"{key!r} is not a shared-memory object")
    return fd


def byte_count(value: object, what: str) -> int:
    """A non-negative integer that fits in 64 bits (the protocol's uint64), or InvalidInput."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_U64:
        raise InvalidInput(f"{what} must be an integer from 0 to 2^64-1, got {value!r}")
    return value


class SharedMemoryRegions:
    """The regions registered with this server, shared by every process given the same `directory` (None: one
    of its own, made at the first registration and removed by `close`). At most `limit` at once (0: off)."""

    def __init__(self, directory: Path | None, limit: int) -> None:
        self.given = directory
        self.made: Path | None = None
        self.limit = limit

    @property
    def directory(self) -> Path:
        if self.given is not None:
            return self.given
        if self.made is None:
            self.made = Path(tempfile.mkdtemp(prefix="vit-serve-regions-"))
        return self.made

    @property
    def in_use(self) -> bool:
        """Whether there is a directory to look in: a shared one, or this object's own once made."""
        return self.given is not None or self.made is not None

    def close(self) -> None:
        """Forget every region this object's own directory holds (a shared one is its owner's to remove)."""
        if self.made is not None:
            shutil.rmtree(self.made, ignore_errors=True)
            self.made = None

    def record(self, name: str) -> Path:
        return self.directory / (hashlib.sha256(name.encode()).hexdigest()[:40] + ".json")

    def lock(self) -> int:
        """An exclusive lock over registering and unregistering (every process's): release with os.close."""
        fd = os.open(self.directory / ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)
        return fd

    def register(self, name: str, key: str, offset: object, byte_size: object) -> Region:
        """Register `byte_size` bytes of object `key` from `offset` as `name`: the object must exist, be a
        shared-memory object and hold them. AlreadyExists when `name` is taken."""
        if self.limit == 0:
            raise NotSupported("system shared memory is turned off here (VIT_SHARED_MEMORY_REGIONS=0)")
        if not name or "\0" in name:
            raise InvalidInput("a shared-memory region needs a name")
        region = Region(name, key, byte_count(offset, "offset"), byte_count(byte_size, "byte_size"))
        fd = open_object(key, writable=False)
        try:
            size = os.fstat(fd).st_size
        finally:
            os.close(fd)
        if region.offset + region.byte_size > size:
            raise InvalidInput(
                f"region {name!r}: offset {region.offset} + byte_size {region.byte_size} is past the end of "
                f"shared-memory object {key!r} ({size} bytes)"
            )
        lock = self.lock()
        try:
            if sum(1 for p in self.directory.glob("*.json")) >= self.limit:
                raise InvalidInput(
                    f"{self.limit} shared-memory regions are registered, the most this server takes "
                    "(VIT_SHARED_MEMORY_REGIONS); unregister one first"
                )
            staged = self.directory / f".{os.getpid()}.staged"
            staged.write_text(json.dumps(asdict(region)))
            try:
                os.link(staged, self.record(name))  # whole or not at all; fails when the name is taken
            except FileExistsError:
                raise AlreadyExists(
                    f"a shared-memory region named {name!r} is already registered; unregister it first"
                ) from None
            finally:
                staged.unlink()
        finally:
            os.close(lock)
        return region

    def unregister(self, name: str | None = None) -> None:
        """Forget region `name` (nothing when there is none of that name), or every region (None)."""
        if not self.in_use:
            return
        lock = self.lock()
        try:
            records = [self.record(name)] if name is not None else list(self.directory.glob("*.json"))
            for record in records:
                record.unlink(missing_ok=True)
        finally:
            os.close(lock)

    def find(self, name: str) -> Region | None:
        if not self.in_use:
            return None
        try:
            found = Region(**json.loads(self.record(name).read_text()))
        except FileNotFoundError:
            return None
        return found if found.name == name else None

    def status(self, name: str | None = None) -> list[Region]:
        """Region `name` (RegionNotFound when there is none), or every region, by name."""
        if name is not None:
            found = self.find(name)
            if found is None:
                raise RegionNotFound(f"no system shared-memory region named {name!r} is registered")
            return [found]
        if not self.in_use:
            return []
        regions = []
        for record in self.directory.glob("*.json"):
            try:
                regions.append(Region(**json.loads(record.read_text())))
            except FileNotFoundError:  # unregistered meanwhile
                continue
        return sorted(regions, key=lambda r: r.name)

    def span(self, name: str, offset: object, byte_size: object, what: str) -> tuple[Region, int, int]:
        """(the region, its object's offset, the byte count) of `byte_size` bytes from `offset` into region
        `name`, checked to lie inside it."""
        region = self.find(name) if isinstance(name, str) else None
        if region is None:
            raise InvalidInput(f"{what}: no system shared-memory region named {name!r} is registered")
        start, size = (
            byte_count(offset, f"{what}: shared_memory_offset"),
            byte_count(byte_size, f"{what}: shared_memory_byte_size"),
        )
        if start + size > region.byte_size:
            raise InvalidInput(
                f"{what}: shared_memory_offset {start} + shared_memory_byte_size {size} is past the end of region "
                f"{name!r} ({region.byte_size} bytes)"
            )
        return region, region.offset + start, size

    def check(self, name: object, offset: object, byte_size: object, what: str) -> None:
        """InvalidInput unless the span lies inside a registered region (before any compute is spent)."""
        if not isinstance(name, str):
            raise InvalidInput(f"{what}: shared_memory_region must be a region's name, got {name!r}")
        self.span(name, offset, byte_size, what)

    def read(self, name: str, offset: object, byte_size: object, what: str, limit: int) -> bytes:
        """`byte_size` bytes from `offset` into region `name`, read through a read-only descriptor."""
        region, start, size = self.span(name, offset, byte_size, what)
        if size > limit:
            raise PayloadTooLarge(
                f"{what}: {size} bytes in shared memory; at most {limit} are taken (VIT_MAX_UPLOAD_BYTES)"
            )
        fd = open_object(region.key, writable=False)
        try:
            data = os.pread(fd, size, start)
        finally:
            os.close(fd)
        if len(data) != size:
            raise InvalidInput(
                f"{what}: shared-memory object {region.key!r} holds fewer bytes than region {name!r} spans"
            )
        return data

    def write(self, name: str, offset: object, byte_size: object, data: bytes, what: str) -> None:
        """`data` into region `name` from `offset`; InvalidInput when the span the request gave is too small."""
        region, start, size = self.span(name, offset, byte_size, what)
        if len(data) > size:
            raise InvalidInput(
                f"{what} needs {len(data)} bytes; shared_memory_byte_size gives {size} in region {name!r}"
            )
        fd = open_object(region.key, writable=True)
        try:
            if os.fstat(fd).st_size < start + len(data):  # shrunk since it was registered: never grow it
                raise InvalidInput(f"{what}: shared-memory object {region.key!r} no longer holds region {name!r}")
            written = os.pwrite(fd, data, start)
        finally:
            os.close(fd)
        if written != len(data):
            raise InvalidInput(f"{what}: only {written} of {len(data)} bytes could be written to region {name!r}")
