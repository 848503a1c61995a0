"""python -m model.convert: each library's model, built at random init by the library itself, converts
through the CLI into a checkpoint whose logits equal the library's (fp32, atol 1e-4)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import timm
import torch
import torchvision
from safetensors.torch import save_file
from timm.models.vision_transformer import ParallelScalingBlock, ParallelThingsBlock, ResPostBlock
from torchvision.models import get_model_weights

from harness.preloaded import run_command
from model.checkpoint import load_checkpoint
from model.convert.__main__ import main as convert_main
from model.convert.converted import (
    MAX_PIXEL_LEVELS,
    MAX_RELATIVE_LOGIT_DIFF,
    ConversionError,
    check_equal,
    check_preprocessing,
)
from model.convert.timm_vit import from_timm_model
from model.convert.torchvision_vit import matching_recipe, torchvision_preprocessing
from model.rollout import attention_map
from model.vit import ViTConfig
from tests.support.checkpoints import Pretrained

pytestmark = pytest.mark.slow  # converts timm, torchvision and transformers models

ATOL = 1e-4


def same_logits(checkpoint: Path, reference: Callable[[torch.Tensor], torch.Tensor], channels: int = 3) -> None:
    ckpt = load_checkpoint(checkpoint)
    size = ckpt.config.image_size
    x = torch.randn(3, channels, size, size, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        ours, theirs = ckpt.model(x), reference(x)
    assert theirs.std() > 0.5  # the comparison is not between two near-constant outputs
    torch.testing.assert_close(ours, theirs, atol=ATOL, rtol=0)


def same_embedding(checkpoint: Path, timm_model: Any) -> None:
    """Our embedding is timm's pre-logits: `forward_head(forward_features(x), pre_logits=True)`."""
    ckpt = load_checkpoint(checkpoint)
    size = ckpt.config.image_size
    x = torch.randn(3, 3, size, size, generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        _, ours, _ = ckpt.model.forward_with_embedding(x)
        theirs = timm_model.forward_head(timm_model.forward_features(x), pre_logits=True)
    assert ours.shape == (3, ckpt.config.dim) and theirs.std() > 0.1
    torch.testing.assert_close(ours, theirs, atol=ATOL, rtol=0)


def convert_timm_model(model: Any, tmp_path: Path, arch: str, suffix: str = ".safetensors") -> Path:
    weights = tmp_path / f"weights{suffix}"
    if suffix == ".safetensors":
        save_file(model.state_dict(), str(weights))
    else:
        torch.save(model.state_dict(), weights)
    out = tmp_path / "out.safetensors"
    return convert_main(["timm", "--arch", arch, "--weights", str(weights), "--output", str(out)])


@pytest.mark.parametrize("source", ["timm", "torchvision", "hf"])
def test_converted_logits_equal_the_library(pretrained: Callable[[str], Pretrained], source: str) -> None:
    ref = pretrained(source)
    same_logits(ref.checkpoint, ref.model)
    ckpt = load_checkpoint(ref.checkpoint)
    assert ckpt.training["converted_from"]["source"] in ("timm", "torchvision", "huggingface")
    assert ckpt.training["converted_from"]["max_relative_logit_diff"] <= 1e-4
    # the library's own evaluation transform ran on the same JPEG and PNG files as the checkpoint's preprocessing
    check = ckpt.training["converted_from"]["preprocessing_check"]
    assert check["checked_images"] == 5 and check["max_pixel_levels"] <= MAX_PIXEL_LEVELS


@pytest.mark.parametrize(
    ("arch", "features"),
    [
        ("deit3_small_patch16_224", {"layer_scale": True, "no_embed_class": True}),
        ("vit_little_patch16_reg1_gap_256", {"reg_tokens": 1, "pool": "avg", "fc_norm": True, "layer_scale": True}),
        ("deit_tiny_distilled_patch16_224", {"dist_token": True, "pool": "cls"}),  # two tokens, two heads averaged
    ],
)
def test_timm_architectures_with_extra_features(tmp_path: Path, arch: str, features: dict[str, Any]) -> None:
    torch.manual_seed(0)
    m = timm.create_model(arch, pretrained=False, num_classes=7).eval()
    torch.nn.init.normal_(m.head.weight, std=0.5)
    if hasattr(m, "head_dist"):
        torch.nn.init.normal_(m.head_dist.weight, std=0.5)
    for name, p in m.named_parameters():
        if name.endswith("gamma"):  # layer scale starts at 1e-6: the blocks would hardly count
            torch.nn.init.uniform_(p, 0.5, 1.5)
    out = convert_timm_model(m, tmp_path, arch, suffix=".pth")
    config = load_checkpoint(out).config
    assert {k: getattr(config, k) for k in features} == features
    assert config.num_classes == 7 and config.norm_eps == 1e-6
    same_logits(out, m)
    same_embedding(out, m)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"pre_norm": True, "qkv_bias": False},  # CLIP-style pre-norm
        {"class_token": False, "global_pool": "avg", "fc_norm": False, "reg_tokens": 2},  # no CLS: average pooling
        {"reg_tokens": 4, "no_embed_class": True, "init_values": 1e-3},
        {"qk_norm": True},  # queries and keys normalised per head
        {"global_pool": "map", "class_token": False},  # SigLIP's attention-pooling head
        {"global_pool": "map", "reg_tokens": 2},  # pooling over CLS and registers too
        {"act_layer": "quick_gelu"},  # OpenAI CLIP
        {"act_layer": "gelu_tanh", "global_pool": "map", "class_token": False},  # SigLIP as transformers has it
        {"block_fn": ResPostBlock, "class_token": False, "global_pool": "avg", "init_values": 0.5},  # x + LN(f(x))
        {"block_fn": ParallelScalingBlock, "init_values": 0.5},  # ViT-22B's parallel block, its MLP bias apart
        {"block_fn": ParallelScalingBlock, "qkv_bias": True, "qk_norm": True},  # one bias for the fused projection
    ],
)
def test_timm_options_convert_exactly(kwargs: dict[str, Any]) -> None:
    torch.manual_seed(0)
    m = timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=5, **kwargs).eval()
    torch.nn.init.normal_(m.head.weight, std=0.5)
    converted = from_timm_model(m)
    model = converted.build()
    assert check_equal(model, converted) <= 1e-5
    x = torch.randn(2, 3, 224, 224)
    with torch.inference_mode():
        torch.testing.assert_close(model(x), m(x), atol=ATOL, rtol=0)
        pre_logits = m.forward_head(m.forward_features(x), pre_logits=True)
        torch.testing.assert_close(model.forward_with_embedding(x)[1], pre_logits, atol=ATOL, rtol=0)


@pytest.mark.parametrize(
    ("arch", "kwargs"),
    [
        ("eva02_tiny_patch14_224", {}),  # EVA-02: rotary positions, packed SwiGLU, EVA's q and v biases
        ("eva02_tiny_patch14_224", {"qkv_fused": False, "swiglu_mlp": True, "scale_mlp": True}),  # EVA-02 base's
        ("eva02_tiny_patch14_224", {"scale_attn_inner": True, "global_pool": "token"}),  # EVA-02 CLIP's sub-LN
        ("vit_small_patch16_rope_mixed_ape_224", {}),  # RoPE-Mixed: a table per block and head; no_embed_class
        ("vit_small_patch16_dinov3", {}),  # DINOv3's rotate-half rotary layout, registers, layer scale
        ("vit_medium_patch16_rope_reg1_gap_256", {}),  # no CLS, no absolute positions
        ("vit_pe_core_tiny_patch16_384", {}),  # Perception Encoder: pooling over every token with its own heads
        ("beit_base_patch16_224", {"embed_dim": 192, "num_heads": 3}),  # BEiT: relative position bias per block
        ("beit_base_patch16_224", {"embed_dim": 192, "num_heads": 3, "use_shared_rel_pos_bias": True}),
        ("vit_relpos_small_patch16_224", {}),  # bias from an MLP over log-spaced offsets (Swin V2's)
        ("vit_relpos_medium_patch16_rpn_224", {}),  # res-post-norm blocks with that bias
        ("vit_relpos_base_patch16_plus_240", {"embed_dim": 192, "num_heads": 3}),  # one bias shared by the blocks
        ("beit3_base_patch16_224", {"embed_dim": 192, "num_heads": 3}),  # BEiT-3: a norm inside attention
    ],
)
def test_timm_eva_and_relative_position_models_convert_exactly(arch: str, kwargs: dict[str, Any]) -> None:
    """Logits, embeddings and attention maps of timm's Eva, Beit and VisionTransformerRelPos classes and BEiT-3's
    VisionTransformer (two blocks, jittered random weights)."""
    torch.manual_seed(0)
    m = timm.create_model(arch, pretrained=False, num_classes=5, depth=2, **kwargs).eval()
    with torch.no_grad():
        for p in m.parameters():  # zero-initialised biases and tiny layer scales would hide a mismatch
            p.add_(torch.randn_like(p) * 0.02)
    converted = from_timm_model(m)
    model = converted.build()
    assert check_equal(model, converted) <= MAX_RELATIVE_LOGIT_DIFF  # float rounding: 0 to 2e-5 measured
    size = converted.config.image_size
    x = torch.randn(2, 3, size, size)
    with torch.inference_mode():
        torch.testing.assert_close(model(x), m(x), atol=ATOL, rtol=0)
        pre_logits = m.forward_head(m.forward_features(x), pre_logits=True)
        logits, embedding, attentions = model.forward_with_embedding(x, return_attention=True)
        torch.testing.assert_close(embedding, pre_logits, atol=ATOL, rtol=0)
        torch.testing.assert_close(logits, m(x), atol=ATOL, rtol=0)  # the explicit-softmax path too
    grid = converted.config.grid_size
    for method in ("rollout", "last"):
        maps = attention_map(attentions, method, model.readout)
        assert maps.shape == (2, grid, grid) and float(maps.amax()) == 1.0


@pytest.mark.parametrize(
    ("build", "feature"),
    [
        (lambda: timm.create_model("vit_dwee_patch16_reg1_gap_256"), "attention of type DiffAttention"),
        (lambda: timm.create_model("eva02_tiny_patch14_224", num_classes=5, global_pool="avgmax"), "'avgmax'"),
        (lambda: timm.create_model("vit_small_patch16_rope_224", depth=2, use_post_norm=True), "EvaBlockPostNorm"),
        (lambda: timm.create_model("vit_tiny_patch16_224", block_fn=ParallelThingsBlock), "ParallelThingsBlock"),
        (lambda: timm.create_model("vit_tiny_patch16_224", global_pool="max"), "global_pool='max'"),
        (lambda: timm.create_model("vit_tiny_patch16_224", num_classes=0), "no classification head"),
        (lambda: timm.create_model("vit_tiny_patch16_224", act_layer="silu"), "exact GELU, tanh GELU and QuickGELU"),
    ],
)
def test_timm_features_we_lack_are_refused_by_name(build: Callable[[], Any], feature: str) -> None:
    with pytest.raises(ConversionError, match="unsupported feature: .*" + feature.replace("(", r"\(")):
        from_timm_model(build())


def test_refusal_through_the_cli_exits_2_with_one_line(tmp_path: Path) -> None:
    m = timm.create_model("vit_dwee_patch16_reg1_gap_256")  # differential attention
    torch.save(m.state_dict(), tmp_path / "dwee.pth")
    r = run_command(
        [
            sys.executable,
            "-m",
            "model.convert",
            "timm",
            "--arch",
            "vit_dwee_patch16_reg1_gap_256",
            "--weights",
            str(tmp_path / "dwee.pth"),
            "--output",
            str(tmp_path / "out.safetensors"),
        ],
        timeout=120,
    )
    assert r.returncode == 2
    assert "error: unsupported feature: block 0: attention of type DiffAttention" in r.stderr
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "out.safetensors").exists()


def test_timm_imagenet_heads_get_imagenet_names(pretrained: Callable[[str], Pretrained]) -> None:
    classes = load_checkpoint(pretrained("timm").checkpoint).classes
    assert len(classes) == 1000 and classes[0].startswith("tench") and classes[-1].startswith("toilet tissue")


def test_timm_preprocessing_is_the_data_config(pretrained: Callable[[str], Pretrained]) -> None:
    p = load_checkpoint(pretrained("timm").checkpoint).preprocessing
    assert (p.image_size, p.resize, p.crop_pct, p.interpolation, p.resize_backend) == (
        224,
        "center_crop",
        0.9,
        "bicubic",
        "pil",
    )
    assert p.resize_size == 248 and p.mean == (0.5, 0.5, 0.5)


def test_torchvision_classes_and_recipe(pretrained: Callable[[str], Pretrained]) -> None:
    ckpt = load_checkpoint(pretrained("torchvision").checkpoint)
    assert ckpt.classes == pretrained("torchvision").classes and ckpt.classes[0] == "tench"
    p = ckpt.preprocessing
    assert (p.resize_size, p.image_size, p.interpolation) == (256, 224, "bilinear")
    assert ckpt.training["converted_from"]["recipe"] == "IMAGENET1K_V1"
    assert ckpt.config.norm_eps == 1e-6


def test_torchvision_recipe_follows_the_image_size() -> None:
    """A 384 px vit_b_16 takes the SWAG recipe whose crop is 384 (bicubic, no resize margin)."""
    recipe = matching_recipe(get_model_weights("vit_b_16"), 384)
    assert recipe.name == "IMAGENET1K_SWAG_E2E_V1"
    p = torchvision_preprocessing(recipe, ViTConfig(image_size=384, patch_size=16))
    assert (p.interpolation, p.resize_size, p.image_size) == ("bicubic", 384, 384)


def test_weights_of_another_architecture_are_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    m = torchvision.models.VisionTransformer(
        image_size=32, patch_size=16, num_layers=1, num_heads=2, hidden_dim=32, mlp_dim=64, num_classes=3
    )
    torch.save(m.state_dict(), tmp_path / "w.pth")
    with pytest.raises(SystemExit):
        convert_main(
            [
                "torchvision",
                "--arch",
                "vit_b_16",
                "--weights",
                str(tmp_path / "w.pth"),
                "--output",
                str(tmp_path / "o.safetensors"),
            ]
        )
    assert "the weights do not fit torchvision's vit_b_16" in capsys.readouterr().err


def test_hf_labels_and_processor(pretrained: Callable[[str], Pretrained]) -> None:
    ckpt = load_checkpoint(pretrained("hf").checkpoint)
    assert ckpt.classes == ["cat", "dog", "fox", "owl", "yak"]
    p = ckpt.preprocessing
    assert (p.resize, p.crop_pct, p.interpolation, p.resize_backend) == ("squash", 1.0, "bicubic", "tensor")
    assert ckpt.config.norm_eps == 1e-12


def test_hf_transformers4_directory_with_pytorch_model_bin(tmp_path: Path) -> None:
    from transformers import ViTConfig as HFConfig
    from transformers import ViTForImageClassification, ViTImageProcessor

    config = HFConfig(
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=48,
        image_size=32,
        patch_size=8,
        num_labels=3,
        qkv_bias=False,
    )
    m = ViTForImageClassification(config).eval()
    torch.nn.init.normal_(m.classifier.weight, std=2.0)
    m.save_pretrained(tmp_path / "d")
    ViTImageProcessor(size={"height": 32, "width": 32}).save_pretrained(tmp_path / "d")  # bilinear, mean 0.5
    # the layout transformers 4 wrote: pytorch_model.bin, with its key names
    (tmp_path / "d" / "model.safetensors").unlink()
    torch.save({transformers4_name(k): v for k, v in m.state_dict().items()}, tmp_path / "d" / "pytorch_model.bin")
    out = convert_main(["hf", "--model-dir", str(tmp_path / "d"), "--output", str(tmp_path / "o.safetensors")])
    ckpt = load_checkpoint(out)
    assert ckpt.classes == ["LABEL_0", "LABEL_1", "LABEL_2"] and not ckpt.config.qkv_bias
    assert ckpt.preprocessing.interpolation == "bilinear" and ckpt.preprocessing.mean == (0.5, 0.5, 0.5)
    same_logits(out, lambda x: m(pixel_values=x).logits)


@pytest.mark.parametrize(
    ("family", "options"),
    [
        ("deit-teacher", {}),  # DeiTForImageClassificationWithTeacher: CLS and distillation heads averaged
        ("deit", {}),  # DeiTForImageClassification: the distillation token is in the sequence, unread
        ("beit", {"use_relative_position_bias": True, "use_mean_pooling": True}),
        ("beit", {"use_shared_relative_position_bias": True, "use_absolute_position_embeddings": True}),
    ],
)
def test_hf_deit_and_beit_convert_exactly(tmp_path: Path, family: str, options: dict[str, Any]) -> None:
    """Each class saved by save_pretrained with random weights (jittered: zero biases and small layer scales
    would hide a mismatch), converted through the CLI: logits equal transformers', and maps from every block."""
    import transformers

    sizes = dict(hidden_size=48, num_hidden_layers=2, num_attention_heads=3, intermediate_size=96)
    sizes |= dict(image_size=32, patch_size=8, num_labels=4)
    if family == "beit":
        m = transformers.BeitForImageClassification(transformers.BeitConfig(**sizes, **options))
    else:
        config = transformers.DeiTConfig(**sizes)
        kind = "DeiTForImageClassificationWithTeacher" if family == "deit-teacher" else "DeiTForImageClassification"
        m = getattr(transformers, kind)(config)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.1)
        for name in ("classifier", "cls_classifier", "distillation_classifier"):  # logits far from constant
            if hasattr(m, name):
                torch.nn.init.normal_(getattr(m, name).weight, std=2.0)
    m.eval().save_pretrained(tmp_path / "d")
    processor = transformers.BeitImageProcessor if family == "beit" else transformers.DeiTImageProcessor
    resized = dict(size={"height": 36, "width": 36}, crop_size={"height": 32, "width": 32}, do_center_crop=True)
    processor(**resized).save_pretrained(tmp_path / "d")
    out = convert_main(["hf", "--model-dir", str(tmp_path / "d"), "--output", str(tmp_path / "o.safetensors")])
    same_logits(out, lambda x: m(pixel_values=x).logits)
    model = load_checkpoint(out).model
    assert model.config.dist_token == (family == "deit-teacher")
    assert model.config.reg_tokens == (family == "deit") and model.config.rel_pos_bias == (family == "beit")
    with torch.inference_mode():
        _, attentions = model.forward_with_attention(torch.randn(2, 3, 32, 32))
    for method in ("rollout", "last"):
        assert attention_map(attentions, method, model.readout).shape == (2, 4, 4)


def transformers4_name(key: str) -> str:
    """transformers 5's ViT key -> the name transformers 4 saved it under."""
    v4 = {"q_proj": "attention.query", "k_proj": "attention.key", "v_proj": "attention.value", "o_proj": "output.dense"}
    key = key.replace("vit.layers.", "vit.encoder.layer.")
    for new, old in v4.items():
        key = key.replace(f"attention.{new}.", f"attention.{old}.")
    return key.replace(".mlp.fc1.", ".intermediate.dense.").replace(".mlp.fc2.", ".output.dense.")


def test_classes_file_overrides_labels(tmp_path: Path, pretrained: Callable[[str], Pretrained]) -> None:
    hf_dir = pretrained("hf").checkpoint.parent / "hf-vit"
    (tmp_path / "labels.txt").write_text("a\nb\nc\nd\ne\n\n")
    out = convert_main(
        [
            "hf",
            "--model-dir",
            str(hf_dir),
            "--classes",
            str(tmp_path / "labels.txt"),
            "--output",
            str(tmp_path / "o.safetensors"),
        ]
    )
    assert load_checkpoint(out).classes == ["a", "b", "c", "d", "e"]
    (tmp_path / "short.txt").write_text("a\nb\n")
    with pytest.raises(SystemExit) as e:
        convert_main(
            [
                "hf",
                "--model-dir",
                str(hf_dir),
                "--classes",
                str(tmp_path / "short.txt"),
                "--output",
                str(tmp_path / "o2.safetensors"),
            ]
        )
    assert e.value.code == 2


def test_pickled_objects_are_never_unpickled(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "evil.pth"
    torch.save({"head.weight": torch.zeros(2, 2), "payload": argparse.Namespace(run="rm -rf /")}, path)
    with pytest.raises(SystemExit):
        convert_main(
            ["timm", "--arch", "vit_tiny_patch16_224", "--weights", str(path), "--output", str(tmp_path / "o")]
        )
    assert "not a plain state dict; torch.load(weights_only=True) refused it" in capsys.readouterr().err


def test_wrapped_training_checkpoints_are_unwrapped(tmp_path: Path) -> None:
    m = timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=4).eval()
    torch.nn.init.normal_(m.head.weight, std=0.5)
    wrapped = {"state_dict": {f"module.{k}": v for k, v in m.state_dict().items()}, "epoch": 7}
    torch.save(wrapped, tmp_path / "ckpt.pth")
    out = convert_main(
        [
            "timm",
            "--arch",
            "vit_tiny_patch16_224",
            "--weights",
            str(tmp_path / "ckpt.pth"),
            "--output",
            str(tmp_path / "o.safetensors"),
        ]
    )
    same_logits(out, m)


def test_the_check_catches_a_wrong_mapping() -> None:
    m = timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=5).eval()
    torch.nn.init.normal_(m.head.weight, std=0.5)
    converted = from_timm_model(m)
    qkv = converted.state_dict["blocks.0.attn.qkv.weight"]
    dim = qkv.shape[1]
    converted.state_dict["blocks.0.attn.qkv.weight"] = torch.cat([qkv[dim : 2 * dim], qkv[:dim], qkv[2 * dim :]])
    with pytest.raises(ConversionError, match="logits differ from the source model's"):
        check_equal(converted.build(), converted)


@pytest.mark.parametrize(
    "wrong",
    [
        {"resize": "squash"},  # a non-square file squashed where the source crops
        {"mean": (0.485, 0.456, 0.406), "std": (0.229, 0.224, 0.225)},  # ImageNet's, where the source has 0.5
        {"interpolation": "bilinear"},  # the source resizes bicubic
        {"resize_backend": "tensor"},  # the source resizes the PIL image
    ],
)
def test_a_preprocessing_unlike_the_sources_is_caught_on_image_files(wrong: dict[str, Any]) -> None:
    """The check starts from files, not tensors: whatever the logits say, a preprocessing that is not the source's
    library's is refused."""
    import dataclasses

    m = timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=5).eval()
    converted = from_timm_model(m)
    assert check_preprocessing(converted.build(), converted)["max_pixel_levels"] <= MAX_PIXEL_LEVELS
    converted.preprocessing = dataclasses.replace(converted.preprocessing, **wrong)
    with pytest.raises(ConversionError, match="differs from the source's processor"):
        check_preprocessing(converted.build(), converted)


def test_a_directory_without_its_image_processor_is_refused_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Never served on guessed settings: the files looked for, and how to supply them."""
    from transformers import ViTConfig as HFConfig
    from transformers import ViTForImageClassification

    config = HFConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=48, image_size=32)
    ViTForImageClassification(config).save_pretrained(tmp_path / "d")
    out = tmp_path / "o.safetensors"
    with pytest.raises(SystemExit) as exited:
        convert_main(["hf", "--model-dir", str(tmp_path / "d"), "--output", str(out)])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert exited.value.code == 2 and not out.exists()
    assert err == (
        f"error: {tmp_path / 'd'}: no image processor settings (looked for preprocessor_config.json and "
        "processor_config.json); save the model's processor beside it, e.g. "
        "AutoProcessor.from_pretrained(SOURCE).save_pretrained(DIR), and convert again"
    )


@pytest.mark.parametrize(
    ("argv", "what"),
    [
        (
            ["timm", "--arch", "vit_tiny_patch16_224.augreg_in21k_ft_in1k", "--pretrained"],
            "timm's pretrained vit_tiny_patch16_224.augreg_in21k_ft_in1k",
        ),
        (["open_clip", "--arch", "ViT-B-32", "--pretrained", "openai"], "open_clip's ViT-B-32 (openai)"),
    ],
)
def test_pretrained_on_a_hub_that_does_not_answer_is_refused_at_once(
    tmp_path: Path, argv: list[str], what: str
) -> None:
    """Not a minute of the libraries' retries: one probe, then one line saying what to do."""
    import os
    import time

    from tests.support.network import silent_endpoint

    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"} | {"HF_HUB_CACHE": str(tmp_path / "hub")}
    with silent_endpoint() as endpoint:
        started = time.monotonic()
        r = run_command(
            [sys.executable, "-m", "model.convert", *argv, "--output", str(tmp_path / "o.safetensors")],
            env=env | {"HF_ENDPOINT": endpoint},
            timeout=120,
        )
        took = time.monotonic() - started
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines() == [
        f"error: could not fetch {what}: {endpoint} did not answer within 3 s (ReadTimeout); set HF_HUB_OFFLINE=1 to "
        "use the local hub cache, or download the weights elsewhere and pass --weights FILE"
    ]
    assert took < 45, took  # the probe and the imports, not the retries


def test_module_entry_point_help(capsys: pytest.CaptureFixture[str]) -> None:
    r = run_command([sys.executable, "-m", "model.convert", "--help"], check=True)
    assert "{timm,torchvision,hf,open_clip}" in r.stdout
    with pytest.raises(SystemExit) as exited:  # a source's own help, from the same entry point in-process
        convert_main(["timm", "--help"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    assert "--weights" in out and "--pretrained" in out and "--classes" in out


def test_half_precision_weights_convert_to_float32(tmp_path: Path) -> None:
    m = timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=4).eval()
    torch.nn.init.normal_(m.head.weight, std=0.5)
    save_file({k: v.half() for k, v in m.state_dict().items()}, str(tmp_path / "half.safetensors"))
    out = convert_main(
        [
            "timm",
            "--arch",
            "vit_tiny_patch16_224",
            "--weights",
            str(tmp_path / "half.safetensors"),
            "--output",
            str(tmp_path / "o.safetensors"),
        ]
    )
    ckpt = load_checkpoint(out)
    assert all(t.dtype == torch.float32 for t in ckpt.model.state_dict().values())
    m.load_state_dict({k: v.half().float() for k, v in m.state_dict().items()})  # the same rounded weights
    same_logits(out, m)
