"""Whether the Hugging Face hub answers now: asked once, with a short timeout, so that an offline machine fails
(or reads the local hub cache) within seconds instead of waiting on the libraries' retries."""

from __future__ import annotations

import functools

from model.convert.converted import ConversionError

PROBE_TIMEOUT_S = 3.0  # how long the hub has to answer before it counts as unreachable
OFFLINE_SET = "HF_HUB_OFFLINE is set"  # the user's own choice: the libraries read the hub cache themselves


@functools.cache  # once per process: several hub names, one wait at most
def hub_unreachable() -> str | None:
    """Why the hub cannot be asked now (HF_HUB_OFFLINE set, or no answer to one request within PROBE_TIMEOUT_S),
    or None when it answers."""
    from huggingface_hub import constants
    from huggingface_hub.utils import get_session

    if constants.HF_HUB_OFFLINE:
        return OFFLINE_SET
    try:  # huggingface_hub's own session: its HTTP library, proxies and headers, and none of its retries
        get_session().head(constants.ENDPOINT, timeout=PROBE_TIMEOUT_S)
    except Exception as e:  # timeouts, refused connections, names that do not resolve: the library's many types
        return f"{constants.ENDPOINT} did not answer within {PROBE_TIMEOUT_S:.0f} s ({type(e).__name__})"
    return None


def check_reachable(what: str) -> None:
    """Refuse a library's own download (timm's or open_clip's `--pretrained`) at once when the hub does not answer:
    their retries would take a minute to say the same. HF_HUB_OFFLINE=1 lets them read the hub cache instead."""
    offline = hub_unreachable()
    if offline is not None and offline != OFFLINE_SET:
        raise ConversionError(
            f"could not fetch {what}: {offline}; set HF_HUB_OFFLINE=1 to use the local hub cache, or download the "
            "weights elsewhere and pass --weights FILE"
        )
