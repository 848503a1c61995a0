"""Pages for people: the try-it page at `/` and the API docs, with every asset served by the app itself.

FastAPI's default `/docs` loads its script and stylesheet from a CDN and renders blank without
internet. Here it is built with FastAPI's self-hosting hook (`get_swagger_ui_html`) over the
Swagger UI files that the `fastapi-offline` package ships. ReDoc is left out: its bundle always
loads the Redocly logo from cdn.redoc.ly.
"""

from __future__ import annotations

from pathlib import Path

import fastapi_offline
from fastapi import APIRouter, FastAPI, Request
from fastapi.openapi.docs import get_swagger_ui_html, get_swagger_ui_oauth2_redirect_html
from fastapi.responses import FileResponse, HTMLResponse
from fastapi.staticfiles import StaticFiles

PAGE_DIR = Path(__file__).resolve().parent / "static"
DOCS_ASSETS_DIR = Path(fastapi_offline.__file__).resolve().parent / "static"
PAGE_ASSETS = "/assets"
DOCS_ASSETS = "/docs-assets"

router = APIRouter(include_in_schema=False)


@router.get("/")
async def index() -> FileResponse:
    """The page to try the model: upload images, see classes and where the model looked."""
    return FileResponse(PAGE_DIR / "index.html", media_type="text/html")


@router.get("/docs")
async def swagger_ui(request: Request) -> HTMLResponse:
    """Swagger UI for the OpenAPI schema, from local assets."""
    root = request.scope.get("root_path", "")
    return get_swagger_ui_html(
        openapi_url=f"{root}{request.app.openapi_url}",
        title=f"{request.app.title} - API docs",
        oauth2_redirect_url=f"{root}/docs/oauth2-redirect",
        swagger_js_url=f"{root}{DOCS_ASSETS}/swagger-ui-bundle.js",
        swagger_css_url=f"{root}{DOCS_ASSETS}/swagger-ui.css",
        swagger_favicon_url=f"{root}{DOCS_ASSETS}/favicon.png",
    )


@router.get("/docs/oauth2-redirect")
async def swagger_ui_redirect() -> HTMLResponse:
    return get_swagger_ui_oauth2_redirect_html()


def install_pages(app: FastAPI) -> None:
    """Mount the page, the docs and their static files (create the app with docs_url=None and redoc_url=None)."""
    app.include_router(router)
    app.mount(PAGE_ASSETS, StaticFiles(directory=PAGE_DIR), name="assets")
    app.mount(DOCS_ASSETS, StaticFiles(directory=DOCS_ASSETS_DIR), name="docs-assets")
