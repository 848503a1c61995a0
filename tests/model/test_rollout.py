from __future__ import annotations

import pytest
import torch

from model.rollout import (
    Readout,
    attention_map,
    attention_rollout,
    discard_lowest,
    fuse_heads,
    gradient_attention_map,
    gradient_rollout,
    last_layer_attention,
    scale_to_unit,
)
from model.vit import ViTConfig
from tests.support.checkpoints import TINY, tiny_model


def random_attention(b: int = 2, heads: int = 3, n: int = 17, layers: int = 4, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.rand(b, heads, n, n, generator=g).softmax(-1) for _ in range(layers)]


@pytest.mark.parametrize("fn", [attention_rollout, last_layer_attention])
def test_map_shape_and_range(fn) -> None:  # type: ignore[no-untyped-def]
    maps = fn(random_attention())
    assert maps.shape == (2, 4, 4)
    for m in maps:
        assert float(m.min()) == pytest.approx(0.0, abs=1e-6)
        assert float(m.max()) == pytest.approx(1.0, abs=1e-6)


def test_identity_attention_gives_uniform_map() -> None:
    eye = torch.eye(17).expand(2, 3, 17, 17)
    maps = attention_rollout([eye] * 4)
    assert torch.all(maps == maps[0, 0, 0])


def test_rollout_rows_stay_normalised() -> None:
    """Each layer's matrix (fused + identity, renormalised) is row-stochastic, so the product is too."""
    attentions = random_attention()
    result = torch.eye(17).expand(2, 17, 17)
    for a in attentions:
        a = fuse_heads(a) + torch.eye(17)
        a = a / a.sum(-1, keepdim=True)
        result = a @ result
    torch.testing.assert_close(result.sum(-1), torch.ones(2, 17))


def test_rollout_follows_attention_to_one_patch() -> None:
    """If every token attends only to patch 5, rollout puts the peak on patch 5."""
    n = 17
    a = torch.zeros(1, 2, n, n)
    a[..., 1 + 5] = 1.0
    maps = attention_rollout([a, a])
    assert int(maps.flatten().argmax()) == 5


def test_head_fusion_modes() -> None:
    a = torch.tensor([[[[0.2, 0.8]], [[0.6, 0.4]]]])  # (1, 2 heads, 1, 2)
    assert fuse_heads(a, "mean").flatten().tolist() == pytest.approx([0.4, 0.6])
    assert fuse_heads(a, "max").flatten().tolist() == pytest.approx([0.6, 0.8])
    assert fuse_heads(a, "min").flatten().tolist() == pytest.approx([0.2, 0.4])
    with pytest.raises(ValueError, match="head fusion"):
        fuse_heads(a, "median")  # type: ignore[arg-type]


def test_discard_is_applied_to_every_sample() -> None:
    fused = torch.rand(3, 5, 5, generator=torch.Generator().manual_seed(1)) + 0.1  # zeros only from discarding
    fused[1, 0, 0] = 0.05  # the protected CLS-to-CLS entry is the smallest in this sample
    out = discard_lowest(fused, 0.4)
    for b in range(3):
        assert int((out[b] == 0).sum()) == 10  # 40 % of 25 entries, in each sample, not only the first
        assert out[b, 0, 0] == fused[b, 0, 0]
        others = fused[b].flatten()[1:].sort().values
        kept = out[b].flatten()[1:]
        assert float(kept[kept != 0].min()) >= float(others[10]) - 1e-6  # the 10 lowest others went


def test_rollout_with_discard_keeps_range() -> None:
    maps = attention_rollout(random_attention(), discard_ratio=0.5)
    assert float(maps.min()) >= 0.0 and float(maps.max()) <= 1.0


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="at least one layer"):
        attention_rollout([])
    with pytest.raises(ValueError, match="discard_ratio"):
        attention_rollout(random_attention(), discard_ratio=1.0)
    with pytest.raises(ValueError, match="attention method"):
        attention_map(random_attention(), "gradcam")


def test_model_attention_maps_match_grid() -> None:
    model = tiny_model()
    with torch.inference_mode():
        _, attentions = model.forward_with_attention(torch.randn(2, 3, 32, 32))
    assert attention_map(attentions, "rollout").shape == (2, 4, 4)
    assert attention_map(attentions, "last").shape == (2, 4, 4)


def test_readout_skips_registers_and_follows_the_pooling() -> None:
    """A CLS token, 3 registers and a 4x4 grid: maps cover the 16 patches only, read as the model pools."""
    attentions = random_attention(n=1 + 3 + 16)
    last = fuse_heads(attentions[-1])
    cls = last_layer_attention(attentions, readout=Readout(prefix_tokens=4, pool="cls"))
    expected = scale_to_unit(last[:, 0, 4:].reshape(2, 4, 4))
    torch.testing.assert_close(cls, expected)
    avg = last_layer_attention(attentions, readout=Readout(prefix_tokens=4, pool="avg"))
    torch.testing.assert_close(avg, scale_to_unit(last[:, 4:, 4:].mean(dim=1).reshape(2, 4, 4)))
    assert attention_rollout(attentions, readout=Readout(4, "avg")).shape == (2, 4, 4)


def test_model_without_cls_token_gives_maps() -> None:
    model = tiny_model(ViTConfig(**{**TINY.to_dict(), "class_token": False, "pool": "avg", "reg_tokens": 2}))
    _, attentions = model.forward_with_attention(torch.randn(2, 3, 32, 32))
    for method in ("rollout", "last"):
        assert attention_map(attentions, method, model.readout).shape == (2, 4, 4)


def test_axial_blocks_compose_columns_after_rows() -> None:
    """An axial model's two layers per block become one matrix: head-fused columns times head-fused rows."""
    layers = random_attention(n=17, layers=4)  # two blocks: (row, col), (row, col)
    readout = Readout(1, "cls", axial=True)
    blocks = [fuse_heads(layers[1]) @ fuse_heads(layers[0]), fuse_heads(layers[3]) @ fuse_heads(layers[2])]
    torch.testing.assert_close(
        last_layer_attention(layers, readout=readout), scale_to_unit(blocks[1][:, 0, 1:].reshape(2, 4, 4))
    )
    eye = torch.eye(17)
    expected = torch.eye(17).expand(2, 17, 17)
    for b in blocks:
        a = b + eye
        expected = (a / a.sum(-1, keepdim=True)) @ expected
    torch.testing.assert_close(
        attention_rollout(layers, readout=readout), scale_to_unit(expected[:, 0, 1:].reshape(2, 4, 4))
    )
    with pytest.raises(ValueError, match="two attention layers per block"):
        attention_rollout(layers[:3], readout=readout)


def test_gradient_rollout_follows_chefer() -> None:
    """R = I; per layer R += mean_h((grad * A)^+) R; the map is the readout row over the patches."""
    attentions, gradients = random_attention(n=17, layers=3), [torch.randn(2, 3, 17, 17) for _ in range(3)]
    relevance = torch.eye(17).expand(2, 17, 17)
    for a, g in zip(attentions, gradients, strict=True):
        relevance = relevance + (g * a).clamp_min(0).mean(dim=1) @ relevance
    torch.testing.assert_close(
        gradient_rollout(attentions, gradients), scale_to_unit(relevance[:, 0, 1:].reshape(2, 4, 4))
    )


@pytest.fixture(scope="module")
def bundled() -> torch.nn.Module:
    from app.settings import BUNDLED_WEIGHTS
    from model.checkpoint import load_checkpoint

    return load_checkpoint(BUNDLED_WEIGHTS).model


@pytest.fixture(scope="module")
def shapes_batch() -> torch.Tensor:
    from model.data import shapes_preprocessing
    from model.preprocessing import EvalTransform
    from model.shapes import make_sample

    transform = EvalTransform(shapes_preprocessing(64, 1))
    return torch.stack([transform(make_sample(20261121, i).image) for i in range(6)])


def test_gradient_maps_are_per_image_in_a_batch(bundled: torch.nn.Module, shapes_batch: torch.Tensor) -> None:
    """Each image's map in a batch is the map it gets alone, for every image, not just the first."""
    _, maps = gradient_attention_map(bundled, shapes_batch)
    assert maps.shape == (6, 8, 8) and float(maps.min()) >= 0.0 and float(maps.max()) <= 1.0
    for i in range(6):
        _, alone = gradient_attention_map(bundled, shapes_batch[i : i + 1])
        torch.testing.assert_close(maps[i], alone[0], atol=1e-4, rtol=0)
    assert not torch.allclose(maps[0], maps[1])


def test_gradient_maps_depend_on_the_target_class(bundled: torch.nn.Module, shapes_batch: torch.Tensor) -> None:
    logits, top1 = gradient_attention_map(bundled, shapes_batch)
    predicted = logits.argmax(1)
    _, same = gradient_attention_map(bundled, shapes_batch, predicted)
    torch.testing.assert_close(same, top1)
    _, other = gradient_attention_map(bundled, shapes_batch, (predicted + 3) % 10)
    assert all(not torch.allclose(top1[i], other[i], atol=1e-3) for i in range(6))


@pytest.mark.parametrize(
    "variant",
    [
        {"attention_pattern": "axial"},
        {"class_token": False, "pool": "avg", "reg_tokens": 2, "attention_pattern": "axial"},
    ],
)
def test_every_map_works_for_axial_models(variant: dict[str, object]) -> None:
    model = tiny_model(ViTConfig(**{**TINY.to_dict(), **variant}))
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        _, attentions = model.forward_with_attention(x)
    for method in ("rollout", "last"):
        assert attention_map(attentions, method, model.readout).shape == (2, 4, 4)
    assert gradient_attention_map(model, x)[1].shape == (2, 4, 4)


@pytest.mark.parametrize("pool_prefix", [False, True])
def test_attention_pooled_models_with_prefix_tokens_read_their_maps_through_the_pooling(pool_prefix: bool) -> None:
    """CLS and registers before the patches; the pooling reads the patches alone (timm's VisionTransformer) or
    every token (timm's Eva): its `last` map is its own weights on the patches, and every method runs."""
    config = ViTConfig(**{**TINY.to_dict(), "pool": "map", "reg_tokens": 2, "pool_prefix": pool_prefix})
    model = tiny_model(config)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        _, attentions = model.forward_with_attention(x)
    pooling = attentions[-1].mean(dim=1)[:, 0]  # (B, K): heads fused
    patches = pooling[:, -TINY.num_patches :]
    expected = scale_to_unit(patches.reshape(2, 4, 4))
    torch.testing.assert_close(attention_map(attentions, "last", model.readout), expected)
    assert attention_map(attentions, "rollout", model.readout).shape == (2, 4, 4)
    assert gradient_attention_map(model, x)[1].shape == (2, 4, 4)
