from __future__ import annotations

from pathlib import Path

import pytest

from harness.images import encode
from model.shapes import make_sample


@pytest.fixture
def images(tmp_path: Path) -> list[Path]:
    """Eight PNG and JPEG shapes in a folder tree, a corrupt PNG and a text file."""
    folder = tmp_path / "images"
    (folder / "sub").mkdir(parents=True)
    paths = []
    for i in range(8):
        path = folder / ("sub" if i % 2 else "") / f"{i}.{'png' if i % 3 else 'jpg'}"
        make_sample(5, i).image.convert("RGB").save(path)
        paths.append(path)
    (folder / "broken.png").write_bytes(encode(make_sample(5, 9).image)[:60])
    (folder / "notes.txt").write_text("not an image")
    return [*paths, folder / "broken.png", folder / "notes.txt"]
