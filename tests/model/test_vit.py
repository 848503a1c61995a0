from __future__ import annotations

import pytest
import torch

from model.rollout import attention_map
from model.vit import ViT, ViTConfig, build_pos_embed, resample_pos_embed
from tests.support.checkpoints import TINY, tiny_model


def test_forward_shape() -> None:
    model = tiny_model()
    logits = model(torch.randn(3, 3, 32, 32))
    assert logits.shape == (3, 10)


@pytest.mark.parametrize("pos_embed", ["learned", "sincos1d", "sincos2d"])
def test_fused_and_explicit_attention_agree(pos_embed: str) -> None:
    config = ViTConfig(**{**TINY.to_dict(), "pos_embed": pos_embed})
    model = tiny_model(config)
    x = torch.randn(4, 3, 32, 32)
    with torch.inference_mode():
        fused = model(x)
        explicit, attentions = model.forward_with_attention(x)
    torch.testing.assert_close(fused, explicit, atol=1e-5, rtol=0)
    n = 1 + config.num_patches
    assert len(attentions) == config.depth
    for a in attentions:
        assert a.shape == (4, config.heads, n, n)
        torch.testing.assert_close(a.sum(-1), torch.ones(4, config.heads, n), atol=1e-5, rtol=0)


def test_one_image_does_not_depend_on_its_batch() -> None:
    model = tiny_model()
    x = torch.randn(5, 3, 32, 32)
    with torch.inference_mode():
        torch.testing.assert_close(model(x)[2:3], model(x[2:3]), atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"image_size": 30, "patch_size": 8}, "not divisible by patch_size"),
        ({"dim": 30, "heads": 4}, "not divisible by heads"),
        ({"in_channels": 2}, "in_channels must be 1 or 3"),
        ({"pos_embed": "rope"}, "pos_embed must be one of"),
        ({"num_classes": 1}, "num_classes must be at least 2"),
    ],
)
def test_config_errors_are_clear(changes: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ViTConfig(**{**TINY.to_dict(), **changes})


def test_config_round_trips_and_rejects_unknown_fields() -> None:
    assert ViTConfig.from_dict(TINY.to_dict()) == TINY
    with pytest.raises(ValueError, match="unknown ViTConfig fields"):
        ViTConfig.from_dict({**TINY.to_dict(), "rope_theta": 100.0})


def test_fixed_position_tables_stay_out_of_the_state_dict() -> None:
    for kind, in_state in [("learned", True), ("sincos1d", False), ("sincos2d", False)]:
        model = ViT(ViTConfig(**{**TINY.to_dict(), "pos_embed": kind}))
        assert ("pos_embed" in model.state_dict()) is in_state
        assert model.pos_embed.shape == (1, 1 + TINY.num_patches, TINY.dim)


def test_sincos2d_leaves_cls_without_position() -> None:
    table = build_pos_embed("sincos2d", grid=4, dim=32)
    assert table.shape == (1, 17, 32)
    assert torch.count_nonzero(table[0, 0]) == 0
    assert len({tuple(row.tolist()) for row in table[0, 1:]}) == 16  # every patch position differs


def test_init_is_truncated_normal() -> None:
    model = ViT(ViTConfig(**{**TINY.to_dict(), "dim": 64, "mlp_ratio": 4.0}))
    w = model.blocks[0].mlp.fc1.weight.detach()
    assert abs(float(w.std()) - 0.02) < 0.003  # timm: trunc_normal_(std=.02), bounds at +-2
    assert float(w.abs().max()) < 0.2
    assert torch.all(model.blocks[0].mlp.fc1.bias == 0)
    assert float(model.cls_token.detach().abs().max()) < 1e-4


def test_patch_embedding_keeps_pytorch_default_init() -> None:
    model = ViT(ViTConfig(**{**TINY.to_dict(), "dim": 64}))
    w = model.patch_embed.proj.weight.detach()  # kaiming-uniform(a=sqrt(5)): std = 1 / sqrt(3 * fan_in)
    fan_in = w[0].numel()
    assert abs(float(w.std()) - (3 * fan_in) ** -0.5) < 0.1 * (3 * fan_in) ** -0.5


def self_attention_share(model: ViT, x: torch.Tensor) -> float:
    """Mean weight a patch token gives itself in the first block."""
    with torch.inference_mode():
        _, attentions = model.forward_with_attention(x)
    patches = attentions[0][:, :, 1:, 1:]
    return float(patches.diagonal(dim1=-2, dim2=-1).mean())


def test_mimetic_init_makes_first_layer_attention_local() -> None:
    config = ViTConfig(image_size=32, patch_size=4, in_channels=1, dim=64, depth=2, heads=4, mlp_ratio=2.0)
    torch.manual_seed(0)
    x = torch.randn(4, 1, 32, 32)
    plain = ViT(config)
    mimetic = ViT(config).mimetic_init_(torch.Generator().manual_seed(0))
    uniform = 1 / (1 + config.num_patches)
    assert self_attention_share(plain, x) < 2 * uniform  # random init: near-uniform attention
    assert self_attention_share(mimetic, x) > 5 * uniform  # mimetic: each token attends to itself
    with torch.inference_mode():
        _, attentions = mimetic.forward_with_attention(x)
    # ... and, through the sine/cosine positions, more to its grid neighbours than to far tokens.
    a = attentions[0][:, :, 1:, 1:].mean((0, 1))  # (N, N)
    g = config.grid_size
    ij = torch.stack(torch.meshgrid(torch.arange(g), torch.arange(g), indexing="ij"), -1).reshape(-1, 2)
    dist = (ij[:, None] - ij[None]).abs().sum(-1)
    assert float(a[dist == 1].mean()) > 2 * float(a[dist >= g].mean())


def test_mimetic_init_is_seeded_and_keeps_the_architecture() -> None:
    a = ViT(TINY).mimetic_init_(torch.Generator().manual_seed(3))
    b = ViT(TINY).mimetic_init_(torch.Generator().manual_seed(3))
    for (name, p), q in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        if "qkv" in name or "attn.proj" in name or name == "pos_embed":
            torch.testing.assert_close(p, q, msg=name)
    torch.testing.assert_close(a.pos_embed, build_pos_embed("sincos2d", TINY.grid_size, TINY.dim))
    assert a(torch.randn(2, 3, 32, 32)).isfinite().all()
    # W_v W_o starts near -0.4 I: the value path subtracts part of the residual it reads.
    attn = a.blocks[0].attn
    w = (attn.qkv.weight[2 * TINY.dim :].T @ attn.proj.weight.T).detach()
    assert float(torch.diagonal(w).mean()) < -0.2


def test_no_weight_decay_names_real_parameters() -> None:
    model = tiny_model()
    names = dict(model.named_parameters())
    assert model.no_weight_decay() <= set(names)


def test_grayscale_input() -> None:
    model = tiny_model(ViTConfig(**{**TINY.to_dict(), "in_channels": 1}))
    assert model(torch.randn(2, 1, 32, 32)).shape == (2, 10)


OPTIONS: list[dict[str, object]] = [
    {"reg_tokens": 2},
    {"class_token": False, "pool": "avg"},
    {"reg_tokens": 3, "no_embed_class": True, "pool": "avg", "fc_norm": True},
    {"layer_scale": True, "pre_norm": True, "qkv_bias": False, "norm_eps": 1e-6},
    {"reg_tokens": 1, "no_embed_class": True, "pos_embed": "sincos2d"},
    {"qk_norm": True, "activation": "quick_gelu"},
    {"norm": "res_post", "class_token": False, "pool": "avg", "fc_norm": True},
    {"dist_token": True},
    {"pool": "map", "class_token": False},
    {"pool": "map", "reg_tokens": 1},
    {"pool": "map", "pool_prefix": True, "pool_heads": 4},
    {"rope": "axial", "activation": "swiglu", "mlp_norm": True, "attn_norm": True},
    {"rope": "mixed", "rope_half": True, "pos_embed": "none", "reg_tokens": 2},
    {"rel_pos_bias": True, "pos_embed": "none", "layer_scale": True, "pool": "avg", "fc_norm": True},
]


@pytest.mark.parametrize("options", OPTIONS)
def test_options_keep_fused_and_explicit_attention_equal(options: dict[str, object]) -> None:
    model = tiny_model(ViTConfig(**{**TINY.to_dict(), **options}))
    for name, p in model.named_parameters():  # layer scale starts tiny and tokens near zero: make every path count
        if name.endswith(("gamma", "rel_pos_table")) or name in ("cls_token", "dist_token", "reg_token"):
            torch.nn.init.normal_(p, std=0.5)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        fused = model(x)
        explicit, attentions = model.forward_with_attention(x)
    torch.testing.assert_close(fused, explicit, atol=1e-5, rtol=1e-5)
    tokens = model.num_prefix_tokens + TINY.num_patches
    if model.attn_pool is not None:  # the pooling's weights over the tokens it reads come last
        read = tokens if model.config.pool_prefix else TINY.num_patches
        assert attentions.pop().shape == (2, model.config.pool_heads or TINY.heads, 1, read)
    assert all(a.shape == (2, TINY.heads, tokens, tokens) for a in attentions)


def test_old_config_records_load_with_the_original_architecture() -> None:
    old = {
        k: v
        for k, v in TINY.to_dict().items()
        if k
        in (
            "image_size",
            "patch_size",
            "in_channels",
            "num_classes",
            "dim",
            "depth",
            "heads",
            "mlp_ratio",
            "dropout",
            "pos_embed",
        )
    }
    config = ViTConfig.from_dict(old)
    assert (config.norm_eps, config.class_token, config.reg_tokens, config.pool) == (1e-5, True, 0, "cls")
    assert set(ViT(config).state_dict()) == set(tiny_model().state_dict())


def test_cls_pooling_needs_a_cls_token() -> None:
    with pytest.raises(ValueError, match="pool='cls' needs class_token=True"):
        ViTConfig(**{**TINY.to_dict(), "class_token": False})


def test_position_resampling_equals_timm() -> None:
    from timm.layers import resample_abs_pos_embed

    table = torch.randn(1, 2 + 14 * 14, 48)
    for new_grid in (4, 7, 20):
        ours = resample_pos_embed(table, new_grid, prefix=2)
        theirs = resample_abs_pos_embed(table, [new_grid, new_grid], num_prefix_tokens=2)
        torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=0)
    assert resample_pos_embed(table, 14, prefix=2) is table


VARIANTS: list[dict[str, object]] = [
    {"norm": "post"},
    {"head": "mlp"},
    {"head": "mlp", "head_hidden": 24},
    {"attention_pattern": "axial"},
    {"attention_pattern": "axial", "class_token": False, "pool": "avg", "reg_tokens": 2},
    {"attention_pattern": "axial", "norm": "post", "head": "mlp"},
]


@pytest.mark.parametrize("variant", VARIANTS)
def test_variants_keep_fused_and_explicit_attention_equal(variant: dict[str, object]) -> None:
    model = tiny_model(ViTConfig(**{**TINY.to_dict(), **variant}))
    x = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        fused = model(x)
        explicit, attentions = model.forward_with_attention(x)
    torch.testing.assert_close(fused, explicit, atol=1e-5, rtol=1e-5)
    per_block = 2 if variant.get("attention_pattern") == "axial" else 1
    assert len(attentions) == per_block * TINY.depth


def copy_into_torch_layer(block: torch.nn.Module, layer: torch.nn.TransformerEncoderLayer) -> None:
    with torch.no_grad():
        layer.self_attn.in_proj_weight.copy_(block.attn.qkv.weight)
        layer.self_attn.in_proj_bias.copy_(block.attn.qkv.bias)
        layer.self_attn.out_proj.weight.copy_(block.attn.proj.weight)
        layer.self_attn.out_proj.bias.copy_(block.attn.proj.bias)
        for ours, theirs in (
            (block.mlp.fc1, layer.linear1),
            (block.mlp.fc2, layer.linear2),
            (block.ln_1, layer.norm1),
            (block.ln_2, layer.norm2),
        ):
            theirs.weight.copy_(ours.weight)
            theirs.bias.copy_(ours.bias)


@pytest.mark.parametrize("norm", ["post", "pre"])
def test_blocks_equal_torchs_transformer_encoder_layer(norm: str) -> None:
    """Post-norm is nn.TransformerEncoderLayer(norm_first=False); pre-norm is norm_first=True."""
    config = ViTConfig(**{**TINY.to_dict(), "norm": norm})
    block = tiny_model(config).blocks[0].eval()
    for p in block.parameters():  # LayerNorms start at exactly 1 and 0: randomise them too
        torch.nn.init.normal_(p, std=0.2) if p.ndim == 1 else None
    layer = torch.nn.TransformerEncoderLayer(
        TINY.dim,
        TINY.heads,
        int(TINY.dim * TINY.mlp_ratio),
        dropout=0.0,
        activation="gelu",
        batch_first=True,
        norm_first=norm == "pre",
    ).eval()
    copy_into_torch_layer(block, layer)
    x = torch.randn(2, 17, TINY.dim)
    with torch.no_grad():
        torch.testing.assert_close(block(x)[0], layer(x), atol=1e-5, rtol=1e-5)


def test_post_norm_model_has_no_extra_final_norm() -> None:
    model = tiny_model(ViTConfig(**{**TINY.to_dict(), "norm": "post"}))
    assert isinstance(model.norm, torch.nn.Identity)  # the last block already ends in LayerNorm


def test_mlp_head_is_the_vit_papers() -> None:
    model = tiny_model(ViTConfig(**{**TINY.to_dict(), "head": "mlp"}))
    head = model.head
    assert [type(m).__name__ for m in head.children()] == ["LayerNorm", "Linear", "GELU", "Dropout", "Linear"]
    assert head.fc1.out_features == 4 * TINY.num_classes and head.fc2.out_features == TINY.num_classes
    wider = tiny_model(ViTConfig(**{**TINY.to_dict(), "head": "mlp", "head_hidden": 64}))
    assert wider.head.fc1.out_features == 64


def test_axial_attention_stays_on_its_row_and_column() -> None:
    model = tiny_model(ViTConfig(**{**TINY.to_dict(), "attention_pattern": "axial"}))
    with torch.no_grad():
        _, (row, col, *_) = model.forward_with_attention(torch.randn(1, 3, 32, 32))
    g, P = TINY.grid_size, 1
    for query in range(TINY.num_patches):
        r, c = divmod(query, g)
        row_keys = {P + i for i in range(TINY.num_patches) if i // g == r} | {0}
        col_keys = {P + i for i in range(TINY.num_patches) if i % g == c} | {0}
        assert set(row[0, :, P + query].nonzero()[:, 1].tolist()) == row_keys
        assert set(col[0, :, P + query].nonzero()[:, 1].tolist()) == col_keys
    assert bool((row[0, :, 0] > 0).all()) and bool((col[0, :, 0] > 0).all())  # CLS attends to every token


def test_axial_cls_token_reaches_every_patch_in_one_block() -> None:
    """Changing one patch changes the CLS output of the first block: the CLS token is global."""
    block = tiny_model(ViTConfig(**{**TINY.to_dict(), "attention_pattern": "axial"})).blocks[0].double()
    x = torch.randn(1, 17, TINY.dim, dtype=torch.float64)
    for patch in range(1, 17):
        y = x.clone()
        y[0, patch] += torch.randn(TINY.dim, dtype=torch.float64)  # not a constant: LayerNorm removes those
        with torch.no_grad():
            change = (block(x)[0][0, 0] - block(y)[0][0, 0]).abs().max()
        assert change > 1e-9, patch  # float64: far above rounding; an unreachable patch changes nothing


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"norm": "sandwich"}, "norm must be one of"),
        ({"head": "conv"}, "head must be one of"),
        ({"attention_pattern": "local"}, "attention_pattern must be one of"),
        ({"head_hidden": -1}, "head_hidden"),
        ({"activation": "relu"}, "activation must be one of"),
        ({"qk_norm": True, "attention_pattern": "axial"}, "qk_norm applies to full attention only"),
        ({"dist_token": True, "pool": "avg"}, "dist_token needs pool='cls'"),
        ({"dist_token": True, "fc_norm": True}, "dist_token needs"),
        ({"pool": "map", "head": "mlp"}, "pool='map' needs a linear head"),
    ],
)
def test_variant_config_errors_are_clear(changes: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ViTConfig(**{**TINY.to_dict(), **changes})


def test_quick_gelu_is_clips() -> None:
    model = tiny_model(ViTConfig(**{**TINY.to_dict(), "activation": "quick_gelu"}))
    x = torch.linspace(-4, 4, 81)
    torch.testing.assert_close(model.blocks[0].mlp.act(x), x * torch.sigmoid(1.702 * x))


def test_res_post_norm_normalises_each_branch_before_adding_it() -> None:
    config = ViTConfig(**{**TINY.to_dict(), "norm": "res_post"})
    block = tiny_model(config).blocks[0].eval()
    x = torch.randn(2, 5, TINY.dim)
    with torch.no_grad():
        y = x + block.ln_1(block.attn(x)[0])
        expected = y + block.ln_2(block.mlp(y))
        torch.testing.assert_close(block(x)[0], expected)


def test_distillation_token_logits_average_two_heads_and_maps_read_both_tokens() -> None:
    model = tiny_model(ViTConfig(**{**TINY.to_dict(), "dist_token": True}))
    assert model.num_prefix_tokens == 2 and model.readout.read_tokens == 2
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        features, _ = model.forward_features(x)
        logits, embedding, _ = model.forward_with_embedding(x)
        both = (model.head(features[:, 0]) + model.head_dist(features[:, 1])) / 2
    torch.testing.assert_close(logits, both)
    torch.testing.assert_close(model(x), both)
    torch.testing.assert_close(embedding, (features[:, 0] + features[:, 1]) / 2)
    relevance = torch.rand(2, model.num_prefix_tokens + TINY.num_patches, model.num_prefix_tokens + TINY.num_patches)
    torch.testing.assert_close(model.readout.row(relevance), relevance[:, :2, 2:].mean(dim=1))


def test_attention_pooling_reads_through_its_own_attention() -> None:
    model = tiny_model(ViTConfig(**{**TINY.to_dict(), "pool": "map", "class_token": False}))
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        logits, embedding, attentions = model.forward_with_embedding(x, return_attention=True)
        torch.testing.assert_close(logits, model(x), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(embedding, model.forward_head(model.forward_features(x)[0], pre_logits=True))
    pooling = attentions[-1]
    assert len(attentions) == TINY.depth + 1 and pooling.shape == (2, TINY.heads, 1, TINY.num_patches)
    last = attention_map(attentions, "last", model.readout)
    expected = pooling.mean(dim=1)[:, 0].reshape(2, TINY.grid_size, TINY.grid_size)
    expected = (expected - expected.amin(dim=(1, 2), keepdim=True)) / (
        expected.amax(dim=(1, 2), keepdim=True) - expected.amin(dim=(1, 2), keepdim=True)
    )
    torch.testing.assert_close(last, expected)
    assert attention_map(attentions, "rollout", model.readout).shape == (2, TINY.grid_size, TINY.grid_size)
