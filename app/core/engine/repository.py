"""A model repository: a directory where every checkpoint file is a model named by its file, `NAME.safetensors`.

Clients only ever name models; a name is checked before it becomes a path, and nothing outside the
directory is read (a symbolic link that leads out of it is refused).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from app.core.contract.errors import InvalidInput, ModelNotFound
from app.settings import is_model_name

SUFFIX = ".safetensors"


@dataclass(frozen=True)
class FileStamp:
    """What changes when a checkpoint file is rewritten or replaced."""

    modified_ns: int
    size: int
    inode: int


def check_name(name: str) -> None:
    """A model name, never a path: letters, digits, '.', '_', '-', not starting with a dot, no '..'."""
    if not is_model_name(name):
        raise InvalidInput(
            f"{name!r} is not a model name: use letters, digits, '.', '_' and '-' (at most 64, "
            "not starting with '.', no '..'); paths are never accepted"
        )


class Repository:
    def __init__(self, root: Path) -> None:
        self.root = root.resolve()

    def path(self, name: str) -> Path:
        """The checkpoint of model `name`; InvalidInput for a bad name, ModelNotFound when there is no such file."""
        check_name(name)
        path = self.root / f"{name}{SUFFIX}"
        if not path.is_file() or not self.inside(path):
            # clients name models, never paths: the repository's place on the server stays its own
            raise ModelNotFound(f"no model named {name!r} in the model repository")
        return path

    def inside(self, path: Path) -> bool:
        return path.resolve().parent == self.root

    def scan(self) -> dict[str, FileStamp]:
        """Every model file in the directory, by name, sorted."""
        found: dict[str, FileStamp] = {}
        try:
            entries = sorted(os.scandir(self.root), key=lambda e: e.name)
        except FileNotFoundError:
            return found
        for entry in entries:
            name = entry.name.removesuffix(SUFFIX)
            if not entry.name.endswith(SUFFIX) or not is_model_name(name):
                continue  # hidden files, partial downloads (name.safetensors.tmp), other files
            try:
                if not entry.is_file() or not self.inside(Path(entry.path)):
                    continue
                stat = entry.stat()
            except OSError:  # removed while scanning
                continue
            found[name] = FileStamp(stat.st_mtime_ns, stat.st_size, stat.st_ino)
        return found
