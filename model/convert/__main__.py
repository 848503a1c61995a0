"""python -m model.convert {timm,torchvision,hf,open_clip} ... --output OUT.safetensors"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from model.checkpoint import Checkpoint, load_checkpoint, save_checkpoint
from model.convert import __doc__ as PACKAGE_DOC
from model.convert.converted import (
    ConversionError,
    Converted,
    check_equal,
    check_preprocessing,
    describe,
    read_classes,
    read_labels,
)
from model.vit import param_count_str


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m model.convert",
        description=(PACKAGE_DOC or "").split("\n\n")[0],
        epilog="The output serves with VIT_WEIGHTS=OUT.safetensors bin/serve and fine-tunes with model.train --init-from.",
    )
    sources = p.add_subparsers(dest="source", required=True, metavar="{timm,torchvision,hf,open_clip}")

    def common(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--output", type=Path, required=True, help="checkpoint to write (.safetensors)")
        sp.add_argument("--classes", type=Path, help="labels, one per line (default: from the source)")
        sp.add_argument(
            "--labels",
            type=Path,
            help="CLIP and SigLIP: class names, one per line, answered when a request names none (default: none, "
            "and every request names its own)",
        )
        sp.add_argument(
            "--no-check", action="store_true", help="skip comparing logits with the source model (very large models)"
        )

    def weights(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--arch", required=True, help="the library's model name")
        w = sp.add_mutually_exclusive_group(required=True)
        w.add_argument("--weights", type=Path, help="state dict file: .safetensors, or .pth/.bin (tensors only)")
        w.add_argument("--pretrained", action="store_true", help="download the library's pretrained weights")

    t = sources.add_parser("timm", help="a timm VisionTransformer (vit_*, deit_*, deit3_*, ...)")
    weights(t)
    common(t)
    tv = sources.add_parser("torchvision", help="torchvision's vit_b_16, vit_b_32, vit_l_16, vit_l_32, vit_h_14")
    weights(tv)
    tv.add_argument(
        "--recipe",
        help="weights enum member whose transforms and categories apply, e.g. IMAGENET1K_SWAG_E2E_V1 "
        "(default: the one whose crop matches the weights' image size)",
    )
    common(tv)
    hf = sources.add_parser(
        "hf",
        help="a Hugging Face directory (save_pretrained): a ViT, DeiT (with or without its teacher) or BEiT "
        "...ForImageClassification, or a CLIP or SigLIP model (both towers: classes named at request time)",
    )
    hf.add_argument("--model-dir", type=Path, required=True, help="directory with config.json and the weights")
    common(hf)
    oc = sources.add_parser(
        "open_clip", help="an open_clip CLIP or SigLIP model (ViT-B-32, ViT-B-16-SigLIP, ...): both towers"
    )
    oc.add_argument("--arch", required=True, help="open_clip's model name (open_clip.list_models())")
    w = oc.add_mutually_exclusive_group(required=True)
    w.add_argument("--weights", type=Path, help="state dict file: .safetensors, or .pth/.bin (tensors only)")
    w.add_argument(
        "--pretrained", metavar="TAG", help="download open_clip's pretrained weights of that tag (openai, ...)"
    )
    common(oc)
    return p.parse_args(argv)


def load_source(args: argparse.Namespace) -> Converted:
    if args.source == "timm":
        from model.convert.timm_vit import convert_timm

        return convert_timm(args.arch, args.weights, args.pretrained)
    if args.source == "torchvision":
        from model.convert.torchvision_vit import convert_torchvision

        return convert_torchvision(args.arch, args.weights, args.pretrained, args.recipe)
    if args.source == "open_clip":
        from model.convert.open_clip import convert_open_clip

        return convert_open_clip(args.arch, args.weights, args.pretrained)
    from model.convert.hf_clip import convert_hf_clip, is_zero_shot
    from model.convert.hf_vit import convert_hf

    return convert_hf_clip(args.model_dir) if is_zero_shot(args.model_dir) else convert_hf(args.model_dir)


def convert(args: argparse.Namespace) -> Path:
    """Convert, check against the source, write, and re-load the written file."""
    converted = load_source(args)
    config = converted.config
    if converted.zero_shot is None:
        if args.labels is not None:
            raise ConversionError(
                "--labels names the classes of a CLIP or SigLIP model; use --classes for a classifier"
            )
        if args.classes is not None:
            converted.classes = read_classes(args.classes, config.num_classes)
    elif args.classes is not None:
        raise ConversionError("a CLIP or SigLIP model has no fixed head to name: give its default labels with --labels")
    elif args.labels is not None:
        converted.classes = read_labels(args.labels)
    model = converted.build()
    source = dict(converted.source)
    if not args.no_check:
        source["max_relative_logit_diff"] = check_equal(model, converted)
        source["preprocessing_check"] = check_preprocessing(model, converted)
    save_checkpoint(
        args.output,
        model,
        converted.classes,
        converted.preprocessing,
        {"converted_from": source},
        zero_shot=converted.build_zero_shot(),
    )
    written = load_checkpoint(args.output)  # the file is a valid checkpoint of this project
    p = converted.preprocessing
    print(
        f"{source['source']} {source.get('arch', source.get('model_dir', ''))}: ViT {param_count_str(model.num_parameters())} "
        f"params, {config.image_size} px, patch {config.patch_size}, {outputs(written)}, pool {config.pool}"
    )
    print(f"preprocessing: {describe(p)}")
    if "max_relative_logit_diff" in source:
        print(f"logits match the source model: max relative difference {source['max_relative_logit_diff']:.1e}")
    if source.get("preprocessing_check"):
        c = source["preprocessing_check"]
        print(
            f"preprocessing matches the source's processor on {c['checked_images']} image files (JPEG and PNG, square "
            f"and not): pixels at most {c['max_pixel_levels']:.2f} levels of 255 apart, outputs from the files "
            f"within {c['max_relative_output_diff']:.1e} (relative)"
        )
    print(f"wrote {args.output} ({written.identity})")
    return Path(args.output)


def outputs(checkpoint: Checkpoint) -> str:
    if checkpoint.zero_shot is None:
        return f"{checkpoint.config.num_classes} classes"
    z = checkpoint.zero_shot
    labels = f"{len(checkpoint.classes)} default labels" if checkpoint.classes else "no default labels"
    return (
        f"zero-shot ({z.config.rule} over labels named per request, {labels}; text tower "
        f"{param_count_str(sum(p.numel() for p in z.text.parameters()))} params, embeddings of {z.embed_dim})"
    )


def main(argv: list[str] | None = None) -> Path:
    args = parse_args(argv)
    try:
        return convert(args)
    except ConversionError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
