"""What the routes depend on: the data plane, ready, and an authorized caller, written once for every router."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request
from starlette.datastructures import Headers

from app.core.contract.errors import DRAINING, NOT_READY, Draining, NotReady
from app.core.data_plane import DataPlane


def credentials(headers: Headers) -> str:
    """The API key a request carries: X-API-Key, or Authorization: Bearer KEY."""
    given = headers.get("x-api-key") or headers.get("authorization", "")
    return given.removeprefix("Bearer ").strip()


# Dependencies are async on purpose: FastAPI runs plain `def` dependencies on a thread pool, a thread hop per
# request each (docs/performance.md).
async def data_plane(request: Request) -> DataPlane:
    plane: DataPlane = request.app.state.data_plane
    return plane


async def serving_data_plane(plane: Annotated[DataPlane, Depends(data_plane)]) -> DataPlane:
    """The data plane, while it takes requests; NotReady before the models are loaded and once it has stopped."""
    plane.check_serving()
    return plane


async def ready_data_plane(plane: Annotated[DataPlane, Depends(data_plane)]) -> DataPlane:
    """For readiness probes: NotReady before the models are loaded, Draining from the start of shutdown."""
    if not plane.ready():
        raise Draining(DRAINING) if plane.draining else NotReady(NOT_READY)
    return plane


async def authorized_data_plane(request: Request) -> DataPlane:
    """The data plane for inference and model changes: while it takes requests (NotReady otherwise), and with
    VIT_API_KEYS set, for a caller with a matching key. One dependency, not a chain: FastAPI resolves each
    link on every request."""
    plane = await data_plane(request)
    plane.check_serving()
    plane.authorize(credentials(request.headers))
    return plane


Plane = Annotated[DataPlane, Depends(data_plane)]
AuthorizedPlane = Annotated[DataPlane, Depends(authorized_data_plane)]
ServingPlane = Annotated[DataPlane, Depends(serving_data_plane)]
ReadyPlane = Annotated[DataPlane, Depends(ready_data_plane)]
