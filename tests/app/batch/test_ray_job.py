"""`--ray`: the same job as a Ray Data pipeline on a real local Ray instance gives the single-process rows."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow.dataset
import pytest
import torch

from app.batch.__main__ import main
from app.batch.outputs import read_output

ray = pytest.importorskip("ray")  # the optional extra; the dev environment has it
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def read_shards(folder: Path) -> list[dict[str, Any]]:
    if folder.suffix == ".parquet":
        return list(pyarrow.dataset.dataset(folder, format="parquet").to_table().to_pylist())
    return [json.loads(line) for shard in sorted(folder.glob("*.json")) for line in shard.read_text().splitlines()]


@pytest.mark.parametrize("shards", ["rows.parquet", "rows.jsonl"])
def test_ray_rows_equal_the_single_process_runner(
    local_ray: None, tiny_checkpoint: Path, images: list[Path], tmp_path: Path, shards: str
) -> None:
    common = [
        "--checkpoint",
        str(tiny_checkpoint),
        "--backend",
        "torch",
        "--device",
        "cpu",
        "--batch-size",
        "3",
        "--embedding",
        "--attention",
        "last",
        "--top-k",
        "2",
    ]
    inputs = [str(images[0].parent), str(images[-1])]  # the folder, and the text file named explicitly
    assert main([*inputs, "--output", str(tmp_path / "one.jsonl"), *common]) == 1
    assert main([*inputs, "--output", str(tmp_path / shards), "--ray", "--actors", "2", *common]) == 1
    expected = {r["path"]: r for r in read_output(tmp_path / "one.jsonl")}
    got = {r["path"]: r for r in read_shards(tmp_path / shards)}
    assert set(got) == set(expected) and len(got) == len(images)
    for path, row in got.items():
        want = expected[path]
        assert row["error"] == want["error"] and row["top_k_labels"] == want["top_k_labels"], path
        if want["error"] is None:
            for key in ("top_k_probabilities", "embedding", "attention"):
                torch.testing.assert_close(torch.tensor(row[key]), torch.tensor(want[key]), atol=1e-5, rtol=0)
