"""A FastAPI service that serves ViT checkpoints with dynamic batching: a serving core, protocol codecs, web edge."""

from __future__ import annotations

import tomllib
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path


def project_version() -> str:
    """The version in pyproject.toml: from the installed metadata, or the file itself beside an uninstalled tree."""
    try:
        return version("vit-serve")
    except PackageNotFoundError:  # run from a copy of the tree (the container image)
        pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
        found: str = tomllib.loads(pyproject.read_text())["project"]["version"]
        return found


__version__ = project_version()
