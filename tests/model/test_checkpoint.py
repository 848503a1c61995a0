from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from model.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from model.preprocessing import Preprocessing
from model.shapes import SHAPE_CLASSES
from tests.support.checkpoints import TINY, TINY_PREPROCESSING, tiny_model


def test_round_trip_restores_the_same_model(tiny_checkpoint: Path) -> None:
    ckpt = load_checkpoint(tiny_checkpoint)
    x = torch.randn(2, 3, 32, 32)
    with torch.inference_mode():
        torch.testing.assert_close(ckpt.model(x), tiny_model()(x))
    assert ckpt.config == TINY
    assert ckpt.classes == SHAPE_CLASSES
    assert ckpt.preprocessing == TINY_PREPROCESSING
    assert ckpt.training == {"dataset": "shapes", "seed": 0}
    assert len(ckpt.content_hash) == 64 and ckpt.version == ckpt.content_hash[:12]


def test_checkpoint_is_readable_by_other_users(tiny_checkpoint: Path) -> None:
    assert tiny_checkpoint.stat().st_mode & 0o444 == 0o444


def test_content_hash_follows_the_weights(tmp_path: Path) -> None:
    a = save_checkpoint(tmp_path / "a.safetensors", tiny_model(seed=0), list(SHAPE_CLASSES), TINY_PREPROCESSING)
    b = save_checkpoint(tmp_path / "b.safetensors", tiny_model(seed=0), list(SHAPE_CLASSES), TINY_PREPROCESSING)
    c = save_checkpoint(tmp_path / "c.safetensors", tiny_model(seed=1), list(SHAPE_CLASSES), TINY_PREPROCESSING)
    assert a == b != c


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"nope\.safetensors: file not found"):
        load_checkpoint(tmp_path / "nope.safetensors")


def test_a_folder_is_named_as_one(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="a folder, not a checkpoint file: name the .safetensors file in it"):
        load_checkpoint(tmp_path)


def test_truncated_file(tiny_checkpoint: Path) -> None:
    data = tiny_checkpoint.read_bytes()
    tiny_checkpoint.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated or corrupted") as e:
        load_checkpoint(tiny_checkpoint)
    assert str(tiny_checkpoint) in str(e.value)


def test_garbage_file(tmp_path: Path) -> None:
    path = tmp_path / "garbage.safetensors"
    path.write_bytes(b"\x00" * 100)
    with pytest.raises(CheckpointError, match="not a readable safetensors file"):
        load_checkpoint(path)


def test_flipped_tensor_bytes_fail_the_hash(tiny_checkpoint: Path) -> None:
    data = bytearray(tiny_checkpoint.read_bytes())
    data[-10] ^= 0xFF  # inside the tensor data, past the header
    tiny_checkpoint.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="content hash mismatch"):
        load_checkpoint(tiny_checkpoint)


def rewrite(path: Path, tensors: dict[str, torch.Tensor] | None = None, **meta_changes: str) -> None:
    """Re-save a checkpoint with edited tensors or metadata (keeping the hash honest unless edited)."""
    from model.checkpoint import content_hash, read_checkpoint_file

    old_tensors, meta = read_checkpoint_file(path)
    tensors = tensors if tensors is not None else old_tensors
    meta = {**meta, "content_hash": content_hash(tensors), **meta_changes}
    save_file(tensors, str(path), metadata=meta)


def test_shape_mismatch_names_the_tensor(tiny_checkpoint: Path) -> None:
    tensors = load_file(str(tiny_checkpoint))
    tensors["head.weight"] = torch.zeros(7, TINY.dim)
    rewrite(tiny_checkpoint, tensors)
    with pytest.raises(CheckpointError, match=r"tensor head\.weight has shape \(7, 32\), config expects \(10, 32\)"):
        load_checkpoint(tiny_checkpoint)


def test_missing_tensor(tiny_checkpoint: Path) -> None:
    tensors = load_file(str(tiny_checkpoint))
    del tensors["norm.weight"]
    rewrite(tiny_checkpoint, tensors)
    with pytest.raises(CheckpointError, match="missing.*norm.weight"):
        load_checkpoint(tiny_checkpoint)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"format": "other"}, "not a checkpoint of this project"),
        ({"format_version": "99"}, "format version '99' is not supported"),
        ({"config": "{not json"}, "invalid metadata"),
        ({"config": json.dumps({**TINY.to_dict(), "dim": 33})}, "invalid metadata: dim 33 is not divisible"),
        ({"classes": json.dumps(["a", "b"])}, "2 class names but config.num_classes=10"),
    ],
)
def test_bad_metadata(tiny_checkpoint: Path, changes: dict[str, str], message: str) -> None:
    rewrite(tiny_checkpoint, **changes)
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(tiny_checkpoint)


def test_plain_safetensors_without_metadata_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "plain.safetensors"
    save_file(tiny_model().state_dict(), str(path))
    with pytest.raises(CheckpointError, match="not a checkpoint of this project"):
        load_checkpoint(path)


def test_save_refuses_wrong_class_count(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="3 class names for a model with 10 classes"):
        save_checkpoint(tmp_path / "x.safetensors", tiny_model(), ["a", "b", "c"], TINY_PREPROCESSING)


def test_preprocessing_validation() -> None:
    with pytest.raises(ValueError, match="mean and std need 3 values"):
        Preprocessing(32, 3, (0.5,), (0.5,))
    with pytest.raises(ValueError, match="resize must be"):
        Preprocessing(32, 1, (0.5,), (0.5,), "stretch")  # type: ignore[arg-type]
