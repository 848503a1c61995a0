"""Which of timm's ViT-family architectures convert: `python -m model.convert.coverage`.

Every architecture timm lists under `vit_*`, `deit*`, `beit*`, `eva02*`, `*siglip*` and `*dinov2*`, with at most
`--max-params` million parameters and an input of at most `--max-size` pixels, is built with random weights
(jittered, so that no branch is left at its zero or near-zero initial value) and handed to the converter. It
either converts with logits equal to timm's, or is refused with a `ConversionError` that names the feature.
Anything else is a bug: `differs` (converted, but the logits are not timm's) or `crashed` (another exception).
A headless image tower that open_clip pairs with a text tower (SigLIP's, say) converts with that text tower, as
a zero-shot model served with labels named per request: open_clip's model of the pair, built with random
weights, converts with its image embeddings and text embeddings equal to open_clip's. Its own tokenizer would
be fetched from the hub; offline, the walk carries OpenAI's BPE in its place, which the parity check (random
token ids) does not read. Image towers of more than 120 M parameters are not paired (open_clip builds them whole).

    python -m model.convert.coverage                      # the table, as docs/pretrained.md holds it
    python -m model.convert.coverage --small --json out.json   # two blocks each: the quick walk the tests do
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from model.convert.converted import ConversionError, check_equal
from model.convert.timm_vit import from_timm_model

FAMILY = ("vit_*", "deit*", "beit*", "eva02*", "*siglip*", "*dinov2*")
# A paired open_clip model is built whole, even in the quick walk (open_clip takes no depth for a timm tower):
# image towers larger than this stay reported as headless rather than cost gigabytes
PAIRED_MAX_PARAMS = 120e6
Result = Literal["converted", "refused", "differs", "crashed"]


@dataclass(frozen=True)
class Outcome:
    arch: str
    result: Result
    detail: str  # converted: the relative logit difference; otherwise the error's message
    zero_shot: str = ""  # converted as a zero-shot model with the text tower of this open_clip model


def family(max_params_m: float, max_size: int) -> list[str]:
    """The architectures of the family within the limits, by name (parameters counted without allocating them)."""
    import timm

    names = []
    for name in sorted(set(timm.list_models(list(FAMILY)))):
        cfg = timm.models.get_pretrained_cfg(name)
        size = max(cfg.input_size[1:]) if cfg is not None else 224
        if size > max_size:
            continue
        if parameters(name) <= max_params_m * 1e6:
            names.append(name)
    return names


def parameters(name: str) -> int:
    import timm

    try:
        with torch.device("meta"):
            model = timm.create_model(name, pretrained=False)
    except Exception:  # a model whose construction computes on its tensors: count it for real
        model = timm.create_model(name, pretrained=False)
    return sum(p.numel() for p in model.parameters())


def created(name: str, small: bool, **kwargs: Any) -> Any:
    """timm's model as its constructor initialises it (on the current device); with `small`, two blocks where the
    architecture takes `depth`."""
    import timm

    try:
        return timm.create_model(name, pretrained=False, **({"depth": 2} if small else {}), **kwargs)
    except TypeError:  # no `depth` argument: built whole
        return timm.create_model(name, pretrained=False, **kwargs)


def build(name: str, small: bool, **kwargs: Any) -> Any:
    """timm's model with seeded random weights (and `kwargs`, such as num_classes); with `small`, two blocks where
    the architecture takes `depth`."""
    import timm

    torch.manual_seed(0)
    try:
        model = created(name, small, **kwargs)
    except Exception:
        if not small:
            raise
        # settings given per block (Sapiens2's heads) do not shorten: the whole model, on no memory, which
        # the converter refuses from its structure alone or fails to check (and the walk reports it)
        with torch.device("meta"):
            return timm.create_model(name, pretrained=False, **kwargs).eval()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():  # zero-initialised heads and tiny layer scales would hide a mismatch
            p.add_(torch.randn(p.shape, generator=generator, dtype=p.dtype) * 0.02)
    return model.eval()


def checked_batch(small: bool) -> int:
    """Images (and token rows) the logits are compared on: one in the quick walk, whose forwards at each model's
    own input size (up to 518 pixels) are most of its time; a mapping that differs shows on any one input, and
    the converter's handling of a batch is checked by its own tests."""
    return 1 if small else 2


def refused_by_structure(name: str, small: bool) -> ConversionError | None:
    """The converter's refusal of `name` read from the model's structure alone, built on no memory (a refusal
    never reads a weight's value); None where the structure converts, or where the model cannot be built that
    way. A refused model then costs no random initialisation of its weights (up to a few hundred million)."""
    try:
        with torch.device("meta"):
            model = created(name, small)
        from_timm_model(model.eval())
    except ConversionError as e:
        return e
    except Exception:  # a model that needs its values to be built or read: `build` makes it whole
        return None
    return None


def convert(name: str, small: bool = False) -> Outcome:
    """One architecture's outcome."""
    try:
        if (refusal := refused_by_structure(name, small)) is not None:
            raise refusal
        model = build(name, small)
        converted = from_timm_model(model)
        diff = check_equal(converted.build(), converted, batch=checked_batch(small))
    except ConversionError as e:
        result: Result = "differs" if "logits differ" in str(e) else "refused"
        outcome = Outcome(name, result, str(e))
        pairs = text_towers().get(name.split(".")[0]) if feature(outcome) == HEADLESS else None
        if pairs and parameters(name) <= PAIRED_MAX_PARAMS:
            return convert_zero_shot(name, pairs[0], small)
        return outcome
    except Exception as e:  # what the test forbids: any other failure is a bug to fix
        return Outcome(name, "crashed", f"{type(e).__name__}: {e}")
    return Outcome(name, "converted", f"{diff:.1e}")


def text_towers() -> dict[str, list[str]]:
    """open_clip's models by the timm image tower they are built on: the text towers a headless tower pairs with."""
    try:
        import open_clip
    except ImportError:  # the convert extra is not installed: no pairs
        return {}
    pairs: dict[str, list[str]] = {}
    for arch in sorted(open_clip.list_models()):
        tower = (open_clip.get_model_config(arch) or {}).get("vision_cfg", {}).get("timm_model_name")
        if tower:
            pairs.setdefault(tower, []).append(arch)
    return pairs


def convert_zero_shot(name: str, arch: str, small: bool) -> Outcome:
    """`name`'s image tower converted with open_clip `arch`'s text tower (two text blocks with `small`)."""
    import open_clip
    from open_clip.tokenizer import SimpleTokenizer

    from model.convert.open_clip import from_open_clip_model

    try:
        cfg = json.loads(json.dumps(open_clip.get_model_config(arch)))
        built = arch
        if small:  # the text tower shortened, registered under a name of its own
            cfg["text_cfg"]["layers"] = 2
            built = f"{arch}-two-text-blocks"
            with tempfile.TemporaryDirectory() as folder:
                (Path(folder) / f"{built}.json").write_text(json.dumps(cfg))
                open_clip.add_model_config(Path(folder))
        torch.manual_seed(0)
        model = open_clip.create_model(built, pretrained=None)
        generator = torch.Generator().manual_seed(1)
        with torch.no_grad():  # away from the zero and near-zero initial values that would hide a wrong mapping
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=generator, dtype=p.dtype) * 0.02)
        model.eval()
        tokenizer = SimpleTokenizer(context_length=cfg["text_cfg"].get("context_length", 77))
        converted = from_open_clip_model(model, tokenizer)
        diff = check_equal(converted.build(), converted, batch=checked_batch(small))
    except ConversionError as e:
        failed: Result = "differs" if "logits differ" in str(e) else "refused"
        return Outcome(name, failed, f"with open_clip's {arch}: {e}", arch)
    except Exception as e:
        return Outcome(name, "crashed", f"with open_clip's {arch}: {type(e).__name__}: {e}", arch)
    return Outcome(name, "converted", f"{diff:.1e}", arch)


def feature(outcome: Outcome) -> str:
    """A refusal's feature, as the converter names it, without the per-model details."""
    text = outcome.detail.removeprefix("unsupported feature: ").split(";")[0]
    text = re.sub(r"^block \d+: ", "", text)
    return re.sub(r" \(.*", "", text) if outcome.result == "refused" else outcome.result


def table(outcomes: Iterable[Outcome]) -> str:
    """Markdown: the outcomes counted by result and feature, most first, with the architectures of each."""
    groups: dict[str, list[str]] = {}
    for o in outcomes:
        key = "converted, logits equal" if o.result == "converted" else feature(o)
        if o.result == "converted" and o.zero_shot:
            key = "converted zero-shot, with open_clip's text tower, embeddings equal"
        groups.setdefault(key, []).append(o.arch)
    lines = ["| result | architectures | which |", "|---|---:|---|"]
    for key, archs in sorted(groups.items(), key=lambda kv: (not kv[0].startswith("converted"), -len(kv[1]))):
        shown = ", ".join(archs) if len(archs) <= 6 else ", ".join(archs[:6]) + f", and {len(archs) - 6} more"
        lines.append(f"| {key} | {len(archs)} | {shown} |")
    return "\n".join(lines)


HEADLESS = "no classification head"
STEM = "a patch embedding other than one convolution"  # hybrid CNN stems, which may stay refused


def head_coverage(outcomes: list[Outcome]) -> str:
    """The share of the architectures with a classification head that convert, with and without hybrid stems."""
    headed = [o for o in outcomes if feature(o) != HEADLESS]
    plain = [o for o in headed if feature(o) != STEM]

    def share(group: list[Outcome]) -> str:
        done = sum(o.result == "converted" for o in group)
        return f"{done} of {len(group)} ({100 * done / max(len(group), 1):.0f} %)"

    return f"with a classification head: {share(headed)} convert; without the hybrid stems: {share(plain)}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m model.convert.coverage", description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--max-params", type=float, default=120.0, help="most parameters, in millions (default 120)")
    p.add_argument("--max-size", type=int, default=448, help="largest input side in pixels (default 448)")
    p.add_argument("--small", action="store_true", help="two blocks each (quick; the tests' walk)")
    p.add_argument("--only", nargs="+", metavar="ARCH", help="these architectures instead of the family")
    p.add_argument("--json", type=Path, help="write every outcome here")
    args = p.parse_args(argv)
    names = args.only or family(args.max_params, args.max_size)
    outcomes = []
    for name in names:
        outcome = convert(name, args.small)
        outcomes.append(outcome)
        print(f"{outcome.result:<10} {name}: {outcome.detail[:160]}", file=sys.stderr, flush=True)
    counts = Counter(o.result for o in outcomes)
    print(table(outcomes))
    print(f"\n{len(outcomes)} architectures: " + ", ".join(f"{n} {r}" for r, n in counts.most_common()))
    print(head_coverage(outcomes))
    if args.json:
        args.json.write_text(json.dumps([asdict(o) for o in outcomes], indent=1) + "\n")
    return 1 if counts["crashed"] or counts["differs"] else 0


if __name__ == "__main__":
    sys.exit(main())
