"""Every benchmark and evaluation command the docs give runs as written: each one's arguments, read by its own
argument parser (in one fresh interpreter that stops each command once its arguments are read, so nothing is
measured), and its results file, where the docs link one, names its commit and machine."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "weights").glob("*.md"))]
pytestmark = pytest.mark.slow  # a fresh interpreter that imports every scenario

# Run in a fresh interpreter: each command's module run as `python -m` runs it, until its parser has read the
# arguments; then the command stops (its arguments taken), or argparse's own error says what it refused.
PARSE_ONLY = """
import argparse, json, runpy, sys

class Parsed(Exception):
    pass

real = argparse.ArgumentParser.parse_known_args

def parse_known_args(self, args=None, namespace=None):
    known, extra = real(self, args, namespace)
    if extra:
        self.error("unrecognized arguments: " + " ".join(extra))
    raise Parsed

argparse.ArgumentParser.parse_known_args = parse_known_args
verdicts = {}
for command in json.loads(sys.argv[1]):
    module, *args = command
    sys.argv = [module, *args]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        verdicts[" ".join(command)] = "ran without reading arguments"
    except Parsed:
        verdicts[" ".join(command)] = "ok"
    except SystemExit as e:
        verdicts[" ".join(command)] = f"exit {e.code}"
print(json.dumps(verdicts))
"""


def documented_commands() -> set[str]:
    """`python -m bench...` and `python -m evaluation...` as the pages give them, inline or in code blocks (lines
    joined where they continue, comments dropped); templates (`SCENARIO`, `N [N ...]`, `a|b`) left out."""
    found = set()
    for page in PAGES:
        text = page.read_text()
        for block in re.findall(r"```[a-z]*\n(.*?)```", text, re.DOTALL):
            for line in block.replace("\\\n", " ").splitlines():
                command = re.match(r"\s*(?:\S*/)?(python -m .*)", line)  # `.venv/bin/python -m` too
                if command:
                    found.add(command.group(1).split(" #")[0])
        for span in re.findall(r"`([^`]+)`", re.sub(r"```.*?```", "", text, flags=re.DOTALL)):
            found.add(span)
    commands = {" ".join(c.split()) for c in found}
    return {
        c
        for c in commands
        if re.match(r"python -m (bench|evaluation)\b", c) and not re.search(r"[A-Z]{3,}|\||\[", c.split(" ", 3)[-1])
    }


def test_every_documented_command_is_taken_by_its_parser() -> None:
    commands = sorted(documented_commands())
    assert len(commands) > 20 and "python -m bench feature-cost" in commands  # the reading found the docs' commands
    argv = []
    for command in commands:
        words = shlex.split(command)[2:]  # after `python -m`
        argv.append(["bench", *words[1:]] if words[0] == "bench" else words)
    done = subprocess.run(
        [sys.executable, "-c", PARSE_ONLY, json.dumps(argv)], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    verdicts = json.loads(done.stdout.strip().splitlines()[-1])
    refused = {c: v for c, v in verdicts.items() if v != "ok" and not c.endswith(("bench", "--help"))}
    assert not refused, f"{refused}\n{done.stderr[-3000:]}"


def test_every_results_file_the_docs_link_names_its_commit_and_machine() -> None:
    linked = set()
    for page in PAGES:
        for target in re.findall(r"\]\(([^)#]*results/[^)#]+\.md)\)", page.read_text()):
            linked.add((page.parent / target).resolve())
    assert len(linked) > 10
    for markdown in sorted(linked):
        data = json.loads(markdown.with_suffix(".json").read_text())
        if isinstance(data, list):  # entries gathered over runs (the stand-in's): each names its own
            assert data and all(entry["commit"] and entry["machine"] for entry in data), markdown.name
            continue
        record = data.get("record", data)  # a GPU run keeps its commit and machine at the top
        parts = [part for part in data.values() if isinstance(part, dict) and "commit" in part]  # or an A/B's parts
        commits = [record["commit"]] if record.get("commit") else [part["commit"] for part in parts]
        assert commits and all(commits) and record.get("machine"), markdown.name
