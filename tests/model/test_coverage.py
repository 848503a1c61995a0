"""Every architecture of timm's ViT family (vit_*, deit*, beit*, eva02*, *siglip*, *dinov2*), built with random
weights and two blocks, either converts with timm's logits or is refused with a ConversionError naming the
feature: none crashes, and none converts to other logits."""

from __future__ import annotations

import pytest

from model.convert.converted import ConversionError
from model.convert.coverage import FAMILY, Outcome, build, convert, feature, head_coverage, refused_by_structure, table
from model.convert.timm_vit import from_timm_model

pytestmark = pytest.mark.slow

# The walk converts every architecture of the family (about three minutes of a core): the shards are marked `walk`,
# which `bin/test` leaves to a step of its own (`.ci/run` runs it after the suite). It is split in shards, each a
# class: pytest-xdist (--dist loadscope) hands a class to a worker, so the shards run on every worker at once.
SHARDS = 4


def family() -> list[str]:
    import timm

    return sorted(set(timm.list_models(list(FAMILY))))


def test_the_shards_cover_the_whole_family() -> None:
    names = family()
    assert len(names) > 200  # the whole list, not a sample
    assert sorted(n for shard in range(SHARDS) for n in names[shard::SHARDS]) == names


def check_shard(shard: int) -> None:
    """Every architecture of one shard converts with timm's logits or is refused by name; at least 60 of the
    family convert, so at least 15 of each shard."""
    outcomes = [convert(name, small=True) for name in family()[shard::SHARDS]]
    bad = [f"{o.arch}: {o.result}: {o.detail}" for o in outcomes if o.result in ("crashed", "differs")]
    assert not bad, "\n".join(bad)
    for o in outcomes:
        if o.result == "refused":
            assert o.detail.startswith(("unsupported feature: ", "timm has no model")), o
    assert sum(o.result == "converted" for o in outcomes) >= 60 // SHARDS


@pytest.mark.walk
class TestShard0:
    def test_every_architecture_converts_exactly_or_is_refused_by_name(self) -> None:
        check_shard(0)


@pytest.mark.walk
class TestShard1:
    def test_every_architecture_converts_exactly_or_is_refused_by_name(self) -> None:
        check_shard(1)


@pytest.mark.walk
class TestShard2:
    def test_every_architecture_converts_exactly_or_is_refused_by_name(self) -> None:
        check_shard(2)


@pytest.mark.walk
class TestShard3:
    def test_every_architecture_converts_exactly_or_is_refused_by_name(self) -> None:
        check_shard(3)


def test_the_table_groups_refusals_by_feature() -> None:
    outcomes = [
        Outcome("a", "converted", "0.0e+00"),
        Outcome("b", "refused", "unsupported feature: block 3: the activation QuickGELU() (only exact GELU)"),
        Outcome("c", "refused", "unsupported feature: block 0: the activation QuickGELU() (only exact GELU)"),
    ]
    assert feature(outcomes[1]) == "the activation QuickGELU()"
    assert table(outcomes).splitlines()[2:] == [
        "| converted, logits equal | 1 | a |",
        "| the activation QuickGELU() | 2 | b, c |",
    ]


def test_a_headless_siglip_tower_converts_with_open_clips_text_tower() -> None:
    """SigLIP's image tower has no head: with the text tower open_clip pairs it with, it serves zero-shot, its
    image and text embeddings equal to open_clip's. DINOv3, which open_clip pairs with nothing, stays headless."""
    paired = convert("vit_base_patch16_siglip_224", small=True)
    assert (paired.result, paired.zero_shot) == ("converted", "ViT-B-16-SigLIP"), paired
    assert float(paired.detail) < 1e-4
    alone = convert("vit_small_patch16_dinov3", small=True)
    assert feature(alone) == "no classification head" and not alone.zero_shot
    assert table([paired, alone]).splitlines()[2] == (
        "| converted zero-shot, with open_clip's text tower, embeddings equal | 1 | vit_base_patch16_siglip_224 |"
    )


def test_head_coverage_leaves_out_headless_models_and_counts_stems_apart() -> None:
    outcomes = [
        Outcome("a", "converted", "0.0e+00"),
        Outcome("b", "refused", "unsupported feature: no classification head (num_classes=0); convert a model"),
        Outcome("c", "refused", "unsupported feature: a patch embedding other than one convolution (embed_layer)"),
        Outcome("d", "refused", "unsupported feature: block 0: attention of type DiffAttention"),
    ]
    assert head_coverage(outcomes) == (
        "with a classification head: 1 of 3 (33 %) convert; without the hybrid stems: 1 of 2 (50 %)"
    )


@pytest.mark.parametrize("arch", ["vit_small_patch16_18x2_224", "vit_tiny_r_s16_p8_224", "eva02_tiny_patch14_224"])
def test_a_refusal_read_from_the_structure_is_the_one_the_built_model_gets(arch: str) -> None:
    """The walk reads a refusal from the model built on no memory (no weights initialised): the same refusal,
    word for word, as converting the model built with its weights."""
    from_structure = refused_by_structure(arch, small=True)
    assert from_structure is not None
    with pytest.raises(ConversionError) as built:
        from_timm_model(build(arch, small=True))
    assert str(from_structure) == str(built.value)


def test_a_model_the_converter_takes_is_not_refused_by_its_structure() -> None:
    assert refused_by_structure("vit_tiny_patch16_224", small=True) is None
    assert convert("vit_tiny_patch16_224", small=True).result == "converted"
