"""What the routes depend on: the ready service and a valid API key, written once for every router."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from app.core.errors import NotReady
from app.core.service import NOT_READY, Service


# Dependencies are async on purpose: FastAPI runs plain `def` dependencies on a thread pool, two
# thread hops per request that showed up as 15 % of the event loop's time under load.
async def ready_service(request: Request) -> Service:
    """The service, once every model is loaded and warm; NotReady before that and while draining."""
    service: Service | None = request.app.state.service
    if service is None:
        raise NotReady(NOT_READY)
    service.check_ready()
    return service


async def check_api_key(request: Request, service: Annotated[Service, Depends(ready_service)]) -> None:
    """With VIT_API_KEYS set, inference needs a matching X-API-Key (or Authorization: Bearer) header."""
    if service.api_keys.required:
        given = request.headers.get("x-api-key") or request.headers.get("authorization", "")
        service.api_keys.check(given.removeprefix("Bearer ").strip())


ReadyService = Annotated[Service, Depends(ready_service)]
ApiKey = Depends(check_api_key)
