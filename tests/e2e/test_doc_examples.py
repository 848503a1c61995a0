"""The README's and api.md's examples against a real server, so that what they show cannot drift from what the
service answers: their own commands make the images, each `curl` to the service is sent as written, and the
output block after it must match (numbers within 1e-4; a result shown alone is matched against the response's
result, on the keys it shows)."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

from app.settings import BUNDLED_WEIGHTS
from harness.server import ROOT, Server
from tests.support.servers import ServerFactory

pytestmark = [pytest.mark.slow, pytest.mark.e2e]
PAGES = [ROOT / "README.md", ROOT / "docs" / "api.md"]
BLOCK = re.compile(r"^```(\w*)\n(.*?)^```", re.MULTILINE | re.DOTALL)
EMBEDDING_SHOWN = re.compile(r'gives `"embedding": \[([-0-9., ]+), \.\.\.\]`')


@dataclass(frozen=True)
class Block:
    language: str
    text: str
    end: int  # where it ends in the page


def blocks(page: str) -> list[Block]:
    return [Block(m.group(1), m.group(2), m.end()) for m in BLOCK.finditer(page)]


def commands(block: Block) -> list[str]:
    """The block's shell commands: continued lines joined, and lines inside an open quote (a `python -c "..."`
    over several lines) kept with their command; comment lines dropped."""
    out: list[str] = []
    pending = ""
    for line in block.text.replace("\\\n", " ").splitlines():
        pending = f"{pending}\n{line}" if pending else line
        if pending.count('"') % 2 == 0:
            if pending.strip() and not pending.lstrip().startswith("#"):
                out.append(pending)
            pending = ""
    return out


def is_service_call(command: str) -> bool:
    return command.startswith("curl ") and "localhost:8000" in command


def make_images(folder: Path) -> None:
    """Run every documented command that writes a sample image (`.venv/bin/python -c "..."`), in `folder`."""
    for page in PAGES:
        text = page.read_text()
        for block in blocks(text):
            if block.language not in ("bash", "sh", ""):
                continue
            for command in commands(block):
                if command.startswith(".venv/bin/python -c") and ".save(" in command:
                    argv = shlex.split(command)
                    env = {**os.environ, "PYTHONPATH": str(ROOT)}
                    subprocess.run([sys.executable, *argv[1:]], cwd=folder, env=env, check=True, timeout=120)
        for inline in re.findall(r"`(\.venv/bin/python -c \"[^`]*\.save\([^`]*\")`", text):
            argv = shlex.split(inline)
            env = {**os.environ, "PYTHONPATH": str(ROOT)}
            subprocess.run([sys.executable, *argv[1:]], cwd=folder, env=env, check=True, timeout=120)


def send(command: str, base: str, folder: Path) -> Any:
    """A documented `curl` to the service, sent to `base` with httpx: -s, -F field=@file, --data-binary @file,
    -H header, and the URL are understood; anything else fails the test, naming the form."""
    argv = shlex.split(command.split("  #")[0])[1:]
    files: list[tuple[str, tuple[str, bytes]]] = []
    headers: dict[str, str] = {}
    body: bytes | None = None
    url = ""
    while argv:
        arg = argv.pop(0)
        if arg == "-s":
            continue
        if arg == "-F":
            field, _, name = argv.pop(0).partition("=@")
            files.append((field, (name, (folder / name).read_bytes())))
        elif arg == "--data-binary":
            body = (folder / argv.pop(0).removeprefix("@")).read_bytes()
        elif arg == "-H":
            key, _, value = argv.pop(0).partition(": ")
            headers[key] = value
        elif arg.startswith("http://localhost:8000"):
            parts = urlsplit(arg)
            url = f"{base}{parts.path}" + (f"?{parts.query}" if parts.query else "")
        else:
            raise AssertionError(f"a curl form the check does not read: {arg!r} in {command!r}")
    if not files and body is None:
        r = httpx.get(url, timeout=60)
    else:
        r = httpx.post(url, files=files or None, content=body, headers=headers, timeout=60)
    assert r.status_code == 200, (command, r.text)
    return r.json()


def close(shown: Any, got: Any, where: str) -> None:
    """`shown` as the page prints it against `got`: the same structure, numbers within 1e-4; a dict shown may
    leave keys out."""
    if isinstance(shown, dict):
        assert isinstance(got, dict), where
        for key, value in shown.items():
            assert key in got, f"{where}: the service gives no {key!r}"
            close(value, got[key], f"{where}.{key}")
    elif isinstance(shown, list):
        assert isinstance(got, list) and len(got) == len(shown), f"{where}: {len(shown)} items shown, {got!r}"
        for i, (a, b) in enumerate(zip(shown, got, strict=True)):
            close(a, b, f"{where}[{i}]")
    elif isinstance(shown, float) and not isinstance(got, bool):
        assert got == pytest.approx(shown, abs=1e-4), f"{where}: shown {shown}, the service gives {got}"
    else:
        assert shown == got, f"{where}: shown {shown!r}, the service gives {got!r}"


@pytest.fixture(scope="module")
def server(serve: ServerFactory) -> Server:
    # api.md's out-of-distribution example is shown with this threshold
    return serve(BUNDLED_WEIGHTS, VIT_OOD_THRESHOLD="vit-shapes=0.5")


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every image the pages' commands make, made once for both pages."""
    folder = tmp_path_factory.mktemp("doc-images")
    make_images(folder)
    return folder


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_the_pages_examples_are_what_the_service_answers(server: Server, page: Path, images: Path) -> None:
    tmp_path = images
    text = page.read_text()
    found = blocks(text)
    checked = 0
    for block, after in zip(found, [*found[1:], None], strict=True):
        calls = [c for c in commands(block) if is_service_call(c)] if block.language in ("bash", "sh") else []
        if not calls or any(not (tmp_path / n).exists() for c in calls for n in re.findall(r"@(\S+)", c)):
            continue  # not a call, or one on files the page does not make (a.png, b.jpg)
        between = text[block.end : text.find("```", block.end)] if after else ""
        if after is not None and not between.strip() and after.language in ("json", "text", ""):
            outputs = [json.loads(line) for line in after.text.splitlines() if line.startswith("{")]
            if len(outputs) == len(calls):
                for call, shown in zip(calls, outputs, strict=True):
                    got = send(call, server.url, tmp_path)
                    if "filename" in shown:  # one result, shown alone
                        got = next(r for r in got["results"] if r["filename"] == shown["filename"])
                    close(shown, got, f"{page.name}: {call}")
                    checked += 1
                continue
        if len(calls) == 1 and (m := EMBEDDING_SHOWN.match(text[block.end :].lstrip())):
            shown_values = [float(v) for v in m.group(1).split(",")]
            got_values = send(calls[0], server.url, tmp_path)["results"][0]["embedding"][: len(shown_values)]
            for a, b in zip(shown_values, got_values, strict=True):  # shown to 3 or 4 significant digits
                assert b == pytest.approx(a, rel=5e-3, abs=5e-4), (calls[0], shown_values, got_values)
            checked += 1
    assert checked >= (1 if page.name == "README.md" else 5), f"{page.name}: {checked} examples found to check"
