"""Models named on a hub, converted once: `timm:<model name>` and `hf:<repo id>`.

The weights come through the libraries' own hub code (huggingface_hub, which timm's pretrained weights also
use): downloaded when online, read from the local hub cache when offline (`HF_HUB_OFFLINE=1`, or a hub that does
not answer one request within seconds: nothing waits on the libraries' retries). They are
converted with the parity check, and the checkpoint is kept in a cache folder under the hub revision it came
from, so that a restart, or another process, converts nothing.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import re
import tempfile
from pathlib import Path

from model.checkpoint import save_checkpoint
from model.convert.converted import ConversionError, Converted, check_equal, check_preprocessing
from model.convert.reachable import hub_unreachable

log = logging.getLogger("app")
HF_FILES = [
    "config.json",
    "preprocessor_config.json",
    "processor_config.json",  # transformers 5 keeps the image processor's settings here
    "model.safetensors",
    "pytorch_model.bin",
    # a CLIP or SigLIP model's tokenizer, which its checkpoint carries
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "spiece.model",
]


def not_fetched(ident: str, e: Exception, offline: str | None) -> ConversionError:
    """The one line for a hub download that failed: offline and not in the cache, or the hub's own error."""
    if offline is not None:
        return ConversionError(f"could not fetch {ident}: {offline}, and the local hub cache holds no copy of it")
    return ConversionError(f"could not fetch {ident} ({type(e).__name__}: {first_line(e)})")


def fetch_timm(name: str) -> Path:
    """The weights file of timm's pretrained `name` (an architecture, with its tag: `vit_base_patch16_224.augreg2_in21k_ft_in1k`)."""
    import timm
    from huggingface_hub import hf_hub_download

    if name.split(".")[0] not in timm.list_models():
        raise ConversionError(f"timm has no model {name!r}; see timm.list_models('vit_*')")
    cfg = timm.models.get_pretrained_cfg(name)
    if cfg is None or not cfg.hf_hub_id:
        raise ConversionError(
            f"timm's {name!r} has no weights on the Hugging Face hub; download them and convert the file with "
            "python -m model.convert timm --weights"
        )
    offline = hub_unreachable()
    try:
        filename = cfg.hf_hub_filename or "model.safetensors"
        return Path(hf_hub_download(cfg.hf_hub_id, filename, local_files_only=offline is not None))
    except Exception as e:  # offline without the file, network, authentication: many types
        raise not_fetched(cfg.hf_hub_id, e, offline) from e


def fetch_hf(repo: str) -> Path:
    """The folder of Hugging Face repo `repo` (config, processor and weights), from the hub or its cache."""
    from huggingface_hub import snapshot_download

    offline = hub_unreachable()
    try:
        return Path(snapshot_download(repo, allow_patterns=HF_FILES, local_files_only=offline is not None))
    except Exception as e:
        raise not_fetched(repo, e, offline) from e


def mtime(path: Path) -> float:
    return path.stat().st_mtime


def first_line(e: Exception) -> str:
    return (str(e).strip().splitlines() or [""])[0][:300]


def revision(fetched: Path) -> str:
    """The hub revision a fetched file or folder belongs to: the snapshot (commit) folder of the hub cache."""
    folder = fetched if fetched.is_dir() else fetched.parent
    return folder.name


def preprocessing_checked(path: Path) -> bool:
    """Whether a kept conversion was checked against its source's own preprocessing on image files. One made before
    that check may carry settings guessed where the source's processor was not read, and is converted again."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            training = json.loads((f.metadata() or {}).get("training", "{}"))
    except Exception:  # unreadable: convert it again
        return False
    return bool(training.get("converted_from", {}).get("preprocessing_check"))


def converted_checkpoint(hub: str, ident: str, cache: Path | None) -> tuple[Path, bool]:
    """The checkpoint of hub model `hub:ident`, and whether it was converted now (False: found in `cache`)."""
    slug = re.sub(r"[^A-Za-z0-9._-]+", "--", ident)
    try:
        fetched = fetch_timm(ident) if hub == "timm" else fetch_hf(ident)
    except ConversionError:
        # unreachable now (offline, no hub cache): a conversion kept from an earlier start still serves
        kept = [] if cache is None else sorted((cache / hub).glob(f"{glob.escape(slug)}@*.safetensors"), key=mtime)
        if not kept:
            raise
        log.warning("%s:%s cannot be fetched now; serving the conversion kept in %s", hub, ident, kept[-1])
        if not preprocessing_checked(kept[-1]):
            log.warning(
                "%s was converted before preprocessing was checked against the source: convert it online", kept[-1]
            )
        return kept[-1], False
    target = None if cache is None else cache / hub / f"{slug}@{revision(fetched)[:16]}.safetensors"
    if target is not None and target.is_file() and preprocessing_checked(target):
        return target, False
    converted = convert(hub, ident, fetched)
    model = converted.build()
    source = dict(converted.source) | {"hub": f"{hub}:{ident}", "revision": revision(fetched)}
    source["max_relative_logit_diff"] = check_equal(model, converted)
    source["preprocessing_check"] = check_preprocessing(model, converted)
    if target is None:
        target = Path(tempfile.mkdtemp(prefix="vit-serve-hub-")) / f"{slug}.safetensors"
    target.parent.mkdir(parents=True, exist_ok=True)
    staged = target.with_name(f".{target.name}.{os.getpid()}")
    training = {"converted_from": source}
    save_checkpoint(
        staged, model, converted.classes, converted.preprocessing, training, zero_shot=converted.build_zero_shot()
    )
    staged.replace(target)  # whole or not at all, for a process that starts beside this one
    return target, True


def convert(hub: str, ident: str, fetched: Path) -> Converted:
    if hub == "timm":
        from model.convert.timm_vit import convert_timm

        converted = convert_timm(ident, fetched, pretrained=False)
        converted.source["weights"] = f"timm:{ident}"
        return converted
    from model.convert.hf_clip import convert_hf_clip, is_zero_shot
    from model.convert.hf_vit import convert_hf

    return convert_hf_clip(fetched) if is_zero_shot(fetched) else convert_hf(fetched)
