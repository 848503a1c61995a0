"""Every architecture of timm's ViT family (vit_*, deit*, beit*, eva02*, *siglip*, *dinov2*), built with random
weights and two blocks, either converts with timm's logits or is refused with a ConversionError naming the
feature: none crashes, and none converts to other logits."""

from __future__ import annotations

import pytest

from model.convert.coverage import FAMILY, Outcome, convert, feature, head_coverage, table

pytestmark = pytest.mark.slow  # builds every architecture of the family (about two minutes on two cores)


def test_every_architecture_converts_exactly_or_is_refused_by_name() -> None:
    import timm

    names = sorted(set(timm.list_models(list(FAMILY))))
    assert len(names) > 200  # the whole list, not a sample
    outcomes = [convert(name, small=True) for name in names]
    bad = [f"{o.arch}: {o.result}: {o.detail}" for o in outcomes if o.result in ("crashed", "differs")]
    assert not bad, "\n".join(bad)
    for o in outcomes:
        if o.result == "refused":
            assert o.detail.startswith(("unsupported feature: ", "timm has no model")), o
    assert sum(o.result == "converted" for o in outcomes) >= 60


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
