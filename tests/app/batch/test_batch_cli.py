"""`python -m app.batch` through its command line: rows equal the service's answers, bad files are rows,
every output format, resume, and outputs that are whole or absent."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch

from app.batch.__main__ import main
from app.batch.outputs import atomic_file, journal_path, read_output
from app.settings import BUNDLED_WEIGHTS
from harness.preloaded import run_command, start_command
from harness.server import ROOT
from tests.support.clients import ClientFactory

pytestmark = pytest.mark.slow  # runs the batch command in processes of its own


def run(checkpoint: Path, inputs: list[Path], output: Path, *flags: str) -> int:
    argv = [
        *map(str, inputs),
        "--output",
        str(output),
        "--checkpoint",
        str(checkpoint),
        "--device",
        "cpu",
        "--backend",
        "torch",
        "--batch-size",
        "4",
        *flags,
    ]
    return main(argv)


def test_rows_equal_the_services_answers(
    tiny_checkpoint: Path, images: list[Path], tmp_path: Path, make_client: ClientFactory
) -> None:
    output = tmp_path / "out.jsonl"
    flags = ("--top-k", "3", "--probabilities", "--embedding", "--attention", "rollout")
    assert run(tiny_checkpoint, images, output, *flags) == 1  # two files failed
    rows = {r["path"]: r for r in read_output(output)}
    assert list(rows) == [str(p) for p in images]  # input order
    answers = asyncio.run(served(make_client, images))
    for path, r in zip(images, answers, strict=True):
        row = rows[str(path)]
        if r.status_code != 200:
            assert row["error"] == r.json()["detail"] and row["label"] is None
            continue
        served_row = r.json()["results"][0]
        assert row["error"] is None
        assert row["top_k_labels"] == [t["label"] for t in served_row["top_k"]]
        assert row["label"] == served_row["top_k"][0]["label"]
        for key in ("probabilities", "embedding"):
            torch.testing.assert_close(torch.tensor(row[key]), torch.tensor(served_row[key]), atol=1e-6, rtol=0)
        torch.testing.assert_close(torch.tensor(row["attention"]), torch.tensor(served_row["attention"]["map"]))
    errors = [r["error"] for r in rows.values() if r["error"]]
    assert len(errors) == 2 and all("not a recognised image" in e or "truncated" in e for e in errors)


async def served(make_client: ClientFactory, images: list[Path]) -> list[httpx.Response]:
    """The service's answers for the same files, each sent under its path as the file name."""
    answers = []
    async with make_client(max_batch_size=4) as client:
        for path in images:
            files = {"file": (str(path), path.read_bytes(), "application/octet-stream")}
            params: dict[str, str | int | bool] = {"top_k": 3, "attention": "rollout", "embedding": True}
            answers.append(await client.post("/predict", files=files, params=params))
    return answers


@pytest.mark.parametrize("suffix", [".jsonl", ".csv", ".parquet"])
def test_every_format_holds_the_same_rows(
    tiny_checkpoint: Path, images: list[Path], tmp_path: Path, suffix: str
) -> None:
    reference, output = tmp_path / "ref.jsonl", tmp_path / f"out{suffix}"
    assert run(tiny_checkpoint, images, reference, "--embedding") == 1
    assert run(tiny_checkpoint, images, output, "--embedding") == 1
    expected, got = read_output(reference), read_output(output)
    assert [r["path"] for r in got] == [r["path"] for r in expected]
    for a, b in zip(got, expected, strict=True):
        assert a["label"] == b["label"] and a["error"] == b["error"] and a["top_k_labels"] == b["top_k_labels"]
        if b["embedding"] is not None:
            torch.testing.assert_close(torch.tensor(a["embedding"]), torch.tensor(b["embedding"]))
    assert not journal_path(output).exists()


def test_resume_computes_only_what_is_missing(tiny_checkpoint: Path, images: list[Path], tmp_path: Path) -> None:
    output = tmp_path / "out.csv"
    good = images[:8]
    assert run(tiny_checkpoint, good[:3], output) == 0
    finished = read_output(output)
    # An interrupted run: two more rows in its journal, marked so a recomputation would show, and a torn line.
    marked = [{**finished[0], "path": str(p), "label": "from the journal"} for p in good[3:5]]
    journal_path(output).write_text("".join(json.dumps(r) + "\n" for r in marked) + '{"path": "' + str(good[5]))
    assert run(tiny_checkpoint, good, output) == 2  # without --resume an existing output is refused
    assert run(tiny_checkpoint, good, output, "--resume") == 0
    rows = read_output(output)
    assert [r["path"] for r in rows] == [str(p) for p in good]
    assert rows[:3] == finished
    assert [r["label"] for r in rows[3:5]] == ["from the journal"] * 2  # not computed twice
    assert all(
        r["label"]
        in {"circle", "square", "triangle", "pentagon", "hexagon", "star", "cross", "ring", "crescent", "arrow"}
        for r in rows[5:]
    )
    assert not journal_path(output).exists()


def test_a_failed_write_leaves_the_previous_output_whole(tmp_path: Path) -> None:
    output = tmp_path / "out.jsonl"
    output.write_text('{"path": "a"}\n')
    with pytest.raises(RuntimeError), atomic_file(output) as tmp:
        tmp.write_text('{"path": "b"')
        raise RuntimeError("killed mid-write")
    assert output.read_text() == '{"path": "a"}\n' and list(tmp_path.iterdir()) == [output]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["missing-dir", "--output", "o.jsonl"], "missing-dir: no such file or directory"),
        (["{images}", "--output", "o.xlsx"], "the output's suffix names its format"),
        (["{images}", "--output", "o.jsonl", "--target", "star"], "target chooses the class a gradient map explains"),
        (
            ["{images}", "--output", "o.jsonl", "--attention", "gradient", "--target", "moon"],
            "target 'moon' names no class",
        ),
        (["{images}", "--output", "no-folder/o.jsonl"], "o.jsonl: there is no folder no-folder to write it in"),
        (["{images}", "--output", "o.jsonl", "--threads", "-1"], "argument --threads: must be at least 0, got -1"),
        (["{images}", "--output", "o.jsonl", "--top-k", "0"], "argument --top-k: must be at least 1, got 0"),
    ],
)
def test_bad_arguments_exit_2_with_what_to_fix(
    tiny_checkpoint: Path,
    images: list[Path],
    tmp_path: Path,
    args: list[str],
    message: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    argv = [a.replace("{images}", str(images[0].parent)) for a in args]
    monkeypatch.chdir(tmp_path)
    for name in [n for n in os.environ if n.startswith("VIT_")]:
        monkeypatch.delenv(name)
    try:
        status = main([*argv, "--checkpoint", str(tiny_checkpoint), "--backend", "torch"])
    except SystemExit as exited:  # argparse's refusals
        status = exited.code
    err = capsys.readouterr().err
    assert status == 2, err
    assert message in err


def test_a_killed_run_resumes_where_its_journal_ends(tiny_checkpoint: Path, images: list[Path], tmp_path: Path) -> None:
    """Killed (SIGKILL) while blocked on its eleventh input, the run has synced its first windows; --resume
    computes only the rest, and the output equals an uninterrupted run's."""
    good = images[:8]
    fifo = tmp_path / "slow.png"
    os.mkfifo(fifo)  # reading it blocks until a writer comes: the run stops there, mid-job
    inputs = [*good, *good[:2], fifo, *good[2:4]]
    inputs = [tmp_path / f"copy{i}.png" if p != fifo else p for i, p in enumerate(inputs)]
    for i, p in enumerate(inputs):
        if p != fifo:
            p.write_bytes(good[i % 8].read_bytes())
    output = tmp_path / "out.jsonl"
    argv = [
        sys.executable,
        "-m",
        "app.batch",
        *map(str, inputs),
        "--output",
        str(output),
        "--checkpoint",
        str(tiny_checkpoint),
        "--backend",
        "torch",
        "--device",
        "cpu",
        "--batch-size",
        "1",
    ]
    with open(os.devnull, "w") as devnull:
        proc = start_command(argv, devnull, devnull, cwd=ROOT)
    journal = journal_path(output)
    deadline = time.monotonic() + 60
    while not (journal.exists() and journal.read_text().count("\n") >= 8):
        assert proc.poll() is None and time.monotonic() < deadline, "the run ended or stalled before its journal filled"
        time.sleep(0.05)
    time.sleep(0.5)  # time for rows 8 and 9 to be done, unwritten as they wait for their window: not journaled
    proc.kill()
    proc.wait()
    assert not output.exists()  # the output is written only at the end: whole or absent
    kept = journal.read_text().splitlines()
    assert len(kept) == 8
    fifo.unlink()
    fifo.write_bytes(good[0].read_bytes())
    resumed = run_command([*argv, "--resume"], cwd=ROOT)
    assert resumed.returncode == 0, resumed.stderr
    assert f"{len(inputs) - 8} images classified" in resumed.stderr and "8 already done" in resumed.stderr
    rows = read_output(output)
    assert [r["path"] for r in rows] == [str(p) for p in inputs]
    assert [json.dumps(r) for r in rows[:8]] == kept  # kept as the journal had them, not recomputed
    fresh = tmp_path / "fresh.jsonl"
    assert run(tiny_checkpoint, inputs, fresh) == 0
    for a, b in zip(rows, read_output(fresh), strict=True):
        assert a["label"] == b["label"] and a["top_k_labels"] == b["top_k_labels"]


def test_a_zero_shot_model_classifies_into_the_labels_given(
    images: list[Path], tmp_path: Path, make_client: ClientFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    from model.convert.__main__ import main as convert_main
    from tests.support.zero_shot import clip_repo

    repo = clip_repo(tmp_path / "repo")
    clip = convert_main(["hf", "--model-dir", str(repo.path), "--output", str(tmp_path / "clip.safetensors")])
    assert run(clip, images[:2], tmp_path / "none.jsonl") == 2  # no labels, and the model has none
    assert "no default labels" in capsys.readouterr().err
    output = tmp_path / "out.jsonl"
    assert run(clip, images[:2], output, "--labels", "cat,dog", "--label", "Hello, World!", "--probabilities") == 0
    rows = read_output(output)

    async def answers() -> list[httpx.Response]:
        async with make_client(weights=clip) as client:
            params = {"labels": "cat,dog", "label": "Hello, World!", "top_k": 3}
            return [
                await client.post("/predict", files={"file": (p.name, p.read_bytes())}, params=params)
                for p in images[:2]
            ]

    for row, r in zip(rows, asyncio.run(answers()), strict=True):
        served_row = r.json()["results"][0]
        assert row["top_k_labels"] == [t["label"] for t in served_row["top_k"]]
        assert sorted(row["top_k_labels"]) == ["Hello, World!", "cat", "dog"]
        torch.testing.assert_close(torch.tensor(row["probabilities"]), torch.tensor(served_row["probabilities"]))


def test_a_head_taught_by_example_classifies_into_its_classes(
    images: list[Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--head: the head beside the checkpoint answers, the rows' classes its own, its probabilities those it gives
    the embeddings the run writes; a head the model lacks fails before any image."""
    from model.checkpoint import load_checkpoint
    from model.taught_head import fit, save
    from model.teach import head_path

    checkpoint = tmp_path / "shapes.safetensors"
    checkpoint.write_bytes(BUNDLED_WEIGHTS.read_bytes())
    ckpt = load_checkpoint(checkpoint)
    g = torch.Generator().manual_seed(0)
    head = fit(torch.randn(8, ckpt.config.dim, generator=g), [0] * 4 + [1] * 4, ["left", "right"], ckpt.content_hash)
    save(head, head_path(checkpoint, "sides"))
    assert run(checkpoint, images[:2], tmp_path / "none.jsonl", "--head", "other") == 2
    assert "model shapes has no head named 'other'; its heads: sides" in capsys.readouterr().err
    output = tmp_path / "out.jsonl"
    assert run(checkpoint, images[:4], output, "--head", "sides", "--probabilities", "--embedding") == 0
    rows = read_output(output)
    assert len(rows) == 4 and all(sorted(row["top_k_labels"]) == ["left", "right"] for row in rows)
    for row in rows:
        expected = head.probabilities(torch.tensor([row["embedding"]]))[0]
        torch.testing.assert_close(torch.tensor(row["probabilities"]), expected, atol=1e-5, rtol=0)
