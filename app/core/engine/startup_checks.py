"""What the engine checks and finds before it serves: the shadow pairs and out-of-distribution thresholds the
settings name against the models loaded, and the checkpoints to load at startup (hub names converted)."""

from __future__ import annotations

import logging
from pathlib import Path

from app.core.engine.repository import FileStamp, Repository
from app.core.engine.served_model import ServedModel
from app.core.engine.shadow import Shadow
from app.settings import HubName, Settings, parse_thresholds

log = logging.getLogger("app")


def check_shadows(shadows: dict[str, Shadow], served: dict[str, ServedModel]) -> None:
    """Every VIT_SHADOW pair names two served models with the same classes; ValueError, one line, otherwise."""
    for shadow in shadows.values():
        pair = shadow.pair
        for name in (pair.champion, pair.challenger):
            if name not in served:
                raise ValueError(f"VIT_SHADOW {pair.champion}:{pair.challenger}: no model {name!r} is served")
        if zero_shot := [n for n in (pair.champion, pair.challenger) if served[n].labels is not None]:
            raise ValueError(
                f"VIT_SHADOW {pair.champion}:{pair.challenger}: {zero_shot[0]} is zero-shot, its classes named per "
                "request, so the two models' answers cannot be compared"
            )
        if served[pair.champion].classes != served[pair.challenger].classes:
            raise ValueError(
                f"VIT_SHADOW {pair.champion}:{pair.challenger}: the models' classes differ, so their answers "
                "cannot be compared"
            )


def check_thresholds(settings: Settings, served: dict[str, ServedModel]) -> None:
    """Every model VIT_OOD_THRESHOLD names is served, and a threshold on a 0-to-1 score is under 1 (a distance's
    threshold kept for a model that now scores by its top probability would flag nothing); ValueError, one line,
    otherwise."""
    if settings.ood_threshold is None:
        return
    for name, value in parse_thresholds(settings.ood_threshold).items():
        if name != "*" and name not in served:
            raise ValueError(
                f"VIT_OOD_THRESHOLD {name}={value:g}: no model {name!r} is served; served: {', '.join(served)}"
            )
    for name, model in served.items():
        reference, limit = model.checkpoint.reference, settings.ood_threshold_for(name)
        if reference is not None and reference.score == "max_softmax" and limit is not None and limit >= 1:
            p99 = "" if reference.held_out_p99 is None else f"; its ood_p99 is {reference.held_out_p99:.3g}"
            raise ValueError(
                f"VIT_OOD_THRESHOLD {limit:g} for model {name!r}: its out-of-distribution score is max_softmax, "
                f"1 - its top probability, always under 1, so this would flag nothing; give a threshold under 1{p99}"
            )


def startup_models(settings: Settings, repository: Repository | None, files: dict[str, FileStamp]) -> dict[str, Path]:
    """The checkpoints loaded before the service is ready, by model name, the default first.

    Without a repository: VIT_MODELS (or VIT_WEIGHTS). With one: VIT_MODELS' names, then, unless the
    control mode is explicit, every other model file in it.
    """
    if repository is None:
        return {
            name: hub_checkpoint(settings, name, path) if isinstance(path, HubName) else path
            for name, path in settings.model_paths().items()
        }
    named = settings.model_names()
    if missing := [n for n in named if n not in files]:
        raise ValueError(
            f"VIT_MODELS names {', '.join(missing)}, but VIT_MODEL_REPOSITORY {repository.root} has no such "
            f"model file (NAME.safetensors); it has: {', '.join(files) or 'none'}"
        )
    names = named if settings.model_control == "explicit" else named + [n for n in files if n not in named]
    if not names and settings.model_control == "none":
        raise ValueError(f"VIT_MODEL_REPOSITORY {repository.root} holds no model file (NAME.safetensors) to serve")
    return {name: repository.path(name) for name in names}


def hub_checkpoint(settings: Settings, name: str, hub: HubName) -> Path:
    """The converted checkpoint of a model VIT_MODELS names on a hub: from VIT_HUB_CACHE, or fetched (or read
    from the hub's local cache) and converted now; ValueError, one line, when it cannot be."""
    from model.convert.converted import ConversionError  # here: only a hub name brings in the converters
    from model.convert.hub import converted_checkpoint

    try:
        path, fresh = converted_checkpoint(hub.hub, hub.id, settings.hub_cache)
    except (ConversionError, OSError) as e:
        raise ValueError(f"VIT_MODELS {name}={hub}: {e}") from None
    except Exception as e:  # a library's own failure on what it fetched: still one line, never a traceback
        raise ValueError(f"VIT_MODELS {name}={hub}: {type(e).__name__}: {e}") from None
    log.info("model %s: %s %s %s", name, hub, "converted to" if fresh else "converted before:", path)
    return path
