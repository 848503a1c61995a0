"""The failures a client can act on, one exception type each, raised by the core with no notion of a protocol.

Each edge maps them to its protocol's answer in one table: HTTP statuses for `/predict` and V2 REST
(`app/web/errors.py`), status codes for other protocols.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any


class ServiceError(Exception):
    """Base of the errors the service answers with; `detail` says what to fix."""

    def __init__(self, detail: str, retry_after_s: int | None = None) -> None:
        super().__init__(detail)
        self.detail = detail
        self.retry_after_s = retry_after_s  # when to try again, for Overloaded


class PayloadTooLarge(ServiceError):
    """A body, message or decoded image over its limit."""


class UnsupportedMediaType(ServiceError):
    """Not an image format the service decodes, or a request type it does not take."""


class InvalidInput(ServiceError):
    """Undecodable image, bad parameters or tensors, too many or no images."""


class Unauthorized(ServiceError):
    """API key missing or wrong."""


class ModelNotFound(ServiceError):
    """A model name (or version) that this service does not serve."""


class Overloaded(ServiceError):
    """The queue is full; `retry_after_s` says when it has likely cleared."""


class NotReady(ServiceError):
    """Not loaded yet, or draining for shutdown."""


class Draining(NotReady):
    """Shutting down: a request that came after the drain began, or one still running when it ran out. Over HTTP
    its answer closes the connection (`Connection: close`), so a client's next request opens one to another
    replica."""


NOT_READY = "not ready: the models are not loaded yet or the service is draining; retry shortly"
LOADING = "not ready: the models are loading; retry shortly"
DRAINING = "draining: this server is shutting down; retry on another replica"
DRAIN_TIMED_OUT = "draining: not finished within VIT_DRAIN_TIMEOUT_S; retry on another replica"
TIMED_OUT = "the request was not answered within VIT_REQUEST_TIMEOUT_S; retry or send fewer images"


class RequestTimeout(ServiceError):
    """Not answered within the request's deadline."""


class InferenceFailed(ServiceError):
    """The forward pass failed for an image even on its own (a server fault, not bad input)."""


class LoadFailed(ServiceError):
    """A checkpoint the repository holds that did not load (any version already serving goes on serving)."""


class NotAllowed(ServiceError):
    """A repository change this server's VIT_MODEL_CONTROL does not take (load and unload are for explicit)."""


class AlreadyExists(ServiceError):
    """A name already taken, such as a shared-memory region's."""


class RegionNotFound(ServiceError):
    """No shared-memory region of that name is registered."""


class NotSupported(ServiceError):
    """A protocol feature this server does not offer (CUDA shared memory), or one turned off."""


def validation_problems(problems: Iterable[Mapping[str, Any]]) -> str:
    """A validator's problems (pydantic's `errors()`) in one line: each where it is, then what is wrong; a problem
    with the whole document (not JSON, say) names no place, and where it came from (query, body) is left out."""
    said = []
    for problem in problems:
        where = ".".join(str(part) for part in problem["loc"] if part not in ("query", "body"))
        said.append(f"{where}: {problem['msg']}" if where else str(problem["msg"]))
    return "; ".join(said)
