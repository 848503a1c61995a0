from __future__ import annotations

from pathlib import Path

import pytest

from app.batch.inputs import InputError, expand_inputs


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    for name in ("b.jpg", "a.PNG", "sub/c.webp", "sub/deep/d.gif", "notes.txt", "sub/e.bmp"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(b"x")
    return tmp_path


def test_a_directory_gives_its_image_files_recursively_sorted(tree: Path) -> None:
    got = [Path(p).relative_to(tree).as_posix() for p in expand_inputs([str(tree)])]
    assert got == ["a.PNG", "b.jpg", "sub/c.webp", "sub/deep/d.gif", "sub/e.bmp"]


def test_files_patterns_and_lists_in_the_order_given_each_once(tree: Path) -> None:
    listing = tree / "list.txt"
    listing.write_text(f"# a comment\n{tree / 'notes.txt'}\n\n{tree / 'sub'}/*.webp\n")
    got = expand_inputs([str(tree / "b.jpg"), f"@{listing}", f"{tree}/**/*.gif", str(tree / "b.jpg")])
    assert [Path(p).name for p in got] == ["b.jpg", "notes.txt", "c.webp", "d.gif"]


@pytest.mark.parametrize("item", ["missing.jpg", "nothing/*.png", "@no-such-list.txt"])
def test_inputs_that_name_nothing_are_refused(tmp_path: Path, item: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(InputError, match=item.split("/")[0].lstrip("@")):
        expand_inputs([item])
