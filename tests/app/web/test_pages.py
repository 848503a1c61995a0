"""The page at / and offline /docs as the app serves them: no other host referenced, out of the API schema."""

from __future__ import annotations

import re

import httpx

from app.web.pages import PAGE_DIR

URL = re.compile(r"""(?:https?:)?//[A-Za-z0-9.-]+""")


async def test_page_and_its_assets_reference_no_other_host(client: httpx.AsyncClient) -> None:
    r = await client.get("/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    for name in ("index.html", "app.js", "style.css"):
        assert not URL.findall((PAGE_DIR / name).read_text()), name
    for asset, kind in (("/assets/app.js", "javascript"), ("/assets/style.css", "text/css")):
        r = await client.get(asset)
        assert r.status_code == 200 and kind in r.headers["content-type"]


async def test_docs_load_their_assets_from_this_service(client: httpx.AsyncClient) -> None:
    r = await client.get("/docs")
    assert r.status_code == 200
    referenced = set(re.findall(r"""(?:src|href)=["']?([^"' >]+)""", r.text))
    assert referenced == {
        "/docs-assets/swagger-ui-bundle.js",
        "/docs-assets/swagger-ui.css",
        "/docs-assets/favicon.png",
    }
    for asset in referenced:
        assert (await client.get(asset)).status_code == 200
    assert (await client.get("/redoc")).status_code == 404  # ReDoc's bundle would call out to its CDN


async def test_pages_stay_out_of_the_api_schema(client: httpx.AsyncClient) -> None:
    paths = (await client.get("/openapi.json")).json()["paths"]
    assert not {"/", "/docs"} & set(paths)


# In a real browser.
