"""The docs say what the code does: every setting documented with its real default, every link resolving."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Literal, get_origin

import pytest

from app.choices import choices
from app.settings import Settings
from app.telemetry.metrics import Metrics, ModelMetrics
from harness.server import ROOT

DOCS = sorted((ROOT / "docs").glob("*.md"))


def shown(value: object) -> str:
    """A default as the configuration page writes it."""
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, float) and value.is_integer():
        return f"`{int(value)}`"
    if isinstance(value, Path):
        return f"`{value.relative_to(ROOT) if value.is_relative_to(ROOT) else value}`"
    return f"`{value}`"


def test_every_setting_is_documented_with_its_default() -> None:
    page = (ROOT / "docs" / "configuration.md").read_text()
    rows = dict(re.findall(r"^\| `(VIT_\w+)` \| ([^|]+?) \|", page, re.MULTILINE))
    fields = {f"VIT_{name.upper()}": field.default for name, field in Settings.model_fields.items()}
    assert set(rows) == set(fields), "documented but no setting, or a setting not documented"
    for name, default in fields.items():
        assert rows[name] == shown(default), f"{name}: the page says {rows[name]}, the code {shown(default)}"


def test_every_metric_is_documented() -> None:
    metrics = Metrics()
    ModelMetrics(metrics, "m")
    metrics.requests.labels("http", "/predict", "200").inc()
    metrics.dropped_images.labels("m", "cancelled").inc()
    types = re.findall(r"^# TYPE (\w+) ", metrics.render().decode(), re.MULTILINE)
    exported = {name for name in types if not name.endswith("_created")}  # the client's creation timestamps
    page = (ROOT / "docs" / "operations.md").read_text()
    assert set(re.findall(r"^\| `(vit_\w+)` \|", page, re.MULTILINE)) == exported


def anchors(page: Path) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.DOTALL)
    headings = re.findall(r"^#+ (.+)$", text, re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


@pytest.mark.parametrize("page", [ROOT / "README.md", ROOT / "weights" / "README.md", *DOCS], ids=lambda p: p.name)
def test_relative_links_resolve(page: Path) -> None:
    """Each link to a file reaches it, and each link to a heading (on the page or another) reaches that heading."""
    for target, anchor in re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]*))?\)", page.read_text()):
        if re.match(r"[a-z]+:", target):
            continue
        linked = page.parent / target if target else page
        assert linked.exists(), f"{page.name} links to {target}, which does not exist"
        if anchor and linked.suffix == ".md":
            assert anchor in anchors(linked), f"{page.name} links to {target}#{anchor}, a heading it does not have"


def test_every_closed_choice_is_documented_with_all_its_values() -> None:
    """A setting spelled as a Literal (app/choices.py) lists each of its values on the configuration page."""
    page = (ROOT / "docs" / "configuration.md").read_text()
    rows = dict(re.findall(r"^\| `(VIT_\w+)` \|[^|]+\|(.+)\|$", page, re.MULTILINE))
    checked = 0
    for name, field in Settings.model_fields.items():
        values = choices(field.annotation) if get_origin(field.annotation) is Literal else ()
        for value in values:
            assert value in rows[f"VIT_{name.upper()}"], f"VIT_{name.upper()}: {value} is not documented"
        checked += bool(values)
    assert checked >= 4  # backend, decode, model_control, log_level


NUMBERS = {"one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6}


def test_the_zero_shot_transcript_counts_the_probabilities_it_shows() -> None:
    """docs/pretrained.md's words about SigLIP's answer count what its transcript's SigLIP answer holds."""
    page = (ROOT / "docs" / "pretrained.md").read_text()
    answer = next(line for line in page.splitlines() if line.startswith('{"model":{"name":"siglip"'))
    shown = len(json.loads(answer)["results"][0]["probabilities"])
    [said] = re.findall(r"SigLIP's (\w+) probabilities", page)
    assert NUMBERS[said] == shown, f"the page says {said}, its transcript shows {shown}"


def test_the_batch_transcripts_read_only_files_the_page_makes() -> None:
    """Every file a command on docs/batch.md reads under imgs/ is made by a command before it on the page."""
    page = (ROOT / "docs" / "batch.md").read_text()
    for command in re.finditer(r"^\$ python -m app\.batch (.*)$", page, re.MULTILINE):
        made = page[: command.start()]
        for path in re.findall(r"\b(imgs/[\w.]+)", command[1]):
            written = re.search(rf"> ?{re.escape(path)}\b|Path\('{re.escape(path)}'\)\.write_", made)
            assert written, f"docs/batch.md: `{command[0]}` reads {path}, which no command before it makes"
